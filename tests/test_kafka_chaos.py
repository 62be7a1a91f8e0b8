"""Workers under chaos against Apache Kafka (issue 30, items 5 to 7): many rebalances, a broker
SIGKILL and restart on its log, network blackholes shorter and longer than ``--broker-timeout``
(through a loopback proxy, tests/kafka_proxy.py), and workers started at the same moment on a new
application. In each: releases equal replay's (each once), and no healthy worker exits; a worker
stopped on purpose exits 0. A failure names the worker, its exit code, its last line and its log.

The harness is checked first (the ``test_harness_*`` tests): the proxy really blackholes and
really resumes, the broker really advertises it, and a SIGKILLed broker restarted on its log
keeps its topics, records and group offsets; so a failure of the other tests is the product's.

Timing: events are produced as time goes by, each one trigger interval before its own time
(:class:`LiveFeed`), so it reaches the broker well before its trigger fires: the feed checks that
margin and says so if the machine was too loaded to keep it (then a failure is not the product's).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, free_port_block
from tests.kafka_proxy import KafkaProxy
from tests.test_kafka_worker import LATENESS_S, Scenario, Worker, assert_no_conflicting_releases, canonical

SCRIPT = str(ROOT / "scripts" / "broker")
#: docs/operations.md, "Health": readiness says waiting-for-broker after 10 s without an answer
#: (processor/adapters/faust_app.py BROKER_WAIT_S); checked between these bounds (s)
WAITING_AFTER = (8.0, 15.0)
#: the documented stop line of an outage longer than --broker-timeout
BROKER_TIMEOUT_LINE = re.compile(r"dpstream worker: stopped: BrokerUnreachableError: no answer from the broker at \S+ for \d+ s "
                                 r"\(--broker-timeout\)")


# ---------------------------------------------------------------- harness: brokers and the proxy


class ChaosBroker:
    """An Apache Kafka broker of this test's own (scripts/broker on free ports), optionally with a
    proxied listener behind a :class:`KafkaProxy`. ``address``: the plain listener (the test's
    own clients); ``for_workers``: what the workers are given (the proxy's address if proxied)."""

    def __init__(self, proxied: bool):
        self.port = free_port_block(3)
        self.address = f"127.0.0.1:{self.port}"
        self.proxy = KafkaProxy(("127.0.0.1", self.port + 2)).start() if proxied else None
        self.for_workers = self.proxy.address if proxied else self.address

    def run(self, command: str) -> str:
        env = {**os.environ}
        env.pop("DPSTREAM_BROKER_PROXY_PORT", None)
        if self.proxy is not None:
            env["DPSTREAM_BROKER_PROXY_PORT"] = str(self.proxy.port)
        proc = subprocess.run([SCRIPT, command, str(self.port)], capture_output=True, text=True, timeout=180, env=env)
        assert proc.returncode == 0, f"scripts/broker {command} {self.port}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    @property
    def run_dir(self) -> Path:
        return Path(os.environ.get("DPSTREAM_BROKER_DIR", ROOT / ".broker"))

    @property
    def data(self) -> Path:
        return self.run_dir / f"kafka-{self.port}-data"

    @property
    def pid(self) -> int:
        return int((self.run_dir / f"broker-{self.port}.pid").read_text())

    def kill_and_restart(self, down_s: float) -> float:
        """SIGKILL the broker, start it again on its log after ``down_s``; returns how long it
        did not answer (the restart after a SIGKILL takes about 15 s here: log recovery)."""
        killed = time.time()
        self.run("kill")
        assert not (self.data / ".kafka_cleanshutdown").exists(), "harness: a SIGKILL must leave no clean-shutdown mark"
        sleep_until(killed + down_s)
        self.run("restart")
        return time.time() - killed

    def close(self) -> None:
        try:
            self.run("stop")
            shutil.rmtree(self.data, ignore_errors=True)
            for name in (f"kafka-{self.port}.properties", f"broker-{self.port}.log", f"broker-{self.port}.kind"):
                (self.run_dir / name).unlink(missing_ok=True)
        finally:
            if self.proxy is not None:
                self.proxy.close()


def started(proxied: bool) -> ChaosBroker:
    """A broker of the test's own, or a skip when scripts/broker cannot start Apache Kafka here
    (its Tansu fallback has neither a restart on its log nor a second listener)."""
    b = ChaosBroker(proxied)
    try:
        b.run("start")
    except AssertionError as exc:
        b.close()
        pytest.skip(f"these trials need Apache Kafka: {exc}")
    kind = subprocess.run([SCRIPT, "which", str(b.port)], capture_output=True, text=True).stdout.strip()
    if "Apache Kafka" not in kind:
        b.close()
        pytest.skip(f"these trials need Apache Kafka (a restart on its log, a second listener); scripts/broker started {kind}")
    return b


@pytest.fixture(scope="session")
def module_kafka():
    """Session-scoped, not module-scoped: under pytest-xdist (scripts/test) a process runs these
    trials between other files' tests, and a module fixture would be stopped and started again at
    each switch. So each process that runs a trial starts one broker of its own, once."""
    b = started(proxied=True)
    yield b
    b.close()


@pytest.fixture
def chaos_kafka(module_kafka):
    """The module's own broker (started once: about 15 s on 2 cores), as each trial needs it: the
    proxy forwarding without delay, no requests held, the broker answering (a trial that failed mid-outage
    may have left it down)."""
    b = module_kafka
    b.proxy.restore()
    b.proxy.stop_holding()
    b.proxy.latency_s = 0.0
    if subprocess.run([SCRIPT, "status", str(b.port)], capture_output=True).returncode != 0:
        b.run("restart")
    return b


# ---------------------------------------------------------------- harness: workers
def group_args(name: str) -> tuple:
    return ("--assignment", "group", "--instance-id", name, "--log-level", "info")  # restores and moves in the log


class Fleet:
    """The workers of one trial. Each is started through :meth:`start`; those stopped on purpose
    (or expected to exit) are remembered, so that :meth:`assert_healthy` can say which others
    exited, when (a watcher looks every 0.2 s) and why."""

    def __init__(self, sc: Scenario, broker_for_workers: str | None = None, extra: tuple = ()):
        self.sc = sc
        # a later --broker wins (argparse): the workers go through the proxy, the test does not
        self.extra = (("--broker", broker_for_workers) if broker_for_workers else ()) + tuple(extra)
        self.meant: dict[int, str] = {}  # id(worker) -> what the test did to it
        self.clean_stops: list[tuple[Worker, int]] = []
        self.exited_at: dict[int, float] = {}  # id(worker) -> when it was seen gone (0.2 s)
        self.closed = False
        threading.Thread(target=self._watch, name="fleet-watch", daemon=True).start()

    def close(self) -> None:
        """Stop every worker still running (the end of the trial)."""
        for w in self.sc.workers:
            w.stop()
        self.closed = True

    def _watch(self) -> None:
        while not self.closed:
            for w in list(self.sc.workers):
                if id(w) not in self.exited_at and w.proc is not None and w.proc.poll() is not None:
                    self.exited_at[id(w)] = time.time()
            time.sleep(0.2)

    def when(self, w: Worker) -> str:
        """When the worker was seen gone, on the test's clock (and the window's, once known)."""
        t = self.exited_at.get(id(w), time.time())
        where = f" ({t - self.sc.window_start / 1000:+.1f} s from the window's start)" if self.sc.window_start else ""
        return f"{t - w.started_at:.0f} s after its start{where}"

    def start(self, name: str, mode: str = "group", index: int = 0, workers: int = 1, extra: tuple = ()) -> Worker:
        """``mode`` group: the worker ``name`` of the consumer group (index and workers unused);
        static: worker ``index`` of ``workers``."""
        if mode == "group":
            how, index, workers = group_args(name), 0, 1
        else:
            how = ("--log-level", "info")
        w = self.sc.worker(name, index, workers, self.extra + how + tuple(extra))
        w.name = name
        w.start()
        w.started_at = time.time()
        self.sc.workers.append(w)
        return w

    def stop(self, w: Worker) -> int:
        """SIGTERM (a scale-in, a rolling update): it must exit 0 within 30 s."""
        self.meant[id(w)] = "stopped"
        w.stop()
        self.clean_stops.append((w, w.proc.returncode))
        return w.proc.returncode

    def expect_exit(self, w: Worker) -> None:
        self.meant[id(w)] = "expected to exit"

    def live(self) -> list[Worker]:
        return [w for w in self.sc.workers if id(w) not in self.meant]

    def problems(self, health: bool = True) -> list[str]:
        """Every worker the test did not stop that exited (with ``health``: or whose /healthz does
        not answer 200: call it once they have all started), and every worker stopped on purpose
        that did not exit 0."""
        out = []
        for w in self.live():
            if w.proc.poll() is not None:
                out.append(f"worker {w.name} exited by itself with code {w.proc.returncode}, {self.when(w)}\n{describe(w)}")
            elif health:
                try:
                    code = w.get("/healthz")[0]
                except OSError as exc:
                    code = exc
                if code != 200:
                    out.append(f"worker {w.name} runs but /healthz answers {code}\n{describe(w)}")
        for w, code in self.clean_stops:
            if code != 0:
                out.append(f"worker {w.name}, stopped on purpose (SIGTERM), exited with code {code}\n{describe(w)}")
        return out

    def assert_healthy(self) -> None:
        problems = self.problems()
        assert not problems, f"{len(problems)} worker(s) failed:\n\n" + "\n\n".join(problems)


def stop_lines(w: Worker) -> list[str]:
    """The worker's own account of why it stopped: its 'stopping' log lines and its last line."""
    return [line for line in w.log.read_text(errors="replace").splitlines()
            if "dpstream worker stopping:" in line or line.startswith("dpstream worker: ")]


def describe(w: Worker, lines: int = 30) -> str:
    """Why the worker stopped, and its log's last errors (ERROR lines and librdkafka's levels 0
    to 3) and last lines: enough to see the cause without the heartbeat noise of an outage."""
    text = w.log.read_text(errors="replace").splitlines()
    errors = [line for line in text if "[ERROR]" in line or "[CRITICAL]" in line or re.match(r"%[0-3]\|", line)]
    by_kind: dict[str, str] = {}  # one line per kind of error (its text without numbers), the last one
    for line in errors:
        text_only = re.sub(r"^\[[^]]*\] \[\d+\] |^%\d\|[\d.]+\|", "", line)
        kind = re.sub(r"\d+", "N", text_only)
        by_kind.pop(kind, None)
        by_kind[kind] = text_only
    distinct = list(by_kind.values())
    # the last traceback in full (a worker stopped by an error of Python's own logs one): the
    # last 8 lines show only its innermost frames
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")]
    traceback = []
    if starts:
        traceback = [text[starts[-1] - 1]] if starts[-1] else []
        for line in text[starts[-1]:starts[-1] + 80]:
            if line.startswith("[") or line.startswith("dpstream worker: "):
                break  # the next log record
            traceback.append(line)
    return (f"  state dir {w.state_dir.name}, log {w.log.name}; why it stopped: {stop_lines(w)[-2:] or 'nothing said'}\n"
            f"  its last {lines} distinct errors:\n    " + "\n    ".join(distinct[-lines:]) +
            ("\n  its last traceback:\n    " + "\n    ".join(traceback) if traceback else "") +
            "\n  its last 8 log lines:\n    " + "\n    ".join(text[-8:]))


def wait_for(predicate, timeout: float, what: str, fleet: Fleet | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if fleet is not None and fleet.problems(health=False):
            fleet.assert_healthy()
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def owned(workers: list[Worker]) -> list[float]:
    try:
        return [w.metric("dpstream_partitions_owned") for w in workers]
    except OSError:
        return []


def settled(workers: list[Worker], total: int = 8) -> bool:
    """Every worker owns some partitions, together all ``total`` (4 input, 4 repartition)."""
    counts = owned(workers)
    return bool(counts) and min(counts) > 0 and sum(counts) == total


def write_window_events(sc: Scenario, n: int, users: int, keys: int, lead_s: float, intervals: int | None = None,
                        seed: int = 11) -> None:
    """Like Scenario.write_events, but the event times cover only the window's first
    ``intervals`` trigger intervals (all of it by default)."""
    sc.write_events(n, users, keys, lead_s, seed=seed, span_ms=None if intervals is None else intervals * sc.window_s * 1000 // sc.triggers)


class LiveFeed(threading.Thread):
    """Produces the scenario's events (its events file, time-ordered) to the plain listener as
    time goes by, each one trigger interval before its own time, in chunks of 0.2 s: every event
    is stamped by the broker at least an interval before its trigger's fire time, and events keep
    arriving (the workers' transactions follow each other) while the workers rebalance or are
    cut off. ``late`` lists the chunks acknowledged after their trigger's fire time (the machine
    too loaded to keep the promise: a harness failure, not the product's)."""

    CHUNK_MS = 200

    def __init__(self, sc: Scenario):
        super().__init__(name="live-feed", daemon=True)
        self.sc = sc
        self.interval_ms = sc.window_s * 1000 // sc.triggers
        self.late: list[str] = []
        self.sent = 0
        self.error: BaseException | None = None

    def fire_ms(self, ts: int) -> int:
        return self.sc.window_start + ((ts - self.sc.window_start) // self.interval_ms + 1) * self.interval_ms

    def run(self) -> None:
        from confluent_kafka import Producer

        from dpstream.processor.adapters.kafka_tools import PRODUCER_DEFAULTS

        try:
            chunks: dict[int, list[tuple[bytes, bytes, int]]] = {}
            for line in self.sc.events.read_bytes().splitlines():
                event = json.loads(line)  # keyed by user, as `dpstream produce` keys them
                chunks.setdefault((event["ts"] - self.interval_ms) // self.CHUNK_MS, []).append(
                    (line, event["user_id"].encode(), event["ts"]))
            producer = Producer({"bootstrap.servers": self.sc.broker, **PRODUCER_DEFAULTS, "linger.ms": 5})
            for slot in sorted(chunks):
                sleep_until(slot * self.CHUNK_MS / 1000)
                for line, key, _ in chunks[slot]:
                    producer.produce(self.sc.input, line, key)
                left = producer.flush(30)
                assert left == 0, f"{left} events not acknowledged within 30 s"
                self.sent += len(chunks[slot])
                late_ms = time.time() * 1000 - self.fire_ms(chunks[slot][-1][2])
                if late_ms > 0:
                    self.late.append(f"chunk at {slot * self.CHUNK_MS} acknowledged {late_ms:.0f} ms after its trigger's fire time")
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.error = exc

    def check(self) -> None:
        """The harness kept its promise (call after join)."""
        assert self.error is None, f"harness: the live feed failed: {self.error!r}"
        assert not self.late, ("harness, not the product: the machine was too loaded to produce the events in time "
                               f"({len(self.late)} chunks late; first: {self.late[0]})")


def releases_after_the_window(sc: Scenario, fleet: Fleet, timeout: float = 120) -> tuple[list[dict], list[dict]]:
    """Replay's releases, and the output once it holds all of them (or after ``timeout`` past the
    window's end, or once no worker is left to publish them)."""
    expected = sc.replay()
    sleep_until(sc.window_start / 1000 + sc.window_s + LATENESS_S)
    deadline = time.time() + timeout
    released: list[dict] = []
    while time.time() < deadline:
        released = sc.read(sc.output)
        if canonical(released) >= canonical(expected) or not any(w.proc.poll() is None for w in fleet.live()):
            break
        time.sleep(1)
    return expected, released


def clocks(fleet: Fleet) -> str:
    """Where each running worker stands: its input watermarks, lag and triggers, and its last
    log lines (why releases are missing: a clock held back, or a worker stuck)."""
    out = []
    for w in fleet.live():
        if w.proc.poll() is not None:
            continue
        try:
            samples = w.metrics()
        except OSError as exc:
            out.append(f"worker {w.name}: /metrics unreachable: {exc}")
            continue
        shown = {f"{n}{dict(ls)}": v for (n, ls), v in sorted(samples.items())
                 if n in ("dpstream_input_watermark_seconds", "dpstream_consumer_lag_records", "dpstream_triggers_fired_total")}
        tail = [line for line in w.log.read_text(errors="replace").splitlines() if not line.startswith("%")][-6:]
        out.append(f"worker {w.name} at {time.time():.1f}: {shown}\n    " + "\n    ".join(tail))
    return "\n".join(out)


def assert_releases_equal(expected: list[dict], released: list[dict], fleet: Fleet | None = None) -> None:
    assert_no_conflicting_releases(released)
    assert expected, "replay released nothing: the trial tests nothing"
    missing, extra = canonical(expected) - canonical(released), canonical(released) - canonical(expected)
    assert not missing and not extra, (f"releases differ from replay's: {len(missing)} of {len(expected)} missing, "
                                       f"{len(extra)} not replay's" + (f"\n{clocks(fleet)}" if fleet is not None else ""))


def restores(w: Worker, start: int = 0, end: int | None = None) -> list[tuple[str, str]]:
    """(partition, 'full' | 'incremental') of each restore the worker logged between two offsets of its log."""
    text = w.log.read_bytes()[start:end].decode(errors="replace")
    return re.findall(r"(\S+-\d+): restored \((full|incremental), from changelog offset", text)


def held_partitions(w: Worker, end: int) -> set[str]:
    """The partitions the worker held at an offset of its log (its 'gained' and 'gave up' lines)."""
    held: set[str] = set()
    for line in w.log.read_bytes()[:end].decode(errors="replace").splitlines():
        m = re.search(r"(gained|gave up) \d+ partitions: (.*)$", line)
        if m:
            names = {p.strip() for p in m.group(2).split(",") if p.strip()}
            held = held | names if m.group(1) == "gained" else held - names
    return held


def start_fleet(fleet: Fleet, mode: str, n: int) -> list[Worker]:
    """n workers, ready (group: settled on the partitions). The first is ready before the others
    start: it creates the application's topics, so that a start race (item 7, its own test)
    cannot stand in for the failure a trial is after."""
    ws = [fleet.start("w0", mode, index=0, workers=n).wait_ready()]
    ws += [fleet.start(f"w{i}", mode, index=i, workers=n) for i in range(1, n)]
    for w in ws:
        w.wait_ready()
    if mode == "group":
        wait_for(lambda: settled(ws), 90, f"the {n} workers settle on the 8 partitions", fleet)
    return ws


# ---------------------------------------------------------------- the harness itself
def test_harness_the_proxy_blackholes_and_resumes_and_the_broker_advertises_it(chaos_kafka):
    """Through the proxy: the broker advertises the proxy (clients stay behind it after
    bootstrap). Blackholed: no answer and no byte moved, a new connection is accepted and hangs,
    while the plain listener answers. Restored: the same clients resume and every record sent
    meanwhile is delivered once. Reset: every connection is closed and the clients reconnect."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    from dpstream.processor.adapters.kafka_tools import tail
    from dpstream.topics.kafka import TopicSpec, create_topics

    b, proxy = chaos_kafka, chaos_kafka.proxy
    behind = AdminClient({"bootstrap.servers": proxy.address})
    brokers = behind.list_topics(timeout=10).brokers
    assert {(x.host, x.port) for x in brokers.values()} == {("127.0.0.1", proxy.port)}, "the broker must advertise the proxy"
    plain = AdminClient({"bootstrap.servers": b.address})
    assert {x.port for x in plain.list_topics(timeout=10).brokers.values()} == {b.port}
    tag = uuid.uuid4().hex[:8]
    topic = f"harness-proxy-{tag}"
    create_topics(b.address, [TopicSpec(topic, 2)])
    producer = Producer({"bootstrap.servers": proxy.address, "enable.idempotence": True, "acks": "all", "linger.ms": 5})
    for i in range(100):
        producer.produce(topic, f"{i}".encode())
    assert producer.flush(15) == 0

    proxy.blackhole()
    time.sleep(0.5)  # bytes in flight as it began are held, not counted
    moved = proxy.forwarded
    for i in range(100, 200):
        producer.produce(topic, f"{i}".encode())
    assert producer.flush(5) > 0, "a producer behind a blackhole must not be acknowledged"
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": proxy.address}).list_topics(timeout=3)
    with pytest.raises(KafkaException):
        behind.list_topics(timeout=3)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as raw:  # accepted (not refused) ...
        raw.settimeout(2)
        raw.sendall(b"\x00\x00\x00\x0a\x00\x12\x00\x00\x00\x00\x00\x01\xff\xff")  # ApiVersions v0
        with pytest.raises(socket.timeout):  # ... and hangs: neither an answer nor a close
            raw.recv(1)
    assert len(plain.list_topics(timeout=5).topics) > 0, "the plain listener must not be blackholed"
    assert proxy.forwarded == moved, "nothing may move through a blackhole"

    proxy.restore()
    assert producer.flush(30) == 0, "the same producer must resume once the blackhole ends"
    assert len(behind.list_topics(timeout=10).topics) > 0
    assert proxy.forwarded > moved
    proxy.latency_s = 0.25  # each way: a metadata round trip takes at least 0.5 s, and still answers
    began = time.time()
    assert len(behind.list_topics(timeout=10).topics) > 0 and time.time() - began >= 0.5
    proxy.latency_s = 0.0
    connections, before = proxy.accepted, proxy.open_connections
    assert before
    proxy.reset()
    assert not before & proxy.open_connections, "a reset closes every connection (the clients may open new ones at once)"
    for i in range(200, 300):
        producer.produce(topic, f"{i}".encode())
    assert producer.flush(30) == 0, "clients reconnect after a reset"
    assert proxy.accepted > connections
    import io

    out = io.StringIO()
    tail(b.address, topic, out, idle_seconds=3)
    assert sorted(int(v) for v in out.getvalue().split()) == list(range(300)), "each record once, none lost"

    # hold_together: a CreateTopics request waits for the next one (1.5 s later), then both go;
    # a lone one goes after the window
    proxy.hold_together(CREATE_TOPICS, 2, 10.0)
    rounds = len(proxy.released)
    done: dict[str, float] = {}

    def create(name: str) -> None:
        create_topics(proxy.address, [TopicSpec(name, 1)])
        done[name] = time.time()

    began = time.time()
    first = threading.Thread(target=create, args=(f"harness-first-{tag}",))
    first.start()
    time.sleep(1.5)
    create(f"harness-second-{tag}")
    first.join(30)
    assert proxy.released[rounds:] == [2] and done[f"harness-first-{tag}"] - began >= 1.5, (proxy.released, done)
    proxy.hold_together(CREATE_TOPICS, 2, 1.0)
    began = time.time()
    create(f"harness-lone-{tag}")
    assert proxy.released[rounds:] == [2, 1] and done[f"harness-lone-{tag}"] - began >= 1.0
    assert {f"harness-{x}-{tag}" for x in ("first", "second", "lone")} <= set(plain.list_topics(timeout=10).topics)


def test_harness_a_sigkilled_broker_restarts_on_its_log_with_topics_records_and_offsets(chaos_kafka):
    """scripts/broker kill: the broker process is gone at once (no clean shutdown in its log);
    scripts/broker restart brings it back on its log directory with its topics, every committed
    record (transactions included, an aborted one still aborted) and the group's offsets."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from dpstream.topics.kafka import TopicSpec, create_topics

    b = chaos_kafka
    topic = f"harness-kill-{uuid.uuid4().hex[:8]}"
    create_topics(b.address, [TopicSpec(topic, 3)])
    p = Producer({"bootstrap.servers": b.address, "acks": "all", "enable.idempotence": True})
    for i in range(1000):
        p.produce(topic, f"{i}".encode(), partition=i % 3)
    assert p.flush(15) == 0
    tx = Producer({"bootstrap.servers": b.address, "transactional.id": f"{topic}-tx"})
    tx.init_transactions(30)
    tx.begin_transaction()
    for i in range(1000, 1010):
        tx.produce(topic, f"{i}".encode(), partition=0)
    tx.commit_transaction(30)
    tx.begin_transaction()
    tx.produce(topic, b"aborted", partition=1)
    tx.flush(10)
    tx.abort_transaction(30)
    c = Consumer({"bootstrap.servers": b.address, "group.id": f"{topic}-group", "enable.auto.commit": False})
    for attempt in range(30):  # a new broker creates its offsets topic on the first group's first call
        try:
            c.commit(offsets=[TopicPartition(topic, 0, 123), TopicPartition(topic, 1, 45)], asynchronous=False)
            break
        except KafkaException:
            time.sleep(1)
    c.close()

    pid = b.pid
    out = b.run("kill")
    assert "SIGKILL" in out
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert subprocess.run([SCRIPT, "status", str(b.port)]).returncode != 0, "a killed broker does not answer"
    # Kafka marks its log directory at a clean shutdown (and only then): none after a SIGKILL
    assert b.data.is_dir() and not (b.data / ".kafka_cleanshutdown").exists()
    time.sleep(2)
    b.run("restart")
    assert b.pid != pid
    assert topic in AdminClient({"bootstrap.servers": b.address}).list_topics(timeout=10).topics
    reader = Consumer({"bootstrap.servers": b.address, "group.id": "harness-reader", "isolation.level": "read_committed",
                       "auto.offset.reset": "earliest", "enable.partition.eof": True})
    reader.assign([TopicPartition(topic, q, 0) for q in range(3)])
    values, eof, deadline = [], set(), time.time() + 60
    while len(eof) < 3 and time.time() < deadline:
        m = reader.poll(1)
        if m is None:
            continue
        if m.error():
            eof.add(m.partition())
            continue
        values.append(m.value())
    assert sorted(int(v) for v in values) == list(range(1010)), "every committed record survives; the aborted one stays aborted"
    side = Consumer({"bootstrap.servers": b.address, "group.id": f"{topic}-group", "enable.auto.commit": False})
    deadline = time.time() + 60
    while True:  # the restarted coordinator loads its offsets topic first: NOT_COORDINATOR meanwhile
        try:
            got = {tp.partition: tp.offset for tp in side.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=30)}
            break
        except KafkaException as exc:
            if time.time() > deadline or exc.args[0].code() not in (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                                                                     KafkaError.COORDINATOR_NOT_AVAILABLE):
                raise
            time.sleep(1)
    assert got == {0: 123, 1: 45}, "the group's committed offsets survive"
    reader.close()
    side.close()


# ---------------------------------------------------------------- item 5: many rebalances
def rebalance_storm(tmp_path, b: ChaosBroker, changes: int, window_s: int, triggers: int, events: int, seed: int) -> None:
    """Three group workers, events flowing, and extra workers joining and leaving (SIGTERM, a
    scale-in) every second or so, at least ``changes`` times and on until the window's end: up to
    three extras at a time, each a named pod with its own volume (reused when it joins again); a
    joining worker does not wait for the last rebalance to end, a leaving one has been ready.
    Rebalances interrupt transactions in flight (a worker sends a transaction refused for an old
    generation again); none may stop a worker (issue 30, item 5).

    The workers reach the broker through the proxy with 20 ms of latency each way (a broker a
    little farther away than loopback): a transaction's requests are then still in flight when
    a rebalance refuses its offsets, as on a loaded machine, where a016c0c failed most often."""
    rng = np.random.default_rng(seed)
    sc = Scenario(tmp_path, b.address, window_s=window_s, triggers=triggers)
    fleet = Fleet(sc, b.for_workers)
    b.proxy.latency_s = 0.02
    leaving: list[threading.Thread] = []
    try:
        start_fleet(fleet, "group", 3)
        write_window_events(sc, events, users=events // 10, keys=80, lead_s=8, seed=seed)
        feed = LiveFeed(sc)
        feed.start()
        pool = [f"x{i}" for i in range(5)]
        last: dict[str, Worker] = {}
        present: list[Worker] = []
        done, log = 0, []
        end = sc.window_start / 1000 + window_s
        while done < changes or time.time() < end:
            time.sleep(float(rng.uniform(0.3, 1.5)))
            if fleet.problems(health=False):
                break  # reported below, with the others
            ready = [w for w in present if has_been_ready(w)]
            # a pod comes back only once its last incarnation has exited (as a StatefulSet's
            # does): its volume is still locked until then
            free = [n for n in pool if last.get(n) is None or last[n].proc.poll() is not None]
            if len(present) < 3 and free and (not ready or rng.random() < 0.5):
                name = free[0]
                pool.remove(name)
                pool.append(name)  # the least recently used comes back first
                w = last[name] = fleet.start(name)
                present.append(w)
                what = "join"
            elif ready:
                w = ready[int(rng.integers(len(ready)))]
                present.remove(w)
                leaving.append(threading.Thread(target=fleet.stop, args=(w,)))
                leaving[-1].start()
                what = "leave"
            else:
                continue
            done += 1
            log.append(f"{time.time() - sc.window_start / 1000:+.1f}s {what} {w.name}")
        for t in leaving:
            t.join(60)
        feed.join(timeout=window_s + 60)
        expected, released = releases_after_the_window(sc, fleet)
        retries = sum(w.log.read_text(errors="replace").count("sending it again") for w in sc.workers)
        print(f"{done} joins and leaves, {retries} transactions sent again after a rebalance (window start = 0 s): "
              + "; ".join(log))
        fleet.assert_healthy()
        assert done >= changes
        feed.check()
        assert_releases_equal(expected, released, fleet)
    finally:
        for t in leaving:
            t.join(60)
        fleet.close()


def has_been_ready(w: Worker) -> bool:
    """Whether /readyz has answered 200 once (a group worker is 'restoring' again at each gain)."""
    if not getattr(w, "was_ready", False):
        try:
            w.was_ready = w.get("/readyz")[0] == 200
        except OSError:
            pass
    return getattr(w, "was_ready", False)


def test_joins_and_leaves_every_second_through_a_window_stop_no_worker(tmp_path, chaos_kafka):
    """CI: at least 10 joins and leaves (30 to 80 in practice) through a 40 s window of 300,000
    events. On a016c0c both runs through the proxy stopped two or three workers: a transaction
    sent again after a rebalance ended in OUT_OF_ORDER_SEQUENCE_NUMBER ('skipped sequence
    numbers'). Straight to the broker it did in 4 of 6 runs, on a loaded machine."""
    rebalance_storm(tmp_path, chaos_kafka, changes=10, window_s=40, triggers=5, events=300_000, seed=5)


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CI")), reason="a 90 s window of joins and leaves (at least 40): CI runs the 30 s one; run "
                                                      "this with scripts/test tests/test_kafka_chaos.py")
def test_joins_and_leaves_every_second_through_a_long_window_stop_no_worker(tmp_path, chaos_kafka):
    """Outside CI: at least 40 joins and leaves through a 90 s window of 450,000 events."""
    rebalance_storm(tmp_path, chaos_kafka, changes=40, window_s=90, triggers=6, events=450_000,
                    seed=int(os.environ.get("DPSTREAM_CHAOS_SEED", "40")))


# ---------------------------------------------------------------- item 6: broker restarts and outages
@pytest.mark.parametrize("mode", ["group", "static"])
def test_a_broker_sigkill_and_restart_20_s_later_stops_no_worker(tmp_path, chaos_kafka, mode):
    """Events flow into the window until the broker is SIGKILLed (transactions in flight), it
    is down 20 s or more (restarted 5 s after the kill, it recovers its log for 15 s or more), across
    trigger times, and comes back on its log: every worker rides it
    out (docs/operations.md, "Health": a broker restart needs nothing) and the releases are
    replay's. Static workers survived this on a016c0c; group workers exited (issue 30, item 6)."""
    b = chaos_kafka
    sc = Scenario(tmp_path, b.address, window_s=30, triggers=5)
    # the restart's length is the machine's (JVM start and log recovery: 15 s on an idle machine,
    # up to 64 s on a loaded 2-core one): the workers' timeout stays well past it, so the trial is
    # about riding out a restart, not about how fast this machine restarts a broker
    fleet = Fleet(sc, None, ("--broker-timeout", "240s"))
    try:
        start_fleet(fleet, mode, 3 if mode == "group" else 2)
        # events of the first three intervals, produced until just before the kill
        write_window_events(sc, 20_000, users=2_000, keys=60, lead_s=8, intervals=3)
        feed = LiveFeed(sc)
        feed.start()
        feed.join(timeout=120)
        feed.check()
        killed = time.time() - sc.window_start / 1000
        down = b.kill_and_restart(5)
        print(f"broker killed {killed:+.1f} s into the window, answering again {down:.1f} s later")
        assert 12 < down < 200, f"harness: the outage must pass the 10 s wait and stay under the 240 s --broker-timeout: {down:.0f} s"
        expected, released = releases_after_the_window(sc, fleet)
        fleet.assert_healthy()
        assert_releases_equal(expected, released, fleet)
    finally:
        fleet.close()


def test_a_20_s_blackhole_is_ridden_out_by_group_workers_with_incremental_restores(tmp_path, chaos_kafka):
    """A network partition of 20 s between the workers and the broker (the broker runs; events
    keep arriving from elsewhere), past their 6 s session timeout: they fall out of the group.
    When it heals, each rejoins and regains partitions, a partition it held before restored
    incrementally (from its checkpoint: docs/operations.md, "Elastic workers", "Restore"),
    none exits, and the releases are replay's."""
    b = chaos_kafka
    sc = Scenario(tmp_path, b.address, window_s=30, triggers=5)
    fleet = Fleet(sc, b.for_workers)
    try:
        ws = start_fleet(fleet, "group", 3)
        write_window_events(sc, 30_000, users=3_000, keys=80, lead_s=8)
        feed = LiveFeed(sc)
        feed.start()
        sleep_until(sc.window_start / 1000 + 7)  # the first trigger fired (or is firing), events flowing
        marks = {w.name: w.log.stat().st_size for w in ws}
        b.proxy.blackhole()
        cut = time.time()
        waiting: dict[str, float] = {}  # when readiness said so (reported, not asserted: see the next test)
        while time.time() < cut + 20:
            for w in ws:
                try:
                    if w.name not in waiting and "waiting-for-broker" in w.get("/readyz")[1]:
                        waiting[w.name] = round(time.time() - cut, 1)
                except OSError:
                    pass
            time.sleep(0.25)
        b.proxy.restore()
        print(f"blackhole from {cut - sc.window_start / 1000:+.1f} s to {time.time() - sc.window_start / 1000:+.1f} s "
              f"into the window; waiting-for-broker after {waiting} s")
        feed.join(timeout=120)
        expected, released = releases_after_the_window(sc, fleet)
        fleet.assert_healthy()
        feed.check()
        assert_releases_equal(expected, released, fleet)
        # they fell out of the group and came back: each restored partitions after the heal, and a
        # partition it held when the partition began comes back incrementally (in full only if the
        # worker warned about it: its last changes not sent, a store ahead of its changelog)
        report = {}
        for w in ws:
            held = held_partitions(w, marks[w.name])
            after = restores(w, marks[w.name])
            warned = [line for line in w.log.read_bytes()[marks[w.name]:].decode(errors="replace").splitlines()
                      if "[WARNING]" in line or "[ERROR]" in line]
            unsent = {p for p in held if any(re.search(rf"\b{re.escape(p)}\b", line) for line in warned)}
            report[w.name] = (sorted(held), after, sorted(unsent))
            assert after, f"worker {w.name} restored nothing after the blackhole (did it rejoin?): {report}"
            full = [p for p, kind in after if kind == "full" and p in held and p not in unsent]
            assert not full, f"worker {w.name} restored in full partitions it held before the blackhole: {full}; {report}"
        assert any(kind == "incremental" for _, after, _ in report.values() for _, kind in after), report
    finally:
        fleet.close()


@pytest.mark.parametrize("mode", ["static", "group"])
def test_a_blackhole_past_the_broker_timeout_waits_at_10_s_exits_at_the_timeout_and_resumes(tmp_path, chaos_kafka, mode):
    """Cut off for 35 s with --broker-timeout 20s: /readyz says waiting-for-broker about 10 s in
    (docs/operations.md, "Health"), and the worker exits 1 with the documented line ('no answer
    from the broker ... (--broker-timeout)') near 20 s, not with another error and not much later.
    Started again once the network heals (what Kubernetes does), it resumes: replay's releases.
    On a016c0c a static worker said waiting at about 18 s and stopped with 'Failed to flush all
    outstanding messages' after about 68 s of a 90 s outage (issue 30, item 6)."""
    b = chaos_kafka
    timeout_s = 20
    sc = Scenario(tmp_path, b.address)
    fleet = Fleet(sc, b.for_workers, ("--broker-timeout", f"{timeout_s}s"))
    try:
        ws = start_fleet(fleet, mode, 2)
        write_window_events(sc, 20_000, users=2_000, keys=60, lead_s=4)
        sc.produce_events()
        wait_for(lambda: sum(w.metric("dpstream_records_accumulated_total", query=sc.query) for w in ws) > 0, 60,
                 "stage 2 took records", fleet)
        b.proxy.blackhole()
        cut = time.time()
        waiting: dict[str, float] = {}
        exited: dict[str, float] = {}
        while time.time() < cut + 35 and len(exited) < len(ws):
            for w in ws:
                if w.name in exited:
                    continue
                if w.proc.poll() is not None:
                    exited[w.name] = time.time() - cut
                    continue
                try:
                    code, body = w.get("/readyz")
                except OSError:
                    continue
                if code == 503 and "waiting-for-broker" in body and w.name not in waiting:
                    waiting[w.name] = time.time() - cut
            time.sleep(0.25)
        sleep_until(cut + 35)
        b.proxy.restore()
        report = {w.name: {"waiting after": waiting.get(w.name), "exited after": exited.get(w.name),
                           "exit code": w.proc.poll(), "why": stop_lines(w)[-2:]} for w in ws}
        print(f"--broker-timeout {timeout_s}s, blackhole 35 s: {report}")
        for w in ws:
            fleet.expect_exit(w)
            r = report[w.name]
            assert r["waiting after"] is not None and WAITING_AFTER[0] <= r["waiting after"] <= WAITING_AFTER[1], (
                f"worker {w.name}: /readyz must say waiting-for-broker about 10 s in: {r}")
            assert r["exited after"] is not None, f"worker {w.name} did not exit within the 35 s outage: {r}\n{describe(w)}"
            assert r["exit code"] == 1, f"worker {w.name}: exit code {r['exit code']}: {r}\n{describe(w)}"
            assert BROKER_TIMEOUT_LINE.fullmatch((stop_lines(w) or [""])[-1]), (
                f"worker {w.name} must stop with the documented broker-timeout line: {r}\n{describe(w)}")
            assert all("BrokerUnreachableError" in line for line in stop_lines(w)), f"worker {w.name}: {r}\n{describe(w)}"
            assert timeout_s - 1 <= r["exited after"] <= timeout_s + 10, (
                f"worker {w.name} must exit at the broker timeout, not before nor much later: {r}")
        for i in range(len(ws)):  # Kubernetes restarts them
            fleet.start(f"w{i}", mode, index=i, workers=len(ws)).wait_ready()
        expected, released = releases_after_the_window(sc, fleet)
        fleet.assert_healthy()
        assert_releases_equal(expected, released, fleet)
    finally:
        fleet.close()


# ---------------------------------------------------------------- item 7: workers start together
#: starts of each group of workers: 2 in CI (eight in all, each caught the race of a016c0c with
#: probability about 1/2), 3 outside it
START_REPS = int(os.environ.get("DPSTREAM_START_REPS", "2" if os.environ.get("CI") else "3"))
#: the Kafka API key of CreateTopics (the proxy sends the workers' requests together)
CREATE_TOPICS = 19


@pytest.mark.parametrize("mode,n", [("group", 2), ("group", 3), ("static", 2), ("static", 3)])
def test_workers_started_together_on_a_new_app_id_all_become_ready(tmp_path, chaos_kafka, mode, n):
    """As the chart starts its pods (in parallel) on a fresh install: n workers started at the
    same moment on a new application id, which create its topics, each time: every one becomes
    ready and none exits (on a016c0c two raced their topic creation in 7 of 14 starts: 'topic
    ...-by-key does not exist', exit 2, or a bare UNKNOWN_TOPIC_OR_PART; issue 30, item 7). In
    the first start where all are ready, the releases are replay's too.

    Processes started together still reach the broker a second or so apart (imports, two
    cores), and the race is over in milliseconds; so the proxy in front of the broker sends the
    workers' CreateTopics requests to it together (``hold_together``: each waits up to 3 s for
    the others), as when they do start at the same instant."""
    b = chaos_kafka
    b.proxy.hold_together(CREATE_TOPICS, n, 3.0)
    failures, checked = [], False
    for rep in range(START_REPS):
        (tmp_path / f"start{rep}").mkdir()
        sc = Scenario(tmp_path / f"start{rep}", b.address)
        fleet = Fleet(sc, b.for_workers)
        rounds = len(b.proxy.released)
        try:
            ws = [fleet.start(f"w{i}", mode, index=i, workers=n) for i in range(n)]
            deadline = time.time() + 120
            while time.time() < deadline and not fleet.problems(health=False):
                try:
                    if all(w.get("/readyz")[0] == 200 for w in ws):
                        break
                except OSError:
                    pass
                time.sleep(0.2)
            else:
                if not fleet.problems(health=False):
                    failures.append(f"start {rep}: not all ready within 120 s:\n" + "\n".join(describe(w, 10) for w in ws))
            time.sleep(3)  # an error surfacing just after readiness
            if mode == "group" and not fleet.problems(health=False):
                try:
                    wait_for(lambda: settled(ws), 90, f"the {n} workers settle on the 8 partitions", fleet)
                except AssertionError as exc:
                    failures.append(f"start {rep}: {exc}")
            if not checked and not fleet.problems():
                sc.write_events(10_000, users=1_000, keys=40, lead_s=4)
                sc.produce_events()
                expected, released = releases_after_the_window(sc, fleet)
                assert_releases_equal(expected, released, fleet)
                checked = True
            print(f"start {rep}: CreateTopics requests sent together: {b.proxy.released[rounds:]}")
            failures += [f"start {rep}: {p}" for p in fleet.problems()]
            for w in ws:
                if w.proc.poll() is None:
                    fleet.stop(w)
            failures += [f"start {rep}: {p}" for p in fleet.problems(health=False) if "stopped on purpose" in p]
        finally:
            fleet.close()
    assert not failures, f"{len(failures)} failure(s) in {START_REPS} starts of {n} {mode} workers:\n\n" + "\n\n".join(failures)
    assert checked
    assert n in b.proxy.released, f"harness: the workers' CreateTopics requests never went together: {b.proxy.released}"


def test_topics_are_there_for_every_client_once_create_topics_returns_also_to_a_concurrent_creator(chaos_kafka):
    """What a worker does first on a new application (topics/kafka.py create_topics, then it
    reads the topics' partitions): two creators of the same new topics at the same instant, as
    two pods of a fresh install. Once create_topics has returned, to the creator and to the other
    (told TOPIC_ALREADY_EXISTS), the topics must be there for any client, every partition with a
    leader. On a016c0c a metadata request right after it often did not list them yet (the
    broker publishes a new topic to its metadata a little after creating it; under load, up to
    a few hundred ms): the worker's 'topic ... does not exist' refusal of issue 30, item 7. How
    often depends on the machine's load: all 30 checks failed in one run here, none in another."""
    from confluent_kafka.admin import AdminClient

    from dpstream.topics.kafka import TopicSpec, create_topics

    def missing_after_create(names: list[str], barrier: threading.Barrier, out: list) -> None:
        barrier.wait()
        try:
            create_topics(chaos_kafka.address, [TopicSpec(name, 4) for name in names])
        except Exception as exc:  # noqa: BLE001 - reported below
            out.append(f"create_topics raised {exc!r}")
            return
        meta = AdminClient({"bootstrap.servers": chaos_kafka.address}).list_topics(timeout=15)
        for name in names:
            topic = meta.topics.get(name)
            if topic is None or topic.error is not None or len(topic.partitions) != 4 or \
                    any(p.leader < 0 for p in topic.partitions.values()):
                out.append(f"{name}: {'absent' if topic is None else topic.error or 'a partition without a leader'}")

    problems = []
    tag = uuid.uuid4().hex[:8]
    for round_ in range(10):
        names = [f"created-{tag}-{round_}-{k}" for k in range(3)]
        barrier, out = threading.Barrier(2), []
        creators = [threading.Thread(target=missing_after_create, args=(names, barrier, out)) for _ in range(2)]
        for t in creators:
            t.start()
        for t in creators:
            t.join(60)
        problems += [f"round {round_}: {line}" for line in out]
    assert not problems, f"{len(problems)} topics not there right after create_topics returned:\n" + "\n".join(problems)
