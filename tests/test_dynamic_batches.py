"""Dynamic updates taken in by the batch (issue 33, item 4): nothing changes but time.

The worker and replay hand a dynamic query whole batches of records
(:meth:`DynamicQueryState.apply_records`), and the counter takes a decided stretch of updates at
once (:meth:`DynamicCounter.apply_many`: the baseline as per-tick counts). Whatever the batches,
the outcome must be the one of a record at a time and an update at a time: the same refusals with
the same reasons, the same drops, the same log in the store, the same releases, the same state.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.accountant.dynamic import DynamicPlan
from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms.dynamic import DynamicCounter, InvalidUpdate
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from dpstream.topics.records import InvalidRecord
from tests.conftest import TEST_SECRET

ITEMS = ["a", "b", "c"]


def release_view(releases) -> list:
    return [(r.segment, r.position, r.counts.tolist(), r.exact.tolist(), r.noise_scales) for r in releases]


def snapshot_view(counter: DynamicCounter) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in counter.snapshot().items()
            if k not in ("partitioner", "tree", "inserts", "deletes")}


updates = st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 3)), min_size=1, max_size=250)


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
@settings(max_examples=60, deadline=None)
@given(stream=updates, cuts=st.lists(st.integers(0, 250), max_size=6))
def test_the_counter_takes_a_stretch_of_updates_as_one_update_at_a_time(mechanism, stream, cuts):
    """Ticks that move on by 0 to 3 (several updates per tick, empty ticks between), deletes of
    absent items included, cut into stretches anywhere: apply_many gives the releases, exact
    counts and state of apply per update."""
    plan = DynamicPlan(1.0, 0.0, 0.05, 0.25, mechanism)
    one, many, expected, got = one_at_a_time_and_in_stretches(
        lambda: DynamicCounter(plan, ITEMS, NodeNoise(TEST_SECRET, "batches"), "q"), ITEMS, stream, cuts)
    assert release_view(got) == release_view(expected)
    assert snapshot_view(many) == snapshot_view(one)


def one_at_a_time_and_in_stretches(make_counter, items: list[str], stream, cuts):
    """Two fresh counters fed ``stream`` ((item index, insert?, tick gap)): one by apply per
    update, the other by apply_many over the stretches between ``cuts``; both then decide five
    more ticks. Returns (one, many, one's releases, many's releases)."""
    ticks = np.cumsum([1] + [gap for _, _, gap in stream[1:]])
    one, many = make_counter(), make_counter()
    expected = []
    for (x, ins, _), t in zip(stream, ticks.tolist()):
        expected += one.apply(items[x], "insert" if ins else "delete", t)
    got = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(stream))), len(stream)]
    indices = np.array([x for x, _, _ in stream])
    inserts = np.array([ins for _, ins, _ in stream])
    for lo, hi in zip(bounds, bounds[1:]):
        got += many.apply_many(indices[lo:hi], inserts[lo:hi], ticks[lo:hi])
    end = int(ticks[-1]) + 5
    return one, many, expected + one.advance_to(end), got + many.advance_to(end)


def test_the_counter_refuses_a_stretch_that_goes_back_or_names_an_unknown_item():
    counter = DynamicCounter(DynamicPlan(1.0, 0.0, 0.05, 0.25, "baseline"), ITEMS, NodeNoise(TEST_SECRET, "b"), "q")
    counter.apply_many(np.array([0, 1]), np.array([True, True]), np.array([3, 3]))
    counter.advance_to(5)
    with pytest.raises(InvalidUpdate, match="late"):
        counter.apply_many(np.array([0]), np.array([True]), np.array([4]))
    with pytest.raises(InvalidUpdate, match="late"):
        counter.apply_many(np.array([0, 1]), np.array([True, True]), np.array([7, 6]))
    with pytest.raises(InvalidUpdate, match="declared items"):
        counter.apply_many(np.array([3]), np.array([True]), np.array([9]))
    assert counter.updates == 2 and counter.exact.tolist() == [1, 1, 0]


def records(min_size: int = 1):
    """Update records of every kind the agent meets: valid, unknown item or op, bad or missing
    time, dated before the query's start, far in the future, undecodable; with units."""
    good = st.fixed_dictionaries({"item": st.sampled_from(ITEMS), "op": st.sampled_from(["insert", "delete"]),
                                  "ts": st.integers(0, 400), "user": st.sampled_from(["u1", "u2", "u3", "u4"])})
    bad = st.one_of(
        st.fixed_dictionaries({"item": st.sampled_from(["zz", 7, None]), "op": st.just("insert"), "ts": st.integers(0, 400),
                               "user": st.just("u1")}),
        st.fixed_dictionaries({"item": st.just("a"), "op": st.sampled_from(["upsert", None]), "ts": st.just(5), "user": st.just("u2")}),
        st.fixed_dictionaries({"item": st.just("a"), "op": st.just("insert"), "ts": st.sampled_from(["soon", 1.5, True])}),
        st.fixed_dictionaries({"item": st.just("b"), "op": st.just("insert"), "ts": st.just(10**9), "user": st.just("u3")}),
        st.just(InvalidRecord("not valid JSON")),
    )
    return st.lists(st.one_of(good, good, good, bad), min_size=min_size, max_size=120)


def make(store, unit: bool) -> DynamicQueryState:
    kw = dict(unit_field="user", contribution_bound=3) if unit else {}
    q = DynamicQueryConfig(name="plans", items=ITEMS, epsilon=1.0, start=2, tick="5ms", allowed_lateness="20ms",
                           max_skew="1s", **kw)
    return DynamicQueryState(q, NodeNoise(TEST_SECRET, "batches"), Pseudonymizer(TEST_SECRET), store)


@pytest.mark.parametrize("unit", [False, True], ids=["per-update", "unit-bound"])
@settings(max_examples=60, deadline=None)
@given(recs=records(), cuts=st.lists(st.integers(0, 120), max_size=5), clocks=st.lists(st.integers(0, 500), min_size=1, max_size=5))
def test_records_taken_in_by_the_batch_come_out_as_one_at_a_time(unit, recs, cuts, clocks):
    """The same records cut into batches anywhere, the clock moved between them (ticks decided,
    later records late): the same refusals, drops, store contents and releases as one apply per
    record with the clock moved at the same places."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(recs))), len(recs)]
    moves = sorted(clocks)
    outcomes = []
    for batched in (False, True):
        store = MemoryStore()
        state = make(store, unit)
        reasons, released = [], []
        for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            batch = WriteBatch()
            arrival = [moves[min(k, len(moves) - 1)]] * (hi - lo)
            if batched:
                reasons += state.apply_records(recs[lo:hi], batch, arrival)
            else:
                reasons += [state.apply(r, batch, clock_ms=c) for r, c in zip(recs[lo:hi], arrival)]
            state.advance_clock(moves[min(k, len(moves) - 1)], batch)
            store.write(batch)
            released += state.take_pending()
            mark = WriteBatch()
            state.mark_published(mark)
            store.write(mark)
        end = WriteBatch()
        state.advance_clock(10_000, end)
        store.write(end)
        released += state.take_pending()
        outcomes.append((reasons, dict(state.dropped), state.updates_in, released, sorted(store.scan_prefix(b"")),
                         snapshot_view(state.counter)))
    assert outcomes[0][0] == outcomes[1][0]
    assert outcomes[0][1:] == outcomes[1][1:]


# ---------------------------------------------------------------- the neighbour relation (issue 33, item 6)
def fed_updates(recs: list, arrivals: list[int], unit: bool) -> Counter:
    """What the counter is fed, as a multiset of (tick, item, op), for records arriving at the
    given (public) times; the clock is moved at fixed public times, whatever the data."""
    store = MemoryStore()
    state = make(store, unit)
    fed: Counter = Counter()
    take = state.counter.counters[0].apply_many  # one shard: its items are the query's

    def spy(items, inserts, ticks):
        fed.update(zip(np.asarray(ticks).tolist(), np.asarray(items).tolist(), np.asarray(inserts).tolist()))
        return take(items, inserts, ticks)

    state.counter.counters[0].apply_many = spy
    moves = iter(range(200, 2_000, 100))
    next_move = next(moves)
    for rec, at in zip(recs, arrivals):
        while at >= next_move:
            batch = WriteBatch()
            state.advance_clock(next_move, batch)
            store.write(batch)
            next_move = next(moves, 10**9)
        batch = WriteBatch()
        state.apply(rec, batch, clock_ms=at)
        store.write(batch)
    batch = WriteBatch()
    state.advance_clock(10_000, batch)
    return fed


def own_updates(rec, unit: bool) -> Counter:
    """The updates a record carries on its own (its tick from its own time), as fed_updates counts them."""
    tick = (rec["ts"] - 2) // 5 + 1
    return Counter({(tick, ITEMS.index(rec["item"]), rec["op"] == "insert"): 1})


@pytest.mark.parametrize("unit", [False, True], ids=["one-update", "one-unit"])
@settings(max_examples=80, deadline=None)
@given(recs=records(min_size=20), gaps=st.lists(st.integers(0, 40), min_size=120, max_size=120), pick=st.integers(0, 10**6))
def test_removing_one_party_changes_the_counters_input_by_its_own_updates_only(unit, recs, gaps, pick):
    """Whatever the other parties write - invalid records, late ones, far-future ones, deletes of
    absent items, floods over their bound - removing one record (no unit field: the privacy unit
    is the update) or every record of one unit (with ``unit_field``) changes the multiset of
    (tick, item, op) the counter takes in by that party's own updates only, each at its own
    tick, at most ``contribution_bound`` of them: nobody else's update is taken in or left out
    because of it (docs/privacy.md, "Dynamic counts")."""
    arrivals = (100 + np.cumsum(gaps[:len(recs)])).tolist()
    # most records dated near their arrival (on time), some behind it (late once their tick is
    # decided): a valid record's time moved by its arrival, so that open ticks see traffic
    recs = [{**r, "ts": at + r["ts"] % 80 - 40} if isinstance(r, dict) and type(r.get("ts")) is int and r["ts"] < 10**9
            else r for r, at in zip(recs, arrivals)]
    base = fed_updates(recs, arrivals, unit)
    victim = recs[pick % len(recs)]
    if unit:
        who = victim.get("user") if isinstance(victim, dict) else None
        keep = [k for k, r in enumerate(recs) if not (isinstance(r, dict) and who is not None and r.get("user") == who)]
        if who is None:
            keep = [k for k in range(len(recs)) if k != pick % len(recs)]
        mine = [recs[k] for k in range(len(recs)) if k not in set(keep)]
    else:
        keep = [k for k in range(len(recs)) if k != pick % len(recs)]
        mine = [victim]
    neighbour = fed_updates([recs[k] for k in keep], [arrivals[k] for k in keep], unit)
    removed = base - neighbour
    assert not neighbour - base, "removing a party made the counter take in someone else's update"
    allowed = Counter()
    for r in mine:
        if isinstance(r, dict) and r.get("item") in ITEMS and r.get("op") in ("insert", "delete") and type(r.get("ts")) is int:
            allowed += own_updates(r, unit)
    assert not removed - allowed, f"removed {removed - allowed} that the party did not write"
    assert sum(removed.values()) <= (3 if unit else 1)
