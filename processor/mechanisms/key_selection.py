"""Streaming private key selection (DP-SQLP Algorithm 2) and empty-key release prediction (Algorithm 4).

Per key and *round*, a DP tree over the triggers is fed with the round's incremental unique-user
counts. At trigger i the tree's noisy prefix sum ``q_hat`` is compared with ``mu + tau_r`` (r the
tree's leaf for trigger i); a key above it is *selected* (its buffered aggregate is released by
:mod:`dpstream.processor.mechanisms.perturbation`) and starts a new round with a fresh tree. Each user adds 1 to one
leaf of a round's tree and takes part in at most C rounds (section 4.4): the accountant's
sensitivity.

Tree layout, chosen so that the tree's shape never depends on private data:

* round 0 uses absolute leaves (leaf i = trigger i): the trigger at which a key first appears is
  data, so the tree starts at trigger 1 with zero increments before that (Algorithm 2, line 5);
* round k >= 1 starts right after the release that closed round k-1 (public: it is an output),
  so its leaf r is trigger ``start + r - 1``: shorter prefixes, less noise.

Gate (Algorithm 2, line 4): a key is only tested once ``participations > mu``, where
``participations`` counts (user, round) arrivals and therefore bounds every round's count from
above. The gate never closes again, so after a release the new round is tested from its first
trigger, also with no new data; prediction covers those triggers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dpstream.accountant.counters import BINARY_TREE
from dpstream.accountant.plan import PrivacyPlan
from dpstream.processor.mechanisms.counters import counter_for
from dpstream.processor.mechanisms.noise import TREE_ID_DTYPE, NodeNoise
from dpstream.processor.mechanisms.tree import ABSENT

SELECT_KIND = "select"
#: Bound on (tree, leaf) pairs materialized at once while scanning the future.
PREDICTION_CHUNK = 1 << 21


def _subset(keys: Sequence[str], idx: np.ndarray) -> Sequence[str]:
    """The keys at positions ``idx``. A lazy sequence of keys (one with ``take``: the pipeline's
    key texts, read only when needed) stays lazy."""
    take = getattr(keys, "take", None)
    return take(idx) if take is not None else [keys[j] for j in idx]


@dataclass
class SelectionBatch:
    """Key-selection state of a batch of keys, column-wise (one row per key)."""

    keys: Sequence[str]
    round: np.ndarray
    start: np.ndarray  # trigger of the round's leaf 1
    done: np.ndarray  # leaves of the round tree already processed
    count: np.ndarray  # true unique-user count of the current round
    participations: np.ndarray  # gate statistic: sum of all rounds' counts
    cache: np.ndarray  # (n, tree_levels) int64 frontier noise integers Fz at `done` (dpstream.processor.mechanisms.tree)
    _tree_ids: np.ndarray | None = field(default=None, repr=False)
    #: an upper bound (float, with a guard for rounding) on max over the round's future leaves
    #: p > (leaf when computed) of N_p - tau_p; NaN: unknown. Only ever used to *skip* a scan
    #: that could not find a release (see :meth:`KeySelector.predict`)
    noise_max: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.noise_max is None:
            self.noise_max = np.full(len(self.keys), np.nan)

    @classmethod
    def new(cls, keys: Sequence[str], tree_levels: int) -> "SelectionBatch":
        n = len(keys)
        zeros = np.zeros(n, dtype=np.int64)
        return cls(list(keys), zeros.copy(), np.ones(n, dtype=np.int64), zeros.copy(), zeros.copy(), zeros.copy(),
                   np.full((n, tree_levels), ABSENT, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def tree_ids_known(self) -> np.ndarray:
        """Each key's round tree id as far as derived (empty: not yet): what a caller keeps
        between triggers (:meth:`KeySelector.tree_ids` derives the missing ones it needs)."""
        if self._tree_ids is None:
            self._tree_ids = np.zeros(len(self.keys), dtype=TREE_ID_DTYPE)
        return self._tree_ids

    def take(self, idx: np.ndarray) -> "SelectionBatch":
        """A copy of some rows (tree ids kept)."""
        ids = None if self._tree_ids is None else self._tree_ids[idx].copy()
        return SelectionBatch(_subset(self.keys, idx), self.round[idx], self.start[idx], self.done[idx], self.count[idx],
                              self.participations[idx], self.cache[idx], ids, self.noise_max[idx].copy())


@dataclass
class SelectionStep:
    selected: np.ndarray  # bool per key: q_hat > mu + tau, decided in exact arithmetic
    tested: np.ndarray  # bool per key (gate open)
    #: float approximation of q_hat per key (NaN where not tested): diagnostics and tests only,
    #: never published and never compared with a threshold
    noisy_count: np.ndarray


class KeySelector:
    """Algorithm 2 for one (query, window), vectorized over the keys of a micro-batch."""

    def __init__(self, plan: PrivacyPlan, noise: NodeNoise, query: str, window_start: int):
        if plan.public_keys:
            raise ValueError(f"query {query}: a plan with public keys has no key selection (docs/privacy.md, \"Public keys\")")
        self.plan = plan
        self.query = query
        self.window_start = int(window_start)
        self.triggers = plan.triggers
        self.mu = plan.key_threshold
        self.release_at = plan.key_threshold + np.asarray(plan.thresholds)  # mu + tau_r, index r-1
        # added to a scan's largest margin: far above the float error of a margin (the guard is
        # public: the plan's thresholds only)
        self._guard = 1e-6 * (1.0 + np.abs(self.release_at).max(initial=0.0) + abs(self.mu))
        # one counter stream per (key, round), fed with users new to the round (sensitivity 1)
        self.counter = counter_for(plan.counter or BINARY_TREE.name, plan.triggers, plan.sigma_key_selection, noise)
        self.noise = noise

    @property
    def state_width(self) -> int:
        return self.counter.state_width

    def new_batch(self, keys: Sequence[str]) -> SelectionBatch:
        batch = SelectionBatch.new(keys, self.state_width)
        batch.cache = self.counter.empty_state(len(batch))
        return batch

    def tree_ids(self, batch: SelectionBatch, idx: np.ndarray | None = None) -> np.ndarray:
        """Ids of each key's current round tree, or of the keys at ``idx``: empty entries among
        them are derived now (and kept in the batch). Keys behind the gate are never walked, so
        their ids are left underived: most keys of a trigger, each a keyed hash of its text."""
        if batch._tree_ids is None:
            batch._tree_ids = np.zeros(len(batch), dtype=TREE_ID_DTYPE)
        missing = np.nonzero(batch._tree_ids == b"")[0] if idx is None else idx[batch._tree_ids[idx] == b""]
        if len(missing):
            batch._tree_ids[missing] = self.noise.tree_ids_for(
                self.query, self.window_start, SELECT_KIND, list(_subset(batch.keys, missing)), batch.round[missing].tolist())
        return batch._tree_ids if idx is None else batch._tree_ids[idx]

    def step(self, batch: SelectionBatch, trigger: int, new_users: np.ndarray) -> SelectionStep:
        """Run trigger ``trigger`` (1..T) for every key in ``batch``; mutates ``batch``.

        ``new_users[k]``: users new to key k's current round in this micro-batch (0 for keys
        loaded only because prediction named this trigger).
        """
        if not 1 <= trigger <= self.triggers:
            raise ValueError(f"trigger {trigger} outside 1..{self.triggers}")
        new_users = np.asarray(new_users, dtype=np.int64)
        leaf = trigger - batch.start + 1
        if (leaf < 1).any() or (leaf <= batch.done).any():
            # validate before touching state: a rejected call must leave the batch as it was
            raise ValueError("trigger is before a key's current round or was already processed")
        batch.count += new_users
        batch.participations += new_users
        tested = batch.participations > self.mu
        idx = np.nonzero(tested)[0]
        selected = np.zeros(len(batch), dtype=bool)
        noisy = np.full(len(batch), np.nan)
        if len(idx):
            ids = self.tree_ids(batch, idx)
            walk = self.counter.walk(ids, batch.done[idx], leaf[idx], batch.cache[idx])
            # q_hat = count + N, compared with mu + tau exactly (dpstream.processor.mechanisms.tree)
            prefix = walk.prefix(np.arange(len(idx)), leaf[idx])
            selected[idx] = prefix.exceeds(batch.count[idx], self.release_at[leaf[idx] - 1])
            noisy[idx] = batch.count[idx] + prefix.approx()
            batch.cache[idx] = walk.state_at(leaf[idx])
            batch.done[idx] = leaf[idx]
        if selected.any():
            self._start_next_round(batch, selected, trigger)
        return SelectionStep(selected, tested, noisy)

    def _start_next_round(self, batch: SelectionBatch, selected: np.ndarray, trigger: int) -> None:
        batch.round[selected] += 1
        batch.start[selected] = trigger + 1
        batch.done[selected] = 0
        batch.count[selected] = 0
        batch.cache[selected] = self.counter.empty_state(int(selected.sum()))
        batch.noise_max[selected] = np.nan
        if batch._tree_ids is not None:
            batch._tree_ids[selected] = b""

    def predict(self, batch: SelectionBatch) -> np.ndarray:
        """Algorithm 4: for each key, the first trigger after its processed leaves at which it
        would be selected if no new data arrived, or 0 if none in this window.

        Uses exactly the noise the future triggers will see (same PRF), so a key that is neither
        in a micro-batch nor predicted for a trigger would not have been selected there.

        Every "would it be selected" is the same exact comparison :meth:`step` makes
        (:meth:`dpstream.processor.mechanisms.tree.NoisePrefix.exceeds`), so the prediction is exactly what the real
        step decides.

        Shortcut, never changing an answer: the round's future noise path does not depend on
        data, so a scan also records an upper bound ``noise_max >= max_{p > r} (N_p - tau_p)``
        (the float maximum plus a guard larger than its rounding error). Later, at a leaf
        r' >= r with count c', ``c' + noise_max <= mu`` proves that no future step releases
        (the max over p > r' is at most the max over p > r), and the scan is skipped. Tail keys,
        whose counts stay far below the threshold, are then scanned once per round instead of
        at every visit.
        """
        n = len(batch)
        out = np.zeros(n, dtype=np.int64)
        last_leaf = self.triggers - batch.start + 1
        # False where noise_max is NaN; the slack covers the rounding of this float sum
        hopeless = batch.count + batch.noise_max <= self.mu - 1e-9 * (1.0 + np.abs(batch.count))
        candidates = np.nonzero((batch.participations > self.mu) & (last_leaf > batch.done) & ~hopeless)[0]
        if not len(candidates):
            return out
        ids = np.zeros(n, dtype=TREE_ID_DTYPE)
        ids[candidates] = self.tree_ids(batch, candidates)
        remaining = (last_leaf - batch.done)[candidates]
        # chunk so that at most PREDICTION_CHUNK future leaves are materialized at once
        cumulative = np.cumsum(remaining)
        lo = 0
        while lo < len(candidates):
            base = cumulative[lo - 1] if lo else 0
            hi = max(int(np.searchsorted(cumulative, base + PREDICTION_CHUNK, side="right")), lo + 1)
            part = candidates[lo:hi]
            walk = self.counter.walk(ids[part], batch.done[part], last_leaf[part], batch.cache[part])
            first_leaf, max_margin = walk.scan(batch.count[part], self.release_at)  # every part scans >= 1 leaf
            hit = first_leaf > 0
            out[part[hit]] = batch.start[part[hit]] + first_leaf[hit] - 1
            batch.noise_max[part] = max_margin + self._guard + self.mu
            lo = hi
        return out
