"""Exact Gaussian-DP composition (``composition: gdp``) against dp-accounting 0.6.0's PLD accountant.

The plan composes the Gaussian parts in mu-GDP (mu^2 adds) and converts once with the GDP curve
``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``. These tests compute the privacy
curve of the mechanism the pipeline actually runs, the *discrete* Gaussians of the worst-case
user, with dp-accounting's privacy-loss distributions, and check it stays within the declared
budget; they also fix how much smaller sigma is than under zCDP with the CKS conversion.
"""
import math

import pytest
from dp_accounting.pld import privacy_loss_distribution as pld

from dpstream.accountant.calibration import cks_rho, gdp_delta, gdp_epsilon, gdp_mu
from dpstream.accountant.counters import BLT, LATTICE_TARGET_SIGMA
from dpstream.accountant.plan import GDP_DISCRETE_MARGIN, QueryBudget, plan_query

PAPER = dict(epsilon=6.0, delta=1e-9, contribution_bound=32)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("eps", [0.5, 2.0, 6.0])
def test_gdp_curve_matches_the_pld_of_a_gaussian(mu, eps):
    """dp-accounting's PLD of one Gaussian mechanism (sensitivity 1, sigma 1/mu; pessimistic,
    connect-the-dots discretization) bounds the closed form from above and is within 1e-4
    relative of it (its discretization error at interval 1e-5)."""
    ours = gdp_delta(mu, eps)
    theirs = pld.from_gaussian_mechanism(1.0 / mu, 1.0, value_discretization_interval=1e-5).get_delta_for_epsilon(eps)
    assert ours <= theirs * (1 + 1e-9)
    assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-15)


def test_gdp_inverses_are_consistent():
    for eps, delta in [(0.5, 1e-6), (6.0, 1e-9), (1.0, 1e-5)]:
        mu = gdp_mu(eps, delta)
        assert gdp_delta(mu, eps) <= delta
        assert gdp_delta(mu * (1 + 1e-9), eps) > delta * (1 - 1e-6)
        assert gdp_epsilon(mu, delta) == pytest.approx(eps, rel=1e-9)


@pytest.mark.parametrize("T", [100, 1000])
def test_the_discrete_mechanism_of_the_worst_case_user_stays_within_delta(T):
    """The tree plan under GDP: the worst-case user reaches C key-selection trees with 1 on each of
    h read nodes, and one perturbation tree with C on each of its h read levels (all C records in
    one node per level). dp-accounting composes the exact discrete Gaussian privacy losses of
    those nodes; their delta at epsilon must not exceed the part the plan gives the Gaussians.
    Without GDP_DISCRETE_MARGIN this fails: the discrete curve is about 1e-5 above the
    continuous one, the PLD's own discretization another 1e-5."""
    plan = plan_query(QueryBudget(triggers=T, composition="gdp", **PAPER))
    C, h = plan.contribution_bound, plan.tree_height
    selection = pld.from_discrete_gaussian_mechanism(plan.sigma_key_selection, 1, use_connect_dots=True).self_compose(C * h)
    perturbation = pld.from_discrete_gaussian_mechanism(plan.sigma_perturbation, C, use_connect_dots=True).self_compose(h)
    delta = selection.compose(perturbation).get_delta_for_epsilon(plan.epsilon)
    assert delta <= plan.delta_conversion
    assert delta >= plan.delta_conversion * (1 - 3 * GDP_DISCRETE_MARGIN)  # and the calibration is tight


@pytest.mark.parametrize("counter", ["binary_tree", "blt"])
def test_gdp_sigmas_are_smaller_than_zcdp_by_the_exact_conversion(counter):
    """At the paper's budget GDP's mu is 4.2% above zCDP's sqrt(2 rho): every sigma is 4.2%
    smaller. The figure is the ratio of the two conversions, independent of the counter."""
    for T in (100, 1000):
        zcdp = plan_query(QueryBudget(triggers=T, counter=counter, **PAPER))
        gdp = plan_query(QueryBudget(triggers=T, counter=counter, composition="gdp", **PAPER))
        ratio = gdp.sigma_perturbation / zcdp.sigma_perturbation
        expected = math.sqrt(2 * cks_rho(6.0, zcdp.delta_conversion)) / gdp_mu(6.0, gdp.delta_conversion * (1 - GDP_DISCRETE_MARGIN))
        assert ratio == pytest.approx(expected, rel=1e-3)
        assert 0.955 < ratio < 0.962
        assert gdp.sigma_key_selection / zcdp.sigma_key_selection == pytest.approx(ratio, rel=2e-3)
        assert gdp.delta_spent <= gdp.delta and gdp.epsilon_spent <= gdp.epsilon * (1 + 1e-9)


@pytest.mark.parametrize("T", [10, 100, 1000])
def test_blt_plan_spends_exactly_mu_on_the_worst_case_user(T):
    """BLT under GDP: the worst-case user's squared shift over sigma^2, summed over its C
    key-selection streams (unit increments) and its perturbation streams (C L in one stream;
    the rounding slack on every touched stream), is mu^2: the plan spends all of the budget and
    not more. The slack is bounded with the lattice step at its largest, 2 sigma / target."""
    plan = plan_query(QueryBudget(triggers=T, counter="blt", composition="gdp", **PAPER))
    C, L = plan.contribution_bound, plan.clamp
    mu_sq = 2 * plan.rho_total
    col2, col1, slack = BLT.sensitivity_sq(T), BLT.sensitivity_l1(T), BLT.slack(T)

    def spent(sigma, streams, bound):
        s = slack * 2 * sigma / LATTICE_TARGET_SIGMA
        return (bound * bound * col2 + 2 * s * bound * col1 + streams * T * s * s) / sigma ** 2

    total = C * spent(plan.sigma_key_selection, 1, 1.0) + spent(plan.sigma_perturbation, C, C * L)
    assert total == pytest.approx(mu_sq, rel=1e-9)
    # and the continuous-Gaussian PLD of those sensitivities is within the Gaussian part's delta
    sel = pld.from_gaussian_mechanism(plan.sigma_key_selection, math.sqrt(C * spent(plan.sigma_key_selection, 1, 1.0)) * plan.sigma_key_selection,
                                      value_discretization_interval=1e-5)
    per = pld.from_gaussian_mechanism(plan.sigma_perturbation, math.sqrt(spent(plan.sigma_perturbation, C, C * L)) * plan.sigma_perturbation,
                                      value_discretization_interval=1e-5)
    assert sel.compose(per).get_delta_for_epsilon(plan.epsilon) <= plan.delta_conversion
