"""Replay resume checks its input (issue 32, item 7; docs/user-guide.md, "Resuming and appending").

A state directory resumed with another file used to skip that file's first N lines (N: the lines
consumed before), silently: all 300 lines of a new file were ignored with "0 events". The state
now keeps a fingerprint of the lines it consumed; a resume with another file, or with the same
file edited, is refused before anything is read, republished or charged, naming the state
directory; the same file, grown, resumes; ``--append`` reads another file as the stream's
continuation."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from dpstream.processor.adapters.replay import ReplayError, ReplayRunner
from dpstream.processor.cli import main
from dpstream.processor.config import BudgetConfig, BudgetLimit, DpstreamConfig
from dpstream.processor.engine.budget import LEDGER_STORE
from dpstream.state.store import PartitionStores, WriteBatch
from dpstream.state.tables import TextMark
from tests.conftest import TEST_LABEL, TEST_SECRET
from tests.privacy._helpers import DAY, START, Run, events, query, replay, secret_file, write_jsonl


def config() -> DpstreamConfig:
    return DpstreamConfig(queries=[query()])


def budget_config() -> DpstreamConfig:
    limit = BudgetLimit(max_epsilon=6.0 * 10, max_delta=1e-9 * 10)
    return DpstreamConfig(queries=[query()], budget=BudgetConfig(default=limit))


def day_rows(seed: int, day: int = 0, records: int = 2000) -> list[dict]:
    return events(np.random.default_rng(seed), users=200, records=records, start=START + day * DAY, prefix=f"d{day}u")


def state_contents(state_dir) -> dict:
    """Every key and value of the state directory's stores (the replay's and the ledger's)."""
    stores = PartitionStores(state_dir)
    try:
        return {name: dict(stores.store(name).scan_prefix(b"")) for name in (0, LEDGER_STORE)}
    finally:
        stores.close()


def refused(config, input_path, state_dir, **kw) -> str:
    with pytest.raises(ReplayError) as exc:
        replay(config, input_path, state_dir=state_dir, **kw)
    return str(exc.value)


def test_the_same_file_resumed_equals_an_uninterrupted_run(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", day_rows(1))
    whole = replay(config(), path, state_dir=tmp_path / "whole")
    first = replay(config(), path, state_dir=tmp_path / "part", stop_after=700)
    rest = replay(config(), path, state_dir=tmp_path / "part")
    assert first.summary.stopped_early and rest.summary.lines == 2000
    assert first.output + rest.output == whole.output and whole.records


def test_the_same_file_grown_resumes_where_it_stopped(tmp_path):
    rows = day_rows(2)
    grown = write_jsonl(tmp_path / "e.jsonl", rows)
    whole = replay(config(), grown, state_dir=tmp_path / "whole")
    write_jsonl(tmp_path / "e.jsonl", rows[:1200])  # the file as it was when the first run read it
    first = replay(config(), tmp_path / "e.jsonl", state_dir=tmp_path / "part", stop_after=1000)
    write_jsonl(tmp_path / "e.jsonl", rows)  # it grew since
    rest = replay(config(), tmp_path / "e.jsonl", state_dir=tmp_path / "part")
    assert first.output + rest.output == whole.output


def test_a_last_line_without_its_newline_matches_once_the_file_grew(tmp_path):
    rows = day_rows(3, records=300)
    path = tmp_path / "e.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:200]))  # no newline after line 200
    replay(config(), path, state_dir=tmp_path / "s")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rest = replay(config(), path, state_dir=tmp_path / "s")
    # lines 201-300 read, none of the first 200 again
    assert rest.summary.lines == 300 and rest.stats[0].events_in == 100


def test_another_file_is_refused_naming_the_state_directory_and_changes_nothing(tmp_path):
    """The trial's case: a new 300-line file on a state directory that had consumed more."""
    state = tmp_path / "s"
    first_input = write_jsonl(tmp_path / "a.jsonl", day_rows(4))
    replay(config(), first_input, state_dir=state, stop_after=1000)
    before = state_contents(state)
    other = write_jsonl(tmp_path / "b.jsonl", day_rows(5, records=300))
    message = refused(config(), other, state)
    assert str(state) in message and "a.jsonl" in message and "--state-dir" in message and "--append" in message
    assert "has only 300 lines" in message
    longer = write_jsonl(tmp_path / "c.jsonl", day_rows(6))
    assert "differs from it in its first 1,000 lines" in refused(config(), longer, state)
    assert state_contents(state) == before
    # still resumable with its own input
    assert replay(config(), first_input, state_dir=state).summary.lines == 2000


def test_a_file_with_one_line_edited_in_the_consumed_part_is_refused(tmp_path):
    rows = day_rows(7)
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    replay(config(), path, state_dir=tmp_path / "s", stop_after=1000)
    before = state_contents(tmp_path / "s")
    edited = [dict(r) for r in rows]
    edited[500]["key"] = "k-edited"
    write_jsonl(path, edited)
    assert str(tmp_path / "s") in refused(config(), path, tmp_path / "s")
    assert state_contents(tmp_path / "s") == before
    # an edit after the consumed lines is input not yet read: accepted
    edited = [dict(r) for r in rows]
    edited[1500]["key"] = "k-edited"
    write_jsonl(path, edited)
    assert replay(config(), path, state_dir=tmp_path / "s").summary.lines == 2000


def test_a_state_directory_without_a_fingerprint_resumes_with_a_warning(tmp_path):
    """Written before fingerprints were kept: resumed as before (nothing to check against), and
    fingerprinted from then on."""
    rows = day_rows(15)
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    whole = replay(config(), path, state_dir=tmp_path / "whole")
    first = replay(config(), path, state_dir=tmp_path / "s", stop_after=700)
    stores = PartitionStores(tmp_path / "s")
    try:
        batch = WriteBatch()
        batch.delete(TextMark(stores.store(0), b"input-prefix").key)
        stores.store(0).write(batch)
    finally:
        stores.close()
    log = io.StringIO()
    runner = ReplayRunner(config(), TEST_SECRET, str(tmp_path / "s"), log=log, noise_label=TEST_LABEL)
    out = io.StringIO()
    try:
        runner.run(str(path), out, stop_after_lines=1400)
    finally:
        runner.close()
    assert "has no fingerprint of its input" in log.getvalue() and str(tmp_path / "s") in log.getvalue()
    rest = replay(config(), path, state_dir=tmp_path / "s")
    assert first.output + out.getvalue() + rest.output == whole.output
    assert "has only 300 lines" in refused(config(), write_jsonl(tmp_path / "b.jsonl", rows[:300]), tmp_path / "s")


def test_the_refusal_comes_before_any_budget_is_charged(tmp_path):
    """Exact: the ledger (and the whole state) is byte for byte what the stopped run left, while
    the same resume with the right input does charge the windows up to --until."""
    rows = day_rows(8) + day_rows(9, day=1)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    until = START + 3 * DAY
    first = replay(budget_config(), path, state_dir=tmp_path / "s", start_ms=START, until_ms=until, stop_after=500)
    assert sorted(first.charges) == ["clicks:1795132800000"]
    before = state_contents(tmp_path / "s")
    other = write_jsonl(tmp_path / "b.jsonl", day_rows(10, day=1))
    refused(budget_config(), other, tmp_path / "s", start_ms=START, until_ms=until)
    assert state_contents(tmp_path / "s") == before
    rest = replay(budget_config(), path, state_dir=tmp_path / "s", start_ms=START, until_ms=until)
    assert sorted(rest.charges) == [f"clicks:{START + d * DAY}" for d in range(3)]


def test_append_reads_another_file_as_the_continuation_of_the_stream(tmp_path):
    """Day 1 to a public end, then day 2 appended: the releases of one run over both days."""
    day1, day2 = day_rows(11), day_rows(12, day=1)
    day2[10] = {"user_id": "u-bad", "ts": day2[10]["ts"]}  # no key: reported by its stream line number
    both = write_jsonl(tmp_path / "both.jsonl", day1 + day2)
    whole = replay(config(), both, state_dir=tmp_path / "whole", until_ms=START + 2 * DAY)
    first_day = write_jsonl(tmp_path / "day1.jsonl", day1)
    second_day = write_jsonl(tmp_path / "day2.jsonl", day2)
    first = replay(config(), first_day, state_dir=tmp_path / "s", until_ms=START + DAY)
    second = _replay_appending(second_day, tmp_path / "s", until_ms=START + 2 * DAY)
    assert second.summary.lines == 4000 and second.stats[0].events_in == 1999  # every valid line of day 2
    assert first.output + second.output == whole.output
    assert [d["source"] for d in second.dead] == ["line 2011"] == [d["source"] for d in whole.dead]
    # the fingerprint now covers day 2: day 1 without --append is another file
    assert "day2.jsonl" in refused(config(), first_day, tmp_path / "s")
    assert replay(config(), second_day, state_dir=tmp_path / "s").summary.lines == 4000


def _replay_appending(input_path, state_dir, until_ms):
    runner = ReplayRunner(config(), TEST_SECRET, str(state_dir), log=io.StringIO(), noise_label=TEST_LABEL)
    out, dead = io.StringIO(), io.StringIO()
    try:
        summary = runner.run(str(input_path), out, dead_letters=dead, until_ms=until_ms, append=True)
        stats = [p.stats for p in runner.pipelines]
    finally:
        runner.close()
    return Run(out.getvalue(), dead.getvalue(), summary, stats)


def test_cli_refuses_another_file_with_exit_code_2_and_one_line_leaving_outputs_alone(tmp_path, capsys):
    cfg = tmp_path / "q.yaml"
    cfg.write_text("queries:\n  - {name: clicks, window: 1d, triggers: 24, contribution_bound: 4, epsilon: 6, delta: 1e-9}\n")
    key = secret_file(tmp_path)
    first_input = write_jsonl(tmp_path / "a.jsonl", day_rows(13))
    other = write_jsonl(tmp_path / "b.jsonl", day_rows(14, records=300))
    out, dead, state = tmp_path / "out.jsonl", tmp_path / "dead.jsonl", tmp_path / "state"
    common = ["--config", str(cfg), "--output", str(out), "--dead-letter", str(dead), "--state-dir", str(state),
              "--noise-key-file", str(key), "--quiet"]
    assert main(["replay", "--input", str(first_input), "--stop-after-lines", "1500", *common]) == 0
    written = out.read_bytes(), dead.read_bytes()
    capsys.readouterr()
    assert main(["replay", "--input", str(other), *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpstream: --input: state directory ") and str(state) in err[0]
    assert (out.read_bytes(), dead.read_bytes()) == written
    # --append reads the other file from its first line, after the 1,500 lines consumed
    assert main(["replay", "--input", str(other), "--append", *common]) == 0
    assert "replay: 1,800 lines" in capsys.readouterr().err
    assert main(["replay", "--input", str(tmp_path / "missing.jsonl"), *common]) == 2
    assert capsys.readouterr().err == f"dpstream: --input: {tmp_path / 'missing.jsonl'}: no such file\n"
