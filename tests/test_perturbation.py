"""Hierarchical perturbation (Algorithm 3): unbiased releases with eq. (2) variance, and the
same noise however the releases are scheduled.

Tolerances: a release's error is a fixed linear combination of independent discrete Gaussians
(sigma >= 29 grid units) and so has Gaussian moments up to ~e^{-2 pi^2 sigma^2}; the sample
variance of n draws has sd V sqrt(2/(n-1)), the sample mean sd sqrt(V/n). Z = 5.5 sd per
check: two-sided false failure 3.8e-8 per check, < 3e-6 over this file.

Releases are the exact noisy prefix rounded to the nearest grid step: error = round(N), N the
symmetric noise of the prefix, so the mean stays 0 and, by Sheppard's correction (accurate to
~e^{-2 pi^2 sigma^2} for a density this smooth on the unit grid), the variance is V + 1/12 steps^2.
"""
import math

import numpy as np
import pytest

from dpstream.accountant.calibration import prefix_variance_factor
from dpstream.accountant.plan import QueryBudget, plan_query
from dpstream.processor.mechanisms.perturbation import HierarchicalPerturber

Z = 5.5
BASE = dict(epsilon=1.0, delta=1e-6, triggers=16, contribution_bound=2)
PLANS = {
    "count": dict(aggregate="count"),
    "sum": dict(aggregate="sum", clamp=10.0),
}


def _plan(kind):
    return plan_query(QueryBudget(**BASE, **PLANS[kind]))


def _deltas(plan, T, n, rng):
    """Random buffered aggregates per (trigger, key), in grid units, within +-C*L."""
    bound = plan.perturbation_sensitivity_units
    low = 0 if plan.aggregate == "count" else -bound
    return rng.integers(low, bound + 1, size=(T + 1, n))


def _run(perturber, keys, deltas, schedule):
    """Release at the given triggers (ascending), adding everything buffered since the last
    release. Returns {trigger: (released values, exact cumulative values)}."""
    batch = perturber.new_batch(keys)
    out, last = {}, 0
    for trigger in schedule:
        buffered = deltas[last + 1:trigger + 1].sum(axis=0)
        values = np.asarray(perturber.release(batch, trigger, buffered))
        exact = deltas[1:trigger + 1].sum(axis=0) * perturber.resolution
        out[trigger] = (values, exact)
        last = trigger
    return out


@pytest.mark.parametrize("kind", ["count", "sum"])
def test_releases_unbiased_with_prefix_variance(noise, kind):
    plan = _plan(kind)
    T, n = plan.triggers, 40000
    perturber = HierarchicalPerturber(plan, noise, f"perturb-stats-{kind}", 0)
    assert perturber.resolution == plan.resolution
    if kind == "sum":
        assert plan.resolution < plan.clamp and (plan.clamp / plan.resolution).is_integer()
    rng = np.random.default_rng(41)
    deltas = _deltas(plan, T, n, rng)
    releases = _run(perturber, [f"k{i}" for i in range(n)], deltas, range(1, T + 1))
    unit_var = perturber.counter.sampler.variance  # exact variance of one node's noise, units^2
    assert unit_var == pytest.approx(plan.sigma_perturbation_units**2, rel=1e-9)
    for trigger, (values, exact) in releases.items():
        error = values - exact
        V = unit_var * plan.resolution**2 * prefix_variance_factor(trigger)
        rounded = V + plan.resolution**2 / 12  # Sheppard's correction for rounding to the grid
        assert abs(error.mean()) <= Z * math.sqrt(rounded / n), trigger
        assert abs(error.var(ddof=1) - rounded) <= Z * rounded * math.sqrt(2 / (n - 1)), trigger
        # the accountant's reported stddev is the noise's (nominal sigma, before rounding)
        assert perturber.stddev(trigger) ** 2 == pytest.approx(V, rel=1e-9)
        # every value is a whole number of grid steps, exactly (the step is a power of two)
        units = values / plan.resolution
        assert (units == np.round(units)).all()
        if kind == "count":
            assert all(isinstance(v, int) for v in perturber.publish(np.array([1, -2])))
    assert plan.expected_stddev == pytest.approx(perturber.stddev(T), rel=1e-12)


@pytest.mark.parametrize("kind", ["count", "sum"])
def test_release_noise_does_not_depend_on_schedule(noise, kind):
    plan = _plan(kind)
    T, n = plan.triggers, 500
    perturber = HierarchicalPerturber(plan, noise, "schedule", 0)
    keys = [f"k{i}" for i in range(n)]
    rng = np.random.default_rng(5)
    deltas = _deltas(plan, T, n, rng)
    every = _run(perturber, keys, deltas, range(1, T + 1))
    for schedule in ([3, 8, 16], [16], [1, 2, 15], [5, 6, 7, 11, 12]):
        some = _run(perturber, keys, deltas, schedule)
        for trigger in schedule:
            np.testing.assert_array_equal(some[trigger][0], every[trigger][0])
    # a fresh perturber object (e.g. after a restart) gives the same values
    again = _run(HierarchicalPerturber(plan, noise, "schedule", 0), keys, deltas, [4, 9, 13])
    for trigger in (4, 9, 13):
        np.testing.assert_array_equal(again[trigger][0], every[trigger][0])
    # a key's noise does not depend on which other keys share its batch
    part = _run(perturber, keys[17:33], deltas[:, 17:33], [8])
    np.testing.assert_array_equal(part[8][0], every[8][0][17:33])
    # different column, window or query: different noise
    for other in (
        HierarchicalPerturber(plan, noise, "schedule", 0, column="other"),
        HierarchicalPerturber(plan, noise, "schedule", 1),
        HierarchicalPerturber(plan, noise, "schedule2", 0),
    ):
        assert not np.array_equal(_run(other, keys, deltas, [16])[16][0], every[16][0])


def test_release_validation(noise):
    plan = _plan("count")
    perturber = HierarchicalPerturber(plan, noise, "validate", 0)
    batch = perturber.new_batch(["a"])
    perturber.release(batch, 5, np.array([1]))
    snapshot = (batch.released_units.copy(), batch.done.copy(), batch.cache.copy())
    for bad in (5, 4, 0, plan.triggers + 1):
        with pytest.raises(ValueError):
            perturber.release(batch, bad, np.array([1]))
    np.testing.assert_array_equal(batch.released_units, snapshot[0])
    np.testing.assert_array_equal(batch.done, snapshot[1])
    np.testing.assert_array_equal(batch.cache, snapshot[2])


@pytest.mark.parametrize("counter", ["binary_tree", "blt"])
def test_release_steps_index_the_stream_by_release_number(noise, counter):
    """``perturbation_steps: release``: a key's j-th release reads step j of its stream, whatever
    the triggers it happens at, with the noise of that step (the same as a trigger-indexed
    stream's at trigger j, since stream ids and draws are the same), and its stddev is the
    counter's at step j. Releasing twice at one trigger, or beyond T releases, is refused."""
    plan_r = plan_query(QueryBudget(**BASE, counter=counter, perturbation_steps="release"))
    plan_t = plan_query(QueryBudget(**BASE, counter=counter))
    assert plan_r.sigma_perturbation == plan_t.sigma_perturbation  # the step layout costs nothing
    T, n = plan_r.triggers, 300
    rng = np.random.default_rng(4)
    deltas = rng.integers(0, 3, size=(T + 1, n))
    by_release = HierarchicalPerturber(plan_r, noise, "steps", 0)
    by_trigger = HierarchicalPerturber(plan_t, noise, "steps", 0)
    sparse = [3, 4, 9, 15]  # released at these triggers: steps 1, 2, 3, 4
    got = _run(by_release, [f"k{i}" for i in range(n)], deltas, sparse)
    dense = by_trigger.new_batch([f"k{i}" for i in range(n)])
    for j, trigger in enumerate(sparse, 1):
        # the trigger-indexed stream at trigger j carries the noise the release-indexed one reads
        # at step j; feed it the same cumulative data by then
        buffered = deltas[(sparse[j - 2] + 1 if j > 1 else 1):trigger + 1].sum(axis=0)
        values = np.asarray(by_trigger.release(dense, j, buffered))
        np.testing.assert_array_equal(got[trigger][0], values)
    assert by_release.stddev(2) == pytest.approx(plan_r.sigma_perturbation * math.sqrt(
        by_release.counter.calibration.step_variance(2, T)))
    batch = by_release.new_batch(["a"])
    batch.done[:] = T
    with pytest.raises(ValueError, match="more often"):
        by_release.release(batch, T, np.zeros(1, dtype=np.int64))
