"""Hierarchical perturbation with a DP tree (DP-SQLP Algorithm 3), for COUNT and SUM columns.

Once key selection releases a key at trigger i, the aggregate buffered since the key's last
release (``Delta V``, line 7) is added to leaf i of the key's perturbation tree (one per window
and aggregate column; leaf i is trigger i, a fixed public layout) and the tree's noisy prefix sum
is published (line 9). Values live on the accountant's grid (``plan.resolution``: 1 for counts,
``L / 2^j`` for sums) so that integer noise on the grid is the discrete Gaussian mechanism on
integer data; the accountant's sensitivity is ``C * L`` per tree (section 4.4: all C
contributions may land in one node).

Between releases nothing is published for the key; the last release stands.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from accountant.calibration import prefix_variance_factor
from accountant.plan import PrivacyPlan
from processor.noise import NodeNoise, discrete_gaussian
from processor.tree import HonakerForest


@dataclass
class PerturbationBatch:
    """Perturbation-tree state of a batch of keys, column-wise."""

    keys: list
    released_units: np.ndarray  # exact sum (grid units) of everything released so far
    done: np.ndarray  # last leaf (trigger) released, 0 if none
    cache: np.ndarray  # (n, levels) frontier noise estimates at `done`
    _tree_ids: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def new(cls, keys: Sequence[str], levels: int) -> "PerturbationBatch":
        n = len(keys)
        return cls(list(keys), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.full((n, levels), np.nan))

    def __len__(self) -> int:
        return len(self.keys)


class HierarchicalPerturber:
    """Algorithm 3 for one (query, window, column), vectorized over released keys."""

    def __init__(self, plan: PrivacyPlan, noise: NodeNoise, query: str, window_start: int, column: str | None = None):
        self.plan = plan
        self.query = query
        self.window_start = int(window_start)
        self.kind = f"perturb:{column or plan.aggregate}"
        self.resolution = plan.resolution
        self.forest = HonakerForest(plan.triggers, discrete_gaussian(plan.sigma_perturbation_units), noise)
        self.noise = noise

    @property
    def levels(self) -> int:
        return self.forest.levels

    def new_batch(self, keys: Sequence[str]) -> PerturbationBatch:
        return PerturbationBatch.new(keys, self.levels)

    def tree_ids(self, batch: PerturbationBatch) -> np.ndarray:
        if batch._tree_ids is None:
            batch._tree_ids = self.noise.tree_ids_for(self.query, self.window_start, self.kind, batch.keys, [0] * len(batch))
        return batch._tree_ids

    def release(self, batch: PerturbationBatch, trigger: int, delta_units: np.ndarray) -> np.ndarray:
        """Add each key's buffered aggregate (grid units) at leaf ``trigger`` and return the noisy
        cumulative aggregates in value units. Mutates ``batch``."""
        if not 1 <= trigger <= self.plan.triggers:
            raise ValueError(f"trigger {trigger} outside 1..{self.plan.triggers}")
        if (batch.done >= trigger).any():
            raise ValueError("a key was already released at or after this trigger")
        delta_units = np.asarray(delta_units, dtype=np.int64)
        leaf = np.full(len(batch), trigger, dtype=np.int64)
        walk = self.forest.walk(self.tree_ids(batch), batch.done, leaf, batch.cache)
        noise = walk.prefix_noise(np.arange(len(batch)), leaf)
        batch.released_units += delta_units
        batch.cache = walk.cache_at(leaf)
        batch.done[:] = trigger
        return (batch.released_units + noise) * self.resolution

    def stddev(self, trigger: int) -> float:
        """Standard deviation of a release at ``trigger`` (value units), from the accountant."""
        return self.plan.sigma_perturbation * prefix_variance_factor(trigger) ** 0.5
