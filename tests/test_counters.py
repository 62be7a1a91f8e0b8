"""The ContinualCounter seam (dpstream.processor.mechanisms.counters) and the accountant's calibration of
the binary tree behind it (dpstream.accountant.counters): the declared sensitivity is the number of read
values one increment can reach, the declared per-step variance is what the noise has, and the
same secret and stream ids give the same noise."""
import math

import numpy as np
import pytest

from dpstream.accountant.counters import BINARY_TREE, COUNTERS, counter_calibration
from dpstream.accountant.plan import BudgetError, QueryBudget, plan_query
from dpstream.processor.mechanisms.counters import (
    COUNTER_TYPES,
    BinaryTreeCounter,
    ContinualCounter,
    counter_for,
)
from dpstream.processor.mechanisms.noise import NodeNoise
from tests.conftest import TEST_SECRET


def _ids(n, salt=b"c"):
    return np.array([bytes([salt[0]]) + i.to_bytes(15, "big") for i in range(n)], dtype="S16")


def test_every_counter_has_a_calibration_and_the_protocol():
    assert set(COUNTER_TYPES) == set(COUNTERS)
    counter = counter_for("binary_tree", 100, 3.0, NodeNoise(TEST_SECRET))
    assert isinstance(counter, BinaryTreeCounter) and counter.calibration is BINARY_TREE
    for name in ("name", "calibration", "steps", "state_width", "empty_state", "walk"):
        assert hasattr(counter, name), name
    assert counter.steps == 100 and counter.state_width == BINARY_TREE.state_width(100)
    assert counter.empty_state(3).shape == (3, counter.state_width)
    _: ContinualCounter = counter  # structural: the protocol's shape


@pytest.mark.parametrize("T", [1, 2, 3, 7, 8, 100, 1000])
def test_declared_sensitivity_is_the_most_read_values_one_increment_reaches(T):
    """An increment at step s changes every complete node (level l, index j; (j+1) 2^l <= T)
    covering s; only complete nodes are ever read. The declared squared sensitivity must be the
    maximum over s of how many such nodes there are (each changes by the increment)."""
    worst = max(sum(1 for level in range(T.bit_length() + 1) if ((s - 1) >> level) + 1 << level <= T) for s in range(1, T + 1))
    assert BINARY_TREE.sensitivity_sq(T) == worst


def test_declared_step_variance_matches_the_noise():
    """20,000 streams advanced to step t: the noisy prefix's variance over sigma^2 is the
    declared step_variance(t). Tolerance: 6 standard deviations of a sample variance,
    6 sqrt(2 / n) relative (about 6%), plus the discrete Gaussian's variance deficit at sigma 4
    (below 1e-12)."""
    n, T, sigma = 20_000, 100, 4.0
    counter = counter_for("binary_tree", T, sigma, NodeNoise(TEST_SECRET, "counters"))
    for t in (1, 7, 64, 100):
        walk = counter.walk(_ids(n), np.zeros(n, dtype=np.int64), np.full(n, t), counter.empty_state(n))
        noise = walk.prefix(np.arange(n), np.full(n, t)).approx()
        declared = BINARY_TREE.step_variance(t, T) * sigma ** 2
        assert abs(noise.mean()) < 6 * math.sqrt(declared / n)
        assert abs(noise.var() / declared - 1) < 6 * math.sqrt(2 / n)


def test_same_secret_and_streams_give_the_same_noise_whatever_the_steps_taken():
    """Replay identity: the noise is a function of the secret and the stream only; advancing in
    one jump or step by step (carrying the state) reads the same prefixes."""
    n, T = 50, 37
    one = counter_for("binary_tree", T, 2.5, NodeNoise(TEST_SECRET, "replay"))
    two = counter_for("binary_tree", T, 2.5, NodeNoise(TEST_SECRET, "replay"))
    jump = one.walk(_ids(n), np.zeros(n, dtype=np.int64), np.full(n, T), one.empty_state(n))
    expected = [jump.prefix(np.arange(n), np.full(n, t)).rounded(np.zeros(n, dtype=np.int64)) for t in range(1, T + 1)]
    state, done = two.empty_state(n), np.zeros(n, dtype=np.int64)
    for t in range(1, T + 1):
        walk = two.walk(_ids(n), done, np.full(n, t), state)
        got = walk.prefix(np.arange(n), np.full(n, t)).rounded(np.zeros(n, dtype=np.int64))
        np.testing.assert_array_equal(got, expected[t - 1])
        state, done = walk.state_at(np.full(n, t)), np.full(n, t)
    other = counter_for("binary_tree", T, 2.5, NodeNoise(TEST_SECRET, "another label"))
    walk = other.walk(_ids(n), np.zeros(n, dtype=np.int64), np.full(n, T), other.empty_state(n))
    assert not np.array_equal(walk.prefix(np.arange(n), np.full(n, T)).rounded(np.zeros(n, dtype=np.int64)), expected[-1])


def test_the_plan_takes_thresholds_and_stddev_from_the_counter():
    plan = plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32))
    assert plan.tree_height == BINARY_TREE.sensitivity_sq(100)
    for r in (1, 50, 100):
        assert plan.threshold(r) == pytest.approx(plan.tail_multiplier * plan.sigma_key_selection * math.sqrt(BINARY_TREE.step_variance(r, 100)))
    assert plan.expected_stddev == pytest.approx(plan.sigma_perturbation * math.sqrt(BINARY_TREE.step_variance(100, 100)))
    with pytest.raises(BudgetError) as err:
        plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32, counter="fenwick"))
    assert err.value.field == "counter"
    with pytest.raises(ValueError, match="counter"):
        counter_calibration("fenwick")
