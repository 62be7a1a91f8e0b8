"""Privacy accounting: the one place every noise scale, threshold and composition is derived.

Nothing else in dpstream re-derives a formula; the pipeline asks :func:`plan_levels`
(one plan per level of a hierarchical query; :func:`plan_query` for a flat one).
"""
from dpstream.accountant.calibration import (
    cks_delta,
    cks_epsilon,
    cks_rho,
    honaker_variance_factor,
    prefix_variance_factor,
    read_levels,
)
from dpstream.accountant.plan import (
    BudgetError,
    PrivacyPlan,
    QueryBudget,
    plan_levels,
    plan_query,
)

__all__ = [
    "BudgetError",
    "PrivacyPlan",
    "QueryBudget",
    "cks_delta",
    "cks_epsilon",
    "cks_rho",
    "honaker_variance_factor",
    "plan_levels",
    "plan_query",
    "prefix_variance_factor",
    "read_levels",
]
