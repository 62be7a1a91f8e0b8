"""DP binary tree aggregation (DP-SQLP Algorithm 1) with bottom-up Honaker estimation (section 2.2),
in exact integer arithmetic.

Why exact (docs/privacy.md, "The arithmetic of releases"): a published number must be a function
of privatized values only. If a release were computed in floating point as ``fl(S + g(z))`` from
the raw prefix S and the noise draws z, its rounding would depend on S itself, and its low-order
bits would tell S apart from S + 1 far more often than delta allows. So nothing here is a float
that mixes data and noise.

The arithmetic. Every node holds an integer ``y = x + z``: its data x (a sum of integer leaves)
plus integer discrete Gaussian noise z. With ``F_0 = y`` and ``F_l = 2^l y + F_left + F_right``,
the bottom-up Honaker estimate of a level-l node is exactly ``F_l / D_l``, ``D_l = 2^(l+1) - 1``
(:func:`dpstream.accountant.calibration.honaker_denominator` proves it). The recursion is linear and the
data part satisfies it with ``F_l^x = D_l x_l``, so ``F_l = D_l x_l + Fz_l`` where ``Fz_l`` is
the same recursion over the noise alone. The noisy prefix sum at leaf i (one complete node per
set bit of i, eq. (2)) is therefore the exact rational

    q_hat_i = sum_j F_j / D_j = S_i + N_i,   N_i = sum_j Fz_j / D_j,

where S_i is the exact prefix of the leaves. Both expressions are the *same rational number*, a
function of the privatized nodes y only; the code keeps the integer S_i and the integers Fz_j
apart because N_i depends on the tree's identity alone (the keyed noise PRF), which is what lets
release prediction (Algorithm 4) read a key's future noise now. Every decision is taken on the
exact rational: :meth:`NoisePrefix.exceeds` (a threshold comparison) and
:meth:`NoisePrefix.rounded` (the nearest integer, which is never a tie because every D_j is odd).
Both use a float filter with a proven error bound and fall back to :class:`fractions.Fraction`
when the filter cannot decide, so their answers are those of exact arithmetic.

A tree's state is its exact prefix sum plus a *frontier cache*: ``Fz`` of the decomposition
nodes of the last leaf processed (at most one per level; integers). Advancing from leaf r0 to r1
computes only the nodes that complete in (r0, r1]; straddling nodes take their left child from
the cache. :class:`HonakerForest` does this for many trees at once with numpy (one noise call per
level), as key selection, perturbation and release prediction need on the hot path.

Node (level l, index j) covers leaves ``j*2^l + 1 .. (j+1)*2^l`` (1-based); it is complete at
leaf ``(j+1)*2^l``. Only complete nodes are ever read.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpstream.accountant.calibration import honaker_denominator, tree_levels
from dpstream.processor.mechanisms.noise import DiscreteGaussian, NodeNoise, node_ids

#: Marks a level of a frontier cache that holds no node (its bit of the leaf is 0).
ABSENT = np.iinfo(np.int64).min
#: The float filter decides only when the float estimate is at least this far (relative) from
#: the decision boundary; its own error is below 1e-13 relative (see NoisePrefix.exceeds).
_FILTER = 1e-9
_EXACT_LIMIT = float(1 << 52)


@dataclass
class _Level:
    start: np.ndarray  # first node index computed, per tree (r0 >> l)
    offsets: np.ndarray  # n+1 offsets into values
    values: np.ndarray  # Fz of the computed nodes (int64), flat


class NoisePrefix:
    """The exact noise parts ``N = sum_j Fz_j / D_j`` of some (tree, leaf) prefixes.

    Held as ``whole + frac`` with ``whole = sum_j floor(Fz_j / D_j)`` (exact int64) and ``frac =
    sum_j (Fz_j mod D_j) / D_j`` (a float in [0, levels), error below 1e-13); the exact rational
    of any entry is recomputed from the integers on demand.
    """

    def __init__(self, walk: "ForestWalk", tree: np.ndarray, leaf: np.ndarray, whole: np.ndarray, frac: np.ndarray):
        self._walk, self._tree, self._leaf = walk, tree, leaf
        self.whole = whole
        self.frac = frac

    def __len__(self) -> int:
        return len(self.whole)

    def exact(self, i: int) -> Fraction:
        """N of entry i as an exact fraction."""
        tree, leaf = self._tree[i:i + 1], int(self._leaf[i])
        total = Fraction(0)
        for level in range(self._walk.tree_levels):
            if (leaf >> level) & 1:
                fz = int(self._walk._lookup(level, tree, np.array([(leaf >> level) - 1]))[0])
                total += Fraction(fz, honaker_denominator(level))
        return total

    def approx(self) -> np.ndarray:
        """Float approximations of N, for statistics and metadata only: never for a decision."""
        return self.whole + self.frac

    def exceeds(self, base: np.ndarray, threshold: np.ndarray) -> np.ndarray:
        """``base + N > threshold`` exactly, per entry (``base`` integers, ``threshold`` floats).

        Filter: ``d = (float(base + whole) - threshold) + frac``. ``base + whole`` converts
        exactly while below 2^52; the subtraction and the addition each round by at most one
        relative ulp, and ``frac`` is within 1e-13 of its true value, so when ``|d|`` exceeds
        ``1e-9 (1 + |threshold| + |base + whole|)`` its sign is the exact answer. Otherwise (or
        beyond 2^52) the comparison is redone with fractions."""
        x = np.asarray(base, dtype=np.int64) + self.whole
        threshold = np.broadcast_to(np.asarray(threshold, dtype=np.float64), x.shape)
        xf = x.astype(np.float64)
        d = (xf - threshold) + self.frac
        out = d > 0
        unsure = np.nonzero((np.abs(d) <= _FILTER * (1.0 + np.abs(threshold) + np.abs(xf))) | (np.abs(xf) >= _EXACT_LIMIT))[0]
        for i in unsure.tolist():
            value = Fraction(int(x[i])) + (self.exact(i) - int(self.whole[i]))
            out[i] = value > Fraction(float(threshold[i]))
        return out

    def rounded(self, base: np.ndarray) -> np.ndarray:
        """The integer nearest to ``base + N`` (int64), per entry. Never a tie: N has an odd
        denominator. ``floor(frac + 1/2)`` is decided by the float unless ``frac + 1/2`` is within
        1e-9 of an integer, which is then settled with fractions."""
        x = np.asarray(base, dtype=np.int64) + self.whole
        shifted = self.frac + 0.5
        step = np.floor(shifted)
        unsure = np.nonzero(np.abs(shifted - np.rint(shifted)) <= _FILTER)[0]
        step = step.astype(np.int64)
        for i in unsure.tolist():
            frac = self.exact(i) - int(self.whole[i])
            step[i] = (frac + Fraction(1, 2)).__floor__()
        return x + step


class ForestWalk:
    """The nodes completing in (r0, r1] for a batch of trees, as exact integers ``Fz``."""

    def __init__(self, forest: "HonakerForest", cache: np.ndarray, done: np.ndarray, upto: np.ndarray):
        self._forest = forest
        self._cache = cache
        self.tree_levels = forest.tree_levels
        self.done = done
        self.upto = upto
        self._levels: list[_Level] = []

    def _lookup(self, level: int, tree: np.ndarray, index: np.ndarray) -> np.ndarray:
        lv = self._levels[level]
        rel = index - lv.start[tree]
        out = np.empty(len(index), dtype=np.int64)
        inside = rel >= 0
        out[inside] = lv.values[lv.offsets[tree[inside]] + rel[inside]]
        outside = ~inside
        if outside.any():
            cached = self._cache[tree[outside], level]
            if (cached == ABSENT).any():
                raise AssertionError("a frontier node missing from the cache was read")
            out[outside] = cached
        return out

    def prefix(self, tree: np.ndarray, leaf: np.ndarray) -> NoisePrefix:
        """N_leaf for (tree, leaf) pairs with r0 <= leaf <= r1 of that tree (leaf >= 1)."""
        tree = np.asarray(tree, dtype=np.int64)
        leaf = np.asarray(leaf, dtype=np.int64)
        whole = np.zeros(len(leaf), dtype=np.int64)
        frac = np.zeros(len(leaf), dtype=np.float64)
        for level in range(self.tree_levels):
            sel = np.nonzero((leaf >> level) & 1)[0]
            if len(sel):
                fz = self._lookup(level, tree[sel], (leaf[sel] >> level) - 1)
                q, r = np.divmod(fz, honaker_denominator(level))  # r in [0, D): floor division
                whole[sel] += q
                frac[sel] += r / honaker_denominator(level)
        return NoisePrefix(self, tree, leaf, whole, frac)

    def prefix_noise(self, tree: np.ndarray, leaf: np.ndarray) -> np.ndarray:
        """Float approximations of N_leaf: statistics only (see :meth:`prefix` for decisions)."""
        return self.prefix(tree, leaf).approx()

    def cache_at(self, leaf: np.ndarray) -> np.ndarray:
        """Frontier caches (``Fz`` per level, :data:`ABSENT` where the leaf's bit is 0) at ``leaf``."""
        n = len(leaf)
        cache = np.full((n, self.tree_levels), ABSENT, dtype=np.int64)
        tree = np.arange(n)
        for level in range(self.tree_levels):
            sel = np.nonzero((leaf >> level) & 1)[0]
            if len(sel):
                cache[sel, level] = self._lookup(level, tree[sel], (leaf[sel] >> level) - 1)
        return cache

    def future(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (tree, leaf) with r0 < leaf <= r1, flattened tree-major, leaves ascending."""
        count = np.maximum(self.upto - self.done, 0)
        tree = np.repeat(np.arange(len(count)), count)
        starts = np.cumsum(count) - count
        leaf = self.done[tree] + 1 + (np.arange(len(tree)) - starts[tree])
        return tree, leaf


class HonakerForest:
    """Vectorized noise side of many DP trees with the same capacity and noise scale."""

    def __init__(self, capacity: int, sampler: DiscreteGaussian, noise: NodeNoise):
        self.capacity = int(capacity)
        self.tree_levels = tree_levels(self.capacity)
        self.sampler = sampler
        self.noise = noise

    def empty_cache(self, n: int) -> np.ndarray:
        return np.full((n, self.tree_levels), ABSENT, dtype=np.int64)

    def walk(self, trees: np.ndarray, done: np.ndarray, upto: np.ndarray, cache: np.ndarray) -> ForestWalk:
        """Compute the nodes of each tree completing in (done, upto]; ``cache`` is at ``done``."""
        done = np.asarray(done, dtype=np.int64)
        upto = np.asarray(upto, dtype=np.int64)
        if (upto > self.capacity).any():
            raise ValueError("leaf beyond the tree's capacity")
        n = len(done)
        walk = ForestWalk(self, np.asarray(cache, dtype=np.int64), done, upto)
        ordinal = np.arange(n)
        for level in range(self.tree_levels):
            start = done >> level
            count = np.maximum((upto >> level) - start, 0)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(count, out=offsets[1:])
            total = int(offsets[-1])
            if total == 0:
                walk._levels.append(_Level(start, offsets, np.zeros(0, dtype=np.int64)))
                continue
            tree = np.repeat(ordinal, count)
            index = start[tree] + (np.arange(total) - offsets[tree])
            own = self.noise.sample_indexed(self.sampler, trees, tree, node_ids(np.full(total, level), index)).astype(np.int64)
            if level == 0:
                values = own
            else:
                # F_l = 2^l z + F_left + F_right (dpstream.accountant.calibration.honaker_denominator)
                values = (own << level) + walk._lookup(level - 1, tree, 2 * index) + walk._lookup(level - 1, tree, 2 * index + 1)
            walk._levels.append(_Level(start, offsets, values))
        return walk
