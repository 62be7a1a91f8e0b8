"""Continual counters: the seam between DP-SQLP's algorithms and the mechanism that releases
noisy prefix sums (docs/architecture.md, "Where to add").

Key selection (Algorithm 2) keeps one counter stream per (key, round) fed with users new to the
round; perturbation (Algorithm 3) one per (key, column) fed with the key's buffered aggregate.
Both use a counter only through :class:`ContinualCounter`: they advance many streams at once from
the step each has processed to a later one, read exact noisy prefixes (compared with thresholds
and rounded exactly, never ``raw + noise`` in floating point: docs/privacy.md, "The arithmetic of
releases"), and carry a fixed-width int64 state per stream between steps, which the key rows store
(state.tables: ``sel_cache``, ``pcache``). The accountant calibrates a counter from its
:class:`accountant.counters.CounterCalibration` (sensitivity and per-step variance), found by
the counter's name.

The binary tree with Honaker estimation (:mod:`processor.mechanisms.tree`) is the first
implementation; its state is the frontier of complete nodes, one per tree level.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from accountant.counters import BINARY_TREE, CounterCalibration
from processor.mechanisms.noise import NodeNoise, discrete_gaussian
from processor.mechanisms.tree import HonakerForest


class NoisyPrefixes(Protocol):
    """Noisy prefixes of a batch of (stream, step) pairs, held exactly."""

    def exceeds(self, base: np.ndarray, threshold: np.ndarray) -> np.ndarray:
        """``base + noise > threshold``, decided exactly."""

    def rounded(self, base: np.ndarray) -> np.ndarray:
        """``base + noise`` rounded to the nearest integer, exactly (int64)."""

    def approx(self) -> np.ndarray:
        """The noise as floats: statistics and shortcuts only, never a decision or a release."""


class CounterWalk(Protocol):
    """Many streams advanced from their processed step ``done`` to ``upto``."""

    def prefix(self, stream: np.ndarray, step: np.ndarray) -> NoisyPrefixes:
        """Noisy prefixes for (stream, step) pairs with done <= step <= upto of that stream."""

    def state_at(self, step: np.ndarray) -> np.ndarray:
        """Each stream's state (n, state_width) once ``step`` is processed."""

    def future(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (stream, step) with done < step <= upto, stream-major, steps ascending."""


class ContinualCounter(Protocol):
    name: str
    calibration: CounterCalibration
    steps: int  # T
    state_width: int  # int64 numbers of state per stream

    def empty_state(self, n: int) -> np.ndarray:
        """State of ``n`` streams before their first step."""

    def walk(self, streams: np.ndarray, done: np.ndarray, upto: np.ndarray, state: np.ndarray) -> CounterWalk:
        """Advance streams (16-byte ids naming their noise) from ``done`` (with ``state``) to ``upto``."""


class _TreeWalk:
    def __init__(self, walk):
        self._walk = walk

    def prefix(self, stream, step):
        return self._walk.prefix(stream, step)

    def state_at(self, step):
        return self._walk.cache_at(step)

    def future(self):
        return self._walk.future()


class BinaryTreeCounter:
    """The binary tree with bottom-up Honaker estimation (DP-SQLP section 2.2) over T steps."""

    name = BINARY_TREE.name
    calibration = BINARY_TREE

    def __init__(self, steps: int, sigma_units: float, noise: NodeNoise):
        self._use(HonakerForest(steps, discrete_gaussian(sigma_units), noise))

    @classmethod
    def over(cls, forest: HonakerForest) -> "BinaryTreeCounter":
        """A counter over a given forest (tests inject forests with known node noise)."""
        counter = cls.__new__(cls)
        counter._use(forest)
        return counter

    def _use(self, forest: HonakerForest) -> None:
        self._forest = forest
        self.steps = forest.capacity
        self.state_width = forest.tree_levels
        self.sampler = forest.sampler  # the node noise's distribution (statistical tests)

    def empty_state(self, n: int) -> np.ndarray:
        return self._forest.empty_cache(n)

    def walk(self, streams, done, upto, state) -> CounterWalk:
        return _TreeWalk(self._forest.walk(streams, done, upto, state))


COUNTER_TYPES: dict[str, type] = {BinaryTreeCounter.name: BinaryTreeCounter}


def counter_for(name: str, steps: int, sigma_units: float, noise: NodeNoise) -> ContinualCounter:
    """The counter a plan names, at the plan's noise scale (grid units)."""
    return COUNTER_TYPES[name](steps, sigma_units, noise)
