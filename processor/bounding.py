"""User contribution bounding (DP-SQLP section 3.2 and section 4.1 step 1; DESIGN.md section 12).

Stage 1, partitioned by user: each (user, window) - the privacy unit - admits at most C records,
the first C in arrival order; each admitted record gets a *slot* 1..C. The per-user state is just
the number of admitted records. Values are clamped to ``|v| <= L`` and put on the accountant's
grid (``round(v / resolution)`` grid units, ties to even): the integer data the perturbation
tree's discrete noise needs.

Why this cannot be pushed past C by at-least-once delivery: slot assignment is a deterministic
function of the prior count and the arrival order. The runner stores the input position with the
counts in one atomic write, so input it has already counted is skipped after a restart; and if
stage 1's *output* is delivered twice, both copies carry the same (user, slot), which stage 2
counts once per key. A user therefore never has more than C counted contributions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotAssignment:
    slots: np.ndarray  # int64 per record: prior count + rank among its group's records + 1
    admitted: np.ndarray  # bool per record: slot <= C
    counts: np.ndarray  # int64 per group: admitted records after this batch (<= C)


class ContributionBounder:
    def __init__(self, contribution_bound: int, clamp: float, resolution: float = 1.0):
        if contribution_bound < 1:
            raise ValueError("contribution_bound must be >= 1")
        self.contribution_bound = int(contribution_bound)
        self.clamp = float(clamp)
        self.resolution = float(resolution)

    def assign_slots(self, prior: np.ndarray, group_of: np.ndarray) -> SlotAssignment:
        """Slots for a batch of records. ``group_of[r]``: index of record r's (user, window) group,
        records in arrival order; ``prior[g]``: records group g admitted before this batch."""
        prior = np.asarray(prior, dtype=np.int64)
        group_of = np.asarray(group_of, dtype=np.int64)
        order = np.argsort(group_of, kind="stable")
        sorted_groups = group_of[order]
        start = np.ones(len(order), dtype=bool)
        start[1:] = sorted_groups[1:] != sorted_groups[:-1]
        first = np.nonzero(start)[0]
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order)) - np.repeat(first, np.diff(np.append(first, len(order))))
        slots = prior[group_of] + rank + 1
        admitted = slots <= self.contribution_bound
        counts = np.minimum(prior + np.bincount(group_of, minlength=len(prior)), np.maximum(prior, self.contribution_bound))
        return SlotAssignment(slots, admitted, counts)

    def units(self, values):
        """Clamp to [-L, L] and express on the grid (integer units). Rejects non-finite values."""
        arr = np.asarray(values, dtype=np.float64)
        if not np.isfinite(arr).all():
            raise ValueError("value must be finite")
        units = np.rint(np.clip(arr, -self.clamp, self.clamp) / self.resolution).astype(np.int64)
        return int(units) if units.ndim == 0 else units
