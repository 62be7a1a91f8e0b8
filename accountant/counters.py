"""Calibration of continual counters: what the accountant needs to know about a counter.

A continual counter releases noisy prefix sums of one stream over steps 1..T from discrete
Gaussian noise of scale sigma (dpstream.processor.mechanisms.counters). For the privacy argument and the
thresholds the accountant needs these functions of the counter, and no more (docs/privacy.md,
"Accounting" and "Counters"):

* ``sensitivity_sq(T)``: ``||C e_1||^2``, the squared L2 norm of what one unit increment at the
  first step changes in the privatized values (the encoder's first column; every other column is
  a truncation of it, so no single increment does more). An increment ``Delta`` costs
  ``sensitivity_sq * Delta^2`` in ``mu^2`` (GDP) or half that over ``sigma^2`` in zCDP. A user
  whose records reach several steps of one stream (perturbation) changes the encoded values by
  ``C Delta`` with ``||Delta||_1 <= C L``; ``||C Delta||_2`` is convex in ``Delta``, so its
  maximum over that L1 ball is at a vertex ``C L e_j``: the one-step bound, times ``C L``.
* ``sensitivity_l1(T)``: ``||C e_1||_1``, which the rounding slack term needs (below);
* ``step_variance(t, T)``: the variance of the noisy prefix at step t, in units of sigma^2;
* ``slack``: counters whose noise lives on a lattice finer than the data (the BLT) round their
  feedback to that lattice; the privatized value at a step may then move by up to ``slack``
  lattice units more than the linear encoder says. The accountant widens the sensitivity by it;
* ``bias_units(t, T)``: a bound on the deterministic part of that rounding in the prefix at t,
  in lattice units (added to the thresholds so the tail bound stays true);
* ``draws(T)``: noise draws per stream a user can influence (the sampler's total-variation term).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from dpstream.accountant.calibration import (
    prefix_variance_factor,
    read_levels,
    tree_levels,
)

#: Lattice counters put their noise on the grid ``unit / K`` with K the largest power of two
#: keeping the sampler's scale ``sigma_units * K`` at most this (dpstream.processor.mechanisms.noise).
LATTICE_TARGET_SIGMA = 65536.0


@dataclass(frozen=True)
class CounterCalibration:
    name: str
    #: T -> ||C e_1||_2^2: squared L2 sensitivity of the privatized values to one unit increment
    sensitivity_sq: Callable[[int], float]
    #: (t, T) -> Var(noisy prefix at step t) / sigma^2
    step_variance: Callable[[int, int], float]
    #: T -> int64 numbers of state per stream carried between steps
    state_width: Callable[[int], int]
    #: T -> noise draws per stream that one user's increment can reach
    draws: Callable[[int], int]
    #: T -> ||C e_1||_1 (only used with a nonzero slack)
    sensitivity_l1: Callable[[int], float] = lambda T: 0.0
    #: T -> per-step rounding slack of the privatized values, in lattice units (0: exact)
    slack: Callable[[int], float] = lambda T: 0.0
    #: (t, T) -> bound on |deterministic rounding part| of the prefix at t, in lattice units
    bias_units: Callable[[int, int], float] = lambda t, T: 0.0

    @property
    def lattice(self) -> bool:
        """Whether the noise lives on a lattice finer than the data grid (see lattice_scale)."""
        return self.slack(2) > 0


def lattice_scale(sigma_units: float) -> int:
    """K: the largest power of two with ``sigma_units * K <= LATTICE_TARGET_SIGMA`` (at least 1).

    The lattice step ``1 / K`` (in grid units) is then below ``2 sigma_units / LATTICE_TARGET_SIGMA``,
    the bound the accountant uses for the slack, whatever the grid (dpstream.accountant.plan)."""
    if not sigma_units > 0:  # a noise scale of 0 (a part the plan does not run, such as public keys' selection)
        raise ValueError(f"a lattice counter needs a positive noise scale, got {sigma_units!r}")
    k = 1
    while sigma_units * (2 * k) <= LATTICE_TARGET_SIGMA:
        k *= 2
    return k


#: The binary tree with bottom-up Honaker estimation (DP-SQLP section 2.2, eqs. (1)-(2)): an
#: increment reaches one read node per level, ``floor(lg T) + 1`` of them (read_levels); the
#: prefix at t reads one complete node per set bit of t (prefix_variance_factor); the state is
#: the frontier of complete nodes, one per level of the padded tree (tree_levels). Exact
#: integers throughout: no slack.
BINARY_TREE = CounterCalibration("binary_tree", read_levels, lambda t, T: prefix_variance_factor(t),
                                 tree_levels, read_levels)


# --- Buffered Linear Toeplitz (BLT) ------------------------------------------------------------

#: Largest magnitude of a noise increment w (lattice units): |z| <= 12 sigma + 1 <= 2^20.6 for the
#: table sampler's scales, and w = C^-1 (z - rounding) with sum_k |r_k| < 2 (checked below).
BLT_NOISE_BITS = 23


@dataclass(frozen=True)
class BLTParameters:
    """The shipped BLT encoder for a horizon: ``c_0 = 1``, ``c_m = sum_k omega_k theta_k^(m-1)``,
    theta and omega exact dyadic fractions ``x / 2^bits`` (dpstream.accountant.blt_parameters)."""

    horizon: int
    bits: int
    theta_int: tuple
    omega_int: tuple

    @property
    def theta(self) -> np.ndarray:
        return np.array(self.theta_int, dtype=np.float64) / (1 << self.bits)

    @property
    def omega(self) -> np.ndarray:
        return np.array(self.omega_int, dtype=np.float64) / (1 << self.bits)

    @property
    def buffers(self) -> int:
        return len(self.theta_int)

    @property
    def fine_bits(self) -> int:
        """F: buffers hold lattice units times 2^F. As many bits as keep ``theta_int * buffer``
        below 2^62: a buffer is at most ``2^BLT_NOISE_BITS * 2^F / (1 - theta)``."""
        decay = max(1.0 / (1.0 - th) for th in self.theta)
        return max(0, min(10, int(math.floor(62 - self.bits - BLT_NOISE_BITS - math.log2(decay)))))


def blt_parameters(T: int) -> BLTParameters:
    """The fit for the smallest fitted horizon >= T (the largest one beyond it)."""
    from dpstream.accountant.blt_parameters import BITS, FITS

    horizons = sorted(FITS)
    horizon = next((h for h in horizons if h >= T), horizons[-1])
    theta, omega, _ = FITS[horizon]
    return BLTParameters(horizon, BITS, tuple(theta), tuple(omega))


#: Floats below are exact-rounded sums of positive terms; this factor covers their rounding so
#: that sensitivities and variances are upper bounds (relative error below 1e-12 at T <= 2^24).
_SAFE = 1.0 + 1e-9


@lru_cache(maxsize=64)
def _blt_tables(T: int):
    """(col2, col1, variances[t-1], bias[t-1]) of the BLT encoder for T steps.

    The encoder's column ``c`` and the noise response ``r = C^-1 e_1`` (``w = C^-1 z``) are
    computed with their defining recurrences; the prefix noise at t is ``sum_{j<=t} R_{t-j} z_j``
    with ``R = cumsum(r)``, so its variance is ``sum_{j<t} R_j^2`` (sigma^2 units)."""
    p = blt_parameters(T)
    theta, omega = p.theta, p.omega
    m = np.arange(T - 1, dtype=np.float64)
    c = np.concatenate([[1.0], (omega[None, :] * theta[None, :] ** m[:, None]).sum(axis=1)])
    r = np.empty(T)
    buf = np.zeros(p.buffers)
    for t in range(T):
        if t:
            buf = theta * buf + r[t - 1]
        r[t] = (1.0 if t == 0 else 0.0) - float(omega @ buf)
    R = np.cumsum(r)
    variances = np.cumsum(R * R) * _SAFE
    # |rounding part of w_t| <= 1/2 + e per step (dpstream.processor.mechanisms.counters.BLTCounter):
    # its effect on the prefix at t is at most (1/2 + e) * sum_{j<t} |R_j|
    bias = (0.5 + _blt_feedback_error(p)) * np.cumsum(np.abs(R)) * _SAFE
    return float(np.sum(c * c)) * _SAFE, float(np.sum(np.abs(c))) * _SAFE, variances, bias


def _blt_feedback_error(p: BLTParameters) -> float:
    """e: how far the BLT's rounded feedback can be from the exact linear one, in lattice units.

    Each buffer update rounds once (by at most 1/2 fine unit), and the error decays with
    theta_k, so a buffer is within ``1 / (2 (1 - theta_k))`` fine units of its exact value; the
    feedback ``sum_k omega_k buf_k / 2^F`` is then within ``sum_k |omega_k| / (2 (1 - theta_k) 2^F)``."""
    theta, omega = p.theta, p.omega
    return float(np.sum(np.abs(omega) / (2.0 * (1.0 - theta)))) / (1 << p.fine_bits) * _SAFE


def _blt_slack(T: int) -> float:
    return 1.0 + 2.0 * _blt_feedback_error(blt_parameters(T))


#: The BLT counter with 3 buffers (dpstream.processor.mechanisms.counters.BLTCounter): its state is the 3
#: buffers and the running prefix of the noise, 4 numbers per stream at any T.
BLT = CounterCalibration(
    "blt",
    sensitivity_sq=lambda T: _blt_tables(T)[0],
    step_variance=lambda t, T: float(_blt_tables(T)[2][t - 1]),
    state_width=lambda T: blt_parameters(T).buffers + 1,
    draws=lambda T: T,
    sensitivity_l1=lambda T: _blt_tables(T)[1],
    slack=_blt_slack,
    bias_units=lambda t, T: float(_blt_tables(T)[3][t - 1]),
)

COUNTERS: dict[str, CounterCalibration] = {c.name: c for c in (BINARY_TREE, BLT)}
#: names a query config may use for the counters
CONFIG_NAMES = {"tree": BINARY_TREE.name, "blt": BLT.name}


def counter_calibration(name: str) -> CounterCalibration:
    try:
        return COUNTERS[CONFIG_NAMES.get(name, name)]
    except KeyError:
        raise ValueError(f"counter: must be one of {', '.join(CONFIG_NAMES)}, got {name!r}") from None


class LatticeSlackError(ValueError):
    """The budget is too small for a lattice counter's rounding slack (the plan names the field)."""


def lattice_sigma(mu_sq: float, squares: float, l1: float, touched: int, steps: int, counter: CounterCalibration) -> float:
    """The smallest sigma with ``sigma^2 mu^2 >= squares ||c||^2 + 2 kappa sigma l1 ||c||_1 +
    touched T kappa^2 sigma^2`` (see slack_sigma): a user whose increments over the streams it
    reaches have squares adding to ``squares``, absolute values to ``l1``, on ``touched`` streams."""
    col2 = counter.sensitivity_sq(steps)
    kappa = 2.0 * counter.slack(steps) / LATTICE_TARGET_SIGMA
    a = mu_sq - touched * steps * kappa * kappa
    if a <= 0:
        raise LatticeSlackError("the budget is too small for the lattice counter's rounding slack")
    b = 2.0 * kappa * l1 * counter.sensitivity_l1(steps)
    c = squares * col2
    return (b + math.sqrt(b * b + 4.0 * a * c)) / (2.0 * a)


def slack_sigma(mu_sq: float, streams: int, bound: float, steps: int, counter: CounterCalibration,
                per_stream: float | None = None) -> float:
    """The smallest sigma (value units) at which one user's privatized values move by at most
    ``mu`` in L2, over ``streams`` streams of ``steps`` steps with total increments ``bound``.

    Exact counters: ``sigma = bound * sqrt(||C e_1||^2) / mu`` (per stream, and the streams share
    ``bound``; for key selection call with the per-stream bound and multiply mu^2 accordingly).
    Lattice counters add the slack ``s`` lattice units per step, a lattice step being at most
    ``2 sigma / LATTICE_TARGET_SIGMA`` (lattice_scale). With ``kappa = 2 s / target``, one
    stream's squared sensitivity is at most ``sum_t (|a_t| + kappa sigma)^2 <= b^2 ||c||_2^2 +
    2 kappa sigma b ||c||_1 + T kappa^2 sigma^2`` for a stream's share b of the bound; over streams
    with shares adding to ``bound`` the first two terms are largest with everything in one stream,
    and every touched stream adds the last. With a cap ``per_stream`` on each share (the per-key
    bound), the sum of squared shares is at most ``bound * per_stream``. Solving
    ``sigma^2 mu^2 = that`` for sigma gives the positive root of a quadratic."""
    col2 = counter.sensitivity_sq(steps)
    slack = counter.slack(steps)
    squares = bound * min(bound, per_stream if per_stream is not None else bound)  # max sum of squared shares
    if not slack:
        return math.sqrt(squares * col2 / mu_sq)
    return lattice_sigma(mu_sq, squares, bound, streams, steps, counter)
