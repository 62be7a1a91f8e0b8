"""Closed-form privacy arithmetic: zCDP <-> (epsilon, delta), tree levels, Honaker variances.

Everything here is a pure function of public parameters. The zCDP-to-(epsilon, delta)
conversion is the optimal one of Canonne, Kamath and Steinke, "The Discrete Gaussian for
Differential Privacy" (NeurIPS 2020), Proposition 12 / Corollary 13:

    rho-zCDP  =>  (eps, delta)-DP for
    delta = inf_{alpha > 1}  exp((alpha-1)(alpha*rho - eps) + alpha*log(1 - 1/alpha)) / (alpha - 1)

It is tighter than the textbook ``eps = rho + 2 sqrt(rho ln(1/delta))`` used in DP-SQLP's
Theorem 2.3, and it is valid for the *discrete* Gaussian, which satisfies exactly the same
zCDP bound as the continuous one (CKS Theorem 4). DP-SQLP Appendix B uses the same conversion
(its footnote points at ``cdp2adp.py``). The log of the bound is convex in alpha, with
derivative ``(2 alpha - 1) rho - eps + log(1 - 1/alpha)``, so a bisection on the derivative
finds the optimum; any alpha gives a valid (upper) bound, so numerical slack only ever errs on
the safe side.
"""
from __future__ import annotations

import math
from functools import lru_cache

_ITERATIONS = 200


def cks_delta(rho: float, eps: float) -> float:
    """Smallest delta such that rho-zCDP implies (eps, delta)-DP (CKS Corollary 13)."""
    if rho < 0 or eps < 0:
        raise ValueError("rho and eps must be non-negative")
    if rho == 0:
        return 0.0
    lo, hi = 1.0 + 1e-12, max(2.0, (eps + 1.0) / (2.0 * rho) + 2.0)
    for _ in range(_ITERATIONS):
        alpha = 0.5 * (lo + hi)
        derivative = (2.0 * alpha - 1.0) * rho - eps + math.log1p(-1.0 / alpha)
        if derivative < 0:
            lo = alpha
        else:
            hi = alpha
    alpha = hi
    log_delta = (alpha - 1.0) * (alpha * rho - eps) + alpha * math.log1p(-1.0 / alpha) - math.log(alpha - 1.0)
    return min(1.0, math.exp(log_delta))


def _bisect(below, lo: float, hi: float) -> tuple[float, float]:
    """``_ITERATIONS`` halvings of [lo, hi] keeping ``below(lo)`` true and ``below(hi)`` false."""
    for _ in range(_ITERATIONS):
        mid = 0.5 * (lo + hi)
        if below(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def cks_epsilon(rho: float, delta: float) -> float:
    """Smallest eps such that rho-zCDP implies (eps, delta)-DP."""
    if not 0 < delta:
        raise ValueError("delta must be positive")
    if delta >= 1 or rho == 0:
        return 0.0
    hi = rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))  # the standard bound
    return _bisect(lambda eps: cks_delta(rho, eps) > delta, 0.0, hi)[1]


def cks_rho(eps: float, delta: float) -> float:
    """Largest rho such that rho-zCDP implies (eps, delta)-DP."""
    if eps <= 0 or not 0 < delta < 1:
        raise ValueError("need eps > 0 and 0 < delta < 1")
    return _bisect(lambda rho: cks_delta(rho, eps) <= delta, 0.0, eps + 1.0)[0]


def read_levels(triggers: int) -> int:
    """Number of tree levels whose nodes some output reads: ``floor(lg T) + 1``.

    A node at level l (leaves are level 0) with index j covers leaves ``j*2^l+1 .. (j+1)*2^l``.
    Bottom-up Honaker estimation (DP-SQLP section 2.2) only ever reads a node once it is
    *complete*, i.e. ``(j+1) * 2^l <= T``; an incomplete node's noisy value is never used, not
    even through an ancestor (ancestors of an incomplete node are incomplete). The path from
    leaf 1 to the root passes a complete node at every level l with ``2^l <= T``, so one
    contribution reaches ``floor(lg T) + 1`` read nodes, and no leaf reaches more. For T = 100
    this is 7 = ceil(lg 100), the paper's h; for T a power of two it is one more than the
    paper's ``ceil(lg T)`` (the root of a full tree is complete and read at leaf T).
    """
    if triggers < 1:
        raise ValueError("triggers must be >= 1")
    return int(triggers).bit_length()


def tree_levels(triggers: int) -> int:
    """Levels of the padded tree with ``2^ceil(lg T)`` leaves (Algorithm 1, line 1)."""
    return max(1, (int(triggers) - 1).bit_length() + 1)


@lru_cache(maxsize=64)
def honaker_variance_factor(level: int) -> float:
    """Var(bottom-up Honaker estimate of a node at ``level``) / sigma^2, DP-SQLP eq. (1).

    A node at level l roots a subtree with kappa = l + 1 levels, giving
    ``1 / (2 (1 - 2^-kappa))``: 1 for a leaf, 2/3 one level up, 4/7 the next.
    """
    return 1.0 / (2.0 * (1.0 - 2.0 ** (-(level + 1))))


@lru_cache(maxsize=64)
def honaker_weights(level: int) -> tuple[float, float]:
    """Inverse-variance weights (own noisy value, sum of children's estimates) at ``level``.

    The children's sum has variance ``2 v_{l-1} sigma^2``, the node's own noisy value
    ``sigma^2``; weighting each by the inverse of its variance gives the estimate whose variance
    is :func:`honaker_variance_factor`. Level 0 (a leaf) has no children: weights (1, 0).
    """
    if level == 0:
        return 1.0, 0.0
    children = 2.0 * honaker_variance_factor(level - 1)
    return children / (1.0 + children), 1.0 / (1.0 + children)


def honaker_denominator(level: int) -> int:
    """``D_l = 2^(l+1) - 1``: the exact integer form of bottom-up Honaker estimation.

    With integer noisy node values ``y`` (data + integer noise), define ``F_0 = y`` at a leaf and
    ``F_l = 2^l * y + F_left + F_right`` at level l. Then the Honaker estimate of a level-l node
    is exactly ``F_l / D_l``. Proof by induction: the weights of :func:`honaker_weights` are
    ``a_l = 2^l / D_l`` and ``b_l = (2^l - 1) / D_l`` (the children's sum has variance
    ``2 v_{l-1} = 2^l / (2^l - 1)`` sigma^2), so ``a_l y + b_l (F_L / D_{l-1} + F_R / D_{l-1})``
    ``= (2^l y + F_L + F_R) / D_l`` because ``D_{l-1} = 2^l - 1``. Every ``D_l`` is odd, so a sum
    of estimates (a prefix) is a fraction with an odd denominator: it is never half-way between
    two integers, and rounding it to the nearest integer is unambiguous.
    """
    if level < 0:
        raise ValueError("level must be >= 0")
    return (1 << (level + 1)) - 1


def prefix_variance_factor(leaf: int) -> float:
    """Var(noisy prefix sum S_1..S_leaf) / sigma^2 (DP-SQLP eq. (2)).

    The prefix [1, leaf] is read from one complete node per set bit of ``leaf`` (level = bit
    position), and the Honaker estimates of distinct complete maximal nodes are independent.
    """
    if leaf < 1:
        raise ValueError("leaf must be >= 1")
    total, level = 0.0, 0
    while leaf:
        if leaf & 1:
            total += honaker_variance_factor(level)
        leaf >>= 1
        level += 1
    return total


def tail_multiplier(triggers: int, beta: float) -> float:
    """z such that a prefix-noise sum exceeds ``z * lambda_i`` at any of T triggers w.p. <= beta.

    ``z = sqrt(2 ln(T / beta))``. Every discrete Gaussian N_Z(0, sigma^2) is sigma^2-subgaussian
    (Canonne, Kamath, Steinke 2020, Corollary 23) and so is any weighted sum of independent ones
    with variance proxy ``lambda^2``; hence ``P[noise > z lambda] <= exp(-z^2/2) = beta / T``
    holds exactly for our integer noise, and a union bound over the T triggers gives beta.

    DP-SQLP Appendix B uses ``Phi^-1(1 - beta / T)`` (about 6% lower). That quantile is exact
    only for continuous noise: with integer noise ``P[N > tau] = P[N >= ceil(tau)]`` can exceed
    ``beta / T`` (1.9x at T = 1 in our tests), which would under-charge delta, so it is not
    offered.
    """
    if not 0 < beta < 1:
        raise ValueError("beta must be in (0, 1)")
    return math.sqrt(2.0 * math.log(triggers / beta))


def _phi(x: float) -> float:
    """Standard normal CDF, accurate in the far lower tail (erfc)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gdp_delta(mu: float, eps: float) -> float:
    """Smallest delta such that mu-GDP implies (eps, delta)-DP (Dong, Roth and Su 2022, Corollary
    2.13; the same curve as Balle and Wang 2018, Theorem 8):

        delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).

    A Gaussian mechanism of L2 sensitivity Delta and scale sigma is (Delta/sigma)-GDP, and
    Gaussian mechanisms compose exactly: mu^2 adds (their Corollary 3.3)."""
    if mu < 0 or eps < 0:
        raise ValueError("mu and eps must be non-negative")
    if mu == 0:
        return 0.0
    return max(0.0, _phi(-eps / mu + mu / 2.0) - math.exp(eps) * _phi(-eps / mu - mu / 2.0))


def gdp_mu(eps: float, delta: float) -> float:
    """Largest mu such that mu-GDP implies (eps, delta)-DP (delta(eps) increases with mu)."""
    if eps <= 0 or not 0 < delta < 1:
        raise ValueError("need eps > 0 and 0 < delta < 1")
    lo, hi = 0.0, 1.0
    while gdp_delta(hi, eps) <= delta:
        lo, hi = hi, 2.0 * hi
    return _bisect(lambda mu: gdp_delta(mu, eps) <= delta, lo, hi)[0]


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest eps such that mu-GDP implies (eps, delta)-DP (delta(eps) decreases with eps)."""
    if not 0 < delta:
        raise ValueError("delta must be positive")
    if delta >= 1 or mu == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2.0 * hi
    return _bisect(lambda eps: gdp_delta(mu, eps) > delta, lo, hi)[1]
