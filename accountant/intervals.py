"""Confidence intervals of releases: the half-width a release's noise stays within at the
documented level (docs/privacy.md, "Error bars").

Every interval is ``noisy value +- half-width``, the half-width a function of the noise
distribution of the release's counter only (its scale, step and horizon), never of raw data: for
DP-SQLP releases those are public parameters; for dynamic counts they also follow from the
mechanism's own privatized decisions (below). Either way it is post-processing of privatized
values. Half-widths are whole grid steps
(integers for counts), so the bounds are on the same grid as the value. The level is per
release: :data:`CI_LEVEL` of the releases' intervals contain their true (bounded) values, not all
of a trigger's at once.

* DP-SQLP perturbation (:func:`gaussian_halfwidth_units`): the noise of a release is a weighted
  sum of independent discrete Gaussians (a Honaker tree prefix or a BLT prefix) with standard
  deviation at most the release's ``stddev`` (a discrete Gaussian of scale sigma has variance
  below sigma^2: CKS 2020), plus, for the BLT, a rounding part bounded by
  ``bias_units(t, T) / K`` grid steps (dpstream.accountant.counters). The half-width is
  ``ceil(z stddev + bias)``, z the two-sided normal quantile. The release is that noisy prefix
  rounded to the nearest whole step, so the interval misses the truth only when the unrounded
  noise is at least ``h + 1/2``: the half step is slack for the discreteness of the noise.
* Dynamic counts (:func:`discrete_laplace_sum_halfwidth`): the noise is a sum of independent
  discrete Laplace draws. Their scales are not public constants: they follow from the budget and
  from the mechanism's privatized decisions - where segments closed (the partitioner's SVT
  output, hence each counter's step) and, for the interval tree, each read node's current round
  (its restarts) and whether it halted (both decided from the node's noisy size and deletion
  count). Functions of DP outputs, so the interval costs nothing, but its width moves with those
  decisions (docs/privacy.md, "Error bars"). Their sum has no closed-form quantile, so the
  half-width is the smaller of two valid bounds on ``P(|noise| > h)``: a Chernoff bound with the
  exact moment generating function, and a union bound over the draws with each draw's exact tail
  (exact when there is a single draw). Both are upper bounds, so the coverage is at least the
  level.
"""
from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist
from typing import Sequence

import numpy as np

from dpstream.accountant.counters import (
    CounterCalibration,
    counter_calibration,
    lattice_scale,
)
from dpstream.accountant.dynamic import discrete_laplace_tail

#: the level of every published interval (its fields are named for it: ``ci95_low``, ``ci95_high``)
CI_LEVEL = 0.95
#: field-name stem of the intervals: ``<stem>_low`` and ``<stem>_high`` (``sum_<stem>_low`` ... for a mean)
CI_FIELD = f"ci{round(CI_LEVEL * 100)}"
#: relative margin on float bounds, covering their rounding (the computed bound is then an upper bound)
_SAFE = 1.0 + 1e-9


def normal_quantile(level: float = CI_LEVEL) -> float:
    """z with ``P(|N(0, 1)| <= z) = level``: the ``(1 + level) / 2`` quantile (1.959964 at 0.95)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    return NormalDist().inv_cdf(0.5 + level / 2.0)


@lru_cache(maxsize=4096)
def _gaussian_halfwidth(counter_name: str, sigma_units: float, step: int, steps: int, level: float) -> int:
    counter = counter_calibration(counter_name)
    sd = sigma_units * math.sqrt(counter.step_variance(step, steps))
    bias = counter.bias_units(step, steps) / lattice_scale(sigma_units) if counter.lattice else 0.0
    return int(math.ceil((normal_quantile(level) * sd + bias) * _SAFE))


def gaussian_halfwidth_units(counter: CounterCalibration, sigma_units: float, step: int, steps: int,
                             level: float = CI_LEVEL) -> int:
    """Half-width, in whole grid steps, of the interval of a perturbation release at ``step`` of
    a counter over ``steps`` steps with node scale ``sigma_units`` (grid steps): ``ceil(z sd +
    bias)`` with ``sd = sigma_units sqrt(step_variance(step, steps))`` (the release's ``stddev``
    over the grid step) and, for a lattice counter, ``bias = bias_units(step, steps) / K``."""
    if not 1 <= step <= steps:
        raise ValueError(f"step {step} outside 1..{steps}")
    return _gaussian_halfwidth(counter.name, float(sigma_units), int(step), int(steps), float(level))


def _laplace_log_mgf(scales: np.ndarray, copies: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """``sum_i copies_i log E[exp(lam X_i)]`` for X_i discrete Laplace with P[x] ~ exp(-|x| / s_i),
    at each ``lam`` (below every 1 / s_i): ``log((1 - q)^2 / ((1 - q e^lam) (1 - q e^-lam)))``,
    ``q = exp(-1 / s)``, in expm1/log1p form."""
    a = -1.0 / scales[:, None]
    lam = lam[None, :]
    terms = 2.0 * np.log(-np.expm1(a)) - np.log(-np.expm1(a + lam)) - np.log(-np.expm1(a - lam))
    return (copies[:, None] * terms).sum(axis=0)


def _chernoff_threshold(scales: np.ndarray, copies: np.ndarray, failure: float) -> float:
    """An ``a`` with ``P(|sum| >= a) <= failure``: ``min over lam of (K(lam) + ln(2 / failure)) / lam``
    (Chernoff on each side; K the log moment generating function). Every lam gives a valid ``a``;
    the grid search and its refinement only make it small. The function is quasi-convex in lam
    (``lam K' - K`` increases), so the refinement around the grid's best point finds its minimum."""
    cap = float(np.min(1.0 / scales))
    c = math.log(2.0 / failure)

    def value(lam: np.ndarray) -> np.ndarray:
        return (_laplace_log_mgf(scales, copies, lam) + c) / lam

    # (0, cap), geometric towards both ends: the best lam is near 0 for many draws, near cap for one
    grid = cap * np.unique(np.concatenate([np.geomspace(1e-7, 0.5, 300), 1.0 - np.geomspace(0.5, 1e-9, 300)]))
    values = value(grid)
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    fine = np.linspace(lo, hi, 257)
    return float(min(values[best], float(np.min(value(fine)))))


def discrete_laplace_sum_halfwidth(scales: Sequence[float], copies: int = 1, level: float = CI_LEVEL) -> int:
    """The smallest integer h this module can prove ``P(|N| > h) <= 1 - level`` for, N the sum of
    ``copies`` independent draws of each discrete Laplace scale in ``scales`` (a scale may repeat:
    one draw per entry). 0 when there is no draw (no noise)."""
    failure = 1.0 - level
    if not 0.0 < failure < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    active = [float(s) for s in scales if s > 0 and 1.0 / s <= 700]  # exp(-1/s) underflows: the draw is 0
    if not active or copies <= 0:
        return 0
    n = len(active) * copies
    # union bound: P(|N| > sum m_i) <= sum P(|X_i| > m_i), each term at most failure / n (exact tails)
    union = copies * sum(discrete_laplace_tail(s, failure / n) for s in active)
    uniq, counts = np.unique(np.array(active), return_counts=True)
    return _laplace_sum_halfwidth(tuple(uniq.tolist()), tuple((counts * copies).tolist()), failure, union)


@lru_cache(maxsize=1024)
def _laplace_sum_halfwidth(scales: tuple, copies: tuple, failure: float, union: int) -> int:
    s, c = np.array(scales), np.array(copies, dtype=np.float64)
    a = _chernoff_threshold(s, c, failure) * _SAFE
    best = min(union, max(0, math.ceil(a) - 1))  # P(|N| > h) = P(|N| >= h + 1) <= failure once h + 1 >= a
    exact = _fft_halfwidth(s, c, failure)
    return int(best if exact is None else min(best, exact))


#: the distribution of a sum is computed exactly (below) on at most this many integers
FFT_MAX_SIZE = 1 << 21
#: tail mass outside the FFT's range, bounded by Chernoff; and a bound on the FFT's float error
_FFT_TAIL, _FFT_ERROR = 1e-12, 1e-8


def _fft_halfwidth(scales: np.ndarray, copies: np.ndarray, failure: float):
    """The smallest h with ``P(|N| <= h) >= 1 - failure``, from N's distribution computed on the
    integers modulo L by the inverse FFT of its characteristic function, ``prod_i phi_i(u)^copies_i``
    with ``phi(u) = (1 - q)^2 / ((1 - q)^2 + 4 q sin^2(u / 2))`` at ``u = 2 pi k / L``. That gives
    ``p_L(k) = sum_j P(N = k + j L)``: for ``h < L / 2`` the aliased mass in ``|k| <= h`` is at most
    ``P(|N| >= L - h)``, which Chernoff bounds by 1e-12 (L is chosen so), and the float error of
    the FFT is far below 1e-8; both are subtracted, so the h found is valid. None when the sum is
    too wide for :data:`FFT_MAX_SIZE` integers (the caller's bounds stand alone then)."""
    reach = _chernoff_threshold(scales, copies, _FFT_TAIL) * _SAFE
    size = 1 << max(4, int(math.ceil(math.log2(2.0 * reach + 4.0))))
    if size > FFT_MAX_SIZE:
        return None
    sin2 = np.sin(np.arange(size // 2 + 1) * (math.pi / size)) ** 2  # sin^2(u / 2)
    phi = np.ones(len(sin2))
    for scale, count in zip(scales.tolist(), copies.tolist()):
        gap = math.expm1(-1.0 / scale) ** 2  # (1 - q)^2
        factor = gap / (gap + 4.0 * math.exp(-1.0 / scale) * sin2)
        phi *= factor if count == 1 else factor ** count
    pmf = np.fft.irfft(phi, n=size)
    half = size // 2 - 1
    covered = pmf[0] + 2.0 * np.cumsum(pmf[1:half + 1])  # P_L(|k| <= h), h = 1..half
    covered = np.concatenate([[pmf[0]], covered])
    ok = np.nonzero(covered - _FFT_TAIL - _FFT_ERROR >= 1.0 - failure)[0]
    if not len(ok):  # (h <= half < L / 2 < L - reach: the aliasing bound above holds)
        return None
    return int(ok[0])
