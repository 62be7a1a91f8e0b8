"""The Faust app: the worker's agents, trigger timer and web endpoints (the only Faust code).

Faust runs the worker: its lifecycle and signals, two agents (stage 1 by user, stage 2 by key),
the timer that fires triggers on the fixed schedule, and the web server for ``/healthz``,
``/readyz`` and ``/metrics``. All processing is :class:`processor.adapters.worker.DpstreamWorker`.

Records reach the agents in batches, from an aiokafka consumer (Faust's own Kafka client) that
the app runs with static partition assignment (worker i of N owns partitions p % N == i; see
:mod:`processor.adapters.worker`). Faust's per-event stream path was measured at 13k events/s on this
machine against 587k/s for aiokafka's ``getmany``, so one channel message carries a batch: the
records of every owned partition of a stage fetched within ``--batch-linger`` (or up to
``--fetch-records``), sent on with one acknowledgement wait (docs/operations.md, "Batches").
Messages are sent with confluent-kafka (:class:`topics.kafka.KafkaPublisher`). Health states and
the broker watch: docs/operations.md, "Health".
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import faust
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from processor.adapters.metrics import PipelineMetrics
from processor.adapters.worker import (
    WATERMARK_DELAY_MS,
    DpstreamWorker,
    FiredTrigger,
    InputWentBackError,
    Ownership,
)
from processor.config import DpstreamConfig
from topics.kafka import (
    KafkaPublisher,
    aiokafka_security,
    client_security,
    create_topics,
    read_epoch_marks,
    read_progress,
    repartition_topic,
    timestamp_types,
    topics_for,
    write_epoch_mark,
)

log = logging.getLogger("dpstream.worker")

#: --delivery choices (docs/operations.md, "Delivery")
DELIVERIES = ("exactly-once", "at-least-once")
#: s a stopping worker gives Faust to shut down before the process exits anyway (non-zero)
STOP_GRACE_S = 5.0
#: s without a broker answer before readiness says the worker is waiting for it
BROKER_WAIT_S = 10.0
#: s between checks that the source logs still hold what the state has read
LOG_CHECK_S = 30.0


class CreateTimeInputError(RuntimeError):
    """An input topic's timestamps are its producers' (CreateTime), and --allow-create-time was not given."""


class BrokerUnreachableError(RuntimeError):
    """The broker has not answered for ``--broker-timeout`` seconds."""


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)


@dataclass
class WorkerSettings:
    config: DpstreamConfig
    secret: bytes = field(repr=False)  # never printed
    broker: str = field(default="127.0.0.1:19092")  # host:port[,host:port]
    state_dir: str = "./dpstream-state"
    ownership: Ownership = Ownership()
    partitions: int = 8  # partitions of the topics the worker creates
    web_port: int = 9400
    web_host: str = "0.0.0.0"
    app_id: str = "dpstream"
    fetch_records: int = 100_000
    session_timeout: float = 6.0
    heartbeat_interval: float = 1.0
    partitioner: str = "murmur2"  # how producers map a user key to an input partition (checked per record)
    watermark_delay_ms: int = WATERMARK_DELAY_MS  # see DpstreamWorker.watermark_messages
    broker_timeout: float = 60.0  # s without any answer from the broker before the worker exits non-zero
    batch_linger: float = 0.1  # s records gather after the first one before they are processed as one batch
    delivery: str = "exactly-once"  # or "at-least-once" (docs/operations.md, "Delivery")
    allow_create_time: bool = False  # run on input topics whose producers stamp the timestamps (docs/privacy.md, "Time")


def broker_address(url: str) -> str:
    """``kafka://host:port`` or ``host:port`` -> ``host:port`` (comma-separated lists kept)."""
    return ",".join(part.split("://", 1)[-1] for part in url.split(","))


def trigger_tick_seconds(config: DpstreamConfig) -> float:
    """How often the timer looks for due triggers: a tenth of the shortest trigger interval,
    at most 1 s, at least 50 ms."""
    if not config.queries:
        return 1.0
    shortest = min(q.window_ms // q.triggers for q in config.queries) / 1000.0
    return min(1.0, max(0.05, shortest / 10))


def build_app(s: WorkerSettings) -> faust.App:
    broker = broker_address(s.broker)
    os.makedirs(s.state_dir, exist_ok=True)
    security = client_security()
    app = faust.App(
        s.app_id, broker=f"kafka://{broker.replace(',', ';kafka://')}", store="memory://", datadir=os.path.join(s.state_dir, "faust"),
        web_enabled=True, web_port=s.web_port,
        web_bind=s.web_host, web_host=s.web_host, processing_guarantee="at_least_once", topic_allow_declare=False,
        broker_session_timeout=s.session_timeout, broker_heartbeat_interval=s.heartbeat_interval, autodiscover=False,
        broker_credentials=_faust_credentials(security),
    )
    metrics = PipelineMetrics()
    exactly_once = s.delivery == "exactly-once"
    #: who sends: one transactional producer per role (a transaction is one role's batch; each
    #: id fences its previous incarnation), or one plain producer for every role at least once
    roles = ("stage1", "stage2", "timer", "dynamic")
    publishers: dict[str, KafkaPublisher] = {}
    locks: dict[str, asyncio.Lock] = {}
    stage1_in = app.channel()
    stage2_in = app.channel()
    dynamic_in = app.channel()
    #: batches sent to each stage's agent and not yet processed (the consume loop gathers more
    #: records for a stage while it is busy)
    in_flight = {stage1_in: 0, stage2_in: 0, dynamic_in: 0}
    #: state: starting -> ready <-> waiting-for-broker; any -> stopping (docs/operations.md, "Health")
    status = {"ready": False, "state": "starting", "reason": "opening state", "worker": None, "consumer": None,
              "acknowledged": time.monotonic(),
              # by partition: the consumer's position after the last fetch (past transaction
              # markers and aborted records, which no record's offset stands for), and the offset
              # after the last record fetched
              "positions": {}, "fetched": {}}

    def set_state(state: str, reason: str = "") -> None:
        status["state"], status["reason"] = state, reason
        status["ready"] = state == "ready"
        metrics.ready.set(1 if state == "ready" else 0)

    def start_publishers() -> None:
        """Blocking: exactly once, each role's producer starts its transactions, fencing the
        previous incarnation of this worker (its open transactions abort)."""
        for role in roles:
            if exactly_once:
                publishers[role] = KafkaPublisher(broker, transactional_id=f"{s.app_id}-{s.ownership.index}-{role}",
                                                  timeout=s.broker_timeout)
            else:
                publishers[role] = publishers.get("stage1") or KafkaPublisher(broker)

    async def send(messages, role: str = "timer") -> None:
        """Send and wait until acknowledged (at least once) or committed as one transaction
        (exactly once), off the event loop; the caller commits state only after this."""
        batch = [(m.topic, m.value, m.key, m.partition) for m in messages]
        if not batch:
            return
        lock = locks.setdefault(role, asyncio.Lock())
        async with lock:
            await asyncio.get_running_loop().run_in_executor(None, lambda: publishers[role].send(batch, s.broker_timeout))
        status["acknowledged"] = time.monotonic()

    async def publish(fired: list[FiredTrigger]) -> None:
        worker: DpstreamWorker = status["worker"]
        for f in fired:
            # exactly once: the releases and the record that they are published, in one transaction
            await send(worker.release_messages(f) + ([worker.published_message(f)] if exactly_once else []))
            worker.mark_published(f)

    async def publish_dynamic(key) -> None:
        worker: DpstreamWorker = status["worker"]
        # exactly once: the releases and the record of the segments they complete, in one transaction
        await send(worker.dynamic_releases(key) + (worker.dynamic_published_messages(key) if exactly_once else []), "dynamic")
        worker.mark_dynamic_published(key)

    async def crash(exc: BaseException) -> None:
        # at-least-once: stop rather than go on past a batch whose state was not committed;
        # the restarted worker resumes from the last committed offsets. Every state write is
        # atomic, so exiting at once loses nothing: Faust's own shutdown may wait a minute on a
        # broker that is gone, so the process exits non-zero within STOP_GRACE_S whatever happens
        if status["state"] == "stopping":
            return
        log.error("dpstream worker stopping: %s: %s", type(exc).__name__, exc)
        set_state("stopping", f"{type(exc).__name__}: {exc}")
        asyncio.get_running_loop().call_later(STOP_GRACE_S, _exit_now, 1)
        await app.crash(exc)

    async def process(items, step, role: str) -> None:
        """One dispatched batch: every partition's records through ``step`` (each partition once,
        its own store), all their messages sent with one acknowledgement wait (exactly once: one
        transaction, with the progress record of each partition), then every state write
        committed: one broker round trip per batch, not per partition."""
        worker: DpstreamWorker = status["worker"]
        results = [r for topic, partition, records in items if (r := step(topic, partition, records)) is not None]
        messages = [m for r in results for m in r.messages]
        if exactly_once:
            messages += [worker.progress_message(r) for r in results]
        await send(messages, role)  # bounded records and dead letters first,
        for r in results:  # then the state they cover
            r.commit()

    @app.agent(stage1_in, name="dpstream.stage1_bound_contributions")
    async def stage1_bound_contributions(batches):
        """Stage 1, by user: contribution bounding; bounded records go out keyed by key."""
        async for items in batches:
            try:
                await process(items, status["worker"].process_input, "stage1")
            except Exception as exc:  # noqa: BLE001 - any failure stops the worker
                await crash(exc)
                return
            in_flight[stage1_in] -= 1

    @app.agent(stage2_in, name="dpstream.stage2_aggregate_by_key")
    async def stage2_aggregate_by_key(batches):
        """Stage 2, by key: append bounded records to the pending micro-batches."""
        async for items in batches:
            try:
                await process(items, status["worker"].process_repartitioned, "stage2")
            except Exception as exc:  # noqa: BLE001
                await crash(exc)
                return
            in_flight[stage2_in] -= 1

    @app.agent(dynamic_in, name="dpstream.dynamic_counts")
    async def dynamic_counts(batches):
        """Dynamic queries: insert/delete updates -> per-item counts at each closed segment."""
        async for items in batches:
            try:
                await process(items, status["worker"].process_dynamic, "dynamic")  # dead letters, then the update log
            except Exception as exc:  # noqa: BLE001
                await crash(exc)
                return
            in_flight[dynamic_in] -= 1

    @app.timer(trigger_tick_seconds(s.config), name="dpstream.fire_triggers")
    async def fire_triggers():
        """The fixed trigger schedule: key selection, perturbation, prediction, publication."""
        worker = status["worker"]
        if worker is None or not status["ready"]:
            return
        try:
            now = int(time.time() * 1000)
            # announce how far each owned input partition has been read (committed progress
            # only); stage 2 fires a trigger once every input partition is past it
            await send(worker.watermark_messages(now, read_to_end(worker)))
            for fired in worker.iter_fire_due(now):  # each published before the next is computed
                await publish([fired])
            # dynamic queries: every tick the clock has passed is decided, updates or not
            due, letters = worker.advance_dynamic(now, read_to_end(worker), commit=False)
            await send(letters, "dynamic")  # the refused deletes' dead letters, then the decisions
            worker.commit_dynamic()
            for key in due:
                await publish_dynamic(key)
        except Exception as exc:  # noqa: BLE001
            await crash(exc)

    def check_logs_of(worker: DpstreamWorker) -> dict:
        """Every source partition's log against the state (raises InputWentBackError); returns
        the log positions (start, end, topic id) by partition."""
        positions = _log_positions(broker, worker.sources)
        for src in worker.sources:
            src.check_log(*positions[(src.topic, src.partition)])
        return positions

    def read_to_end(worker: DpstreamWorker) -> dict:
        """Owned input (and dynamic update) partitions read to the end the broker last reported,
        every record fetched committed, with the time of that report (its fetch response). The
        end can be a transaction marker (an upstream producer's transactions), which no record
        holds: the consumer's position passes it."""
        consumer = status["consumer"]
        ends = {}
        if consumer is None:
            return ends
        for key, src in [*worker.stage1.items(), *worker.dynamic.items()]:
            tp = _tp(*key)
            high = consumer.highwater(tp)
            if high is None:
                continue
            committed = src.last_offset + 1
            position = status["positions"].get(tp, committed)
            if committed >= high or (position >= high and committed >= status["fetched"].get(tp, 0)):
                ends[key] = consumer.last_poll_timestamp(tp)
        return ends

    def refresh_metrics() -> None:
        worker, consumer = status["worker"], status["consumer"]
        if worker is None:
            return
        worker.refresh_metrics()
        for src in worker.sources:
            high = consumer.highwater(_tp(src.topic, src.partition)) if consumer is not None else None
            if high is not None:
                metrics.consumer_lag.labels(src.topic, str(src.partition)).set(max(0, high - src.last_offset - 1))

    @app.task
    async def consume():
        """Open the state, republish the journal, then read owned partitions in batches."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.errors import OffsetOutOfRangeError

        loop = asyncio.get_running_loop()
        consumer = None
        try:
            specs = topics_for(s.config.queries, s.partitions, s.config.dynamic)
            await loop.run_in_executor(None, lambda: create_topics(broker, specs))
            inputs = {q.input_topic for q in s.config.queries}
            dynamic_inputs = {q.input_topic for q in s.config.dynamic}
            counts = await loop.run_in_executor(None, lambda: _partition_counts(
                broker, inputs | dynamic_inputs | {repartition_topic(q.name) for q in s.config.queries}))
            stamps = await loop.run_in_executor(None, lambda: timestamp_types(broker, inputs | dynamic_inputs))
            for topic in sorted(t for t, kind in stamps.items() if kind != "LogAppendTime"):
                # the producers' stamps decide lateness: a record reaching the broker more than the
                # watermark delay after its stamp is late or not depending on how far behind the
                # worker was, which other users' records influence (docs/privacy.md, "Time")
                if not s.allow_create_time:
                    raise CreateTimeInputError(
                        f"input topic {topic} has message.timestamp.type={stamps[topic]}: its producers' timestamps would "
                        f"decide which records are late, and the guarantee would rest on every producer delivering within "
                        f"the watermark delay. Set it to LogAppendTime (kafka-configs.sh --alter --entity-type topics "
                        f"--entity-name {topic} --add-config message.timestamp.type=LogAppendTime), or start with "
                        f"--allow-create-time. See docs/privacy.md, \"Time\"")
                log.warning("input topic %s has message.timestamp.type=%s (--allow-create-time): its producers' timestamps "
                            "decide which records are late (docs/operations.md, \"Time and lateness\")", topic, stamps[topic])
            for topic in dynamic_inputs:
                if counts[topic] != 1:
                    raise RuntimeError(f"dynamic input topic {topic!r} has {counts[topic]} partitions; it needs exactly 1")
            # existing topics keep their partition counts: use what the broker has
            repartitions = {n for t, n in counts.items() if t not in inputs | dynamic_inputs}
            if len(repartitions) > 1:
                raise RuntimeError(f"repartition topics have different partition counts: {sorted(repartitions)}")
            # what this worker's state belonged to when it last started, kept outside its volume:
            # an empty state directory under the same epoch is a lost volume, refused
            mark_key = f"{s.app_id}/{s.ownership.index}"
            previous = (await loop.run_in_executor(None, lambda: read_epoch_marks(broker))).get(mark_key)
            worker = await loop.run_in_executor(None, lambda: DpstreamWorker(
                s.config, s.secret, s.state_dir, s.ownership, {t: counts[t] for t in inputs},
                repartitions.pop() if repartitions else s.partitions, metrics, previous_mark=previous, app_id=s.app_id,
                partitioner=s.partitioner, watermark_delay_ms=s.watermark_delay_ms))
            status["worker"] = worker
            if previous is None or {k: previous.get(k) for k in worker.epoch_mark} != worker.epoch_mark:
                mark = {**worker.epoch_mark, "since_ms": int(time.time() * 1000)}
                await loop.run_in_executor(None, lambda: write_epoch_mark(broker, mark_key, mark))
            await loop.run_in_executor(None, start_publishers)
            if exactly_once:  # what the last incarnation delivered: never sent again
                progress = await loop.run_in_executor(None, lambda: read_progress(broker, s.app_id))
                worker.resume(progress)
            await publish(worker.unpublished())
            for key in worker.dynamic:  # releases recomputed from the update log, not yet sent
                await publish_dynamic(key)
            # the logs must still hold what the state has read (a recreated topic, a broker that
            # lost data: refused, never silently counted from wherever the log is now)
            positions = await loop.run_in_executor(None, lambda: check_logs_of(worker))
            # "none": an offset out of range later (the log went back while running) raises
            # read_committed: our own repartition records count once their transaction committed
            consumer = AIOKafkaConsumer(bootstrap_servers=broker, group_id=None, enable_auto_commit=False, auto_offset_reset="none",
                                        isolation_level="read_committed",
                                        max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=32 * 1024 * 1024,
                                        **aiokafka_security(security))
            await consumer.start()
            status["consumer"] = consumer
            stage_of = {}
            for key, src in worker.stage1.items():
                stage_of[_tp(*key)] = (stage1_in, src)
            for key, src in worker.stage2.items():
                stage_of[_tp(*key)] = (stage2_in, src)
            for key, src in worker.dynamic.items():
                stage_of[_tp(*key)] = (dynamic_in, src)
            consumer.assign(list(stage_of))
            for tp, (_, src) in stage_of.items():
                start = positions[(src.topic, src.partition)][0]
                if src.last_offset + 1 < start:  # deleted by retention before this worker read them
                    log.error("%s: records at offsets %d to %d were deleted (retention) before this worker read them; "
                              "going on from offset %d", src.name, src.last_offset + 1, start - 1, start)
                consumer.seek(tp, max(src.last_offset + 1, start))  # the state's own offset, not a group commit
            set_state("ready")
            log.info("dpstream worker %d/%d ready: %d input and %d repartition partitions", s.ownership.index, s.ownership.workers,
                     len(worker.stage1), len(worker.stage2))
            # batches by time and size: records gather for up to --batch-linger after the first
            # one, or until --fetch-records, then go to their stage as one message (docs/operations.md,
            # "Batches"): a trickle of live records costs one broker round trip (one transaction)
            # per linger, not per fetch. While a stage is still busy with its last batch, its
            # records go on gathering: under load batches grow, and the fixed cost of each
            # (acknowledgement wait, transaction commit) is shared by more records
            stages = (stage1_in, stage2_in, dynamic_in)
            pending: dict = {ch: {} for ch in stages}
            counts = dict.fromkeys(stages, 0)
            firsts: dict = dict.fromkeys(stages)
            while True:
                now = time.monotonic()
                due = [firsts[ch] + s.batch_linger - now for ch in stages if counts[ch] and not in_flight[ch]]
                wait_ms = 200 if not due else max(0, int(min(due) * 1000))
                if any(in_flight[ch] for ch in stages if counts[ch]):
                    wait_ms = min(wait_ms, 20)  # look again soon: a busy stage may have finished
                await asyncio.sleep(0)  # a fetch that returns at once does not yield: let the agents and the web server run
                room = s.fetch_records - sum(counts.values())
                if room <= 0:
                    fetched = {}
                    await asyncio.sleep(0.02)  # full: wait for a busy stage to take its batch
                else:
                    try:
                        fetched = await consumer.getmany(timeout_ms=wait_ms, max_records=room)
                    except OffsetOutOfRangeError as exc:
                        tp, offset = next(iter(exc.args[0].items()))
                        raise InputWentBackError(
                            f"{tp.topic}-{tp.partition}: offset {offset}, where this worker's state goes on, is no longer in "
                            f"the log: the topic was recreated or the broker lost data. See docs/operations.md, \"When the "
                            f"input goes back\"") from None
                for tp, records in fetched.items():
                    ch = stage_of[tp][0]
                    pending[ch].setdefault(tp, []).extend(records)
                    counts[ch] += len(records)
                    if firsts[ch] is None:
                        firsts[ch] = time.monotonic()
                    status["fetched"][tp] = records[-1].offset + 1
                for tp in stage_of:
                    status["positions"][tp] = await consumer.position(tp)
                now = time.monotonic()
                for ch in stages:
                    if counts[ch] and not in_flight[ch] and (counts[ch] >= s.fetch_records or now - firsts[ch] >= s.batch_linger):
                        in_flight[ch] += 1
                        await ch.send(value=[(tp.topic, tp.partition, records) for tp, records in pending[ch].items()])
                        pending[ch], counts[ch], firsts[ch] = {}, 0, None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            await crash(exc)
        finally:
            if status["state"] != "stopping":
                set_state("stopping", "consumer stopped")
            if consumer is not None:
                await consumer.stop()

    @app.timer(1.0, name="dpstream.watch_broker")
    async def watch_broker():
        """Broker contact: the last fetch response or acknowledged send. Without any for 10 s the
        worker says it is waiting (readiness 503) and resumes when the broker answers again;
        without any for ``broker_timeout`` it exits non-zero, for Kubernetes to restart it."""
        consumer = status["consumer"]
        if consumer is None or status["state"] not in ("ready", "waiting-for-broker"):
            return
        fetched = [consumer.last_poll_timestamp(tp) for tp in consumer.assignment()]
        now_ms = time.time() * 1000
        silent = min([(now_ms - t) / 1000 for t in fetched if t] + [time.monotonic() - status["acknowledged"]])
        if silent > s.broker_timeout:
            await crash(BrokerUnreachableError(f"no answer from the broker at {broker} for {silent:.0f} s (--broker-timeout)"))
        elif silent > BROKER_WAIT_S:
            if status["state"] == "ready":
                log.warning("waiting for the broker at %s: no answer for %.0f s", broker, silent)
            set_state("waiting-for-broker", f"no answer from the broker for {silent:.0f} s")
        elif status["state"] == "waiting-for-broker":
            log.info("the broker at %s answers again", broker)
            set_state("ready")

    @app.timer(LOG_CHECK_S, name="dpstream.check_logs")
    async def check_logs():
        """While running: a source topic recreated under the same name, or a log shorter than
        what the state has read, stops the worker (refused on restart too) rather than count the
        new records from wherever the old offsets point."""
        worker = status["worker"]
        if worker is None or status["state"] != "ready":
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, lambda: check_logs_of(worker))
        except InputWentBackError as exc:
            await crash(exc)
        except Exception as exc:  # noqa: BLE001 - the broker may be away: watch_broker handles that
            log.debug("log position check skipped: %s", exc)

    @app.page("/healthz")
    async def healthz(web, request):
        """Liveness: the event loop answers and the worker is not stopping."""
        if status["state"] == "stopping":
            return web.json({"status": "stopping", "reason": status["reason"]}, status=503)
        return web.json({"status": "alive", "state": status["state"]})

    @app.page("/readyz")
    async def readyz(web, request):
        """Readiness: state open, journal republished, partitions assigned, broker answering."""
        body = {"status": status["state"], "reason": status["reason"]}
        return web.json(body, status=200 if status["state"] == "ready" else 503)

    @app.page("/metrics")
    async def prometheus_metrics(web, request):
        refresh_metrics()  # counters are kept by the pipeline; brought up to date at each scrape
        return web.bytes(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    app.dpstream_status = status  # for tests and the bench
    app.dpstream_metrics = metrics
    return app


def _faust_credentials(settings: dict):
    """Faust's own client (its app consumer and producer) with the same security settings."""
    protocol = settings.get("security.protocol", "PLAINTEXT")
    if protocol == "PLAINTEXT":
        return None
    from aiokafka.helpers import create_ssl_context

    ssl = create_ssl_context(cafile=settings.get("ssl.ca.location")) if "SSL" in protocol else None
    if "SASL" in protocol:
        return faust.SASLCredentials(username=settings.get("sasl.username"), password=settings.get("sasl.password"),
                                     mechanism=settings.get("sasl.mechanisms", "PLAIN"), ssl_context=ssl)
    return faust.SSLCredentials(ssl)


def _tp(topic: str, partition: int):
    from aiokafka import TopicPartition

    return TopicPartition(topic, partition)


def _log_positions(broker: str, sources) -> dict[tuple[str, int], tuple[int, int, Optional[str]]]:
    """(log start offset, log end offset, topic id) of each source partition. Topic ids come
    from DescribeTopics (Apache Kafka); a broker without them gives None."""
    from confluent_kafka import Consumer, TopicCollection, TopicPartition
    from confluent_kafka.admin import AdminClient

    topics = sorted({src.topic for src in sources})
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
        for src in sources:
            low, high = consumer.get_watermark_offsets(TopicPartition(src.topic, src.partition), timeout=15)
            out[(src.topic, src.partition)] = (low, high, ids.get(src.topic))
        return out
    finally:
        consumer.close()


def _partition_counts(broker: str, topics: set[str]) -> dict[str, int]:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": broker, **client_security()}).list_topics(timeout=15)
    counts = {}
    for topic in topics:
        if topic not in meta.topics or meta.topics[topic].error is not None:
            raise RuntimeError(f"topic {topic!r} does not exist on {broker}")
        counts[topic] = len(meta.topics[topic].partitions)
    return counts


def run_worker(s: WorkerSettings, loglevel: str = "info") -> int:
    from faust.worker import Worker

    app = build_app(s)
    worker = Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    worker.execute_from_commandline()  # until SIGTERM/SIGINT; exits the process
    return 0
