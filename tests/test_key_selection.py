"""Streaming private key selection (Algorithm 2) and release prediction (Algorithm 4)."""
import math

import numpy as np
import pytest
from conftest import TEST_SECRET
from scipy import stats

from dpstream.accountant.plan import QueryBudget, plan_query
from dpstream.processor.mechanisms.key_selection import (
    SELECT_KIND,
    KeySelector,
    SelectionBatch,
)
from dpstream.processor.mechanisms.noise import NodeNoise, TreeIdentity
from dpstream.processor.mechanisms.tree import ABSENT, HonakerForest

MU = 3
#: beta boosted so that false releases are measurable. plan_query needs
#: (e^eps + 1) * C * beta < delta < 1: (e + 1) * 0.1 = 0.37 < 0.5.
BOOSTED = dict(epsilon=1.0, delta=0.5, triggers=16, contribution_bound=1, beta=0.1, key_threshold=MU)


def boosted_plan(**overrides):
    return plan_query(QueryBudget(**{**BOOSTED, **overrides}))


def _leaf1_exceedance(selector, count=None):
    """Exact P[count + N_1 > mu + tau_1] for the table sampler (N_1 = one leaf's integer noise);
    count defaults to mu (the worst case a false release allows)."""
    count = selector.mu if count is None else count
    sampler = selector.counter.sampler
    x = np.arange(-sampler.bound, sampler.bound + 1)
    return float(sampler.pmf(x)[count + x > selector.mu + selector.plan.thresholds[0]].sum())


#: New users per trigger offset from the round's first trigger; the round count stays <= mu.
GROUPS = {"zero": {}, "mu-at-once": {0: MU}, "spread": {0: 1, 3: 1, 7: 1}}


def _false_releases(selector, batch, first_trigger, round_, seed):
    """Step every trigger from ``first_trigger`` feeding each key its group's schedule while it
    is in round ``round_``; returns {group: (released at least once in that round, n)}."""
    n = len(batch)
    group = np.random.default_rng(seed).integers(0, len(GROUPS), size=n)
    names = list(GROUPS)
    released = np.zeros(n, dtype=bool)
    for trigger in range(first_trigger, selector.triggers + 1):
        offset = trigger - first_trigger
        new_users = np.array([GROUPS[names[g]].get(offset, 0) for g in range(len(names))])[group]
        new_users[released] = 0
        step = selector.step(batch, trigger, new_users)
        assert step.tested.all()
        assert (batch.count[~released & ~step.selected] <= MU).all()
        released |= step.selected & (batch.round == round_ + 1)
    return {name: (int(released[group == g].sum()), int((group == g).sum())) for g, name in enumerate(names)}


def _check_false_release_rate(released, n, plan, p_leaf1):
    # Theory: P[a key whose round count stays <= mu is released during the round] <= beta
    # (union bound over the round's <= T leaves of P[N_r > tau_r] <= beta / T).
    # Upper check: X ~ Binomial(n, p) with p <= beta; reject only if P[X > k | p = beta] < 1e-6.
    upper = stats.binom.isf(1e-6, n, plan.beta)
    assert released <= upper, (released / n, plan.beta)
    # Lower check (the bound is not vacuous in the other direction): the key is released at
    # least when leaf 1 alone exceeds the threshold, whose exact probability p_leaf1 comes from
    # the pmf; P[X < k | p = p_leaf1] <= 1e-6.
    lower = stats.binom.ppf(1e-6, n, p_leaf1)
    assert released >= lower, (released / n, p_leaf1)


def test_false_release_rate_round0_without_gate(noise):
    """The mechanism A' of Theorem 3.1's proof: test a key at every trigger with no gate. The gate
    would make round-0 false releases impossible (count == participations <= mu is never tested,
    see test_gate_*), so it is bypassed by pre-loading participations."""
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "false-release", 0)
    batch = selector.new_batch([f"k{i}" for i in range(20000)])
    batch.participations += MU + 1  # gate open from trigger 1
    for name, (released, n) in _false_releases(selector, batch, 1, 0, seed=1).items():
        _check_false_release_rate(released, n, plan, _leaf1_exceedance(selector, GROUPS[name].get(0, 0)))


def test_false_release_rate_after_a_release(noise):
    """Natural pipeline: every key is released at trigger 1 (50 users); its round 1 starts at
    trigger 2 and gets at most mu new users. Round 1 has T - 1 leaves."""
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "round1", 0)
    n = 20000
    batch = selector.new_batch([f"k{i}" for i in range(n)])
    first = selector.step(batch, 1, np.full(n, 50))
    assert first.selected.all()  # 50 - mu is > 8 sd above tau_1
    assert (batch.round == 1).all() and (batch.count == 0).all() and (batch.start == 2).all()
    for name, (released, n) in _false_releases(selector, batch, 2, 1, seed=2).items():
        _check_false_release_rate(released, n, plan, _leaf1_exceedance(selector, GROUPS[name].get(0, 0)))


@pytest.mark.parametrize("T,beta", [(16, 0.1), (100, 1e-3), (1000, 1e-6)])
def test_subgaussian_single_leaf_tail_is_exact(noise, T, beta):
    """Deterministic: with the subgaussian multiplier, the exact table probability of one
    leaf's noise exceeding tau_1 is <= beta / T."""
    plan = plan_query(QueryBudget(epsilon=1.0, delta=0.9, triggers=T, contribution_bound=1, beta=beta, key_threshold=MU))
    selector = KeySelector(plan, noise, "tail", 0)
    assert _leaf1_exceedance(selector) <= beta / T


_TAIL_GRID = [(eps, T, C) for eps in (0.5, 2.0, 6.0, 10.0) for T in (1, 2, 16, 100) for C in (1, 4, 32)]


def _leaf1_ratio(noise, eps, T, C):
    plan = plan_query(QueryBudget(epsilon=eps, delta=1e-6, triggers=T, contribution_bound=C))
    return _leaf1_exceedance(KeySelector(plan, noise, "tail", 0)) / (plan.beta / T)


def test_subgaussian_tail_bound_holds_for_the_integer_noise(noise):
    """P[N_1 > tau_1] <= beta / T exactly (from the table pmf) over a grid of budgets. With one
    trigger (T = 1) this is the whole false-release probability the accountant charges."""
    worst = max(_leaf1_ratio(noise, eps, T, C) for eps, T, C in _TAIL_GRID)
    assert worst <= 1.0


# --------------------------------------------------------------------------- gate


def test_gate_closed_until_participations_exceed_mu(noise):
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "gate", 0)
    batch = selector.new_batch(["a", "b", "c", "d", "e"])
    step = selector.step(batch, 1, np.array([0, 1, 2, 3, 4]))
    assert step.tested.tolist() == [False, False, False, False, True]
    assert np.isnan(step.noisy_count[:4]).all() and np.isfinite(step.noisy_count[4])
    assert not step.selected[:4].any()
    assert batch.done.tolist()[:4] == [0, 0, 0, 0]
    # participations accumulate over triggers: 3 + 1 > mu opens the gate of key "d" at trigger 3
    step = selector.step(batch, 3, np.array([0, 0, 1, 1, 0]))
    assert step.tested.tolist() == [False, False, False, True, True]
    assert np.isnan(step.noisy_count[:3]).all()
    # a key whose gate is closed is never predicted
    assert selector.predict(batch)[:3].tolist() == [0, 0, 0]


def test_gate_at_mu_zero(noise):
    plan = boosted_plan(key_threshold=0.0)
    selector = KeySelector(plan, noise, "gate0", 0)
    batch = selector.new_batch(["a", "b"])
    step = selector.step(batch, 1, np.array([0, 1]))
    assert step.tested.tolist() == [False, True]


# --------------------------------------------------------------------------- rounds


def test_round_restart(noise):
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "restart", 7)
    n = 2000
    keys = [f"k{i}" for i in range(n)]
    batch = selector.new_batch(keys)
    selector.step(batch, 2, np.full(n, 3))  # gate closed (3 <= mu): nothing tested
    ids_round0 = selector.tree_ids(batch).copy()
    step = selector.step(batch, 5, np.full(n, 60))
    assert step.selected.all()
    assert (batch.round == 1).all()
    assert (batch.count == 0).all()
    assert (batch.participations == 63).all()  # the gate statistic is not reset
    assert (batch.start == 6).all() and (batch.done == 0).all() and (batch.cache == ABSENT).all()
    ids_round1 = selector.tree_ids(batch)
    assert not np.any(ids_round0 == ids_round1)
    assert ids_round1[0] == noise.tree_id(TreeIdentity("restart", 7, "k0", SELECT_KIND, 1))

    # round 1's leaf 1 is trigger 6; with no new users q_hat is that tree's N_1 alone
    step = selector.step(batch, 6, np.zeros(n))
    forest = HonakerForest(plan.triggers, selector.counter.sampler, noise)
    walk = forest.walk(ids_round1, np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), forest.empty_cache(n))
    n1_round1 = walk.prefix_noise(np.arange(n), np.ones(n, dtype=np.int64))
    np.testing.assert_array_equal(step.noisy_count, n1_round1)
    # ... which is different noise from round 0's leaf 1 (independent draws coincide w.p.
    # q = sum p(x)^2; allow 5.5 sd of Binomial(n, q))
    walk0 = forest.walk(ids_round0, np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), forest.empty_cache(n))
    n1_round0 = walk0.prefix_noise(np.arange(n), np.ones(n, dtype=np.int64))
    sampler = selector.counter.sampler
    x = np.arange(-sampler.bound, sampler.bound + 1)
    q = float(np.sum(sampler.pmf(x) ** 2))
    equal = int(np.sum(n1_round0 == n1_round1))
    assert abs(equal - n * q) <= 5.5 * math.sqrt(n * q * (1 - q))


# --------------------------------------------------------------------------- prediction


def _prediction_plan(counter="binary_tree"):
    # a large beta: noise-only selections (what prediction is for) are common
    return plan_query(QueryBudget(epsilon=1.0, delta=0.9, triggers=32, contribution_bound=1, beta=0.2, key_threshold=2,
                                  counter=counter))


COUNTERS = ["binary_tree", "blt"]


@pytest.mark.parametrize("counter", COUNTERS)
@pytest.mark.parametrize("j", [1, 6, 16, 31, 32])
def test_prediction_equals_the_first_future_selection(noise, j, counter):
    plan = _prediction_plan(counter)
    T = plan.triggers
    selector = KeySelector(plan, noise, f"predict-{j}", 0)
    rng = np.random.default_rng(1000 + j)
    n = 4000
    batch = selector.new_batch([f"k{i}" for i in range(n)])
    # before j: sparse random arrivals, so keys are in various rounds/leaves at trigger j
    for trigger in range(1, j):
        arrivals = rng.random(n) < 0.3
        selector.step(batch, trigger, np.where(arrivals, rng.integers(0, 6, size=n), 0))
    # at j: counts near the threshold of the key's current leaf, so that noise alone decides
    leaf = j - batch.start + 1
    target = plan.key_threshold + np.asarray(plan.thresholds)[leaf - 1] + rng.normal(-3.0, 4.0, size=n)
    step_j = selector.step(batch, j, np.maximum(0, np.round(target - batch.count)).astype(np.int64))
    predicted = selector.predict(batch)
    assert ((predicted == 0) | (predicted > j)).all()

    first = np.zeros(n, dtype=np.int64)
    for trigger in range(j + 1, T + 1):
        step = selector.step(batch, trigger, np.zeros(n, dtype=np.int64))
        first[(first == 0) & step.selected] = trigger
    np.testing.assert_array_equal(predicted, first)

    # the test exercised both branches and keys that were just released at j
    if j < T - 1:
        assert (predicted > 0).sum() >= 50 and (predicted == 0).sum() >= 50
        assert step_j.selected.sum() >= 50
        assert (predicted[step_j.selected] > 0).sum() >= 1  # a new round (count 0) predicted to release on noise alone
        assert (predicted[~step_j.selected] > 0).sum() >= 20
    if j == T:
        assert (predicted == 0).all()  # no trigger left in the window


@pytest.mark.parametrize("counter", COUNTERS)
def test_prediction_with_small_chunks_is_the_same(noise, monkeypatch, counter):
    import dpstream.processor.mechanisms.key_selection as ks

    plan = _prediction_plan(counter)
    selector = KeySelector(plan, noise, "chunks", 0)
    rng = np.random.default_rng(3)
    n = 500
    batch = selector.new_batch([f"k{i}" for i in range(n)])
    selector.step(batch, 4, rng.integers(0, 20, size=n))
    whole = selector.predict(batch)
    monkeypatch.setattr(ks, "PREDICTION_CHUNK", 7)
    np.testing.assert_array_equal(selector.predict(batch), whole)


# --------------------------------------------------------------------------- recomputation


def _take(batch, idx):
    return SelectionBatch(
        [batch.keys[i] for i in idx], batch.round[idx].copy(), batch.start[idx].copy(), batch.done[idx].copy(),
        batch.count[idx].copy(), batch.participations[idx].copy(), batch.cache[idx].copy(),
    )


def _put(batch, idx, sub):
    for name in ("round", "start", "done", "count", "participations", "cache"):
        getattr(batch, name)[idx] = getattr(sub, name)
    batch._tree_ids = None


def _arrivals(T, n, seed):
    rng = np.random.default_rng(seed)
    users = np.zeros((T + 1, n), dtype=np.int64)  # users[trigger, key]
    for k in range(n):
        triggers = rng.choice(np.arange(1, T + 1), size=rng.integers(1, 6), replace=False)
        users[triggers, k] = rng.integers(0, 9, size=len(triggers))
    return users


def _dense_run(plan, secret, users):
    T, n = plan.triggers, users.shape[1]
    selector = KeySelector(plan, NodeNoise(secret), "recompute", 0)
    batch = selector.new_batch([f"k{i}" for i in range(n)])
    noisy = np.full((T + 1, n), np.nan)
    selected = np.zeros((T + 1, n), dtype=bool)
    for trigger in range(1, T + 1):
        step = selector.step(batch, trigger, users[trigger])
        noisy[trigger], selected[trigger] = step.noisy_count, step.selected
    return noisy, selected


@pytest.mark.parametrize("counter", COUNTERS)
def test_same_secret_same_inputs_same_noise(counter):
    plan = _prediction_plan(counter)
    users = _arrivals(plan.triggers, 600, 11)
    a = _dense_run(plan, TEST_SECRET, users)
    b = _dense_run(plan, TEST_SECRET, users)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = _dense_run(plan, TEST_SECRET + b"!", users)
    assert not np.array_equal(np.nan_to_num(a[0]), np.nan_to_num(c[0]))


@pytest.mark.parametrize("counter", COUNTERS)
def test_sparse_processing_with_prediction_equals_dense(counter):
    """The production schedule: at each trigger only keys with data or predicted for that
    trigger are loaded. Every q_hat it computes, and every selection, equals the run that tests
    every key at every trigger: q_hat at a trigger does not depend on which earlier triggers
    were visited."""
    plan = _prediction_plan(counter)
    T, n = plan.triggers, 600
    users = _arrivals(T, n, 12)
    dense_noisy, dense_selected = _dense_run(plan, TEST_SECRET, users)
    assert dense_selected.sum() >= 100

    selector = KeySelector(plan, NodeNoise(TEST_SECRET), "recompute", 0)
    batch = selector.new_batch([f"k{i}" for i in range(n)])
    predicted = np.zeros(n, dtype=np.int64)
    sparse_selected = np.zeros((T + 1, n), dtype=bool)
    visited = 0
    for trigger in range(1, T + 1):
        idx = np.nonzero((users[trigger] > 0) | (predicted == trigger))[0]
        if not len(idx):
            continue
        visited += len(idx)
        sub = _take(batch, idx)
        step = selector.step(sub, trigger, users[trigger, idx])
        tested = step.tested
        np.testing.assert_array_equal(step.noisy_count[tested], dense_noisy[trigger, idx[tested]])
        sparse_selected[trigger, idx] = step.selected
        predicted[idx] = selector.predict(sub)
        _put(batch, idx, sub)
    np.testing.assert_array_equal(sparse_selected, dense_selected)
    assert visited < 0.3 * T * n  # it really skipped most (key, trigger) pairs


# --------------------------------------------------------------------------- input validation


def test_rejected_step_does_not_mutate_state(noise):
    """Regression: step() used to add new_users to count and participations *before* validating the trigger,
    so a rejected call (ValueError) leaves phantom users in the state."""
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "reject", 0)
    batch = selector.new_batch(["a", "b"])
    selector.step(batch, 5, np.array([4, 4]))
    before = (batch.count.copy(), batch.participations.copy(), batch.done.copy())
    with pytest.raises(ValueError):
        selector.step(batch, 3, np.array([7, 7]))  # trigger before the processed leaf
    np.testing.assert_array_equal(batch.count, before[0])
    np.testing.assert_array_equal(batch.participations, before[1])
    np.testing.assert_array_equal(batch.done, before[2])


def test_same_trigger_cannot_be_tested_twice(noise):
    """Regression: the guard used to be ``leaf < done``, so a key already tested at trigger t can be tested at t
    again. Both tests use the same noise N_t, so the two noisy counts differ by exactly the new
    users: a node's noise reused on different data (docs/privacy.md, "Failures")."""
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "twice", 0)
    batch = selector.new_batch(["a"])
    first = selector.step(batch, 5, np.array([4]))
    assert first.tested[0] and not first.selected[0]
    with pytest.raises(ValueError):
        selector.step(batch, 5, np.array([1]))


def test_trigger_range(noise):
    plan = boosted_plan()
    selector = KeySelector(plan, noise, "range", 0)
    batch = selector.new_batch(["a"])
    for bad in (0, plan.triggers + 1):
        with pytest.raises(ValueError):
            selector.step(batch, bad, np.array([1]))


@pytest.mark.parametrize("counter", COUNTERS)
def test_noise_max_shortcut_gives_the_same_predictions(noise, counter):
    """The cached max of the future noise path only skips scans that could not find a release:
    predictions with the cache equal predictions computed from scratch at every trigger."""
    plan = _prediction_plan(counter)
    T = plan.triggers
    rng = np.random.default_rng(77)
    n = 3000
    cached = KeySelector(plan, noise, "shortcut", 0)
    fresh = KeySelector(plan, noise, "shortcut", 0)
    a = cached.new_batch([f"k{i}" for i in range(n)])
    b = fresh.new_batch([f"k{i}" for i in range(n)])
    skipped = 0
    for trigger in range(1, T + 1):
        arrivals = np.where(rng.random(n) < 0.2, rng.integers(0, 3, size=n), 0)
        cached.step(a, trigger, arrivals)
        fresh.step(b, trigger, arrivals)
        before = np.isfinite(a.noise_max) & (a.count + a.noise_max <= plan.key_threshold)
        skipped += int(before.sum())
        b.noise_max[:] = np.nan  # forget: scan everything
        np.testing.assert_array_equal(cached.predict(a), fresh.predict(b))
    assert skipped > n  # the shortcut was actually taken many times
