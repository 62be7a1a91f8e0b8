"""The exact privacy curve of a composition of discrete Gaussian mechanisms (docs/privacy.md,
"Accounting").

A *part* ``(sigma, shift, copies)`` stands for ``copies`` independent coordinates, each carrying
discrete Gaussian noise N_Z(0, sigma^2) (pmf proportional to ``exp(-x^2 / 2 sigma^2)`` on the
integers, the sampler of dpstream.processor.mechanisms.noise) and each moved by the integer
``shift`` between two neighbouring inputs. :func:`discrete_gaussian_delta` returns an upper
bound on

    delta(eps) = E_P[(1 - e^(eps - L))_+],    L = ln(P(y) / Q(y)),

the hockey-stick divergence of the composition of all parts, P the output distribution without
the shifts and Q with them. The bound is tight to floating precision when the parts, after
merging equal ones, are at most two or small (the common case: a count query, one part for key
selection and one for perturbation), and within a second-order discretization error otherwise.

**One direction suffices.** For one coordinate, ``L(x) = ((x - D)^2 - x^2) / (2 sigma^2) =
(D^2 - 2 D x) / (2 sigma^2)`` with ``x ~ N_Z(0, sigma^2)``. The reverse pair (Q against P, or a
shift of -D) has, at ``y = D + x'`` with ``x' ~ N_Z(0, sigma^2)``, the loss ``(D^2 + 2 D x') /
(2 sigma^2)``, which has the same distribution as L because N_Z(0, sigma^2) is symmetric. The
coordinates are independent, so every direction of the composition has the same privacy loss
distribution, and delta(eps) above is the curve of both neighbour directions.

**A part's loss is a function of an integer.** With ``S`` the sum of the part's ``n`` noises,
``L = (n D^2 - 2 D S) / (2 sigma^2)``, decreasing in ``S``; S's pmf is computed on Z:

* for ``sigma < CLOSED_FORM_SIGMA`` exactly, by repeated squaring of the pmf of one N_Z with
  direct (non-FFT) convolutions: every operation adds or multiplies positive numbers, so every
  mass, however small, keeps its relative precision (an FFT would leave an absolute error of
  about 1e-16 of the largest mass, far above the tails where delta ~ 1e-9 .. 1e-15 lives);
* for larger sigma from Poisson summation: ``E[e^{itS}] = (c (a(t) + r(t)))^n`` with
  ``a(t) = e^{-sigma^2 t^2 / 2}``, ``0 <= r(t) <= rho = 2 sum_{j>=1} e^{-sigma^2 pi^2 (2j-1)^2 / 2}``
  on ``[-pi, pi]`` and ``c = 1 / (1 + 2 sum_{m>=1} e^{-2 pi^2 sigma^2 m^2}) <= 1``; inverting,
  ``|P[S = k] - g(k)| <= E`` for the continuous density ``g(k)`` of N(0, n sigma^2) at k, with
  ``E = n rho (1 + rho)^(n-1) + (1 - c^n) g(0) + e^{-n sigma^2 pi^2 / 2} / (pi^2 n sigma^2)``
  (``rho`` is 5e-54 at sigma 5, and falls fast). The masses used are ``g(k) - E``, never above
  the true ones.

**Every approximation errs on the safe side.**

* Truncation: S is kept within ``TAIL_SIGMAS`` of its sub-Gaussian scale (N_Z(0, sigma^2) is
  sigma^2-subgaussian, Canonne, Kamath and Steinke 2020, Corollary 23, so a sum of m is m
  sigma^2-subgaussian and ``P[|S| >= t] <= 2 exp(-t^2 / (2 m sigma^2))``). The masses computed are
  a *sub-measure* of the true pmf; its missing mass (the ``deficit``, bounded by those tail bounds
  and by ``E`` per point) is added to delta in full: an atom contributes at most its mass.
* Floating point: every mass is computed with a relative error far below ``FLOAT_SLACK``
  (products and sums of positive numbers: about 1e-13 after the longest chain of convolutions,
  times at most a few dozen parts). Where masses are weighed against each other
  (``A - e^{eps - L_1} B`` below) the cumulative P-masses enter inflated by it and the Q-masses
  deflated by it, so the cancellation cannot hide an error; the sum over the outer atoms, whose
  terms are all non-negative, is inflated by it once more.
* Composition: the parts are independent and the loss adds. Two parts are combined exactly:
  for each value of the first, the second's losses above ``eps - L_1`` are a prefix of its
  (monotone) support, so the inner sum is ``A - e^{eps - L_1} B`` with A and B cumulative sums
  of its P-masses and Q-masses (``Q = P e^{-L}``). More parts: all but one are merged first,
  exactly (every pair of losses) while the number of atoms stays below ``MAX_EXACT_ATOMS``;
  beyond that, on a grid of losses with the *connect-the-dots* split (Doroshenko, Ghazi, Kamath,
  Kumar, Manurangsi 2022): an atom of loss l between grid points l_j < l < l_{j+1} is split
  between the two with its P-mass and its Q-mass both preserved. The original pair is a
  post-processing of the split one (merge the two atoms back), so the split pair's curve is an
  upper bound at every eps, composition keeps that, and the error is of second order in the
  grid step (only grid cells a kink of the remaining curve falls in lose anything). A part too
  large to enumerate (``MAX_PART_ATOMS``) is split onto a grid of its own the same way.
* Atoms of negligible mass (below ``PRUNE_MASS``) are dropped into the deficit.

**Pure parts.** An epsilon_0-DP mechanism (the dynamic queries' Laplace noise) is dominated by
randomized response with epsilon_0 (Kairouz, Oh and Viswanath 2015): losses +-epsilon_0 with
P-masses ``e^eps0 / (1 + e^eps0)`` and ``1 / (1 + e^eps0)``; ``copies`` of it are a binomial.
A ``pure`` tuple of ``(epsilon_0, copies)`` enters the composition beside the parts
(:func:`composition_delta`, :func:`composition_epsilon`; docs/privacy.md, "Totals over time").

Results are cached per tuple of parts (public parameters only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

#: Noise is kept within this many sub-Gaussian scales: each cut drops at most 2 e^(-84.5) ~ 4e-37.
TAIL_SIGMAS = 13.0
#: From this sigma on, the pmf of a sum of discrete Gaussians is the Poisson-summation form
#: (error per point about copies * 5e-54 at sigma 5, less above); below it, exact convolutions.
CLOSED_FORM_SIGMA = 5.0
#: Relative slack for floating-point rounding (every computed mass is far more precise; see above).
FLOAT_SLACK = 1e-9
#: Atoms below this mass are dropped (and counted into delta).
PRUNE_MASS = 1e-60
#: The merged outer parts stay exact (every pair of losses) up to this many atoms.
MAX_EXACT_ATOMS = 1 << 16
#: A part with more support points than this is split onto a loss grid of its own.
MAX_PART_ATOMS = 1 << 17
#: Grid points of a merged (connect-the-dots) outer distribution, at most; the step follows.
MAX_GRID_POINTS = 1 << 14
#: The finest loss grid used for merging outer parts.
MIN_GRID_STEP = 2e-4
_EXP_CAP = 700.0  # exp arguments are clipped here; every clip lowers a Q-mass: safe


@dataclass(frozen=True)
class Atoms:
    """A sub-measure on privacy losses: ``mass[i]`` (P-measure) at ``loss[i]``; its Q-measure is
    ``mass * e^-loss`` atom by atom. ``deficit`` bounds the P-mass missing from it."""

    loss: np.ndarray
    mass: np.ndarray
    deficit: float


def canonical_parts(parts: Iterable[Sequence]) -> tuple[tuple[float, int, int], ...]:
    """Parts as a sorted tuple of ``(sigma, shift, copies)``, parts of the same (sigma, shift)
    merged (their noise sums are one sum of more copies), empty ones dropped."""
    merged: dict[tuple[float, int], int] = {}
    for sigma, shift, copies in parts:
        if shift != int(shift) or copies != int(copies):
            raise ValueError(f"shift and copies must be integers, got {shift!r}, {copies!r}")
        sigma, shift, copies = float(sigma), int(shift), int(copies)
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
        if shift < 0 or copies < 0:
            raise ValueError(f"shift and copies must be >= 0, got {shift}, {copies}")
        if shift and copies:
            merged[(sigma, shift)] = merged.get((sigma, shift), 0) + copies
    return tuple(sorted((s, d, n) for (s, d), n in merged.items()))


def canonical_pure(pure: Iterable[Sequence]) -> tuple[tuple[float, int], ...]:
    """Pure parts as a sorted tuple of ``(epsilon_0, copies)``, equal epsilons merged."""
    merged: dict[float, int] = {}
    for eps0, copies in pure:
        eps0, copies = float(eps0), int(copies)
        if not (math.isfinite(eps0) and eps0 >= 0) or copies < 0:
            raise ValueError(f"a pure part needs epsilon_0 >= 0 and copies >= 0, got {eps0!r}, {copies!r}")
        if eps0 and copies:
            merged[eps0] = merged.get(eps0, 0) + copies
    return tuple(sorted(merged.items()))


def discrete_gaussian_delta(parts: Iterable[Sequence], eps: float) -> float:
    """An upper bound, tight to floating precision, on delta(eps) of the composition of
    ``parts``, each ``(sigma, shift, copies)`` (module docstring)."""
    return _delta(canonical_parts(parts), float(eps))


def discrete_gaussian_epsilon(parts: Iterable[Sequence], delta: float) -> float:
    """The smallest eps (to 1e-12 relative) with ``discrete_gaussian_delta(parts, eps) <= delta``
    (verified at the value returned); 0 if delta(0) is already at most delta."""
    return _epsilon(canonical_parts(parts), float(delta))


def composition_delta(parts: Iterable[Sequence], pure: Iterable[Sequence], eps: float) -> float:
    """delta(eps) of discrete Gaussian ``parts`` composed with ``pure`` parts (module docstring)."""
    return _delta(canonical_parts(parts), float(eps), canonical_pure(pure))


def composition_epsilon(parts: Iterable[Sequence], pure: Iterable[Sequence], delta: float) -> float:
    """The smallest eps with ``composition_delta(parts, pure, eps) <= delta``, as
    :func:`discrete_gaussian_epsilon`."""
    return _epsilon(canonical_parts(parts), float(delta), canonical_pure(pure))


def pure_atoms(eps0: float, copies: int) -> Atoms:
    """``copies`` randomized responses of ``eps0``: ``j`` of them answer "+" with the binomial
    P-mass, and the loss is ``eps0 (2 j - copies)``."""
    j = np.arange(copies + 1, dtype=np.float64)
    log_p, log_q = -math.log1p(math.exp(-eps0)), -math.log1p(math.exp(eps0))
    log_choose = np.array([math.lgamma(copies + 1) - math.lgamma(k + 1) - math.lgamma(copies - k + 1) for k in range(copies + 1)])
    mass = np.exp(log_choose + j * log_p + (copies - j) * log_q)
    return _pruned(Atoms(eps0 * (2.0 * j - copies), mass, 0.0))


# ---------------------------------------------------------------------------------------------
# The pmf of a sum of discrete Gaussians
# ---------------------------------------------------------------------------------------------

def _cut(sigma: float, copies: int) -> int:
    """|S| <= this is kept for a sum of ``copies`` N_Z(0, sigma^2)."""
    return int(math.ceil(TAIL_SIGMAS * sigma * math.sqrt(copies)))


def _subgaussian_tail(t: int, sigma: float, copies: int) -> float:
    """P[|S| >= t] <= 2 exp(-t^2 / (2 copies sigma^2)) (CKS 2020, Corollary 23)."""
    return 2.0 * math.exp(-t * t / (2.0 * copies * sigma * sigma))


def _one_discrete_gaussian(sigma: float) -> tuple[int, np.ndarray, float]:
    """(first support point, masses, deficit) of N_Z(0, sigma^2) on |x| <= cut. The masses are
    divided by an upper bound on the normalising constant (its kept part plus a geometric bound
    on the rest), so none exceeds the true pmf."""
    t = _cut(sigma, 1)
    x = np.arange(-t, t + 1, dtype=np.float64)
    g = np.exp(-x * x / (2.0 * sigma * sigma))
    kept = float(np.sum(g))
    # sum_{x > t} e^{-x^2/2s^2} <= e^{-(t+1)^2/2s^2} / (1 - e^{-(2t+3)/2s^2}) (ratios decrease)
    rest = 2.0 * math.exp(-(t + 1) ** 2 / (2.0 * sigma * sigma)) / -math.expm1(-(2 * t + 3) / (2.0 * sigma * sigma))
    total = kept + rest
    return -t, g / total, rest / total


def _convolve(a: tuple[int, np.ndarray, float], b: tuple[int, np.ndarray, float], copies: int,
              sigma: float) -> tuple[int, np.ndarray, float]:
    """The sum of two independent sums (``copies`` noises in all), cut back to its range: the
    dropped mass is below the true tail beyond the cut, which the sub-Gaussian bound bounds."""
    first = a[0] + b[0]
    mass = np.convolve(a[1], b[1])  # direct: positive terms, relative precision kept
    t = _cut(sigma, copies)
    lo, hi = max(first, -t), min(first + len(mass) - 1, t)
    deficit = a[2] + b[2]
    if lo > first or hi < first + len(mass) - 1:
        deficit += _subgaussian_tail(t + 1, sigma, copies)
        mass = mass[lo - first: hi - first + 1]
    return lo, mass, deficit


@lru_cache(maxsize=256)
def _sum_pmf_exact(sigma: float, copies: int) -> tuple[int, np.ndarray, float]:
    """(first, masses, deficit) of the sum of ``copies`` iid N_Z(0, sigma^2), by repeated
    squaring with direct convolutions."""
    base = _one_discrete_gaussian(sigma)
    result, power, n, done = None, base, copies, 0
    size = 1
    while True:
        if n & 1:
            done += size
            result = power if result is None else _convolve(result, power, done, sigma)
        n >>= 1
        if not n:
            return result
        size *= 2
        power = _convolve(power, power, size, sigma)


def _closed_form_error(sigma: float, copies: int) -> float:
    """E: a bound on |P[S = k] - g(k)| for every k (module docstring, Poisson summation)."""
    s2 = sigma * sigma
    rho = 2.0 * sum(math.exp(-s2 * math.pi ** 2 * (2 * j - 1) ** 2 / 2.0) for j in range(1, 4))
    tau = 2.0 * sum(math.exp(-2.0 * math.pi ** 2 * s2 * m * m) for m in range(1, 4))
    var = copies * s2
    one_minus_cn = -math.expm1(-copies * math.log1p(tau))
    return (copies * rho * math.exp((copies - 1) * math.log1p(rho)) + one_minus_cn / math.sqrt(2.0 * math.pi * var)
            + math.exp(-var * math.pi ** 2 / 2.0) / (math.pi ** 2 * var)) * (1.0 + FLOAT_SLACK)


def _sum_pmf_closed(sigma: float, copies: int, ks: np.ndarray) -> np.ndarray:
    """Lower bounds ``max(g(k) - E, 0)`` on P[S = k] at the integers ``ks`` (sigma >= CLOSED_FORM_SIGMA)."""
    var = copies * sigma * sigma
    g = np.exp(-ks * ks / (2.0 * var)) / math.sqrt(2.0 * math.pi * var)
    return np.maximum(g - _closed_form_error(sigma, copies), 0.0)


# ---------------------------------------------------------------------------------------------
# One part's losses
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def part_atoms(sigma: float, shift: int, copies: int) -> Atoms:
    """The privacy losses of one part, ``L = (n D^2 - 2 D S) / (2 sigma^2)`` at every kept value
    of S, with their masses (a sub-measure; module docstring). Parts with more than
    ``MAX_PART_ATOMS`` support points are split onto a loss grid (connect the dots)."""
    t = _cut(sigma, copies)
    a, b = copies * shift * shift / (2.0 * sigma * sigma), shift / (sigma * sigma)  # L = a - b S
    if sigma < CLOSED_FORM_SIGMA:
        first, mass, deficit = _sum_pmf_exact(sigma, copies)
        ks = np.arange(first, first + len(mass), dtype=np.float64)
        return _pruned(Atoms(a - b * ks, mass, deficit))
    error = _closed_form_error(sigma, copies)
    deficit = _subgaussian_tail(t + 1, sigma, copies) + (2 * t + 1) * 2.0 * error
    if 2 * t + 1 <= MAX_PART_ATOMS:
        ks = np.arange(-t, t + 1, dtype=np.float64)
        return _pruned(Atoms(a - b * ks, _sum_pmf_closed(sigma, copies, ks), deficit))
    # too many points: split onto a grid of every g-th point of S (connect the dots). An atom r
    # points past a grid point k0 has loss l(k0) - r b and goes to l(k0) with the weight below,
    # the rest to l(k0 + g); the weights depend on r only, so a chunk is a matrix product.
    g = math.ceil((2 * t + 1) / MAX_PART_ATOMS)
    rows = -(-(2 * t + 1) // g)
    r = np.arange(g, dtype=np.float64)
    upper = -np.expm1(-(g - r) * b) / -math.expm1(-g * b)
    total = np.zeros(rows + 1)
    chunk = max(1, (1 << 20) // g)
    for row in range(0, rows, chunk):
        n_rows = min(chunk, rows - row)
        ks = -t + row * g + np.arange(n_rows * g, dtype=np.float64)
        mass = np.where(ks <= t, _sum_pmf_closed(sigma, copies, ks), 0.0).reshape(n_rows, g)
        total[row: row + n_rows] += mass @ upper
        total[row + 1: row + n_rows + 1] += mass @ (1.0 - upper)
    return _pruned(Atoms(a - b * (-t + g * np.arange(rows + 1, dtype=np.float64)), total, deficit))


def _split_onto_grid(loss: np.ndarray, mass: np.ndarray, step: float) -> tuple[int, np.ndarray]:
    """Connect the dots: each atom split between the grid points ``j step`` around it, P-mass
    and Q-mass preserved. Returns (index of the first grid point, masses on the grid)."""
    j = np.floor(loss / step)
    frac = np.clip(loss - j * step, 0.0, step)
    upper = mass * (-np.expm1(-frac)) / -math.expm1(-step)
    lower = mass - upper
    j0 = int(j.min())
    idx = (j - j0).astype(np.int64)
    out = np.bincount(idx, weights=lower, minlength=int(idx.max()) + 2)
    out += np.bincount(idx + 1, weights=upper, minlength=len(out))
    return j0, out


def _pruned(atoms: Atoms) -> Atoms:
    keep = atoms.mass >= PRUNE_MASS
    if keep.all():
        return atoms
    dropped = float(np.sum(atoms.mass[~keep])) * (1.0 + FLOAT_SLACK)
    return Atoms(atoms.loss[keep], atoms.mass[keep], atoms.deficit + dropped)


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Composition:
    """The outer parts merged (atoms), and the inner part's cumulative P- and Q-masses by loss."""

    outer_loss: np.ndarray
    outer_mass: np.ndarray
    inner_desc: np.ndarray  # inner losses, sorted descending, negated (ascending for searchsorted)
    inner_p: np.ndarray  # cumulative P-mass of the inner atoms with loss >= each; [0] = 0
    inner_q: np.ndarray  # cumulative Q-mass likewise
    deficit: float

    def delta(self, eps: float) -> float:
        return self.evaluate(eps)[0]

    def evaluate(self, eps: float) -> tuple[float, float]:
        """(the bound on delta(eps), ``-u d/du`` of it at ``u = e^eps``): the bound is a sum of
        ``max(0, a - u e^{-l} q)`` over the outer atoms, convex and decreasing in u."""
        e = eps - self.outer_loss  # the inner part must lose at least this
        count = np.searchsorted(self.inner_desc, -e, side="right")  # inner losses >= e
        a = self.inner_p[count] * (1.0 + FLOAT_SLACK)
        eq = np.exp(np.minimum(e, _EXP_CAP)) * (self.inner_q[count] * (1.0 - FLOAT_SLACK))
        inner = a - eq
        positive = inner > 0
        delta = min(1.0, float(np.dot(self.outer_mass[positive], inner[positive])) * (1.0 + FLOAT_SLACK) + self.deficit)
        return delta, float(np.dot(self.outer_mass[positive], eq[positive])) * (1.0 + FLOAT_SLACK)


def _merge(x: Atoms, y: Atoms) -> Atoms:
    """Exact composition of two atom sets (every pair of losses)."""
    loss = (x.loss[:, None] + y.loss[None, :]).ravel()
    mass = (x.mass[:, None] * y.mass[None, :]).ravel()
    return _pruned(Atoms(loss, mass, x.deficit + y.deficit))


def _grid_merge(parts: list[Atoms]) -> Atoms:
    """Composition of ``parts`` on one loss grid (connect the dots, then direct convolutions)."""
    # the merged losses spread over about +-TAIL_SIGMAS of their standard deviation (each part's
    # own range is wider than its share of that): the grid step is set by the merged spread
    variance = 0.0
    for p in parts:
        total = float(np.sum(p.mass))
        mean = float(np.dot(p.mass, p.loss)) / total
        variance += float(np.dot(p.mass, (p.loss - mean) ** 2)) / total
    step = max(MIN_GRID_STEP, 2.0 * TAIL_SIGMAS * math.sqrt(variance) / MAX_GRID_POINTS)
    grids = [_trimmed(*_split_onto_grid(p.loss, p.mass, step), p.deficit) for p in parts]
    # convolve pairwise, smallest first (a balanced order: fewer operations than one by one)
    while len(grids) > 1:
        grids.sort(key=lambda g: len(g[1]))
        (alo, a, ad), (blo, b, bd) = grids[0], grids[1]
        grids = grids[2:] + [_trimmed(alo + blo, _convolve_grids(a, b), ad + bd)]
    lo, w, deficit = grids[0]
    return _pruned(Atoms((np.arange(len(w)) + lo) * step, w, deficit * (1.0 + FLOAT_SLACK)))


def _convolve_grids(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The direct convolution of two grid distributions. A part whose own lattice is coarser than
    the grid has its mass on few grid points (two per atom); the shifted copies of the other
    array, one per such point, are then far fewer operations than the dense product."""
    nz_a, nz_b = np.flatnonzero(a), np.flatnonzero(b)
    if len(nz_b) * len(a) < len(nz_a) * len(b):
        a, b, nz_a = b, a, nz_b
    if len(nz_a) * (len(b) + 2000) >= len(a) * len(b):
        return _dense_convolve(a, b)
    out = np.zeros(len(a) + len(b) - 1)
    for i in nz_a:
        out[i: i + len(b)] += a[i] * b
    return out


#: np.convolve slows down some 20-fold once its operands outgrow the cache: long ones go in blocks
_BLOCK = 2048


def _dense_convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if len(a) <= _BLOCK and len(b) <= _BLOCK:
        return np.convolve(a, b)
    out = np.zeros(len(a) + len(b) - 1)
    for i in range(0, len(a), _BLOCK):
        for j in range(0, len(b), _BLOCK):
            part = np.convolve(a[i: i + _BLOCK], b[j: j + _BLOCK])
            out[i + j: i + j + len(part)] += part
    return out


def _trimmed(lo: int, w: np.ndarray, deficit: float) -> tuple[int, np.ndarray, float]:
    """Drop negligible masses of a grid distribution (their mass counts into the deficit): the
    ends, and any point below ``PRUNE_MASS`` (which also keeps products clear of subnormal
    numbers, whose arithmetic is some 20 times slower)."""
    small = w < PRUNE_MASS
    if small.any():
        deficit += float(np.sum(w[small])) * (1.0 + FLOAT_SLACK)
        w = np.where(small, 0.0, w)
    csum = np.cumsum(w)
    start = int(np.searchsorted(csum, PRUNE_MASS, side="right"))
    rcsum = np.cumsum(w[::-1])
    stop = len(w) - int(np.searchsorted(rcsum, PRUNE_MASS, side="right"))
    if start > 0:
        deficit += float(csum[start - 1])
    if stop < len(w):
        deficit += float(rcsum[len(w) - stop - 1])
    return lo + start, w[start:stop], deficit


@lru_cache(maxsize=16)
def _composition(parts: tuple, pure: tuple = ()) -> _Composition:
    atoms = [part_atoms(*p) for p in parts] + [pure_atoms(*p) for p in pure]
    if not atoms:
        atoms = [Atoms(np.zeros(1), np.ones(1), 0.0)]
    inner_index = max(range(len(atoms)), key=lambda i: len(atoms[i].loss))
    inner = atoms[inner_index]
    rest = [a for i, a in enumerate(atoms) if i != inner_index]
    outer = Atoms(np.zeros(1), np.ones(1), 0.0)
    rest.sort(key=lambda a: len(a.loss))
    while rest and (len(outer.loss) == 1 or len(outer.loss) * len(rest[0].loss) <= MAX_EXACT_ATOMS):
        outer = _merge(outer, rest.pop(0))
    if rest:
        outer = _grid_merge([outer] + rest)
    by_loss = np.argsort(outer.loss, kind="stable")  # sorted queries: a faster searchsorted
    outer = Atoms(outer.loss[by_loss], outer.mass[by_loss], outer.deficit)
    order = np.argsort(-inner.loss, kind="stable")
    loss, mass = inner.loss[order], inner.mass[order]
    q = mass * np.exp(np.minimum(-loss, _EXP_CAP))
    return _Composition(
        outer_loss=outer.loss, outer_mass=outer.mass, inner_desc=-loss,
        inner_p=np.concatenate([[0.0], np.cumsum(mass)]), inner_q=np.concatenate([[0.0], np.cumsum(q)]),
        deficit=(outer.deficit + inner.deficit) * (1.0 + FLOAT_SLACK))


@lru_cache(maxsize=16)
def _cached_composition(parts: tuple, pure: tuple) -> _Composition:
    return _composition(parts, pure)


@lru_cache(maxsize=4096)
def _delta(parts: tuple, eps: float, pure: tuple = ()) -> float:
    return _cached_composition(parts, pure).delta(eps)


@lru_cache(maxsize=4096)
def _epsilon(parts: tuple, delta: float, pure: tuple = ()) -> float:
    """Newton's method in ``u = e^eps`` (the bound is convex and decreasing in u, so from below
    the root each step stays below it, up to the float slack), then bisection of the last
    bracket to 1e-13: the value returned is the upper end, verified. The start is the
    continuous Gaussian curve's epsilon at the same mu, stepped down until it is below."""
    from dpstream.accountant.calibration import gdp_epsilon

    curve = _cached_composition(parts, pure)
    if curve.delta(0.0) <= delta:
        return 0.0
    mu = math.sqrt(sum(n * d * d / (s * s) for s, d, n in parts) + sum(n * e * e for e, n in pure))
    hi = math.inf  # the smallest eps seen with delta(eps) <= target
    try:
        eps = gdp_epsilon(mu, delta) if 0 < delta < 1 else 1.0
    except OverflowError:  # a long composition: start from the Gaussian's zCDP bound instead
        eps = mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta))
    d, slope = curve.evaluate(eps)
    down = 1e-4 * eps + 1e-9
    while d <= delta:  # above the root: step down, further each time
        hi, eps, down = eps, max(0.0, eps - down), down * 10.0
        d, slope = curve.evaluate(eps)
    lo = eps  # delta(lo) > target
    for _ in range(100):
        if slope <= 0:
            break
        new = eps + math.log1p((d - delta) / slope)
        if new <= eps or new >= hi:
            break
        d, slope = curve.evaluate(new)
        if d <= delta:  # past the root (the float slack bends the curve a little): bracketed
            hi = new
            break
        converged = new - eps <= 1e-14 * max(1.0, new)
        lo = eps = new
        if converged:
            break
    # Newton ends within a hair of the root: probe just below hi, then just above lo, each with
    # growing steps, and bisect what is left
    step = 1e-13 * max(1.0, hi if math.isfinite(hi) else lo)
    while math.isfinite(hi) and hi - step > lo:
        if curve.delta(hi - step) > delta:
            lo = hi - step
            break
        hi, step = hi - step, step * 8.0
    step = 1e-13 * max(1.0, lo)
    while not math.isfinite(hi):  # grow until verified
        if curve.delta(lo + step) <= delta:
            hi = lo + step
        else:
            lo, step = lo + step, step * 4.0
            if lo > 1e6:
                return math.inf
    while hi - lo > 1e-13 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if curve.delta(mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def scaled_parts(parts: Iterable[Sequence], scale: float) -> tuple[tuple[float, int, int], ...]:
    """``parts`` with every sigma multiplied by ``scale``."""
    return canonical_parts((float(s) * scale, d, n) for s, d, n in parts)


def discrete_gaussian_scale(parts: Iterable[Sequence], eps: float, delta: float, aim: float = 1.0) -> float:
    """1.0 when ``discrete_gaussian_delta(parts, eps) <= delta``; otherwise the smallest common
    factor ``s > 1`` (to about 1e-7 relative) by which every sigma of ``parts`` must grow for the
    delta to be at most ``aim * delta`` (``aim <= 1``: room for a check with a coarser
    accountant). The value returned is verified."""
    if not 0 < aim <= 1:
        raise ValueError(f"aim must be in (0, 1], got {aim!r}")
    return _scale(canonical_parts(parts), float(eps), float(delta), float(aim))


#: the scale is solved for this fraction of the delta aimed at, so that a plan is tight to about this much
SCALE_TARGET = 1.0 - 1e-7


@lru_cache(maxsize=1024)
def _scale(parts: tuple, eps: float, delta: float, aim: float) -> float:
    """First a fixed-point step on the ratio of the discrete curve to the continuous Gaussian
    curve of the same mu (mu^2 = sum n D^2 / sigma^2, Dong-Roth-Su 2022; at scale s it is exact
    in mu / s) until the root is bracketed, then regula falsi (Illinois) on log delta within the
    bracket: delta is continuous in the scale but, with few coarse atoms, steep. Every scale
    returned has been evaluated and found within ``aim * delta``."""
    from dpstream.accountant.calibration import gdp_delta, gdp_mu

    def excess(scale: float) -> float:  # log(delta(scale) / target), decreasing in scale
        found = _delta(scaled_parts(parts, scale), eps)
        return math.log(found / target) if found > 0 else -math.inf

    if _delta(parts, eps) <= delta:
        return 1.0
    delta *= aim
    target = delta * SCALE_TARGET
    mu = math.sqrt(sum(n * d * d / (s * s) for s, d, n in parts))
    lo, f_lo = 1.0, excess(1.0)  # lo: too small a scale (f > 0)
    hi = f_hi = None
    scale = lo
    for _ in range(60):
        continuous = gdp_delta(mu / scale, eps)
        if continuous > 0:
            ratio = _delta(scaled_parts(parts, scale), eps) / continuous
            scale = max(scale * 1.0001, mu / gdp_mu(eps, min(target / ratio, 0.5)))
        else:
            scale *= 1.01
        f = excess(scale)
        if f <= 0:
            hi, f_hi = scale, f
            break
        lo, f_lo = scale, f
    if hi is None:
        raise ArithmeticError("the discrete Gaussian scale did not converge")
    side = 0
    for _ in range(200):
        if f_hi >= -1e-6 or hi - lo <= 1e-15 * hi:
            break
        scale = hi - f_hi * (hi - lo) / (f_hi - f_lo) if math.isfinite(f_hi) else 0.5 * (lo + hi)
        scale = min(max(scale, lo + 1e-3 * (hi - lo)), hi - 1e-3 * (hi - lo))
        f = excess(scale)
        if f <= 0:
            hi, f_hi = scale, f
            if side == -1:
                f_lo *= 0.5
            side = -1
        else:
            lo, f_lo = scale, f
            if side == 1:
                f_hi *= 0.5
            side = 1
    if _delta(scaled_parts(parts, hi), eps) > delta:  # hi was verified above; checked again for the record
        raise ArithmeticError("the discrete Gaussian scale failed verification")
    return hi
