"""The accountant's sensitivity assumptions (DP-SQLP section 4.4) hold on real bounded data.

Pipeline model used here, per docs/privacy.md, "The mechanism": stage 1 admits at most C records per user
(ContributionBounder, one slot state per user); stage 2 builds, per key, (a) the key-selection
round tree's leaves: users new to the key at each trigger (a single round per key here), and
(b) the perturbation tree's leaves: the sum of admitted values (grid units) at each trigger.
Adding one user must change (a) by at most 1 per key on at most C keys, (b) by at most C*L in
L1 over all keys, hence every tree node's L2 change is within the accountant's rho.
"""
import random
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.accountant.calibration import read_levels
from dpstream.accountant.plan import QueryBudget, plan_query
from dpstream.processor.mechanisms.bounding import ContributionBounder

T = 16
C = 3
L = 2.0
RESOLUTION = 0.5
KEYS = [f"key{k}" for k in range(10)]
MAX_UNITS = int(L / RESOLUTION)


def _records(rng, user, n):
    """n records of one user: (record id, key, trigger, raw value); values exceed +-L sometimes."""
    return [
        (f"{user}/{i}".encode(), rng.choice(KEYS), rng.randint(1, T), rng.uniform(-2.5 * L, 2.5 * L))
        for i in range(n)
    ]


def _aggregate(records_by_user):
    """Leaf vectors per key: (selection: new users per trigger, perturbation: units per trigger)."""
    bounder = ContributionBounder(C, L, RESOLUTION)
    select = {k: np.zeros(T + 1, dtype=np.int64) for k in KEYS}
    perturb = {k: np.zeros(T + 1, dtype=np.int64) for k in KEYS}
    for user, records in records_by_user.items():
        records = sorted(records, key=lambda r: r[2])  # arrival order
        assigned = bounder.assign_slots(np.zeros(1, dtype=np.int64), np.zeros(len(records), dtype=np.int64))
        assert assigned.counts[0] <= C and assigned.admitted.sum() <= C
        first_seen = {}
        for (record_id, key, trigger, value), ok in zip(records, assigned.admitted):
            if not ok:
                continue
            perturb[key][trigger] += bounder.units(value)
            first_seen.setdefault(key, trigger)
        for key, trigger in first_seen.items():
            select[key][trigger] += 1
    return {k: v[1:] for k, v in select.items()}, {k: v[1:] for k, v in perturb.items()}


def _node_sums(leaves):
    """Sums over every read node: levels 0..read_levels(T)-1, complete blocks of 2^l leaves."""
    out = []
    for level in range(read_levels(T)):
        width = 1 << level
        complete = len(leaves) // width
        out.append(leaves[: complete * width].reshape(complete, width).sum(axis=1))
    return np.concatenate(out)


def _dataset(rng):
    users = {f"u{u}": _records(rng, f"u{u}", rng.randint(1, 2 * C + 2)) for u in range(8)}
    extra = _records(rng, "extra", rng.randint(C + 1, 4 * C))
    return users, extra


@lru_cache(maxsize=None)
def _plan(aggregate):
    kw = dict(aggregate="sum", clamp=L, resolution=RESOLUTION) if aggregate == "sum" else {}
    return plan_query(QueryBudget(epsilon=1.0, delta=1e-6, triggers=T, contribution_bound=C, **kw))


@pytest.mark.parametrize("seed", range(300))
def test_one_extra_user_stays_within_the_accounted_sensitivity(seed):
    rng = random.Random(seed)
    users, extra = _dataset(rng)
    if seed % 3 == 0:  # worst case: every record on one key, one trigger, at +L
        key, trigger = rng.choice(KEYS), rng.randint(1, T)
        extra = [(f"extra/{i}".encode(), key, trigger, 10 * L) for i in range(2 * C)]
    select0, perturb0 = _aggregate(users)
    select1, perturb1 = _aggregate({**users, "extra": extra})

    h = read_levels(T)
    sel_diff = {k: select1[k] - select0[k] for k in KEYS}
    per_diff = {k: perturb1[k] - perturb0[k] for k in KEYS}
    # (i) key selection: each key's round tree changes by <= 1 (one new user), on <= C keys
    assert all(np.abs(d).sum() <= 1 and (d >= 0).all() for d in sel_diff.values())
    assert sum(bool(d.any()) for d in sel_diff.values()) <= C
    # (ii) perturbation: <= C*L per key, and <= C*L summed over keys (values in grid units)
    per_l1 = {k: int(np.abs(d).sum()) for k, d in per_diff.items()}
    assert max(per_l1.values()) <= C * MAX_UNITS
    assert sum(per_l1.values()) <= C * MAX_UNITS
    # (iii) over every read node of every tree: squared L2 change <= h (C L)^2 (perturbation)
    # and <= C h (key selection): the rho the plan charges
    per_l2sq = sum(float(np.sum(_node_sums(d) ** 2)) for d in per_diff.values())
    sel_l2sq = sum(float(np.sum(_node_sums(d) ** 2)) for d in sel_diff.values())
    assert per_l2sq <= h * (C * MAX_UNITS) ** 2
    assert sel_l2sq <= C * h
    plan = _plan("sum")
    assert plan.resolution == RESOLUTION and plan.perturbation_sensitivity_units == C * MAX_UNITS
    assert plan.rho_perturbation == pytest.approx(h * (C * L) ** 2 / (2 * plan.sigma_perturbation**2), rel=1e-12)
    assert (per_l2sq * RESOLUTION**2) / (2 * plan.sigma_perturbation**2) <= plan.rho_perturbation * (1 + 1e-12)
    assert sel_l2sq / (2 * plan.sigma_key_selection**2) <= plan.rho_key_selection * (1 + 1e-12)
    if seed % 3 == 0:
        # the worst case is attained: one key, all C records (+L each) in one leaf; at leaf 1 every
        # one of the h read levels has a complete node containing it
        assert sum(per_l1.values()) == C * MAX_UNITS
        if trigger == 1:
            assert per_l2sq == h * (C * MAX_UNITS) ** 2


def test_count_plan_sensitivity():
    plan = _plan("count")
    h = read_levels(T)
    assert plan.perturbation_sensitivity_units == C
    assert plan.rho_perturbation == pytest.approx(h * C**2 / (2 * plan.sigma_perturbation**2), rel=1e-12)
    assert plan.rho_key_selection == pytest.approx(C * h / (2 * plan.sigma_key_selection**2), rel=1e-12)


# --------------------------------------------------------------------------- ContributionBounder


@pytest.mark.parametrize("seed", range(50))
def test_slots_never_exceed_c_and_continue_from_prior_counts(seed):
    """Many users, records interleaved, prior counts from earlier batches: slots are 1..C in
    arrival order per user, continuing from the prior count; nothing beyond C is admitted; and the
    assignment is a deterministic function of (prior, arrival order), which is what lets replayed
    input and replayed stage-1 output be recognised downstream."""
    rng = np.random.default_rng(seed)
    bounder = ContributionBounder(C, L, RESOLUTION)
    groups = int(rng.integers(1, 20))
    prior = rng.integers(0, C + 1, size=groups)
    group_of = rng.integers(0, groups, size=int(rng.integers(1, 10 * C)))
    a = bounder.assign_slots(prior, group_of)
    for g in range(groups):
        mine = np.nonzero(group_of == g)[0]
        expected = prior[g] + 1 + np.arange(len(mine))
        np.testing.assert_array_equal(a.slots[mine], expected)
        np.testing.assert_array_equal(a.admitted[mine], expected <= C)
        assert a.counts[g] == min(C, prior[g] + len(mine))
    b = bounder.assign_slots(prior, group_of)
    np.testing.assert_array_equal(a.slots, b.slots)
    # a second batch continues where the first stopped
    c = bounder.assign_slots(a.counts, group_of)
    assert (c.slots[c.admitted] > a.counts[group_of][c.admitted]).all()
    assert (np.minimum(a.counts, C) == a.counts).all() and (c.counts <= C).all()


def test_units_clamp_and_grid():
    bounder = ContributionBounder(C, L, RESOLUTION)  # L = 2, grid 0.5: |units| <= 4
    cases = {0.0: 0, 0.26: 1, 0.24: 0, 0.25: 0, 0.75: 2, -0.75: -2, 1.9: 4, 2.0: 4, 2.1: 4, 1e9: 4, -1e9: -4, -2.0: -4}
    for value, units in cases.items():
        assert bounder.units(value) == units, value
        assert isinstance(bounder.units(value), int)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError):
            bounder.units(bad)
    assert ContributionBounder(1, 1.0).units(0.5) == 0 and ContributionBounder(1, 1.0).units(1.5) == 1
    np.testing.assert_array_equal(bounder.units(np.array([0.26, -9.0, 1.9])), [1, -4, 4])


def test_units_clamps_huge_finite_values():
    """Regression: units(v) used to compute round(v / resolution) before clamping; for a finite v with
    |v| / resolution > max float (here 1e308 / 0.5) that is round(inf) -> OverflowError, instead
    of clamping to +-L. A finite value is valid input and must be clamped."""
    bounder = ContributionBounder(C, L, RESOLUTION)
    assert bounder.units(1e308) == MAX_UNITS
    assert bounder.units(-1e308) == -MAX_UNITS


def test_bounder_rejects_bad_bound():
    with pytest.raises(ValueError):
        ContributionBounder(0, 1.0)


# --------------------------------------------------------------------------- key_histories


_U64 = st.sampled_from([0, 1, 2, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1])  # few keys (collide often), at the u64 edges


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_key_histories_match_a_plain_loop(data):
    """Each record's predecessor (the latest earlier-arrived trigger <= its own) and amendment
    target (the earliest earlier-arrived trigger > its own) per (user, key), from the user's prior
    state (a set: its entries in any order) and the batch in arrival order, in any event-time
    order, duplicates included; and the new state is the set of distinct (user, key, trigger),
    grouped by user."""
    from dpstream.processor.mechanisms.bounding import key_histories

    groups = data.draw(st.integers(1, 5))
    triples = st.tuples(st.integers(0, groups - 1), _U64, st.integers(1, 20))
    state = data.draw(st.lists(triples, max_size=25, unique=True))
    state = data.draw(st.permutations(state))
    state.sort(key=lambda x: x[0])  # grouped by user; within a user, any order
    batch = data.draw(st.lists(triples, max_size=40))  # arrival order is not event-time order
    g = np.array([x[0] for x in batch], dtype=np.int64)
    k = np.array([x[1] for x in batch], dtype=np.uint64)
    t = np.array([x[2] for x in batch], dtype=np.int64)
    sg, st_ = np.array([x[0] for x in state], dtype=np.int64), np.array([x[2] for x in state], dtype=np.int64)
    out = key_histories(g, k, t, sg, np.array([x[1] for x in state], dtype=np.uint64), st_)
    seen: dict = {}
    for a, b, c in state:
        seen.setdefault((a, b), []).append(c)
    expected_prev, expected_amend = [], []
    for gi, ki, ti in batch:
        earlier = seen.setdefault((gi, ki), [])
        expected_prev.append(max([x for x in earlier if x <= ti], default=0))
        expected_amend.append(min([x for x in earlier if x > ti], default=0))
        earlier.append(ti)
    np.testing.assert_array_equal(out.previous, expected_prev)
    np.testing.assert_array_equal(out.amend, expected_amend)
    entries = list(zip(out.group.tolist(), out.key.tolist(), out.trigger.tolist()))
    assert len(entries) == len(set(entries))  # distinct
    assert set(entries) == {(a, b, c) for (a, b), ts in seen.items() for c in ts}
    assert out.group.tolist() == sorted(out.group.tolist())  # grouped by user
    # the new entries alone (what the state's changelog appends): after each user's entries, they
    # make exactly the new state, in its order
    added = key_histories(g, k, t, sg, np.array([x[1] for x in state], dtype=np.uint64), st_, appended=True)
    np.testing.assert_array_equal(added.previous, out.previous)
    np.testing.assert_array_equal(added.amend, out.amend)
    rebuilt = []
    for u in range(groups):
        rebuilt += [x for x in state if x[0] == u]
        rebuilt += [e for e in zip(added.group.tolist(), added.key.tolist(), added.trigger.tolist()) if e[0] == u]
    assert rebuilt == entries
