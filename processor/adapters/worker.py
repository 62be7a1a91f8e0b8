"""What the Kafka worker does with records, free of Faust and of any Kafka client.

The Faust adapter (:mod:`dpstream.processor.adapters.faust_app`) reads batches of records, hands them here, sends
the messages this returns, waits for the broker to acknowledge them, and only then commits the
state write this prepared. Everything DP happens in :class:`dpstream.processor.engine.pipeline.QueryPipeline`,
the same code ``dpstream replay`` and the benchmarks run.

Partitions and state (docs/operations.md, "Partitions and state"; docs/privacy.md, "Failures").
Elastic workers (``--assignment group``; docs/operations.md, "Elastic workers") own what the
consumer group assigns instead: :meth:`DpstreamWorker.restore` rebuilds a gained partition's store
from its changelog, :meth:`DpstreamWorker.add_source` and :meth:`DpstreamWorker.remove_source`
take partitions on and off, and every store's changes go out as changelog records
(:meth:`DpstreamWorker.changelog_messages`) in the transaction of the outputs they belong to.
The rest of this paragraph is static ownership. Worker ``i`` of ``N`` owns partition ``p``
of every topic it reads when ``p % N == i``: the input topic's partitions for stage 1 (by user)
and the repartition topics' partitions for stage 2 (by key). Ownership is static, like the pods
of the StatefulSet whose volumes hold the RocksDB state, so a partition's state never has to
move: a restarted worker finds its state on its volume. Each source topic-partition has its own
store, and every state write carries the offset of the last input record it covers, in the same
atomic RocksDB write. On start the worker reads each partition from that offset + 1; records
redelivered by at-least-once consumption at or below it are skipped. State is therefore updated
exactly once per input record even though Kafka delivers at least once.

Failure rules:

* Stage 1 sends its bounded records (and dead letters) and waits for them to be acknowledged
  *before* it commits the user counts. A crash in between re-bounds the same records from the
  same state: the lateness clock is each record's Kafka timestamp (not the wall clock), so the
  replay assigns identical (user, slot) pairs, and stage 2 keeps one record per (user, slot) of a
  micro-batch. No user ever has more than C counted contributions.
* A trigger's releases are journaled in the same write as its state (:meth:`QueryPipeline.fire`),
  then sent, then marked published. After a crash the journaled, unpublished releases are sent
  again from the journal, never recomputed. Noise is a function of the secret, the run's noise
  label (kept with the state: :func:`worker_noise_label`) and the tree position only, so it is
  identical after a restart.
* A store written under another noise secret or run, or by another worker layout, is refused:
  that is a new budget epoch, never a silent reset.
* Exactly-once delivery (docs/operations.md, "Delivery"): the messages of a batch, or of a
  trigger, go out in one Kafka transaction with a progress record of what they complete
  (:meth:`DpstreamWorker.progress_message`, :meth:`DpstreamWorker.published_message`); after a
  crash, :meth:`DpstreamWorker.resume` keeps what was delivered from being sent again.

Time (docs/privacy.md, "Time"): windows are charged and dynamic ticks are decided on the wall
clock, data or not; every query's windows are charged in one public order on every worker
(:class:`dpstream.processor.engine.budget.ChargeSchedule`). Stage 1 judges each record by its own Kafka
timestamp: ``late`` if that is past its trigger's fire time, ``future`` if its event time is
more than ``max_skew`` after it (both dead-lettered). A trigger fires once every input partition
has been read past its fire time (the input watermark, :meth:`DpstreamWorker.watermark_messages`),
never past the wall clock. Nothing one record claims moves any clock.
"""
from __future__ import annotations

import json
import logging
import operator
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np

from dpstream.accountant.ledger import recorded_entries, recorded_epoch
from dpstream.processor.adapters.metrics import PipelineMetrics
from dpstream.processor.adapters.trigger_log import TriggerLog, iso_utc
from dpstream.processor.config import DpstreamConfig, DynamicQueryConfig, plan_for
from dpstream.processor.engine.budget import (
    LEDGER_STORE,
    BudgetGate,
    ChargeSchedule,
    open_ledger,
)
from dpstream.processor.engine.dynamic_stream import (
    DynamicQueryState,
    RoutedUpdates,
    UnitBounder,
    UnitRoutedUpdates,
    UpdateRouter,
    unit_step_partitions,
)
from dpstream.processor.engine.pipeline import (
    BoundedRecords,
    PackedColumns,
    PipelineStats,
    QueryPipeline,
    RoutedEvents,
    Schedule,
    check_noise_epoch,
    prepare_noise_tables,
)
from dpstream.processor.engine.runner import Fired, QueryRunner
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer, keep_tables_in
from dpstream.state.changelog import ChangelogStore, restore_from_changelog
from dpstream.state.noise_tables import NoiseTableDirectory
from dpstream.state.store import (
    PartitionStores,
    Store,
    WriteBatch,
    check_state_directory,
)
from dpstream.state.tables import WINDOW_OPEN, DynamicTables, InputWatermarks, IntegerMark, TextMark
from dpstream.topics.decoding import decoder_for
from dpstream.topics.kafka import (
    CHANGELOG_MAX_BYTES,
    DEAD_LETTER_TOPIC,
    PROGRESS_TOPIC,
    changelog_topic,
    item_topic,
    repartition_topic,
    rerouting_topic,
    unit_topic,
)
from dpstream.topics.partitioner import partition_for
from dpstream.topics.records import (
    WATERMARK_KEY,
    EventParser,
    dead_letter,
    decode_watermark,
    encode_json,
    encode_watermark,
    release_key,
)

log = logging.getLogger("dpstream.worker")

LAYOUT_FILE = "worker-layout.json"
#: the run nonce of the noise label this state directory was written under (:func:`stored_run_nonce`)
RUN_FILE = "worker-run.json"
#: default of how far behind the newest broker-stamped timestamp read (or the time a partition was
#: read to its end) a stage-1 partition's watermark stays: the broker's and the worker's clocks may
#: differ this much, and a producer's record (CreateTime) may reach the broker this long after its
#: stamp, without being late (docs/privacy.md, "Time")
WATERMARK_DELAY_MS = 2000
#: dynamic ticks decided per timer call at most: a query whose start is long past catches up
#: over several calls instead of stalling the event loop
DYNAMIC_TICKS_PER_STEP = 200_000


_KEY, _VALUE, _TIMESTAMP = operator.attrgetter("key"), operator.attrgetter("value"), operator.attrgetter("timestamp")

#: Kafka's timestamp types (the record batch attribute; aiokafka's ``ConsumerRecord.timestamp_type``)
CREATE_TIME, LOG_APPEND_TIME = 0, 1


def broker_stamped_max(records: Sequence["RecordLike"]) -> Optional[int]:
    """The newest timestamp among ``records`` that the broker stamped (LogAppendTime), or None.

    Only these may move a partition's watermark: a broker's append times rise with the offsets,
    so every record stamped at or before the newest one read has been read. A producer's stamp
    (CreateTime) is data: one producer stamping a record ahead would lift a lagging partition's
    watermark and make other users' unread records late, so their inclusion would depend on
    another user's record (docs/privacy.md, "Time"). A CreateTime partition's watermark moves only
    when it has been read to its end."""
    stamped = [r.timestamp for r in records if getattr(r, "timestamp_type", CREATE_TIME) == LOG_APPEND_TIME]
    return max(stamped) if stamped else None


def dead_letter_category(reason: str) -> str:
    """A dead letter's reason as one of the categories of ``dpstream_events_dropped_total``
    (docs/operations.md, "Topics and records"): the reason text itself may quote the record."""
    for prefix, category in (("late:", "late"), ("future:", "future"), ("key id collision", "key_collision")):
        if reason.startswith(prefix):
            return category
    return "malformed"  # the parser's reasons, an absent delete


#: most bytes of one repartition message: half of Apache Kafka's default record limit (1 MB), so a
#: large stage-1 batch never makes a message the broker refuses (which stopped the worker)
REPARTITION_MESSAGE_BYTES = 512 * 1024


def encoded_parts(records: PackedColumns, limit: Optional[int] = None) -> list[bytes]:
    """``records`` in wire form, split in halves until every part is at most ``limit`` bytes
    (default :data:`REPARTITION_MESSAGE_BYTES`; one record is never split: its size is bounded by
    the key's length limit). Stage 2 and a dynamic query's shards apply parts independently, so
    the split changes nothing but the message count."""
    limit = REPARTITION_MESSAGE_BYTES if limit is None else limit
    value = records.encode()
    if len(value) <= limit or len(records) == 1:
        return [value]
    half = len(records) // 2
    return encoded_parts(records.take(np.arange(half)), limit) + encoded_parts(records.take(np.arange(half, len(records))), limit)


def _undelivered(source: "SourcePartition", records: Sequence["RecordLike"], apply) -> list["RecordLike"]:
    """The records of a batch not yet in ``source``'s state, after applying (``apply``, then
    committing its result with no message sent) those whose outputs were already delivered in a
    committed transaction before a crash (exactly once: docs/operations.md, "Delivery"). A batch
    is split at that offset, so no output is sent twice however the batches fall."""
    if records and records[0].offset <= source.last_offset:
        records = [r for r in records if r.offset > source.last_offset]  # redelivered: already in state
    if records and records[0].offset <= source.delivered_offset:
        done = [r for r in records if r.offset <= source.delivered_offset]
        apply(done).commit()
        records = records[len(done):]
    return list(records)


class RecordLike(Protocol):
    """A consumed Kafka record (aiokafka's ConsumerRecord fits)."""

    offset: int
    key: Optional[bytes]
    value: Optional[bytes]
    timestamp: int  # ms
    timestamp_type: int  # CREATE_TIME or LOG_APPEND_TIME


@dataclass
class Message:
    topic: str
    value: bytes
    key: Optional[bytes] = None
    partition: Optional[int] = None


class StateLayoutError(RuntimeError):
    """The state directory does not belong to this worker layout (a new epoch is needed)."""


class InputWentBackError(StateLayoutError):
    """A source partition's log no longer holds what this worker's state says it read: the topic
    was recreated, or the broker lost data (docs/operations.md, "When the input goes back")."""


class LostStateError(StateLayoutError):
    """The state directory is empty, but this worker already ran under this budget epoch and
    noise secret: its volume was lost (docs/privacy.md, "Failures")."""


def lost_state_message(what: str, app_id: str, config: DpstreamConfig) -> str:
    """A lost-state refusal that says how to go on (docs/operator-guide.md, "Start over")."""
    epoch = config.budget.epoch if config.budget is not None else None
    return (f"{what}. Starting afresh would forget the budget it spent and could re-release values with the same "
            f"noise, so it is refused. Either give the worker its state directory back, or start over on purpose: "
            f"`dpstream reset --config CONFIG --app-id {app_id} --state-dir DIR --broker BROKER --yes` "
            f"(deletes the state and the application's internal topics, and moves to a new noise label), or a new "
            f"application id (--app-id {app_id}-2, with output topics of its own) or a new budget.epoch in the config "
            f"({'now ' + repr(epoch) if epoch is not None else 'no budget section yet'}). "
            f"See docs/operator-guide.md, \"Start over\"")


def run_mismatch_message(state_dir: Path, stored: str, agreed: str, app_id: str, config: DpstreamConfig) -> str:
    """The refusal of a state directory written under another run than the application's
    (docs/operator-guide.md, "Start over")."""
    theirs = f"run {stored}" if stored else "a run from before run nonces"
    return lost_state_message(
        f"state directory {state_dir} was written under {theirs} of application {app_id!r}, but the application's run "
        f"is {agreed or 'one from before run nonces'} (dpstream-epochs, key {app_id}/run/...): the epoch marks were lost and "
        f"another worker started a new run, or this directory belongs to another one. Its state and the run's cannot be "
        f"mixed", app_id, config)


def worker_epoch(config: DpstreamConfig, restarts: int = 0) -> str:
    """The worker's epoch: the configured ``budget.epoch`` ("1" without a budget section), and how
    many times ``dpstream reset`` started the application over (docs/operator-guide.md, "Start
    over"), so a start-over never reuses the noise or the changelogs of released values."""
    epoch = config.budget.epoch if config.budget is not None else "1"
    return f"{epoch}.restart{restarts}" if restarts else epoch


def worker_noise_label(app_id: str, config: DpstreamConfig, restarts: int = 0, nonce: str = "") -> str:
    """The worker's noise label (docs/privacy.md, "Noise"): ``worker:<app id>:<epoch>:<run nonce>``.
    The epoch keeps a new epoch or start-over from reusing the noise of released values; the run
    nonce (:func:`new_run_nonce`, agreed by the application's workers: :mod:`dpstream.processor.adapters.run_identity`)
    keeps a fresh start that lost both the state and the epoch marks from reusing it. ``nonce=""``:
    a run begun before run nonces (dpstream 0.1.0), whose label it keeps. ``dpstream replay
    --noise-label`` with this label reproduces the worker's releases."""
    label = f"worker:{app_id}:{worker_epoch(config, restarts)}"
    return f"{label}:{nonce}" if nonce else label


def new_run_nonce() -> str:
    """A new run's nonce: 128 random bits (hex), so two runs never draw the same label (docs/privacy.md, "Noise")."""
    return os.urandom(16).hex()


def stored_run_nonce(state_dir: str | Path) -> Optional[str]:
    """The run nonce a worker's state directory was written under (:data:`RUN_FILE`): None for a
    new directory, "" for one written before run nonces (a layout file and no run file)."""
    state_dir = Path(state_dir)
    if (state_dir / RUN_FILE).exists():
        return str(json.loads((state_dir / RUN_FILE).read_text())["nonce"])
    return "" if (state_dir / LAYOUT_FILE).exists() else None


def run_fields(app_id: str, config: DpstreamConfig, restarts: int, nonce: str) -> dict:
    """What every release of a worker says about the run that made it (docs/user-guide.md, the
    release format): the application, and its run: the noise label (what ``dpstream replay
    --noise-label`` takes), the budget epoch, the start-over count and the run nonce. Public
    values: no secret, no fingerprint of it. A fresh start reads them back from the output topic
    (:func:`dpstream.processor.adapters.run_identity.live_release`)."""
    return {"app_id": app_id, "run": {"noise_label": worker_noise_label(app_id, config, restarts, nonce),
                                      "budget_epoch": config.budget.epoch if config.budget is not None else "1",
                                      "restarts": int(restarts), "nonce": nonce}}


def epoch_mark(config: DpstreamConfig, noise: NodeNoise, restarts: int = 0, nonce: str = "") -> dict:
    """What a worker's state belongs to: the configured budget epoch, the noise secret (as its
    public fingerprint), after ``dpstream reset`` the start-over count, and the run nonce. Kept
    outside the volume (:data:`dpstream.topics.kafka.EPOCH_TOPIC`)."""
    mark = {"budget_epoch": config.budget.epoch if config.budget is not None else None, "noise": noise.fingerprint}
    if restarts:
        mark["restarts"] = int(restarts)
    if nonce:
        mark["run"] = nonce
    return mark


@dataclass(frozen=True)
class Ownership:
    """Worker ``index`` of ``workers`` owns partition p when p % workers == index."""

    index: int = 0
    workers: int = 1

    def __post_init__(self):
        if self.workers < 1 or not 0 <= self.index < self.workers:
            raise ValueError(f"worker index {self.index} must be in [0, {self.workers})")

    def partitions(self, count: int) -> list[int]:
        return [p for p in range(count) if p % self.workers == self.index]


class SourcePartition:
    """One owned source topic-partition: its store, the pipelines using it, its input offset."""

    def __init__(self, topic: str, partition: int, store: Store, pipelines: list[QueryPipeline]):
        self.topic = topic
        self.partition = partition
        self.store = store
        self.pipelines = pipelines
        self.runners = [QueryRunner(p) for p in pipelines]
        self._offset = IntegerMark(store, b"offset")
        self.last_offset = self._offset.get(-1)
        #: exactly once: the outputs of every record up to this offset are on Kafka in a committed
        #: transaction (the progress topic, :meth:`DpstreamWorker.resume`); such records are
        #: applied to the state again after a crash, their outputs never sent again
        self.delivered_offset = -1
        #: stage 1: the newest broker-stamped (LogAppendTime) timestamp among the committed records
        #: read since start (:func:`broker_stamped_max`), and
        #: the watermark last announced to stage 2 (in memory: stage 2 keeps the announced ones)
        self.read_ms: Optional[int] = None
        self.announced_ms: Optional[int] = None
        #: stage 2: how far each stage-1 input partition has been read, from its markers
        self._watermarks = InputWatermarks(store)
        self.watermarks: dict[tuple[str, int], int] = self._watermarks.get()
        self._topic_id = TextMark(store, b"topic-id")
        #: stage 1: its lanes, the partitions of the queries' by-user topics read into this
        #: state with the input partition (:meth:`DpstreamWorker.process_stage_one`): topic -> the
        #: offset read up to, committed with the state
        self.lanes: dict[str, int] = {}
        self._lane_offsets: dict[str, IntegerMark] = {}
        #: stage 1: how far each input partition's events sent here were read, from the markers
        #: on the by-user topics ((by-user topic, input partition) -> ms), and the watermark last
        #: announced on them
        self._rerouted = InputWatermarks(store, b"rerouted-watermarks")
        self.rerouted_marks: dict[tuple[str, int], int] = self._rerouted.get()
        self.announced_own_ms: Optional[int] = None
        #: stage 1: lane offsets to process first, in lane order, before anything else: the last
        #: batch before a crash, whose outputs were delivered (exactly once: into the state
        #: only) or may have been (at least once: sent again), so that every record gets the slot
        #: it got then (docs/privacy.md, "Failures")
        self.replay: dict[str, int] = {}
        self.replay_sends = False
        self._plan = TextMark(store, b"lane-plan")
        self._planned = False  # a plan is written and not yet cleared

    def add_lane(self, topic: str) -> None:
        """Stage 1: read ``topic``'s partition of this number into this state too (a by-user topic)."""
        mark = self._lane_offsets[topic] = IntegerMark(self.store, b"offset:" + topic.encode())
        self.lanes[topic] = mark.get(-1)
        plan = json.loads(self._plan.get() or "{}")
        self._planned = bool(plan)
        replay = {lane: int(o) for lane, o in plan.items() if int(o) > self.lane_offset(lane)}
        if replay:  # at least once: the last batch's outputs may be out; they go again, as they were
            self.replay, self.replay_sends = replay, True

    @property
    def lane_order(self) -> list[str]:
        """The order a batch's lanes are bounded in: the input, then the by-user topics."""
        return [self.topic, *self.lanes]

    def lane_offset(self, lane: str) -> int:
        return self.last_offset if lane == self.topic else self.lanes.get(lane, -1)

    def write_plan(self, offsets: dict[str, int]) -> None:
        """At least once, a stage-1 partition with lanes: which records the batch about to be
        sent covers, before it is sent (:attr:`replay`)."""
        batch = WriteBatch()
        self._plan.put(batch, json.dumps(offsets, sort_keys=True))
        self.store.write(batch)
        self._planned = True

    def check_log(self, start: int, end: int, topic_id: Optional[str], read_to: Optional[int] = None) -> None:
        """Refuse a log that went back: another topic under the same name (its id changed), or
        an end offset before the offset this state has read up to (records this state counted
        are gone). ``start``/``end``: the partition's log start and end offsets now. The topic id
        is recorded the first time one is given. ``read_to``: the offset the state had read up to
        before the end was asked for, when the worker reads on meanwhile (else the current one):
        a record read after the question may lie past the end it was told."""
        read_to = self.last_offset if read_to is None else read_to
        recorded = self._topic_id.get()
        if topic_id and recorded and recorded != topic_id:
            raise InputWentBackError(
                f"{self.name}: the topic was recreated (its id is {topic_id}, this state read topic id {recorded}, up to offset "
                f"{self.last_offset}); its records are not the ones this state counted. See docs/operations.md, \"When the input "
                f"goes back\"")
        if read_to + 1 > end:
            raise InputWentBackError(
                f"{self.name}: the log ends at offset {end}, but this state has read up to offset {read_to}: the "
                f"topic was recreated or the broker lost data. See docs/operations.md, \"When the input goes back\"")
        if topic_id and not recorded:
            batch = WriteBatch()
            self._topic_id.put(batch, topic_id)
            self.store.write(batch)

    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    def commit(self, batch: WriteBatch, last_offset: int, read_ms: Optional[int] = None, lanes: Optional[dict] = None,
               marks: Optional[dict] = None) -> None:
        """The state changes of records up to ``last_offset`` (and each lane's offset in
        ``lanes``) and those offsets: one atomic write."""
        self.write(batch, last_offset, lanes, marks)
        self.acknowledge(last_offset, read_ms, lanes, marks)

    def write(self, batch: WriteBatch, last_offset: int, lanes: Optional[dict] = None, marks: Optional[dict] = None) -> None:
        self._offset.put(batch, last_offset)
        for lane, offset in (lanes or {}).items():
            if offset != self.lanes.get(lane):
                self._lane_offsets[lane].put(batch, offset)
        if marks:
            self._rerouted.put(batch, {**self.rerouted_marks, **marks})
        if self._planned:
            self._plan.put(batch, "")
            self._planned = False
        self.store.write(batch)

    def acknowledge(self, last_offset: int, read_ms: Optional[int] = None, lanes: Optional[dict] = None,
                    marks: Optional[dict] = None) -> None:
        """Records up to ``last_offset`` are written and their outputs delivered: they count for
        the watermark (elastic workers write the state first, then commit the transaction that
        carries its changelog: only then)."""
        self.last_offset = last_offset
        if lanes:
            self.lanes.update(lanes)
        if marks:
            self.rerouted_marks.update(marks)
        if self.replay:
            self.replay = {lane: o for lane, o in self.replay.items() if o > self.lane_offset(lane)}
        if read_ms is not None:
            self.read_ms = read_ms if self.read_ms is None else max(self.read_ms, read_ms)

    def rerouted_watermark(self, partitions: int) -> Optional[int]:
        """Stage 1: how far every input partition's events sent to this one have been read here
        (the markers of every by-user topic from every input partition; None until each has
        announced one). No lanes: no limit."""
        if not self.lanes:
            return 2**62
        marks = [self.rerouted_marks.get((lane, p)) for lane in self.lanes for p in range(partitions)]
        return None if None in marks else min(marks)

    def read_watermark(self, now_ms: int, end_ms: Optional[int], delay_ms: int) -> Optional[int]:
        """Stage 1 and dynamic updates: how far this partition has been read, as a time. The
        newest committed broker-stamped timestamp (:func:`broker_stamped_max`), or ``end_ms``
        (when the broker said where the log ends, if it has been read to there), less
        ``delay_ms``, never past ``now_ms``; None before anything is known (docs/privacy.md,
        "Time")."""
        read = self.read_ms
        if end_ms is not None:
            read = end_ms if read is None else max(read, end_ms)
        return None if read is None else min(read, now_ms) - delay_ms

    def advance_watermarks(self, batch: WriteBatch, marks: Iterable[tuple[str, int, int]]) -> None:
        """Stage 2: take in watermark markers (kept with the offset they were read at)."""
        changed = False
        for topic, partition, ms in marks:
            if ms > self.watermarks.get((topic, partition), -2**63):
                self.watermarks[(topic, partition)] = ms
                changed = True
        if changed:
            self._watermarks.put(batch, self.watermarks)

    def input_watermark(self, topic: str, partitions: int) -> Optional[int]:
        """Stage 2: the time up to which every partition of the input ``topic`` has been read
        (None until each has announced one)."""
        marks = [self.watermarks.get((topic, p)) for p in range(partitions)]
        return None if None in marks else min(marks)


@dataclass
class StageOneResult:
    """What one stage-1 batch produced; sent first, then :meth:`commit`-ted."""

    source: SourcePartition
    batch: WriteBatch
    last_offset: int
    messages: list[Message] = field(default_factory=list)
    invalid: Counter = field(default_factory=Counter)
    read_ms: Optional[int] = None  # the newest broker-stamped timestamp of the batch (broker_stamped_max)
    #: stage 1: each lane's offset after this batch, and the by-user markers it read
    lanes: dict = field(default_factory=dict)
    marks: dict = field(default_factory=dict)

    def commit(self) -> None:
        self.source.commit(self.batch, self.last_offset, self.read_ms, self.lanes, self.marks)

    def write(self) -> None:
        self.source.write(self.batch, self.last_offset, self.lanes, self.marks)

    def acknowledge(self) -> None:
        self.source.acknowledge(self.last_offset, self.read_ms, self.lanes, self.marks)

    def offsets(self) -> dict[str, int]:
        """Every lane's offset after this batch, the input's first."""
        return {self.source.topic: self.last_offset, **self.source.lanes, **self.lanes}


@dataclass
class StageTwoResult:
    """What one stage-2 batch produced: dead letters to send, then :meth:`commit`."""

    source: SourcePartition
    batch: WriteBatch
    last_offset: int
    messages: list[Message] = field(default_factory=list)
    applied: int = 0

    def commit(self) -> None:
        self.source.commit(self.batch, self.last_offset)

    def write(self) -> None:
        self.source.write(self.batch, self.last_offset)

    def acknowledge(self) -> None:
        self.source.acknowledge(self.last_offset)


@dataclass
class FiredTrigger:
    """A trigger fired on an owned repartition partition: send its releases, then :meth:`DpstreamWorker.mark_published`."""

    source: SourcePartition
    fired: Fired
    #: time.perf_counter() when its computation began (the trigger log line's duration)
    started: Optional[float] = None

    @property
    def pipeline(self) -> QueryPipeline:
        return self.fired.runner.pipeline

    @property
    def window(self) -> int:
        return self.fired.window

    @property
    def trigger(self) -> int:
        return self.fired.trigger

    @property
    def releases(self) -> list[dict]:
        return self.fired.releases


class DpstreamWorker:
    def __init__(self, config: DpstreamConfig, secret: bytes, state_dir: str | Path, ownership: Optional[Ownership],
                 input_partitions: dict[str, int], repartitions: int, metrics: Optional[PipelineMetrics] = None,
                 block_cache_mb: int = 64, write_buffer_mb: int = 32, previous_mark: Optional[dict] = None,
                 app_id: str = "dpstream", partitioner: str = "murmur2", now_ms: Optional[int] = None,
                 watermark_delay_ms: int = WATERMARK_DELAY_MS, restarts: int = 0, run_nonce: Optional[str] = None,
                 dynamic_partitions: Optional[dict[str, int]] = None):
        """``dynamic_partitions``: each dynamic query's update topic's partition count (default
        1): a topic of several runs in two steps, an :class:`UpdateRouter` on each of its
        partitions and each query's shards on its by-item topic (docs/user-guide.md, "Partitions");
        with a ``unit_field`` in three, the unit step (:class:`UnitBounder`) on its by-unit topic
        between them."""
        self.config = config
        self.dynamic_partitions = {q.input_topic: int((dynamic_partitions or {}).get(q.input_topic, 1)) for q in config.dynamic}
        #: how many times ``dpstream reset`` started this application over (public; epoch topic)
        self.restarts = int(restarts)
        self.watermark_delay_ms = int(watermark_delay_ms)
        self.ownership = ownership
        self.repartitions = repartitions
        self.input_partitions = dict(input_partitions)
        self.partitioner = partitioner
        self.metrics = metrics or PipelineMetrics()
        self.app_id = app_id
        #: since start, for the status page (docs/operations.md, "Status page"): dead letters by
        #: (query, reason category), and each query's last trigger fired here (:meth:`trigger_fired`)
        self.dead_letters: Counter = Counter()
        self.last_fired: dict[str, dict] = {}
        #: since start, the (window, trigger)s fired here per query, whatever the partitions that
        #: fired each (the status page counts triggers, not partitions)
        self.triggers_fired: dict[str, set] = defaultdict(set)
        #: one log line per trigger for the whole worker (processor/adapters/trigger_log.py)
        self.trigger_log = TriggerLog()
        self.state_dir = Path(state_dir)
        check_state_directory(self.state_dir)  # before the layout file is written into it
        #: the run nonce of the noise label (docs/privacy.md, "Noise"): the one the application's
        #: workers agreed on (``run_nonce``; faust_app), which must be the state directory's own;
        #: without one, the state directory's, else a new run's
        stored = stored_run_nonce(self.state_dir)
        if run_nonce is None:
            run_nonce = stored if stored is not None else new_run_nonce()
        elif stored is not None and stored != run_nonce:
            raise StateLayoutError(run_mismatch_message(self.state_dir, stored, run_nonce, app_id, config))
        self.run_nonce = run_nonce
        self.noise = NodeNoise(secret, worker_noise_label(app_id, config, self.restarts, run_nonce))
        # sampler tables built once per state directory, not at every start (state/noise_tables.py)
        keep_tables_in(NoiseTableDirectory.for_state(self.state_dir))
        self.pseudonyms = Pseudonymizer(secret)
        #: what every release says about the run that made it (:func:`run_fields`)
        self.run_fields = run_fields(app_id, config, self.restarts, run_nonce)
        #: the epoch mark this worker's state belongs to; ``previous_mark``: what it recorded
        #: outside its volume when it last started (None: never)
        self.epoch_mark = epoch_mark(config, self.noise, self.restarts, run_nonce)
        self._check_layout(input_partitions, previous_mark)
        self.stores = PartitionStores(self.state_dir, block_cache_mb, write_buffer_mb)
        self.stage1: dict[tuple[str, int], SourcePartition] = {}
        self.stage2: dict[tuple[str, int], SourcePartition] = {}
        #: by input topic: its records' decoder (input_format; a schema registry's client is shared)
        self.decoders = {q.input_topic: decoder_for(config.format_of(q), config.schema_registry, q.input_topic)
                         for q in [*config.queries, *config.dynamic]}
        self.parsers = {q.name: EventParser.for_query(q) for q in config.queries}
        self._plans = {q.name: plan_for(q) for q in config.queries}
        self._by_input: dict[str, list] = defaultdict(list)
        for q in config.queries:
            self._by_input[q.input_topic].append(q)
        self._by_repartition = {self.repartition_topic(q.name): q for q in config.queries}
        #: stage 1's lanes: each query's by-user topic, read with its input topic into the same
        #: state (docs/operations.md, "Writing to the input topic")
        self._by_rerouting = {self.rerouting_topic(q.name): q for q in config.queries}
        #: (by-user topic, partition) -> the stage-1 source it is read into
        self.lanes: dict[tuple[str, int], SourcePartition] = {}
        self._dynamic_queries: dict[str, list] = defaultdict(list)
        for q in config.dynamic:
            self._dynamic_queries[q.input_topic].append(q)
        #: a partitioned update topic's queries: each one's by-item topic (a partition per shard)
        self._by_item = {self.item_topic(q.name): q for q in config.dynamic if self.partitioned(q.input_topic)}
        #: ... and, with a unit_field, its by-unit topic (a partition per unit step)
        self._by_unit = {self.unit_topic(q.name): q for q in config.dynamic
                         if self.partitioned(q.input_topic) and q.unit_field is not None}
        self._dynamic_plans: dict = {}
        # the budget ledger: each window is charged as the wall clock reaches it, from the
        # schedule's public start (budget.start, else this worker's first start, kept in state).
        # Never changelogged: every worker computes the same ledger from the public schedule
        ledger_store = self.stores.store(LEDGER_STORE)
        check_noise_epoch(ledger_store, self.noise)
        self.ledger = open_ledger(config, ledger_store)
        self.gate = BudgetGate(config, self.ledger) if self.ledger is not None else None
        self.charges: Optional[ChargeSchedule] = None
        self.schedule_start: Optional[int] = None
        if self.gate is not None:
            start = config.budget.start_ms
            if start is None:
                mark = IntegerMark(ledger_store, b"schedule-start")
                start = mark.get()
                if start is None:
                    start = int(now_ms if now_ms is not None else time.time() * 1000)
                    batch = WriteBatch()
                    mark.put(batch, start)
                    ledger_store.write(batch)
            self.schedule_start = start
            # every query's windows, owned or not, in the schedule's one order: the same ledger on
            # every worker (processor/engine/budget.py)
            self.charges = ChargeSchedule(self.gate, config.queries, start, ledger_store)
        # dynamic queries: an update topic of one partition is owned by the worker that owns
        # partition 0; one of several has its partitions (routers) and its by-item topics' (shards)
        self.dynamic: dict[tuple[str, int], SourcePartition] = {}  # update topic partitions
        self.dynamic_shards: dict[tuple[str, int], SourcePartition] = {}  # by-item topic partitions
        self.dynamic_units: dict[tuple[str, int], SourcePartition] = {}  # by-unit topic partitions
        self.unit_bounders: dict[tuple[str, int], UnitBounder] = {}
        self.dynamic_routers: dict[tuple[str, int], list[UpdateRouter]] = {}
        self.dynamic_states: dict[tuple[str, int], list[DynamicQueryState]] = defaultdict(list)
        if ownership is not None:  # static: every owned partition now (group: as the group assigns them)
            for topic in self._by_input:
                for p in ownership.partitions(input_partitions[topic]):
                    self.add_source(topic, p, self._open(f"{topic}-{p}"))
            for topic in self._by_repartition:
                for p in ownership.partitions(repartitions):
                    self.add_source(topic, p, self._open(f"{topic}-{p}"))
            for topic in self._dynamic_queries:
                for p in ownership.partitions(self.dynamic_partitions[topic]):
                    self.add_source(topic, p, self._open(f"{topic}-{p}"))
            for topic, q in self._by_item.items():
                for k in ownership.partitions(q.shards):
                    self.add_source(topic, k, self._open(f"{topic}-{k}"))
            for topic, q in self._by_unit.items():
                for j in ownership.partitions(unit_step_partitions(q)):
                    self.add_source(topic, j, self._open(f"{topic}-{j}"))

    # ------------------------------------------------------------------ sources
    def source_topics(self) -> list[str]:
        """Every topic whose partitions this application's workers read (and own by partition)."""
        return [*self._by_input, *self._by_repartition, *self._dynamic_queries, *self._by_item, *self._by_unit]

    def partitioned(self, topic: str) -> bool:
        """Whether a dynamic update topic has several partitions (routed to shards)."""
        return self.dynamic_partitions.get(topic, 1) > 1

    def item_topic(self, query_name: str) -> str:
        """This application's and epoch's by-item topic of a dynamic query (:func:`item_topic`)."""
        return item_topic(query_name, self.app_id, worker_epoch(self.config, self.restarts))

    def unit_topic(self, query_name: str) -> str:
        """This application's and epoch's by-unit topic of a dynamic query (:func:`unit_topic`)."""
        return unit_topic(query_name, self.app_id, worker_epoch(self.config, self.restarts))

    def routed_topic(self, query: DynamicQueryConfig) -> str:
        """Where a partitioned update topic's routers send a query's updates: its unit step with
        a unit bound, else its shards."""
        return self.item_topic(query.name) if query.unit_field is None else self.unit_topic(query.name)

    def add_source(self, topic: str, partition: int, store: Store) -> SourcePartition:
        """Own ``topic``'s ``partition``, its state in ``store`` (restored first when it moved)."""
        key = (topic, partition)
        if topic in self._by_repartition:
            q = self._by_repartition[topic]
            # a stage 2 releases the public keys (if declared) stage 1 routes to its partition
            source = SourcePartition(topic, partition, store, [QueryPipeline(q, self.noise, store, self.pseudonyms,
                                                                             index=self.config.queries.index(q),
                                                                             key_partition=(partition, self.repartitions))])
            if self.gate is not None:
                for pipe in source.pipelines:
                    pipe.set_schedule(self.gate.window_gate(pipe.query), self.schedule_start)
            self.stage2[key] = source
        elif topic in self._by_input:
            source = SourcePartition(topic, partition, store, [QueryPipeline(q, self.noise, store, self.pseudonyms,
                                                                             index=self.config.queries.index(q))
                                                               for q in self._by_input[topic]])
            self.stage1[key] = source
            for q in self._by_input[topic]:
                lane = self.rerouting_topic(q.name)
                source.add_lane(lane)
                self.lanes[(lane, partition)] = source
        elif topic in self._dynamic_queries and self.partitioned(topic):
            source = SourcePartition(topic, partition, store, [])
            self.dynamic[key] = source
            self.dynamic_routers[key] = []
            for q in self._dynamic_queries[topic]:
                if DynamicTables(store, q.name).pinned_plan() is not None:
                    # its counters ran on the topic's one partition: shards starting afresh would
                    # release its positions again, with the same noise, on other data
                    raise StateLayoutError(
                        f"{source.name}: dynamic query {q.name!r} ran on this update topic when it had one partition; now it "
                        f"has {self.dynamic_partitions[topic]}: its state cannot move to shards. Use a new query name or a new "
                        f"budget.epoch (docs/user-guide.md, \"Partitions\")")
                router = UpdateRouter(q, partition, self.watermark_delay_ms, index=self.config.dynamic.index(q),
                                      pseudonyms=self.pseudonyms)
                router.refused = self.gate is not None and not self.gate.start_dynamic(q)
                self.dynamic_routers[key].append(router)
        elif topic in self._by_unit:
            q = self._by_unit[topic]
            source = SourcePartition(topic, partition, store, [])
            self.dynamic_units[key] = source
            bounder = self.unit_bounders[key] = UnitBounder(q, partition, store, index=self.config.dynamic.index(q))
            bounder.refused = self.gate is not None and not self.gate.start_dynamic(q)
            # what it bounded through is what it announces to the shards (the committed input watermarks)
            source.read_ms = source.input_watermark(q.input_topic, self.dynamic_partitions[q.input_topic])
        elif topic in self._dynamic_queries or topic in self._by_item:
            source = SourcePartition(topic, partition, store, [])
            queries = [self._by_item[topic]] if topic in self._by_item else self._dynamic_queries[topic]
            (self.dynamic_shards if topic in self._by_item else self.dynamic)[key] = source
            for q in queries:
                state = DynamicQueryState(q, self.noise, self.pseudonyms, store, index=self.config.dynamic.index(q),
                                          shard=partition if topic in self._by_item else None)
                if self.gate is not None:
                    state.refused = not self.gate.start_dynamic(q)
                self.dynamic_states[key].append(state)
        else:
            raise KeyError(f"{topic} is not a topic this application reads")
        return source

    def remove_source(self, topic: str, partition: int) -> None:
        """Give up a partition (it moved to another worker): its store is closed, its data kept
        on this volume for an incremental restore should it come back (state/changelog.py)."""
        key = (topic, partition)
        source = self.stage1.get(key)
        if source is not None:
            for lane in source.lanes:
                self.lanes.pop((lane, partition), None)
        for table in (self.stage1, self.stage2, self.dynamic, self.dynamic_shards, self.dynamic_routers, self.dynamic_units,
                      self.unit_bounders):
            table.pop(key, None)
        self.dynamic_states.pop(key, None)
        self.stores.release(f"{topic}-{partition}")

    def restore(self, topic: str, partition: int, read_changelog, now_ms: int) -> ChangelogStore:
        """Elastic workers: the store of a gained partition, made equal to its committed
        changelog before anything is processed (docs/operations.md, "Elastic workers").
        ``read_changelog(start)`` gives the changelog's end offset and batches of ``(offset,
        key, value)`` from ``start`` to there. Blocking: run off the event loop, then :meth:`add_source`."""
        name = f"{topic}-{partition}"
        gauge, counter = self.metrics.restore_remaining.labels(name), self.metrics.restored_records.labels(name)
        started = time.perf_counter()

        def progress(applied: int, last: int, end: int) -> None:
            gauge.set(max(0, end - last - 1))
            counter.inc(applied - progress.applied)
            if applied // 200_000 > progress.applied // 200_000:
                log.info("%s: restoring, %d changelog records so far (offset %d of %d)", name, applied, last, end)
            progress.applied = applied

        progress.applied = 0
        done = restore_from_changelog(self.stores, name, read_changelog, now_ms, progress)
        gauge.set(0)
        seconds = time.perf_counter() - started
        self.metrics.restore_seconds.labels(name).observe(seconds)
        log.info("%s: restored (%s, from changelog offset %d): %d records in %.2f s", name,
                 "full" if done.full else "incremental", done.start, done.records, seconds)
        check_noise_epoch(done.store, self.noise)
        return done.store

    def changelog_messages(self, sources: Iterable[SourcePartition]) -> tuple[list[Message], list[tuple[SourcePartition, int]]]:
        """Elastic workers: every change the stores of ``sources`` made since their last
        transaction, as changelog records for the next one, and the sequence numbers they reach
        (for :meth:`checkpoint` once it committed)."""
        messages, taken = [], []
        for source in sources:
            if not isinstance(source.store, ChangelogStore):
                continue
            changes, seq = source.store.take_changes()
            if not changes:
                continue
            topic = self.changelog_topic(source.topic)
            for key, value in changes:
                if value is not None and len(value) > CHANGELOG_MAX_BYTES:
                    raise StateLayoutError(f"{source.name}: a state value of {len(value)} bytes is over the changelog's "
                                           f"{CHANGELOG_MAX_BYTES} bytes: lower --fetch-records")
                messages.append(Message(topic, value, key, source.partition))
            taken.append((source, seq))
        return messages, taken

    def checkpoint(self, taken: list[tuple[SourcePartition, int]], acknowledged: dict[tuple[str, int], int], now_ms: int) -> None:
        """The transaction carrying ``taken``'s changes committed (``acknowledged``: the
        publisher's offsets of them): each store now equals its changelog up to there."""
        for source, seq in taken:
            offset = acknowledged.get((self.changelog_topic(source.topic), source.partition))
            if offset is not None:
                source.store.checkpoint(offset, seq, now_ms)

    def repartition_topic(self, query_name: str) -> str:
        """This application's and epoch's stage 1 -> stage 2 topic of a query."""
        return repartition_topic(query_name, self.app_id, worker_epoch(self.config, self.restarts))

    def rerouting_topic(self, query_name: str) -> str:
        """This application's and epoch's stage 1 -> stage 1 topic of a query (:func:`rerouting_topic`)."""
        return rerouting_topic(query_name, self.app_id, worker_epoch(self.config, self.restarts))

    def rerouting_topics(self) -> dict[str, str]:
        """Every query's by-user topic -> its input topic (the by-user topic has its partitions)."""
        return {lane: q.input_topic for lane, q in self._by_rerouting.items()}

    def changelog_topic(self, source_topic: str) -> str:
        return changelog_topic(self.app_id, worker_epoch(self.config, self.restarts), source_topic)

    # ------------------------------------------------------------------ setup
    def _check_layout(self, input_partitions: dict[str, int], previous_mark: Optional[dict] = None) -> None:
        """Ownership is static; a state directory written under another layout (worker index,
        worker count or partition counts) would hold some partitions' state and miss others'.

        A state directory with no layout is new. If this worker already ran under the same
        budget epoch and noise secret, its state (ledger, user counts, journal) was lost:
        starting afresh would forget spent budget and could release different values for
        (window, key, trigger) already released with the same noise. Refused before anything is
        written, so the refusal stands on every restart until a new epoch is configured."""
        layout_path = self.state_dir / LAYOUT_FILE
        if self.ownership is None:
            # elastic workers: the volume is a cache of the changelogs, a lost one is restored
            # from them (the changelogs themselves are checked: faust_app, changelog marks)
            mine = {"assignment": "group", "input_partitions": dict(sorted(input_partitions.items())),
                    "repartitions": self.repartitions}
        elif not layout_path.exists() and previous_mark is not None and \
                {k: previous_mark.get(k) for k in self.epoch_mark} == self.epoch_mark:
            raise LostStateError(lost_state_message(
                f"state directory {self.state_dir} is empty, but worker {self.ownership.index} of application "
                f"{self.app_id!r} already ran under epoch {worker_epoch(self.config, self.restarts)!r}, this noise secret "
                f"and noise label {self.noise.label} (since {previous_mark.get('since_ms')} ms): its state was lost",
                self.app_id, self.config))
        if self.ownership is not None:
            mine = {"worker_index": self.ownership.index, "workers": self.ownership.workers,
                    "input_partitions": dict(sorted(input_partitions.items())), "repartitions": self.repartitions}
        if any(n > 1 for n in self.dynamic_partitions.values()):  # (left out otherwise: the layout of state before them)
            mine["dynamic_partitions"] = dict(sorted(self.dynamic_partitions.items()))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / LAYOUT_FILE
        if path.exists():
            stored = json.loads(path.read_text())
            if stored != mine:
                raise StateLayoutError(f"state directory {self.state_dir} was written by worker layout {stored}, this worker is "
                                       f"{mine}; moving partitions would move their state: keep the layout, or start a new "
                                       f"epoch (new state, new noise secret)")
        run_path = self.state_dir / RUN_FILE
        if not run_path.exists():  # before the layout file: a directory with a layout has its run
            written = run_path.with_suffix(".tmp")
            written.write_text(json.dumps({"app_id": self.app_id, "nonce": self.run_nonce, "noise_label": self.noise.label},
                                          sort_keys=True))
            os.replace(written, run_path)
        if not path.exists():
            path.write_text(json.dumps(mine, sort_keys=True))

    def _open(self, name: str) -> Store:
        store = self.stores.store(name)
        check_noise_epoch(store, self.noise)
        return store

    def close(self) -> None:
        self.stores.close()

    def owned_counts(self) -> dict[str, int]:
        """How many partitions of each source topic this worker owns."""
        counts = Counter(topic for topic, _ in [*self.stage1, *self.stage2, *self.dynamic, *self.dynamic_shards, *self.dynamic_units])
        return {topic: counts.get(topic, 0) for topic in self.source_topics()}

    def source_of(self, key: tuple[str, int]) -> Optional[SourcePartition]:
        """The owned source partition ``(topic, partition)`` (for a by-user topic's partition: the
        stage-1 source it is read into), None if not owned (now)."""
        return self.stage1.get(key) or self.stage2.get(key) or self.dynamic.get(key) or self.dynamic_shards.get(key) or \
            self.dynamic_units.get(key) or self.lanes.get(key)

    @property
    def sources(self) -> list[SourcePartition]:
        return [*self.stage1.values(), *self.stage2.values(), *self.dynamic.values(), *self.dynamic_shards.values(),
                *self.dynamic_units.values()]

    def _dynamic_source(self, key: tuple[str, int]) -> SourcePartition:
        """The source a dynamic query's step reads: an update topic's partition, a by-item or a by-unit one."""
        return self.dynamic.get(key) or self.dynamic_shards.get(key) or self.dynamic_units[key]

    def pipelines(self) -> Iterable[QueryPipeline]:
        for src in self.sources:
            yield from src.pipelines

    # ------------------------------------------------------------------ stage 1
    # Stage 1 bounds a user's contributions in the state of the input partition its user id maps
    # to (--partitioner; docs/privacy.md, "Failures"). An event read anywhere else is sent there
    # through the query's by-user topic, whose partition p is read into input partition p's state
    # (its lane): a user's events are bounded in one state whatever partition its producer chose.
    def process_input(self, topic: str, partition: int, records: Sequence[RecordLike]) -> Optional[StageOneResult]:
        """Bound a batch of input records of one partition; nothing is written yet."""
        return self.process_stage_one(self.stage1[(topic, partition)], {topic: records})[0]

    def process_batch(self, stage: str, items) -> tuple[list, list]:
        """One dispatched batch of ``stage``: ``items`` are (topic, partition, records, source).
        Returns the results to send and commit, and the items to read again with the next batch
        (:meth:`process_stage_one`)."""
        if stage != "stage1":
            step = self.process_repartitioned if stage == "stage2" else self.process_dynamic
            return [r for topic, partition, records, _ in items if (r := step(topic, partition, records)) is not None], []
        grouped: dict[int, tuple[SourcePartition, dict]] = {}
        for topic, _, records, source in items:
            grouped.setdefault(id(source), (source, {}))[1][topic] = records
        results, again = [], []
        for source, lanes in grouped.values():
            result, rest = self.process_stage_one(source, lanes)
            if result is not None:
                results.append(result)
            again += [(lane, source.partition, recs, source) for lane, recs in rest.items()]
        return results, again

    def process_stage_one(self, source: SourcePartition, lanes: dict[str, Sequence[RecordLike]]
                          ) -> tuple[Optional[StageOneResult], dict[str, list]]:
        """Bound a batch of a stage-1 partition's records (``lanes``: input or by-user topic ->
        its records), all in one pass: the state is read as committed, so two passes of one batch
        would both see a user's count from before it. Returns the result (nothing is written
        yet), and records to hand back for the next batch.

        After a crash the first batch must be the one that was in flight (:attr:`SourcePartition.replay`),
        in the same lane order, so that each record gets the (user, slot) it got then: records
        past it wait (they are handed back). Exactly once, its outputs were delivered: it goes
        into the state with nothing sent, and the rest follows at once."""
        pending = {}
        for lane in source.lane_order:
            recs = lanes.get(lane)
            if not recs:
                continue
            done = source.lane_offset(lane)
            if recs[0].offset <= done:
                recs = [r for r in recs if r.offset > done]  # redelivered: already in state
            if recs:
                pending[lane] = list(recs)
        if source.replay:  # a lane gone since (its query removed) is nothing to wait for
            source.replay = {lane: o for lane, o in source.replay.items() if lane in source.lane_order}
        if source.replay:
            chunk, rest, complete = self._replay_chunk(source, pending)
            if source.replay_sends or not complete:
                if not source.replay_sends and chunk:
                    self._bound_lanes(source, chunk).commit()
                    chunk = {}
                return (self._bound_lanes(source, chunk) if chunk else None), rest
            if chunk:
                self._bound_lanes(source, chunk).commit()
            pending = rest
        return (self._bound_lanes(source, pending) if pending else None), {}

    @staticmethod
    def _replay_chunk(source: SourcePartition, pending: dict[str, list]) -> tuple[dict, dict, bool]:
        """``pending`` split into the longest prefix of the replayed batch (lane by lane, in lane
        order) and the rest; whether the prefix is the whole replayed batch."""
        chunk, rest, blocked = {}, {}, False
        for lane in source.lane_order:
            recs = pending.get(lane, [])
            upto = source.replay.get(lane)
            if blocked or upto is None:
                if recs:
                    rest[lane] = recs
                continue
            k = sum(1 for r in recs if r.offset <= upto)
            if k:
                chunk[lane] = recs[:k]
            if recs[k:]:
                rest[lane] = recs[k:]
            blocked = not k or recs[k - 1].offset < upto
        return chunk, rest, not blocked

    def _bound_lanes(self, source: SourcePartition, lanes: dict[str, list]) -> StageOneResult:
        topic = source.topic
        records = lanes.get(topic, [])
        result = StageOneResult(source, WriteBatch(), records[-1].offset if records else source.last_offset)
        parsed, stamps = None, None
        if records:
            stamps = np.fromiter(map(_TIMESTAMP, records), dtype=np.int64, count=len(records))
            result.read_ms = broker_stamped_max(records)
            parsed = self.decoders[topic].decode(list(map(_VALUE, records)))  # once for every query
        for runner in source.runners:
            q = runner.query
            here = self._parse_input(runner, source, records, parsed, stamps, result) if records else None
            lane = self.rerouting_topic(q.name)
            moved = self._take_lane(lane, lanes.get(lane), result)
            parts = [p for p in (here, moved) if p is not None and len(p)]
            if parts:
                self._bound_events(runner, RoutedEvents.concat(parts), records, result)
        return result

    def _parse_input(self, runner: QueryRunner, source: SourcePartition, records: list, parsed, stamps: np.ndarray,
                     result: StageOneResult) -> RoutedEvents:
        """A query's events of input records: the invalid ones dead-lettered, those of users that
        another partition owns sent there (by-user topic), the rest returned for bounding here."""
        pipe, q = runner.pipeline, runner.query
        topic, partition = source.topic, source.partition
        parsed_events = self.parsers[q.name].parse_batch(parsed)  # per batch: columns, not one object per record
        for i, reason in sorted(dict(parsed_events.invalid).items()):
            result.invalid[(q.name, reason)] += 1
            result.messages.append(self._letter(q.name, reason, records[i].value or b"", f"{topic}/{partition}@{records[i].offset}"))
        pipe.stats.events_in += len(parsed_events.invalid)
        pipe.stats.dropped["malformed"] += len(parsed_events.invalid)
        kept = parsed_events.index
        if not len(kept):
            return None
        user_ids = [u.encode() for u in parsed_events.users]
        keys = parsed_events.keys
        # origin -1: "offsets" are positions in this batch's records (no per-record offset read
        # on the direct path); the events that move get their partition and offset
        events = RoutedEvents(self.pseudonyms.encoded_users(user_ids), self.pseudonyms.group_keys(keys),
                              np.array(keys, dtype=object), parsed_events.values, parsed_events.ts, stamps[kept],
                              np.full(len(kept), -1, dtype=np.int64), kept.astype(np.int64))
        home = partition_for(user_ids, self.input_partitions[topic], self.partitioner)
        away = home != partition
        if not away.any():
            return events
        # another partition's users: to it, through the query's by-user topic (pseudonyms only)
        lane = self.rerouting_topic(q.name)
        moving = np.flatnonzero(away)
        for p in np.unique(home[moving]).tolist():
            part = events.take(moving[home[moving] == p])
            part.origins[:] = partition
            part.offsets = np.fromiter((records[i].offset for i in part.offsets.tolist()), dtype=np.int64, count=len(part))
            result.messages.append(Message(lane, part.encode(), None, p))
        self.metrics.rerouted.labels(q.name).inc(len(moving))
        return events.take(np.flatnonzero(~away))

    def _take_lane(self, lane: str, records: Optional[list], result: StageOneResult) -> Optional[RoutedEvents]:
        """A by-user topic's records: its markers (kept with the state) and its events."""
        if not records:
            return None
        result.lanes[lane] = records[-1].offset
        parts = []
        for r in records:
            if r.key == WATERMARK_KEY:
                _, origin, ms = decode_watermark(r.value)
                if ms > result.marks.get((lane, origin), result.source.rerouted_marks.get((lane, origin), -2**63)):
                    result.marks[(lane, origin)] = ms
            else:
                parts.append(RoutedEvents.decode(r.value))
        return RoutedEvents.concat(parts) if parts else None

    def _bound_events(self, runner: QueryRunner, events: RoutedEvents, records: list, result: StageOneResult) -> None:
        """Bound a query's events (this partition's own, then those sent here) and send the
        bounded records on, by key."""
        q = runner.query
        topic, partition = result.source.topic, result.source.partition
        stage_one = runner.stage_one(events.events(), events.stamps, result.batch)
        for e, reason in stage_one.refused:  # late, future and key id collisions (counted by stage 1)
            result.invalid[(q.name, reason)] += 1
            origin, offset = int(events.origins[e]), int(events.offsets[e])
            if origin < 0:  # read here: ``offset`` is its position in the batch
                original, where = records[offset].value, f"{topic}/{partition}@{records[offset].offset}"
            else:  # sent here by the partition it was read on: the dead letter names where it is
                original, where = b"", f"{topic}/{origin}@{offset} (by way of partition {partition})"
            result.messages.append(self._letter(q.name, reason, original or b"", where))
        bounded = stage_one.records
        if not len(bounded):
            return
        # by key; a hierarchy by its level-1 key, so a whole subtree is on one partition and
        # its consistency step sees every level (docs/privacy.md, "Post-processing: hierarchical consistency")
        target = (bounded.roots % np.uint64(self.repartitions)).astype(np.int64)
        out_topic = self.repartition_topic(q.name)
        for p in np.unique(target).tolist():
            for value in encoded_parts(bounded.take(np.nonzero(target == p)[0])):
                result.messages.append(Message(out_topic, value, None, p))

    def _letter(self, query: str, reason: str, original: bytes, source: str) -> Message:
        """A dead letter for ``query``, counted by reason category (:func:`dead_letter_category`)."""
        self.dead_letters[(query, dead_letter_category(reason))] += 1
        return Message(DEAD_LETTER_TOPIC, encode_json({"query": query, **dead_letter(reason, original, source)}))

    # ------------------------------------------------------------------ stage 2
    def process_repartitioned(self, topic: str, partition: int, records: Sequence[RecordLike]) -> Optional[StageTwoResult]:
        """Append bounded records to the pending micro-batches and take in the watermark markers
        among them; nothing is written yet. Returns the dead letters (key id collisions) to send
        before :meth:`StageTwoResult.commit`."""
        source = self.stage2[(topic, partition)]
        records = _undelivered(source, records, lambda done: self._accumulate(source, topic, partition, done))
        return self._accumulate(source, topic, partition, records) if records else None

    def _accumulate(self, source: SourcePartition, topic: str, partition: int, records: Sequence[RecordLike]) -> StageTwoResult:
        runner = source.runners[0]
        result = StageTwoResult(source, WriteBatch(), records[-1].offset, applied=len(records))
        data = [r for r in records if r.key != WATERMARK_KEY]
        source.advance_watermarks(result.batch, (decode_watermark(r.value) for r in records if r.key == WATERMARK_KEY))
        if not data:
            return result
        decoded = [BoundedRecords.decode(r.value) for r in data]
        late_before = runner.pipeline.stats.dropped["late"]
        # one call for the whole batch: its fixed cost (window status, key registration, one blob
        # per (window, trigger)) is paid once, not per message. The last offset is unique within the
        # partition, so pending blobs never collide, and the batch commits with that offset whole
        for text, reason in runner.stage_two(BoundedRecords.concat(decoded), records[-1].offset, result.batch):
            origin = next(r.offset for r, d in zip(data, decoded) if text in d.keys.tolist())
            result.messages.append(self._letter(runner.query.name, reason, text.encode(), f"{topic}/{partition}@{origin}"))
        late = runner.pipeline.stats.dropped["late"] - late_before
        if late:
            # on time at stage 1 yet its trigger fired: a producer's timestamps were more out of
            # order than the watermark delay allows (docs/operations.md, "Time and lateness")
            log.warning("query %s: %d bounded records reached %s after their trigger fired (timestamps out of order by more "
                        "than the watermark delay); counted as late", runner.query.name, late, source.name)
        return result

    # ------------------------------------------------------------------ watermarks
    def watermark_messages(self, now_ms: int, read_to_end: Optional[dict[tuple[str, int], int]] = None) -> list[Message]:
        """Markers announcing how far each owned input partition has been read, to every
        partition of each of its queries' repartition topics: after the bounded records they
        cover were acknowledged (the caller sends only committed progress), so on each
        repartition partition a marker follows the records it covers.

        A partition's watermark is the newest broker-stamped (LogAppendTime) timestamp read from
        it (:func:`broker_stamped_max`: never a producer's), or, once it has been
        read to its end, the time the broker said where its end was (``read_to_end``: input
        partition -> that time; an idle partition must not hold back the schedule), less the
        watermark delay, and never past the wall clock. Stage 2 fires a
        trigger once every input partition's watermark has passed its fire time (docs/privacy.md,
        "Time"), so a worker that was down, or behind, reads its backlog before it fires.

        Stage 2 uses a watermark only to fire triggers, so a partition announces one the first
        time, then only once it has passed another fire time of its queries
        (:meth:`_passes_fire_time`): an idle, caught-up worker writes nothing, and its
        consumer group shows lag 0 (docs/operations.md, "Consumer offsets")."""
        ends = read_to_end or {}
        out = []
        for (topic, p), source in self.stage1.items():
            partitions = self.input_partitions[topic]
            own = source.read_watermark(now_ms, ends.get((topic, p)), self.watermark_delay_ms)
            if own is not None and self._passes_fire_time(source, source.announced_own_ms, own):
                # to every partition of the by-user topics: this partition's events sent there
                # were acknowledged before this marker, so it follows them
                source.announced_own_ms = own
                value = encode_watermark(topic, p, own)
                out.extend(Message(lane, value, WATERMARK_KEY, r) for lane in source.lanes for r in range(partitions))
            moved = source.rerouted_watermark(partitions)
            mark = None if own is None or moved is None else min(own, moved)
            if mark is None or not self._passes_fire_time(source, source.announced_ms, mark):
                continue
            source.announced_ms = mark
            value = encode_watermark(topic, p, mark)
            for pipe in source.pipelines:
                out.extend(Message(self.repartition_topic(pipe.query.name), value, WATERMARK_KEY, q) for q in range(self.repartitions))
        out += self._update_watermark_messages(now_ms, ends)
        return out

    def _update_watermark_messages(self, now_ms: int, ends: dict) -> list[Message]:
        """A partitioned update topic's partitions' watermarks, to every shard of their queries:
        after the routed updates they cover were acknowledged, so on each by-item partition a
        marker follows them; each time it lets a shard decide another tick. A shard decides a
        tick once every update partition's marker has passed its decision time."""
        out = []
        for key, routers in self.dynamic_routers.items():
            source = self.dynamic[key]
            own = source.read_watermark(now_ms, ends.get(key), self.watermark_delay_ms)
            before = source.announced_ms
            if own is None or (before is not None and
                               all(r.query.decided_through(own) <= r.query.decided_through(before) for r in routers)):
                continue
            source.announced_ms = own
            value = encode_watermark(key[0], key[1], own)
            for r in routers:
                steps = r.query.shards if r.query.unit_field is None else unit_step_partitions(r.query)
                out.extend(Message(self.routed_topic(r.query), value, WATERMARK_KEY, k) for k in range(steps))
        # a unit step's: the input watermark it bounded through (committed), after the updates it admitted
        for key, bounder in self.unit_bounders.items():
            source, q = self.dynamic_units[key], bounder.query
            own, before = source.read_ms, source.announced_ms
            if own is None or (before is not None and q.decided_through(own) <= q.decided_through(before)):
                continue
            source.announced_ms = own
            value = encode_watermark(key[0], key[1], own)
            out.extend(Message(self.item_topic(q.name), value, WATERMARK_KEY, k) for k in range(q.shards))
        return out

    @staticmethod
    def _passes_fire_time(source: SourcePartition, announced: Optional[int], mark: int) -> bool:
        """Whether stage 2 needs ``mark`` announced: nothing announced yet (since start), or a
        fire time of one of ``source``'s queries lies in (announced, mark]."""
        if announced is None:
            return True
        return mark > announced and any(_fire_time_between(pipe.schedule, announced, mark) for pipe in source.pipelines)

    def stage_two_clock(self, source: SourcePartition, now_ms: int) -> Optional[int]:
        """The clock stage 2 fires a partition's triggers by: the input watermark, never past the
        wall clock (None until every input partition has announced one)."""
        mark = self._input_watermark(source)
        return None if mark is None else min(mark, now_ms)

    def _input_watermark(self, source: SourcePartition) -> Optional[int]:
        topic = source.pipelines[0].query.input_topic
        return source.input_watermark(topic, self.input_partitions[topic])

    # ------------------------------------------------------------------ dynamic queries
    def process_dynamic(self, topic: str, partition: int, records: Sequence[RecordLike]
                        ) -> "Optional[StageOneResult | StageTwoResult]":
        """Log update records (judged late or future by each record's own Kafka timestamp): the
        update log, unit counts and offset in one write, committed after its dead letters are
        sent. Ticks are decided by the timer (:meth:`advance_dynamic`), never by the arrival of
        updates. On an update topic of several partitions, a partition's records are routed to
        their shards instead (:meth:`_route_updates`), and a by-item partition logs what it is
        sent (:meth:`_take_routed`)."""
        key = (topic, partition)
        step = self._take_routed if key in self.dynamic_shards else self._route_updates if key in self.dynamic_routers \
            else self._bound_units if key in self.unit_bounders else self._log_updates
        source = self._dynamic_source(key)
        records = _undelivered(source, records, lambda done: step(key, done))
        return step(key, records) if records else None

    def _route_updates(self, key: tuple[str, int], records: Sequence[RecordLike]) -> StageOneResult:
        """A partition of a partitioned update topic: each query's updates to the by-item
        partitions of their shards (in one transaction with the offset, exactly once), the
        refused records dead-lettered. Its watermark follows to every shard once the batch is
        acknowledged (:meth:`watermark_messages`)."""
        topic, partition = key
        source = self.dynamic[key]
        messages = []
        objs = self.decoders[topic].decode([r.value for r in records])
        stamps = [r.timestamp for r in records]
        offsets = [r.offset for r in records]
        for router in self.dynamic_routers[key]:
            routed, reasons = router.route(objs, stamps, offsets)
            out = self.routed_topic(router.query)
            # parts under the broker's message size: a backlog's batch holds many updates per shard
            messages += [Message(out, part, None, k) for k, updates in sorted(routed.items()) for part in encoded_parts(updates)]
            for r, reason in zip(records, reasons):
                if reason is not None:
                    messages.append(self._letter(router.query.name, reason, r.value or b"", f"{topic}/{partition}@{r.offset}"))
        return StageOneResult(source, WriteBatch(), records[-1].offset, messages, read_ms=broker_stamped_max(records))

    def _take_routed(self, key: tuple[str, int], records: Sequence[RecordLike]) -> StageTwoResult:
        """A by-item partition: its shard logs the updates it was sent (each once), and takes in
        the update topic's partitions' watermarks (kept with the offset)."""
        source = self.dynamic_shards[key]
        result = StageTwoResult(source, WriteBatch(), records[-1].offset, applied=len(records))
        source.advance_watermarks(result.batch, (decode_watermark(r.value) for r in records if r.key == WATERMARK_KEY))
        for st in self.dynamic_states[key]:
            late = sum(st.take_routed(RoutedUpdates.decode(r.value), result.batch) for r in records if r.key != WATERMARK_KEY)
            if late:
                log.warning("dynamic query %s: %d updates reached %s after their tick was decided (the broker's and this "
                            "worker's clocks differ by more than the watermark delay); counted as late", st.query.name, late,
                            source.name)
        return result

    def _bound_units(self, key: tuple[str, int], records: Sequence[RecordLike]) -> StageOneResult:
        """A by-unit partition: its unit step logs the updates it was sent (each once) and takes
        in the update topic's partitions' watermarks; once their least has passed a tick, it
        bounds the tick's updates and sends the admitted ones to their shards, in one
        transaction with its offset (at least once: before its state is written). Its own
        watermark follows them to every shard once they are acknowledged (:meth:`watermark_messages`)."""
        source, bounder = self.dynamic_units[key], self.unit_bounders[key]
        q = bounder.query
        batch = WriteBatch()
        source.advance_watermarks(batch, (decode_watermark(r.value) for r in records if r.key == WATERMARK_KEY))
        late = sum(bounder.take(UnitRoutedUpdates.decode(r.value), batch) for r in records if r.key != WATERMARK_KEY)
        if late:
            log.warning("dynamic query %s: %d updates reached %s after their tick was bounded (the broker's and this "
                        "worker's clocks differ by more than the watermark delay); counted as late", q.name, late, source.name)
        clock = source.input_watermark(q.input_topic, self.dynamic_partitions[q.input_topic])
        admitted = None if clock is None else bounder.bound(clock, batch)
        messages = [] if not admitted else [Message(self.item_topic(q.name), part, None, k)
                                             for k, updates in sorted(admitted.items()) for part in encoded_parts(updates)]
        return StageOneResult(source, batch, records[-1].offset, messages, read_ms=None if admitted is None else clock)

    def _log_updates(self, key: tuple[str, int], records: Sequence[RecordLike]) -> StageOneResult:
        topic, partition = key
        source = self.dynamic[key]
        batch, messages = WriteBatch(), []
        objs = self.decoders[topic].decode([r.value for r in records])
        clocks = [r.timestamp for r in records]  # each judged "future" against its own Kafka timestamp
        for st in self.dynamic_states[key]:
            for r, reason in zip(records, st.apply_records(objs, batch, clocks)):
                if reason is not None:
                    messages.append(self._letter(st.query.name, reason, r.value or b"", f"{topic}/{partition}@{r.offset}"))
        return StageOneResult(source, batch, records[-1].offset, messages, read_ms=broker_stamped_max(records))

    def advance_dynamic(self, now_ms: int, read_to_end: Optional[dict[tuple[str, int], int]] = None
                        ) -> list[tuple[str, int]]:
        """Decide every dynamic tick the update topic's watermark has passed, updates or not (the
        timer's job): as for triggers, the watermark is the newest broker-stamped timestamp read
        from it (:func:`broker_stamped_max`), or the time it was read to its end (``read_to_end``),
        less the watermark delay, never past the wall clock; so a worker that was down reads the
        updates of an overdue tick before it decides it (an update is late once its tick is
        decided). Deciding refuses nothing (every logged update is taken in: docs/privacy.md,
        "Dynamic counts"). Returns the sources with releases to send (then
        :meth:`mark_dynamic_published`); the decisions are written at once (a crash before the
        releases are sent recomputes them from the update log)."""
        due = []
        ends = read_to_end or {}
        for key, states in self.dynamic_states.items():
            source = self._dynamic_source(key)
            if key in self.dynamic_shards:  # a shard: every update topic partition's watermark (or unit step's)
                mark = self._shard_watermark(key)
                clock = None if mark is None else min(mark, now_ms)
            else:
                clock = source.read_watermark(now_ms, ends.get(key), self.watermark_delay_ms)
            if clock is None:
                continue  # nothing known about the update topic yet: decide nothing
            batch = WriteBatch()
            for st in states:
                st.advance_clock(clock, batch, max_ticks=DYNAMIC_TICKS_PER_STEP)
            if len(batch):
                source.store.write(batch)
            if any(st.pending for st in states):
                due.append(key)
        return due

    def _shard_watermark(self, key: tuple[str, int]) -> Optional[int]:
        """A shard's input watermark: the least of its query's update topic partitions' (with a
        unit bound: of its unit steps'; None until each announced one)."""
        q = self.dynamic_states[key][0].query
        if q.unit_field is not None:
            return self.dynamic_shards[key].input_watermark(self.unit_topic(q.name), unit_step_partitions(q))
        return self.dynamic_shards[key].input_watermark(q.input_topic, self.dynamic_partitions[q.input_topic])

    def dynamic_releases(self, key: tuple[str, int]) -> list[Message]:
        return [Message(st.query.output_topic, encode_json({**rec, **self.run_fields}), st.query.name.encode())
                for st in self.dynamic_states[key] for rec in st.take_pending()]

    def mark_dynamic_published(self, key: tuple[str, int], through: Optional[dict[str, int]] = None) -> None:
        """The pending dynamic releases reached the output (``through``: only those up to each
        query's release number, :attr:`DynamicRelease.sequence`, by query name)."""
        batch = WriteBatch()
        for st in self.dynamic_states[key]:
            if through is None or st.query.name in through:
                st.mark_published(batch, None if through is None else through[st.query.name])
        if len(batch):
            self._dynamic_source(key).store.write(batch)

    def dynamic_published_messages(self, key: tuple[str, int]) -> list[Message]:
        """Exactly once: the progress records of the pending dynamic releases (sent with them)."""
        source = self._dynamic_source(key)
        # "segment": the release number (the segment itself with one shard, as before shards)
        return [Message(PROGRESS_TOPIC, encode_json({"segment": st.pending[-1].sequence}),
                        f"{self.app_id}/{source.name}/published/{st.query.name}".encode())
                for st in self.dynamic_states[key] if st.pending]

    def prepare_noise_tables(self) -> None:
        """Build every query's sampler tables (:func:`prepare_noise_tables`): the worker's run
        calls this in a thread at start, and its first trigger waits for it there, not on the
        event loop (docs/architecture.md, "Noise tables")."""
        for query in self.config.queries:
            prepare_noise_tables(query, self.noise)

    def fire_due(self, now_ms: int) -> list[FiredTrigger]:
        """Open (charge) the windows the wall clock has reached, and fire every owned trigger whose
        fire time (its time plus the allowed lateness) every input partition's watermark has
        passed (:meth:`stage_two_clock`). Which records a trigger holds is fixed by the schedule
        and each record's Kafka timestamp; the watermark only decides when all of them have been
        read. Releases are journaled on return."""
        return list(self.iter_fire_due(now_ms))

    def iter_fire_due(self, now_ms: int) -> Iterator[FiredTrigger]:
        """:meth:`fire_due`, one trigger at a time (each journaled as it is yielded): the worker
        publishes each before it computes the next, so a backlog of overdue triggers does not
        hold its event loop (health probes, /metrics) for all of them at once."""
        if self.charges is not None:
            self.charges.charge_due(now_ms)
        for source in self.stage2.values():
            runner = source.runners[0]
            due = runner.fire_due(self.stage_two_clock(source, now_ms), open_clock_ms=now_ms)
            while True:
                started = time.perf_counter()
                f = next(due, None)
                if f is None:
                    break
                self.metrics.observe_trigger(runner.query.name, time.perf_counter() - started)
                yield FiredTrigger(source, f, started)

    def fire_next(self, source: SourcePartition, now_ms: int) -> Optional[FiredTrigger]:
        """Elastic workers: open the windows the wall clock has reached on one owned stage-2
        partition and fire its next due trigger (as :meth:`iter_fire_due`), or None. The caller
        holds the partition's transaction: the state written here goes out in the same one as
        the releases (docs/operations.md, "Elastic workers")."""
        runner = source.runners[0]
        runner.pipeline.open_due(now_ms)
        nxt = runner.next_due(self.stage_two_clock(source, now_ms))
        if nxt is None:
            return None
        started = time.perf_counter()
        fired = runner.fire(nxt[1], nxt[2])
        self.metrics.observe_trigger(runner.query.name, time.perf_counter() - started)
        return FiredTrigger(source, fired, started)

    def unpublished(self) -> list[FiredTrigger]:
        """Journaled releases not yet marked published (after a crash): send them again."""
        return [FiredTrigger(source, f) for source in self.stage2.values() for runner in source.runners for f in runner.unpublished()]

    # ------------------------------------------------------------------ exactly once
    # With --delivery exactly-once, every send is one Kafka transaction that also carries a
    # progress record (dpstream.topics.kafka.PROGRESS_TOPIC) saying which inputs' outputs, or which
    # triggers' releases, it completes. The state is committed after the transaction; a crash in
    # between leaves the state behind the progress topic, and :meth:`resume` tells the restarted
    # worker what not to send again (docs/operations.md, "Delivery").
    def resume(self, progress: dict[str, dict]) -> None:
        """Take in what the progress topic says was delivered (:func:`dpstream.topics.kafka.read_progress`):
        records up to each source's delivered offset are applied to the state with no output
        sent, and journaled triggers up to its published one are marked published, not sent."""
        for source in self.stage2.values():
            done = progress.get(source.name)
            source.delivered_offset = int(done["offset"]) if done else -1
        for source in self.stage1.values():
            done = progress.get(source.name)
            offsets = {source.topic: int(done["offset"]), **{k: int(v) for k, v in done.get("lanes", {}).items()}} if done else {}
            replay = {lane: o for lane, o in offsets.items() if lane in source.lane_order and o > source.lane_offset(lane)}
            if replay:  # the last batch's outputs are out: it goes into the state as it was, nothing sent
                source.replay, source.replay_sends = replay, False
        for f in self.unpublished():
            done = progress.get(f"{f.source.name}/published")
            if done and (f.window, f.trigger) <= (int(done["window"]), int(done["trigger"])):
                self.mark_published(f)
        for source in [*self.dynamic.values(), *self.dynamic_shards.values(), *self.dynamic_units.values()]:
            source.delivered_offset = int(progress[source.name]["offset"]) if source.name in progress else -1
        for key, states in self.dynamic_states.items():
            source = self._dynamic_source(key)
            through = {st.query.name: int(progress[f"{source.name}/published/{st.query.name}"]["segment"])
                       for st in states if f"{source.name}/published/{st.query.name}" in progress}
            self.mark_dynamic_published(key, through)

    def progress_message(self, result: "StageOneResult | StageTwoResult") -> Message:
        """The progress record of a processed batch: its outputs are delivered up to its last
        offset (stage 1: and each lane's)."""
        value = {"offset": result.last_offset}
        if isinstance(result, StageOneResult) and result.source.lanes:
            value["lanes"] = {lane: o for lane, o in result.offsets().items() if lane != result.source.topic}
        return Message(PROGRESS_TOPIC, encode_json(value), f"{self.app_id}/{result.source.name}".encode())

    def published_message(self, fired: FiredTrigger) -> Message:
        """The progress record of a trigger: its releases (and every earlier trigger's of its
        partition: they fire and publish in order) are delivered."""
        return Message(PROGRESS_TOPIC, encode_json({"window": fired.window, "trigger": fired.trigger}),
                       f"{self.app_id}/{fired.source.name}/published".encode())

    def release_messages(self, fired: FiredTrigger) -> list[Message]:
        """A trigger's releases, each with the run that made it (:func:`run_fields`)."""
        q = fired.pipeline.query
        return [Message(q.output_topic, encode_json({**r, **self.run_fields}), release_key(q.name, r["window_start"], r["key"]))
                for r in fired.releases]

    @staticmethod
    def mark_published(fired: FiredTrigger) -> None:
        fired.fired.runner.published(fired.fired)

    def trigger_fired(self, fired: FiredTrigger, republished: bool = False) -> None:
        """A trigger's releases are out on one partition: for its log line (:meth:`log_triggers`,
        docs/operations.md, "The trigger log line") the query, the window's start, the trigger,
        how many keys it released and how long it took from the start of its computation until
        its releases were acknowledged (committed, exactly once). Public values only: no key, no
        user. ``republished``: sent again from the journal after a restart (computed by an
        earlier run, so no duration)."""
        q = fired.pipeline.query
        if republished or fired.started is None:
            self.trigger_log.add(q.name, q.triggers, fired.window, fired.trigger, len(fired.releases), fired.source.partition)
            return
        duration_ms = (time.perf_counter() - fired.started) * 1000
        self.trigger_log.add(q.name, q.triggers, fired.window, fired.trigger, len(fired.releases), fired.source.partition,
                             duration_ms)
        # the status page's last trigger: the latest (window, trigger) fired here, over the
        # partitions that fired it (each its own share of the keys)
        last, now_ms = self.last_fired.get(q.name), int(time.time() * 1000)
        if last is None or (fired.window, fired.trigger) > (last["window_start_ms"], last["trigger"]):
            self.last_fired[q.name] = {"window_start_ms": fired.window, "trigger": fired.trigger, "at_ms": now_ms,
                                       "keys_released": len(fired.releases), "duration_ms": round(duration_ms, 1), "partitions": 1}
        elif (fired.window, fired.trigger) == (last["window_start_ms"], last["trigger"]):
            last.update(at_ms=now_ms, keys_released=last["keys_released"] + len(fired.releases), partitions=last["partitions"] + 1,
                        duration_ms=max(last["duration_ms"], round(duration_ms, 1)))
        # counted once per trigger, not per partition (the status page's "triggers fired")
        self.triggers_fired[q.name].add((fired.window, fired.trigger))

    def log_triggers(self, force: bool = False) -> list[str]:
        """Log one line per trigger every owned repartition partition of its query has fired
        (a catch-up of several in one line per query): :class:`TriggerLog`. ``force``: all
        pending ones (the worker stops)."""
        owned: Counter = Counter(src.pipelines[0].query.name for src in self.stage2.values())
        return self.trigger_log.flush(owned, force)

    # ------------------------------------------------------------------ metrics
    def dropped_counts(self) -> list[tuple]:
        """(query, dropped counts by reason) of every pipeline and dynamic query state this
        worker holds (processor/adapters/drop_report.py sums them per query)."""
        counts = [(pipe.query, pipe.stats.dropped) for pipe in self.pipelines()]
        counts += [(st.query, st.dropped) for states in self.dynamic_states.values() for st in states]
        counts += [(r.query, r.dropped) for routers in self.dynamic_routers.values() for r in routers]
        counts += [(b.query, b.dropped) for b in self.unit_bounders.values()]
        return counts

    def refresh_metrics(self) -> None:
        combined: dict[str, PipelineStats] = {}
        keys_released: Counter = Counter()
        for pipe in self.pipelines():
            name = pipe.query.name
            total = combined.setdefault(name, PipelineStats())
            st = pipe.stats
            total.events_in += st.events_in
            total.dropped.update(st.dropped)
            total.releases += st.releases
            total.accumulated += st.accumulated
            total.triggers_fired += st.triggers_fired
            total.keys_loaded += st.keys_loaded
            total.keys_tracked += st.keys_tracked
            total.consistency_updates += st.consistency_updates
            total.consistency_seconds += st.consistency_seconds
            keys_released[name] += len(st.keys_released)  # stage-2 partitions hold disjoint keys
        plans = self._plans
        for name, total in combined.items():
            self.metrics.observe_pipeline(name, total, plans[name], keys_released=keys_released[name])
        dynamic: dict[str, PipelineStats] = {}  # per query: its routers' and its shards' counts
        for st in (st for states in self.dynamic_states.values() for st in states):
            total = dynamic.setdefault(st.query.name, PipelineStats())
            total.events_in += st.updates_in
            total.dropped.update(st.dropped)
            total.releases += st.releases
        for r in (r for routers in self.dynamic_routers.values() for r in routers):
            total = dynamic.setdefault(r.query.name, PipelineStats())
            total.events_in += r.updates_in
            total.dropped.update(r.dropped)
        for b in self.unit_bounders.values():
            dynamic.setdefault(b.query.name, PipelineStats()).dropped.update(b.dropped)
        for q in self.config.dynamic:
            if q.name in dynamic:
                plan = self._dynamic_plans.get(q.name) or self._dynamic_plans.setdefault(q.name, q.plan())
                self.metrics.observe_pipeline(q.name, dynamic[q.name], plan, keys_released=0)
        for source in self.sources:
            self.metrics.state_bytes.labels(source.name).set(source.store.size_bytes())
        marks: dict[str, list] = defaultdict(list)
        for source in self.stage2.values():
            marks[source.pipelines[0].query.name].append(self._input_watermark(source))
        for name, values in marks.items():
            if None not in values:
                self.metrics.input_watermark.labels(name).set(min(values) / 1000.0)
        # the earliest trigger still to fire per query (docs/operations.md, "Dashboards and alerts")
        next_fire: dict[str, int] = {}
        for source in self.stage2.values():
            nxt = source.runners[0].pipeline.next_fire()
            if nxt is not None:
                name = source.runners[0].query.name
                next_fire[name] = min(next_fire.get(name, nxt[0]), nxt[0])
        self.metrics.observe_next_triggers(next_fire)
        if self.ledger is not None:
            now_ms = int(time.time() * 1000)
            # each query's principal, read from the ledger (a budget section names one for every query)
            remaining = {q.name: self.ledger.get(self.config.budget.principal_of(q), now_ms).remaining[0]
                         for q in (*self.config.queries, *self.config.dynamic)}
            self.metrics.observe_ledger(self.ledger.entries(now_ms), remaining)

    # ------------------------------------------------------------------ status page
    def _query_watermark(self, query: str) -> Optional[dict]:
        """The input watermark a query's triggers fire by here: the lowest over its owned
        repartition partitions (None until each has heard from every input partition)."""
        marks = [self._input_watermark(src) for src in self.stage2.values() if src.pipelines[0].query.name == query]
        if not marks or None in marks:
            return None
        return {"ms": min(marks), "at": _iso(min(marks))}

    def partition_watermark(self, key: tuple[str, int]) -> Optional[int]:
        """The status page's watermark of an owned partition: for an input partition the one it
        last announced to stage 2 (announced when it passes a fire time: :meth:`watermark_messages`),
        for a repartition partition the input watermark it fires by."""
        if key in self.stage1:
            return self.stage1[key].announced_ms
        if key in self.stage2:
            return self._input_watermark(self.stage2[key])
        if key in self.dynamic_routers:
            return self.dynamic[key].announced_ms
        if key in self.dynamic_shards:
            return self._shard_watermark(key)
        if key in self.dynamic_units:
            return self.dynamic_units[key].announced_ms
        return None

    def status(self, now_ms: int) -> dict:
        """What the status page shows (docs/operations.md, "Status page"), for this worker's
        partitions: per query its public settings, open windows, last and next trigger, releases
        and triggers since start, dead letters by reason; the budget ledger as it recorded it;
        the partitions owned. Aggregates and counts only, the same as ``/metrics`` or public: no
        key, no user id, no record, no secret or fingerprint."""
        queries = []
        for q in self.config.queries:
            stage1 = [p for src in self.stage1.values() for p in src.pipelines if p.query.name == q.name]
            stage2 = [src.pipelines[0] for src in self.stage2.values() if src.pipelines[0].query.name == q.name]
            schedule = Schedule(q)
            windows: dict[int, list[int]] = defaultdict(list)
            for pipe in stage2:
                for w in pipe.open_windows():
                    windows[w].append(pipe.progress(w))
            nexts = [n for pipe in stage2 if (n := pipe.next_fire()) is not None]
            last = self.last_fired.get(q.name)
            if last is None:  # nothing fired since start: the latest trigger this worker's state records
                done = [(schedule.fire_time(w, p.fired), w, p.fired) for pipe in stage2 for w, p in pipe.tables.progress.scan().items()
                        if p.status == WINDOW_OPEN and p.fired > 0]
                if done:
                    _, w, i = max(done)
                    last = {"window_start_ms": w, "trigger": i}
            if last is not None:
                last = {**last, "window_start": _iso(last["window_start_ms"]),
                        "due": _iso(schedule.fire_time(last["window_start_ms"], last["trigger"]))}
                if "at_ms" in last:
                    last["at"] = _iso(last["at_ms"])
            queries.append({
                "name": q.name, "kind": "windowed", "output_topic": q.output_topic, "input_watermark": self._query_watermark(q.name),
                "aggregate": q.aggregate, "window": q.window, "triggers": q.triggers,
                "allowed_lateness": q.allowed_lateness, "epsilon": q.epsilon, "delta": q.delta,
                "open_windows": [{"start": _iso(w), "start_ms": w, "triggers_fired": min(done), "triggers_fired_max": max(done)}
                                 for w, done in sorted(windows.items())],
                "last_trigger": last,
                "next_trigger": None if not nexts else {"due": _iso(min(nexts)[0]), "due_ms": min(nexts)[0],
                                                         "window_start": _iso(min(nexts)[1]), "trigger": min(nexts)[2]},
                "events_in": sum(p.stats.events_in for p in stage1),
                "triggers_fired": len(self.triggers_fired[q.name]),
                "releases": sum(p.stats.releases for p in stage2),
                "dead_letters": {reason: n for (name, reason), n in sorted(self.dead_letters.items()) if name == q.name},
            })
        for q in self.config.dynamic:
            states = [st for sts in self.dynamic_states.values() for st in sts if st.query.name == q.name]
            routers = [r for rs in self.dynamic_routers.values() for r in rs if r.query.name == q.name]
            queries.append({"name": q.name, "kind": "dynamic", "output_topic": q.output_topic, "aggregate": "count",
                            "epsilon": q.epsilon, "delta": q.delta,
                            "tick": q.tick, "events_in": sum(st.updates_in for st in states) + sum(r.updates_in for r in routers),
                            # every tick up to this one is decided (its releases computed): public, the clock's
                            "decided_tick": max((st.decided for st in states), default=None),
                            "releases": sum(st.releases for st in states),
                            "dead_letters": {reason: n for (name, reason), n in sorted(self.dead_letters.items()) if name == q.name}})
        budget = None
        if self.ledger is not None:
            budget = {"epoch": recorded_epoch(self.ledger.store), "principals": [
                {"principal": e.principal, "spent_epsilon": e.spent_epsilon, "max_epsilon": e.max_epsilon,
                 "remaining_epsilon": e.remaining[0], "spent_delta": e.spent_delta, "max_delta": e.max_delta,
                 "charges": e.charges, "refusals": e.refusals, "period_began": _iso(e.last_reset_ms),
                 "period_ends": _iso(e.last_reset_ms + e.refresh_ms) if e.refresh_ms else None}
                for e in recorded_entries(self.ledger.store)]}
        owned: dict[str, list[int]] = defaultdict(list)
        for topic, p in sorted([*self.stage1, *self.stage2, *self.dynamic, *self.dynamic_shards, *self.dynamic_units]):
            owned[topic].append(p)
        # the run's noise label: what `dpstream replay --noise-label` takes to reproduce this
        # worker's releases (public, as in every release)
        return {"now": _iso(now_ms - now_ms % 1000), "app_id": self.app_id, "noise_label": self.noise.label,
                "run": self.run_fields["run"], "queries": queries, "budget": budget, "partitions_owned": dict(owned)}


def _fire_time_between(schedule: Schedule, after: int, upto: int) -> bool:
    """Whether a fire time (a trigger time plus the allowed lateness) of ``schedule`` lies in
    (after, upto]: the first trigger time past ``after - lateness``, in its window or the next."""
    start, end = after - schedule.lateness, upto - schedule.lateness
    window = start - start % schedule.window_ms
    trigger = (start - window) // schedule.interval + 1
    if trigger > schedule.triggers:
        window, trigger = window + schedule.window_ms, 1
    return schedule.trigger_time(window, trigger) <= end


#: ISO-8601 UTC (the trigger log line's and the status page's)
_iso = iso_utc
