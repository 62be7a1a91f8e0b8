"""The Faust app: the worker's agents, trigger timer and web endpoints (the only Faust code).

Faust runs the worker: its lifecycle and signals, three agents (stage 1 by user, stage 2 by key,
dynamic updates), the timer that fires triggers on the fixed schedule, and the web server for
``/healthz``, ``/readyz``, ``/metrics`` and the status page. Everything they do is a method of one
:class:`dpstream.processor.adapters.worker_run.WorkerRun` (static or elastic ownership), whose
processing is :class:`dpstream.processor.adapters.worker.DpstreamWorker`.

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

from dpstream.processor.adapters.drop_report import DropReport
from dpstream.processor.adapters.elastic_run import ElasticRun
from dpstream.processor.adapters.health import STOPPING, WorkerHealth
from dpstream.processor.adapters.metrics import PipelineMetrics
from dpstream.processor.adapters.stage_batches import STAGES
from dpstream.processor.adapters.static_run import StaticRun
from dpstream.processor.adapters.status_page import render_status
from dpstream.processor.adapters.worker import WATERMARK_DELAY_MS, InputWentBackError, Ownership
from dpstream.processor.adapters.worker_run import group_id  # noqa: F401 - the CLI and tests name it here
from dpstream.processor.adapters.worker_startup import CreateTimeInputError, TopicLayoutError
from dpstream.processor.config import DpstreamConfig
from dpstream.state.store import check_state_directory
from dpstream.topics.client_properties import use_client_id
from dpstream.topics.kafka import aiokafka_security, client_security

log = logging.getLogger("dpstream.worker")

#: --delivery choices (docs/operations.md, "Delivery")
DELIVERIES = ("exactly-once", "at-least-once")
#: --assignment choices (docs/operations.md, "Elastic workers")
ASSIGNMENTS = ("static", "group")
#: s a stopping worker gives Faust to shut down before the process exits anyway (non-zero)
STOP_GRACE_S = 5.0
#: s between checks that the source logs still hold what the state has read
LOG_CHECK_S = 30.0
#: s between commits of a static worker's consumer offsets to Kafka (monitoring only:
#: docs/operations.md, "Consumer offsets")
OFFSET_COMMIT_S = 5.0


class BrokerUnreachableError(RuntimeError):
    """The broker has not answered for ``--broker-timeout`` seconds."""


#: s between the worker's reports of dropped events (one line per query and reason, with
#: counts, never one per event: processor/adapters/drop_report.py)
DROP_REPORT_S = 10.0


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


def faust_group_id(s: WorkerSettings) -> str:
    """Faust's app id, which its own consumer joins as a group (see :func:`build_app`)."""
    return f"{s.app_id}-{s.instance_id}" if s.assignment == "group" else s.app_id


def worker_client_id(s: WorkerSettings) -> str:
    """The ``client.id`` of every Kafka client of this worker process (its producers, group
    member, partition reader and Faust's own): ``<app id>-<instance id>-<pid>``, the instance id
    being the host's name (a pod's name) unless --instance-id says otherwise. Kafka's tools list
    a group's members by it (``kafka-consumer-groups --describe --members``), and the broker's
    logs and quotas name clients by it: without one every client is ``rdkafka``."""
    return f"{s.app_id}-{s.instance_id}-{os.getpid()}"


def build_app(s: WorkerSettings) -> faust.App:
    """The Faust app of one worker: three agents (the stages), the timers and the web pages, all
    calling one :class:`dpstream.processor.adapters.worker_run.WorkerRun` (static or elastic)."""
    broker = broker_address(s.broker)
    client_id = worker_client_id(s)
    use_client_id(client_id)
    os.makedirs(s.state_dir, exist_ok=True)
    # Faust's own consumer joins a group named after its app id; our agents read in-memory channels,
    # so that group has nothing to share. Elastic workers give each its own: a worker joining or
    # leaving would otherwise rebalance every worker's Faust consumer too, and Faust suspends its
    # channels while it rebalances
    faust_id = faust_group_id(s)
    check_state_directory(Path(s.state_dir))  # before Faust makes its datadir in it
    app = faust.App(
        faust_id, broker=f"kafka://{broker.replace(',', ';kafka://')}", store="memory://", datadir=os.path.join(s.state_dir, "faust"),
        web_enabled=True, web_port=s.web_port,
        web_bind=s.web_host, web_host=s.web_host, processing_guarantee="at_least_once", topic_allow_declare=False,
        broker_session_timeout=s.session_timeout, broker_heartbeat_interval=s.heartbeat_interval, autodiscover=False,
        broker_credentials=_faust_credentials(client_security()), broker_client_id=client_id,
    )
    metrics = PipelineMetrics()
    health = WorkerHealth(metrics.ready)
    channels = {stage: app.channel() for stage in STAGES}

    async def send_batch(stage: str, items: list) -> None:
        await channels[stage].send(value=items)

    async def crash(exc: BaseException) -> None:
        # at-least-once: stop rather than go on past a batch whose state was not committed;
        # the restarted worker resumes from the last committed offsets. Every state write is
        # atomic, so exiting at once loses nothing: Faust's own shutdown may wait a minute on a
        # broker that is gone, so the process exits non-zero within STOP_GRACE_S whatever happens
        if health.stopping:
            return
        # an error of Python's own (AttributeError, KeyError...) is a bug, not a condition the
        # worker names: its traceback (code locations; the message is the same) says where
        bug = type(exc).__module__ == "builtins"
        log.error("dpstream worker stopping: %s: %s", type(exc).__name__, exc, exc_info=exc if bug else None)
        health.set(STOPPING, f"{type(exc).__name__}: {exc}")
        health.stopped_by = exc  # said again as the last line, after Faust's shutdown (run_worker)
        asyncio.get_running_loop().call_later(STOP_GRACE_S, _exit_now, *stop_line(exc))
        await app.crash(exc)

    kind = ElasticRun if s.assignment == "group" else StaticRun
    run = kind(s, broker, metrics, health, send_batch, crash)

    def stage_agent(stage: str, name: str, doc: str):
        async def agent(batches):
            async for items in batches:
                try:
                    await run.process(items, stage)
                except Exception as exc:  # noqa: BLE001 - any failure stops the worker
                    await crash(exc)
                    return
                run.batches.done(stage)

        agent.__doc__ = doc
        return app.agent(channels[stage], name=f"dpstream.{name}")(agent)

    stage_agent("stage1", "stage1_bound_contributions", "Stage 1, by user: contribution bounding; bounded records go out keyed by key.")
    stage_agent("stage2", "stage2_aggregate_by_key", "Stage 2, by key: append bounded records to the pending micro-batches.")
    stage_agent("dynamic", "dynamic_counts", "Dynamic queries: insert/delete updates -> per-item counts at each closed segment.")

    @app.timer(trigger_tick_seconds(s.config), name="dpstream.fire_triggers")
    async def fire_triggers():
        """The fixed trigger schedule: key selection, perturbation, prediction, publication."""
        if run.worker is None or not health.ready:
            return
        try:
            await run.fire(int(time.time() * 1000))
            run.worker.log_triggers()  # one line per trigger fired on every owned partition
        except Exception as exc:  # noqa: BLE001
            await crash(exc)

    @app.task
    async def consume():
        """Open the state, then read the owned partitions in batches."""
        loop = asyncio.get_running_loop()
        # the poll thread waits on the event loop during a rebalance while sends, restores and
        # broker queries also run off it: room for all of them
        loop.set_default_executor(ThreadPoolExecutor(16, thread_name_prefix="dpstream"))
        try:
            await run.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            await crash(exc)
        finally:
            if not health.stopping:
                health.set(STOPPING, "consumer stopped")
            await run.close()
            if run.worker is not None:
                run.worker.log_triggers(force=True)  # triggers some partitions fired before the stop

    @app.timer(1.0, name="dpstream.watch_broker")
    async def watch_broker():
        """Broker contact: the last fetch response, acknowledged send or answered question (and,
        after 3 s without any, a metadata question of the watch's own). Without any for 10 s the
        worker says it is waiting (readiness 503) and resumes when the broker answers again;
        without any for ``broker_timeout`` it exits non-zero, for Kubernetes to restart it."""
        if run.consumer is None:
            return
        asyncio.ensure_future(run.probe_broker())  # answers only when nothing else heard from the broker
        silent = run.broker_silence()
        verdict = health.judge_silence(silent, s.broker_timeout)
        if verdict == "timeout":
            await crash(BrokerUnreachableError(f"no answer from the broker at {broker} for {silent:.0f} s (--broker-timeout)"))
        elif verdict == "waiting":
            log.warning("waiting for the broker at %s: no answer for %.0f s", broker, silent)
        elif verdict == "answers":
            log.info("the broker at %s answers again", broker)

    drops = DropReport(s.partitioner)

    @app.timer(DROP_REPORT_S, name="dpstream.report_drops")
    async def report_drops():
        """Dropped events: one line per query, reason and period, with the count and the likely
        cause (a warning for input problems, info for the bounds at work)."""
        if run.worker is not None:
            for level, line in drops.lines(run.worker.dropped_counts()):
                log.log(level, line)

    @app.timer(LOG_CHECK_S, name="dpstream.check_logs")
    async def check_logs():
        """While running: a source topic recreated under the same name, or a log shorter than
        what the state has read, stops the worker (refused on restart too) rather than count the
        new records from wherever the old offsets point."""
        if run.worker is None or not health.ready:
            return
        try:
            await run.check_logs()
        except InputWentBackError as exc:
            await crash(exc)
        except Exception as exc:  # noqa: BLE001 - the broker may be away: watch_broker handles that
            log.debug("log position check skipped: %s", exc)

    @app.timer(OFFSET_COMMIT_S, name="dpstream.commit_offsets")
    async def commit_offsets():
        """Static ownership: commit what the state has read to Kafka for lag tools
        (docs/operations.md, "Consumer offsets"). Elastic workers commit theirs in their
        transactions."""
        if run.worker is not None and health.ready:
            await run.commit_offsets()

    @app.page("/")
    async def status_page(web, request):
        """The status page: plain HTML, no script (processor/adapters/status_page.py)."""
        return web.html(render_status(run.status_data()))

    @app.page("/status.json")
    async def status_json(web, request):
        return web.json(run.status_data())

    @app.page("/healthz")
    async def healthz(web, request):
        """Liveness: the event loop answers and the worker is not stopping."""
        if health.stopping:
            return web.json({"status": "stopping", "reason": health.reason}, status=503)
        return web.json({"status": "alive", "state": health.state})

    @app.page("/readyz")
    async def readyz(web, request):
        """Readiness: state open, journal republished, partitions assigned, broker answering."""
        body = {"status": health.state, "reason": health.reason}
        return web.json(body, status=200 if health.ready else 503)

    @app.page("/metrics")
    async def prometheus_metrics(web, request):
        run.refresh_metrics()  # counters are kept by the pipeline; brought up to date at each scrape
        return web.bytes(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST.split(";")[0])

    app.dpstream_run = run  # for tests and the bench
    app.dpstream_health = health
    app.dpstream_metrics = metrics
    return app


def _faust_credentials(settings: dict):
    """Faust's own client (its app consumer and producer) with the same security settings
    (the CA, and a client certificate when given)."""
    protocol = settings.get("security.protocol", "PLAINTEXT")
    if protocol == "PLAINTEXT":
        return None
    translated = aiokafka_security(settings)
    ssl = translated.get("ssl_context")
    if translated.get("sasl_mechanism") == "OAUTHBEARER":
        return faust.OAuthCredentials(oauth_cb=translated["sasl_oauth_token_provider"], ssl_context=ssl)
    if "SASL" in protocol:
        return faust.SASLCredentials(username=settings.get("sasl.username"), password=settings.get("sasl.password"),
                                     mechanism=settings.get("sasl.mechanisms", "PLAIN"), ssl_context=ssl)
    return faust.SSLCredentials(ssl)


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

    def __init__(self, health: WorkerHealth):
        super().__init__()
        self.health = health

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        if self.health.stopped_by is not None and template.endswith(_CRASH_ECHOES):
            return False
        if "Error while stopping child" in template and record.exc_info:  # mode prefixes "[^Worker]: "
            # mode stops a thread service after its event loop closed, on a stop at start (a
            # refusal) under load: its stack dump says nothing about the worker, which has said why
            exc = record.exc_info[1]
            if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
                return False
        return _UNUSED_TOPIC not in template and not any(_UNUSED_TOPIC in str(a) for a in (record.args or ()))


#: s a fresh cluster may take to make its group coordinator ready before the worker says so
COORDINATOR_WARN_S = 15.0


def quiet_library_noise(level: int) -> None:
    """Below --log-level debug: mode's "Timer ... is overlapping" warnings are not problems for
    this worker. Its timers do work that may outlast their period by design (a catch-up of many
    triggers, a broker round trip); the next tick then simply comes later. A worker that falls
    behind shows in dpstream_trigger_duration_seconds, dpstream_input_lag_records and its
    readiness (docs/operations.md, "Health")."""
    if level > logging.DEBUG:
        logging.getLogger("mode.timers").setLevel(logging.ERROR)


def wait_for_group_coordinator(broker: str, group: str, timeout: float) -> None:
    """Until the broker names a coordinator for ``group`` (Faust's own consumer joins it): on a
    fresh cluster the first request makes the broker create ``__consumer_offsets``, and until it
    is loaded every client of a group is told "coordinator not available", which aiokafka logs
    as ERRORs and WARNINGs while it retries. Retried quietly here (DEBUG); said at WARNING only
    after :data:`COORDINATOR_WARN_S`; after ``timeout`` Faust starts anyway and says why."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from dpstream.processor.adapters.kafka_tools import RDKAFKA_LOG

    admin = AdminClient({"bootstrap.servers": broker, "logger": RDKAFKA_LOG, **client_security()})
    started = time.monotonic()
    warned = False
    while True:
        try:
            admin.describe_consumer_groups([group], request_timeout=5)[group].result()
            return
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            name = error.name() if hasattr(error, "name") else str(exc)
            if "COORDINATOR" not in name and not getattr(error, "retriable", lambda: False)():
                log.debug("group coordinator of %s: %s (left to Faust's consumer)", group, exc)
                return
            log.debug("group coordinator of %s not ready yet: %s", group, name)
        waited = time.monotonic() - started
        if waited >= timeout:
            return
        if waited >= COORDINATOR_WARN_S and not warned:
            log.warning("the broker at %s has had no group coordinator ready for %.0f s (a cluster still starting?)", broker, waited)
            warned = True
        time.sleep(0.5)


def preflight(s: WorkerSettings) -> None:
    """Before Faust starts (its own failures are stack dumps): the web port is free, the Kafka
    clients' settings work (credentials, TLS files, values: refused at once, naming the setting;
    docs/operations.md, "Kafka security"), and a broker answers within ``--broker-timeout``.
    Raises :class:`WorkerRefusal`."""
    from dpstream.processor.adapters.kafka_tools import last_reason, protocol_hint, wait_for_broker
    from dpstream.topics.kafka import KafkaSettingError

    with socket.socket(socket.AF_INET6 if ":" in s.web_host else socket.AF_INET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((s.web_host, s.web_port))
        except OSError as exc:
            raise WorkerRefusal(f"--web-port {s.web_port}: cannot listen on {s.web_host}:{s.web_port} ({exc.strerror}): another "
                                f"worker on this machine? Give each its own --web-port") from None
    broker = broker_address(s.broker)

    def waiting() -> None:
        log.warning("no Kafka broker answers at %s yet%s; waiting up to %g s (--broker-timeout)", broker, last_reason(),
                    s.broker_timeout)

    try:
        answered = wait_for_broker(broker, s.broker_timeout, waiting)
        # aiokafka's and Faust's clients read the same files with Python's ssl, not librdkafka's
        aiokafka_security(client_security())
    except KafkaSettingError as exc:
        raise WorkerRefusal(f"connecting to {broker}: {exc}") from None
    if s.config.schema_registry is not None:  # avro, protobuf or json_schema input
        from dpstream.topics.decoding import RegistrySettingError, check_registry

        try:
            check_registry(s.config.schema_registry)
        except RegistrySettingError as exc:
            raise WorkerRefusal(str(exc)) from None
    if not answered:
        raise WorkerRefusal(f"no Kafka broker answered at {broker} within {s.broker_timeout:g} s (--broker-timeout)"
                            f"{last_reason()}; start one (scripts/broker start) or pass --broker HOST:PORT{protocol_hint()}")
    wait_for_group_coordinator(broker, faust_group_id(s), s.broker_timeout)


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
                handler.addFilter(_FaustNoise(app.dpstream_health))
            quiet_library_noise(level)

        def _schedule_shutdown(self, sig) -> None:
            health = app.dpstream_health
            if health.stopped_by_signal is None:  # said once, however many signals follow
                health.stopped_by_signal = sig.name
                log.info("dpstream worker stopping: %s received", sig.name)
                if not health.stopping:
                    health.set(STOPPING, f"{sig.name} received")
            super()._schedule_shutdown(sig)

    return QuietWorker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)


def run_worker(s: WorkerSettings, loglevel: str = "info") -> int:
    """Run until SIGTERM/SIGINT (0), or until a failure: then its reason is the last line on
    stderr, ``dpstream worker: refused: ...`` (exit code 2: the operator must act, see
    :func:`refusals`) or ``dpstream worker: stopped: ...`` (1) (docs/operations.md, "Health")."""
    use_client_id(worker_client_id(s))  # the preflight's clients too
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
    stopped_by = app.dpstream_health.stopped_by
    # A failure exits at once (os._exit): an executor thread may still be waiting on a broker that
    # is gone (the monitoring offset commit blocks until its coordinator answers), and the
    # interpreter's own exit joins those threads, which kept a worker up 40 s after it stopped
    if stopped_by is not None:
        _exit_now(*stop_line(stopped_by))
    elif code:
        _exit_now(code, f"dpstream worker: stopped: Faust failed (exit code {code}; its log above says why)")
    # the last line of a clean stop, as a failure's is (docs/operations.md, "Health")
    print(f"dpstream worker: stopped on {app.dpstream_health.stopped_by_signal or 'request'} (exit code {code})",
          file=sys.stderr, flush=True)
    return code
