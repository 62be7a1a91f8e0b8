"""The dynamic query over a store (shared by replay and the worker): validation, unit bounding,
ticks decided on the clock in (tick, arrival) order, and recovery from the update log
(identical releases, republished not lost)."""
import json

import numpy as np
import pytest

from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, RocksDBStore, WriteBatch
from dpstream.topics.records import InvalidRecord
from tests.conftest import TEST_SECRET

ITEMS = ["a", "b", "c", "d"]


def stream(n: int, seed: int = 2, units: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    live, out = [], []
    for i in range(n):
        rec = {"ts": i}
        if units:
            rec["user"] = f"u{rng.integers(units)}"
        if live and rng.random() < 0.45:
            rec.update(item=live.pop(int(rng.integers(len(live)))), op="delete")
        else:
            rec.update(item=ITEMS[int(rng.integers(4))], op="insert")
            live.append(rec["item"])
        out.append(rec)
    return out


def run(state: DynamicQueryState, records, store, chunk: int = 500, publish: bool = True) -> list[dict]:
    """Log each chunk, then move the clock to the chunk's last record time (ticks up to it minus
    the allowed lateness are decided), then publish."""
    released = []
    for i in range(0, len(records), chunk):
        batch = WriteBatch()
        for rec in records[i:i + chunk]:
            state.apply(rec, batch)
        state.advance_clock(records[i:i + chunk][-1]["ts"], batch)
        store.write(batch)
        if publish:
            released += state.take_pending()
            mark = WriteBatch()
            state.mark_published(mark)
            store.write(mark)
    return released


def make(store, **kw) -> DynamicQueryState:
    q = DynamicQueryConfig(name="plans", items=ITEMS, epsilon=1.0, start=0, tick="5ms", **kw)
    return DynamicQueryState(q, NodeNoise(TEST_SECRET), Pseudonymizer(TEST_SECRET), store)


def test_restart_replays_the_log_and_republishes_unpublished_releases(tmp_path):
    records = stream(20_000)
    ref_store = MemoryStore()
    reference = run(make(ref_store), records, ref_store)
    assert len(reference) > 10

    store = RocksDBStore(tmp_path / "s")
    first = make(store)
    half = run(first, records[:10_000], store)
    # crash: the next chunk is logged but its releases never reach the output
    batch = WriteBatch()
    for rec in records[10_000:12_000]:
        first.apply(rec, batch)
    first.advance_clock(records[11_999]["ts"], batch)
    store.write(batch)
    store.close()
    store = RocksDBStore(tmp_path / "s")
    again = make(store)
    resent = again.take_pending()  # recomputed from the log, past the published marker
    mark = WriteBatch()
    again.mark_published(mark)
    store.write(mark)
    rest = run(again, records[12_000:], store)
    got = half + resent + rest
    assert [json.dumps(r, sort_keys=True) for r in got] == [json.dumps(r, sort_keys=True) for r in reference]
    store.close()


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
def test_range_count_releases_survive_a_restart_and_name_their_release(tmp_path, mechanism):
    """static_release mwem_ranges through the agent's state: releases carry the rounded
    synthetic counts and no intervals, name the release in ``mechanism``, and a restart from the
    RocksDB state (snapshots and the log behind them) publishes exactly the uninterrupted run's."""
    records = stream(12_000, seed=4)
    ref_store = MemoryStore()
    reference = run(make(ref_store, mechanism=mechanism, static_release="mwem_ranges"), records, ref_store)
    assert len(reference) > 5
    for rec in reference:
        assert rec["mechanism"] == f"dynamic:{mechanism}+mwem_ranges"
        assert not any(key.startswith(("ci95", "total_ci95")) for key in rec)
        assert all(isinstance(v, int) for v in rec["counts"].values()) and rec["total"] == sum(rec["counts"].values())
    store = RocksDBStore(tmp_path / "s")
    got = run(make(store, mechanism=mechanism, static_release="mwem_ranges"), records[:6_000], store)
    store.close()
    store = RocksDBStore(tmp_path / "s")
    again = make(store, mechanism=mechanism, static_release="mwem_ranges")
    got += run(again, records[6_000:], store)
    store.close()
    assert [json.dumps(r, sort_keys=True) for r in got] == [json.dumps(r, sort_keys=True) for r in reference]


def test_invalid_updates_and_unit_bound():
    store = MemoryStore()
    st = make(store, unit_field="user", contribution_bound=2)
    batch = WriteBatch()
    assert "'op'" in st.apply({"item": "a", "op": "upsert", "ts": 1, "user": "x"}, batch)
    assert "declared items" in st.apply({"item": "zz", "op": "insert", "ts": 1, "user": "x"}, batch)
    assert st.apply(InvalidRecord("not valid JSON"), batch) == "not valid JSON"
    assert "'ts'" in st.apply({"item": "a", "op": "insert", "ts": "soon", "user": "x"}, batch)
    assert "'user'" in st.apply({"item": "a", "op": "insert", "ts": 1}, batch)
    # a delete of an absent item (its tick, 1, comes before the inserts', 2) is taken in like any
    # update: refusing it would make its fate depend on other units' updates
    assert st.apply({"item": "a", "op": "delete", "ts": 1, "user": "w"}, batch) is None
    for _ in range(3):  # the unit's third update is dropped, not counted
        assert st.apply({"item": "a", "op": "insert", "ts": 6, "user": "x"}, batch) is None
    st.advance_clock(1_000 + 20, batch)  # ticks of 5 ms, 1 s allowed lateness
    assert st.counter.counters[0].updates == 3
    assert st.counter.exact.tolist() == [1, 0, 0, 0]  # the baseline: inserts minus deletes
    assert st.dropped["contribution_bound"] == 1 and st.dropped["malformed"] == 5
    # time never goes back to a decided tick; an update far ahead of its arrival clock is future
    assert st.apply({"item": "a", "op": "insert", "ts": 3, "user": "z"}, batch).startswith("late")
    assert st.dropped["late"] == 1
    assert st.apply({"item": "a", "op": "insert", "ts": 10_000_000, "user": "v"}, batch, clock_ms=5_000).startswith("future")
    # mechanisms run at epsilon / C (group privacy)
    assert st.counter.plan.epsilon == 0.5


def test_a_state_logged_when_absent_deletes_were_refused_does_not_resume():
    """Before issue 30 a delete of an absent item was refused when its tick was decided. A log
    written then, recomputed under the new rule, would feed such deletes to nodes already
    released with the same noise (the difference of two releases of one node would show the
    delete), so the rule is part of the query's pinned fingerprint and an old state is refused
    (a new name or state directory starts over). Here the store holds the fingerprint the old
    code pinned: the same plan and schedule, without the rule."""
    import pytest

    from dpstream.accountant.plan import plan_fingerprint
    from dpstream.processor.engine.pipeline import PlanChangedError
    from dpstream.state.tables import DynamicTables

    q = DynamicQueryConfig(name="plans", items=ITEMS, epsilon=1.0, start=0, tick="5ms")
    old_schedule = {"items": list(q.items), "start": q.start, "tick": q.tick_ms, "lateness": q.lateness_ms,
                    "unit_field": q.unit_field, "contribution_bound": q.contribution_bound}
    store = MemoryStore()
    DynamicTables(store, q.name).pin_plan(plan_fingerprint([q.plan(), old_schedule]).hex().encode())
    with pytest.raises(PlanChangedError, match="another calibration"):
        DynamicQueryState(q, NodeNoise(TEST_SECRET), Pseudonymizer(TEST_SECRET), store)
    make(MemoryStore())  # a fresh state starts
