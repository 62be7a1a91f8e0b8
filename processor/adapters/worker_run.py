"""One worker process's run: what the Faust agents, timers and pages call.

:class:`WorkerRun` holds what both ways of owning partitions share: the state
(:class:`dpstream.processor.adapters.worker.DpstreamWorker`), the producers
(:class:`dpstream.processor.adapters.delivery.RolePublishers`), the batches gathering for the
stages' agents, the health. Its two kinds: :class:`dpstream.processor.adapters.static_run.StaticRun`
(``--worker-index``/``--workers``: fixed partitions read with aiokafka) and
:class:`dpstream.processor.adapters.elastic_run.ElasticRun` (``--assignment group``: partitions
assigned by a consumer group, state moved through changelogs). Faust itself is only in
:mod:`dpstream.processor.adapters.faust_app`, which wires these methods to agents and timers.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

from dpstream.processor.adapters.delivery import RolePublishers
from dpstream.processor.adapters.health import WorkerHealth
from dpstream.processor.adapters.metrics import PipelineMetrics
from dpstream.processor.adapters.stage_batches import StageBatches
from dpstream.processor.adapters.trigger_log import iso_utc as _iso
from dpstream.processor.adapters.worker import DpstreamWorker, FiredTrigger
from dpstream.processor.adapters.worker_startup import WorkerStartup
from dpstream.topics.kafka import client_security, kafka_error

log = logging.getLogger("dpstream.worker")

#: s of silence after which the broker watch asks the broker itself (probe_broker), and how long
#: the question may take
PROBE_AFTER_S, PROBE_TIMEOUT_S = 3.0, 5.0


def log_positions(broker: str, keys) -> dict[tuple[str, int], tuple[int, int, Optional[str]]]:
    """(log start offset, log end offset, topic id) of each ``(topic, partition)`` in ``keys``.
    Topic ids come from DescribeTopics (Apache Kafka); a broker without them gives None. Blocking;
    it takes keys, not sources, so that nothing of a source's state is touched off the event loop."""
    from confluent_kafka import Consumer, KafkaException, TopicCollection, TopicPartition
    from confluent_kafka.admin import AdminClient

    keys = list(keys)
    topics = sorted({topic for topic, _ in keys})
    ids: dict[str, Optional[str]] = {}
    admin = AdminClient({"bootstrap.servers": broker, **client_security()})  # kept alive until the futures resolve
    try:
        futures = admin.describe_topics(TopicCollection(topics))
        for name, future in futures.items():
            ids[name] = str(future.result(15).topic_id) or None
    except Exception as exc:  # noqa: BLE001 - no DescribeTopics (e.g. Tansu): offsets alone
        log.debug("no topic ids from the broker (%s): checking offsets only", exc)
        ids = {}
    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-log-positions", "enable.auto.commit": False,
                         **client_security()})
    try:
        out = {}
        for topic, partition in keys:
            try:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=15)
            except KafkaException as exc:
                raise kafka_error(f"reading the log offsets of {topic}-{partition}", exc) from None
            out[(topic, partition)] = (low, high, ids.get(topic))
        return out
    finally:
        consumer.close()


class WorkerRun:
    """What a worker's run shares, whichever way it owns its partitions (subclasses)."""

    def __init__(self, s, broker: str, metrics: PipelineMetrics, health: WorkerHealth,
                 send_batch: Callable[[str, list], Awaitable[None]], crash: Callable[[BaseException], Awaitable[None]]):
        self.s, self.broker, self.metrics, self.health = s, broker, metrics, health
        self.crash = crash  # stops the worker (faust_app)
        self.exactly_once = s.delivery == "exactly-once"
        self.publishers = RolePublishers(broker, s.app_id, s.delivery, s.assignment,
                                         s.instance_id if s.assignment == "group" else str(s.ownership.index), s.broker_timeout,
                                         heard=health.heard_from_broker, silence=health.silence)
        self.batches = StageBatches(send_batch, s.batch_linger, s.fetch_records)
        self.worker: Optional[DpstreamWorker] = None
        self.consumer = None
        self._probe = None  # the client of probe_broker, and whether a probe is under way
        self._noise_tables: Optional[asyncio.Future] = None  # run: the sampler tables being built
        self._probing = False

    # ------------------------------------------------------------------ the consume task
    async def run(self) -> None:
        """Open the state, start the producers, then read the owned partitions in batches."""
        loop = asyncio.get_running_loop()
        self.worker = await loop.run_in_executor(None, WorkerStartup(self.s, self.broker, self.metrics).open)
        # the sampler tables, in a thread while the worker starts reading (seconds for the BLT's)
        self._noise_tables = loop.run_in_executor(None, self.worker.prepare_noise_tables)
        await loop.run_in_executor(None, self.publishers.start)
        await self.consume(loop)

    async def consume(self, loop) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """The consume task ended: leave (hand partitions over) and close the clients."""

    # ------------------------------------------------------------------ the agents and the timer
    async def process(self, items, stage: str) -> None:
        """One dispatched batch of ``stage`` (stage1, stage2, dynamic)."""
        raise NotImplementedError

    async def fire(self, now_ms: int) -> None:
        """The timer: fire every due trigger, decide dynamic ticks."""
        raise NotImplementedError

    async def noise_tables_built(self) -> None:
        """Wait for the sampler tables started at :meth:`run` (fire calls this first), off the
        event loop: triggers would otherwise build them on it (docs/architecture.md, "Noise
        tables")."""
        if self._noise_tables is not None:
            await self._noise_tables

    def stage_of(self, key) -> str:
        w = self.worker
        return "stage1" if key in w.stage1 or key in w.lanes else "stage2" if key in w.stage2 else "dynamic"

    # ------------------------------------------------------------------ watching
    def broker_silence(self) -> float:
        """s since the broker last answered (health: ``waiting-for-broker``, --broker-timeout)."""
        return self.health.silence()

    async def probe_broker(self) -> None:
        """Ask the broker for its metadata when nothing else has heard from it for a while, so
        that a worker with nothing to send (or whose one send is stuck on something else than the
        broker) does not read as cut off from it. Counts as an answer (health)."""
        if self._probing or self.health.silence() < PROBE_AFTER_S:
            return
        self._probing = True
        try:
            if await asyncio.get_running_loop().run_in_executor(None, self._ask_broker):
                self.health.heard_from_broker()
        finally:
            self._probing = False

    def _ask_broker(self) -> bool:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        if self._probe is None:
            self._probe = AdminClient({"bootstrap.servers": self.broker, **client_security()})
        try:
            self._probe.list_topics(timeout=PROBE_TIMEOUT_S)
            return True
        except KafkaException:
            return False

    async def check_logs(self) -> dict:
        """Every source partition's log against the state (raises InputWentBackError); returns
        the log positions (start, end, topic id) by partition. The broker is asked off the event
        loop, the states are read on it, and only those of sources still owned then: a
        partition given up meanwhile has had its store closed (elastic workers)."""
        worker = self.worker
        sources = worker.sources
        read_to = {(src.topic, src.partition): src.last_offset for src in sources}  # before asking: the worker reads on
        positions = await asyncio.get_running_loop().run_in_executor(None, log_positions, self.broker, list(read_to))
        for src in sources:
            key = (src.topic, src.partition)
            if worker.source_of(key) is src:
                src.check_log(*positions[key], read_to=read_to[key])
        return positions

    def high_watermark(self, key) -> Optional[int]:
        raise NotImplementedError

    def refresh_metrics(self) -> None:
        worker = self.worker
        if worker is None:
            return
        worker.refresh_metrics()
        lags = {}
        for src in worker.sources:
            high = self.high_watermark((src.topic, src.partition))
            if high is not None:
                lags[(src.topic, src.partition)] = max(0, high - src.last_offset - 1)
        self.metrics.observe_lag(lags)  # a partition that moved away loses its sample
        for topic, count in worker.owned_counts().items():
            self.metrics.partitions_owned.labels(topic).set(count)

    async def commit_offsets(self) -> None:
        """Monitoring offsets for lag tools (static workers; elastic ones commit theirs in their
        transactions)."""

    def status_data(self) -> dict:
        """The status page's data (docs/operations.md, "Status page"): the worker's own
        (:meth:`DpstreamWorker.status`), its health state and how it runs."""
        s = self.s
        worker = self.worker
        data = worker.status(int(time.time() * 1000)) if worker is not None else {"app_id": s.app_id}
        group = s.assignment == "group"
        data.update(state=self.health.state, reason=self.health.reason, assignment=s.assignment, delivery=s.delivery,
                    worker=f"instance {s.instance_id}" if group else f"worker {s.ownership.index} of {s.ownership.workers}",
                    offsets_group=group_id(s.app_id), partitions=self.partition_status() if worker is not None else [])
        return data

    def partition_status(self) -> list[dict]:
        """Each owned partition's read position, log end, lag (end minus position, as Kafka's
        consumer-groups tool counts it) and watermark, for the status page. The end is the one
        the broker last reported (None before it did)."""
        worker = self.worker
        kinds = {**dict.fromkeys(worker.stage1, "input"), **dict.fromkeys(worker.stage2, "by key"),
                 **dict.fromkeys(worker.dynamic, "updates"), **dict.fromkeys(worker.dynamic_shards, "by item"),
                 **dict.fromkeys(worker.dynamic_units, "by unit")}
        rows = []
        for key, kind in sorted(kinds.items()):
            src = worker.source_of(key)
            if src is None:
                continue
            read_to, end = self.read_offset(key, src), self.high_watermark(key)
            mark = worker.partition_watermark(key)
            rows.append({"topic": key[0], "partition": key[1], "kind": kind, "offset": read_to, "end": end,
                         "lag": None if end is None else max(0, end - read_to),
                         "watermark": None if mark is None else _iso(mark)})
        return rows

    def read_offset(self, key, src) -> int:
        """The offset the worker has read a partition up to (the next to read), committed."""
        return src.last_offset + 1

    # ------------------------------------------------------------------ static publication
    async def publish(self, fired: list[FiredTrigger]) -> None:
        worker = self.worker
        for f in fired:
            # exactly once: the releases and the record that they are published, in one transaction
            await self.publishers.send(worker.release_messages(f) + ([worker.published_message(f)] if self.exactly_once else []))
            worker.mark_published(f)
            worker.trigger_fired(f)  # for its log line (docs/operations.md, "The trigger log line")

    async def publish_dynamic(self, key) -> None:
        worker = self.worker
        # exactly once: the releases and the record of the segments they complete, in one transaction
        await self.publishers.send(worker.dynamic_releases(key) + (worker.dynamic_published_messages(key) if self.exactly_once else []),
                                   "dynamic")
        worker.mark_dynamic_published(key)


def group_id(app_id: str) -> str:
    """The elastic workers' consumer group, and the static workers' monitoring offsets' group
    (Faust's own consumer uses the app id as its group)."""
    return f"{app_id}-workers"
