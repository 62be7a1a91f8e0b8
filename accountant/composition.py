"""A user's privacy loss over many windows and queries: ``basic``, ``zcdp`` and ``pld`` totals
(docs/privacy.md, "Totals over time").

Each window a query charges is one :class:`WindowLoss`: its (epsilon, delta) as the ledger has
always charged them (``basic``: epsilons and deltas add), and the terms the tighter accountings
compose instead:

* ``rho``: the zCDP of its noise (the plan's ``rho_total``: discrete Gaussians, on the integers
  or on a BLT lattice, are ``shift^2 / (2 sigma^2)``-zCDP, Canonne, Kamath and Steinke 2020;
  a dynamic query's ``epsilon``-DP Laplace noise is ``epsilon^2 / 2``-zCDP, Bun and Steinke 2016
  Proposition 1.4). zCDP composes by adding rho; one optimal conversion (CKS Proposition 12)
  gives the total (epsilon, delta).
* ``parts`` and ``pure``: the exact privacy-loss distribution of its noise where the mechanism
  allows one: the binary tree's discrete Gaussians (:func:`dpstream.accountant.plan.worst_case_parts`)
  and randomized response for a pure-DP mechanism. Privacy-loss distributions compose exactly
  (:mod:`dpstream.accountant.discrete_gaussian_curve`); ``pld`` is the tightest total. The BLT's
  lattice noise has no exact curve here (its window accountant uses the continuous Gaussian with
  a margin), so a total that includes a BLT window has no ``pld`` value: ``zcdp`` is offered.
* ``failure``: key selection's thresholding. The per-window argument (DP-SQLP Theorem 3.1) charges
  ``(e^eps + 1) C beta`` to delta. Over many windows that factor would be e^(total epsilon), so
  the totals use the two-sided coupling of docs/privacy.md ("Totals over time") instead: the
  probability that a key of the user is released while only the user could have made it cross
  the threshold, added once, with no e^eps factor (:func:`selection_failure`).
* ``draws``: noise draws the user's data reaches. Each comes from a table sampler whose
  probabilities are within 2^-128 of the exact discrete Gaussian's (dpstream.processor.mechanisms.noise).
  Where the exact probability is at least ``2^-128 / TABLE_RELATIVE_ERROR`` the table is within
  a relative ``gamma`` of it; the rest of the outputs (the "bad" set, far in a tail) is charged
  to delta by its mass. Then ``delta_real(eps) <= (1 + gamma)^n delta_ideal(eps - n kappa) +
  P[bad]`` with ``kappa = ln((1 + gamma) / (1 - gamma))`` (:func:`sampler_terms`), again with
  no e^eps factor (the per-window ``(e^eps + 1)`` TV term would pass any delta above epsilon ~40).

:func:`total_epsilon` and :func:`total_delta` evaluate a :class:`Total` in one accounting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from dpstream.accountant.calibration import cks_delta, cks_epsilon
from dpstream.accountant.counters import BINARY_TREE, counter_calibration
from dpstream.accountant.discrete_gaussian_curve import (
    canonical_parts,
    canonical_pure,
    composition_delta,
    composition_epsilon,
)
from dpstream.accountant.plan import MAX_SAMPLER_SIGMA, SAMPLER_TV_BOUND, worst_case_parts

#: how the budget ledger adds charges, and how ``dpstream plan`` totals them (``budget.accounting``)
ACCOUNTINGS = ("basic", "zcdp", "pld")
#: each table probability is within this (2^-128) of the exact one (dpstream.processor.mechanisms.noise)
TABLE_QUANTUM = 2.0 ** -128
#: relative error of the table's probabilities allowed on the outputs the totals call good
TABLE_RELATIVE_ERROR = 2.0 ** -40
#: the relative error there, counting the table's renormalization after truncation (its
#: truncated mass is below SAMPLER_TV_BOUND)
_GAMMA = TABLE_RELATIVE_ERROR + SAMPLER_TV_BOUND
_KAPPA = math.log1p(_GAMMA) - math.log1p(-_GAMMA)


def _good_radius() -> float:
    """r: every |x| <= r sigma has exact probability >= 2^-128 / gamma, for every sigma the
    sampler takes (the pmf is ``e^{-x^2 / 2 sigma^2} / Z`` with ``Z <= sigma sqrt(2 pi) + 1``,
    worst at the largest sigma)."""
    log_threshold = math.log(TABLE_RELATIVE_ERROR) - math.log(TABLE_QUANTUM)  # ln(gamma / 2^-128)
    return math.sqrt(2.0 * (log_threshold - math.log(MAX_SAMPLER_SIGMA * math.sqrt(2.0 * math.pi) + 1.0)))


GOOD_RADIUS = _good_radius()


@dataclass(frozen=True)
class WindowLoss:
    """One charge (a window of a DP-SQLP query, or a dynamic query's one charge) in the terms of
    every accounting (module docstring). ``parts`` None: no exact curve (the BLT)."""

    epsilon: float
    delta: float
    rho: float
    failure: float = 0.0
    draws: int = 0
    parts: Optional[tuple] = ()
    pure: tuple = ()

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta, "rho": self.rho, "failure": self.failure, "draws": self.draws,
                "parts": None if self.parts is None else [list(p) for p in self.parts], "pure": [list(p) for p in self.pure]}

    @classmethod
    def from_dict(cls, d: dict) -> "WindowLoss":
        parts = d.get("parts")
        return cls(d["epsilon"], d["delta"], d["rho"], d.get("failure", 0.0), int(d.get("draws", 0)),
                   None if parts is None else tuple(tuple(p) for p in parts), tuple(tuple(p) for p in d.get("pure", ())))


def selection_failure(plans: Sequence) -> float:
    """The probability, over one window of a query, that key selection releases one of a user's
    keys at a trigger where only the user's own records could have put it above the threshold:
    per (key, round) tree and trigger i, the noise exceeds ``z lambda_i - w`` (w the user's
    largest selection weight, 1 without weights: while the key's gate is still closed without
    the user, the others have given at most mu, so the count is at most ``mu + w``); the noise
    is ``lambda_i^2``-subgaussian (CKS Corollary 23), so each tree fails with probability at most
    ``sum_i exp(-(z - w / lambda_i)^2 / 2)``, and a user reaches C trees per level. The per-window
    ``C beta`` is the same sum at ``w = 0`` (docs/privacy.md, "Totals over time")."""
    total = 0.0
    for p in plans:
        if p.public_keys or p.sigma_key_selection == 0:
            continue
        counter = BINARY_TREE if p.counter is None else counter_calibration(p.counter)
        T = p.triggers
        lam = p.sigma_key_selection * np.sqrt(np.array([counter.step_variance(r, T) for r in range(1, T + 1)]))
        weight = float(max(p.selection_weights) if p.selection_weights else 1)
        margin = np.maximum(0.0, p.tail_multiplier - weight / lam)
        per_tree = min(1.0, float(np.sum(np.exp(-margin * margin / 2.0))))
        total += p.contribution_bound * per_tree
    return min(1.0, total)


def user_draws(plan) -> int:
    """Noise draws one user's records reach in one window of a query, over all its levels: a
    selection stream (none with public keys) and one perturbation stream per column, per key round
    and level, each reaching the counter's draws (``h`` for the tree, T for the BLT): the
    per-window sampler term's count (dpstream.accountant.plan)."""
    counter = BINARY_TREE if plan.counter is None else counter_calibration(plan.counter)
    columns = 1 if plan.columns is None else len(plan.columns)
    trees = columns if plan.public_keys else 1 + columns
    return plan.levels * trees * plan.contribution_bound * counter.draws(plan.triggers)


def query_loss(plans: Sequence) -> WindowLoss:
    """One window of a DP-SQLP query (all its levels' plans)."""
    p = plans[0]
    exact = all(q.counter is None for q in plans)
    parts = canonical_parts(part for q in plans for group in worst_case_parts(q) for part in group) if exact else None
    return WindowLoss(p.epsilon_spent, p.delta_spent, p.rho_total, selection_failure(plans), user_draws(p), parts)


def dynamic_loss(epsilon: float) -> WindowLoss:
    """A dynamic query's one charge: epsilon-DP through exactly sampled discrete Laplace noise
    (no table sampler, no failure term)."""
    return WindowLoss(float(epsilon), 0.0, float(epsilon) ** 2 / 2.0, pure=((float(epsilon), 1),))


@dataclass
class Total:
    """Charges composed: the sums every accounting needs (``add`` one charge, or ``count`` of it).
    ``legacy_*``: charges recorded with (epsilon, delta) only, composed with the rest by basic
    composition. ``exact``: every charge has an exact curve (``pld`` is defined)."""

    epsilon: float = 0.0
    delta: float = 0.0
    rho: float = 0.0
    failure: float = 0.0
    draws: int = 0
    max_rho: float = 0.0  # the largest one charge's rho: bounds any one draw's shift / sigma
    parts: list = field(default_factory=list)
    pure: list = field(default_factory=list)
    exact: bool = True
    legacy_epsilon: float = 0.0
    legacy_delta: float = 0.0

    def add(self, loss: Optional[WindowLoss], count: int = 1, epsilon: float = 0.0, delta: float = 0.0) -> "Total":
        if loss is None:  # a charge recorded before its loss terms were
            self.epsilon += count * epsilon
            self.delta += count * delta
            self.legacy_epsilon += count * epsilon
            self.legacy_delta += count * delta
            return self
        self.epsilon += count * loss.epsilon
        self.delta += count * loss.delta
        self.rho += count * loss.rho
        self.failure += count * loss.failure
        self.draws += count * loss.draws
        if count:
            self.max_rho = max(self.max_rho, loss.rho)
        if loss.parts is None:
            self.exact = False
        else:
            self.parts = [list(p) for p in canonical_parts([*self.parts, *((s, d, n * count) for s, d, n in loss.parts)])]
        self.pure = [list(p) for p in canonical_pure([*self.pure, *((e, n * count) for e, n in loss.pure)])]
        return self

    def copy(self) -> "Total":
        return Total(**{**self.__dict__, "parts": [list(p) for p in self.parts], "pure": [list(p) for p in self.pure]})

    def to_dict(self) -> dict:
        return self.copy().__dict__

    @classmethod
    def from_dict(cls, d: dict) -> "Total":
        return cls(**d)


def sampler_terms(total: Total) -> tuple[float, float, float]:
    """(multiplier, epsilon shift, bad mass) of the table samplers over ``total.draws`` draws:
    ``delta_real(eps) <= multiplier delta_ideal(eps - shift) + bad`` (module docstring). A draw's
    shift is at most ``sigma sqrt(2 rho)`` (one draw's zCDP is part of its charge's rho), so the bad
    set's mass is at most ``2 exp(-(r - sqrt(2 rho))^2 / 2)`` per draw (the discrete Gaussian is
    sigma^2-subgaussian) plus the table's TV distance, counted twice (it also bounds how much the
    thresholding failure grows under the table)."""
    n = total.draws
    if n == 0:
        return 1.0, 0.0, 0.0
    margin = GOOD_RADIUS - math.sqrt(2.0 * total.max_rho)
    tail = 1.0 if margin <= 0 else min(1.0, 2.0 * math.exp(-margin * margin / 2.0))
    return math.exp(n * math.log1p(_GAMMA)), n * _KAPPA, min(1.0, n * (tail + 2.0 * SAMPLER_TV_BOUND))


def _ideal_delta(total: Total, accounting: str, eps: float) -> float:
    if accounting == "zcdp":
        return cks_delta(total.rho, eps) if total.rho > 0 else 0.0
    return composition_delta(total.parts, total.pure, eps)


def _ideal_epsilon(total: Total, accounting: str, delta: float) -> float:
    if accounting == "zcdp":
        return cks_epsilon(total.rho, delta) if total.rho > 0 else 0.0
    return composition_epsilon(total.parts, total.pure, delta)


def available(total: Total, accounting: str) -> bool:
    return accounting != "pld" or total.exact


def total_delta(total: Total, accounting: str, epsilon: float) -> float:
    """The composed delta at ``epsilon`` (inf: ``pld`` without an exact curve)."""
    if accounting == "basic":
        return total.delta if total.epsilon <= epsilon * (1 + 1e-12) else 1.0
    if not available(total, accounting):
        return math.inf
    eps = epsilon - total.legacy_epsilon
    multiplier, shift, bad = sampler_terms(total)
    if eps - shift < 0:
        return 1.0
    return min(1.0, multiplier * _ideal_delta(total, accounting, eps - shift) + bad + total.failure + total.legacy_delta)


def total_epsilon(total: Total, accounting: str, delta: float) -> float:
    """The composed epsilon at ``delta`` (``basic``: the sum of epsilons, valid for the sum of
    deltas only: inf when ``delta`` is below it). inf when ``delta`` does not cover the failure
    and sampler terms, or ``pld`` has no exact curve."""
    if accounting == "basic":
        return total.epsilon if total.delta <= delta * (1 + 1e-12) else math.inf
    if not available(total, accounting):
        return math.inf
    multiplier, shift, bad = sampler_terms(total)
    left = (delta - bad - total.failure - total.legacy_delta) / multiplier
    if left <= 0:
        return math.inf
    if left >= 1:
        return total.legacy_epsilon
    return _ideal_epsilon(total, accounting, left) + shift + total.legacy_epsilon


def compose(terms: Iterable[tuple[WindowLoss, int]]) -> Total:
    """The total of ``count`` charges of each loss."""
    out = Total()
    for loss, count in terms:
        out.add(loss, count)
    return out


def composed_horizons(spends: Sequence, losses: dict, horizons: Sequence[tuple[str, int]], delta: Optional[float] = None) -> dict:
    """Per input topic and horizon, the total of every window its queries can reach in a
    UTC-aligned horizon (``spends``: :class:`dpstream.accountant.plan.Spend`; ``losses``: each
    query's :class:`WindowLoss` by name), composed by ``zcdp`` and ``pld`` at ``delta`` (None:
    the basic total's own delta for that horizon, for a like-for-like comparison). A value is None
    where the accounting has no total: ``pld`` with a BLT query, or a delta that does not cover
    the failure and sampler terms."""
    from dpstream.accountant.plan import windows_in

    topics: dict[str, list] = {}
    for s in spends:
        topics.setdefault(s.topic, []).append(s)
    out = {}
    for topic, group in topics.items():
        per = {}
        for name, ms in horizons:
            total = compose((losses[s.name], windows_in(ms, s.window_ms)) for s in group)
            at = total.delta if delta is None else delta
            row = {"delta": at, "basic_epsilon": total.epsilon, "basic_delta": total.delta}
            for accounting in ("zcdp", "pld"):
                eps = total_epsilon(total, accounting, at)
                row[accounting] = None if not math.isfinite(eps) else eps
            multiplier, shift, bad = sampler_terms(total)
            row["terms"] = {"rho": total.rho, "failure": total.failure, "sampler_bad_mass": bad, "sampler_epsilon": shift,
                            "draws": total.draws, "exact_curve": total.exact}
            per[name] = row
        out[topic] = per
    return out
