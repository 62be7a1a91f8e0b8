"""The accountant against closed forms and an independent library (dp_accounting 0.6.0)."""
import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from scipy import optimize
from scipy.stats import norm

from dpstream.accountant.calibration import (
    cks_delta,
    cks_epsilon,
    cks_rho,
    honaker_variance_factor,
    prefix_variance_factor,
    tail_multiplier,
)
from dpstream.accountant.plan import (
    SAMPLER_TV_BOUND,
    BudgetError,
    QueryBudget,
    plan_query,
)

RHOS = [1e-3, 0.01, 0.1, 0.5, 1.0, 3.0, 10.0]
DELTAS = [1e-3, 1e-6, 1e-9, 1e-12]


def _optimal_order(rho, eps):
    """Independent solve (brentq) of d/d alpha of the CKS log-delta: (2a-1) rho - eps + log(1-1/a) = 0."""
    f = lambda a: (2 * a - 1) * rho - eps + math.log1p(-1 / a)
    hi = 2.0
    while f(hi) < 0:
        hi *= 2
    return optimize.brentq(f, 1 + 1e-12, hi, xtol=1e-14, rtol=1e-15)


def _orders_with(*extra):
    return sorted(set(list(DEFAULT_RDP_ORDERS) + [float(a) for a in extra]))


def _exact_gaussian_delta(rho, eps):
    """Tight delta(eps) of the continuous Gaussian mechanism with mu = sqrt(2 rho) (Balle-Wang)."""
    mu = math.sqrt(2 * rho)
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


# --------------------------------------------------------------------------- CKS conversion


@pytest.mark.parametrize("rho", RHOS)
@pytest.mark.parametrize("delta", DELTAS)
def test_cks_round_trips(rho, delta):
    eps = cks_epsilon(rho, delta)
    # cks_epsilon errs on the safe side: the delta it achieves is <= the target, and tight
    assert cks_delta(rho, eps) <= delta
    assert cks_delta(rho, eps) == pytest.approx(delta, rel=1e-6)
    assert cks_rho(eps, delta) == pytest.approx(rho, rel=1e-6)
    assert cks_delta(cks_rho(eps, delta), eps) <= delta  # the returned rho is admissible
    assert cks_epsilon(cks_rho(eps, delta), delta) <= eps * (1 + 1e-12)


def test_cks_monotone():
    for delta in DELTAS:
        eps = [cks_epsilon(r, delta) for r in RHOS]
        assert all(a < b for a, b in zip(eps, eps[1:]))  # more rho, more eps
    for rho in RHOS:
        eps = [cks_epsilon(rho, d) for d in DELTAS]
        assert all(a < b for a, b in zip(eps, eps[1:]))  # smaller delta, more eps
        deltas = [cks_delta(rho, e) for e in (0.1, 0.5, 1.0, 2.0, 5.0)]
        assert all(a >= b for a, b in zip(deltas, deltas[1:]))
    for eps in (0.1, 1.0, 6.0):
        rhos = [cks_rho(eps, d) for d in DELTAS]
        assert all(a > b for a, b in zip(rhos, rhos[1:]))
        deltas = [cks_delta(r, eps) for r in RHOS]
        assert all(a <= b for a, b in zip(deltas, deltas[1:]))
    rhos = [cks_rho(e, 1e-9) for e in (0.1, 0.5, 1.0, 3.0, 6.0, 10.0)]
    assert all(a < b for a, b in zip(rhos, rhos[1:]))


@pytest.mark.parametrize("rho", RHOS)
@pytest.mark.parametrize("eps", [0.1, 1.0, 6.0])
def test_cks_delta_is_the_optimum_and_above_the_exact_gaussian(rho, eps):
    a = _optimal_order(rho, eps)
    independent = math.exp((a - 1) * (a * rho - eps) + a * math.log1p(-1 / a)) / (a - 1)
    assert cks_delta(rho, eps) == pytest.approx(min(1.0, independent), rel=1e-9)
    # CKS is an upper bound on the true (tight) delta of the Gaussian mechanism
    assert cks_delta(rho, eps) >= _exact_gaussian_delta(rho, eps) * (1 - 1e-9)
    # and tighter than the textbook bound eps = rho + 2 sqrt(rho ln(1/delta))
    d = 1e-9
    assert cks_epsilon(rho, d) <= rho + 2 * math.sqrt(rho * math.log(1 / d))


def test_cks_edge_cases():
    assert cks_delta(0.0, 1.0) == 0.0
    assert cks_epsilon(0.0, 1e-9) == 0.0
    for bad in ((-1.0, 1.0), (1.0, -1.0)):
        with pytest.raises(ValueError):
            cks_delta(*bad)
    with pytest.raises(ValueError):
        cks_epsilon(1.0, 0.0)
    for bad in ((0.0, 1e-9), (1.0, 0.0), (1.0, 1.0)):
        with pytest.raises(ValueError):
            cks_rho(*bad)


# --------------------------------------------------------------------------- vs dp_accounting


def _gaussian(rho_per_event, count=1):
    """dp_accounting event for `count` Gaussian mechanisms of rho each: noise multiplier
    1/sqrt(2 rho) (RDP of one is alpha / (2 s^2) = alpha rho)."""
    event = dp_accounting.GaussianDpEvent(1.0 / math.sqrt(2.0 * rho_per_event))
    return event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)


@pytest.mark.parametrize("rho", [0.01, 0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-6, 1e-9])
def test_cks_epsilon_against_dp_accounting(rho, delta):
    ours = cks_epsilon(rho, delta)
    rdp = RdpAccountant()
    rdp.compose(_gaussian(rho))
    rdp_eps = rdp.get_epsilon(delta)
    # RDP uses the same conversion (CKS Prop. 12) on a finite grid of orders: never below the
    # continuous optimum, and close to it (the default grid is fine for alpha in [1.1, 64])
    assert rdp_eps >= ours * (1 - 1e-9)
    assert rdp_eps <= ours * 1.02
    # with the optimal order added to the grid, RDP gives our number
    fine = RdpAccountant(orders=_orders_with(_optimal_order(rho, ours)))
    fine.compose(_gaussian(rho))
    assert fine.get_epsilon(delta) == pytest.approx(ours, rel=1e-7)
    # PLD is (near) exact for the continuous Gaussian and tighter than any zCDP conversion; its
    # discretization is pessimistic (coarser = larger eps), so a coarse grid is still a valid check
    pld = PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(_gaussian(rho))
    assert pld.get_epsilon(delta) <= ours


# --------------------------------------------------------------------------- the plan

DPSQLP = dict(epsilon=6.0, delta=1e-9, contribution_bound=32, clamp=1.0)


def _plans():
    for T in (100, 1000):
        for comp in ("zcdp", "basic"):
            yield pytest.param(T, comp, id=f"T{T}-{comp}")


def _closed_form_rhos(plan):
    C, L, h = plan.contribution_bound, plan.clamp, plan.tree_height
    rho_k = C * h / (2 * plan.sigma_key_selection**2)
    rho_m = h * (C * L) ** 2 / (2 * plan.sigma_perturbation**2)
    return rho_k, rho_m


def _rdp_epsilon(parts, delta, extra_orders=()):
    """parts: [(sigma, sensitivity, count)]; composition of Gaussian mechanisms via dp_accounting."""
    acc = RdpAccountant(orders=_orders_with(*extra_orders)) if extra_orders else RdpAccountant()
    for sigma, sensitivity, count in parts:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / sensitivity), count))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("T,composition", list(_plans()))
def test_plan_sigmas_meet_the_budget(T, composition):
    plan = plan_query(QueryBudget(triggers=T, composition=composition, **DPSQLP))
    C, L, h = plan.contribution_bound, plan.clamp, plan.tree_height
    eps = plan.epsilon
    rho_k, rho_m = _closed_form_rhos(plan)
    assert rho_k == pytest.approx(plan.rho_key_selection, rel=1e-12)
    assert rho_m == pytest.approx(plan.rho_perturbation, rel=1e-12)
    assert plan.rho_key_selection_per_tree == pytest.approx(h / (2 * plan.sigma_key_selection**2), rel=1e-12)
    # key selection: C rounds x h levels, sensitivity 1; perturbation: h levels, sensitivity C*L
    key_part = (plan.sigma_key_selection, 1.0, C * h)
    pert_part = (plan.sigma_perturbation, C * L, h)

    if composition == "zcdp":
        total = rho_k + rho_m
        assert total == pytest.approx(plan.rho_total, rel=1e-12)
        delta = plan.delta_conversion
        # default order grid: within ~1e-5 of the optimum; with the optimal order: <= eps
        assert _rdp_epsilon([key_part, pert_part], delta) <= eps * 1.001
        a = _optimal_order(total, eps)
        assert _rdp_epsilon([key_part, pert_part], delta, [a]) <= eps * (1 + 1e-6)
        pld = PLDAccountant()
        pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.sigma_key_selection), C * h))
        pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.sigma_perturbation / (C * L)), h))
        assert pld.get_epsilon(delta) <= eps
        # not needlessly large: 3% less noise would break the budget by our own conversion
        assert cks_epsilon(total / 0.97**2, delta) > eps
        assert plan.epsilon_spent <= eps * (1 + 1e-9)
    else:
        eps_k, eps_m = 0.5 * eps, 0.5 * eps
        sampler_k = (math.exp(eps_k) + 1) * C * h * SAMPLER_TV_BOUND
        sampler_m = (math.exp(eps_m) + 1) * C * h * SAMPLER_TV_BOUND
        conv_k = 2 * plan.delta / 3 - plan.delta_beta - sampler_k
        conv_m = plan.delta / 3 - sampler_m
        assert conv_k + conv_m == pytest.approx(plan.delta_conversion, rel=1e-12)
        for part, rho, e, d in ((key_part, rho_k, eps_k, conv_k), (pert_part, rho_m, eps_m, conv_m)):
            a = _optimal_order(rho, e)
            assert _rdp_epsilon([part], d, [a]) <= e * (1 + 1e-6)
            assert cks_epsilon(rho / 0.97**2, d) > e
        assert plan.epsilon_spent == pytest.approx(eps, rel=1e-12)
    assert plan.delta_spent <= plan.delta * (1 + 1e-9)


def _pvf(i):
    """Independent prefix variance factor: one Honaker node per set bit of i, eq. (1)."""
    return sum(1 / (2 * (1 - 2.0 ** -(l + 1))) for l in range(64) if (i >> l) & 1)


@pytest.mark.parametrize("T", [1, 2, 7, 16, 100, 128, 1000])
def test_plan_bookkeeping_zcdp(T):
    plan = plan_query(QueryBudget(triggers=T, key_threshold=5.0, **DPSQLP))
    eps, delta, C = plan.epsilon, plan.delta, plan.contribution_bound
    h = math.floor(math.log2(T)) + 1
    assert plan.tree_height == h
    # default beta gives the beta term a third of delta
    assert plan.beta == pytest.approx(delta / 3 / ((math.exp(eps) + 1) * C), rel=1e-12)
    assert plan.delta_beta == pytest.approx((math.exp(eps) + 1) * C * plan.beta, rel=1e-12)
    assert plan.delta_sampler == pytest.approx((math.exp(eps) + 1) * 2 * C * h * 2.0**-100, rel=1e-12)
    assert plan.delta_conversion + plan.delta_beta + plan.delta_sampler == pytest.approx(delta, rel=1e-12)
    assert cks_delta(plan.rho_total, eps) <= plan.delta_conversion
    z = math.sqrt(2 * math.log(T / plan.beta))
    assert plan.tail_multiplier == pytest.approx(z, rel=1e-12)
    assert len(plan.thresholds) == T
    for i in range(T):
        assert plan.thresholds[i] == pytest.approx(z * plan.sigma_key_selection * math.sqrt(_pvf(i + 1)), rel=1e-12)
        assert plan.threshold(i + 1) == plan.thresholds[i]
    assert plan.expected_stddev == pytest.approx(plan.sigma_perturbation * math.sqrt(_pvf(T)), rel=1e-12)
    assert plan.key_threshold == 5.0
    assert plan.resolution == 1.0 and plan.sigma_perturbation_units == plan.sigma_perturbation
    assert plan.perturbation_sensitivity_units == C


def test_plan_bookkeeping_basic():
    plan = plan_query(QueryBudget(triggers=100, composition="basic", **DPSQLP))
    eps, delta, C = plan.epsilon, plan.delta, plan.contribution_bound
    assert plan.epsilon_key_selection == plan.epsilon_perturbation == eps / 2
    assert plan.delta_key_selection == pytest.approx(2 * delta / 3, rel=1e-12)
    assert plan.delta_perturbation == pytest.approx(delta / 3, rel=1e-12)
    assert plan.delta_beta == pytest.approx((math.exp(eps / 2) + 1) * C * plan.beta, rel=1e-12)
    assert plan.delta_beta == pytest.approx(delta / 3, rel=1e-12)  # half of delta_k by default
    assert plan.delta_conversion + plan.delta_beta + plan.delta_sampler == pytest.approx(delta, rel=1e-12)


def test_honaker_factors():
    assert [honaker_variance_factor(l) for l in range(3)] == pytest.approx([1, 2 / 3, 4 / 7], rel=1e-15)
    for i in range(1, 300):
        assert prefix_variance_factor(i) == pytest.approx(_pvf(i), rel=1e-14)


def test_sum_plan_grid():
    plan = plan_query(QueryBudget(triggers=100, aggregate="sum", **{**DPSQLP, "clamp": 10.0}))
    assert plan.sigma_perturbation_units == pytest.approx(plan.sigma_perturbation / plan.resolution, rel=1e-12)
    assert plan.sigma_perturbation_units <= 4096
    assert plan.sigma_perturbation_units > 2048 or plan.resolution == 10.0 / 2**20
    assert (plan.clamp / plan.resolution).is_integer()
    assert plan.perturbation_sensitivity_units == round(plan.contribution_bound * plan.clamp / plan.resolution)
    # the grid does not change privacy: rho from the unit-scale noise and unit sensitivity
    h = plan.tree_height
    rho_m_units = h * plan.perturbation_sensitivity_units**2 / (2 * plan.sigma_perturbation_units**2)
    assert rho_m_units == pytest.approx(plan.rho_perturbation, rel=1e-9)


# --------------------------------------------------------------------------- errors

GOOD = dict(epsilon=1.0, delta=1e-6, triggers=100, contribution_bound=4)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(epsilon=float("nan")), "epsilon"),
        (dict(epsilon=float("inf")), "epsilon"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(delta=2.0), "delta"),
        (dict(triggers=0), "triggers"),
        (dict(triggers=(1 << 24) + 1), "triggers"),
        (dict(triggers=10.5), "triggers"),
        (dict(contribution_bound=0), "contribution_bound"),
        (dict(contribution_bound=2.5), "contribution_bound"),
        (dict(aggregate="sum", clamp=0.0), "clamp"),
        (dict(aggregate="sum", clamp=-3.0), "clamp"),
        (dict(clamp=2.0), "clamp"),  # count with a clamp != 1
        (dict(aggregate="avg"), "aggregate"),
        (dict(key_threshold=-1.0), "key_threshold"),
        (dict(key_threshold=float("inf")), "key_threshold"),
        (dict(beta=0.0), "beta"),
        (dict(beta=1.0), "beta"),
        (dict(beta=1e-3), "beta"),  # (e+1)*4*1e-3 >> delta: the beta term eats delta
        (dict(beta=1e-3, composition="basic"), "beta"),
        # the sampler's term (e^eps+1)...2^-100 leaves no delta: the user's epsilon is to blame, even
        # where e^eps overflows a float (docs/privacy.md, "Sampler")
        (dict(epsilon=60.0), "epsilon"),
        (dict(epsilon=1000.0), "epsilon"),
        (dict(epsilon=1000.0, composition="basic"), "epsilon"),
        (dict(epsilon=1000.0, counter="tree", hierarchy_depth=2), "epsilon"),
        (dict(epsilon=1000.0, beta=1e-12), "epsilon"),  # even beta 0 would not do at this epsilon
        (dict(delta=1e-29, composition="zcdp"), "delta"),  # the sampler's term alone exceeds it
        (dict(key_selection_share=0.0), "key_selection_share"),
        (dict(key_selection_share=1.0), "key_selection_share"),
        (dict(composition="advanced"), "composition"),
        (dict(aggregate="sum", clamp=1.0, resolution=0.3), "resolution"),
        (dict(aggregate="sum", clamp=1.0, resolution=-0.5), "resolution"),
        (dict(resolution=0.5), "resolution"),  # counts are integers
        (dict(epsilon=1e-4, triggers=1000, contribution_bound=1000), "contribution_bound"),  # sigma_k beyond the sampler
        (dict(aggregate="sum", clamp=1.0, resolution=1e-6), "resolution"),  # sigma_m beyond the sampler
    ],
)
def test_budget_error_names_the_field(overrides, field):
    with pytest.raises(BudgetError) as err:
        plan_query(QueryBudget(**{**GOOD, **overrides}))
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_tail_multiplier_errors():
    with pytest.raises(ValueError):
        tail_multiplier(10, 0.0)
    with pytest.raises(ValueError):
        tail_multiplier(10, 1.0)
