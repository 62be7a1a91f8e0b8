"""User contribution bounding (DP-SQLP section 3.2 and section 4.1 step 1; docs/privacy.md, "Failures").

Stage 1, partitioned by user: each (user, window) - the privacy unit - admits at most C records,
the first C in arrival order; each admitted record gets a *slot* 1..C. The per-user state is just
the number of admitted records. Values are clamped to ``|v| <= L`` and put on the accountant's
grid (``round(v / resolution)`` grid units, ties to even, then clamped to the ``M = floor(L /
resolution)`` steps the accountant's sensitivity assumes): the integer data the perturbation
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
        self.clamp_units = int(np.floor(self.clamp / self.resolution))

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
        units = np.clip(np.rint(np.clip(arr, -self.clamp, self.clamp) / self.resolution), -self.clamp_units, self.clamp_units)
        units = units.astype(np.int64)
        return int(units) if units.ndim == 0 else units


@dataclass(frozen=True)
class KeyHistory:
    """What stage 1 attaches to admitted records so that stage 2 counts each user at most once per
    (key, selection round), whatever the arrival order (docs/privacy.md, "Distinct users")."""

    previous: np.ndarray  # per record: max trigger of the user's earlier-arrived records for the key with trigger <= its own (0: none)
    amend: np.ndarray  # per record: min trigger of the user's earlier-arrived records for the key with a later trigger (0: none)
    group: np.ndarray  # updated state, sorted by (group, key, trigger): one entry per distinct (group, key, trigger)
    key: np.ndarray
    trigger: np.ndarray


def key_histories(group_of: np.ndarray, key_ids: np.ndarray, triggers: np.ndarray,
                  state_group: np.ndarray, state_key: np.ndarray, state_trigger: np.ndarray) -> KeyHistory:
    """For admitted records (arrival order): each record's *predecessor* among the same user's
    records for the same key, and the updated per-user state (the set of (key, trigger) pairs the
    user has contributed in the window: at most C entries).

    Order the user's records for a key by (trigger, arrival). Stage 2 counts a record as the
    user's arrival in the key's current round iff the trigger of the record before it in that
    order is before the round's first trigger (or there is none). Then in any round only the
    user's first record in the round counts: at most 1 per (key, round) tree, and since each
    counted record is a distinct admitted record, at most C rounds. The count depends only on
    the set of records, never on the order in which they arrived.

    Stage 1 sees records in arrival order, so when a record R arrives it knows only the earlier
    arrivals: ``previous`` is the largest earlier trigger <= R's (an earlier arrival at the same
    trigger comes first in the order). A record arriving *after* a record of a later trigger
    (out of event-time order) becomes the new predecessor of the earliest such later record:
    ``amend`` names that record's trigger, and stage 2 raises the predecessor of the user's
    records for the key in that micro-batch to R's trigger. The amended micro-batch has not
    fired: R's own trigger has not, and triggers fire in order. Every later record already has a
    predecessor at or after that trigger, so one amendment per arrival suffices, and applying
    it twice (a replayed record) changes nothing (a maximum).
    """
    n, n_state = len(group_of), len(state_group)
    group = np.concatenate([np.asarray(state_group, dtype=np.int64), np.asarray(group_of, dtype=np.int64)])
    key = np.concatenate([np.asarray(state_key, dtype=np.uint64), np.asarray(key_ids, dtype=np.uint64)])
    trig = np.concatenate([np.asarray(state_trigger, dtype=np.int64), np.asarray(triggers, dtype=np.int64)])
    position = np.concatenate([np.full(n_state, -1, dtype=np.int64), np.arange(n, dtype=np.int64)])
    # order by (user, key, position): state entries (position -1) come first and records in
    # arrival order, so a stable sort on one dense (user, key) code keeps that order within a
    # segment (two sorts instead of lexsort's three)
    _, key_code = np.unique(key, return_inverse=True)
    segment_code = group * (int(key_code.max(initial=0)) + 1) + key_code.ravel()
    order = np.argsort(segment_code, kind="stable")
    g, k, t, pos = group[order], key[order], trig[order], position[order]
    new_segment = np.ones(len(order), dtype=bool)
    coded = segment_code[order]
    new_segment[1:] = coded[1:] != coded[:-1]
    seg_start = np.maximum.accumulate(np.where(new_segment, np.arange(len(order)), 0))
    earlier = np.arange(len(order)) - seg_start  # elements before this one in its (user, key) segment
    earlier[pos < 0] = 0  # state entries need no answer
    previous = np.zeros(n, dtype=np.int64)
    amend = np.zeros(n, dtype=np.int64)
    total = int(earlier.sum())
    if total:
        b = np.repeat(np.arange(len(order)), earlier)  # the record asking
        first = np.cumsum(earlier) - earlier
        a = seg_start[b] + (np.arange(total) - first[b])  # each element that arrived before it
        ta, tb = t[a], t[b]
        askers = np.nonzero(earlier)[0]
        starts = first[askers]
        prev = np.maximum.reduceat(np.where(ta <= tb, ta, 0), starts)
        big = np.iinfo(np.int64).max
        later = np.minimum.reduceat(np.where(ta > tb, ta, big), starts)
        previous[pos[askers]] = prev
        amend[pos[askers]] = np.where(later == big, 0, later)
    # the new state: distinct (user, key, trigger), sorted; already in (user, key) order, so
    # sort by trigger within each segment
    segment = np.cumsum(new_segment) - 1
    state_order = np.argsort(segment * (int(t.max(initial=0)) + 1) + t, kind="stable")
    gs, ks, ts = g[state_order], k[state_order], t[state_order]
    keep = np.ones(len(gs), dtype=bool)
    keep[1:] = (gs[1:] != gs[:-1]) | (ks[1:] != ks[:-1]) | (ts[1:] != ts[:-1])
    return KeyHistory(previous, amend, gs[keep], ks[keep], ts[keep])
