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


@dataclass(frozen=True)
class LastContributions:
    previous: np.ndarray  # per record: trigger of the user's previous admitted record for the key (0: none)
    group: np.ndarray  # updated state, sorted by (group, key): one entry per (group, key)
    key: np.ndarray
    trigger: np.ndarray


def last_contributions(group_of: np.ndarray, key_ids: np.ndarray, triggers: np.ndarray,
                       state_group: np.ndarray, state_key: np.ndarray, state_trigger: np.ndarray) -> LastContributions:
    """For admitted records (arrival order), the trigger of the same user's previous record for the
    same key, from the batch itself or from the user's state; and the updated state.

    Stage 2 counts a user as *new to a key's current round* (the unit of key selection, DP-SQLP
    Algorithm 2) iff that previous trigger is before the round's first trigger. Stage 1 has the
    user's state loaded anyway, so this needs no per-(key, user) state in stage 2. Each admitted
    record is new to at most one round, so a user still joins at most C round trees.
    """
    n_state = len(state_group)
    group = np.concatenate([np.asarray(state_group, dtype=np.int64), np.asarray(group_of, dtype=np.int64)])
    key = np.concatenate([np.asarray(state_key, dtype=np.uint64), np.asarray(key_ids, dtype=np.uint64)])
    trig = np.concatenate([np.asarray(state_trigger, dtype=np.int64), np.asarray(triggers, dtype=np.int64)])
    position = np.concatenate([np.full(n_state, -1, dtype=np.int64), np.arange(len(group_of), dtype=np.int64)])
    order = np.lexsort((position, key, group))
    g, k, t, pos = group[order], key[order], trig[order], position[order]
    same_as_before = np.zeros(len(order), dtype=bool)
    same_as_before[1:] = (g[1:] == g[:-1]) & (k[1:] == k[:-1])
    prev_sorted = np.zeros(len(order), dtype=np.int64)
    prev_sorted[1:] = np.where(same_as_before[1:], t[:-1], 0)
    previous = np.zeros(len(group_of), dtype=np.int64)
    is_record = pos >= 0
    previous[pos[is_record]] = prev_sorted[is_record]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = ~same_as_before[1:]
    return LastContributions(previous, g[last], k[last], t[last])
