"""Per-key bounds above 1 (``per_key_bound: c_k``, 1 < c_k < C): adversarial tests through the
real stages (docs/privacy.md, "Per-key bound").

Stage 1 keeps, per (user, window), one state entry per admitted record, so it counts a user's
admitted records of each key; only the first c_k of a key (in arrival order) compete for the
user's C slots. The accountant charges the perturbation an L2 sensitivity of sqrt(C c_k) L on
that promise. These tests attack it with the worst neighbours (many records on few keys, many
keys with few records, c_k + 1 records on every key, one line repeated), under random arrival
orders, micro-batches, restarts from the store and duplicated stage-1 output, across triggers and
a window boundary, and through replay resumed from a RocksDB state directory. The measured change
of every key's true (released + buffered) value when one user is removed stays within the
accountant's sensitivity, and reaches it when c_k divides C.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpstream.processor.config import DpstreamConfig, QueryConfig
from dpstream.processor.engine.pipeline import QueryPipeline
from dpstream.processor.preview import _columns
from dpstream.state.store import MemoryStore, WriteBatch
from tests.privacy._helpers import events as helper_events
from tests.privacy._helpers import query as helper_query
from tests.privacy._helpers import replay, write_jsonl
from tests.privacy.test_arrival_order import (
    DAY,
    INTERVAL,
    NOISE,
    PROPERTY,
    PSEUDO,
    START,
    Delivery,
    Rec,
    T,
    admitted_table,
    check_exact_round_counts,
    columns,
    drive,
    make_query,
    random_schedule,
    streams,
)

C = 8
NEIGHBOURS = ["c_k on C / c_k keys, one trigger", "2C on one key", "2C on two keys, spread", "one each on 2C keys",
              "c_k + 1 on C keys", "one line 2C times"]


def key_texts(stream_keys) -> dict[int, str]:
    texts = sorted(set(stream_keys) | {f"n{j}" for j in range(2 * C)})
    return dict(zip(PSEUDO.group_keys(texts).tolist(), texts))


def neighbour_records(kind: str, ck: int, trig: int, value: float) -> list[Rec]:
    """The neighbour's records, in the order they are offered (the schedule then mixes them in)."""
    at = START + (trig - 1) * INTERVAL
    if kind == "c_k on C / c_k keys, one trigger":  # the charged pattern, attained
        return [Rec("neighbour", f"n{j // ck}", at + 7 * j, value) for j in range(C)]
    if kind == "2C on one key":
        return [Rec("neighbour", "n0", at + 7 * j, value) for j in range(2 * C)]
    if kind == "2C on two keys, spread":
        return [Rec("neighbour", f"n{j % 2}", START + (j % T) * INTERVAL + 11 * j, value * (-1) ** j) for j in range(2 * C)]
    if kind == "one each on 2C keys":
        return [Rec("neighbour", f"n{j}", START + (j % T) * INTERVAL + 13 * j, value) for j in range(2 * C)]
    if kind == "c_k + 1 on C keys":
        return [Rec("neighbour", f"n{j % C}", START + (j % T) * INTERVAL + 17 * j, value) for j in range(C * (ck + 1))]
    return [Rec("neighbour", "n0", at + 5, value)] * (2 * C)  # the same line again and again


def with_neighbour(schedule: list[list[Delivery]], mine: list[Rec], seed: int) -> list[list[Delivery]]:
    """The schedule with the neighbour's records in random deliveries of slots before their
    triggers fire (random positions: any arrival order), everything else as it was."""
    rng = np.random.default_rng(seed)
    out = [[Delivery(list(d.records), d.clock, d.crash_before, d.duplicate, d.duplicate_slot) for d in slot] for slot in schedule]
    for r in mine:
        slot = int(rng.integers(0, r.trigger))
        if out[slot]:
            d = out[slot][int(rng.integers(0, len(out[slot])))]
            d.records.insert(int(rng.integers(0, len(d.records) + 1)), r)
        else:
            out[slot].append(Delivery([r], START + slot * INTERVAL))
    return out


def arrival_order(schedule: list[list[Delivery]], user: str) -> list[Rec]:
    return [r for slot in schedule for d in slot for r in d.records if r.user == user]


@PROPERTY
@given(stream=streams(max_per_user=2 * C), seed=st.integers(0, 2 ** 32), kind=st.sampled_from(NEIGHBOURS),
       trig=st.integers(1, T), aggregate=st.sampled_from(["count", "sum"]))
@pytest.mark.parametrize("ck", [2, 4])
def test_removing_the_worst_neighbour_moves_true_values_within_the_charge(ck, stream, seed, kind, trig, aggregate):
    """With and without one neighbour, everyone else's records under the same random arrival
    order, batches, restarts and duplicated stage-1 output: the neighbour's admitted records are
    exactly the first c_k per key of its arrivals, the first C of those; after every trigger each
    key's released + buffered value moves by at most c_k M, all keys by at most C M in L1 and by
    at most the accountant's sqrt(C c_k) L (in grid steps) in L2, and by exactly that when the
    neighbour puts c_k on each of C / c_k keys at one trigger; a round tree alive in both runs
    moves by 0 or 1."""
    L = 2.0 if aggregate == "sum" else 1.0
    extra = dict(aggregate="sum", value_field="v", clamp=L) if aggregate == "sum" else {}
    query = make_query(contribution_bound=C, per_key_bound=ck, **extra)
    plan = QueryPipeline(query, NOISE, MemoryStore(), PSEUDO).plan
    M = plan.clamp_units
    texts = key_texts(stream.keys)
    base = random_schedule(stream.records, seed)
    mine = neighbour_records(kind, ck, trig, 10 * L)
    plus = with_neighbour(base, mine, seed + 1)
    without, with_user = drive(query, base, texts), drive(query, plus, texts)
    check_exact_round_counts(with_user)
    # stage 1 admitted the first c_k per key, then the first C, of the neighbour's arrivals
    want, seen = [], {}
    for r in arrival_order(plus, "neighbour"):
        seen[r.key] = seen.get(r.key, 0) + 1
        if seen[r.key] <= ck and len(want) < C:
            want.append((int(PSEUDO.group_keys([r.key])[0]), r.trigger))
    adm = admitted_table(with_user)
    theirs = adm["users"] == PSEUDO.users(["neighbour"])[0]
    assert sorted(zip(adm["key_ids"][theirs].astype(np.uint64).tolist(), adm["trigger"][theirs].astype(int).tolist())) == sorted(want)
    assert theirs.sum() <= C
    assert np.unique(adm["key_ids"][theirs], return_counts=True)[1].max(initial=0) <= ck
    # the accountant's sensitivity, in grid steps of one record's bound
    charge = (plan.perturbation_l2_sensitivity / plan.clamp) ** 2 * M * M
    assert charge == pytest.approx(C * ck * M * M, rel=1e-12)
    for t in range(T):
        before, after = without.snapshots[t], with_user.snapshots[t]
        diff = [after[k][3] - before[k][3] for k in before]
        assert max(abs(d) for d in diff) <= ck * M
        assert sum(abs(d) for d in diff) <= C * M
        assert sum(d * d for d in diff) <= charge * (1 + 1e-12), (t, kind)
        for k in before:
            if after[k][:2] == before[k][:2]:
                assert after[k][2] - before[k][2] in (0, 1), (t, k)
    if kind == "c_k on C / c_k keys, one trigger":
        final = [with_user.snapshots[-1][k][3] - without.snapshots[-1][k][3] for k in texts]
        assert sum(d * d for d in final) == C * ck * M * M  # attained: the charge is not loose here


@pytest.mark.parametrize("ck", [2, 3])
def test_the_count_per_key_spans_triggers_and_restarts_and_resets_with_the_window(ck):
    """One user's records of key "a", one per stage-1 batch at triggers 5, 5, 1, 3, ... (out of
    order, two in one trigger), a restart (a fresh pipeline on the same store: a worker restarted from its state)
    before every batch: the first c_k to arrive are admitted, whatever their triggers, then
    nothing of "a"; key "b" has its own count; the next window counts from 0 again."""
    query = make_query(contribution_bound=C, per_key_bound=ck)
    store = MemoryStore()
    triggers = [5, 5, 1, 3, 2, 7, 4, 6, 1]
    arrivals = [Rec("u", "a", START + (t - 1) * INTERVAL + 100 + j) for j, t in enumerate(triggers)]
    arrivals.insert(3, Rec("u", "b", START + 2 * INTERVAL + 50))
    arrivals += [Rec("u", "a", START + DAY + j * INTERVAL + 1) for j in range(ck + 2)]  # the next window
    got = []
    for r in arrivals:
        pipe = QueryPipeline(query, NOISE, store, PSEUDO)
        batch = WriteBatch()
        out = pipe.bound(columns([r]), np.array([START], dtype=np.int64), batch)  # arrival before any trigger fires
        store.write(batch)
        assert not pipe.last_rejected
        got += [(k, int(w), int(t)) for k, w, t in zip(out.keys.tolist(), out.window.tolist(), out.trigger.tolist())]
        assert sum(pipe.stats.dropped.values()) + len(out) == 1
        if len(out) == 0:
            assert pipe.stats.dropped["per_key_bound"] == 1
    first = [("a", START, t) for t in triggers[:ck]]
    second = [("a", START + DAY, j + 1) for j in range(ck)]
    assert sorted(got) == sorted(first + [("b", START, 3)] + second)


def test_a_per_key_bound_of_c_bounds_nothing_more_than_c():
    """c_k = C: a user's C records on one key are all admitted, as without a per-key bound (and
    the plan charges C L, as without one)."""
    query = make_query(contribution_bound=4, per_key_bound=4)
    pipe = QueryPipeline(query, NOISE, MemoryStore(), PSEUDO)
    assert pipe.plan.perturbation_l2_sensitivity == 4.0
    recs = [Rec("u", "a", START + 10 + j) for j in range(6)]
    out = pipe.bound(columns(recs), np.full(6, START, dtype=np.int64), WriteBatch())
    assert len(out) == 4 and pipe.stats.dropped["contribution_bound"] == 2 and pipe.stats.dropped["per_key_bound"] == 0


def heavy_rows(seed: int) -> list[dict]:
    """Users with many records on few keys (every user over c_k on some key), in time order."""
    rng = np.random.default_rng(seed)
    rows = helper_events(rng, users=60, keys=5, records=1500)
    return rows


@pytest.mark.parametrize("stop_after", [1, 333, 900])
def test_replay_resumed_from_rocksdb_equals_an_uninterrupted_run(tmp_path, stop_after):
    """Replay with per_key_bound 2 stopped after some lines and resumed from its RocksDB state
    directory publishes what an uninterrupted run publishes, and admits and drops the same
    records: the restarted stage 1 reads each user's per-key counts back, so it never admits a
    third record of a key."""
    config = DpstreamConfig(queries=[helper_query(per_key_bound=2)])
    path = write_jsonl(tmp_path / "e.jsonl", heavy_rows(7))
    whole = replay(config, path, state_dir=tmp_path / "whole")
    first = replay(config, path, state_dir=tmp_path / "part", stop_after=stop_after)
    rest = replay(config, path, state_dir=tmp_path / "part")
    assert first.summary.stopped_early
    assert first.output + rest.output == whole.output
    # the same records dropped; which of the two bounds a drop is counted under may differ (a
    # user at C keeps no per-key entries: a later repeat of a key then counts as contribution_bound)
    both = lambda run: run.stats[0].dropped["per_key_bound"] + run.stats[0].dropped["contribution_bound"]  # noqa: E731
    assert both(first) + both(rest) == both(whole)
    assert first.stats[0].events_in + rest.stats[0].events_in == whole.stats[0].events_in
    assert whole.stats[0].dropped["per_key_bound"] > 0
    assert whole.releases() != replay(DpstreamConfig(queries=[helper_query()]), path).releases()  # the bound did something


def test_preview_keeps_the_records_stage_one_admits():
    """`plan --sample` bounds in line order as stage 1 does: with per_key_bound 2 the records it
    keeps (competing for a slot, among the first C) are those stage 1 admits from the same lines
    in one batch."""
    q = QueryConfig(name="p", window="1d", triggers=8, contribution_bound=5, epsilon=6.0, delta=1e-9, allowed_lateness="0s",
                    per_key_bound=2)
    rows = heavy_rows(3)
    users = [r["user_id"] for r in rows]
    keys = [r["key"] for r in rows]
    ts = np.array([r["ts"] for r in rows], dtype=np.int64)
    ev = _columns(q, users, keys, [np.ones(len(rows))], [ts])
    kept = ev.eligible & (ev.rank < q.contribution_bound)
    pipe = QueryPipeline(q, NOISE, MemoryStore(), PSEUDO)
    recs = [Rec(u, k, int(t)) for u, k, t in zip(users, keys, ts.tolist())]
    out = pipe.bound(columns(recs), ts, WriteBatch())  # each line arrives at its own time
    assert not pipe.last_rejected
    want = sorted(zip(PSEUDO.users([users[i] for i in np.nonzero(kept)[0]]).tolist(), [keys[i] for i in np.nonzero(kept)[0]],
                      ts[kept].tolist()))
    # stage 1's output has no timestamps: compare (user, key, trigger)
    assert sorted((u, k, t) for u, k, t in zip(out.users.tolist(), out.keys.tolist(), out.trigger.tolist())) == sorted(
        (u, k, int((t - START) // (DAY // 8)) + 1) for u, k, t in want)
    assert 0 < len(out) < len(rows)


def test_the_state_format_is_unchanged():
    """The multiset of a per-key bound above 1 is kept in the same user-state layout (one
    (key, trigger) entry per admitted record instead of per distinct pair), and no state written
    before could hold such a query (c_k > 1 was refused): format 5 stays, and its state
    directories keep working. A directory of another format is still refused, naming it."""
    from dpstream.processor.engine.pipeline import StateMismatchError, check_noise_epoch
    from dpstream.processor.mechanisms.noise import NodeNoise
    from dpstream.state.tables import STATE_FORMAT, EpochMarks
    from tests.conftest import TEST_SECRET

    assert STATE_FORMAT == b"5"
    store = MemoryStore()
    noise = NodeNoise(TEST_SECRET, "x")
    EpochMarks(store).put(noise.fingerprint, noise.label)
    batch = WriteBatch()
    batch.put(EpochMarks.FORMAT, b"4")
    store.write(batch)
    with pytest.raises(StateMismatchError, match="state format 4"):
        check_noise_epoch(store, noise)
