"""The dynamic query over a store (shared by replay and the worker): validation, unit bounding,
and recovery by replaying the update log (identical releases, republished not lost)."""
import json

import numpy as np

from processor.config import DynamicQueryConfig
from processor.dynamic_stream import DynamicQueryState
from processor.noise import NodeNoise, Pseudonymizer
from state.store import MemoryStore, RocksDBStore, WriteBatch
from tests.conftest import TEST_SECRET
from topics.records import InvalidRecord

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
    released = []
    for i in range(0, len(records), chunk):
        batch = WriteBatch()
        for rec in records[i:i + chunk]:
            state.apply(rec, batch)
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


def test_invalid_updates_and_unit_bound():
    store = MemoryStore()
    st = make(store, unit_field="user", contribution_bound=2)
    batch = WriteBatch()
    assert st.apply({"item": "a", "op": "delete", "ts": 1, "user": "x"}, batch)[1] == "delete of an item that is not present"
    assert "'op'" in st.apply({"item": "a", "op": "upsert", "ts": 1, "user": "x"}, batch)[1]
    assert "declared items" in st.apply({"item": "zz", "op": "insert", "ts": 1, "user": "x"}, batch)[1]
    assert st.apply(InvalidRecord("not valid JSON"), batch)[1] == "not valid JSON"
    assert "'ts'" in st.apply({"item": "a", "op": "insert", "ts": "soon", "user": "x"}, batch)[1]
    assert "'user'" in st.apply({"item": "a", "op": "insert", "ts": 1}, batch)[1]
    for _ in range(3):  # the unit's third update is dropped, not counted
        assert st.apply({"item": "a", "op": "insert", "ts": 1, "user": "x"}, batch)[1] is None
    assert st.counter.exact.tolist() == [2, 0, 0, 0]
    assert st.dropped["contribution_bound"] == 1 and st.dropped["malformed"] == 6
    # time never goes back to a decided tick
    st.apply({"item": "a", "op": "insert", "ts": 100, "user": "y"}, batch)
    assert st.apply({"item": "a", "op": "insert", "ts": 3, "user": "z"}, batch)[1].startswith("late")
    assert st.dropped["late"] == 1
    # mechanisms run at epsilon / C (group privacy)
    assert st.counter.plan.epsilon == 0.5
