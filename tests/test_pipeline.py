"""The pipeline and the replay runner: determinism, recovery, bounding, privacy smoke, prediction."""
import gzip
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.cli import main
from dpstream.processor.config import DpstreamConfig, QueryConfig
from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from tests.conftest import TEST_LABEL, TEST_SECRET, TEST_SECRET_HEX

DAY = 86_400_000
START = 1_795_132_800_000  # a UTC midnight


def small_query(**overrides) -> QueryConfig:
    fields = dict(name="clicks", window="1d", triggers=24, contribution_bound=4, epsilon=6.0, delta=1e-9, allowed_lateness="0s")
    fields.update(overrides)
    return QueryConfig(**fields)


def make_events(rng, users=400, keys=30, records=3000, start=START, span=DAY):
    """Popular keys (many users) plus a tail; events in time order."""
    user = rng.integers(0, users, records)
    key = np.minimum(rng.geometric(0.15, records) - 1, keys - 1)
    ts = np.sort(start + rng.integers(0, span, records))
    return [{"user_id": f"u{u}", "key": f"k{k}", "ts": int(t)} for u, k, t in zip(user, key, ts)]


def write_jsonl(path, events, extra_lines=()):
    with open(path, "w") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")
    return path


def replay(config, input_path, state_dir=None, stop_after=None, output=None):
    runner = ReplayRunner(config, TEST_SECRET, state_dir, log=io.StringIO(), noise_label=TEST_LABEL)
    out = output if output is not None else io.StringIO()
    try:
        summary = runner.run(str(input_path), out, stop_after_lines=stop_after)
        stats = runner.pipelines[0].stats
    finally:
        runner.close()
    return (out.getvalue() if output is None else None), summary, stats


def test_replay_is_byte_identical(tmp_path, rng):
    config = DpstreamConfig(queries=[small_query()])
    path = write_jsonl(tmp_path / "e.jsonl", make_events(rng))
    first, summary, _ = replay(config, path)
    second, _, _ = replay(config, path)
    assert first == second
    assert summary.releases > 0 and first.count("\n") == summary.releases
    record = json.loads(first.splitlines()[0])
    assert set(record) >= {"query", "window_start", "window_end", "trigger", "key", "count", "stddev", "epsilon", "delta"}
    assert "user_id" not in first and '"u1' not in first  # never user ids


def test_gzip_input_and_cli(tmp_path, rng, monkeypatch):
    events = make_events(rng, records=500)
    gz = tmp_path / "e.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in events)
    cfg = tmp_path / "q.yaml"
    cfg.write_text("queries:\n  - {name: clicks, window: 1d, triggers: 24, contribution_bound: 4, epsilon: 6.0, delta: 1.0e-9}\n")
    monkeypatch.delenv("DPSTREAM_NOISE_KEY", raising=False)
    monkeypatch.delenv("DPSTREAM_NOISE_KEY_FILE", raising=False)
    # no secret: releasing fails clearly
    assert main(["replay", "--config", str(cfg), "--input", str(gz), "--output", str(tmp_path / "o.jsonl"), "--quiet"]) == 2
    key_file = tmp_path / "key"
    key_file.write_text(TEST_SECRET_HEX)
    key_file.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    assert main(["replay", "--config", str(cfg), "--input", str(gz), "--output", str(tmp_path / "o.jsonl"), "--quiet",
                 "--noise-key-file", str(key_file), "--noise-label", TEST_LABEL]) == 0
    plain = write_jsonl(tmp_path / "e.jsonl", events)
    expected, _, _ = replay(DpstreamConfig(queries=[small_query(allowed_lateness="1m")]), plain)
    assert (tmp_path / "o.jsonl").read_text() == expected


def test_resumed_run_equals_uninterrupted(tmp_path, rng):
    config = DpstreamConfig(queries=[small_query()])
    events = make_events(rng, records=4000)
    path = write_jsonl(tmp_path / "e.jsonl", events)
    whole, _, _ = replay(config, path, state_dir=tmp_path / "whole")
    out = tmp_path / "resumed.jsonl"
    with open(out, "w") as fh:
        _, first, _ = replay(config, path, state_dir=tmp_path / "state", stop_after=1234, output=fh)
    assert first.stopped_early
    with open(out, "a") as fh:  # a new process: state reopened from RocksDB
        replay(config, path, state_dir=tmp_path / "state", output=fh)
    assert out.read_text() == whole


def test_no_user_exceeds_c_even_with_duplicated_lines_and_replayed_batches(rng):
    query = small_query(contribution_bound=3)
    store = MemoryStore()
    noise = NodeNoise(TEST_SECRET)
    pseudo = Pseudonymizer(TEST_SECRET)
    pipe = QueryPipeline(query, noise, store)
    events = make_events(rng, users=50, records=2000, span=DAY // 2)
    events = events + events  # every line twice
    cols = EventColumns(pseudo.users([e["user_id"] for e in events]), np.array([e["key"] for e in events], dtype=object),
                        pseudo.group_keys([e["key"] for e in events]), np.ones(len(events)), np.array([e["ts"] for e in events]))
    batch = WriteBatch()
    records = pipe.bound(cols, cols.ts, batch)  # each event arrives at its own time
    pipe.accumulate(records, 1, batch)
    pipe.accumulate(records, 2, batch)  # stage 1's output delivered twice (at-least-once)
    store.write(batch)
    assert len(records) <= 3 * 50
    counted = {}
    for trigger in range(1, 13):
        # what stage 2 merges into the keys at this trigger (reading the bucket changes nothing)
        micro = pipe._take_pending(START, trigger, WriteBatch())
        for u in micro.users.tolist():
            counted[u] = counted.get(u, 0) + 1
        pipe.fire(START, trigger)
    assert counted and max(counted.values()) <= 3
    # every released or buffered unit is one counted contribution: C per user at most in total
    total = sum(counted.values())
    assert total == len(records)
    assert pipe.stats.dropped["duplicate"] >= len(records)


def test_single_user_key_is_never_released(tmp_path, rng):
    """Privacy smoke test: a key only one user ever contributes to stays unpublished all day."""
    query = small_query(triggers=96, contribution_bound=32)
    config = DpstreamConfig(queries=[query])
    events = make_events(rng, users=2000, records=20000)
    lonely = [{"user_id": "loner", "key": "secret-page", "ts": START + i * (DAY // 40)} for i in range(32)]
    merged = sorted(events + lonely, key=lambda e: e["ts"])
    out, summary, _ = replay(config, write_jsonl(tmp_path / "e.jsonl", merged))
    assert summary.releases > 0
    assert "secret-page" not in out


def test_trigger_loads_only_batch_and_predicted_keys(rng):
    query = small_query(triggers=48, contribution_bound=8)
    store = MemoryStore()
    pipe = QueryPipeline(query, NodeNoise(TEST_SECRET), store)
    pseudo = Pseudonymizer(TEST_SECRET)
    # 3,000 one-off keys early in the day, then a trickle of a few keys
    early = [{"user_id": f"u{i}", "key": f"tail{i}", "ts": START + i} for i in range(3000)]
    late = [{"user_id": f"v{i}", "key": f"hot{i % 5}", "ts": START + DAY // 2 + i * 1000} for i in range(200)]
    events = early + late
    cols = EventColumns(pseudo.users([e["user_id"] for e in events]), np.array([e["key"] for e in events], dtype=object),
                        pseudo.group_keys([e["key"] for e in events]), np.ones(len(events)), np.array([e["ts"] for e in events]))
    batch = WriteBatch()
    pipe.accumulate(pipe.bound(cols, cols.ts, batch), 1, batch)  # each event arrives at its own time
    store.write(batch)
    interval = DAY // 48
    for trigger in range(1, 49):
        predicted = {int(x).to_bytes(8, "big") for x in pipe.tables.predictions.at(START, trigger)}
        batch_keys = {e["key"] for e in events if (e["ts"] - START) // interval + 1 == trigger}
        batch_ids = {int(x).to_bytes(8, "big") for x in pseudo.group_keys(sorted(batch_keys))}
        pipe.fire(START, trigger)
        assert pipe.stats.keys_loaded == len(predicted | batch_ids)
        if trigger > 2:
            assert pipe.stats.keys_loaded < 100  # never the 3,000 keys seen earlier


def test_malformed_lines_are_reported_and_skipped(tmp_path, rng):
    config = DpstreamConfig(queries=[small_query(aggregate="sum", value_field="amount", clamp=5.0, name="spend")])
    good = [{"user_id": f"u{i % 40}", "key": "shop", "amount": 1.5, "ts": START + i * 1000} for i in range(200)]
    bad = [
        "{not json",
        '"a string"',
        json.dumps({"key": "shop", "amount": 1, "ts": START}),  # missing user
        json.dumps({"user_id": "u1", "amount": 1, "ts": START}),  # missing key
        json.dumps({"user_id": "u1", "key": "shop", "amount": "NaN", "ts": START}),
        '{"user_id": "u1", "key": "shop", "amount": Infinity, "ts": 1}',
        json.dumps({"user_id": "u1", "key": "shop", "amount": 1, "ts": "yesterday"}),
        json.dumps({"user_id": "u1", "key": "shop", "amount": 1}),
    ]
    path = write_jsonl(tmp_path / "e.jsonl", good, extra_lines=bad)
    runner = ReplayRunner(config, TEST_SECRET, None, log=(log := io.StringIO()))
    dead = io.StringIO()
    try:
        summary = runner.run(str(path), io.StringIO(), dead_letters=dead)
    finally:
        runner.close()
    assert sum(summary.invalid.values()) == len(bad)
    text = log.getvalue()
    for n, reason in [(201, "not valid JSON"), (202, "not a JSON object"), (203, "'user_id'"), (204, "'key'"),
                      (205, "'amount' must be a number"), (206, "not valid JSON"), (207, "'ts'"), (208, "'ts'")]:
        assert f"line {n}: query spend:" in text and reason in text.split(f"line {n}: query spend:")[1].splitlines()[0]
    assert "u1" not in text  # reasons never quote content
    assert len(dead.getvalue().splitlines()) == len(bad)
    assert json.loads(dead.getvalue().splitlines()[0])["reason"] == "not valid JSON"


def test_late_events_are_dropped_and_counted(tmp_path):
    config = DpstreamConfig(queries=[small_query(triggers=24)])
    events = [{"user_id": f"u{i}", "key": "k", "ts": START + i * 3_600_000} for i in range(10)]
    events.append({"user_id": "late", "key": "k", "ts": START + 5})  # trigger 1 fired long ago
    _, _, stats = replay(config, write_jsonl(tmp_path / "e.jsonl", events))
    assert stats.dropped["late"] == 1 and stats.events_in == 11


def test_state_dir_refuses_another_secret(tmp_path, rng):
    config = DpstreamConfig(queries=[small_query()])
    path = write_jsonl(tmp_path / "e.jsonl", make_events(rng, records=100))
    replay(config, path, state_dir=tmp_path / "s", stop_after=50)
    with pytest.raises(RuntimeError, match="different noise secret"):
        ReplayRunner(config, b"another-secret-of-enough-length", str(tmp_path / "s"))


def test_round_counts_are_exact_distinct_users(rng):
    """Each key's key-selection count equals the number of distinct users with a record for it
    since its current round started (Algorithm 2's input), across releases and new rounds."""
    query = small_query(triggers=24, contribution_bound=6, key_threshold=0.0)
    store = MemoryStore()
    pipe = QueryPipeline(query, NodeNoise(TEST_SECRET), store)
    pseudo = Pseudonymizer(TEST_SECRET)
    events = make_events(rng, users=300, keys=12, records=6000)
    cols = EventColumns(pseudo.users([e["user_id"] for e in events]), np.array([e["key"] for e in events], dtype=object),
                        pseudo.group_keys([e["key"] for e in events]), np.ones(len(events)), np.array([e["ts"] for e in events]))
    batch = WriteBatch()
    records = pipe.bound(cols, cols.ts, batch)  # each event arrives at its own time
    pipe.accumulate(records, 1, batch)
    store.write(batch)
    key_ids = np.unique(records.key_ids)
    checked_rounds = 0
    for trigger in range(1, 24):
        pipe.fire(START, trigger)
        rows, names = pipe._load_keys(START, key_ids, {})
        for j in range(len(key_ids)):
            start = int(rows["start"][j])
            mine = (records.key_ids == key_ids[j]) & (records.trigger >= start) & (records.trigger <= trigger)
            assert rows["count"][j] == len(np.unique(records.users[mine])), (names[j], trigger)
            checked_rounds += int(rows["round"][j] > 0)
    assert checked_rounds > 0  # later rounds were exercised


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2**63, 2**64 - 1, 12345]), st.integers(0, 4), st.integers(0, 2)), max_size=40))
def test_dense_codes_are_equal_exactly_when_rows_are(rows):
    """Stage 2 counts distinct (user, key) pairs and drops replayed (user, slot, level) copies by
    these codes: two rows may share a code only if they are the same row, and the lowest column
    comes back as ``code % width``."""
    from dpstream.processor.engine.pipeline import _dense_codes

    ids = np.array([r[0] for r in rows], dtype=np.uint64)
    a = np.array([r[1] for r in rows], dtype=np.int64)
    b = np.array([r[2] for r in rows], dtype=np.int64)
    codes = _dense_codes(ids, (a, 5), (b, 3)).tolist()
    for i in range(len(rows)):
        assert codes[i] % 3 == rows[i][2]
        for j in range(len(rows)):
            assert (codes[i] == codes[j]) == (rows[i] == rows[j])


def test_stage_two_counts_a_user_once_per_key_whatever_its_input_claims():
    """Key selection's sensitivity is one user per key and round. Stage 1 gives a user at most one
    record per key that is new to the round, but stage 2 reads a topic: given several records of
    one user for one key, each claiming to be the first (different slots, no predecessor), it
    must still count that user once, and count each other user once."""
    from dpstream.processor.engine.pipeline import BoundedRecords

    pipe = QueryPipeline(small_query(), NodeNoise(TEST_SECRET, label=TEST_LABEL), MemoryStore())
    key = np.uint64(77)
    users = np.array([5, 5, 5, 6, 7, 7], dtype=np.uint64)
    n = len(users)
    ones = np.ones(n, dtype=np.int64)
    records = BoundedRecords(np.zeros(n, dtype=np.int64) + START, ones, np.full(n, key, dtype=np.uint64),
                             np.array(["k"] * n, dtype=object), users, np.array([1, 2, 3, 1, 1, 2]), ones,
                             np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), ones, np.full(n, key, dtype=np.uint64))
    batch = WriteBatch()
    pipe.accumulate(records, 1, batch)
    pipe.store.write(batch)
    pipe.fire(START, 1)
    blank = np.zeros(1, dtype=pipe.tables.keys.dtype)
    rows, stored = pipe.tables.keys.load(START, np.array([key], dtype=np.uint64), blank)
    assert stored.tolist() == [True]
    assert int(rows["participations"][0]) == 3  # users 5, 6 and 7, once each
