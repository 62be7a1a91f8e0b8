"""DP binary tree aggregation (DP-SQLP Algorithm 1) with bottom-up Honaker estimation (section 2.2).

Observation that shapes this module: every tree node holds ``true value + noise`` and the
bottom-up Honaker estimate is linear with weights that sum to one on the true part, so

    q_hat_i = S_i + N_i,

where ``S_i`` is the exact prefix sum of the leaves and ``N_i`` is the Honaker-weighted noise of
the O(lg T) complete nodes that decompose ``[1, i]`` (one per set bit of i; eq. (2)). ``N_i``
depends only on the tree's identity, through the keyed noise PRF, never on data. So a tree's
state is its true prefix sum plus a *frontier cache*: the noise estimates of the decomposition
nodes of the last leaf processed (at most one per level). Advancing from leaf r0 to r1 computes
only the nodes that complete in (r0, r1]; straddling nodes take their left child from the cache.

:class:`HonakerForest` does this for many trees at once with numpy (one noise call per level),
which is what key selection, perturbation and release prediction (Algorithm 4, a scan of all
future leaves) need on the hot path.

Node (level l, index j) covers leaves ``j*2^l + 1 .. (j+1)*2^l`` (1-based); it is complete at
leaf ``(j+1)*2^l``. Its estimate is ``E = a_l * y + b_l * (E_left + E_right)`` with the weights
of :func:`accountant.calibration.honaker_weights` (a leaf's estimate is its noisy value).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accountant.calibration import honaker_weights, tree_levels
from processor.noise import DiscreteGaussian, NodeNoise, node_ids


@dataclass
class _Level:
    start: np.ndarray  # first node index computed, per tree (r0 >> l)
    offsets: np.ndarray  # n+1 offsets into values
    values: np.ndarray  # noise estimates of the computed nodes, flat


class ForestWalk:
    """Noise estimates of the nodes completing in (r0, r1] for a batch of trees."""

    def __init__(self, forest: "HonakerForest", cache: np.ndarray, done: np.ndarray, upto: np.ndarray):
        self._forest = forest
        self._cache = cache
        self.done = done
        self.upto = upto
        self._levels: list[_Level] = []

    def _lookup(self, level: int, tree: np.ndarray, index: np.ndarray) -> np.ndarray:
        lv = self._levels[level]
        rel = index - lv.start[tree]
        out = np.empty(len(index), dtype=np.float64)
        inside = rel >= 0
        out[inside] = lv.values[lv.offsets[tree[inside]] + rel[inside]]
        outside = ~inside
        if outside.any():
            out[outside] = self._cache[tree[outside], level]
        return out

    def prefix_noise(self, tree: np.ndarray, leaf: np.ndarray) -> np.ndarray:
        """N_leaf for (tree, leaf) pairs with r0 <= leaf <= r1 of that tree (leaf >= 1)."""
        total = np.zeros(len(leaf), dtype=np.float64)
        for level in range(self._forest.levels):
            sel = np.nonzero((leaf >> level) & 1)[0]
            if len(sel):
                total[sel] += self._lookup(level, tree[sel], (leaf[sel] >> level) - 1)
        return total

    def cache_at(self, leaf: np.ndarray) -> np.ndarray:
        """Frontier caches for each tree at its ``leaf`` (r0 <= leaf <= r1)."""
        n = len(leaf)
        cache = np.full((n, self._forest.levels), np.nan)
        tree = np.arange(n)
        for level in range(self._forest.levels):
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
        self.levels = tree_levels(self.capacity)
        self.sampler = sampler
        self.noise = noise
        weights = [honaker_weights(level) for level in range(self.levels)]
        self._own = [w[0] for w in weights]
        self._children = [w[1] for w in weights]

    def empty_cache(self, n: int) -> np.ndarray:
        return np.full((n, self.levels), np.nan)

    def walk(self, trees: np.ndarray, done: np.ndarray, upto: np.ndarray, cache: np.ndarray) -> ForestWalk:
        """Compute the nodes of each tree completing in (done, upto]; ``cache`` is at ``done``."""
        done = np.asarray(done, dtype=np.int64)
        upto = np.asarray(upto, dtype=np.int64)
        if (upto > self.capacity).any():
            raise ValueError("leaf beyond the tree's capacity")
        n = len(done)
        walk = ForestWalk(self, cache, done, upto)
        ordinal = np.arange(n)
        for level in range(self.levels):
            start = done >> level
            count = np.maximum((upto >> level) - start, 0)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(count, out=offsets[1:])
            total = int(offsets[-1])
            if total == 0:
                walk._levels.append(_Level(start, offsets, np.zeros(0)))
                continue
            tree = np.repeat(ordinal, count)
            index = start[tree] + (np.arange(total) - offsets[tree])
            own = self.noise.sample(self.sampler, trees[tree], node_ids(np.full(total, level), index)).astype(np.float64)
            if level == 0:
                values = own
            else:
                below = walk._lookup(level - 1, tree, 2 * index) + walk._lookup(level - 1, tree, 2 * index + 1)
                values = self._own[level] * own + self._children[level] * below
            walk._levels.append(_Level(start, offsets, values))
        return walk
