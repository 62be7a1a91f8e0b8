"""Calibration of continual counters: what the accountant needs to know about a counter.

A continual counter releases noisy prefix sums of one stream over steps 1..T from discrete
Gaussian noise of scale sigma on its internal values (processor.mechanisms.counters). For the
privacy argument and the thresholds, the accountant needs two functions of the counter, and no
more (docs/privacy.md, "Accounting"):

* ``sensitivity_sq(T)``: the squared L2 norm, in units of one increment, of how much one
  increment at any step can change the counter's noised values that some output reads: zCDP
  costs ``sensitivity_sq * Delta^2 / (2 sigma^2)`` for an increment of ``Delta``;
* ``step_variance(t, T)``: the variance of the noisy prefix at step t, in units of sigma^2.

Counters whose state is a few numbers per stream, and whose per-step variance is not a tree's
(e.g. the BLT and other matrix-factorization counters of Google's jax_privacy), declare theirs
here under their name; the mechanism with that name lives in processor.mechanisms.counters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from accountant.calibration import prefix_variance_factor, read_levels, tree_levels


@dataclass(frozen=True)
class CounterCalibration:
    name: str
    #: T -> squared L2 sensitivity of the read noised values to one unit increment
    sensitivity_sq: Callable[[int], int]
    #: (t, T) -> Var(noisy prefix at step t) / sigma^2
    step_variance: Callable[[int, int], float]
    #: T -> int64 numbers of state per stream carried between steps
    state_width: Callable[[int], int]


#: The binary tree with bottom-up Honaker estimation (DP-SQLP section 2.2, eqs. (1)-(2)): an
#: increment reaches one read node per level, ``floor(lg T) + 1`` of them (read_levels); the
#: prefix at t reads one complete node per set bit of t (prefix_variance_factor); the state is
#: the frontier of complete nodes, one per level of the padded tree (tree_levels).
BINARY_TREE = CounterCalibration("binary_tree", read_levels, lambda t, T: prefix_variance_factor(t),
                                 tree_levels)

COUNTERS: dict[str, CounterCalibration] = {c.name: c for c in (BINARY_TREE,)}


def counter_calibration(name: str) -> CounterCalibration:
    try:
        return COUNTERS[name]
    except KeyError:
        raise ValueError(f"counter: must be one of {', '.join(COUNTERS)}, got {name!r}") from None
