"""`dpstream plan --sample`: the utility preview on a sample built by hand (docs/plan.md, "A
utility preview on your own data"). The sample covers 25 minutes of a one-hour window; its
record counts per user and its distinct users per key are known by construction, so the dropped
share and the bucket counts are checked against hand counts."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import dpstream
from dpstream.processor.cli import main

START = 1_767_225_600_000  # 2026-01-01T00:00:00Z
MINUTE = 60_000

CONFIG = """
queries:
  - name: clicks
    key_fields: [key]
    contribution_bound: {C}
    window: 1h
    triggers: 6
    epsilon: 8.0
    delta: 1.0e-6
    counter: tree
"""

#: keys and their distinct users: one key per bucket (1-9 has two)
KEY_USERS = {"k1500": 1500, "k300": 300, "k50": 50, "k5": 5, "k2": 2}
#: users 0..9 add i + 1 more records on k1500 (the heavy users C = 3 cuts)
EXTRA = {i: i + 1 for i in range(10)}
#: a key of 8 users with 2 records each: 16 records, but in the 1-9 bucket (distinct users)
TWICE = ("k8", 8)


def write_sample(path: Path) -> list[dict]:
    """Users 0..n-1 of each key (KEY_USERS), plus EXTRA, at times spread over minutes 0-25."""
    records = []
    for key, n in KEY_USERS.items():
        records += [{"user_id": f"user-{u}", "key": key} for u in range(n)]
    for u, extra in EXTRA.items():
        records += [{"user_id": f"user-{u}", "key": "k1500"} for _ in range(extra)]
    records += [{"user_id": f"user-{u}", "key": TWICE[0]} for u in range(TWICE[1]) for _ in range(2)]
    rng = np.random.default_rng(5)
    times = np.sort(rng.integers(0, 25 * MINUTE, size=len(records)))
    order = rng.permutation(len(records))
    events = [{**records[i], "ts": START + int(t)} for i, t in zip(order.tolist(), times.tolist())]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return events


@pytest.fixture(scope="module")
def previewed(tmp_path_factory):
    """One CLI run with --json and --plot, from an empty working directory, with a noise key in
    the environment that must not be read."""
    work = tmp_path_factory.mktemp("preview")
    sample = work / "sample.jsonl"
    events = write_sample(sample)
    config = work / "q.yaml"
    config.write_text(CONFIG.format(C=3))
    run_dir = work / "run"
    run_dir.mkdir()
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(run_dir)
    os.environ["DPSTREAM_NOISE_KEY"] = "not a usable key"  # reading it would fail the run
    os.environ["DPSTREAM_NOISE_KEY_FILE"] = str(work / "missing.key")
    try:
        import dpstream.processor.mechanisms.noise as noise_module

        def refuse(*args, **kwargs):
            raise AssertionError("the preview read the configured noise secret")

        original, noise_module.load_noise_secret = noise_module.load_noise_secret, refuse
        try:
            import contextlib
            import io

            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(["plan", "--config", str(config), "--sample", str(sample), "--plot", "preview.png", "--json"])
        finally:
            noise_module.load_noise_secret = original
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
    assert code == 0, err.getvalue()
    return {"doc": json.loads(out.getvalue()), "err": err.getvalue(), "events": events, "run_dir": run_dir}


def test_dropped_share_equals_a_hand_count(previewed):
    (q,) = previewed["doc"]["preview"]["queries"]
    per_user: dict = {}
    for e in previewed["events"]:
        per_user[e["user_id"]] = per_user.get(e["user_id"], 0) + 1
    dropped = sum(max(0, n - 3) for n in per_user.values())
    assert dropped > 0
    assert q["dropped_by_contribution_bound"] == dropped
    assert q["dropped_share_by_contribution_bound"] == pytest.approx(dropped / len(previewed["events"]))
    assert q["events"] == len(previewed["events"])


def test_bucket_counts_equal_a_hand_count(previewed):
    (q,) = previewed["doc"]["preview"]["queries"]
    buckets = {b["users"]: b for b in q["error_by_users"]}
    assert list(buckets) == ["1-9", "10-99", "100-999", "1000+"]
    # by construction: k8, k5 and k2 | k50 | k300 | k1500 (distinct users, not records: k8 has 16)
    assert [b["keys"] for b in buckets.values()] == [3, 1, 1, 1]
    # a key of 1500 users is released at epsilon 8 and C 3, close to its true count
    top = buckets["1000+"]
    assert top["released"] == 1
    assert top["median_rel_error"] < 0.1 and top["median_abs_error"] is not None
    assert buckets["1-9"]["released"] == 0 and buckets["1-9"]["median_abs_error"] is None
    assert all(b["released"] <= b["keys"] for b in buckets.values())


def test_a_sample_shorter_than_a_window_fires_its_triggers(previewed):
    """25 minutes of a 1h window with T 6: triggers 1-3 hold the sample; the replay runs to the
    window's end, so the last of them fired and released keys."""
    doc = previewed["doc"]["preview"]
    (q,) = doc["queries"]
    assert doc["until"] == START + 3_600_000 + 60_000  # the window's end plus allowed_lateness 1m
    k = q["keys_released_per_trigger"]
    assert len(k["series"]) == 3 == q["triggers"] and q["windows"] == 1
    assert k["max"] >= 1 and sum(k["series"]) >= 2
    assert k["last"] == k["series"][-1]


def test_publishes_nothing_and_writes_only_the_plot(previewed):
    assert sorted(p.name for p in previewed["run_dir"].iterdir()) == ["preview.png"]
    data = (previewed["run_dir"] / "preview.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(previewed["run_dir"] / "preview.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert "throwaway" in previewed["doc"]["preview"]["secret"]
    assert "not differentially private" in previewed["doc"]["preview"]["note"]


def test_missing_sample_is_one_line_and_exit_2(tmp_path, capsys):
    config = tmp_path / "q.yaml"
    config.write_text(CONFIG.format(C=3))
    assert main(["plan", "--config", str(config), "--sample", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--sample" in err and "none.jsonl" in err and "Traceback" not in err


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    config = tmp_path / "q.yaml"
    config.write_text(CONFIG.format(C=3))
    sample = tmp_path / "s.jsonl"
    write_sample(sample)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["plan", "--config", str(config), "--sample", str(sample), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and not (tmp_path / "p.png").exists()


def _sample(path: Path, per_user: list[list[str]]) -> None:
    lines, t = [], START
    for u, keys in enumerate(per_user):
        for key in keys:
            lines.append(json.dumps({"user_id": f"u{u}", "key": key, "ts": t}))
            t += 1000
    path.write_text("\n".join(lines) + "\n")


def test_suggested_c_is_the_smallest_when_nobody_is_cut(tmp_path):
    """One record per user: no candidate drops anything, and noise grows with C."""
    sample = tmp_path / "s.jsonl"
    _sample(sample, [[f"k{u % 3}"] for u in range(900)])
    report = dpstream.preview({"queries": [_query(C=3)]}, sample)
    s = report["queries"][0]["suggested_contribution_bound"]
    assert [r["C"] for r in s["candidates"]] == [1, 3]
    assert s["value"] == 1 and all(r["dropped_share"] == 0 for r in s["candidates"])


def test_suggested_c_keeps_every_record_when_cutting_loses_whole_keys(tmp_path):
    """Each of 400 users adds one record to each of four keys, in the order A, B, C, D: C = 3
    (the config's) drops every D (a quarter of the records), C = 4 drops nothing."""
    sample = tmp_path / "s.jsonl"
    _sample(sample, [["kA", "kB", "kC", "kD"] for _ in range(400)])
    report = dpstream.preview({"queries": [_query(C=3)]}, sample)
    (q,) = report["queries"]
    s = q["suggested_contribution_bound"]
    rows = {r["C"]: r for r in s["candidates"]}
    assert sorted(rows) == [3, 4]
    assert rows[3]["dropped_share"] == pytest.approx(0.25) and rows[4]["dropped_share"] == 0
    assert s["value"] == 4
    assert q["dropped_share_by_contribution_bound"] == pytest.approx(0.25)  # the pipeline's own count agrees


def _query(C: int) -> dict:
    return {"name": "clicks", "key_fields": ["key"], "contribution_bound": C, "window": "1h", "triggers": 6,
            "epsilon": 8.0, "delta": 1e-6, "counter": "tree"}
