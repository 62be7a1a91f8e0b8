"""The DP-SQLP pipeline of one query (DP-SQLP sections 3-4): one code path for the local replay
runner, the benchmarks and the Kafka worker's agents.

Stage 1, by user (:meth:`QueryPipeline.bound`): event-time window and trigger of each event,
late and future events refused, contribution bounding (at most C records per user and window,
each with a slot 1..C; values clamped and put on the grid), and for each admitted record its
predecessor among the same user's records for the same key, plus the amendment it makes to a
later micro-batch when it arrived out of event-time order (docs/privacy.md, "Distinct users per
round").

Stage 2, by key: bounded records are appended to the pending micro-batch of their (window,
trigger) (:meth:`QueryPipeline.accumulate`), amendments to the micro-batch they amend; at the
trigger, :meth:`QueryPipeline.fire`

1. loads only the keys in the micro-batch plus the keys the prediction index names for this
   trigger (section 4.3) - never all keys;
2. drops replayed stage-1 output (a (user, slot) pair seen twice in the micro-batch:
   docs/privacy.md, "Failures"), applies the amendments, and counts users new to each key's
   current round (their record's predecessor came before the round started), once per
   (key, user);
3. merges the micro-batch into each key's data buffer and runs key selection (Algorithm 2);
4. releases selected keys' buffers through their perturbation trees (Algorithm 3), exactly
   (docs/privacy.md, "The arithmetic of releases");
5. re-plans when each key must next be looked at: a key that had data is visited again at the
   next trigger (cheap, and most active keys have data again); a key visited without data gets
   the full release prediction (Algorithm 4) and is indexed under its predicted trigger, if any;
6. journals the releases and writes all state, the index and the window's progress in one atomic
   write before anything is published; firing an already fired trigger returns the journal, so
   a (window, key, trigger) is never released twice with different values.

Windows (docs/privacy.md, "Windows and budget"): with a budget ledger a window opens, and is
charged, when the clock reaches its start, data or not (:meth:`QueryPipeline.open_due`); without
one it opens with its first record. A window is pinned to the plan it was opened under.

Micro-batch membership is by event time: an event with time t belongs to trigger
``i = floor((t - window_start) / (window / T)) + 1`` of its window; the trigger fires once the
clock (replay's event-time clock, wall time in the worker: docs/privacy.md, "Time") passes
``window_start + i * window / T + allowed_lateness``. Events for a trigger that has fired are
late and dropped (counted).
"""
from __future__ import annotations

import functools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from dpstream.accountant import pins
from dpstream.accountant.counters import BINARY_TREE
from dpstream.accountant.intervals import CI_FIELD
from dpstream.processor.config import QueryConfig, level_plans_for, parse_duration_ms
from dpstream.processor.engine.public_keys import PublicKeyDomain
from dpstream.processor.mechanisms import kernels
from dpstream.processor.mechanisms.aggregates import aggregate_named
from dpstream.processor.mechanisms.bounding import (
    ContributionBounder,
    first_for_key,
    key_histories,
    within_key_bound,
)
from dpstream.processor.mechanisms.consistency import solve as solve_consistency
from dpstream.processor.mechanisms.counters import counter_for
from dpstream.processor.mechanisms.key_selection import KeySelector, SelectionBatch
from dpstream.processor.mechanisms.noise import TREE_ID_DTYPE, NodeNoise, Pseudonymizer
from dpstream.processor.mechanisms.perturbation import (
    HierarchicalPerturber,
    PerturbationBatch,
)
from dpstream.state.store import Store, WriteBatch
from dpstream.state.tables import (
    AMEND_ENTRY,
    STATE_FORMAT,
    STORED_TREE_ID,
    WINDOW_OPEN,
    WINDOW_REFUSED,
    EpochMarks,
    QueryTables,
    ViewEntry,
    put_rows,
    take_rows,
)
from dpstream.topics.records import (
    encode_json,
    key_for_output,
    key_text,
    release_record,
)

#: initial half-width of a value's domain in the consistency program, in standard deviations of
#: its noise (Fioretto et al. section 11.2 size domains from the noise; the solver widens them
#: whenever the optimum touches a bound, so this only affects speed, never the result)
CONSISTENCY_SPREAD = 3.0


def level_key_texts(text: str, depth: int) -> list[str]:
    """The key of each level 1..depth of a hierarchy for a full key (its prefixes, coarse first)."""
    parts = json.loads(text)
    return [key_text(parts[:level]) for level in range(1, depth)] + [text]


class StateMismatchError(RuntimeError):
    """The state directory was written under another secret, noise label, layout or plan than
    this run's: it is refused, never mixed (docs/privacy.md, "Failures")."""


class PlanChangedError(StateMismatchError):
    """A window still open (or a dynamic query) was opened under other settings than this run's
    (docs/privacy.md, "Windows and budget"); ``changes`` names each one
    (:class:`dpstream.accountant.pins.PinChange`)."""

    def __init__(self, message: str, changes: Sequence = ()):
        super().__init__(message)
        self.changes = list(changes)


def check_noise_epoch(store: Store, noise: NodeNoise) -> None:
    """State written under another noise secret or run label must never be mixed with this one:
    the secret defines the budget epoch, the label the run's noise (docs/privacy.md). Nor may state
    of another layout version be read as this one."""
    marks = EpochMarks(store)
    stored = marks.get()
    if stored is None:
        marks.put(noise.fingerprint, noise.label)
        return
    fingerprint, fmt, label = stored
    if fingerprint != noise.fingerprint:
        raise StateMismatchError("the state directory was written with a different noise secret (another budget epoch); "
                                 "use a new state directory")
    if label != noise.label:
        raise StateMismatchError(f"the state directory was written under another noise label than {noise.label!r}: its "
                                 f"trees carry other noise; use the label it was written with, or a new state directory")
    if fmt != STATE_FORMAT:
        raise StateMismatchError(f"the state directory was written by dpstream state format {fmt.decode()}, this is "
                                 f"format {STATE_FORMAT.decode()}: use a new state directory (a new epoch)")


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def _ordered(releases: list[dict]) -> list[dict]:
    """Releases of one trigger in a fixed order (by key), for byte-identical output."""
    return sorted(releases, key=lambda r: json.dumps(r["key"], ensure_ascii=False))


@dataclass
class EventColumns:
    """Parsed, valid events of one query, in arrival order."""

    users: np.ndarray  # uint64 pseudonyms
    keys: np.ndarray  # object array of group-by key text
    key_ids: np.ndarray  # uint64 pseudonyms of the keys
    values: np.ndarray  # float64
    ts: np.ndarray  # int64 event time (ms)

    def __len__(self) -> int:
        return len(self.ts)


class PackedColumns:
    """Column batches that travel through Kafka (stage 1's output and its by-user events): a
    take and a concat of all columns, and the wire form: fixed-width little-endian columns
    (``_COLUMNS``), then the distinct key ids and the JSON list of their texts."""

    _COLUMNS: tuple = ()

    def take(self, index):
        return type(self)(*(getattr(self, f)[index] for f in self.__dataclass_fields__))

    @classmethod
    def concat(cls, parts: Sequence):
        """The records of ``parts`` one after the other (arrival order kept)."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__))

    def encode(self, texts: bool = True) -> bytes:
        """The wire form (``texts=False``: no key texts, for a store that has them already)."""
        cols = [getattr(self, name).astype(dtype).tobytes() for name, dtype in self._COLUMNS]
        if not texts:
            return b"".join([np.array([len(self), 0], dtype="<u4").tobytes(), *cols, b"[]"])
        uniq, first = np.unique(self.key_ids, return_index=True)
        names = json.dumps([self.keys[j] for j in first.tolist()], ensure_ascii=False).encode()
        head = np.array([len(self), len(uniq)], dtype="<u4").tobytes()
        return b"".join([head, *cols, uniq.astype("<u8").tobytes(), names])

    @classmethod
    def decode_columns(cls, blob: bytes) -> tuple[dict, dict]:
        """The columns of :meth:`encode` as arrays, and {key id: key text}."""
        n, m = np.frombuffer(blob[:8], dtype="<u4").tolist()
        pos, cols = 8, {}
        for name, dtype in cls._COLUMNS + (("uniq", "<u8"),):
            size = np.dtype(dtype).itemsize * (m if name == "uniq" else n)
            cols[name] = np.frombuffer(blob[pos:pos + size], dtype=dtype)
            pos += size
        return cols, dict(zip(cols.pop("uniq").tolist(), json.loads(blob[pos:].decode())))


@dataclass
class BoundedRecords(PackedColumns):
    """Stage 1 output (what the repartition topic carries), in arrival order."""

    window: np.ndarray  # int64 window start
    trigger: np.ndarray  # int64
    key_ids: np.ndarray  # uint64
    keys: np.ndarray  # object (text)
    users: np.ndarray  # uint64
    slots: np.ndarray  # int64, 1..C
    units: np.ndarray  # int64, value on the grid
    previous: np.ndarray  # int64, predecessor trigger: the user's latest earlier record for this key (0: none)
    amend: np.ndarray  # int64, micro-batch whose predecessor this record becomes (0: none; dpstream.processor.mechanisms.bounding)
    levels: np.ndarray  # int64, level of the key (1 = coarsest; always 1 for a flat query)
    roots: np.ndarray  # uint64, id of the key's level-1 prefix (the key itself for a flat query): routes stage 2

    def __len__(self) -> int:
        return len(self.slots)

    _COLUMNS = (("window", "<i8"), ("trigger", "<u4"), ("key_ids", "<u8"), ("users", "<u8"), ("slots", "<u2"), ("units", "<i8"),
                ("previous", "<u4"), ("amend", "<u4"), ("levels", "<u1"), ("roots", "<u8"))

    @classmethod
    def decode(cls, blob: bytes) -> "BoundedRecords":
        cols, texts = cls.decode_columns(blob)
        keys = np.array([texts[k] for k in cols["key_ids"].tolist()], dtype=object)
        return cls(cols["window"].astype(np.int64), cols["trigger"].astype(np.int64), cols["key_ids"].astype(np.uint64), keys,
                   cols["users"].astype(np.uint64), cols["slots"].astype(np.int64), cols["units"].astype(np.int64),
                   cols["previous"].astype(np.int64), cols["amend"].astype(np.int64), cols["levels"].astype(np.int64),
                   cols["roots"].astype(np.uint64))


@dataclass
class RoutedEvents(PackedColumns):
    """Parsed events of one query read on an input partition that does not own their users, on
    their way to the one that does (what a by-user topic carries; docs/operations.md, "Writing
    to the input topic"). Users travel as their pseudonyms, never as ids; each event keeps the
    Kafka timestamp of the record it came from (the clock stage 1 judges it by) and that record's
    position, which its dead letter names."""

    users: np.ndarray  # uint64 pseudonyms
    key_ids: np.ndarray  # uint64
    keys: np.ndarray  # object (text)
    values: np.ndarray  # float64
    ts: np.ndarray  # int64 event time (ms)
    stamps: np.ndarray  # int64 Kafka timestamp of the input record (ms)
    origins: np.ndarray  # int64 input partition (-1, never sent: read where it is bounded)
    offsets: np.ndarray  # int64 input offset (origin -1: its position in the batch read)

    _COLUMNS = (("users", "<u8"), ("key_ids", "<u8"), ("values", "<f8"), ("ts", "<i8"), ("stamps", "<i8"), ("origins", "<u4"),
                ("offsets", "<i8"))

    def __len__(self) -> int:
        return len(self.ts)

    def events(self) -> EventColumns:
        return EventColumns(self.users, self.keys, self.key_ids, self.values, self.ts)

    @classmethod
    def decode(cls, blob: bytes) -> "RoutedEvents":
        cols, texts = cls.decode_columns(blob)
        keys = np.array([texts[k] for k in cols["key_ids"].tolist()], dtype=object)
        return cls(cols["users"].astype(np.uint64), cols["key_ids"].astype(np.uint64), keys, cols["values"].astype(np.float64),
                   cols["ts"].astype(np.int64), cols["stamps"].astype(np.int64), cols["origins"].astype(np.int64),
                   cols["offsets"].astype(np.int64))


@dataclass
class MicroBatch:
    """What stage 2 merges at a trigger: de-duplicated bounded records and new keys' texts."""

    key_ids: np.ndarray
    users: np.ndarray
    previous: np.ndarray  # predecessor trigger, amendments applied
    units: np.ndarray
    texts: dict
    levels: np.ndarray  # per record
    roots: np.ndarray  # per record
    slots: np.ndarray | None = None  # per record (1..C)


@dataclass
class PipelineStats:
    events_in: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    releases: int = 0
    keys_released: set = field(default_factory=set, repr=False)
    keys_loaded: int = 0  # keys loaded by the last fire()
    keys_tracked: int = 0  # key states held in open windows
    accumulated: int = 0  # bounded records appended to pending micro-batches (stage 2 input)
    triggers_fired: int = 0
    consistency_updates: int = 0  # records re-issued only because a key's consistent value changed
    consistency_seconds: float = 0.0  # time spent in the consistency step (hierarchies)


class Schedule:
    """Event-time windows and the fixed trigger schedule of a query (public)."""

    def __init__(self, query: QueryConfig):
        self.window_ms = query.window_ms
        self.triggers = query.triggers
        self.interval = self.window_ms // self.triggers
        self.lateness = parse_duration_ms(query.allowed_lateness, allow_zero=True)
        self.max_skew = parse_duration_ms(query.max_skew)

    def window_of(self, ts):
        return ts - ts % self.window_ms

    def trigger_of(self, ts: np.ndarray, window: np.ndarray) -> np.ndarray:
        return (ts - window) // self.interval + 1

    def trigger_time(self, window, trigger):
        return window + trigger * self.interval

    def fire_time(self, window, trigger):
        return self.trigger_time(window, trigger) + self.lateness

    def is_future(self, ts, clock):
        """An event dated more than ``max_skew`` after the clock: dead-lettered as ``future``
        and never allowed to move any clock (docs/privacy.md, "Time")."""
        return ts > clock + self.max_skew


def _dense_codes(ids: np.ndarray, *small: tuple[np.ndarray, int]) -> np.ndarray:
    """One uint64 per row, equal for two rows exactly when the rows are: ``ids`` (64-bit) by
    their rank among the distinct ids, then each ``(column, width)`` (integers in
    ``[0, width)``) mixed in, the last one lowest (``code % width`` gives it back). At 6 * 10^5
    rows one unstable sort of the ids and one of the codes take about a quarter of
    ``np.lexsort`` over the same columns, whose stable merges compare row by row."""
    ids = np.asarray(ids, dtype=np.uint64)
    n = len(ids)
    if not n:
        return np.zeros(0, dtype=np.uint64)
    order = np.argsort(ids)
    ranked = ids[order]
    step = np.empty(n, dtype=np.uint64)
    step[0] = 0
    step[1:] = ranked[1:] != ranked[:-1]
    code = np.empty(n, dtype=np.uint64)
    code[order] = np.cumsum(step)
    span = int(code[order[-1]]) + 1
    for column, width in small:
        span *= int(width)
        if span >= 1 << 63:
            raise OverflowError("too many distinct rows for one 64-bit code")
        code = code * np.uint64(width) + np.asarray(column, dtype=np.int64).astype(np.uint64)
    return code


def _distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` for an integer array: numpy 2.4's ``unique`` takes about eight times
    as long as its vectorized ``sort`` on 6 * 10^5 64-bit ids."""
    ordered = np.sort(np.asarray(values))
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return ordered[first]


def _has_repeats(codes: np.ndarray) -> bool:
    ordered = np.sort(codes)
    return bool(len(ordered) > 1 and (ordered[1:] == ordered[:-1]).any())


def _colliding(texts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Records whose key id was already taken, in this batch, by another key text (a 64-bit
    pseudonym collision): the first text in arrival order keeps the id, later texts are refused."""
    if not len(ids):
        return np.zeros(0, dtype=bool)
    texts = np.asarray(texts, dtype=object)
    first = kernels.first_occurrences(ids)  # per record, the first record with its id
    later = np.nonzero(first != np.arange(len(ids)))[0]  # a first record owns its id
    collided = np.zeros(len(ids), dtype=bool)
    collided[later] = texts[first[later]] != texts[later]
    return collided


def prepare_noise_tables(query: QueryConfig, noise: NodeNoise) -> None:
    """Build the sampler tables the query's triggers use, for key selection and for each
    column's perturbation at every level: a worker calls this off its event loop at start, so
    that its first trigger does not hold the loop for them (docs/architecture.md, "Noise
    tables"). The tables depend on the plan only, never on data."""
    for plan in level_plans_for(query):
        if not plan.public_keys:  # public keys: no key selection to sample for
            KeySelector(plan, noise, query.name, 0).counter.prepare()
        for c, column in enumerate(aggregate_named(query.aggregate).columns):
            HierarchicalPerturber(plan, noise, query.name, 0, column.name, c).counter.prepare()


class KeyTexts(Sequence):
    """The texts of a trigger's keys, in key order, read only where one is needed.

    A trigger looks at tens of thousands of keys but needs the text of few: those it releases
    and those whose tree id is not cached (a new key or a new round). Reading every text from the
    key-text table cost a tenth of a trigger at 1M users. ``resolve`` maps key ids to their
    texts; views made by :meth:`take` share what was read."""

    __slots__ = ("_ids", "_resolve", "_memo")

    def __init__(self, ids: np.ndarray, resolve: Callable[[np.ndarray], list], memo: Optional[dict] = None):
        self._ids = np.asarray(ids, dtype=np.uint64)
        self._resolve = resolve
        self._memo = {} if memo is None else memo

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return self.texts(np.arange(len(self._ids))[j])
        return self.texts(np.array([j], dtype=np.int64))[0]

    def __iter__(self):
        return iter(self.texts(np.arange(len(self._ids))))

    def take(self, idx) -> "KeyTexts":
        """The texts at positions ``idx``, still unread."""
        return KeyTexts(self._ids[np.asarray(idx, dtype=np.int64)], self._resolve, self._memo)

    def texts(self, idx) -> list:
        """The texts at positions ``idx``, read now (each id once)."""
        ids = self._ids[np.asarray(idx, dtype=np.int64)].tolist()
        memo = self._memo
        missing = [i for i in dict.fromkeys(ids) if i not in memo]
        if missing:
            memo.update(zip(missing, self._resolve(np.asarray(missing, dtype=np.uint64))))
        return [memo[i] for i in ids]


class QueryPipeline:
    def __init__(self, query: QueryConfig, noise: NodeNoise, store: Store, pseudonyms: Optional[Pseudonymizer] = None,
                 index: Optional[int] = None, key_partition: Optional[tuple[int, int]] = None):
        """``index``: the query's position in the config's ``queries`` (a refusal names its
        fields as ``queries[index].field``). ``key_partition``: (partition, partitions) of the
        by-key topic this pipeline's stage 2 holds (a worker's); with public keys it releases the
        declared keys routed there, and all of them without it."""
        self.query = query
        self.index = index
        #: one plan per level (docs/privacy.md, "Post-processing: hierarchical consistency"); a flat query has one level
        self.plans = level_plans_for(query)
        self.plan = self.plans[0]  # shared terms: C, L, grid, mu, the query's (epsilon, delta)
        #: what each window is pinned to (QueryConfig.window_pins: docs/privacy.md, "Windows and budget")
        self.pins = query.window_pins(self.plans)
        self._pins_stored = pins.encode(self.pins)
        self.fingerprint = bytes.fromhex(self.pins[pins.PLAN])
        #: windows whose stored pins are this run's (checked, or written and committed)
        self._pinned: set[int] = set()
        self.hierarchy_depth = query.hierarchy_depth
        if self.hierarchy_depth > 1 and pseudonyms is None:
            raise ValueError(f"query {query.name}: a hierarchy needs the pseudonymizer for its level keys")
        self.pseudonyms = pseudonyms
        #: the declared key domain (docs/privacy.md, "Public keys"): all of it for stage 1's
        #: filter, this stage 2's share for its releases; None: key selection decides
        self.public: Optional[PublicKeyDomain] = None
        self.public_share: Optional[PublicKeyDomain] = None
        if query.public_key_texts is not None:
            if pseudonyms is None:
                raise ValueError(f"query {query.name}: public keys need the pseudonymizer for their key ids")
            self.public = PublicKeyDomain.build(query.public_key_texts, self.hierarchy_depth, level_key_texts, pseudonyms.group_keys)
            self.public_share = self.public if key_partition is None else self.public.share(*key_partition)
            self._public_texts = self.public_share.text_of()
        self.noise = noise
        self.store = store
        self.schedule = Schedule(query)
        self.stats = PipelineStats()
        plan = self.plan
        # every counter of the query (key selection and perturbation) has T steps; its state is
        # what the key rows carry per stream (dpstream.processor.mechanisms.counters). Built at
        # key selection's scale: a tree builds that sampler table now, which selection uses anyway
        counter = counter_for(plan.counter or BINARY_TREE.name, plan.triggers,
                              plan.sigma_key_selection or plan.sigma_perturbation_units, noise)  # public keys: no selection
        self.counter_state_width = counter.state_width
        self.bounder = ContributionBounder(plan.contribution_bound, plan.clamp, plan.resolution)
        #: a per-key bound 1 < c_k < C: stage 1 counts a user's admitted records per key, its user
        #: states a multiset of one entry per admitted record (bounding.within_key_bound); with
        #: c_k = 1 the set of keys suffices, and c_k >= C bounds nothing that C does not
        self._per_key_counts = plan.per_key_bound is not None and 1 < plan.per_key_bound < plan.contribution_bound
        #: key selection's weight by slot (index = slot; slots beyond the declared weights: 0)
        self.selection_weights = None
        if plan.selection_weights is not None:
            self.selection_weights = np.zeros(plan.contribution_bound + 1, dtype=np.int64)
            self.selection_weights[1:1 + len(plan.selection_weights)] = plan.selection_weights
        assert np.dtype(TREE_ID_DTYPE) == STORED_TREE_ID, "key rows store tree ids of dpstream.processor.mechanisms.noise's width"
        self.aggregate = aggregate_named(query.aggregate)
        self.tables = QueryTables(store, query.name, self.counter_state_width, len(self.aggregate.columns))
        blank = np.zeros(1, dtype=self.tables.keys.dtype)  # a key not seen yet in the window
        blank["start"], blank["noise_max"] = 1, np.nan
        for name in blank.dtype.names:  # every counter stream's state before its first step
            if name.startswith(("sel_cache", "pcache")):
                blank[name] = counter.empty_state(1)
        self._blank_row = blank
        #: With a budget ledger, windows open on the public schedule (:meth:`set_schedule`,
        #: :meth:`open_due`): the gate charges a window as the clock reaches it, data or not,
        #: and False refuses it. The pipeline never sees who is charged. Without a ledger a
        #: window opens when its first record arrives (nothing is charged, so nothing
        #: observable depends on when).
        self.window_gate: Optional[Callable[[int], bool]] = None
        self._first_window: Optional[int] = None
        self._next_open: Optional[int] = None
        #: event indices (into the last :meth:`bound` call's events) refused there, with reasons
        self.last_rejected: list[tuple[int, str]] = []
        self._progress: dict[int, int] = {}
        self._status: dict[int, int] = {}
        for window, progress in self.tables.progress.scan().items():
            self._progress[window], self._status[window] = progress.fired, progress.status
            if progress.status == WINDOW_OPEN and progress.fired < self.schedule.triggers:
                self._check_pins(window, progress.fingerprint)
        marked = self.tables.schedule.get()
        if marked is not None:
            self._first_window, self._next_open = marked
        self.tables.load_logs()  # at start (the worker builds its pipelines off its event loop), not in a batch
        self.stats.keys_tracked = sum(self.tables.keys.count(w) for w in self.open_windows())

    # ------------------------------------------------------------------ windows and progress
    def open_windows(self) -> list[int]:
        """Open windows whose last trigger has not fired, in time order."""
        return sorted(w for w, p in self._progress.items() if p < self.schedule.triggers and self._status.get(w) == WINDOW_OPEN)

    def progress(self, window: int) -> int:
        return self._progress.get(int(window), 0)

    def _put_progress(self, batch: WriteBatch, window: int, fired: int, status: int) -> None:
        self._pin(window, batch)
        self.tables.progress.put(batch, window, fired, status, self.fingerprint)

    # ------------------------------------------------------------------ what a window is pinned to
    def _check_pins(self, window: int, fingerprint: Optional[bytes] = None) -> bool:
        """Refuse (:class:`PlanChangedError`, naming each setting) a window that was first used
        under other settings than this run's (docs/privacy.md, "Windows and budget"): one
        window's records are never bounded, keyed or calibrated two ways. ``fingerprint``: the
        window's progress row's plan fingerprint, all that state written before the settings
        were recorded holds. Returns whether the window's settings are recorded."""
        if window in self._pinned:
            return True
        stored = self.tables.pins.get(window)
        if stored is None and fingerprint is None:
            return False
        opened = pins.decode(stored) if stored is not None else {pins.PLAN: bytes(fingerprint).hex()}
        changed = pins.changes(opened, self.pins)
        if changed:
            raise self._window_changed(window, changed)
        if stored is not None:
            self._pinned.add(window)
        return stored is not None

    def _pin(self, window: int, batch: WriteBatch) -> None:
        """A window's first use (stage 1's first records of it, or its opening) records this run's
        settings in ``batch``; a later use under other settings is refused (:meth:`_check_pins`).
        A window open across an upgrade (its progress row checked against the plan only) is
        recorded under this run's settings at its next use."""
        if self._check_pins(window):
            return
        self.tables.pins.put(batch, window, self._pins_stored)
        batch.on_commit(functools.partial(self._pinned.add, window))

    def _window_changed(self, window: int, changed: list) -> PlanChangedError:
        where = None if self.index is None else f"queries[{self.index}]"
        last_fire = self.schedule.fire_time(window, self.schedule.triggers)
        return PlanChangedError(
            f"{pins.field_names(changed, where)}: window {_iso(window)} ({window} ms) of query {self.query.name} is still open "
            f"and was opened with {pins.describe(changed)}: a window never mixes two settings. Keep its settings until its last "
            f"trigger has fired ({_iso(last_fire)}) and no later window is open, or make the change a new query (another "
            f"name) or a new epoch (docs/operator-guide.md, \"Changing a query\")", changed)

    def set_schedule(self, gate: Callable[[int], bool], start_ms: int) -> None:
        """Windows open on the public schedule from the window holding ``start_ms``, each charged
        by ``gate`` as the clock reaches it (:meth:`open_due`). The first start is kept in state:
        a restart continues the same schedule."""
        self.window_gate = gate
        if self._first_window is None:
            self._first_window = self._next_open = int(self.schedule.window_of(int(start_ms)))
            batch = WriteBatch()
            self.tables.schedule.put(batch, self._first_window, self._next_open)
            self.store.write(batch)

    @property
    def first_window(self) -> Optional[int]:
        return self._first_window

    def open_due(self, clock_ms: int) -> list[int]:
        """Open every window whose start the clock has reached, in order, with or without data:
        each is charged (or refused) by the gate now, so what is spent and what is refused
        follow the public schedule only (docs/privacy.md). A refused window's pending records are
        dropped (``budget``). Returns the windows opened."""
        if self.window_gate is None:
            return []
        opened = []
        while self._next_open <= clock_ms:
            window = self._next_open
            batch = WriteBatch()
            if window not in self._status:
                self._pin(window, batch)  # before the charge: a window used under other settings is refused uncharged
            allowed = self.window_gate(window)
            if window not in self._status:
                status = WINDOW_OPEN if allowed else WINDOW_REFUSED
                fired = 0 if allowed else self.schedule.triggers
                self._put_progress(batch, window, fired, status)
                self._progress[window], self._status[window] = fired, status
                opened.append(window)
            self._next_open = window + self.schedule.window_ms
            self.tables.schedule.put(batch, self._first_window, self._next_open)
            self.store.write(batch)
            if self._status[window] == WINDOW_REFUSED:
                self.stats.dropped["budget"] += self._discard_pending(window)
        return opened

    def _discard_pending(self, window: int) -> int:
        """Drop a refused window's pending records; returns how many there were."""
        dropped = self.tables.pending.records_in(window)
        self.tables.drop_window(window)
        return dropped

    def next_fire(self) -> Optional[tuple[int, int, int]]:
        """(fire time, window, trigger) of the earliest trigger still to fire, or None."""
        best = None
        for w in self.open_windows():
            i = self.progress(w) + 1
            t = self.schedule.fire_time(w, i)
            if best is None or t < best[0]:
                best = (t, w, i)
        return best

    # ------------------------------------------------------------------ stage 1
    def bound(self, events: EventColumns, prior_clock: np.ndarray, batch: WriteBatch) -> BoundedRecords:
        """Contribution bounding (section 3.2). ``prior_clock[e]`` is the clock when event e
        arrived: events whose trigger has already fired by then are late and refused; events
        dated beyond it by more than ``max_skew`` are refused as ``future``; records whose key
        id is taken by another key text are refused as a collision. Refused events are listed in
        :attr:`last_rejected` for the caller to dead-letter."""
        n = len(events)
        self.stats.events_in += n
        self.last_rejected = []
        prior_clock = np.asarray(prior_clock, dtype=np.int64)
        future = self.schedule.is_future(events.ts, prior_clock)
        collided = _colliding(events.keys, events.key_ids)
        if future.any() or collided.any():
            for e in np.nonzero(future)[0].tolist():
                self.last_rejected.append((e, f"future: field {self.query.time_field!r} is more than {self.query.max_skew} after "
                                              f"the clock"))
            for e in np.nonzero(collided & ~future)[0].tolist():
                self.last_rejected.append((e, "key id collision: another key text holds this key's 64-bit id"))
            self.stats.dropped["future"] += int(future.sum())
            self.stats.dropped["key_collision"] += int((collided & ~future).sum())
        window = self.schedule.window_of(events.ts)
        trigger = self.schedule.trigger_of(events.ts, window)
        on_time = self.schedule.fire_time(window, trigger) > prior_clock
        late = ~on_time & ~future & ~collided
        if late.any():  # dead-lettered too, not only counted: the sender can see what was lost
            for e in np.nonzero(late)[0].tolist():
                self.last_rejected.append((e, f"late: its trigger had fired (allowed_lateness {self.query.allowed_lateness}) "
                                              f"when it arrived"))
        self.stats.dropped["late"] += int(late.sum())
        idx = np.nonzero(on_time & ~future & ~collided)[0]
        if self.public is not None:
            # before bounding: a user's C slots go to declared keys only (docs/privacy.md, "Public keys")
            declared = self.public.admits(events.key_ids[idx], events.keys[idx])
            self.stats.dropped["not_public_key"] += int(len(idx) - declared.sum())
            idx = idx[declared]
        window, trigger = window[idx], trigger[idx]
        self._pin_windows(window, batch)
        users = events.users[idx]
        units = self.bounder.units(events.values[idx])
        # group by (window, user): one contribution budget per privacy unit
        # (a batch is mostly one window: one sort of the users then; any order within a group will do)
        order = np.argsort(users) if len(window) and window[0] == window[-1] and (window == window[0]).all() else np.lexsort((users, window))
        boundary = np.ones(len(order), dtype=bool)
        boundary[1:] = (window[order][1:] != window[order][:-1]) | (users[order][1:] != users[order][:-1])
        group_of = np.empty(len(order), dtype=np.int64)
        group_of[order] = np.cumsum(boundary) - 1
        firsts = order[boundary]
        gw, gu = window[firsts], users[firsts]  # groups are sorted by (window, user)
        state = self.tables.users.read(gw, gu)
        before = state.admitted
        if self.plan.per_key_bound == 1 or self._per_key_counts:
            # at most c_k records per (user, key): only a user's first c_k records for a key, in
            # arrival order, compete for the user's C slots (docs/privacy.md, "Per-key bound")
            if self.plan.per_key_bound == 1:
                within = first_for_key(group_of, events.key_ids[idx], state.group, state.key)
            else:  # the user's state counts its admitted records per key (one entry each)
                within = within_key_bound(group_of, events.key_ids[idx], state.group, state.key, self.plan.per_key_bound)
            eligible = np.nonzero(within)[0]
            self.stats.dropped["per_key_bound"] += int(len(order) - len(eligible))
            assigned = self.bounder.assign_slots(before, group_of[eligible])
            admitted = np.zeros(len(order), dtype=bool)
            admitted[eligible] = assigned.admitted
            slots = np.zeros(len(order), dtype=np.int64)
            slots[eligible] = assigned.slots
            self.stats.dropped["contribution_bound"] += int(len(eligible) - assigned.admitted.sum())
        else:
            assigned = self.bounder.assign_slots(before, group_of)
            admitted, slots = assigned.admitted, assigned.slots
            self.stats.dropped["contribution_bound"] += int(len(order) - admitted.sum())
        keep = idx[admitted]
        rec_group, rec_trigger = group_of[admitted], trigger[admitted]
        rec_keys, rec_ids, rec_levels, rec_roots = events.keys[keep], events.key_ids[keep], np.ones(len(keep), dtype=np.int64), events.key_ids[keep]
        rec_window, rec_users, rec_slots, rec_units = window[admitted], users[admitted], slots[admitted], units[admitted]
        if self.hierarchy_depth > 1:
            # a hierarchy: each admitted record adds one to one key of every level (the prefixes
            # of its key), record-major; the user's C slots are shared by the levels and stage 2
            # de-duplicates per (user, slot, level)
            texts, ids = self._level_keys(rec_keys)
            d = self.hierarchy_depth
            clash = _colliding(texts.ravel(), ids.ravel()).reshape(len(keep), d).any(axis=1)
            if clash.any():  # a level's key text collides with another's id: refuse the whole record
                for e in keep[clash].tolist():
                    self.last_rejected.append((e, "key id collision: another key text holds this key's 64-bit id"))
                self.stats.dropped["key_collision"] += int(clash.sum())
                ok = ~clash
                keep, texts, ids = keep[ok], texts[ok], ids[ok]
                rec_group, rec_trigger, rec_window, rec_users, rec_slots, rec_units = (
                    a[ok] for a in (rec_group, rec_trigger, rec_window, rec_users, rec_slots, rec_units))
            rec_keys, rec_ids = texts.ravel(), ids.ravel()
            rec_levels = np.tile(np.arange(1, d + 1, dtype=np.int64), len(keep))
            rec_roots = np.repeat(ids[:, 0], d)
            rec_group, rec_trigger, rec_window, rec_users, rec_slots, rec_units = (
                np.repeat(a, d) for a in (rec_group, rec_trigger, rec_window, rec_users, rec_slots, rec_units))
        history = key_histories(rec_group, rec_ids, rec_trigger, state.group, state.key, state.trigger,
                                distinct=not self._per_key_counts, appended=True)  # the state's changelog takes appends
        # a user at the bound admits nothing more: the per-key entries are never needed again
        self.tables.users.write(batch, gw, gu, assigned.counts, assigned.counts != before,
                                assigned.counts >= self.plan.contribution_bound, history.group, history.key, history.trigger,
                                before=state.entries, where=state.where)
        return BoundedRecords(rec_window, rec_trigger, rec_ids, rec_keys, rec_users, rec_slots, rec_units, history.previous,
                              history.amend, rec_levels, rec_roots.astype(np.uint64))

    def _pin_windows(self, windows: np.ndarray, batch: WriteBatch) -> None:
        """Stage 1 uses a window when it bounds records of it: its records must be bounded under
        the settings the window was opened under (:meth:`_pin`). A stage-1 store of the worker
        keeps no window progress, so this is where it refuses. A refused window publishes
        nothing: its settings do not matter."""
        if not len(windows):
            return
        lo, hi = int(windows.min()), int(windows.max())
        for w in ([lo] if lo == hi else _distinct(windows).tolist()):
            if self._status.get(w) != WINDOW_REFUSED:
                self._pin(w, batch)

    def _level_keys(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(texts, ids), each (records, depth): the key of every level for each record's key."""
        distinct, inverse = np.unique(keys.astype(str), return_inverse=True)
        texts = np.array([level_key_texts(k, self.hierarchy_depth) for k in distinct.tolist()], dtype=object).reshape(len(distinct), self.hierarchy_depth)
        ids = self.pseudonyms.group_keys(texts.ravel().tolist()).reshape(len(distinct), self.hierarchy_depth)
        return texts[inverse], ids[inverse]

    # ------------------------------------------------------------------ stage 2 input
    def accumulate(self, records: BoundedRecords, seq: int, batch: WriteBatch) -> list[tuple[str, str]]:
        """Append bounded records to their (window, trigger) pending micro-batch, and their
        predecessor amendments to the micro-batches they amend. ``seq`` must be unique per call
        (e.g. the input offset) so the blob keys do not collide. Returns (key text, reason) of
        records refused because their key's id is held by another key text in the window, for
        the caller to dead-letter."""
        if not len(records):
            return []
        windows, inverse = np.unique(records.window, return_inverse=True)
        fired = np.zeros(len(windows), dtype=np.int64)
        refused = np.zeros(len(windows), dtype=bool)
        early = np.zeros(len(windows), dtype=bool)
        for j, w in enumerate(windows.tolist()):
            status = self._status.get(w)
            if status == WINDOW_REFUSED:
                refused[j] = True
            elif status == WINDOW_OPEN:
                fired[j] = self._progress[w]
            elif self.window_gate is not None:
                # not opened yet: before the schedule's start it never will be (late); after,
                # it opens (and is charged) when the clock reaches it, data or not
                early[j] = self._first_window is None or w < self._first_window
            else:
                # no ledger: nothing is charged, so a window may open with its first record
                self._progress[w], self._status[w] = 0, WINDOW_OPEN
                self._put_progress(batch, w, 0, WINDOW_OPEN)
        self.stats.dropped["budget"] += int(refused[inverse].sum())
        on_time = (records.trigger > fired[inverse]) & ~refused[inverse] & ~early[inverse]
        self.stats.dropped["late"] += int((~on_time & ~refused[inverse]).sum())
        records = records.take(np.nonzero(on_time)[0])
        rejected = []
        if len(records):
            records, rejected = self._register_key_texts(records, batch)
        self.stats.accumulated += len(records)
        if not len(records):
            return rejected
        groups = np.lexsort((records.trigger, records.window))
        wt = np.stack([records.window[groups], records.trigger[groups]], axis=1)
        cut = np.nonzero(np.any(wt[1:] != wt[:-1], axis=1))[0] + 1
        for part in np.split(groups, cut):
            if not len(part):
                continue
            w, i = int(records.window[part[0]]), int(records.trigger[part[0]])
            # no key texts: _register_key_texts put every one in the key-text table in this batch
            self.tables.pending.append(batch, w, i, seq, (records if len(part) == len(records) else records.take(part)).encode(texts=False))
        # amendments: an out-of-order arrival becomes the predecessor of a later micro-batch's record
        # (dpstream.processor.mechanisms.bounding.key_histories); that micro-batch has not fired (triggers fire in order)
        amending = np.nonzero(records.amend > 0)[0]
        if len(amending):
            entries = np.empty(len(amending), dtype=AMEND_ENTRY)
            entries["key"], entries["user"], entries["trigger"] = records.key_ids[amending], records.users[amending], records.trigger[amending]
            aw, at = records.window[amending], records.amend[amending]
            order = np.lexsort((at, aw))
            cut = np.nonzero((aw[order][1:] != aw[order][:-1]) | (at[order][1:] != at[order][:-1]))[0] + 1
            for part in np.split(order, cut):
                if len(part):
                    self.tables.amends.append(batch, int(aw[part[0]]), int(at[part[0]]), seq, entries[part])
        return rejected

    def _register_key_texts(self, records: BoundedRecords, batch: WriteBatch) -> tuple[BoundedRecords, list[tuple[str, str]]]:
        """The first text seen in a window under a key id owns the id; records of another text
        under the same id (a 64-bit pseudonym collision) are refused, never merged with it."""
        owner_of = np.empty(len(records), dtype=object)  # per record: the text owning its key id
        windows = np.unique(records.window)
        for w in windows.tolist():
            at = np.nonzero(records.window == w)[0] if len(windows) > 1 else np.arange(len(records))
            # distinct ids of the window (a uint64 sort: far cheaper than a structured one)
            distinct, first, inverse = np.unique(records.key_ids[at], return_index=True, return_inverse=True)
            ids = distinct.tolist()
            texts = records.keys[at[first]]
            known = self.tables.names.owners(w, ids, batch)
            new = [j for j, owner in enumerate(known) if owner is None]
            if new:  # first seen here: the text owns the id
                self.tables.names.register(batch, w, [ids[j] for j in new], [texts[j] for j in new])
                for j in new:
                    known[j] = texts[j]
            owners = np.empty(len(ids), dtype=object)
            owners[:] = known
            owner_of[at] = owners[inverse.ravel()]
        bad = np.asarray(owner_of != records.keys, dtype=bool)
        if not bad.any():
            return records, []
        reason = "key id collision: another key text holds this key's 64-bit id in the window"
        self.stats.dropped["key_collision"] += int(bad.sum())
        rejected = [(t, reason) for t in records.keys[bad].tolist()]
        return records.take(np.nonzero(~bad)[0]), rejected

    # ------------------------------------------------------------------ publication
    def mark_published(self, window: int, trigger: int, batch: WriteBatch) -> None:
        """Record that a trigger's journaled releases reached the output (after they did)."""
        self.tables.published.put(batch, window, trigger)

    def unpublished(self) -> list[tuple[int, int, list[dict]]]:
        """(window, trigger, journaled releases) fired but not yet marked published, in order:
        after a crash these are republished from the journal, never recomputed (docs/privacy.md, "Failures")."""
        out = []
        for window, fired in sorted(self._progress.items()):
            if self._status.get(window) != WINDOW_OPEN:
                continue
            published = self.tables.published.get(window)
            out += [(window, trigger, self.journaled(window, trigger)) for trigger in range(published + 1, fired + 1)]
        return out

    # ------------------------------------------------------------------ stage 2 at a trigger
    def journaled(self, window: int, trigger: int) -> list[dict]:
        return _ordered([json.loads(v) for v in self.tables.journal.read(window, trigger)])

    def fire(self, window: int, trigger: int) -> list[dict]:
        """Run trigger ``trigger`` of ``window``; returns its releases (journaled before return)."""
        window, trigger = int(window), int(trigger)
        if self._status.get(window) != WINDOW_OPEN:
            raise ValueError(f"window {window} of query {self.query.name} is not open")
        done = self.progress(window)
        if trigger <= done:
            return self.journaled(window, trigger)
        if trigger != done + 1:
            raise ValueError(f"trigger {trigger} of window {window} fired out of order (last fired: {done})")
        batch = WriteBatch()
        micro = self._take_pending(window, trigger, batch)
        rec_key, rec_prev, rec_units, texts = micro.key_ids, micro.previous, micro.units, micro.texts
        # --- keys: micro-batch + prediction index for this trigger (never all keys); with public
        # keys, every declared key of this stage 2 at every trigger
        visit = self.tables.predictions.take(window, trigger, batch) if self.public_share is None else self.public_share.ids
        all_ids = _distinct(np.concatenate([rec_key, visit]))
        if self.public_share is not None:
            texts = {**self._public_texts, **texts}
        n = len(all_ids)
        self.stats.keys_loaded = n
        kidx = np.searchsorted(all_ids, rec_key)
        has_data = np.zeros(n, dtype=bool)
        has_data[kidx] = True
        rows, names = self._load_keys(window, all_ids, texts)
        fresh = rows["level"] == 0  # new keys: level and root come with their records
        if fresh.any():
            level_of, root_of = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64)
            if self.public_share is not None:  # a declared key without records yet
                level_of, root_of = self.public_share.level_and_root(all_ids)
            level_of[kidx], root_of[kidx] = micro.levels, micro.roots
            rows["level"][fresh], rows["root"][fresh] = level_of[fresh], root_of[fresh]
        # --- merge the micro-batch: users new to each key's round (the record before theirs in
        # (trigger, arrival) order came before the round started: dpstream.processor.mechanisms.bounding), counted
        # once per (key, user) however many records they have here; buffered aggregate
        delta_units = np.zeros(n, dtype=np.int64)
        np.add.at(delta_units, kidx, rec_units)
        new = np.nonzero(rec_prev < rows["start"][kidx])[0]
        # distinct (user, key) pairs among them, counted per key: the key is the code's low part
        if self.selection_weights is None:
            pairs = _distinct(_dense_codes(micro.users[new], (kidx[new], n)))
            new_users = np.bincount((pairs % np.uint64(n)).astype(np.int64), minlength=n).astype(np.int64)
        else:
            # weighted key selection (per_key_bound 1: a user's records have distinct keys and
            # distinct slots): the first record of each (user, key) adds the weight of its slot
            # (docs/privacy.md, "Weighted key selection")
            _, first = np.unique(_dense_codes(micro.users[new], (kidx[new], n)), return_index=True)
            chosen = new[first]
            new_users = np.bincount(kidx[chosen], weights=self.selection_weights[micro.slots[chosen]], minlength=n).astype(np.int64)
        rows["buffer"] += delta_units if self.aggregate.columns[0].needs_value else np.bincount(kidx, minlength=n)
        for c, column in enumerate(self.aggregate.columns[1:], 2):
            rows[f"buffer_{c}"] += delta_units if column.needs_value else np.bincount(kidx, minlength=n)
        # --- key selection, perturbation and visit planning, each level with its own plan
        released: list[tuple[int, int, dict]] = []
        levels = _distinct(rows["level"]).tolist()
        if len(levels) == 1:  # a flat query (or one level only): no per-level copies on the hot path
            released += self._fire_level(self.plans[levels[0] - 1], window, trigger, all_ids, rows, names, has_data, new_users, batch)
        else:
            for level in levels:
                idx = np.nonzero(rows["level"] == level)[0]
                sub = take_rows(rows, idx)
                released += self._fire_level(self.plans[level - 1], window, trigger, all_ids[idx], sub, names.take(idx),
                                             has_data[idx], new_users[idx], batch)
                put_rows(rows, idx, sub)
        if self.hierarchy_depth > 1 and released:
            started = time.perf_counter()
            released = self._consistent(window, trigger, released, batch)
            self.stats.consistency_seconds += time.perf_counter() - started
        for key_id, _, record in released:
            self.tables.journal.put(batch, window, trigger, key_id, encode_json(record))
        releases = [record for _, _, record in released]
        # --- key states, journal and progress: one atomic write
        self.tables.keys.write(batch, window, all_ids, rows)
        self._put_progress(batch, window, trigger, WINDOW_OPEN)
        self.store.write(batch)
        self._progress[window] = trigger
        self.stats.triggers_fired += 1
        if trigger == self.schedule.triggers:
            self.collect_window(window)
        return _ordered(releases)

    def _fire_level(self, plan, window, trigger, ids, rows, names, has_data, new_users, batch) -> list[tuple[int, int, dict]]:
        """Key selection (Algorithm 2), perturbation (Algorithm 3) and the next visit (Algorithm 4)
        for the keys of one level; mutates ``rows``. Returns (key id, root id, release record) triples.
        With public keys every key is released, with no selection and no visits to plan."""
        if self.public_share is not None:
            return self._release(plan, window, trigger, ids, rows, names, np.ones(len(ids), dtype=bool))
        selector = KeySelector(plan, self.noise, self.query.name, window)
        # tree ids cached in the rows; the selector derives missing ones (a new key, a new round)
        # for the keys it walks, and they are stored with the rows
        sel = SelectionBatch(names, rows["round"].astype(np.int64), rows["start"].astype(np.int64), rows["done"].astype(np.int64),
                             rows["count"].copy(), rows["participations"].copy(), rows["sel_cache"].copy(),
                             rows["sel_tree"].copy(), rows["noise_max"].copy())
        step = selector.step(sel, trigger, new_users)
        selected = step.selected
        releases = self._release(plan, window, trigger, ids, rows, names, selected) if selected.any() else []
        for f in ("round", "start", "done", "count", "participations"):
            rows[f] = getattr(sel, f)
        rows["sel_cache"] = sel.cache
        self._plan_visits(window, trigger, ids, rows, has_data, selector, sel, batch)
        rows["noise_max"] = sel.noise_max  # prediction may have learnt it
        rows["sel_tree"] = sel.tree_ids_known  # a new round's is empty until first derived
        return releases

    def _take_pending(self, window: int, trigger: int, batch: WriteBatch) -> "MicroBatch":
        """The trigger's micro-batch, with replayed stage-1 output removed.

        Stage 1 gives each admitted record a (user, slot), and a replayed copy carries the same
        pair and the same event time, hence lands in this same bucket: keeping the first record
        per (user, slot) here is the de-duplication of docs/privacy.md ("Failures"). The
        predecessor amendments addressed to this micro-batch are applied here (a maximum, so a
        replayed amendment changes nothing).
        """
        parts, texts = [], {}
        amend = self.tables.amends.take(window, trigger, batch)
        columns = ("key_ids", "users", "slots", "units", "previous", "levels", "roots")
        for blob in self.tables.pending.take(window, trigger, batch):
            cols, key_texts = BoundedRecords.decode_columns(blob)
            parts.append([cols[c] for c in columns])
            texts.update(key_texts)
        if not parts:
            empty, none = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
            return MicroBatch(none, none, empty, empty, texts, empty, none, empty)
        rec_key, rec_user, rec_slot, rec_units, rec_prev, rec_level, rec_root = (np.concatenate([p[c] for p in parts])
                                                                                  for c in range(len(columns)))
        # one record per (user, slot) and level: every level of a hierarchy gets each admitted
        # record once; the first copy in arrival order is kept (repeats are rare: check first)
        codes = _dense_codes(rec_user, (rec_slot, int(rec_slot.max()) + 1), (rec_level, int(rec_level.max()) + 1))
        if _has_repeats(codes):
            _, first = np.unique(codes, return_index=True)  # the first occurrence of each
            keep = np.sort(first)
        else:
            keep = np.arange(len(codes))
        self.stats.dropped["duplicate"] += int(len(rec_user) - len(keep))
        rec_key, rec_user, rec_prev = rec_key[keep].astype(np.uint64), rec_user[keep].astype(np.uint64), rec_prev[keep].astype(np.int64)
        if len(amend):
            pairs = np.empty(len(rec_key) + len(amend), dtype=[("k", "<u8"), ("u", "<u8")])
            pairs["k"] = np.concatenate([rec_key, amend["key"]])
            pairs["u"] = np.concatenate([rec_user, amend["user"]])
            _, inverse = np.unique(pairs, return_inverse=True)
            inverse = inverse.ravel()
            raised = np.zeros(int(inverse.max()) + 1, dtype=np.int64)
            np.maximum.at(raised, inverse[len(rec_key):], amend["trigger"].astype(np.int64))
            rec_prev = np.maximum(rec_prev, raised[inverse[:len(rec_key)]])
        return MicroBatch(rec_key, rec_user, rec_prev, rec_units[keep].astype(np.int64), texts, rec_level[keep].astype(np.int64),
                          rec_root[keep].astype(np.uint64), rec_slot[keep].astype(np.int64))

    def _release(self, plan, window, trigger, all_ids, rows, names, selected) -> list[tuple[int, int, dict]]:
        sidx = np.nonzero(selected)[0]
        sub = take_rows(rows, sidx)
        sel_names = names.texts(sidx)
        values, stddevs, intervals = {}, {}, {}
        done = sub["pdone"].astype(np.int64)
        # one perturbation tree per aggregate column (all released at the same triggers)
        for c, column in enumerate(self.aggregate.columns, 1):
            suffix = "" if c == 1 else f"_{c}"
            perturber = HierarchicalPerturber(plan, self.noise, self.query.name, window, column.name, c - 1)
            pb = PerturbationBatch(sel_names, sub["released" + suffix].copy(), done.copy(), sub["pcache" + suffix].copy(),
                                   self._tree_ids(window, sub, "pert_tree" + suffix, sel_names, perturber.kind))
            rows["pert_tree" + suffix][sidx] = sub["pert_tree" + suffix]
            units = perturber.release_units(pb, trigger, rows["buffer" + suffix][sidx])  # exact: whole grid steps
            values[column.name] = perturber.publish(units)
            # public functions of the step, which released keys mostly share: each step once
            steps, at = np.unique(pb.done, return_inverse=True)
            stddev = [perturber.stddev(int(step)) for step in steps.tolist()]
            stddevs[column.name] = [stddev[j] for j in at.ravel().tolist()]
            # the confidence interval: the noisy value +- a public half-width, on the same grid
            half = np.array([perturber.halfwidth_units(int(step)) for step in steps.tolist()], dtype=np.int64)[at.ravel()]
            intervals[column.name] = list(zip(perturber.publish(units - half), perturber.publish(units + half)))
            rows["released" + suffix][sidx] = pb.released_units
            rows["pcache" + suffix][sidx] = pb.cache
            rows["buffer" + suffix][sidx] = 0
        rows["pdone"][sidx] = pb.done  # every column steps alike
        releases = []
        for i, j in enumerate(sidx.tolist()):
            fields = self.aggregate.release_fields({name: v[i] for name, v in values.items()}, {name: v[i] for name, v in stddevs.items()},
                                                   {name: v[i] for name, v in intervals.items()})
            record = release_record(
                query=self.query.name, window_start=window, window_end=window + self.schedule.window_ms, trigger=trigger,
                trigger_time=self.schedule.trigger_time(window, trigger), key=key_for_output(sel_names[i], self.query.key_fields),
                fields=fields, epsilon=plan.epsilon, delta=plan.delta,
            )
            if self.hierarchy_depth > 1:
                record["level"] = plan.level
            releases.append((int(all_ids[j]), int(rows["root"][j]), record))
        self.stats.releases += len(sidx)
        self.stats.keys_released.update((self.query.name, window, name) for name in sel_names)
        return releases

    def _consistent(self, window: int, trigger: int, released: list, batch: WriteBatch) -> list[tuple[int, int, dict]]:
        """Consistent, non-negative integer counts for the published view of a hierarchy
        (docs/privacy.md, "Post-processing: hierarchical consistency"; Fioretto, Van Hentenryck and Zhu, sections 6-7).

        The view is every key of the window released so far at its latest noisy count (a
        compacted output topic holds exactly that). Only subtrees (level-1 roots) with a release
        at this trigger can change. Their released keys form a forest (a key's parent is its
        nearest released ancestor: an unreleased key in between is unknown, so it only adds to
        the ancestor's remainder), and :func:`dpstream.processor.mechanisms.consistency.solve` finds the
        non-negative integers closest to the noisy counts in L2, weighted by each count's inverse
        variance (the paper's plain L2 when all variances are equal), such that every released
        parent is at least the sum of its released descendants. Each record then carries
        ``consistent_count`` and, below the finest level, ``consistent_other``: the part of the
        parent not in its released children (children not, or not yet, released). With public
        keys every parent is closed: it equals the sum of its children, and its other is 0.

        Post-processing of released values and public parameters only: no budget (the paper's
        Lemma 3). Keys released now get the consistent fields on their records; keys released
        earlier whose consistent values changed are re-issued with their unchanged noisy count
        (``released_at`` says when it was released), so the latest record of every key is
        consistent once a trigger's records are all read. Written with the trigger's state.
        A re-issued record repeats the confidence interval of its noisy count; the consistent
        values have none of their own (docs/privacy.md, "Error bars").
        """
        entries: dict[int, dict] = {}
        for root in sorted({root for _, root, _ in released}):
            for v in self.tables.view.read(window, root):
                entries[v.key_id] = {"root": root, "level": v.level, "released_at": v.released_at, "count": v.count, "stddev": v.stddev,
                                     "consistent": v.consistent, "other": v.other, "parts": json.loads(v.text)}
        now = {}
        for key_id, root, record in released:
            old = entries.get(key_id, {"consistent": -1, "other": -1})
            entries[key_id] = {"root": root, "level": record["level"], "released_at": trigger, "count": record["count"],
                               "stddev": record["stddev"], "consistent": old["consistent"], "other": old["other"], "parts": record["key"]}
            now[key_id] = record
        ids = sorted(entries)
        nodes = [entries[k] for k in ids]
        index = {key_text(e["parts"]): i for i, e in enumerate(nodes)}
        parent = np.full(len(nodes), -1, dtype=np.int64)
        direct = np.full(len(nodes), -1, dtype=np.int64)
        for i, e in enumerate(nodes):
            for up in range(len(e["parts"]) - 1, 0, -1):
                j = index.get(key_text(e["parts"][:up]))
                if j is not None:
                    parent[i] = j
                    if up == len(e["parts"]) - 1:
                        direct[i] = j
                    break
        noisy = np.array([e["count"] for e in nodes], dtype=np.float64)
        stddev = np.array([e["stddev"] for e in nodes])
        # a public domain closes every parent: its records are exactly its declared children's
        # (records of other keys are dropped), all released at every trigger, so parent = sum of
        # children, with no remainder (docs/privacy.md, "Public keys")
        solution = solve_consistency(parent, noisy, weight=1.0 / stddev ** 2, spread=CONSISTENCY_SPREAD * stddev,
                                     open=np.full(len(nodes), self.public_share is None))
        values = solution.values
        in_children = np.zeros(len(nodes), dtype=np.int64)
        has_parent = direct >= 0
        np.add.at(in_children, direct[has_parent], values[has_parent])
        other = values - in_children
        out = []
        for i, (key_id, e) in enumerate(zip(ids, nodes)):
            value, rest = int(values[i]), int(other[i])
            record = now.get(key_id)
            if record is None:
                if (value, rest) == (e["consistent"], e["other"]):
                    continue
                record = release_record(
                    query=self.query.name, window_start=window, window_end=window + self.schedule.window_ms, trigger=trigger,
                    trigger_time=self.schedule.trigger_time(window, trigger), key=e["parts"],
                    fields={"count": e["count"], "stddev": e["stddev"], **self._journaled_interval(window, e["released_at"], key_id)},
                    epsilon=self.plan.epsilon, delta=self.plan.delta)
                record["level"] = e["level"]
                self.stats.consistency_updates += 1
            record["released_at"] = e["released_at"]
            record["consistent_count"] = value
            if e["level"] < self.hierarchy_depth:
                record["consistent_other"] = rest
            out.append((key_id, e["root"], record))
            self.tables.view.put(batch, window, int(e["root"]), ViewEntry(key_id, e["level"], e["released_at"], e["count"], e["stddev"],
                                                                         value, rest, key_text(e["parts"])))
        return out

    def _journaled_interval(self, window: int, released_at: int, key_id: int) -> dict:
        """The confidence interval a re-issued record's noisy count was released with: the same
        count has the same interval (docs/privacy.md, "Error bars"). Read from the journal of its
        release (a journal written before intervals existed has none: then none is carried)."""
        raw = self.tables.journal.get(window, released_at, key_id)
        if raw is None:
            return {}
        original = json.loads(raw)
        return {name: original[name] for name in (f"{CI_FIELD}_low", f"{CI_FIELD}_high") if name in original}

    def _tree_ids(self, window: int, rows: np.ndarray, field_name: str, names: list, kind: str) -> np.ndarray:
        """Tree ids cached in the key rows; missing ones (new key or new round) derived and stored."""
        ids = rows[field_name]
        missing = np.nonzero(ids == b"")[0]
        if len(missing):
            rounds = rows["round"][missing].tolist() if kind == "select" else [0] * len(missing)
            texts = names.texts(missing) if isinstance(names, KeyTexts) else [names[j] for j in missing]
            ids[missing] = self.noise.tree_ids_for(self.query.name, window, kind, texts, rounds)
        return ids.copy()

    def _load_keys(self, window: int, ids: np.ndarray, texts: dict) -> tuple[np.ndarray, KeyTexts]:
        """Key states (fixed rows) and key texts (read when needed); new keys get a fresh row.
        Every key's text was registered by :meth:`accumulate` in the batch that wrote its records
        (``texts``: those a pending blob carried, if any)."""
        rows, stored = self.tables.keys.load(window, ids, self._blank_row)
        self.stats.keys_tracked += int(len(stored) - stored.sum())

        def resolve(some: np.ndarray) -> list:
            owners = self.tables.names.owners(window, some.tolist())
            return [texts[i] if name is None else name for i, name in zip(some.tolist(), owners)]
        return rows, KeyTexts(ids, resolve)

    def _plan_visits(self, window, trigger, all_ids, rows, has_data, selector, sel, batch) -> None:
        """Prediction-index entries of these keys (their own level's selector)."""
        T = self.schedule.triggers
        old = rows["predicted"].astype(np.int64)
        nxt = np.zeros(len(all_ids), dtype=np.int64)
        if trigger < T:
            open_gate = sel.participations > self.plan.key_threshold
            # keys with data now: look again at the next trigger (they usually have data again)
            nxt[has_data & open_gate] = trigger + 1
            # keys looked at without data: full release prediction (Algorithm 4)
            idle = np.nonzero(~has_data & open_gate)[0]
            if len(idle):
                sub = sel.take(idle)
                nxt[idle] = selector.predict(sub)
                sel.noise_max[idle] = sub.noise_max
                sel.tree_ids_known[idle] = sub.tree_ids_known
        self.tables.predictions.move(batch, window, all_ids, old, nxt, trigger)
        rows["predicted"] = nxt

    def collect_window(self, window: int) -> None:
        """Drop a finished window's working state (the journal and progress stay)."""
        self.stats.keys_tracked -= self.tables.keys.count(window)
        self.tables.drop_window(window)
