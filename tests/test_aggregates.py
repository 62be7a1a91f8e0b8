"""Aggregates (dpstream.processor.mechanisms.aggregates): MEAN releases a noisy sum and a noisy count, each
from its own perturbation tree, calibrated so that the query meets its (epsilon, delta) by an
independent accountant; COUNT and SUM plans are unchanged by the column split."""
import io
import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from pydantic import ValidationError

from dpstream.accountant.calibration import cks_epsilon, prefix_variance_factor
from dpstream.accountant.plan import (
    SAMPLER_TV_BOUND,
    BudgetError,
    QueryBudget,
    plan_fingerprint,
    plan_levels,
    plan_query,
)
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import DpstreamConfig, QueryConfig
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.processor.mechanisms.perturbation import (
    HierarchicalPerturber,
    PerturbationBatch,
)
from tests.conftest import TEST_LABEL, TEST_SECRET

MEAN = dict(epsilon=2.0, delta=1e-7, triggers=64, contribution_bound=8, clamp=10.0, aggregate="mean", columns=("value", "one"))


def test_mean_plan_meets_the_budget_by_dp_accounting():
    """Key selection (C rounds x h levels, sensitivity 1) and the two column trees (h levels,
    sensitivity C*L for the sum, C for the count) composed by dp_accounting stay within epsilon at
    the plan's conversion delta; and the columns share the perturbation rho equally."""
    plan = plan_query(QueryBudget(**MEAN))
    C, L, h = plan.contribution_bound, plan.clamp, plan.tree_height
    (k_sum, sigma_sum, units_sum, step_sum), (k_count, sigma_count, units_count, step_count) = plan.columns
    assert (k_sum, k_count) == ("value", "one") and step_count == 1.0 and step_sum == plan.resolution
    assert units_sum == pytest.approx(sigma_sum / step_sum) and units_count == sigma_count
    rho_sum = h * (C * L) ** 2 / (2 * sigma_sum ** 2)
    rho_count = h * C ** 2 / (2 * sigma_count ** 2)
    assert rho_sum == pytest.approx(rho_count, rel=1e-12)
    assert rho_sum + rho_count == pytest.approx(plan.rho_perturbation, rel=1e-12)
    parts = [(plan.sigma_key_selection, 1.0, C * h), (sigma_sum, C * L, h), (sigma_count, C, h)]
    rdp = RdpAccountant()
    pld = PLDAccountant()
    for sigma, sensitivity, count in parts:
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / sensitivity), count)
        rdp.compose(event)
        pld.compose(event)
    assert rdp.get_epsilon(plan.delta_conversion) <= plan.epsilon * 1.001
    assert pld.get_epsilon(plan.delta_conversion) <= plan.epsilon
    # the samplers' total-variation term counts three trees per key round: selection, sum, count
    assert plan.delta_sampler == pytest.approx((math.exp(plan.epsilon) + 1) * 3 * C * h * SAMPLER_TV_BOUND, rel=1e-12)
    # not needlessly noisy: 3% less noise on every tree would break the budget
    assert cks_epsilon((plan.rho_key_selection + plan.rho_perturbation) / 0.97 ** 2, plan.delta_conversion) > plan.epsilon


def test_the_sum_column_of_a_mean_is_noisier_than_a_sum_alone():
    """Half the perturbation budget each: sqrt(2) times the noise of a SUM with the same budget."""
    mean = plan_query(QueryBudget(**MEAN))
    total = plan_query(QueryBudget(**{**MEAN, "aggregate": "sum", "columns": None}))
    assert mean.sigma_perturbation == pytest.approx(total.sigma_perturbation * math.sqrt(2), rel=1e-9)


@pytest.mark.parametrize("aggregate,clamp,kinds", [("count", 1.0, ("one",)), ("sum", 5.0, ("value",))])
@pytest.mark.parametrize("composition", ["zcdp", "basic"])
def test_one_column_plans_do_not_change(aggregate, clamp, kinds, composition):
    """COUNT and SUM through the column machinery: the same plan and fingerprint as before, so
    open windows of existing state directories keep their pinned plan."""
    base = dict(epsilon=1.0, delta=1e-6, triggers=48, contribution_bound=4, clamp=clamp, aggregate=aggregate,
                composition=composition, hierarchy_depth=2)
    implicit, explicit = plan_levels(QueryBudget(**base)), plan_levels(QueryBudget(**base, columns=kinds))
    assert implicit == explicit and all(p.columns is None for p in implicit)
    assert plan_fingerprint(implicit) == plan_fingerprint(explicit)


def test_several_columns_need_zcdp():
    with pytest.raises(BudgetError) as err:
        plan_query(QueryBudget(**{**MEAN, "composition": "basic"}))
    assert err.value.field == "composition"


def test_mean_config_needs_a_value_field_and_unknown_aggregates_are_named():
    base = dict(name="m", epsilon=1.0, delta=1e-6, clamp=10.0)
    with pytest.raises(ValidationError, match="value_field: aggregate 'mean' needs a value_field"):
        QueryConfig(aggregate="mean", **base)
    with pytest.raises(ValidationError, match="aggregate"):
        QueryConfig(aggregate="median", value_field="v", **base)
    assert QueryConfig(aggregate="mean", value_field="v", **base).budget().columns == ("value", "one")


def test_count_column_noise_matches_its_declared_stddev():
    """The count tree of a MEAN draws noise at the count column's sigma (plan.columns[1]), not
    the sum's: over 20,000 keys released at trigger 5 with known data, the errors have mean 0 and
    variance stddev_count^2. Tolerances: 6 standard errors of the mean, and 6 standard deviations
    of the sample variance (sqrt(2 / n) relative, about 4.2% at n = 20,000)."""
    plan = plan_query(QueryBudget(**MEAN))
    n, trigger = 20_000, 5
    perturber = HierarchicalPerturber(plan, NodeNoise(TEST_SECRET, "aggregates"), "q", 0, "count", 1)
    batch = PerturbationBatch([f"k{i}" for i in range(n)], np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                              perturber.counter.empty_state(n))
    truth = np.arange(n, dtype=np.int64) % 7
    released = np.array(perturber.release(batch, trigger, truth))
    assert released.dtype.kind == "i"  # a count is published as an integer
    err = released - truth
    sd = perturber.stddev(trigger)
    assert sd == pytest.approx(plan.columns[1][1] * math.sqrt(prefix_variance_factor(trigger)), rel=1e-12)
    assert abs(err.mean()) < 6 * sd / math.sqrt(n)
    assert abs(err.var() / sd ** 2 - 1) < 6 * math.sqrt(2 / n) + 1 / (12 * sd ** 2)  # + rounding to whole steps


def _mean_replay(tmp_path, rows):
    query = QueryConfig(name="spend", window="1d", triggers=4, contribution_bound=3, epsilon=8.0, delta=1e-6, clamp=100.0,
                        aggregate="mean", value_field="amount", allowed_lateness="0s")
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runner = ReplayRunner(DpstreamConfig(queries=[query]), TEST_SECRET, None, log=io.StringIO(), noise_label=TEST_LABEL)
    out = io.StringIO()
    try:
        runner.run(str(path), out)
    finally:
        runner.close()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_mean_releases_sum_count_and_their_ratio(tmp_path):
    """End to end: every release carries the noisy sum (a whole multiple of the grid step), the
    noisy count (an integer), their ratio computed from those two released values only, and both
    noise scales; a replay of the same input gives the same bytes."""
    start = 1_795_132_800_000
    rng = np.random.default_rng(5)
    rows = [{"user_id": f"u{u}", "key": "shop", "amount": float(a), "ts": start + int(t)}
            for u, a, t in zip(range(3000), rng.uniform(0, 150, 3000), np.sort(rng.integers(0, 86_400_000, 3000)))]
    releases = _mean_replay(tmp_path, rows)
    assert releases and releases == _mean_replay(tmp_path, rows)
    plan = QueryConfig(name="spend", triggers=4, contribution_bound=3, epsilon=8.0, delta=1e-6, clamp=100.0, aggregate="mean",
                       value_field="amount").budget()
    step = plan_query(plan).resolution
    for r in releases:
        assert isinstance(r["count"], int)
        assert (r["sum"] / step).is_integer()
        assert r["mean"] == (r["sum"] / r["count"] if r["count"] > 0 else None)
        assert r["stddev"] > r["stddev_count"] > 0
    last = releases[-1]
    # 3,000 users, one record each, values clamped to 100: the truth is within a few noise scales
    assert abs(last["count"] - 3000) < 8 * last["stddev_count"]
    true_sum = float(np.minimum(np.array([r["amount"] for r in rows]), 100.0).sum())
    assert abs(last["sum"] - true_sum) < 8 * last["stddev"] + 3000 * step
