"""The Faust app: the worker's agents, trigger timer and web endpoints (the only Faust code).

Faust runs the worker: its lifecycle and signals, two agents (stage 1 by user, stage 2 by key),
the timer that fires triggers on the fixed schedule, and the web server for ``/healthz``,
``/readyz`` and ``/metrics``. All processing is :class:`dpstream.processor.adapters.worker.DpstreamWorker`.

Records reach the agents in batches, from an aiokafka consumer (Faust's own Kafka client) that
the app runs with static partition assignment (worker i of N owns partitions p % N == i; see
:mod:`dpstream.processor.adapters.worker`), or, with ``--assignment group``, from a consumer group member
(:mod:`dpstream.processor.adapters.consumer_group`) whose gained partitions are restored from their
changelogs before they are read (docs/operations.md, "Elastic workers"). Faust's per-event stream path was measured at 13k events/s on this
machine against 587k/s for aiokafka's ``getmany``, so one channel message carries a batch: the
records of every owned partition of a stage fetched within ``--batch-linger`` (or up to
``--fetch-records``), sent on with one acknowledgement wait (docs/operations.md, "Batches").
Messages are sent with confluent-kafka (:class:`dpstream.topics.kafka.KafkaPublisher`). Health states and
the broker watch: docs/operations.md, "Health".
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import faust
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dpstream.processor.adapters.consumer_group import GroupConsumer
from dpstream.processor.adapters.metrics import PipelineMetrics
from dpstream.processor.adapters.status_page import render_status
from dpstream.processor.adapters.worker import (
    WATERMARK_DELAY_MS,
    DpstreamWorker,
    FiredTrigger,
    InputWentBackError,
    LostStateError,
    Ownership,
    lost_state_message,
    worker_epoch,
)
from dpstream.processor.adapters.worker_run import agree_run
from dpstream.processor.config import DpstreamConfig
from dpstream.state.store import check_state_directory
from dpstream.topics.kafka import (
    CHANGELOG_MAX_BYTES,
    CHANGELOG_TOPIC_CONFIG,
    EPOCH_TOPIC,
    DeliveryError,
    KafkaPublisher,
    TopicSpec,
    aiokafka_security,
    client_security,
    create_topics,
    read_changelog,
    read_epoch_marks,
    read_progress,
    repartition_topic,
    restarts_key,
    timestamp_types,
    topics_for,
    write_epoch_mark,
)

log = logging.getLogger("dpstream.worker")

#: --delivery choices (docs/operations.md, "Delivery")
DELIVERIES = ("exactly-once", "at-least-once")
#: --assignment choices (docs/operations.md, "Elastic workers")
ASSIGNMENTS = ("static", "group")
#: elastic workers: a transaction left open by a killed worker holds its partitions' new owner
#: (stable offsets, the changelog's end) until the broker aborts it after this long (Kafka
#: Streams uses 10 s under exactly-once); every transaction must finish within it
GROUP_TRANSACTION_TIMEOUT_MS = 15_000
#: times a transaction refused for an old group generation is sent again (elastic workers)
GENERATION_RETRIES = 5
#: the stages whose locks a rebalance takes, in this order (never another: no deadlock)
STAGE_ROLES = ("stage1", "stage2", "dynamic")
#: s a stopping worker gives Faust to shut down before the process exits anyway (non-zero)
STOP_GRACE_S = 5.0
#: s without a broker answer before readiness says the worker is waiting for it
BROKER_WAIT_S = 10.0
#: s between checks that the source logs still hold what the state has read
LOG_CHECK_S = 30.0
#: s between commits of a static worker's consumer offsets to Kafka (monitoring only:
#: docs/operations.md, "Consumer offsets")
OFFSET_COMMIT_S = 5.0


class CreateTimeInputError(RuntimeError):
    """An input topic's timestamps are its producers' (CreateTime), and --allow-create-time was not given."""


class BrokerUnreachableError(RuntimeError):
    """The broker has not answered for ``--broker-timeout`` seconds."""


#: s between the worker's reports of events dropped as late or future (one line per query with
#: counts, never one per event: docs/operations.md, "Trying it with a file")
DROP_REPORT_S = 10.0


def drop_report(pipelines, seen: dict) -> list[str]:
    """One line per query whose events were dropped as late or future since the last report;
    ``seen``: the totals reported so far, updated. Counts only, never an event's content."""
    totals: dict = {}
    queries = {}
    for pipe in pipelines:
        queries[pipe.query.name] = pipe.query
        for reason in ("late", "future"):
            key = (pipe.query.name, reason)
            totals[key] = totals.get(key, 0) + pipe.stats.dropped[reason]
    lines = []
    for name, q in sorted(queries.items()):
        late, future = (max(0, totals[(name, r)] - seen.get((name, r), 0)) for r in ("late", "future"))
        if late or future:
            lines.append(f"query {name}: since the last report, {late:,} events dropped as late (their trigger, by their "
                         f"{q.time_field!r}, had fired when the broker stamped them: the worker goes by the stamp, not by "
                         f"{q.time_field!r}) and {future:,} as future (dated more than max_skew {q.max_skew} after the stamp); "
                         f"dead-lettered (docs/operations.md, \"Trying it with a file\")")
    seen.update(totals)
    return lines


class TopicLayoutError(RuntimeError):
    """The topics on the broker do not fit the config (a dynamic input topic with more than one
    partition, repartition topics of different sizes, a topic missing)."""


def refusals() -> tuple:
    """What the worker refuses to run with (the operator must act: a restart refuses again).
    These end the process with ``dpstream worker: refused: ...`` and exit code 2; any other
    failure with ``dpstream worker: stopped: ...`` and 1 (docs/operations.md, "Health")."""
    from dpstream.accountant.ledger import ChargePlanError, LedgerEpochError
    from dpstream.processor.adapters.worker import StateLayoutError
    from dpstream.processor.engine.pipeline import StateMismatchError

    return (StateLayoutError, StateMismatchError, LedgerEpochError, ChargePlanError, CreateTimeInputError, TopicLayoutError,
            WorkerRefusal)


class WorkerRefusal(RuntimeError):
    """Refused before Faust starts (no broker within --broker-timeout, the web port taken)."""


def stop_line(exc: BaseException) -> tuple[int, str]:
    """The exit code and the last line the worker prints when ``exc`` stopped it."""
    if isinstance(exc, refusals()):
        return 2, f"dpstream worker: refused: {exc}"
    return 1, f"dpstream worker: stopped: {type(exc).__name__}: {exc}"


def _exit_now(code: int, last_line: Optional[str] = None) -> None:
    logging.shutdown()
    if last_line:
        print(last_line, file=sys.stderr, flush=True)
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
    #: "static" (--worker-index/--workers) or "group": partitions assigned by the consumer group,
    #: state moved with them through changelogs (docs/operations.md, "Elastic workers")
    assignment: str = "static"
    instance_id: str = field(default_factory=socket.gethostname)  # names this worker's transactional producers (group)


def group_id(app_id: str) -> str:
    """The elastic workers' consumer group (Faust's own consumer uses the app id as its group)."""
    return f"{app_id}-workers"


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
    # Faust's own consumer joins a group named after its app id; our agents read in-memory channels,
    # so that group has nothing to share. Elastic workers give each its own: a worker joining or
    # leaving would otherwise rebalance every worker's Faust consumer too, and Faust suspends its
    # channels while it rebalances
    faust_id = f"{s.app_id}-{s.instance_id}" if s.assignment == "group" else s.app_id
    check_state_directory(Path(s.state_dir))  # before Faust makes its datadir in it
    app = faust.App(
        faust_id, broker=f"kafka://{broker.replace(',', ';kafka://')}", store="memory://", datadir=os.path.join(s.state_dir, "faust"),
        web_enabled=True, web_port=s.web_port,
        web_bind=s.web_host, web_host=s.web_host, processing_guarantee="at_least_once", topic_allow_declare=False,
        broker_session_timeout=s.session_timeout, broker_heartbeat_interval=s.heartbeat_interval, autodiscover=False,
        broker_credentials=_faust_credentials(security),
    )
    metrics = PipelineMetrics()
    exactly_once = s.delivery == "exactly-once"
    group = s.assignment == "group"
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
    #: state: starting -> ready <-> waiting-for-broker, ready <-> restoring (group); any -> stopping
    #: (docs/operations.md, "Health")
    status = {"ready": False, "state": "starting", "reason": "opening state", "worker": None, "consumer": None,
              "acknowledged": time.monotonic(),
              # by partition: the consumer's position after the last fetch (past transaction
              # markers and aborted records, which no record's offset stands for), and the offset
              # after the last record fetched
              "positions": {}, "fetched": {},
              # elastic workers: each owned partition's (high watermark, time asked) and when the
              # broker last answered such a question
              "highs": {}, "answered": time.monotonic()}

    def set_state(state: str, reason: str = "") -> None:
        status["state"], status["reason"] = state, reason
        status["ready"] = state == "ready"
        metrics.ready.set(1 if state == "ready" else 0)

    def start_publishers() -> None:
        """Blocking: exactly once, each role's producer starts its transactions, fencing the
        previous incarnation of this worker (its open transactions abort)."""
        for role in roles:
            if group:  # one id per worker instance: a restarted pod fences its earlier incarnation
                publishers[role] = KafkaPublisher(broker, {"message.max.bytes": CHANGELOG_MAX_BYTES + 1024 * 1024,
                                                           "transaction.timeout.ms": GROUP_TRANSACTION_TIMEOUT_MS},
                                                  transactional_id=f"{s.app_id}-{s.instance_id}-{role}", timeout=s.broker_timeout)
            elif exactly_once:
                publishers[role] = KafkaPublisher(broker, transactional_id=f"{s.app_id}-{s.ownership.index}-{role}",
                                                  timeout=s.broker_timeout)
            else:
                publishers[role] = publishers.get("stage1") or KafkaPublisher(broker)

    def lock(role: str) -> asyncio.Lock:
        return locks.setdefault(role, asyncio.Lock())

    async def send(messages, role: str = "timer") -> None:
        """Send and wait until acknowledged (at least once) or committed as one transaction
        (exactly once), off the event loop; the caller commits state only after this."""
        async with lock(role):
            await send_now(messages, role)

    async def send_now(messages, role: str, offsets=None) -> None:
        """:func:`send`, the caller holding the role's lock; ``offsets``: consumer offsets committed
        in the same transaction (elastic workers' fencing)."""
        batch = [(m.topic, m.value, m.key, m.partition) for m in messages]
        if not batch:
            return
        consumer = status["consumer"]
        for attempt in range(GENERATION_RETRIES + 1):
            meta = consumer.group_metadata() if offsets else None
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: publishers[role].send(batch, s.broker_timeout, offsets=offsets, group=meta))
                break
            except DeliveryError as exc:
                # the group metadata is read by the poll thread (consumer_group.py): a rebalance
                # may have moved the generation since. The member is still in the group, and no
                # partition of ours can have moved: its hand-over waits for the lock we hold. So
                # the transaction (aborted) goes again with the new generation. An unknown member
                # (dropped from the group: its partitions may be another's now) is never retried
                if not offsets or "ILLEGAL_GENERATION" not in str(exc) or attempt == GENERATION_RETRIES:
                    raise
                log.info("a rebalance moved the group's generation during a transaction: sending it again")
                await consumer.metadata_after(meta)
        status["acknowledged"] = time.monotonic()

    async def transact(role: str, sources, messages, offsets: Optional[dict] = None, fence: bool = True) -> None:
        """Elastic workers, the role's lock held: ``messages``, every change the stores of
        ``sources`` made since their last transaction (their changelog records) and their consumer
        offsets, in one transaction; then each store's checkpoint (docs/operations.md, "Elastic
        workers"). A worker that lost one of these partitions in a rebalance cannot commit it.
        ``fence=False``: no consumer offsets, for the changes a worker makes while the group waits
        on it (gaining or giving up a partition), which no other worker can own meanwhile."""
        from confluent_kafka import TopicPartition

        worker: DpstreamWorker = status["worker"]
        changes, taken = worker.changelog_messages(sources)
        if not messages and not changes:
            return
        at = {(src.topic, src.partition): src.last_offset + 1 for src in sources}
        at.update(offsets or {})
        tps = [TopicPartition(t, p, max(0, o)) for (t, p), o in at.items()] if fence else None
        await send_now(list(messages) + changes, role, tps)
        worker.checkpoint(taken, publishers[role].acknowledged, int(time.time() * 1000))

    async def publish(fired: list[FiredTrigger]) -> None:
        worker: DpstreamWorker = status["worker"]
        for f in fired:
            # exactly once: the releases and the record that they are published, in one transaction
            await send(worker.release_messages(f) + ([worker.published_message(f)] if exactly_once else []))
            worker.mark_published(f)
            worker.trigger_fired(f)  # its log line (docs/operations.md, "The trigger log line")

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
        status["stopped_by"] = exc  # said again as the last line, after Faust's shutdown (run_worker)
        asyncio.get_running_loop().call_later(STOP_GRACE_S, _exit_now, *stop_line(exc))
        await app.crash(exc)

    async def process(items, step, role: str) -> None:
        """One dispatched batch: every partition's records through ``step`` (each partition once,
        its own store), all their messages sent with one acknowledgement wait (exactly once: one
        transaction, with the progress record of each partition), then every state write
        committed: one broker round trip per batch, not per partition."""
        worker: DpstreamWorker = status["worker"]
        if group:
            # the state first, then one transaction with its changelog, the outputs and the
            # consumer offsets, then the records count as read (watermarks); partitions lost
            # since these records were fetched are left to their new owner
            async with lock(role):
                results = [r for topic, partition, records, source in items
                           if worker.source_of((topic, partition)) is source and (r := step(topic, partition, records)) is not None]
                for r in results:
                    r.write()
                await transact(role, [r.source for r in results], [m for r in results for m in r.messages],
                               {(r.source.topic, r.source.partition): r.last_offset + 1 for r in results})
                for r in results:
                    r.acknowledge()
            return
        results = [r for topic, partition, records, _ in items if (r := step(topic, partition, records)) is not None]
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
            if group:
                await fire_triggers_group(worker, now)
                return
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

    async def fire_triggers_group(worker: DpstreamWorker, now: int) -> None:
        """The timer, elastic workers: as for static ownership, but each trigger's state (its
        journal, published mark and opened windows) goes out in the transaction of its
        releases, under the stage-2 lock, so that a partition moving to another worker carries
        either all of a trigger or none of it."""
        ends = await read_to_end_group(worker)
        await send(worker.watermark_messages(now, ends))
        if worker.charges is not None:
            worker.charges.charge_due(now)
        for key, source in list(worker.stage2.items()):
            while True:
                async with lock("stage2"):
                    if worker.stage2.get(key) is not source:
                        break  # moved to another worker meanwhile
                    fired = worker.fire_next(source, now)
                    if fired is None:
                        break
                    worker.mark_published(fired)
                    await transact("stage2", [source], worker.release_messages(fired))
                    worker.trigger_fired(fired)
                await asyncio.sleep(0)  # one trigger at a time: probes and stage 2 go on
        async with lock("dynamic"):
            due, letters = worker.advance_dynamic(now, ends)
            messages = list(letters)
            for key in due:
                messages += worker.dynamic_releases(key)
                worker.mark_dynamic_published(key)
            await transact("dynamic", list(worker.dynamic.values()), messages)

    async def read_to_end_group(worker: DpstreamWorker) -> dict:
        """:func:`read_to_end` for elastic workers: each owned input and update partition's high
        watermark is asked of the broker; one the worker has read and committed up to counts as
        read to its end at the time just before it asked."""
        gc = status["consumer"]
        keys = [*worker.stage1, *worker.dynamic]
        if gc is None:
            return {}
        try:
            # no input partition owned: the question still tells the broker answers (watch_broker)
            highs = await asyncio.get_running_loop().run_in_executor(None, lambda: gc.log_ends(keys) if keys else gc.ping())
        except Exception as exc:  # noqa: BLE001 - the broker may be away: watch_broker handles that
            log.debug("log ends not known: %s", exc)
            return {}
        status["answered"] = time.monotonic()
        status["highs"] = highs
        ends = {}
        for key, (high, asked) in highs.items():
            src = worker.source_of(key)
            if src is None:
                continue
            committed = src.last_offset + 1
            position = gc.position(key)
            if committed >= high or (position is not None and position >= high and committed >= status["fetched"].get(key, 0)):
                ends[key] = asked
        return ends

    def check_logs_of(worker: DpstreamWorker) -> dict:
        """Every source partition's log against the state (raises InputWentBackError); returns
        the log positions (start, end, topic id) by partition."""
        sources = worker.sources
        positions = _log_positions(broker, sources)
        for src in sources:
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
            position = status["positions"].get(key, committed)
            if committed >= high or (position >= high and committed >= status["fetched"].get(key, 0)):
                ends[key] = consumer.last_poll_timestamp(tp)
        return ends

    def refresh_metrics() -> None:
        worker, consumer = status["worker"], status["consumer"]
        if worker is None:
            return
        worker.refresh_metrics()
        lags = {}
        for src in worker.sources:
            if group:
                high = status["highs"].get((src.topic, src.partition), (None,))[0]
            else:
                high = consumer.highwater(_tp(src.topic, src.partition)) if consumer is not None else None
            if high is not None:
                lags[(src.topic, src.partition)] = max(0, high - src.last_offset - 1)
        metrics.observe_lag(lags)  # a partition that moved away loses its sample
        for topic, count in worker.owned_counts().items():
            metrics.partitions_owned.labels(topic).set(count)

    async def open_worker(loop) -> DpstreamWorker:
        """Create missing topics, check the input topics, open the state (static: the owned
        partitions'; group: none yet, each is restored as the group assigns it)."""
        # the epoch first: the start-over count in dpstream-epochs names the repartition topics
        await loop.run_in_executor(None, lambda: create_topics(broker, [t for t in topics_for([]) if t.name == EPOCH_TOPIC]))
        marks = await loop.run_in_executor(None, lambda: read_epoch_marks(broker))
        # `dpstream reset` counts start-overs here: each moves the worker to a new noise label
        restarts = int((marks.get(restarts_key(s.app_id)) or {}).get("count", 0))
        # the run nonce of the noise label, the same for every worker of the application; a
        # fresh start over releases of a window still open is refused (worker_run.py)
        run = await loop.run_in_executor(None, lambda: agree_run(broker, s, marks, restarts))
        epoch = worker_epoch(s.config, restarts)
        specs = topics_for(s.config.queries, s.partitions, s.config.dynamic, s.app_id, epoch)
        await loop.run_in_executor(None, lambda: create_topics(broker, specs))
        inputs = {q.input_topic for q in s.config.queries}
        dynamic_inputs = {q.input_topic for q in s.config.dynamic}
        counts = await loop.run_in_executor(None, lambda: _partition_counts(
            broker, inputs | dynamic_inputs | {repartition_topic(q.name, s.app_id, epoch) for q in s.config.queries}))
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
                raise TopicLayoutError(f"dynamic input topic {topic!r} has {counts[topic]} partitions; it needs exactly 1")
        # existing topics keep their partition counts: use what the broker has
        repartitions = {n for t, n in counts.items() if t not in inputs | dynamic_inputs}
        if len(repartitions) > 1:
            raise TopicLayoutError(f"repartition topics have different partition counts: {sorted(repartitions)}")
        # what this worker's state belonged to when it last started, kept outside its volume:
        # an empty state directory under the same epoch is a lost volume, refused (static); a
        # lost changelog topic, refused (group)
        mark_key = f"{s.app_id}/group" if group else f"{s.app_id}/{s.ownership.index}"
        previous = marks.get(mark_key)
        worker = await loop.run_in_executor(None, lambda: DpstreamWorker(
            s.config, s.secret, s.state_dir, None if group else s.ownership, {t: counts[t] for t in inputs},
            repartitions.pop() if repartitions else s.partitions, metrics, previous_mark=previous, app_id=s.app_id,
            partitioner=s.partitioner, watermark_delay_ms=s.watermark_delay_ms, restarts=restarts, run_nonce=run.nonce))
        log.info(run.log_line(worker.noise.label))
        status["worker"] = worker
        mark = dict(worker.epoch_mark)
        if group:
            mark["changelogs"] = await loop.run_in_executor(None, lambda: open_changelogs(worker, counts, previous))
        if previous is None or {k: previous.get(k) for k in mark} != mark:
            mark["since_ms"] = int(time.time() * 1000)
            await loop.run_in_executor(None, lambda: write_epoch_mark(broker, mark_key, mark))
        return worker

    def open_changelogs(worker: DpstreamWorker, counts: dict, previous: Optional[dict]) -> dict:
        """Blocking: create the changelog topics (one per source topic, as many partitions) and
        return their topic ids. A changelog this application epoch already had under another id
        (deleted, recreated) is refused: its stores' state is gone, and starting afresh would
        forget spent budget and released values (docs/privacy.md, "Failures")."""
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient

        names = {worker.changelog_topic(t): counts.get(t, 1) for t in worker.source_topics()}
        create_topics(broker, [TopicSpec(n, k, CHANGELOG_TOPIC_CONFIG, "changelog") for n, k in names.items()])
        admin = AdminClient({"bootstrap.servers": broker, **client_security()})
        ids = {name: str(f.result(15).topic_id) for name, f in admin.describe_topics(TopicCollection(sorted(names))).items()}
        recorded = (previous or {}).get("changelogs") or {}
        same_epoch = previous is not None and {k: previous.get(k) for k in worker.epoch_mark} == worker.epoch_mark
        for name, topic_id in ids.items():
            if same_epoch and recorded.get(name) not in (None, topic_id):
                raise LostStateError(lost_state_message(
                    f"changelog topic {name} was recreated (its id is {topic_id}, this application epoch wrote topic id "
                    f"{recorded[name]}): the state it held is lost", s.app_id, s.config))
        return ids

    class StageBatches:
        """Fetched records gathering per stage until they go to the stage's agent as one batch
        (docs/operations.md, "Batches"): after ``--batch-linger``, or at ``--fetch-records``; while
        the stage is still busy with its last batch, they go on gathering, so under load batches
        grow and the fixed cost of each (acknowledgement wait, transaction) is shared by more."""

        def __init__(self):
            self.stages = (stage1_in, stage2_in, dynamic_in)
            self.pending: dict = {ch: {} for ch in self.stages}  # channel -> (topic, partition) -> (source, records)
            self.counts = dict.fromkeys(self.stages, 0)
            self.firsts: dict = dict.fromkeys(self.stages)

        def wait_ms(self) -> int:
            now = time.monotonic()
            due = [self.firsts[ch] + s.batch_linger - now for ch in self.stages if self.counts[ch] and not in_flight[ch]]
            wait = 200 if not due else max(0, int(min(due) * 1000))
            if any(in_flight[ch] for ch in self.stages if self.counts[ch]):
                wait = min(wait, 20)  # look again soon: a busy stage may have finished
            return wait

        def room(self) -> int:
            return s.fetch_records - sum(self.counts.values())

        def add(self, ch, key, source, records) -> None:
            self.pending[ch].setdefault(key, (source, []))[1].extend(records)
            self.counts[ch] += len(records)
            if self.firsts[ch] is None:
                self.firsts[ch] = time.monotonic()
            status["fetched"][key] = records[-1].offset + 1

        def drop(self, key) -> None:
            """A partition given up: its gathered records are its new owner's to read."""
            for ch in self.stages:
                entry = self.pending[ch].pop(key, None)
                if entry is not None:
                    self.counts[ch] -= len(entry[1])
            status["fetched"].pop(key, None)

        async def dispatch(self) -> None:
            now = time.monotonic()
            for ch in self.stages:
                if self.counts[ch] and not in_flight[ch] and (self.counts[ch] >= s.fetch_records or now - self.firsts[ch] >= s.batch_linger):
                    in_flight[ch] += 1
                    await ch.send(value=[(t, p, records, source) for (t, p), (source, records) in self.pending[ch].items()])
                    self.pending[ch], self.counts[ch], self.firsts[ch] = {}, 0, None

    def role_of(worker: DpstreamWorker, key) -> str:
        return "stage1" if key in worker.stage1 else "stage2" if key in worker.stage2 else "dynamic"

    def channel_of(worker: DpstreamWorker, key):
        return stage1_in if key in worker.stage1 else stage2_in if key in worker.stage2 else dynamic_in

    @app.task
    async def consume():
        """Open the state, then read the owned partitions in batches."""
        loop = asyncio.get_running_loop()
        # the poll thread waits on the event loop during a rebalance while sends, restores and
        # broker queries also run off it: room for all of them
        loop.set_default_executor(ThreadPoolExecutor(16, thread_name_prefix="dpstream"))
        try:
            worker = await open_worker(loop)
            await loop.run_in_executor(None, start_publishers)
            if group:
                await consume_group(loop, worker)
            else:
                await consume_static(loop, worker)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            await crash(exc)
        finally:
            if status["state"] != "stopping":
                set_state("stopping", "consumer stopped")
            consumer = status["consumer"]
            if consumer is not None:
                if group:  # hands over its partitions (on this loop) before it leaves
                    await asyncio.get_running_loop().run_in_executor(None, consumer.close)
                else:
                    await consumer.stop()
            committer = offset_committer.pop("client", None)
            if committer is not None:
                await asyncio.get_running_loop().run_in_executor(None, committer.close)

    async def consume_group(loop, worker: DpstreamWorker) -> None:
        """Elastic workers: read what the consumer group assigns (docs/operations.md, "Elastic
        workers"). A gained partition's store is restored from its changelog before the
        partition is assigned, at the offset the restored state has read to."""
        batches = StageBatches()
        owned: dict = {}  # (topic, partition) -> (channel, source)

        async def gain(keys: list) -> dict:
            set_state("restoring", f"restoring {len(keys)} gained partitions from their changelogs")
            # a previous owner's last transaction settled first (stable offsets, KIP-447): its
            # changelog records are then below the end the restore reads to
            committed = await loop.run_in_executor(None, lambda: gc.committed(keys))
            now = int(time.time() * 1000)
            stores = {}
            for topic, partition in keys:
                changelog = worker.changelog_topic(topic)

                def reader(start, changelog=changelog, partition=partition):
                    return read_changelog(broker, changelog, partition, start)

                stores[(topic, partition)] = await loop.run_in_executor(
                    None, lambda t=topic, p=partition: worker.restore(t, p, reader, now))
            async with _all_locks():
                gained = [worker.add_source(t, p, stores[(t, p)]) for t, p in keys]
            positions = await loop.run_in_executor(None, lambda: _log_positions(broker, gained))
            offsets = {}
            for src in gained:
                key = (src.topic, src.partition)
                start, end, topic_id = positions[key]
                src.check_log(start, end, topic_id)  # a log that went back: refused (InputWentBackError)
                if src.last_offset + 1 < start:
                    log.error("%s: records at offsets %d to %d were deleted (retention) before they were read; going on from "
                              "offset %d", src.name, src.last_offset + 1, start - 1, start)
                offsets[key] = max(src.last_offset + 1, start)
                if committed.get(key, -1) > src.last_offset + 1:
                    log.error("%s: the group committed offset %d, but the restored state has read only to %d: its changelog "
                              "lost records", src.name, committed[key], src.last_offset)
                owned[key] = (channel_of(worker, key), src)
            # what opening them wrote (noise and topic-id marks) goes to their changelogs now, so
            # that their stores stay at a checkpoint (an incremental restore when they come back)
            for role in STAGE_ROLES:
                mine = [src for src in gained if role_of(worker, (src.topic, src.partition)) == role]
                async with lock(role):
                    await transact(role, mine, [], fence=False)
            log.info("gained %d partitions: %s", len(keys), ", ".join(f"{t}-{p}" for t, p in keys))
            status["answered"] = time.monotonic()  # it did, all along the restore
            set_state("ready")
            return offsets

        async def lose(keys: list) -> None:
            async with _all_locks():
                for key in keys:
                    entry = owned.pop(key, None)
                    batches.drop(key)
                    if entry is None:
                        continue
                    source = entry[1]
                    # what its store wrote since its last transaction goes out before it moves
                    role = role_of(worker, key)
                    # a send its (cancelled) agent left running finishes first
                    await loop.run_in_executor(None, publishers[role].wait_idle)
                    try:
                        # only what the worker wrote on gaining it is not on the changelog yet
                        # (every batch and trigger goes out with its changes): while the group
                        # waits on this hand-over, no offsets (the coordinator may not take them now)
                        await transact(role, [source], [], fence=False)
                    except Exception as exc:  # noqa: BLE001 - its next owner rebuilds the store in full
                        log.warning("%s: its last changes were not sent (%s); its next owner restores it in full", source.name, exc)
                    worker.remove_source(*key)
            log.info("gave up %d partitions: %s", len(keys), ", ".join(f"{t}-{p}" for t, p in keys))

        gc = GroupConsumer(broker, group_id(s.app_id), worker.source_topics(), loop, gain, lose, s.session_timeout,
                           s.heartbeat_interval)
        status["consumer"] = gc
        status["answered"] = time.monotonic()
        set_state("ready")
        log.info("dpstream worker %s ready: joined consumer group %s", s.instance_id, group_id(s.app_id))
        while True:
            await asyncio.sleep(0)  # let the agents and the web server run
            room = batches.room()
            if room <= 0:
                await asyncio.sleep(0.02)  # full: wait for a busy stage to take its batch
                fetched = {}
            else:
                fetched = await gc.fetch(room, batches.wait_ms() / 1000)
            for key, records in fetched.items():
                entry = owned.get(key)
                if entry is not None:  # not a partition given up meanwhile
                    batches.add(entry[0], key, entry[1], records)
            await batches.dispatch()

    def _all_locks():
        class _Locks:
            async def __aenter__(self):
                for role in STAGE_ROLES:
                    await lock(role).acquire()

            async def __aexit__(self, *exc):
                for role in reversed(STAGE_ROLES):
                    lock(role).release()

        return _Locks()

    async def consume_static(loop, worker: DpstreamWorker) -> None:
        """Static ownership: republish the journal, then read the owned partitions from the
        offsets their state has read to."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.errors import OffsetOutOfRangeError

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
                                    **aiokafka_security(client_security()))
        await consumer.start()
        status["consumer"] = consumer
        stage_of = {}
        for key, src in [*worker.stage1.items(), *worker.stage2.items(), *worker.dynamic.items()]:
            stage_of[_tp(*key)] = (channel_of(worker, key), src)
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
        batches = StageBatches()
        while True:
            await asyncio.sleep(0)  # a fetch that returns at once does not yield: let the agents and the web server run
            room = batches.room()
            if room <= 0:
                fetched = {}
                await asyncio.sleep(0.02)  # full: wait for a busy stage to take its batch
            else:
                try:
                    fetched = await consumer.getmany(timeout_ms=batches.wait_ms(), max_records=room)
                except OffsetOutOfRangeError as exc:
                    tp, offset = next(iter(exc.args[0].items()))
                    raise InputWentBackError(
                        f"{tp.topic}-{tp.partition}: offset {offset}, where this worker's state goes on, is no longer in "
                        f"the log: the topic was recreated or the broker lost data. See docs/operations.md, \"When the "
                        f"input goes back\"") from None
            for tp, records in fetched.items():
                ch, src = stage_of[tp]
                batches.add(ch, (tp.topic, tp.partition), src, records)
            for tp in stage_of:
                status["positions"][(tp.topic, tp.partition)] = await consumer.position(tp)
            await batches.dispatch()

    @app.timer(1.0, name="dpstream.watch_broker")
    async def watch_broker():
        """Broker contact: the last fetch response or acknowledged send. Without any for 10 s the
        worker says it is waiting (readiness 503) and resumes when the broker answers again;
        without any for ``broker_timeout`` it exits non-zero, for Kubernetes to restart it."""
        consumer = status["consumer"]
        if consumer is None or status["state"] not in ("ready", "waiting-for-broker"):
            return
        if group:  # the timer asks the broker for the log ends at every tick
            fetched = [time.time() * 1000 - (time.monotonic() - status["answered"]) * 1000]
        else:
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

    drops_seen: dict = {}

    @app.timer(DROP_REPORT_S, name="dpstream.report_drops")
    async def report_drops():
        """Events dropped as late or future: one warning per query and period, with counts."""
        worker = status["worker"]
        if worker is not None:
            for line in drop_report(list(worker.pipelines()), drops_seen):
                log.warning(line)

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

    def offsets_read(worker: DpstreamWorker) -> dict:
        """Static ownership: each owned partition's offset its committed state has read to, or
        the consumer's position when every record fetched from it is committed (the position
        passes transaction markers, which no record's offset stands for)."""
        out = {}
        for key, src in [*worker.stage1.items(), *worker.stage2.items(), *worker.dynamic.items()]:
            offset = src.last_offset + 1
            position = status["positions"].get(key)
            if position is not None and position > offset >= status["fetched"].get(key, 0):
                offset = position
            out[key] = offset
        return out

    def commit_offsets_now(offsets: dict) -> None:
        """Blocking: commit ``offsets`` for the group ``<app id>-workers`` from a client that never
        joins it (a commit outside any generation, which Kafka keeps for a group without members)."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        client = offset_committer.get("client")
        if client is None:
            client = offset_committer["client"] = Consumer({
                "bootstrap.servers": broker, "group.id": group_id(s.app_id), "enable.auto.commit": False,
                "socket.timeout.ms": 10_000, **client_security()})
        tps = [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())]
        for attempt in range(3):
            try:
                client.commit(offsets=tps, asynchronous=False)
                return
            except KafkaException as exc:  # the group's coordinator is looked up on the first commit
                if attempt == 2 or not exc.args[0].retriable() and "COORDINATOR" not in exc.args[0].name():
                    raise
                time.sleep(0.5)

    offset_committer: dict = {"committed": {}, "failing": False}

    @app.timer(OFFSET_COMMIT_S, name="dpstream.commit_offsets")
    async def commit_offsets():
        """Static ownership: commit what the state has read to Kafka as the consumer group
        ``<app id>-workers`` after the state committed it, so that standard lag tools (Kafka's
        consumer-groups tool, exporters) see the worker. For monitoring only: the worker resumes
        from its own state, never from these (docs/operations.md, "Consumer offsets"). Elastic
        workers commit theirs in their transactions."""
        worker = status["worker"]
        if group or worker is None or status["state"] != "ready":
            return
        done = offset_committer["committed"]
        offsets = {k: o for k, o in offsets_read(worker).items() if done.get(k) != o}
        if not offsets:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, lambda: commit_offsets_now(offsets))
        except Exception as exc:  # noqa: BLE001 - monitoring only: the worker goes on
            if not offset_committer["failing"]:
                log.warning("consumer offsets not committed to group %s (lag tools will not see this worker's "
                            "progress): %s", group_id(s.app_id), exc)
            offset_committer["failing"] = True
            return
        if offset_committer["failing"]:
            log.info("consumer offsets committed to group %s again", group_id(s.app_id))
        offset_committer["failing"] = False
        done.update(offsets)

    def status_data() -> dict:
        """The status page's data (docs/operations.md, "Status page"): the worker's own
        (:meth:`DpstreamWorker.status`), its health state and how it runs."""
        worker = status["worker"]
        data = worker.status(int(time.time() * 1000)) if worker is not None else {"app_id": s.app_id}
        data.update(state=status["state"], reason=status["reason"], assignment=s.assignment, delivery=s.delivery,
                    worker=f"instance {s.instance_id}" if group else f"worker {s.ownership.index} of {s.ownership.workers}",
                    offsets_group=group_id(s.app_id))
        return data

    @app.page("/")
    async def status_page(web, request):
        """The status page: plain HTML, no script (processor/adapters/status_page.py)."""
        return web.html(render_status(status_data()))

    @app.page("/status.json")
    async def status_json(web, request):
        return web.json(status_data())

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
            raise TopicLayoutError(f"topic {topic!r} does not exist on {broker}")
        counts[topic] = len(meta.topics[topic].partitions)
    return counts


#: what mode (Faust's service framework) logs again when a service crashed (after a service
#: label): the worker has already said why (crash), and says it once more as its last line
_CRASH_ECHOES = ("Crashed reason=%r", "Error: %r", "We experienced a crash! Reraising original exception...")
#: Faust's leader-election topic, which the worker never declares (topic_allow_declare=False) nor
#: uses: its partitions are its own (static) or its group consumer's; aiokafka logs its absence
#: as an ERROR at every start
_UNUSED_TOPIC = "-__assignor-__leader"


class _FaustNoise(logging.Filter):
    """Drops mode's echoes (with their stack dumps) of a failure the worker has reported, and
    the misleading errors about Faust's unused leader topic."""

    def __init__(self, status: dict):
        super().__init__()
        self.status = status

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        if self.status.get("stopped_by") is not None and template.endswith(_CRASH_ECHOES):
            return False
        return _UNUSED_TOPIC not in template and not any(_UNUSED_TOPIC in str(a) for a in (record.args or ()))


def preflight(s: WorkerSettings) -> None:
    """Before Faust starts (its own failures are stack dumps): the web port is free, and a broker
    answers within ``--broker-timeout``. Raises :class:`WorkerRefusal`."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from dpstream.processor.adapters.kafka_tools import RDKAFKA_LOG, last_reason

    with socket.socket(socket.AF_INET6 if ":" in s.web_host else socket.AF_INET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((s.web_host, s.web_port))
        except OSError as exc:
            raise WorkerRefusal(f"--web-port {s.web_port}: cannot listen on {s.web_host}:{s.web_port} ({exc.strerror}): another "
                                f"worker on this machine? Give each its own --web-port") from None
    broker = broker_address(s.broker)
    admin = AdminClient({"bootstrap.servers": broker, "logger": RDKAFKA_LOG, **client_security()})
    deadline = time.monotonic() + s.broker_timeout
    for attempt in itertools.count():
        try:
            admin.list_topics(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            admin.poll(0)  # librdkafka's log lines go to RDKAFKA_LOG (left queued, it prints that it drops them)
            return
        except KafkaException:
            admin.poll(0)  # librdkafka's log lines: the reason
            if time.monotonic() >= deadline:
                raise WorkerRefusal(f"no Kafka broker answered at {broker} within {s.broker_timeout:g} s (--broker-timeout)"
                                    f"{last_reason()}; start one (scripts/broker start) or pass --broker HOST:PORT") from None
            if attempt == 0:
                log.warning("no Kafka broker answers at %s yet%s; waiting up to %g s (--broker-timeout)", broker, last_reason(),
                            s.broker_timeout)


def _quiet_worker(app: faust.App, loglevel: str):
    """Faust's worker, with Faust's, mode's and aiokafka's logs at WARNING and above (all of them
    with --log-level debug), dpstream's at --log-level, without :class:`_FaustNoise`."""
    from faust.worker import Worker

    class QuietWorker(Worker):
        def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
            super().on_setup_root_logger(logger, level)
            logging.getLogger("dpstream").setLevel(level)
            logger.setLevel(level if level <= logging.DEBUG else max(level, logging.WARNING))
            for handler in logger.handlers:
                handler.addFilter(_FaustNoise(app.dpstream_status))

    return QuietWorker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)


def run_worker(s: WorkerSettings, loglevel: str = "info") -> int:
    """Run until SIGTERM/SIGINT (0), or until a failure: then its reason is the last line on
    stderr, ``dpstream worker: refused: ...`` (exit code 2: the operator must act, see
    :func:`refusals`) or ``dpstream worker: stopped: ...`` (1) (docs/operations.md, "Health")."""
    try:
        preflight(s)
    except WorkerRefusal as exc:
        code, line = stop_line(exc)
        print(line, file=sys.stderr)
        return code
    app = build_app(s)
    worker = _quiet_worker(app, loglevel)
    try:
        worker.execute_from_commandline()  # until SIGTERM/SIGINT
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    stopped_by = app.dpstream_status.get("stopped_by")
    # A failure exits at once (os._exit): an executor thread may still be waiting on a broker that
    # is gone (the monitoring offset commit blocks until its coordinator answers), and the
    # interpreter's own exit joins those threads, which kept a worker up 40 s after it stopped
    if stopped_by is not None:
        _exit_now(*stop_line(stopped_by))
    elif code:
        _exit_now(code, f"dpstream worker: stopped: Faust failed (exit code {code}; its log above says why)")
    return code
