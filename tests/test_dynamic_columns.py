"""Update records read as columns (issue 33, item 4: speed) change nothing but time.

A worker takes in a batch of update records with :meth:`UpdateParser.columns` and
:meth:`DynamicQueryState.apply_columns`: whole-array steps instead of one parse and one check per
record. What users rely on is that the outcome is exactly that of the record-by-record path
(:meth:`DynamicQueryState.apply_parsed`): the same refusals with the same reasons (dead letters
name the field), the same drop counts (metrics), the same update log, sequence numbers and unit
counts (so the same releases, and the same state on restart). Checked here on random batches
mixing valid records with every kind of invalid one a producer can write.
"""
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from dpstream.topics.records import TOMBSTONE, InvalidRecord, UpdateParser
from tests.conftest import TEST_SECRET

ITEMS = ["open", "pending", "7", "solved"]
NOISE = NodeNoise(TEST_SECRET, "columns")
PSEUDONYMS = Pseudonymizer(TEST_SECRET)
START, TICK_MS = 1_000, 10


def query(unit: bool, bound: int = 3) -> DynamicQueryConfig:
    extra = {"unit_field": "user", "contribution_bound": bound} if unit else {}
    return DynamicQueryConfig(name="tickets", items=ITEMS, epsilon=1.0, start=START, tick=f"{TICK_MS}ms",
                              allowed_lateness="20ms", **extra)


def values(rng: np.random.Generator) -> object:
    """A field's value as any producer might write it."""
    return [None, 7, 7.0, 7.5, True, "", "x" * 5000, ["open"], {"a": 1}, math.inf, "open", -3][int(rng.integers(12))]


def record(rng: np.random.Generator, unit: bool) -> object:
    """A valid record four times in five; otherwise one field broken, missing, or no object."""
    rec = {"item": ITEMS[int(rng.integers(len(ITEMS)))], "op": ["insert", "delete"][int(rng.integers(2))],
           "ts": START + int(rng.integers(0, 400))}
    if unit:
        rec["user"] = f"u{int(rng.integers(5))}"
    roll = rng.random()
    if roll < 0.8:
        return rec
    if roll < 0.83:
        return TOMBSTONE
    if roll < 0.85:
        return InvalidRecord("not valid JSON")
    field = ["item", "op", "ts", "user"][int(rng.integers(4 if unit else 3))]
    if rng.random() < 0.3:
        rec.pop(field, None)
    else:
        rec[field] = values(rng)
    if field == "ts" and rng.random() < 0.3:
        rec["ts"] = [START - 5, float(START + 50), "2026-12-07T00:00:00Z"][int(rng.integers(3))]
    if field == "ts" and rng.random() < 0.05:
        rec["ts"] = 2 ** 63  # valid, but its tick does not fit the columns: the batch goes one by one
    return rec


def state(q: DynamicQueryConfig) -> tuple[DynamicQueryState, MemoryStore]:
    store = MemoryStore()
    return DynamicQueryState(q, NOISE, PSEUDONYMS, store), store


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 100_000), unit=st.booleans(), batches=st.integers(1, 4), n=st.integers(1, 120),
       decided=st.integers(0, 30))
def test_columns_and_record_by_record_agree_on_every_outcome(seed, unit, batches, n, decided):
    """Random batches (valid records, tombstones, undecodable ones, missing, null, mistyped,
    unhashable, over-long and out-of-range fields, times before the start, as floats, as text
    and past 2^63), some ticks decided already, clocks that make some records future: both paths
    give the same reasons, drop counts, log, sequence numbers, unit counts and stored state."""
    rng = np.random.default_rng(seed)
    q = query(unit)
    columns, columns_store = state(q)
    one_by_one, one_by_one_store = state(q)
    for s, store in ((columns, columns_store), (one_by_one, one_by_one_store)):
        batch = WriteBatch()
        s.advance_clock(START + decided * TICK_MS + 20, batch)
        store.write(batch)
    used_columns = False
    for _ in range(batches):
        objs = [record(rng, unit) for _ in range(n)]
        clocks = [START + int(rng.integers(0, 600)) for _ in range(n)]
        huge = any(isinstance(o, dict) and o.get("ts") == 2 ** 63 for o in objs)
        assert (columns.parser.columns(objs) is None) <= huge
        used_columns |= not huge
        b1, b2 = WriteBatch(), WriteBatch()
        got = columns.apply_records(objs, b1, clocks)
        want = one_by_one.apply_parsed([one_by_one.parse(o) for o in objs], b2, clocks)
        assert got == want
        columns_store.write(b1)
        one_by_one_store.write(b2)
    assert columns.dropped == one_by_one.dropped and columns.updates_in == one_by_one.updates_in
    assert columns.waiting == one_by_one.waiting and columns._next_seq == one_by_one._next_seq
    assert columns._units == one_by_one._units
    assert columns_store._data == one_by_one_store._data
    assert used_columns or batches == 1


def test_columns_read_what_from_mapping_reads_and_hand_the_odd_records_to_it():
    """The usual record is read in list passes; an item given as a number whose text is declared
    ("7"), a float time and an ISO time go through from_mapping and come out as it reads them; an
    invalid record carries from_mapping's reason, naming the field."""
    q = query(unit=False)
    parser = UpdateParser(q, q.items)
    objs = [{"item": "open", "op": "insert", "ts": START + 5}, {"item": 7, "op": "delete", "ts": float(START + 15)},
            {"item": "closed", "op": "insert", "ts": START}, {"item": "open", "op": "remove", "ts": START},
            {"item": "open", "op": "insert"}, TOMBSTONE, {"item": ["open"], "op": {"x": 1}, "ts": START}]
    cols = parser.columns(objs)
    assert cols.items[:2].tolist() == [0, 2] and cols.ops[:2].tolist() == [1, 2] and cols.ticks[:2].tolist() == [1, 2]
    assert cols.invalid == {i: parser.from_mapping(o) for i, o in enumerate(objs) if i >= 2}
    assert {i: r.reason for i, r in cols.invalid.items() if i < 5} == {
        2: "field 'item' is not in the query's declared items", 3: "field 'op' must be 'insert' or 'delete'",
        4: "field 'ts' must be an integer (epoch milliseconds)"}
    assert cols.invalid[6].reason.startswith("field 'item'")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 100_000), unit=st.booleans(), n=st.integers(1, 150), partition=st.integers(0, 7))
def test_a_router_reading_columns_routes_and_refuses_as_record_by_record(seed, unit, n, partition):
    """On an update topic of several partitions the router reads a batch as columns too: the same
    updates go to the same shards (or unit steps) with the same sequence numbers, and the same
    records are refused (invalid, late by their own stamp, future) with the same reasons."""
    from dpstream.processor.engine.dynamic_stream import UpdateRouter

    rng = np.random.default_rng(seed)
    q = query(unit).model_copy(update={"shards": 3})
    objs = [record(rng, unit) for _ in range(n)]
    stamps = [START + int(rng.integers(0, 700)) for _ in range(n)]
    offsets = sorted(int(o) for o in rng.choice(10 * n, n, replace=False))
    routers = [UpdateRouter(q, partition, 15, pseudonyms=PSEUDONYMS) for _ in range(2)]
    routers[1].parser.columns = lambda objs: None  # the record-by-record path
    (got, got_reasons), (want, want_reasons) = (r.route(objs, stamps, offsets) for r in routers)
    assert got_reasons == want_reasons and routers[0].dropped == routers[1].dropped
    assert sorted(got) == sorted(want)
    for k in got:
        assert type(got[k]) is type(want[k]) and got[k].encode() == want[k].encode()
