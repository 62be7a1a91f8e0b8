"""`dpstream demo` explains its numbers (issue 32): raw count, bounded truth, published value and
interval, with bias (bounded - raw) and noise (published - bounded) apart; --noise-label repeats a run."""
from __future__ import annotations

import io
import json
from collections import Counter

import numpy as np
import pytest

from dpstream.processor.cli import main
from dpstream.processor.demo import run_demo
from dpstream.processor.mechanisms.noise import SECRET_ENV, SECRET_FILE_ENV, NodeNoise

# small enough to run in about a second; C = 4 so that bounding drops records of the top pages
SMALL = dict(users=3_000, keys=300, triggers=4, contribution_bound=4)
SMALL_ARGS = ["--users", "3000", "--keys", "300", "--triggers", "4"]
SECRET_HEX = "5f" * 8 + "a3c19e0b7d2846f1" * 3


def independent_counts(events_path, C: int, triggers: int) -> tuple[Counter, Counter]:
    """Raw and bounded records per (page, trigger), counted line by line: each user's first C
    records of the (one-day) window are kept."""
    interval = 86_400_000 // triggers
    raw, bounded, per_user = Counter(), Counter(), Counter()
    with open(events_path) as fh:
        for line in fh:
            event = json.loads(line)
            trigger = (event["ts"] % 86_400_000) // interval + 1
            raw[event["key"], trigger] += 1
            per_user[event["user_id"]] += 1
            if per_user[event["user_id"]] <= C:
                bounded[event["key"], trigger] += 1
    return raw, bounded


def up_to(counts: Counter, page: str, trigger: int) -> int:
    return sum(counts[page, t] for t in range(1, trigger + 1))


def final_releases(path) -> dict[str, dict]:
    final = {}
    with open(path) as fh:
        for line in fh:
            record = json.loads(line)
            final[record["key"]] = record
    return final


def test_printed_bounded_truth_is_an_independent_count_of_bounded_records(tmp_path):
    out = io.StringIO()
    result = run_demo(**SMALL, output_dir=str(tmp_path), out=out, log=io.StringIO())
    raw, bounded = independent_counts(tmp_path / "events.jsonl", SMALL["contribution_bound"], SMALL["triggers"])
    rows = result["pages"]
    assert len(rows) == 5
    assert any(r["bias"] < 0 for r in rows)  # bounding matters on these pages: the test can tell raw from bounded
    printed = out.getvalue()
    for r in rows:
        assert r["raw"] == up_to(raw, r["page"], r["trigger"])
        assert r["bounded"] == up_to(bounded, r["page"], r["trigger"])
        # bias and noise are shown apart and add up to published - raw exactly
        assert r["bias"] == r["bounded"] - r["raw"] and r["noise"] == r["published"] - r["bounded"]
        assert r["bias"] + r["noise"] == r["published"] - r["raw"]
        line = next(x for x in printed.splitlines() if x.split()[:1] == [r["page"]])
        assert line.split() == [r["page"], str(r["trigger"]), f"{r['raw']:,}", f"{r['bounded']:,}", f"{r['published']:,}",
                                f"[{r['ci95'][0]:,},", f"{r['ci95'][1]:,}]", f"{r['bias']:+,}", f"{r['noise']:+,}"]
    assert "bias = bounded - raw" in printed and "noise = published - bounded" in printed
    assert "not private" in printed


def test_bounded_truth_is_what_the_noise_is_added_to(tmp_path, monkeypatch):
    """The code has no noise-free path, so the PRF's node noise is set to zero here: every
    released count is then exactly the demo's bounded truth at its trigger, for every page."""
    def no_noise(self, sampler, trees, *rest):
        return np.zeros(len(rest[-1]), dtype=np.int64)

    monkeypatch.setattr(NodeNoise, "sample", no_noise)
    monkeypatch.setattr(NodeNoise, "sample_indexed", no_noise)
    result = run_demo(**SMALL, output_dir=str(tmp_path), out=io.StringIO(), log=io.StringIO())
    rows = result["pages"]
    assert rows[0]["bias"] < 0 and all(r["noise"] == 0 and r["published"] == r["bounded"] for r in rows)
    _, bounded = independent_counts(tmp_path / "events.jsonl", SMALL["contribution_bound"], SMALL["triggers"])
    final = final_releases(tmp_path / "releases.jsonl")
    assert len(final) > 5
    assert {k: r["count"] for k, r in final.items()} == {k: up_to(bounded, k, r["trigger"]) for k, r in final.items()}


def demo_stdout(capsys, *args: str) -> str:
    assert main(["demo", *SMALL_ARGS, *args]) == 0
    return capsys.readouterr().out


def table(printout: str) -> list[str]:
    return [line for line in printout.splitlines() if line.lstrip().startswith("page-")]


def test_noise_label_with_the_same_secret_repeats_exactly(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, SECRET_HEX)
    first = demo_stdout(capsys, "--noise-label", "demo-a")
    assert first == demo_stdout(capsys, "--noise-label", "demo-a")
    assert table(first) and table(first) != table(demo_stdout(capsys, "--noise-label", "demo-b"))
    # the same secret from a file (as replay's --noise-key-file) gives the same noise
    key_file = tmp_path / "noise.key"
    key_file.write_text(SECRET_HEX + "\n")
    key_file.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    monkeypatch.delenv(SECRET_ENV)
    assert table(demo_stdout(capsys, "--noise-label", "demo-a", "--noise-key-file", str(key_file))) == table(first)


def test_without_a_secret_there_is_no_repeatability_hint_and_no_label(capsys, monkeypatch):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    printout = demo_stdout(capsys)
    assert "one-off random noise secret" in printout and "DPSTREAM_NOISE_KEY" not in printout
    assert main(["demo", *SMALL_ARGS, "--noise-label", "x"]) == 2
    err = capsys.readouterr().err
    assert "--noise-label" in err and "noise secret" in err


@pytest.mark.parametrize("bad", ["not a key", "00" * 4])
def test_a_bad_configured_secret_is_an_error_not_a_silent_one_off(capsys, monkeypatch, bad):
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, bad)
    assert main(["demo", *SMALL_ARGS]) == 2
    assert SECRET_ENV in capsys.readouterr().err


def test_an_epsilon_too_large_is_one_line_naming_the_option(capsys, monkeypatch):
    """`dpstream demo --epsilon 1000` was a traceback (BudgetError from the accountant): the demo's
    query is made of its options, so the error names ``--epsilon`` and the largest that works."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert main(["demo", *SMALL_ARGS, "--epsilon", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpstream: --epsilon 1000: ") and "set epsilon below" in err and "Traceback" not in err
