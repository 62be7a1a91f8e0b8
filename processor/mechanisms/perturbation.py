"""Hierarchical perturbation with a DP tree (DP-SQLP Algorithm 3), for COUNT and SUM columns.

Once key selection releases a key at trigger i, the aggregate buffered since the key's last
release (``Delta V``, line 7) is added to leaf i of the key's perturbation tree (one per window
and aggregate column; leaf i is trigger i, a fixed public layout) and the tree's noisy prefix sum
is published (line 9). Values live on the accountant's grid (``plan.resolution``: 1 for counts, a
power of two for sums) so that integer noise on the grid is the discrete Gaussian mechanism on
integer data; the accountant's sensitivity is ``C * L`` per tree (section 4.4: all C
contributions may land in one node).

What is published is the noisy prefix rounded to the nearest whole grid step, computed exactly
from the integer noisy nodes (:meth:`dpstream.processor.mechanisms.tree.NoisePrefix.rounded`): an integer for a
count, ``k * resolution`` for a sum, which is exact in binary floating point because the grid
step is a power of two. Never ``raw + noise`` in floating point (docs/privacy.md).

Each release carries a confidence interval, the published value +- a half-width in whole grid
steps from the counter's public noise distribution (:meth:`HierarchicalPerturber.halfwidth_units`,
dpstream.accountant.intervals; docs/privacy.md, "Error bars").

Between releases nothing is published for the key; the last release stands.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dpstream.accountant.counters import BINARY_TREE
from dpstream.accountant.intervals import gaussian_halfwidth_units
from dpstream.accountant.plan import PrivacyPlan
from dpstream.processor.mechanisms.counters import counter_for
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.processor.mechanisms.tree import ABSENT


@dataclass
class PerturbationBatch:
    """Perturbation-tree state of a batch of keys, column-wise."""

    keys: list
    released_units: np.ndarray  # exact sum (grid units) of everything released so far
    done: np.ndarray  # last step released (its trigger, or its release number), 0 if none
    cache: np.ndarray  # (n, tree_levels) int64 frontier noise integers Fz at `done` (dpstream.processor.mechanisms.tree)
    _tree_ids: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def new(cls, keys: Sequence[str], tree_levels: int) -> "PerturbationBatch":
        n = len(keys)
        return cls(list(keys), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.full((n, tree_levels), ABSENT, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.keys)


class HierarchicalPerturber:
    """Algorithm 3 for one (query, window, column), vectorized over released keys."""

    def __init__(self, plan: PrivacyPlan, noise: NodeNoise, query: str, window_start: int, column: str | None = None,
                 column_index: int = 0):
        """``column``: the aggregate column this tree perturbs (its name is part of the tree id);
        ``column_index``: its position among the plan's columns (an aggregate of several
        columns has a calibration per column: ``plan.columns``)."""
        self.plan = plan
        self.query = query
        self.window_start = int(window_start)
        self.kind = f"perturb:{column or plan.aggregate}"
        if plan.columns is None:
            self.integer = plan.aggregate == "count"
            self.resolution, self.sigma, sigma_units = plan.resolution, plan.sigma_perturbation, plan.sigma_perturbation_units
        else:
            kind, self.sigma, sigma_units, self.resolution = plan.columns[column_index]
            self.integer = kind == "one"
        self.sigma_units = sigma_units
        self.counter = counter_for(plan.counter or BINARY_TREE.name, plan.triggers, sigma_units, noise)
        self.noise = noise
        #: the stream's step: the trigger (the paper's layout) or the key's release number
        #: (``perturbation_steps: release``; docs/privacy.md, "Perturbation steps")
        self.by_release = plan.perturbation_steps == "release"

    @property
    def state_width(self) -> int:
        return self.counter.state_width

    def new_batch(self, keys: Sequence[str]) -> PerturbationBatch:
        batch = PerturbationBatch.new(keys, self.state_width)
        batch.cache = self.counter.empty_state(len(batch))
        return batch

    def tree_ids(self, batch: PerturbationBatch) -> np.ndarray:
        if batch._tree_ids is None:
            batch._tree_ids = self.noise.tree_ids_for(self.query, self.window_start, self.kind, batch.keys, [0] * len(batch))
        return batch._tree_ids

    def release_units(self, batch: PerturbationBatch, trigger: int, delta_units: np.ndarray) -> np.ndarray:
        """Add each key's buffered aggregate (grid units) at leaf ``trigger`` and return the noisy
        cumulative aggregates as whole grid steps (int64): the nearest integer to the exact noisy
        prefix. Mutates ``batch``."""
        if not 1 <= trigger <= self.plan.triggers:
            raise ValueError(f"trigger {trigger} outside 1..{self.plan.triggers}")
        delta_units = np.asarray(delta_units, dtype=np.int64)
        if self.by_release:
            # step = the key's release number, public (every release is an output); a key is
            # released at most once per trigger, so at most T steps
            leaf = batch.done + 1
            if (leaf > self.plan.triggers).any():
                raise ValueError("a key was released more often than there are triggers")
        else:
            if (batch.done >= trigger).any():
                raise ValueError("a key was already released at or after this trigger")
            leaf = np.full(len(batch), trigger, dtype=np.int64)
        walk = self.counter.walk(self.tree_ids(batch), batch.done, leaf, batch.cache)
        prefix = walk.prefix(np.arange(len(batch)), leaf)
        batch.released_units += delta_units
        batch.cache = walk.state_at(leaf)
        batch.done[:] = leaf
        return prefix.rounded(batch.released_units)

    def release(self, batch: PerturbationBatch, trigger: int, delta_units: np.ndarray) -> list:
        """:meth:`release_units` as published values: ints for a count, ``k * resolution``
        (exact floats: the grid step is a power of two) for a sum."""
        units = self.release_units(batch, trigger, delta_units)
        return self.publish(units)

    def publish(self, units: np.ndarray) -> list:
        if self.integer:
            return [int(u) for u in units.tolist()]
        return [u * self.resolution for u in units.tolist()]

    def stddev(self, step: int) -> float:
        """Standard deviation of a release at ``step`` (the trigger, or the key's release number
        with ``perturbation_steps: release``), in value units, from the accountant."""
        return self.sigma * self.counter.calibration.step_variance(step, self.plan.triggers) ** 0.5

    def halfwidth_units(self, step: int) -> int:
        """Half-width, in whole grid steps, of the confidence interval of a release at ``step``
        (public: the counter, sigma and the step only; dpstream.accountant.intervals, docs/privacy.md,
        "Error bars")."""
        return gaussian_halfwidth_units(self.counter.calibration, self.sigma_units, step, self.plan.triggers)
