"""A dynamic query over a stream of update records, with its state in a store: shared by
``dpstream replay`` and the Kafka worker's dynamic agent (docs/privacy.md, "Dynamic counts",
"Time" and "Failures").

Per record (:meth:`DynamicQueryState.apply`): validate it (item in the declared domain, op, a
time that is not before an already decided tick and not more than ``max_skew`` after the clock
it arrives at), bound the privacy unit's updates when the query has a ``unit_field``, and append
the update to the query's *update log* in the store. Nothing is decided yet.

Ticks are decided on the clock, not on data (docs/privacy.md, "Time"):
:meth:`DynamicQueryState.advance_clock` decides every tick whose end (plus ``allowed_lateness``)
the clock has passed, with or without updates - the worker's timer calls it with the wall clock,
replay with its event-time clock and, at the end, its public ``--until``. The logged updates of
those ticks are fed to :class:`dpstream.processor.mechanisms.dynamic.DynamicCounter` in (tick, arrival) order, so the
order in which updates of undecided ticks arrived does not matter, and whether a segment's
release exists never reveals whether later updates exist. Every logged update is fed, a delete of
an item that is not present included: whether an update is taken in never depends on other
updates (docs/privacy.md, "Dynamic counts"), so no update is refused when its tick is decided.

Recovery: the counter is a deterministic function of the logged updates, the ticks decided and
the secret (all noise is a keyed PRF of its position), so its state is not stored: on start the
updates of the decided ticks are fed again in (tick, arrival) order and the decided ticks are
decided again; the others wait for the clock. Releases are published after the write that
logged their updates; ``published`` (in the same store) names the last release that reached the
output (its :attr:`DynamicRelease.sequence`: the segment with one shard), and the releases the
recovery recomputes past it are sent again - the same values, since the same updates meet the
same noise.

An update topic of several partitions (docs/privacy.md, "Partitions"): an :class:`UpdateRouter`
on each partition judges each record on itself and sends its updates, as :class:`RoutedUpdates`
with a sequence number of where they were read (:func:`routed_seq`), to their shard's state: a
:class:`DynamicQueryState` with a ``shard``, which logs them with :meth:`DynamicQueryState.take_routed`
and feeds each tick in sequence order, so in the topic's order, whatever order they arrived in.
With a ``unit_field`` a unit step sits between them (docs/privacy.md, "Partitions", "A unit
across partitions"): the router sends each update with its unit's pseudonym to the
:class:`UnitBounder` of that unit, which applies the bound once every input partition has passed
a tick, to that tick's updates in sequence order, and sends the admitted ones on to the shards.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from dpstream.accountant import pins
from dpstream.accountant.intervals import CI_FIELD, discrete_laplace_sum_halfwidth
from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.pipeline import PackedColumns, PlanChangedError
from dpstream.processor.mechanisms.dynamic import DynamicRelease, ShardedCounter
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import Store, WriteBatch
from dpstream.state.tables import DynamicTables, UnitStepTables
from dpstream.topics.records import ChangeEventParser, InvalidRecord, Update, UpdateColumns, UpdateParser, iso_utc

OPS = {"insert": 1, "delete": 2}
OP_NAMES = {1: "insert", 2: "delete"}

#: a routed update's sequence number packs where it was read: (input partition, offset, index of
#: the update within its record), in 16, 45 and 2 bits; ticks are fed in this order, so the
#: order of a tick's updates is the topic's, whatever order they reached the shard in
SEQ_OFFSET_BITS, SEQ_SUB_BITS, SEQ_PARTITION_BITS = 45, 2, 16


def routed_seq(partition: int, offset: int, sub: int) -> int:
    """The sequence number of update ``sub`` of the record at ``offset`` of input ``partition``."""
    return (int(partition) << (SEQ_OFFSET_BITS + SEQ_SUB_BITS)) | (int(offset) << SEQ_SUB_BITS) | int(sub)


@dataclass
class RoutedUpdates(PackedColumns):
    """Updates of one dynamic query on their way from the input partition they were read on to
    the partition of the query's by-item topic that runs their shard (docs/user-guide.md,
    "Partitions"): checked already (valid, on time, not future), items as indices, no unit ids."""

    ticks: np.ndarray  # int64
    items: np.ndarray  # int64 index into the query's items
    ops: np.ndarray  # int64 op code (OPS)
    seqs: np.ndarray  # int64 routed_seq

    _COLUMNS = (("ticks", "<i8"), ("items", "<u4"), ("ops", "<u1"), ("seqs", "<i8"))

    def __len__(self) -> int:
        return len(self.ticks)

    def encode(self, texts: bool = False) -> bytes:
        return super().encode(texts=False)  # no key texts: items travel as indices

    @classmethod
    def decode(cls, blob: bytes) -> "RoutedUpdates":
        cols, _ = cls.decode_columns(blob)
        return cls(*(cols[name].astype(np.int64) for name, _ in cls._COLUMNS))


@dataclass
class UnitRoutedUpdates(RoutedUpdates):
    """Updates on their way from an input partition to the unit step of their privacy unit
    (:class:`UnitBounder`): :class:`RoutedUpdates` with the unit's keyed pseudonym (never its id)."""

    units: np.ndarray  # uint64 keyed pseudonym of the update's unit (Pseudonymizer.users)

    _COLUMNS = RoutedUpdates._COLUMNS + (("units", "<u8"),)

    @classmethod
    def decode(cls, blob: bytes) -> "UnitRoutedUpdates":
        cols, _ = cls.decode_columns(blob)
        return cls(*(cols[name].astype(np.int64) for name, _ in RoutedUpdates._COLUMNS), cols["units"].astype(np.uint64))


def unit_step_partitions(query: DynamicQueryConfig) -> int:
    """How many partitions a dynamic query's unit step runs on (its by-unit topic's): one per
    shard. A unit's updates go to partition ``pseudonym % unit_step_partitions``."""
    return query.shards


def pin_dynamic_plan(query: DynamicQueryConfig, tables: DynamicTables, index: Optional[int]) -> None:
    """The state holds counters (or a unit step's counts) built under one set of settings
    (budget, items, ticks, the privacy unit, the fields read: DynamicQueryConfig.pins);
    resuming them under others would recompute released nodes under another noise scale from the
    same uniforms, or count other data in them (docs/privacy.md, "Windows and budget"): refused,
    naming each setting. State written before the settings were recorded holds the plan
    fingerprint only: checked against it, then recorded under this run's settings."""
    mine = query.pins()
    stored = tables.pinned_plan()
    if stored is not None:
        changed = pins.changes(pins.decode(stored), mine)
        if changed:
            where = None if index is None else f"dynamic[{index}]"
            raise PlanChangedError(f"{pins.field_names(changed, where)}: dynamic query {query.name!r} was started with "
                                   f"{pins.describe(changed)}: it must finish on the settings it was started with; use a "
                                   f"new name or a new state directory (a new epoch) for the new settings", changed)
    if stored is None or stored[:1] != b"{":
        tables.pin_plan(pins.encode(mine))


class UpdateRouter:
    """The first step of a dynamic query on an update topic of several partitions, on each input
    partition (docs/user-guide.md, "Partitions"; docs/privacy.md, "Partitions"): parse each
    record, refuse the invalid, the late and the future ones, and send each update to the shard
    of its item. Every judgement is the record's own: late when the watermark its own Kafka
    timestamp makes (less the watermark delay) has passed its tick's decision time, future when
    its time is more than ``max_skew`` after that timestamp. So which updates go on never depends
    on when the worker read them, nor on other partitions."""

    def __init__(self, query: DynamicQueryConfig, partition: int, watermark_delay_ms: int, index: Optional[int] = None,
                 pseudonyms: Optional[Pseudonymizer] = None):
        """``pseudonyms``: with a ``unit_field``, each update goes with its unit's pseudonym to
        the unit step of that unit (:class:`UnitBounder`) instead of to its shard."""
        if query.unit_field is not None and pseudonyms is None:
            raise ValueError(f"dynamic query {query.name!r} has a unit_field: its router needs the pseudonymizer")
        self.pseudonyms = pseudonyms if query.unit_field is not None else None
        self.query = query
        self.partition = int(partition)
        self.delay_ms = int(watermark_delay_ms)
        self.index = index
        self.parser = ChangeEventParser(query, query.items) if query.envelope == "debezium" else UpdateParser(query, query.items)
        self.item_index = {item: i for i, item in enumerate(query.items)}
        self.dropped: Counter = Counter()
        self.refused = False  # the budget ledger refused this query: its updates go nowhere
        self.updates_in = 0

    def route(self, objs: Sequence[Union[dict, InvalidRecord]], stamps: Sequence[int], offsets: Sequence[int]
              ) -> tuple[dict[int, RoutedUpdates], list[Optional[str]]]:
        """The updates of decoded records (``stamps``: their Kafka timestamps, ``offsets``: their
        offsets), by shard (with a ``unit_field``: as :class:`UnitRoutedUpdates`, by partition of
        the unit step); and each record's refusal (None: routed, or dropped without a dead
        letter)."""
        q = self.query
        self.updates_in += len(objs)
        reasons: list[Optional[str]] = [None] * len(objs)
        if self.refused:
            self.dropped["budget"] += len(objs)
            return {}, reasons
        columns = self.parser.columns(objs) if isinstance(self.parser, UpdateParser) else None
        if columns is not None:
            return self._route_columns(columns, stamps, offsets, reasons)
        ticks, items, ops, seqs, units = [], [], [], [], []
        skew = q.max_skew_ms
        for i, obj in enumerate(objs):
            parsed = self.parser.from_mapping(obj)
            if isinstance(parsed, InvalidRecord):
                self.dropped["malformed"] += 1
                reasons[i] = parsed.reason
                continue
            updates = [parsed] if isinstance(parsed, Update) else parsed
            if not updates:
                continue  # a tombstone, or a change that leaves every count as it was
            head, stamp = updates[0], int(stamps[i])
            if head.tick <= q.decided_through(stamp - self.delay_ms):
                self.dropped["late"] += 1
                reasons[i] = "late: its time is in an already decided tick"
                continue
            if head.ts > stamp + skew:
                self.dropped["future"] += 1
                reasons[i] = f"future: field {q.time_field!r} is more than {q.max_skew} after the clock"
                continue
            for sub, u in enumerate(updates):
                ticks.append(head.tick)
                items.append(self.item_index[u.item])
                ops.append(OPS[u.op])
                seqs.append(routed_seq(self.partition, offsets[i], sub))
                units.append(head.unit)  # a record's updates are its one unit's
        if not ticks:
            return {}, reasons
        return self._split([np.array(c, dtype=np.int64) for c in (ticks, items, ops, seqs)], units), reasons

    def _split(self, columns: list[np.ndarray], units: Optional[list[str]]) -> dict[int, RoutedUpdates]:
        """Routed updates (ticks, items, ops, seqs) by the partition they go to: their item's
        shard, or with a unit bound their unit's step."""
        q = self.query
        if self.pseudonyms is None:
            routed = RoutedUpdates(*columns)
            to = routed.items % q.shards
        else:
            routed = UnitRoutedUpdates(*columns, self.pseudonyms.users(units))
            to = (routed.units % np.uint64(unit_step_partitions(q))).astype(np.int64)
        return {k: routed.take(np.flatnonzero(to == k)) for k in np.unique(to).tolist()}

    def _route_columns(self, cols: UpdateColumns, stamps: Sequence[int], offsets: Sequence[int],
                       reasons: list[Optional[str]]) -> tuple[dict[int, RoutedUpdates], list[Optional[str]]]:
        """:meth:`route` of update records read as columns (one update each): the same
        judgements, for the whole batch at once."""
        q = self.query
        ok = np.ones(len(cols), dtype=bool)
        for i, invalid in cols.invalid.items():
            reasons[i] = invalid.reason
            ok[i] = False
        if cols.invalid:
            self.dropped["malformed"] += len(cols.invalid)
        stamps = np.asarray(stamps, dtype=np.int64)
        # late: its tick decided by the watermark its own stamp makes (DynamicQueryConfig.decided_through)
        decided = np.maximum(0, (stamps - self.delay_ms - q.lateness_ms - q.start) // q.tick_ms)
        for mask, reason, text in (
                (cols.ticks <= decided, "late", "late: its time is in an already decided tick"),
                (cols.ts > stamps + q.max_skew_ms, "future", f"future: field {q.time_field!r} is more than {q.max_skew} after the clock")):
            refused = np.flatnonzero(ok & mask).tolist()
            if refused:
                self.dropped[reason] += len(refused)
                for i in refused:
                    reasons[i] = text
                ok[refused] = False
        rows = np.flatnonzero(ok)
        if not len(rows):
            return {}, reasons
        seqs = (np.int64(self.partition) << (SEQ_OFFSET_BITS + SEQ_SUB_BITS)) | (np.asarray(offsets, dtype=np.int64)[rows] << SEQ_SUB_BITS)
        units = None if cols.units is None else [cols.units[i] for i in rows.tolist()]
        return self._split([cols.ticks[rows], cols.items[rows], cols.ops[rows], seqs], units), reasons


class UnitBounder:
    """The unit step of a dynamic query with a ``unit_field`` on an update topic of several
    partitions: one partition of its by-unit topic, which every update of the units it holds
    reaches (docs/privacy.md, "Partitions", "A unit across partitions").

    It logs what the routers send (:meth:`take`: each update once, by its sequence number) and
    bounds a tick once every input partition's watermark has passed the tick's decision time
    (:meth:`bound`): that tick's records, in sequence order - the topic's, whatever order they
    arrived in - each count against its unit's ``contribution_bound`` as in one partition (a
    record counts whole or not at all). So which of a unit's updates count depends on that unit's
    own records only, and never on timing. The admitted updates go on to the shards of their
    items; the unit step's own watermark follows them."""

    def __init__(self, query: DynamicQueryConfig, partition: int, store: Store, index: Optional[int] = None):
        self.query, self.partition, self.index = query, int(partition), index
        self.tables = UnitStepTables(store, query.name)
        pin_dynamic_plan(query, self.tables, index)
        self.store = store
        self._used: dict[int, int] = dict(self.tables.units())
        self.bounded = self.tables.last_bounded()  # every tick <= this is bounded
        #: updates of ticks not bounded yet, as columns: tick, sequence, item, op, unit
        self._waiting: tuple[list[int], ...] = ([], [], [], [], [])
        self._waiting_seqs: set[int] = set()
        for row in self.tables.waiting():
            if row[0] > self.bounded:
                self._wait(*row)
        self.dropped: Counter = Counter()
        self.refused = False  # the budget ledger refused this query: it does not run

    def _wait(self, tick: int, seq: int, item: int, op: int, unit: int) -> None:
        for column, value in zip(self._waiting, (tick, seq, item, op, unit)):
            column.append(value)
        self._waiting_seqs.add(seq)

    def take(self, routed: UnitRoutedUpdates, batch: WriteBatch) -> int:
        """Log updates a router sent (judged there already), each once; one whose tick is bounded
        already is dropped and counted late (clocks that differ by more than the watermark
        delay, as at a shard). Returns how many were dropped as late."""
        if self.refused:
            self.dropped["budget"] += len(routed)
            return 0
        late, fresh = 0, []
        for j, (tick, seq) in enumerate(zip(routed.ticks.tolist(), routed.seqs.tolist())):
            if tick <= self.bounded:
                late += 1
            elif seq not in self._waiting_seqs:
                fresh.append(j)
                self._wait(tick, seq, int(routed.items[j]), int(routed.ops[j]), int(routed.units[j]))
        self.dropped["late"] += late
        if fresh:
            take = np.array(fresh, dtype=np.int64)
            self.tables.append_waiting(batch, routed.ticks[take], routed.seqs[take], routed.items[take], routed.ops[take],
                                       routed.units[take])
        return late

    def bound(self, clock_ms: int, batch: WriteBatch) -> Optional[dict[int, RoutedUpdates]]:
        """Bound every tick the clock (the least input watermark) has passed: the admitted updates
        by shard (a shard with none is left out), or None when no tick is newly bounded. The unit
        counts and the mark go into ``batch``."""
        last = self.query.decided_through(clock_ms)
        if self.refused or last <= self.bounded:
            return None
        tick, seq, item, op = (np.array(c, dtype=np.int64) for c in self._waiting[:4])
        unit = np.array(self._waiting[4], dtype=np.uint64)
        due = np.flatnonzero(tick <= last)
        due = due[np.lexsort((seq[due], tick[due]))]
        admitted = self._admit(seq[due], unit[due], batch)
        keep = np.flatnonzero(tick > last)
        self._waiting = tuple(column[keep].tolist() for column in (tick, seq, item, op, unit))
        self._waiting_seqs.difference_update(seq[due].tolist())
        # the entries of the ticks up to the mark the store holds (written, not this batch's) go
        self.tables.put_bounded(batch, last, self.tables.last_bounded())
        self.bounded = last
        out = due[admitted]
        routed = RoutedUpdates(tick[out], item[out], op[out], seq[out])
        shard = routed.items % self.query.shards
        return {k: routed.take(np.flatnonzero(shard == k)) for k in np.unique(shard).tolist()}

    def _admit(self, seqs: np.ndarray, units: np.ndarray, batch: WriteBatch) -> np.ndarray:
        """Which of these updates (in bounding order) count: each record's (its updates share
        input partition and offset, so ``seq >> SEQ_SUB_BITS``) while its unit stays within the
        bound, the record whole or not at all."""
        bound = self.query.contribution_bound
        admitted = np.zeros(len(seqs), dtype=bool)
        records = seqs >> SEQ_SUB_BITS
        starts = np.flatnonzero(np.r_[True, records[1:] != records[:-1]]) if len(seqs) else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], len(seqs)]
        changed = {}
        for start, end, uid in zip(starts.tolist(), ends.tolist(), units[starts].tolist()):
            used = self._used.get(uid, 0)
            if used + (end - start) > bound:
                self.dropped["contribution_bound"] += 1
                continue
            self._used[uid] = changed[uid] = used + (end - start)
            admitted[start:end] = True
        for uid, used in changed.items():
            self.tables.put_unit(batch, uid, used)
        return admitted


@dataclass(frozen=True)
class LoggedUpdate:
    seq: int  # position in the update log (arrival order)
    item: int  # index into the query's items
    op: str
    tick: int


def dynamic_release_record(query: DynamicQueryConfig, counter: ShardedCounter, release: DynamicRelease) -> dict:
    """One published update of a dynamic query: noisy counts of every item of the release's shard
    (every declared item with one shard), with their
    confidence intervals and the time's ISO-8601 twin. Each count's interval is +- a half-width
    computed from the scales of its discrete Laplace draws only (the total's from the draws of all
    items), never from data; those scales follow from public parameters and from the mechanism's
    own privatized decisions (where segments closed, each read node's restart round, whether it
    halted), so the interval is post-processing and costs nothing, but its width is not a public
    constant (docs/privacy.md, "Error bars")."""
    plan = counter.plan
    # the histogram counters add integer noise to integer counts (exactly, well below 2^53): integers
    # (a synthetic histogram's, static_release mwem_ranges, are rounded)
    counts = {item: int(round(v)) for item, v in zip(counter.shard_items(release.shard), release.counts.tolist())}
    time_ms = query.start + release.position * query.tick_ms
    total = int(sum(counts.values()))
    record = {"query": query.name, "segment": release.segment, "tick": release.position,
              "time": time_ms, "time_iso": iso_utc(time_ms), "counts": counts,
              "total": total,
              # (a static release other than the histogram is named: its counts are a synthetic histogram's)
              "mechanism": f"dynamic:{plan.mechanism}" + ("" if plan.static_release == "histogram" else f"+{plan.static_release}"),
              "epsilon": query.epsilon, "delta": plan.delta_spent}
    if query.shards > 1:  # the shard's items only, in its own segments (docs/user-guide.md, "Shards")
        record["shard"], record["shards"] = release.shard, query.shards
    if release.noise_scales is not None:
        half = discrete_laplace_sum_halfwidth(release.noise_scales)
        half_total = discrete_laplace_sum_halfwidth(release.noise_scales, copies=len(counts))
        record[f"{CI_FIELD}_low"] = {item: c - half for item, c in counts.items()}
        record[f"{CI_FIELD}_high"] = {item: c + half for item, c in counts.items()}
        record[f"total_{CI_FIELD}_low"], record[f"total_{CI_FIELD}_high"] = total - half_total, total + half_total
    return record


#: a dynamic query's state is snapshot once at least this many logged updates were taken in
#: since the last snapshot (and at least as many as it has live instances): DynamicQueryState.snapshot
SNAPSHOT_AFTER_UPDATES = 10_000


class DynamicQueryState:
    def __init__(self, query: DynamicQueryConfig, noise: NodeNoise, pseudonyms: Pseudonymizer, store: Store,
                 index: Optional[int] = None, shard: Optional[int] = None):
        """``index``: the query's position in the config's ``dynamic`` list (a refusal names its
        fields as ``dynamic[index].field``). ``shard``: run that shard only, on updates an
        :class:`UpdateRouter` sent (:meth:`take_routed`; an update topic of several partitions),
        instead of every shard on the records themselves."""
        self.query = query
        self.index = index
        self.store = store
        self.pseudonyms = pseudonyms
        self.tables = DynamicTables(store, query.name)
        self.qid = self.tables.qid
        self._pin_plan()
        self.shard = shard
        self.counter = ShardedCounter(query.plan(), query.items, noise, query.name, query.shards,
                                      owned=None if shard is None else [shard])
        #: routed: the sequence numbers waiting (a resent update is taken in once)
        self._waiting_seqs: set[int] = set()
        self.parser = ChangeEventParser(query, query.items) if query.envelope == "debezium" else UpdateParser(query, query.items)
        self.dropped: Counter = Counter()
        self.refused = False  # the budget ledger refused this query: it does not run
        self.updates_in = 0
        self.releases = 0
        self._units: dict[int, int] = {}
        self._units.update(self.tables.units())
        self.published = self.tables.last_published()
        self.pending: list[DynamicRelease] = []  # recomputed by the recovery, not yet published
        #: logged updates of ticks not decided yet, as columns: sequence, item index, op code, tick
        self._waiting: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self._next_seq = 0
        #: sequence numbers of the logged updates the counter took in since its last snapshot
        self._taken_in: list[int] = []
        #: the last tick of the last snapshot written (0: none): the log entries up to it can go
        self._snapshot_through = 0
        snapshot = self.tables.snapshot()
        if snapshot is not None:
            self.counter.restore(snapshot["counter"])
            self._next_seq = int(snapshot["next_seq"])
            self._snapshot_through = self.counter.decided
        for seq, item, op, tick in self.tables.log():
            self._next_seq = max(self._next_seq, seq + 1)
            if tick <= self._snapshot_through:
                self._taken_in.append(seq)  # in the snapshot already; its entry goes with the next one
            else:
                self._wait(seq, item, op, tick)
        decided = self.tables.last_decided()
        if decided is not None:
            self.pending += [r for r in self._decide(decided) if r.sequence > self.published]

    def _pin_plan(self) -> None:
        pin_dynamic_plan(self.query, self.tables, self.index)

    @property
    def decided(self) -> int:
        """Every tick <= this has been decided."""
        return self.counter.decided

    @property
    def waiting(self) -> list[LoggedUpdate]:
        """The logged updates of ticks not decided yet, in arrival order."""
        return [LoggedUpdate(seq, item, OP_NAMES[op], tick) for seq, item, op, tick in zip(*self._waiting)]

    def last_waiting_tick(self) -> int:
        """The latest tick of a logged update not decided yet (else the last decided tick)."""
        return max(self._waiting[3], default=self.decided)

    def _wait(self, seq: int, item: int, op: int, tick: int) -> None:
        if self.shard is not None:
            self._waiting_seqs.add(seq)
        seqs, items, ops, ticks = self._waiting
        seqs.append(seq)
        items.append(item)
        ops.append(op)
        ticks.append(tick)

    def parse(self, obj: Union[Mapping, InvalidRecord]) -> Union[list[Update], InvalidRecord]:
        """The updates a decoded record holds, all at its time and of its unit (one; for a change
        event none, one or two: dpstream.topics.records.ChangeEventParser), or why it is invalid."""
        parsed = self.parser.from_mapping(obj)
        return [parsed] if isinstance(parsed, Update) else parsed

    def apply(self, obj: Union[dict, InvalidRecord], batch: WriteBatch, clock_ms: Optional[int] = None) -> Optional[str]:
        """One record: log it in ``batch`` for its tick to be decided later, or return why it is
        refused (then it is dead-lettered): invalid, late (its tick is decided), or future (dated
        more than ``max_skew`` after ``clock_ms``, the clock it arrived at). The caller writes the
        batch."""
        return self.apply_records([obj], batch, None if clock_ms is None else [clock_ms])[0]

    def apply_records(self, objs: Sequence[Union[dict, InvalidRecord]], batch: WriteBatch,
                      clocks_ms: Optional[Sequence[int]] = None) -> list[Optional[str]]:
        """:meth:`apply` for each record in turn (``clocks_ms[i]``: the clock record i arrived
        at), with the same outcome as one call each: the log entries go into ``batch`` at once.
        Returns each record's refusal (None: taken, or dropped without a dead letter)."""
        if self.refused:
            return self.apply_parsed([[]] * len(objs), batch)
        columns = self.parser.columns(objs) if isinstance(self.parser, UpdateParser) else None
        if columns is not None:
            return self.apply_columns(columns, batch, clocks_ms)
        return self.apply_parsed([self.parse(obj) for obj in objs], batch, clocks_ms)

    def apply_columns(self, cols: UpdateColumns, batch: WriteBatch, clocks_ms: Optional[Sequence[int]] = None
                      ) -> list[Optional[str]]:
        """:meth:`apply_parsed` of update records read as columns (:meth:`UpdateParser.columns`:
        one update per record), with the same outcome - the same refusals, counts, log entries
        and sequence numbers - in whole-array steps: the late and future checks at once, then
        the unit bound (if any) record by record in arrival order."""
        n = len(cols)
        self.updates_in += n
        reasons: list[Optional[str]] = [None] * n
        ok = np.ones(n, dtype=bool)
        for i, invalid in cols.invalid.items():
            reasons[i] = invalid.reason
            ok[i] = False
        if cols.invalid:
            self.dropped["malformed"] += len(cols.invalid)
        late = ok & (cols.ticks <= self.counter.decided)
        self._refuse(late, "late", "late: its time is in an already decided tick", reasons)
        ok &= ~late
        if clocks_ms is not None:
            future = ok & (cols.ts > np.asarray(clocks_ms, dtype=np.int64) + self.query.max_skew_ms)
            self._refuse(future, "future", f"future: field {self.query.time_field!r} is more than {self.query.max_skew} after "
                                           f"the clock", reasons)
            ok &= ~future
        rows = np.flatnonzero(ok)
        if cols.units is not None and len(rows):
            rows = self._within_bound(rows, [cols.units[i] for i in rows.tolist()], batch)
        if len(rows):
            seqs = list(range(self._next_seq, self._next_seq + len(rows)))
            self._next_seq += len(rows)
            items, ops, ticks = cols.items[rows].tolist(), cols.ops[rows].tolist(), cols.ticks[rows].tolist()
            for column, values in zip(self._waiting, (seqs, items, ops, ticks)):
                column.extend(values)
            self.tables.append_many(batch, seqs, items, ops, ticks)
        return reasons

    def _refuse(self, mask: np.ndarray, reason: str, text: str, reasons: list[Optional[str]]) -> None:
        rows = np.flatnonzero(mask).tolist()
        if rows:
            self.dropped[reason] += len(rows)
            for i in rows:
                reasons[i] = text

    def _within_bound(self, rows: np.ndarray, units: list[str], batch: WriteBatch) -> np.ndarray:
        """The rows (one update each, in arrival order) whose unit stays within its bound; the
        others are dropped and counted."""
        bound, used_by = self.query.contribution_bound, self._units
        keep = []
        for row, uid in zip(rows.tolist(), self.pseudonyms.users(units).tolist()):
            used = used_by.get(uid, 0)
            if used + 1 > bound:
                self.dropped["contribution_bound"] += 1
                continue
            used_by[uid] = used + 1
            self.tables.put_unit(batch, uid, used + 1)
            keep.append(row)
        return np.array(keep, dtype=np.int64)

    def apply_parsed(self, parsed: Sequence[Union[list[Update], InvalidRecord]], batch: WriteBatch,
                     clocks_ms: Optional[Sequence[int]] = None) -> list[Optional[str]]:
        """:meth:`apply_records` of records :meth:`parse` has read already: checked one after
        another - late against the decided ticks, future against its clock, each unit's bound in
        arrival order - and logged. A record counts whole or not at all: a unit never passes its
        bound by half a change."""
        self.updates_in += len(parsed)
        if self.refused:
            self.dropped["budget"] += len(parsed)
            return [None] * len(parsed)
        reasons: list[Optional[str]] = [None] * len(parsed)
        decided, skew = self.counter.decided, self.query.max_skew_ms
        bound = self.query.contribution_bound
        units = [u[0].unit for u in parsed if isinstance(u, list) and u and u[0].unit is not None]
        uids = iter(self.pseudonyms.users(units).tolist()) if units else iter(())
        index, seqs, items, ops, ticks = self.counter.index, *self._waiting
        first = self._next_seq
        for i, updates in enumerate(parsed):
            if isinstance(updates, InvalidRecord):
                self.dropped["malformed"] += 1
                reasons[i] = updates.reason
                continue
            if not updates:
                continue  # a tombstone, or a change that leaves every count as it was
            head = updates[0]
            uid = next(uids) if head.unit is not None else None
            tick = head.tick  # a record's updates share its time and unit
            if tick <= decided:
                self.dropped["late"] += 1
                reasons[i] = "late: its time is in an already decided tick"
                continue
            if clocks_ms is not None and head.ts > clocks_ms[i] + skew:
                self.dropped["future"] += 1
                reasons[i] = f"future: field {self.query.time_field!r} is more than {self.query.max_skew} after the clock"
                continue
            if uid is not None:
                used = self._units.get(uid, 0)
                if used + len(updates) > bound:
                    self.dropped["contribution_bound"] += 1
                    continue
                self._units[uid] = used + len(updates)
                self.tables.put_unit(batch, uid, used + len(updates))
            for u in updates:
                seqs.append(self._next_seq)
                items.append(index[u.item])
                ops.append(OPS[u.op])
                ticks.append(tick)
                self._next_seq += 1
        if self._next_seq > first:
            n = self._next_seq - first
            self.tables.append_many(batch, seqs[-n:], items[-n:], ops[-n:], ticks[-n:])
        return reasons

    def take_routed(self, routed: RoutedUpdates, batch: WriteBatch) -> int:
        """Log updates an :class:`UpdateRouter` sent to this shard (judged there already), each
        once: one whose tick is decided already is dropped and counted late (its router judged it
        on time by its Kafka timestamp: the broker's and the worker's clocks differed by more than
        the watermark delay), one already waiting is a copy sent again (at least once). Returns
        how many were dropped as late."""
        if self.refused:
            self.dropped["budget"] += len(routed)
            return 0
        decided, late = self.counter.decided, 0
        fresh = []
        for j, (tick, seq) in enumerate(zip(routed.ticks.tolist(), routed.seqs.tolist())):
            if tick <= decided:
                late += 1
            elif seq not in self._waiting_seqs:
                fresh.append(j)
                self._wait(seq, int(routed.items[j]), int(routed.ops[j]), tick)
        self.dropped["late"] += late  # (records in are counted where they were read: UpdateRouter)
        if fresh:
            take = np.array(fresh, dtype=np.int64)
            self.tables.append_many(batch, routed.seqs[take].tolist(), routed.items[take].tolist(), routed.ops[take].tolist(),
                                    routed.ticks[take].tolist())
        return late

    def _decide(self, last: int) -> list[DynamicRelease]:
        """Feed the waiting updates of ticks <= ``last`` in (tick, arrival) order - every one of
        them: each was judged on its own fields and the clock when it was logged - and decide
        every tick up to ``last``. Returns the releases."""
        if not self._waiting[0]:
            return self.counter.decide(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64), last)
        seq, item, op, tick = (np.array(column, dtype=np.int64) for column in self._waiting)
        due = tick <= last
        order = np.flatnonzero(due)
        order = order[np.lexsort((seq[order], tick[order]))]
        releases = self.counter.decide(item[order], op[order] == OPS["insert"], tick[order], last)
        self._taken_in += seq[order].tolist()
        rest = np.flatnonzero(~due)
        self._waiting = tuple(column[rest].tolist() for column in (seq, item, op, tick))
        if self.shard is not None:
            self._waiting_seqs.difference_update(seq[order].tolist())
        return releases

    def advance_clock(self, clock_ms: int, batch: WriteBatch, max_ticks: Optional[int] = None) -> None:
        """Decide every tick the clock has passed (:meth:`DynamicQueryConfig.decided_through`),
        data or not - at most ``max_ticks`` of them per call (a query whose public start is long
        past catches up over several calls). Releases of the segments that closed are kept as
        pending."""
        if self.refused:
            return
        last = self.query.decided_through(clock_ms)
        if max_ticks is not None:
            last = min(last, self.counter.decided + max_ticks)
        if last <= self.counter.decided:
            return
        self.pending += self._decide(last)
        self.tables.put_decided(batch, last)

    def take_pending(self) -> list[dict]:
        """Releases to publish now (logged, not yet marked published), as records."""
        return [dynamic_release_record(self.query, self.counter, r) for r in self.pending]

    def mark_published(self, batch: WriteBatch, through: Optional[int] = None) -> None:
        """The pending releases (those up to release ``through``, :attr:`DynamicRelease.sequence`,
        if given) reached the output."""
        done = [r for r in self.pending if through is None or r.sequence <= through]
        if done:
            self.published = done[-1].sequence
            self.releases += len(done)
            self.tables.put_published(batch, self.published)
            self.pending = self.pending[len(done):]
        if not self.pending and len(self._taken_in) >= max(SNAPSHOT_AFTER_UPDATES, self.counter.live_size()):
            self.snapshot(batch)

    def snapshot(self, batch: WriteBatch) -> None:
        """Write the counter's state as of the last decided tick in ``batch``, and delete the log
        entries the previous snapshot took in (written already: a crash before ``batch`` is
        written loses nothing). A restart then reads the snapshot and the updates of the ticks
        after the previous one, not the whole history. Taken once every release is published (a restart must
        recompute the unpublished ones from the log) and once as many updates were taken in as
        the snapshot holds live instances (at least SNAPSHOT_AFTER_UPDATES): the snapshots
        cost O(1) per update, and a restart replays at most that many updates besides the
        waiting ones (docs/user-guide.md, "Dynamic queries")."""
        self.tables.put_snapshot(batch, {"counter": self.counter.snapshot(), "next_seq": self._next_seq}, self._taken_in,
                                 covered_through=self._snapshot_through)
        self._taken_in = []
        self._snapshot_through = self.counter.decided
