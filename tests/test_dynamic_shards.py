"""Shards of a dynamic query (issue 33, item 2: each partition's mechanism covers its own items;
docs/privacy.md, "Shards").

A query with ``shards: K`` splits its items, in declared order, into K fixed shards (item i in
shard i % K), each with a mechanism of its own. What a user relies on: each shard's releases are
exactly those of a mechanism over that shard's items and updates alone (so where a shard is
computed cannot change them); one more or one fewer update changes one shard's input by that
update and nothing else; the releases do not depend on how the ticks are decided (in one call or
many); one shard is the query as it was before shards, byte for byte; and a restart publishes
what the uninterrupted run publishes.
"""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dpstream.accountant.dynamic import DynamicPlan
from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.mechanisms.dynamic import DynamicCounter, ShardedCounter
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.state.store import MemoryStore, RocksDBStore
from dpstream.state.tables import encode_snapshot
from tests.conftest import TEST_SECRET
from tests.test_dynamic_stream import make, run, stream

ITEMS = [f"x{i}" for i in range(7)]
NOISE = NodeNoise(TEST_SECRET, "shards")
MECHANISMS = ["baseline", "interval_tree"]


def plan(mechanism: str, epsilon: float = 1.0) -> DynamicPlan:
    return DynamicPlan(epsilon, 0.0, 0.05, 0.25, mechanism)


def columns(updates):
    """(item, insert, tick) tuples in feeding order -> the three arrays decide() takes."""
    if not updates:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
    items, inserts, ticks = zip(*updates)
    return np.array(items, dtype=np.int64), np.array(inserts, dtype=bool), np.array(ticks, dtype=np.int64)


def view(releases) -> list:
    return [(r.shard, r.sequence, r.segment, r.position, r.counts.tolist(), r.exact.tolist(), r.noise_scales) for r in releases]


# a stream: (item, insert?, tick gap), ticks never going back; deletes of absent items included
stream_strategy = st.lists(st.tuples(st.integers(0, len(ITEMS) - 1), st.booleans(), st.integers(0, 2)), min_size=1, max_size=300)


def ticked(raw) -> list[tuple[int, bool, int]]:
    tick, out = 1, []
    for item, insert, gap in raw:
        tick += gap
        out.append((item, insert, tick))
    return out


@pytest.mark.parametrize("mechanism", MECHANISMS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=stream_strategy, shards=st.integers(1, len(ITEMS)), epsilon=st.sampled_from([0.5, 8.0]))
def test_each_shard_releases_what_a_mechanism_over_its_items_alone_releases(mechanism, raw, shards, epsilon):
    """Shard k's releases are those of a DynamicCounter over items k, k + K, ... fed that shard's
    updates only, with the shard's own noise: no other shard's updates reach it, in any way."""
    updates = ticked(raw)
    last = updates[-1][2] + 30
    sharded = ShardedCounter(plan(mechanism, epsilon), ITEMS, NOISE, "q", shards)
    got = sharded.decide(*columns(updates), last)
    for k in range(shards):
        alone = DynamicCounter(plan(mechanism, epsilon), ITEMS[k::shards], NOISE, "q" if shards == 1 else f"q#shard{k}")
        mine = [(x // shards, ins, t) for x, ins, t in updates if x % shards == k]
        expected = alone.apply_many(*columns(mine)) + alone.advance_to(last + 1) if mine else alone.advance_to(last + 1)
        theirs = [r for r in got if r.shard == k]
        assert [(r.segment, r.position, r.counts.tolist(), r.noise_scales) for r in theirs] == \
            [(r.segment, r.position, r.counts.tolist(), r.noise_scales) for r in expected]
    # numbered in (position, shard) order
    assert [r.sequence for r in got] == list(range(1, len(got) + 1)) or shards == 1
    assert [(r.position, r.shard) for r in got] == sorted((r.position, r.shard) for r in got)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=stream_strategy, shards=st.integers(2, 4), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_releases_do_not_depend_on_how_the_ticks_are_decided(mechanism, raw, shards, cuts):
    """Deciding the ticks in one call or in several (at any ticks), with each call's updates, gives
    the same numbered releases: the worker's timer and replay decide at different times."""
    updates = ticked(raw)
    last = updates[-1][2] + 20
    whole = ShardedCounter(plan(mechanism), ITEMS, NOISE, "q", shards).decide(*columns(updates), last)
    steps = ShardedCounter(plan(mechanism), ITEMS, NOISE, "q", shards)
    got, done = [], 0
    for cut in sorted(set(c % (last + 1) for c in cuts)) + [last]:
        if cut <= done:
            continue
        due = [u for u in updates if done < u[2] <= cut]
        got += steps.decide(*columns(due), cut)
        done = cut
    assert view(got) == view(whole)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=stream_strategy, shards=st.integers(2, 5), extra=st.tuples(st.integers(0, len(ITEMS) - 1), st.booleans()),
       where=st.floats(0, 1))
def test_one_more_update_changes_one_shards_input_by_that_update_only(mechanism, raw, shards, extra, where):
    """Parallel composition: a neighbouring stream (one more update, anywhere) gives every other
    shard the identical input, so identical releases; the update's own shard is the only one
    whose mechanism sees a difference, and that difference is the one update (its counter's
    neighbour relation: docs/privacy.md, "Dynamic counts")."""
    updates = ticked(raw)
    at = int(where * len(updates))
    tick = updates[at - 1][2] if at else 1
    neighbour = updates[:at] + [(extra[0], extra[1], tick)] + updates[at:]
    last = updates[-1][2] + 20
    fed: list[dict] = []
    for stream_ in (updates, neighbour):
        counter = ShardedCounter(plan(mechanism), ITEMS, NOISE, "q", shards)
        inputs = {}
        for k, shard in counter.counters.items():
            take = shard.apply_many

            def spy(items, inserts, ticks, k=k, take=take):
                inputs.setdefault(k, []).extend(zip(np.asarray(ticks).tolist(), np.asarray(items).tolist(),
                                                    np.asarray(inserts).tolist()))
                return take(items, inserts, ticks)

            shard.apply_many = spy
        releases = counter.decide(*columns(stream_), last)
        fed.append({"inputs": inputs, "releases": {k: view([r for r in releases if r.shard == k]) for k in range(shards)}})
    own = extra[0] % shards
    for k in range(shards):
        if k != own:
            assert fed[0]["inputs"].get(k, []) == fed[1]["inputs"].get(k, [])
            # (their global numbers may shift: the own shard may release once more or less)
            assert [r[2:] for r in fed[0]["releases"][k]] == [r[2:] for r in fed[1]["releases"][k]]
    a, b = fed[0]["inputs"].get(own, []), fed[1]["inputs"].get(own, [])
    assert len(b) == len(a) + 1
    added = (tick, extra[0] // shards, extra[1])
    assert sorted(b) == sorted(a + [added])


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_one_shard_is_the_plain_counter_byte_for_byte(mechanism):
    """shards: 1 (the default) is the query as it was: the counter under the query's own noise
    name, the same releases (numbered by segment) and the same snapshot bytes."""
    updates = ticked([(int(i) % 7, bool(i % 3), int(i) % 2) for i in np.random.default_rng(1).integers(0, 50, 400)])
    last = updates[-1][2] + 20
    sharded = ShardedCounter(plan(mechanism), ITEMS, NOISE, "q", 1)
    plain = DynamicCounter(plan(mechanism), ITEMS, NOISE, "q")
    got = sharded.decide(*columns(updates), last)
    expected = plain.apply_many(*columns(updates)) + plain.advance_to(last + 1)
    assert len(got) > 3
    assert [v[:1] + v[2:] for v in view(got)] == [v[:1] + v[2:] for v in view(expected)]
    assert [r.sequence for r in got] == [r.segment for r in got]
    assert encode_snapshot(sharded.snapshot()) == encode_snapshot(plain.snapshot())


def test_shards_draw_independent_noise():
    """Two shards fed the same counts must not share noise (their difference would be exact)."""
    counter = ShardedCounter(plan("baseline", 0.5), ["a", "b"], NOISE, "q", 2)
    updates = [(x, True, t) for t in range(1, 400) for x in (0, 1)]
    releases = counter.decide(*columns(updates), 420)
    by_shard = {k: [r.counts[0] - r.exact[0] for r in releases if r.shard == k] for k in (0, 1)}
    assert by_shard[0] and by_shard[0] != by_shard[1][:len(by_shard[0])]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_sharded_releases_survive_a_restart_and_name_their_shard(tmp_path, mechanism):
    """Through the agent's state: each release names its shard and the shards, counts only its
    shard's items, and a restart from RocksDB publishes exactly the uninterrupted run's
    releases (the published marker counts releases of every shard)."""
    records = stream(8_000, seed=6)
    ref_store = MemoryStore()
    reference = run(make(ref_store, mechanism=mechanism, shards=3), records, ref_store)
    assert {r["shard"] for r in reference} == {0, 1, 2} and all(r["shards"] == 3 for r in reference)
    items = ["a", "b", "c", "d"]
    for r in reference:
        assert list(r["counts"]) == items[r["shard"]::3]
    store = RocksDBStore(tmp_path / "s")
    got = run(make(store, mechanism=mechanism, shards=3), records[:4_000], store)
    store.close()
    store = RocksDBStore(tmp_path / "s")
    got += run(make(store, mechanism=mechanism, shards=3), records[4_000:], store)
    store.close()
    assert [json.dumps(r, sort_keys=True) for r in got] == [json.dumps(r, sort_keys=True) for r in reference]


def test_shards_are_pinned_and_bounded_by_the_items():
    base = dict(name="q", items=["a", "b", "c"], epsilon=1.0, start=0)
    with pytest.raises(ValidationError, match=r"shards: at most the number of items \(3\), got 4"):
        DynamicQueryConfig(**base, shards=4)
    with pytest.raises(ValidationError):
        DynamicQueryConfig(**base, shards=0)
    one, three = DynamicQueryConfig(**base), DynamicQueryConfig(**base, shards=3)
    assert one.fingerprint() == DynamicQueryConfig(**base, shards=1).fingerprint() != three.fingerprint()
    assert three.pins()["shards"] == 3
    # each shard runs at the query's epsilon: the plan, and so the charge, does not change
    assert one.plan() == three.plan() and three.plan().epsilon_spent == 1.0
