"""Bounded state for dynamic queries (issue 33, item 3): the counter's snapshot and the compacted
update log (docs/user-guide.md, "Dynamic queries": state).

A restart must cost time in proportion to the live state, not to the history, and must change
nothing: a counter restored from a snapshot goes on exactly as the one that took it (every
release's noisy counts, positions and noise scales), for both mechanisms, whatever the stream
(deletes of absent items, several updates per tick, node restarts and halts in the interval tree).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.accountant.dynamic import DynamicPlan
from dpstream.processor.engine import dynamic_stream
from dpstream.processor.mechanisms.dynamic import DynamicCounter
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.state.store import MemoryStore, RocksDBStore, WriteBatch
from dpstream.state.tables import decode_snapshot, encode_snapshot
from tests.conftest import TEST_SECRET
from tests.test_dynamic_stream import make, run, stream

ITEMS = ["a", "b", "c"]
NOISE = NodeNoise(TEST_SECRET, "snapshots")


def _counter(mechanism: str, epsilon: float = 1.0) -> DynamicCounter:
    return DynamicCounter(DynamicPlan(epsilon, 0.0, 0.05, 0.25, mechanism), ITEMS, NOISE, "q")


def _feed(counter: DynamicCounter, updates) -> list:
    out = []
    for item, op, tick in updates:
        out += counter.apply(ITEMS[item], op, tick)
    return out


def _same(a, b) -> None:
    assert [(r.segment, r.position, r.noise_scales) for r in a] == [(r.segment, r.position, r.noise_scales) for r in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.counts, y.counts)
        np.testing.assert_array_equal(x.exact, y.exact)


updates_strategy = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["insert", "insert", "delete"]), st.integers(0, 3)),
                            min_size=1, max_size=400)


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=updates_strategy, cut=st.floats(0, 1), epsilon=st.sampled_from([0.05, 1.0, 8.0]))
def test_a_restored_counter_goes_on_exactly_as_the_one_that_took_the_snapshot(mechanism, raw, cut, epsilon):
    """Any stream (items, inserts and deletes, absent items deleted, gaps of up to 3 ticks and
    several updates per tick), cut at any update: the snapshot goes through its byte encoding,
    a fresh counter takes it up, and the rest of the stream gives the same releases as the
    uninterrupted counter, as does deciding the ticks after it."""
    tick, updates = 1, []
    for item, op, gap in raw:
        tick += gap
        updates.append((item, op, tick))
    k = int(cut * len(updates))
    whole = _counter(mechanism, epsilon)
    first = _feed(whole, updates[:k])
    state = decode_snapshot(encode_snapshot(whole.snapshot()))
    rest_whole = _feed(whole, updates[k:]) + whole.advance_to(tick + 50)

    restored = _counter(mechanism, epsilon)
    restored.restore(state)
    rest_restored = _feed(restored, updates[k:]) + restored.advance_to(tick + 50)
    _same(rest_whole, rest_restored)
    assert len(first) + len(rest_whole) >= 1 or tick + 50 < 3
    # and the two end in the same state
    assert encode_snapshot(whole.snapshot()) == encode_snapshot(restored.snapshot())


def test_a_snapshot_round_trips_floats_exactly_and_refuses_other_formats():
    state = {"x": 0.1 + 0.2, "n": np.int64(3), "a": np.arange(5, dtype=np.int32), "m": np.zeros((0, 2), dtype=np.int64),
             "f": np.array([1 / 3, -0.0]), "nested": [{"b": np.array([2**62], dtype=np.int64)}]}
    back = decode_snapshot(encode_snapshot(state))
    assert back["x"] == 0.1 + 0.2 and back["n"] == 3
    assert back["a"].dtype == np.int32 and back["a"].tolist() == [0, 1, 2, 3, 4]
    assert back["m"].shape == (0, 2) and back["f"].tolist() == [1 / 3, -0.0]
    assert back["nested"][0]["b"].tolist() == [2**62]
    with pytest.raises(ValueError, match="unknown format"):
        decode_snapshot(b"S0:" + encode_snapshot(state)[3:])


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
@pytest.mark.parametrize("crash_after", [3, 11, 26])
def test_restarts_from_snapshots_release_what_one_run_does_and_the_log_stays_short(tmp_path, monkeypatch, mechanism, crash_after):
    """The query state over RocksDB: a snapshot after every 300 updates taken in; the process
    stops after ``crash_after`` chunks (some decided, not all published) and a new state on the
    same directory goes on. Releases equal one uninterrupted run's; the log holds only what the
    last snapshot has not taken in, never the history."""
    monkeypatch.setattr(dynamic_stream, "SNAPSHOT_AFTER_UPDATES", 300)
    records = stream(16_000, seed=4)
    ref_store = MemoryStore()
    reference = run(make(ref_store, mechanism=mechanism), records, ref_store)

    store = RocksDBStore(tmp_path / "s")
    state = make(store, mechanism=mechanism)
    cut = crash_after * 500
    got = run(state, records[:cut], store)
    # the last chunk's decisions are written, its releases not published: a crash here
    batch = WriteBatch()
    for rec in records[cut:cut + 500]:
        state.apply(rec, batch)
    state.advance_clock(records[cut + 499]["ts"], batch)
    store.write(batch)
    assert state.pending
    store.close()

    store = RocksDBStore(tmp_path / "s")
    again = make(store, mechanism=mechanism)
    assert store.get(again.tables.snapshot_key) is not None
    # the log: the updates of ticks not decided yet (within the allowed lateness of the clock),
    # and those decided since the snapshot before the last (its entries go when the next one is
    # written): two snapshot intervals, each under the threshold (300, or the live instances if
    # more) plus about a chunk; never the history before them (up to 13,500 updates here)
    logged = sum(1 for _ in again.tables.log())
    assert logged == len(again.waiting) + len(again._taken_in)
    assert len(again._taken_in) < 2 * (max(300, again.counter.live_size()) + 1_000), (len(again._taken_in), again.counter.live_size())
    assert logged < 5_000, (len(again.waiting), len(again._taken_in))
    got += again.take_pending()
    mark = WriteBatch()
    again.mark_published(mark)
    store.write(mark)
    got += run(again, records[cut + 500:], store)
    assert got == reference
    store.close()


def test_a_state_written_before_snapshots_resumes_and_its_old_log_is_emptied(tmp_path, monkeypatch):
    """A state directory written before snapshots logs by sequence (table ``d``, the tick in the
    value: state/keys.py). It resumes with the same releases as one run, and the updates of its
    old log go as a snapshot takes them in."""
    from dpstream.state import keys as sk

    records = stream(6_000, seed=9)
    ref_store = MemoryStore()
    reference = run(make(ref_store), records, ref_store)

    store = RocksDBStore(tmp_path / "s")
    state = make(store)
    got = run(state, records[:3_000], store)
    assert store.get(state.tables.snapshot_key) is None  # 3,000 updates: under the threshold
    # rewrite the log as it was written before snapshots
    old = WriteBatch()
    prefix = sk.DYNAMIC_TICK_LOG + state.tables.qid
    for key, value in list(store.scan_prefix(prefix)):
        tick, seq = int.from_bytes(key[-16:-8], "big"), int.from_bytes(key[-8:], "big")
        old.delete(key)
        old.put(sk.DYNAMIC_LOG + state.tables.qid + seq.to_bytes(8, "big"), value + tick.to_bytes(8, "little"))
    store.write(old)
    legacy = sum(1 for _ in store.scan_prefix(sk.DYNAMIC_LOG + state.tables.qid))
    assert legacy > 0
    store.close()

    monkeypatch.setattr(dynamic_stream, "SNAPSHOT_AFTER_UPDATES", 1_000)
    store = RocksDBStore(tmp_path / "s")
    again = make(store)
    got += run(again, records[3_000:], store)
    assert got == reference
    assert store.get(again.tables.snapshot_key) is not None
    assert sum(1 for _ in store.scan_prefix(sk.DYNAMIC_LOG + again.tables.qid)) == 0
    store.close()


def test_the_restart_bench_keeps_the_log_to_the_live_state_whatever_the_history(monkeypatch):
    """``bench dynamic --restart`` at a small scale: after 60,000 updates the log holds about
    what it holds after 6,000 (two snapshot intervals and the undecided ticks), not 10x more."""
    import io

    from dpstream.processor.bench.dynamic_restart import run_restart_bench

    monkeypatch.setattr(dynamic_stream, "SNAPSHOT_AFTER_UPDATES", 1_000)
    report = run_restart_bench((6_000, 60_000), live=300, items=4, repeats=1, chunk=500, out=io.StringIO())
    short, long = report["rows"]
    assert long["updates"] == 60_000 and 150 <= long["live_items"] <= 600
    assert long["log_entries"] < 2 * short["log_entries"] + 500 and long["log_entries"] < 6_000, report["rows"]


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
def test_a_changelogged_state_taken_up_by_another_worker_goes_on_the_same(monkeypatch, mechanism):
    """Elastic workers: the store's changes go to a compacted changelog, which another worker
    restores from (docs/operations.md, "Elastic workers"). The snapshots and the log ranges they
    delete go there too: the restored state releases what one run does, and the changelog,
    compacted (the latest value per key), holds only the log entries of the last two snapshot
    intervals and the undecided ticks."""
    from dpstream.state import keys as sk
    from dpstream.state.changelog import ChangelogStore, restore_store

    monkeypatch.setattr(dynamic_stream, "SNAPSHOT_AFTER_UPDATES", 300)
    records = stream(12_000, seed=6)
    ref_store = MemoryStore()
    reference = run(make(ref_store, mechanism=mechanism), records, ref_store)

    store = ChangelogStore(MemoryStore())
    got = run(make(store, mechanism=mechanism), records[:8_000], store)
    changes, _ = store.take_changes()
    latest = dict(changes)
    logged = [k for k, v in latest.items() if k.startswith(sk.DYNAMIC_TICK_LOG) and v is not None]
    assert 0 < len(logged) < 4_000, len(logged)
    assert latest.get(make(MemoryStore(), mechanism=mechanism).tables.snapshot_key) is not None

    elsewhere = MemoryStore()
    restore_store(elsewhere, changes)
    got += run(make(elsewhere, mechanism=mechanism), records[8_000:], elsewhere)
    assert got == reference


def test_one_state_gives_one_snapshot_byte_for_byte_after_a_restore():
    """A restored interval tree fills its nodes' members from sets in another order than the
    counter that took the snapshot; the snapshot lists them in id order, so the same state after
    the same input encodes to the same bytes (a stream where the orders differ)."""
    items = list("abcdef")
    rng = np.random.default_rng(5)
    tick, updates = 1, []
    for _ in range(600):
        tick += int(rng.integers(0, 3))
        updates.append((items[int(rng.integers(0, 6))], "delete" if rng.random() < 0.33 else "insert", tick))

    def counter() -> DynamicCounter:
        return DynamicCounter(DynamicPlan(10.0, 0.0, 0.05, 0.25, "interval_tree"), items, NOISE, "q")

    whole = counter()
    for update in updates[:180]:
        whole.apply(*update)
    restored = counter()
    restored.restore(decode_snapshot(encode_snapshot(whole.snapshot())))
    for c in (whole, restored):
        for update in updates[180:]:
            c.apply(*update)
        c.advance_to(tick + 40)
    assert encode_snapshot(whole.snapshot()) == encode_snapshot(restored.snapshot())
