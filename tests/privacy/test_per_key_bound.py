"""The per-key bound (``per_key_bound: c_k``): a user adds at most c_k records to any key.

The accountant charges the perturbation sqrt(C c_k) L instead of C L on this promise, so it must
hold through the real stage 1 (QueryPipeline.bound) for any arrival order, any split into
micro-batches (state carried between them in the store), restarts, duplicated lines, and users
with many records on one key. And the charge must cover what one user can actually change
(through the whole pipeline, for c_k 2 and 4: tests/privacy/test_per_key_counts.py).
"""
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.accountant.calibration import read_levels
from dpstream.accountant.plan import BudgetError, QueryBudget, perturbation_squares, plan_query
from dpstream.processor.config import QueryConfig
from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
from dpstream.processor.mechanisms.bounding import first_for_key, within_key_bound
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from tests.conftest import TEST_SECRET

DAY = 86_400_000
START = 1_795_132_800_000


def _query(C, per_key_bound=1, **kw):
    return QueryConfig(name="pk", window="1d", triggers=8, contribution_bound=C, epsilon=6.0, delta=1e-9,
                       allowed_lateness="0s", per_key_bound=per_key_bound, **kw)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), C=st.integers(1, 6), users=st.integers(1, 6), keys=st.integers(1, 5))
def test_stage_one_admits_each_users_first_record_per_key_up_to_c(data, C, users, keys):
    """Through QueryPipeline.bound over several micro-batches: the admitted records are, per user,
    the first record of each key in arrival order, the first C of those; never two for a key."""
    n = data.draw(st.integers(1, 60))
    rows = data.draw(st.lists(st.tuples(st.integers(0, users - 1), st.integers(0, keys - 1), st.integers(0, 7)),
                              min_size=n, max_size=n))
    if data.draw(st.booleans()):
        rows = rows + rows  # every line twice
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(rows) - 1)), max_size=4))))
    pseudo = Pseudonymizer(TEST_SECRET)
    pipe = QueryPipeline(_query(C), NodeNoise(TEST_SECRET), MemoryStore(), pseudo)
    admitted = []
    for lo, hi in zip([0] + cuts, cuts + [len(rows)]):
        part = rows[lo:hi]
        if not part:
            continue
        key_text = [f"k{k}" for _, k, _ in part]
        ts = np.array([START + t * (DAY // 8) for _, _, t in part], dtype=np.int64)
        cols = EventColumns(pseudo.users([f"u{u}" for u, _, _ in part]), np.array(key_text, dtype=object),
                            pseudo.group_keys(key_text), np.ones(len(part)), ts)
        batch = WriteBatch()
        out = pipe.bound(cols, ts, batch)  # each event arrives at its own time
        pipe.store.write(batch)
        admitted += list(zip(out.users.tolist(), out.keys.tolist()))
    # the rule, computed plainly: per user, first record of each key, in arrival order, first C
    firsts = {}
    for u, k, _ in rows:
        mine = firsts.setdefault(u, [])
        if f"k{k}" not in mine and len(mine) < C:
            mine.append(f"k{k}")
    users_of = dict(zip(pseudo.users([f"u{u}" for u in range(users)]).tolist(), range(users)))
    got = {}
    for user, key in admitted:
        got.setdefault(users_of[user], []).append(key)
    assert {u: sorted(v) for u, v in got.items()} == {u: sorted(v) for u, v in firsts.items() if v}
    assert all(len(v) == len(set(v)) <= C for v in got.values())
    dropped = pipe.stats.dropped
    assert dropped["per_key_bound"] + dropped["contribution_bound"] + len(admitted) == len(rows)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), C=st.integers(2, 8), users=st.integers(1, 4), keys=st.integers(1, 4))
def test_stage_one_admits_each_users_first_ck_records_per_key_up_to_c(data, C, users, keys):
    """c_k from 2 to C through QueryPipeline.bound over several micro-batches, with restarts (a
    fresh pipeline on the same store) between some of them and lines repeated: the admitted
    records are, per user, the first c_k records of each key in arrival order, the first C of
    those; never more than c_k of a key."""
    ck = data.draw(st.integers(2, C))
    n = data.draw(st.integers(1, 60))
    rows = data.draw(st.lists(st.tuples(st.integers(0, users - 1), st.integers(0, keys - 1), st.integers(0, 7)),
                              min_size=n, max_size=n))
    if data.draw(st.booleans()):
        rows = rows + rows  # every line twice
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(rows) - 1)), max_size=5))))
    pseudo = Pseudonymizer(TEST_SECRET)
    store = MemoryStore()
    query = _query(C, per_key_bound=ck)
    pipe = QueryPipeline(query, NodeNoise(TEST_SECRET), store, pseudo)
    admitted, dropped = [], 0
    for lo, hi in zip([0] + cuts, cuts + [len(rows)]):
        part = rows[lo:hi]
        if not part:
            continue
        if data.draw(st.booleans()):  # a restart: stage 1 reads what it admitted from the store
            dropped += sum(pipe.stats.dropped.values())
            pipe = QueryPipeline(query, NodeNoise(TEST_SECRET), store, pseudo)
        key_text = [f"k{k}" for _, k, _ in part]
        ts = np.array([START + t * (DAY // 8) for _, _, t in part], dtype=np.int64)
        cols = EventColumns(pseudo.users([f"u{u}" for u, _, _ in part]), np.array(key_text, dtype=object),
                            pseudo.group_keys(key_text), np.ones(len(part)), ts)
        batch = WriteBatch()
        out = pipe.bound(cols, ts, batch)
        store.write(batch)
        admitted += list(zip(out.users.tolist(), out.keys.tolist(), out.trigger.tolist()))
    dropped += sum(pipe.stats.dropped.values())
    # the rule, computed plainly: per user, in arrival order, the first c_k records of each key, the first C of those
    want: dict = {}
    seen: dict = {}
    for u, k, t in rows:
        m = seen.get((u, k), 0)
        seen[(u, k)] = m + 1
        mine = want.setdefault(u, [])
        if m < ck and len(mine) < C:
            mine.append((f"k{k}", t + 1))
    users_of = dict(zip(pseudo.users([f"u{u}" for u in range(users)]).tolist(), range(users)))
    got: dict = {}
    for user, key, trigger in admitted:
        got.setdefault(users_of[user], []).append((key, trigger))
    assert {u: sorted(v) for u, v in got.items()} == {u: sorted(v) for u, v in want.items() if v}
    for v in got.values():
        assert len(v) <= C
        assert max(np.unique([key for key, _ in v], return_counts=True)[1]) <= ck
    assert dropped + len(admitted) == len(rows)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=30),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=16), st.integers(1, 5))
def test_within_key_bound_matches_a_plain_loop(batch, state, bound):
    """The state is a multiset (one entry per admitted record, grouped by group); at bound 1 on a
    set it is first_for_key."""
    state = sorted(state, key=lambda e: e[0])
    args = (np.array([g for g, _ in batch], dtype=np.int64), np.array([k for _, k in batch], dtype=np.uint64),
            np.array([g for g, _ in state], dtype=np.int64), np.array([k for _, k in state], dtype=np.uint64))
    got = within_key_bound(*args, bound)
    seen: dict = {}
    for pair in state:
        seen[pair] = seen.get(pair, 0) + 1
    want = []
    for pair in batch:
        want.append(seen.get(pair, 0) < bound)
        seen[pair] = seen.get(pair, 0) + 1
    assert got.tolist() == want
    distinct = sorted(set(state))
    set_args = args[:2] + (np.array([g for g, _ in distinct], dtype=np.int64), np.array([k for _, k in distinct], dtype=np.uint64))
    assert within_key_bound(*set_args, 1).tolist() == first_for_key(*set_args).tolist()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=30),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=12))
def test_first_for_key_matches_a_plain_loop(batch, state):
    state = sorted(set(state))
    got = first_for_key(np.array([g for g, _ in batch], dtype=np.int64), np.array([k for _, k in batch], dtype=np.uint64),
                        np.array([g for g, _ in state], dtype=np.int64), np.array([k for _, k in state], dtype=np.uint64))
    seen = set(state)
    want = []
    for pair in batch:
        want.append(pair not in seen)
        seen.add(pair)
    assert got.tolist() == want


@pytest.mark.parametrize("seed", range(40))
def test_one_users_change_is_within_the_charge(seed):
    """One user with c_k = 1: at most one record (|value| <= L) per key, C keys. Over every read
    node of every key's perturbation tree the squared change is at most h C L^2, the charge
    h (sqrt(C c_k) L)^2; adversarial draws put the user's records at one trigger on distinct keys
    with value +-L (the worst case, attained)."""
    rng = np.random.default_rng(seed)
    T, C, L = 16, 5, 1.0
    h = read_levels(T)
    plan = plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=T, contribution_bound=C, per_key_bound=1))
    keys = rng.choice(40, size=C, replace=False)
    trigger = rng.integers(1, T + 1, size=C) if seed % 2 else np.full(C, 1)
    values = rng.choice([-L, L], size=C)
    total = 0.0
    for key, t, v in zip(keys, trigger, values):
        leaves = np.zeros(T)
        leaves[t - 1] = v
        for level in range(h):
            width = 1 << level
            nodes = leaves[: (T // width) * width].reshape(-1, width).sum(axis=1)
            total += float((nodes ** 2).sum())
    assert total <= h * C * plan.per_key_bound * L ** 2
    if seed % 2 == 0:
        assert total == h * C * L ** 2  # attained: every record at leaf 1 is in a read node of every level
    assert plan.sigma_perturbation == pytest.approx(math.sqrt(C) * math.sqrt(h / (2 * plan.rho_perturbation)), rel=1e-12)


def test_per_key_bound_is_refused_outside_1_to_c_and_with_a_hierarchy():
    """c_k must be an integer in [1, C] (a bound above C bounds nothing, and a typo should not
    pass as one), naming the field; the hierarchy's shared slots are not bounded per key."""
    for bad in (0, -1, 5, 2.5, 2.0, True, "2"):
        with pytest.raises(BudgetError) as err:
            plan_query(QueryBudget(epsilon=1.0, delta=1e-6, triggers=8, contribution_bound=4, per_key_bound=bad))
        assert err.value.field == "per_key_bound"
        assert "contribution_bound" in str(err.value)
    for ok in (1, 2, 3, 4):
        assert plan_query(QueryBudget(epsilon=1.0, delta=1e-6, triggers=8, contribution_bound=4, per_key_bound=ok)).per_key_bound == ok
    with pytest.raises(BudgetError) as err:
        plan_query(QueryBudget(epsilon=1.0, delta=1e-6, triggers=8, contribution_bound=4, per_key_bound=2, hierarchy_depth=2))
    assert err.value.field == "per_key_bound"
    with pytest.raises(BudgetError) as err:  # weights need a record's slot to be its key's rank: c_k = 1
        plan_query(QueryBudget(epsilon=1.0, delta=1e-6, triggers=8, contribution_bound=4, per_key_bound=2, selection_weights=(2, 1)))
    assert err.value.field == "selection_weights"


@pytest.mark.parametrize("C", range(1, 13))
def test_the_charged_squares_cover_every_user_and_are_attained_when_ck_divides_c(C):
    """Brute force over every vector of per-key record counts n_j <= c_k with sum <= C: the
    largest sum of n_j^2 is floor(C/c_k) c_k^2 + (C mod c_k)^2 (the pattern the exact discrete
    curve charges), at most C c_k (what every sigma is calibrated to), equal when c_k divides C."""
    def vectors(total, cap):  # non-increasing vectors of positive parts <= cap summing to <= total
        yield ()
        for first in range(min(total, cap), 0, -1):
            for rest in vectors(total - first, first):
                yield (first,) + rest

    for ck in range(1, C + 1):
        worst = max(sum(n * n for n in v) for v in vectors(C, ck))
        assert worst == (C // ck) * ck * ck + (C % ck) ** 2
        assert worst <= perturbation_squares(C, ck) == C * ck
        assert (worst == C * ck) == (C % ck == 0)
    assert perturbation_squares(C, None) == C * C


@pytest.mark.parametrize("ck", [2, 3, 4])
@pytest.mark.parametrize("T", [24, 100])
def test_per_key_bound_plans_meet_the_budget_by_dp_accounting(ck, T):
    """zCDP with the tree: key selection is C h Gaussians of sensitivity 1, perturbation h of L2
    sensitivity sqrt(C c_k) L (the plan's own number); dp_accounting's RDP and PLD accountants
    of that composition stay within epsilon at the plan's conversion delta, and 3% less noise
    would not (the charge is not needlessly large)."""
    C, L = 32, 1.0
    plan = plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=T, contribution_bound=C, per_key_bound=ck, composition="zcdp",
                                  counter="binary_tree"))
    h = plan.tree_height
    assert plan.perturbation_l2_sensitivity == pytest.approx(math.sqrt(C * ck) * L, rel=1e-15)
    assert plan.sigma_perturbation == pytest.approx(math.sqrt(C * ck) * L * math.sqrt(h / (2 * plan.rho_perturbation)), rel=1e-12)
    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.sigma_key_selection), C * h),
              dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.sigma_perturbation / plan.perturbation_l2_sensitivity), h)]
    rdp, pld = RdpAccountant(), PLDAccountant()
    for e in events:
        rdp.compose(e)
        pld.compose(e)
    assert rdp.get_epsilon(plan.delta_conversion) <= 6.0 * 1.001
    assert pld.get_epsilon(plan.delta_conversion) <= 6.0
    tighter = PLDAccountant()
    tighter.compose(events[0])
    tighter.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(0.97 * plan.sigma_perturbation / plan.perturbation_l2_sensitivity), h))
    tighter.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.97 * plan.sigma_key_selection), C * h))
    assert tighter.get_epsilon(plan.delta_conversion) > 6.0


def test_per_key_bound_shrinks_only_the_perturbation_noise():
    base = dict(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32)
    for counter in ("binary_tree", "blt"):
        off = plan_query(QueryBudget(counter=counter, **base))
        on = plan_query(QueryBudget(counter=counter, per_key_bound=1, **base))
        assert on.sigma_key_selection == off.sigma_key_selection
        # exactly 1/sqrt(C) for the tree; the BLT's rounding slack does not shrink with c_k
        assert on.sigma_perturbation / off.sigma_perturbation == pytest.approx(1 / math.sqrt(32), rel=1e-12 if counter == "binary_tree" else 3e-3)
        for ck in (2, 4, 8, 32):  # sqrt(c_k / C)
            at = plan_query(QueryBudget(counter=counter, per_key_bound=ck, **base))
            assert at.sigma_key_selection == off.sigma_key_selection
            assert at.sigma_perturbation / off.sigma_perturbation == pytest.approx(math.sqrt(ck / 32), rel=1e-12 if counter == "binary_tree" else 3e-3)


# --------------------------------------------------------------------------- weighted key selection

WEIGHTS = (3, 2, 2, 1)  # sum of squares 18 <= C = 20 below


def _participations(events, C=20, T=8, weights=WEIGHTS):
    """Run every trigger of one window through the real pipeline; each key's cumulative weighted
    key-selection count (the ``participations`` column of its key row)."""
    pseudo = Pseudonymizer(TEST_SECRET)
    query = QueryConfig(name="w", window="1d", triggers=T, contribution_bound=C, epsilon=6.0, delta=1e-9, allowed_lateness="0s",
                        per_key_bound=1, selection_weights=list(weights))
    pipe = QueryPipeline(query, NodeNoise(TEST_SECRET), MemoryStore(), pseudo)
    key_text = [k for _, k, _ in events]
    ts = np.array([t for _, _, t in events], dtype=np.int64)
    cols = EventColumns(pseudo.users([u for u, _, _ in events]), np.array(key_text, dtype=object), pseudo.group_keys(key_text),
                        np.ones(len(events)), ts)
    batch = WriteBatch()
    pipe.accumulate(pipe.bound(cols, ts, batch), 1, batch)
    pipe.store.write(batch)
    for trigger in range(1, T):  # the last trigger closes the window (and drops its key rows)
        pipe.fire(START, trigger)
    ids, rows = pipe.tables.keys.scan(START)
    assert len(ids)
    return dict(zip(ids.tolist(), rows["participations"].astype(np.int64).tolist()))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32), extra=st.integers(1, 40), shuffle=st.booleans())
def test_one_user_moves_weighted_selection_counts_by_at_most_the_weights(seed, extra, shuffle):
    """Weighted key selection through the real stages: adding one user (many records, repeats of
    keys, any arrival order, its records duplicated) changes each key's weighted selection count
    by 0 or one weight of a distinct slot, so the squared change over keys is at most
    sum_j w_j^2: what the accountant charges for key selection."""
    rng = np.random.default_rng(seed)
    T, interval = 8, DAY // 8
    span = (T - 1) * interval  # records in triggers 1..T-1 (see _participations)
    others = [(f"u{int(rng.integers(0, 30))}", f"k{int(rng.integers(0, 12))}", START + int(rng.integers(0, span))) for _ in range(300)]
    mine = [("adversary", f"k{int(rng.integers(0, 15))}", START + int(rng.integers(0, span))) for _ in range(extra)]
    mine = mine + mine[: extra // 2]  # repeated lines
    if shuffle:
        rng.shuffle(mine)
    base = sorted(others, key=lambda e: e[2])
    plus = sorted(others + mine, key=lambda e: e[2]) if not shuffle else base + mine
    if shuffle:  # the adversary's records arrive last and out of order; the clock is each record's time
        plus = sorted(others, key=lambda e: e[2]) + [(u, k, max(t, START + (T - 2) * interval)) for u, k, t in mine]
    a, b = _participations(base, T=T), _participations(plus, T=T)
    diffs = [b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)]
    nonzero = sorted(d for d in diffs if d)
    assert all(d > 0 for d in nonzero)
    assert sum(d * d for d in nonzero) <= sum(w * w for w in WEIGHTS)
    # distinct slots: the changes are a sub-multiset of the weights
    remaining = list(WEIGHTS)
    for d in nonzero:
        assert d in remaining
        remaining.remove(d)


def test_weighted_plan_charges_the_weights():
    base = dict(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32, per_key_bound=1)
    plain = plan_query(QueryBudget(**base))
    weighted = plan_query(QueryBudget(selection_weights=(4, 2, 2, 2, 1, 1, 1, 1), **base))  # sum of squares 32 = C
    assert weighted.sigma_key_selection == pytest.approx(plain.sigma_key_selection, rel=1e-12)
    doubled = plan_query(QueryBudget(selection_weights=(8, 4, 4, 4, 2, 2, 2, 2), **base))  # 4 C: twice the noise
    assert doubled.sigma_key_selection == pytest.approx(2 * plain.sigma_key_selection, rel=1e-12)
    for bad in ((), (0, 0), (1.5,), tuple([1] * 33), (-1,)):
        with pytest.raises(BudgetError) as err:
            plan_query(QueryBudget(selection_weights=bad, **base))
        assert err.value.field == "selection_weights"
    with pytest.raises(BudgetError) as err:
        plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32, selection_weights=(2, 2)))
    assert err.value.field == "selection_weights"
