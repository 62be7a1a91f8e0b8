"""User contribution bounding (DP-SQLP section 3.2 and section 4.1 step 1; docs/privacy.md, "Failures").

Stage 1, partitioned by user: each (user, window) - the privacy unit - admits at most C records,
the first C in arrival order; each admitted record gets a *slot* 1..C. The per-user state is the
number of admitted records and their keys (:func:`key_histories`). With a per-key bound c_k only
a user's first c_k records of a key, in arrival order, compete for the C slots
(:func:`first_for_key`, :func:`within_key_bound`). Values are clamped to ``|v| <= L`` and put on the accountant's
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

from dpstream.processor.mechanisms import kernels


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
        rank = kernels.group_ranks(group_of, len(prior))  # compiled: one pass, no sort
        if rank is None:
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
    group: np.ndarray  # updated state (or its new entries only), grouped by group (ascending): one entry per distinct (group, key, trigger)
    key: np.ndarray
    trigger: np.ndarray


def key_histories(group_of: np.ndarray, key_ids: np.ndarray, triggers: np.ndarray,
                  state_group: np.ndarray, state_key: np.ndarray, state_trigger: np.ndarray, distinct: bool = True,
                  appended: bool = False) -> KeyHistory:
    """For admitted records (arrival order): each record's *predecessor* among the same user's
    records for the same key, and the updated per-user state (the set of (key, trigger) pairs the
    user has contributed in the window: at most C entries). ``distinct`` False (a per-key bound
    above 1: :func:`within_key_bound`): the state keeps one entry per admitted record instead,
    a multiset whose entries of a key count the user's admitted records of it (still at most C).

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

    The state (``state_group`` ascending; a group's entries in any order) is a set per user. The
    earlier arrivals of a record are its user's state entries and the batch's earlier records of
    the same user: each record is compared with every state entry of its own user (fewer than C)
    and, after one sort of the batch, with its (user, key)'s earlier records in the batch. No
    sort touches the state, which grows through the window while batches do not. The new state
    keeps a group's entries and appends its new ones. ``appended``: the returned state entries
    are the new ones only (what a changelog of appends writes: dpstream.state.tables.UserStates).
    """
    n = len(group_of)
    g = np.asarray(group_of, dtype=np.int64)
    k = np.asarray(key_ids, dtype=np.uint64)
    t = np.asarray(triggers, dtype=np.int64)
    sg = np.asarray(state_group, dtype=np.int64)
    sk = np.asarray(state_key, dtype=np.uint64)
    st = np.asarray(state_trigger, dtype=np.int64)
    big = np.iinfo(np.int64).max
    previous = np.zeros(n, dtype=np.int64)
    later = np.full(n, big, dtype=np.int64)
    known = np.zeros(n, dtype=bool)  # (user, key, trigger) already in the state or earlier in the batch
    if n == 0:
        return KeyHistory(previous, np.zeros(0, dtype=np.int64), *((sg[:0], sk[:0], st[:0]) if appended else (sg, sk, st)))
    compiled = kernels.key_histories(g, k, t, sg, sk, st, distinct, appended)  # the same answers, one user at a time
    if compiled is not None:
        return KeyHistory(*compiled)

    def fold(asking: np.ndarray, ta: np.ndarray, match: np.ndarray, starts: np.ndarray, askers: np.ndarray) -> None:
        """Fold pairs (earlier element, asking record), in runs per asker, into the answers."""
        tb = t[asking]
        previous[askers] = np.maximum(previous[askers], np.maximum.reduceat(np.where(match & (ta <= tb), ta, 0), starts))
        later[askers] = np.minimum(later[askers], np.minimum.reduceat(np.where(match & (ta > tb), ta, big), starts))
        known[askers] |= np.logical_or.reduceat(match & (ta == tb), starts)

    # 1. each record against every state entry of its user (groups are dense small integers:
    # a bincount finds each group's entries, with no search)
    bounds = np.zeros(max(int(g.max()), int(sg.max(initial=-1))) + 2, dtype=np.int64)
    np.cumsum(np.bincount(sg, minlength=len(bounds) - 1), out=bounds[1:])
    if len(sg):
        lo = bounds[g]
        count = bounds[g + 1] - lo
        total = int(count.sum())
        if total:
            asking = np.repeat(np.arange(n), count)
            first = np.cumsum(count) - count
            entry = lo[asking] + (np.arange(total) - first[asking])
            askers = np.nonzero(count)[0]
            fold(asking, st[entry], sk[entry] == k[asking], first[askers], askers)
    # 2. each record against the earlier records of its (user, key) in the batch: order by
    # (user, key, arrival) with one stable sort of a dense (user, key) code
    _, key_code = np.unique(k, return_inverse=True)
    code = g * (int(key_code.max(initial=0)) + 1) + key_code.ravel()
    order = np.argsort(code, kind="stable")
    coded = code[order]
    new_segment = np.ones(n, dtype=bool)
    new_segment[1:] = coded[1:] != coded[:-1]
    seg_start = np.maximum.accumulate(np.where(new_segment, np.arange(n), 0))
    earlier = np.arange(n) - seg_start  # records before this one in its (user, key) segment
    total = int(earlier.sum())
    if total:
        b = np.repeat(np.arange(n), earlier)  # the record asking, in sorted position
        first = np.cumsum(earlier) - earlier
        a = seg_start[b] + (np.arange(total) - first[b])  # each record that arrived before it
        askers_sorted = np.nonzero(earlier)[0]
        fold(order[b], t[order[a]], np.ones(total, dtype=bool), first[askers_sorted], order[askers_sorted])
    amend = np.where(later == big, 0, later)
    # the new state: a group's entries, then its new (key, trigger) pairs (``order`` is by group);
    # as a multiset, one per record
    fresh = order[~known[order]] if distinct else order
    if appended:
        return KeyHistory(previous, amend, g[fresh], k[fresh], t[fresh])
    if not len(fresh):
        return KeyHistory(previous, amend, sg, sk, st)
    at = bounds[g[fresh] + 1]  # after the group's last entry
    return KeyHistory(previous, amend, np.insert(sg, at, g[fresh]), np.insert(sk, at, k[fresh]), np.insert(st, at, t[fresh]))


def first_for_key(group_of: np.ndarray, key_ids: np.ndarray, state_group: np.ndarray, state_key: np.ndarray) -> np.ndarray:
    """Per record (arrival order): whether it is its user's first record for its key in the window,
    i.e. no state entry of its group has its key and no earlier record of the batch has its
    (group, key). The per-key bound of 1 (``per_key_bound``; docs/privacy.md, "Per-key bound")
    admits only these records: a user then adds at most one record to any key. (A bound above 1:
    :func:`within_key_bound`, which at 1 gives the same answer.)

    ``state_group`` ascending with ``state_key`` (the user states of :func:`key_histories`: every
    admitted record's key is there until the user reaches C, after which nothing is admitted)."""
    n = len(group_of)
    first = np.zeros(n, dtype=bool)
    if n == 0:
        return first
    g = np.asarray(group_of, dtype=np.int64)
    k = np.asarray(key_ids, dtype=np.uint64)
    # first in the batch: the earliest record of each (group, key), by one stable sort
    order = np.lexsort((k, g))  # stable: ties keep arrival order
    sg_, sk_ = g[order], k[order]
    head = np.ones(n, dtype=bool)
    head[1:] = (sg_[1:] != sg_[:-1]) | (sk_[1:] != sk_[:-1])
    first[order[head]] = True
    # ... and not in the user's state: compare each candidate with its group's entries (< C each)
    sg = np.asarray(state_group, dtype=np.int64)
    if len(sg):
        sk = np.asarray(state_key, dtype=np.uint64)
        bounds = np.zeros(max(int(g.max()), int(sg.max())) + 2, dtype=np.int64)
        np.cumsum(np.bincount(sg, minlength=len(bounds) - 1), out=bounds[1:])
        cand = np.nonzero(first)[0]
        lo = bounds[g[cand]]
        count = bounds[g[cand] + 1] - lo
        total = int(count.sum())
        if total:
            asking = np.repeat(np.arange(len(cand)), count)
            starts = np.cumsum(count) - count
            entry = lo[asking] + (np.arange(total) - starts[asking])
            has = np.nonzero(count)[0]
            seen = np.logical_or.reduceat(sk[entry] == k[cand[asking]], starts[has])
            first[cand[has[seen]]] = False
    return first


def within_key_bound(group_of: np.ndarray, key_ids: np.ndarray, state_group: np.ndarray, state_key: np.ndarray,
                     bound: int) -> np.ndarray:
    """Per record (arrival order): whether fewer than ``bound`` records of its (group, key) came
    before it, i.e. the group's state entries with its key plus the batch's earlier records of the
    (group, key) number fewer than ``bound``. The per-key bound c_k = ``bound`` > 1
    (``per_key_bound``; docs/privacy.md, "Per-key bound") admits only these records: a user then
    adds at most c_k records to any key, the first c_k in arrival order (then at most C in all).

    ``state_group`` ascending with ``state_key``: the user states of :func:`key_histories` kept as
    a multiset (``distinct=False``), one entry per admitted record, so a group's entries of a key
    count its admitted records of the key. (Every admitted record is there until the user reaches
    C, after which nothing is admitted; an eligible record not admitted for C means the same.)
    A record of the batch beyond the bound counts among the earlier ones of its (group, key), but
    it comes after ``bound`` eligible ones, so the answer is the same."""
    n = len(group_of)
    if n == 0:
        return np.zeros(0, dtype=bool)
    g = np.asarray(group_of, dtype=np.int64)
    k = np.asarray(key_ids, dtype=np.uint64)
    # rank in the batch among the (group, key)'s records, by one stable sort (ties keep arrival order)
    order = np.lexsort((k, g))
    sg_, sk_ = g[order], k[order]
    head = np.ones(n, dtype=bool)
    head[1:] = (sg_[1:] != sg_[:-1]) | (sk_[1:] != sk_[:-1])
    seg_start = np.maximum.accumulate(np.where(head, np.arange(n), 0))
    taken = np.empty(n, dtype=np.int64)
    taken[order] = np.arange(n) - seg_start
    # ... plus the group's state entries with the key: each (group, key)'s first record compares
    # its key with its group's entries (at most C each), the rest of its records share the answer
    sg = np.asarray(state_group, dtype=np.int64)
    if len(sg):
        sk = np.asarray(state_key, dtype=np.uint64)
        bounds = np.zeros(max(int(g.max()), int(sg.max())) + 2, dtype=np.int64)
        np.cumsum(np.bincount(sg, minlength=len(bounds) - 1), out=bounds[1:])
        heads = order[head]
        lo = bounds[g[heads]]
        count = bounds[g[heads] + 1] - lo
        total = int(count.sum())
        if total:
            asking = np.repeat(np.arange(len(heads)), count)
            starts = np.cumsum(count) - count
            entry = lo[asking] + (np.arange(total) - starts[asking])
            has = np.nonzero(count)[0]
            prior = np.zeros(len(heads), dtype=np.int64)
            prior[has] = np.add.reduceat((sk[entry] == k[heads[asking]]).astype(np.int64), starts[has])
            segment = np.cumsum(head) - 1  # per sorted position: its (group, key)'s index among the heads
            taken[order] += prior[segment]
    return taken < bound
