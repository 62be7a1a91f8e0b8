"""``dpstream bench kafka``: one worker's end-to-end events/s through the broker, against a
plain confluent-kafka consume loop over the same topic, in the same run.

The input topic is filled once with the DP-SQLP workload's shape (keyed by user). Then, in
alternation, ``--repeats`` times each:

* baselines: a confluent-kafka consumer assigned to every partition reads the topic from the
  beginning with ``consume(10000)`` and touches each message's value (nothing else), once with
  librdkafka's defaults and once with fetch settings tuned for throughput; and aiokafka's
  ``getmany`` loop (the worker's own client) doing nothing with the records;
* worker: ``dpstream worker`` in a subprocess with fresh state and a fresh app id reads the same
  topic; timed from its readiness until its metrics show every admitted record accumulated by
  stage 2 (parsed, bounded, sent through the repartition topic, read back and appended to its
  micro-batch, with RocksDB writes and broker acknowledgements on the way). Events are dated in
  the half hour before they are produced, in a window whose only trigger is at its end, hours
  away: every event is on time (none late, none ``future`` against its Kafka timestamp) and no
  trigger fires during the measurement (trigger cost is ``bench scaling``'s subject). The run
  fails if the worker dropped anything but contributions over the bound;
* worker, ``--assignment group``: the same with elastic workers' changelogs (every state write
  also goes to a changelog topic in the batch's transaction);
* worker, stock producer: the same events in a second topic written by a confluent-kafka
  ``Producer`` with every setting at its default (keyed by user id, librdkafka's crc32
  partitioner, not the worker's murmur2): about 7 events in 8 are read on a partition that does
  not own their user and go to it through the by-user topic, a second trip through Kafka
  (docs/operator-guide.md, "Writing to the input topic");
* worker, ``--format avro``: the same events as Avro records of confluent-kafka's
  ``AvroSerializer`` (the Confluent wire format; a small in-memory registry,
  :mod:`dpstream.processor.bench.registry_server`, since none installs here), placed as the JSON
  ones (docs/operator-guide.md, "Formats and schema registries");
* worker at ``--compare-with REV``: this repository's worker at another commit, on the JSON topic;
* workers (``--workers N``, default 2): N worker processes with one app id, worker i owning
  partitions p % N == i (what N replicas of the Helm chart run), started together and timed
  from when all are ready until their summed metrics show every admitted record accumulated.

Reported: the median of each and their ratio. The broker (Tansu, memory storage) runs on the
same 2-core machine as the readers.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dpstream.processor.bench.report import machine
from dpstream.topics.kafka import aiokafka_security, client_security

ROOT = Path(__file__).resolve().parents[2]
DAY_MS = 86_400_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFLUENT_TUNED = {"fetch.wait.max.ms": 10, "queued.min.messages": 1_000_000, "fetch.max.bytes": 64 * 1024 * 1024,
                   "max.partition.fetch.bytes": 16 * 1024 * 1024}


def baseline_rate(broker: str, topic: str, expected: int, tuned: bool = False) -> float:
    """A plain confluent-kafka consume loop (librdkafka defaults, or fetch settings tuned for
    throughput); the clock starts at the first non-empty batch."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-bench-baseline", "enable.auto.commit": False,
                         **client_security(), **(CONFLUENT_TUNED if tuned else {})})
    parts = consumer.list_topics(topic, timeout=15).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    got, size, started = 0, 0, None
    try:
        while got < expected:
            msgs = consumer.consume(10_000, 5.0)
            if not msgs:
                raise RuntimeError(f"baseline stalled at {got} of {expected} records")
            if started is None:
                started = time.perf_counter()
            for m in msgs:
                if m.error() is None:
                    size += len(m.value())
                    got += 1
        return got / (time.perf_counter() - started)
    finally:
        consumer.close()


def aiokafka_rate(broker: str, topic: str, expected: int) -> float:
    """The worker's own client, reading as the worker does (getmany) and doing nothing else."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def run() -> float:
        consumer = AIOKafkaConsumer(bootstrap_servers=broker, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
                                    max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=32 * 1024 * 1024,
                                    **aiokafka_security(client_security()))
        await consumer.start()
        try:
            parts = consumer.partitions_for_topic(topic) or set()
            if not parts:
                await consumer._client.force_metadata_update()
                parts = consumer.partitions_for_topic(topic)
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            got, started = 0, None
            while got < expected:
                fetched = await consumer.getmany(timeout_ms=5000, max_records=20_000)
                if not fetched:
                    raise RuntimeError(f"aiokafka baseline stalled at {got} of {expected}")
                if started is None:
                    started = time.perf_counter()
                got += sum(len(v) for v in fetched.values())
            return got / (time.perf_counter() - started)
        finally:
            await consumer.stop()

    return asyncio.run(run())


def _metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            summed = s.name.endswith("_total") or s.name == "dpstream_partitions_owned"  # over their labels
            out[s.name] = out.get(s.name, 0.0) + s.value if summed else s.value
            if s.name == "dpstream_events_dropped_total":
                out[f"dropped:{s.labels['reason']}"] = out.get(f"dropped:{s.labels['reason']}", 0.0) + s.value
    return out


def worker_rate(broker: str, config_path: str, key_file: str, expected: int, partitions: int, workers: int = 1,
                extra: tuple = (), code: str | None = None) -> tuple[float, dict]:
    """``workers`` worker processes (worker i of N owns partitions p % N == i, as the Helm
    chart's replicas do), fresh state and one fresh app id; their summed metrics. ``extra``:
    more worker options; ``code``: run another commit's worker (:func:`older_code`). The rate is
    timed from when every worker is ready; the metrics also hold ``first_event_s``, when the
    first event was taken in after that (the start-up an elastic worker spends joining its group
    and restoring what it is given falls in between)."""
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-") as state:
        procs, ports = _start_workers(broker, config_path, key_file, partitions, Path(state), workers, extra, code)
        try:
            started = time.perf_counter()
            first = None
            while True:
                m: dict = {}
                for port in ports:
                    for k, v in _metrics(port).items():
                        m[k] = m.get(k, 0.0) + v
                if first is None and m.get("dpstream_events_in_total", 0) > 0:
                    first = time.perf_counter() - started
                admitted = m.get("dpstream_events_in_total", 0) - m.get("dpstream_events_dropped_total", 0)
                if m.get("dpstream_events_in_total", 0) >= expected and m.get("dpstream_records_accumulated_total", 0) >= admitted:
                    elapsed = time.perf_counter() - started
                    m["first_event_s"], m["elapsed_s"] = first, elapsed
                    return expected / elapsed, m
                time.sleep(0.05)
        finally:
            _stop_workers(procs)


@contextlib.contextmanager
def older_code(rev: str):
    """A directory whose ``dpstream`` package is commit ``rev`` of this repository (a detached
    git worktree, removed afterwards): a worker started with it on ``PYTHONPATH`` runs that
    commit's code, in the same run as this one's (``bench kafka --compare-with``)."""
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                       capture_output=True)
        try:
            (Path(tmp) / "dpstream").symlink_to(tree)
            yield tmp
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_kafka_bench(broker: str, users: int, keys: int, repeats: int, partitions: int, json_path: str | None,
                    workers: int = 2, baselines: bool = True, compare_with: str | None = None, fmt: str = "json") -> dict:
    with contextlib.ExitStack() as stack:
        older = (compare_with, stack.enter_context(older_code(compare_with))) if compare_with else None
        registry = None
        if fmt != "json":  # records of the format through a registry the worker process reaches over HTTP
            from dpstream.processor.bench.registry_server import RegistryServer

            registry = stack.enter_context(RegistryServer())
        return _run_kafka_bench(broker, users, keys, repeats, partitions, json_path, workers, baselines, older, (fmt, registry))


#: the Avro schema of the bench's events (what a producer using confluent-kafka's serializer registers)
BENCH_AVRO_SCHEMA = {"type": "record", "name": "PageView", "namespace": "bench",
                     "fields": [{"name": "user_id", "type": "string"}, {"name": "key", "type": "string"},
                                {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}


def produce_avro(broker: str, topic: str, lines, registry_url: str) -> int:
    """``lines`` as Avro records of confluent-kafka's ``AvroSerializer`` (the Confluent wire
    format, the schema registered at ``registry_url``), keyed by user id with the murmur2
    partitioner, as ``dpstream produce`` places JSON ones."""
    from confluent_kafka import Producer
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    serialize = AvroSerializer(SchemaRegistryClient({"url": registry_url}), json.dumps(BENCH_AVRO_SCHEMA))
    ctx = SerializationContext(topic, MessageField.VALUE)
    producer = Producer({"bootstrap.servers": broker, "partitioner": "murmur2_random", "linger.ms": 20, **client_security()})
    n = 0
    for line in lines:
        obj = json.loads(line)
        value = serialize(obj, ctx)
        while True:
            try:
                producer.produce(topic, value, key=str(obj["user_id"]).encode())
                break
            except BufferError:
                producer.poll(0.1)
        n += 1
    if producer.flush(120) != 0:
        raise RuntimeError("the Avro producer did not deliver every record")
    return n


def _run_kafka_bench(broker: str, users: int, keys: int, repeats: int, partitions: int, json_path: str | None,
                     workers: int = 2, baselines: bool = True, older: tuple | None = None, fmt: tuple = ("json", None)) -> dict:
    from dpstream.processor.adapters.kafka_tools import produce, synthetic_lines
    from dpstream.topics.kafka import INPUT_TOPIC_CONFIG, TopicSpec, create_topics

    tag = uuid.uuid4().hex[:8]
    topic = f"bench-events-{tag}"
    create_topics(broker, [TopicSpec(topic, partitions, INPUT_TOPIC_CONFIG)])
    now = int(time.time() * 1000)
    span = 30 * 60_000
    # the first window length whose window holds the last half hour and ends over 2 h from now
    window_days = next(d for d in (1, 2, 3, 5) if (now // (d * DAY_MS) + 1) * d * DAY_MS - now > 2 * 3_600_000
                       and now // (d * DAY_MS) == (now - span) // (d * DAY_MS))
    t0 = time.perf_counter()
    n = produce(broker, topic, synthetic_lines(users, keys, 1, now - span, span - 60_000))
    print(f"bench kafka: {n:,} events ({users:,} users, {keys:,} keys) in {topic}, {partitions} partitions, "
          f"produced in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    fmt_topic = f"bench-{fmt[0]}-{tag}"
    if fmt[1] is not None:
        create_topics(broker, [TopicSpec(fmt_topic, partitions, INPUT_TOPIC_CONFIG)])
        produce_avro(broker, fmt_topic, synthetic_lines(users, keys, 1, now - span, span - 60_000), fmt[1])
    stock_topic = f"bench-stock-{tag}"
    if baselines:
        create_topics(broker, [TopicSpec(stock_topic, partitions, INPUT_TOPIC_CONFIG)])
        produce_stock(broker, stock_topic, synthetic_lines(users, keys, 1, now - span, span - 60_000))
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-cfg-") as tmp:
        config_path = Path(tmp) / "queries.yaml"
        config_path.write_text(f"queries:\n  - name: bench{tag}\n    input_topic: {topic}\n    output_topic: bench-out-{tag}\n"
                               f"    window: {window_days}d\n    triggers: 1\n    contribution_bound: 32\n    epsilon: 6\n    delta: 1.0e-9\n")
        stock_config = Path(tmp) / "stock.yaml"
        stock_config.write_text(config_path.read_text().replace(f"input_topic: {topic}\n", f"input_topic: {stock_topic}\n"))
        fmt_config = Path(tmp) / "format.yaml"
        if fmt[1] is not None:
            fmt_config.write_text(config_path.read_text().replace(f"input_topic: {topic}\n", f"input_topic: {fmt_topic}\n")
                                  + f"input_format: {fmt[0]}\nschema_registry:\n  url: {fmt[1]}\n")
        key_file = Path(tmp) / "noise.key"
        key_file.write_bytes(os.urandom(32))  # a throwaway secret: nothing here is published
        key_file.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
        runs = ({"confluent_default": [], "confluent_tuned": [], "aiokafka_getmany": [], "worker": [], "worker_at_least_once": [],
                 "worker_group": [], "worker_stock_producer": []}
                if baselines else {"worker": []})
        scaled = f"workers_{workers}"
        if workers > 1:
            runs[scaled] = []
        if older:
            runs["worker_at_compared"] = []
        if fmt[1] is not None:
            runs[f"worker_{fmt[0]}"] = []
        #: per trial: s from ready to the first event taken in, and events/s from then on
        starts: dict = {}
        running: dict = {}
        for r in range(repeats):
            if baselines:
                runs["confluent_default"].append(baseline_rate(broker, topic, n))
                runs["confluent_tuned"].append(baseline_rate(broker, topic, n, tuned=True))
                runs["aiokafka_getmany"].append(aiokafka_rate(broker, topic, n))
            trials = [("worker", 1, (), config_path)]  # exactly-once delivery, the default
            if older:  # the same worker at another commit (--compare-with), on the same topic
                trials.append(("worker_at_compared", 1, (), config_path))
            if fmt[1] is not None:  # the same events in another format (--format), same placement
                trials.append((f"worker_{fmt[0]}", 1, (), fmt_config))
            if baselines:  # what the transactions cost, and the changelogs of elastic workers, in the same run
                trials.append(("worker_at_least_once", 1, ("--delivery", "at-least-once"), config_path))
                trials.append(("worker_group", 1, ("--assignment", "group"), config_path))
                trials.append(("worker_stock_producer", 1, (), stock_config))
            if workers > 1:
                trials.append((scaled, workers, (), config_path))
            for name, count, extra, config in trials:
                code = older[1] if older and name == "worker_at_compared" else None
                rate, metrics = worker_rate(broker, str(config), str(key_file), n, partitions, count, extra, code)
                refused = {k: v for k, v in metrics.items() if k.startswith("dropped:") and k != "dropped:contribution_bound" and v}
                if refused or metrics.get("dpstream_records_accumulated_total", 0) <= 0:
                    raise RuntimeError(f"the worker refused events ({refused}): the run would measure refusals, not the product")
                runs[name].append(rate)
                starts.setdefault(name, []).append(metrics["first_event_s"])
                running.setdefault(name, []).append(n / (metrics["elapsed_s"] - metrics["first_event_s"]))
            print(f"  run {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in runs.items()) + " events/s", file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    if not baselines:
        return {"events": n, "events_per_s": runs, "medians": medians}
    result = {
        "events": n, "users": users, "keys": keys, "partitions": partitions, "repeats": repeats,
        "events_per_s": runs, "medians": medians,
        "ratio_to_confluent_default": medians["worker"] / medians["confluent_default"],
        "ratio_to_confluent_tuned": medians["worker"] / medians["confluent_tuned"],
        "ratio_to_aiokafka_getmany": medians["worker"] / medians["aiokafka_getmany"],
        "ratio_exactly_once_to_at_least_once": medians["worker"] / medians["worker_at_least_once"],
        "ratio_group_to_static": medians["worker_group"] / medians["worker"],
        # the same, timed from the first event taken in: without the group's join and the restore
        "first_event_s": {k: statistics.median(v) for k, v in starts.items()},
        "events_per_s_from_first_event": {k: statistics.median(v) for k, v in running.items()},
        "ratio_group_to_static_from_first_event": statistics.median(running["worker_group"]) / statistics.median(running["worker"]),
        "ratio_stock_producer_to_keyed": medians["worker_stock_producer"] / medians["worker"],
    }
    if fmt[1] is not None:
        result[f"ratio_{fmt[0]}_to_json"] = medians[f"worker_{fmt[0]}"] / medians["worker"]
        print(f"bench kafka: {fmt[0]} records through a schema registry / JSON: {result[f'ratio_{fmt[0]}_to_json']:.2f} "
              f"({medians[f'worker_{fmt[0]}']:,.0f} events/s)", file=sys.stderr)
    if older:
        result["compared_with"] = older[0]
        result["ratio_worker_to_compared"] = medians["worker"] / medians["worker_at_compared"]
        print(f"bench kafka: this worker / the worker at {older[0]}: {result['ratio_worker_to_compared']:.2f} "
              f"({medians['worker_at_compared']:,.0f} events/s there)", file=sys.stderr)
    if workers > 1:
        result["workers"] = workers
        result[f"ratio_{scaled}_to_aiokafka_getmany"] = medians[scaled] / medians["aiokafka_getmany"]
    print(f"bench kafka (medians of {repeats}): worker {medians['worker']:,.0f} events/s; plain confluent-kafka loop "
          f"{medians['confluent_default']:,.0f} (defaults) / {medians['confluent_tuned']:,.0f} (tuned fetch); aiokafka getmany "
          f"{medians['aiokafka_getmany']:,.0f}. Worker / confluent: {result['ratio_to_confluent_default']:.2f} / "
          f"{result['ratio_to_confluent_tuned']:.2f}; worker / aiokafka: {result['ratio_to_aiokafka_getmany']:.2f}; "
          f"exactly-once / at-least-once: {result['ratio_exactly_once_to_at_least_once']:.2f} "
          f"({medians['worker_at_least_once']:,.0f} events/s at least once); --assignment group (changelogs) / static: "
          f"{result['ratio_group_to_static']:.2f} ({medians['worker_group']:,.0f} events/s; timed from the first event "
          f"taken in: {result['ratio_group_to_static_from_first_event']:.2f}, first event after "
          f"{result['first_event_s']['worker_group']:.2f} s against {result['first_event_s']['worker']:.2f} s); a stock producer's topic (by-user "
          f"topic for ~7/8) / keyed by murmur2: {result['ratio_stock_producer_to_keyed']:.2f} "
          f"({medians['worker_stock_producer']:,.0f} events/s)"
          + (f"; {workers} worker processes together {medians[scaled]:,.0f} events/s, "
             f"{result[f'ratio_{scaled}_to_aiokafka_getmany']:.2f} of aiokafka" if workers > 1 else ""), file=sys.stderr)
    if json_path:
        Path(json_path).write_text(json.dumps({**result, "machine": machine()}, indent=2) + "\n")
    return result


def produce_stock(broker: str, topic: str, lines) -> int:
    """``lines`` as a confluent-kafka ``Producer`` with every setting at its default writes them,
    keyed by their user id (what most librdkafka-based producers do)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": broker, **client_security()})
    n = 0
    for line in lines:
        while True:
            try:
                producer.produce(topic, line, key=str(json.loads(line)["user_id"]).encode())
                break
            except BufferError:  # its queue is full: let it deliver
                producer.poll(0.1)
        n += 1
    if producer.flush(120) != 0:
        raise RuntimeError("the stock producer did not deliver every record")
    return n


# ---------------------------------------------------------------------------------------------- live
LIVE_WINDOW_S, LIVE_TRIGGERS, LIVE_GRACE_S = 20, 4, 3.0


def _start_workers(broker: str, config_path: str, key_file: str, partitions: int, state: Path, workers: int = 1,
                   extra: tuple = (), code: str | None = None) -> tuple[list, list[int]]:
    """``workers`` worker processes with fresh state and one fresh app id, once all are ready.
    ``code``: a directory whose ``dpstream`` is the code to run (:func:`older_code`), else this one."""
    ports = [_free_port() for _ in range(workers)]
    app_id = f"dpstream-bench-{uuid.uuid4().hex[:8]}"
    # each app id its own output topics: an output topic belongs to one application, and another
    # is refused at start (docs/operations.md, "Output topics")
    own_config = state / f"{app_id}.yaml"
    own_config.write_text(re.sub(r"(?m)^(\s*output_topic: )(\S+)$", rf"\g<1>\g<2>-{app_id[-8:]}", Path(config_path).read_text()))
    config_path = str(own_config)
    env = {**os.environ, "DPSTREAM_NOISE_KEY_FILE": key_file}
    if code is not None:
        env["PYTHONPATH"] = code
    procs = []
    group = "group" in extra  # elastic workers: the consumer group assigns, each has an instance id
    for i, port in enumerate(ports):
        layout = ["--instance-id", f"w{i}"] if group else ["--worker-index", str(i), "--workers", str(workers)]
        cmd = [sys.executable, "-m", "dpstream.processor.cli", "worker", "--config", config_path, "--broker", broker,
               "--state-dir", str(state / f"w{i}"), "--partitions", str(partitions), "--web-port", str(port),
               "--web-host", "127.0.0.1", "--app-id", app_id, *layout, "--log-level", "warn", *extra]
        log = open(state / f"worker{i}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    pending = set(range(workers))
    while pending:
        for i in list(pending):
            if procs[i].poll() is not None:
                raise RuntimeError(f"worker {i} exited: {(state / f'worker{i}.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[i]}/readyz", timeout=2) as r:
                    if r.status == 200:
                        pending.discard(i)
            except OSError:
                pass
        time.sleep(0.05)
    while group:  # timed from when the group has assigned (and restored) every input and repartition partition
        owned = sum(_metrics(port).get("dpstream_partitions_owned", 0) for port in ports)
        if owned >= 2 * partitions:
            break
        time.sleep(0.05)
    return procs, ports


def _stop_workers(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def produce_live(broker: str, topic: str, rate: float, seconds: float, users: int, keys: int, seed: int) -> tuple[int, float]:
    """Events produced as they happen: ``rate`` per second for ``seconds``, each dated (and
    Kafka-timestamped) when it is produced, keyed by user. Returns (events, seconds taken)."""
    started = time.perf_counter()
    lines = produce_live_lines(broker, topic, rate, seconds, users, keys, seed, keep=False)
    return len(lines), time.perf_counter() - started


def produce_live_lines(broker: str, topic: str, rate: float, seconds: float, users: int, keys: int, seed: int,
                       keep: bool = True) -> list:
    """:func:`produce_live`'s events, returned in the order sent when ``keep`` (else one None per
    event): a replay of them is the reference for what the worker should release."""
    import numpy as np
    from confluent_kafka import Producer

    from dpstream.processor.adapters.kafka_tools import PRODUCER_DEFAULTS

    rng = np.random.default_rng(seed)
    total = int(rate * seconds)
    user = rng.integers(0, users, total).tolist()
    key = np.minimum(rng.zipf(1.3, total), keys).tolist()
    producer = Producer({"bootstrap.servers": broker, **PRODUCER_DEFAULTS, "linger.ms": 5, **client_security()})
    started = time.perf_counter()
    sent, out = 0, []
    while sent < total:
        due = min(total, int((time.perf_counter() - started) * rate) + 1)
        now = int(time.time() * 1000)
        for i in range(sent, due):
            u = f"user-{user[i]}".encode()
            line = b'{"user_id":"%s","key":"page-%d","ts":%d}' % (u, key[i], now)
            out.append(line if keep else None)
            while True:
                try:
                    producer.produce(topic, line, u)
                    break
                except BufferError:
                    producer.poll(0.01)
        sent = due
        producer.poll(0)
        time.sleep(0.002)
    if producer.flush(60):
        raise RuntimeError("live producer: records not acknowledged")
    return out


def live_trial(broker: str, rate: float, seconds: float, partitions: int, users: int, keys: int, key_file: str) -> dict:
    """One worker on a fresh topic while events are produced live at ``rate``/s. Steady: the
    producer held the rate, nothing was dropped as late, and the worker had taken in (stage 2
    accumulated) every admitted record within LIVE_GRACE_S of the last one being produced."""
    tag = uuid.uuid4().hex[:8]
    topic = f"bench-live-{tag}"
    from dpstream.topics.kafka import INPUT_TOPIC_CONFIG, TopicSpec, create_topics

    create_topics(broker, [TopicSpec(topic, partitions, INPUT_TOPIC_CONFIG)])
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-live-") as tmp:
        config_path = Path(tmp) / "queries.yaml"
        config_path.write_text(f"queries:\n  - name: live{tag}\n    input_topic: {topic}\n    output_topic: bench-out-{tag}\n"
                               f"    window: {LIVE_WINDOW_S}s\n    triggers: {LIVE_TRIGGERS}\n    allowed_lateness: 1s\n"
                               f"    contribution_bound: 32\n    epsilon: 6\n    delta: 1.0e-9\n")
        procs, ports = _start_workers(broker, str(config_path), key_file, partitions, Path(tmp))
        try:
            produced, took = produce_live(broker, topic, rate, seconds, users, keys, seed=int(rate))
            done = time.perf_counter()
            caught_up = None
            while time.perf_counter() - done < 30:
                if procs[0].poll() is not None:
                    raise RuntimeError(f"the worker exited at {rate:,.0f}/s: {(Path(tmp) / 'worker0.log').read_text()[-3000:]}")
                try:
                    m = _metrics(ports[0])
                except OSError:  # stopping: the next turn sees it exit
                    time.sleep(0.5)
                    continue
                admitted = m.get("dpstream_events_in_total", 0) - m.get("dpstream_events_dropped_total", 0)
                if m.get("dpstream_events_in_total", 0) >= produced and m.get("dpstream_records_accumulated_total", 0) >= admitted:
                    caught_up = time.perf_counter() - done
                    break
                time.sleep(0.05)
            m = _metrics(ports[0])
        finally:
            _stop_workers(procs)
    achieved = produced / took
    late = m.get("dropped:late", 0)
    return {"rate": rate, "achieved": achieved, "caught_up_s": caught_up, "late": late, "triggers": m.get("dpstream_triggers_fired_total", 0),
            "steady": achieved >= 0.95 * rate and late == 0 and caught_up is not None and caught_up <= LIVE_GRACE_S}


def run_partition_sweep(broker: str, users: int, keys: int, repeats: int, partition_counts: list[int], json_path: str | None,
                        workers: int = 1) -> dict:
    """``bench kafka --partitions 1,2,4``: the whole comparison (worker against the plain
    confluent-kafka and aiokafka loops, same run) once per partition count of one worker."""
    results = {}
    for count in partition_counts:
        results[count] = run_kafka_bench(broker, users, keys, repeats, count, None, workers=workers)
    print("bench kafka by partitions per worker (medians): " + "; ".join(
        f"{p}: worker {r['medians']['worker']:,.0f}/s, {r['ratio_to_confluent_default']:.2f} of confluent-kafka, "
        f"{r['ratio_to_aiokafka_getmany']:.2f} of aiokafka" for p, r in results.items()), file=sys.stderr)
    if json_path:
        Path(json_path).write_text(json.dumps({"by_partitions": results, "machine": machine()}, indent=2) + "\n")
    return results


def _print_trial(t: dict) -> None:
    caught = "never" if t["caught_up_s"] is None else f"{t['caught_up_s']:.2f} s"
    print(f"  live {t['rate']:,.0f}/s: produced {t['achieved']:,.0f}/s, caught up {caught} after the last event, "
          f"late {t['late']:.0f}: {'steady' if t['steady'] else 'NOT steady'}", file=sys.stderr)


def run_live_bench(broker: str, start_rate: float, seconds: float, partitions: int, users: int, keys: int, repeats: int,
                   json_path: str | None) -> dict:
    """``bench kafka --live RATE``: the highest steady live rate (doubling from RATE until a trial
    is not steady, then one step between), against the worker's bulk rate in the same run."""
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-key-") as tmp:
        key_file = Path(tmp) / "noise.key"
        key_file.write_bytes(os.urandom(32))  # a throwaway secret: nothing here is published
        key_file.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
        trials = []
        rate, best, failed = start_rate, None, None
        while rate <= 1_000_000:
            t = live_trial(broker, rate, seconds, partitions, users, keys, str(key_file))
            trials.append(t)
            _print_trial(t)
            if not t["steady"]:
                failed = rate
                break
            best, rate = rate, rate * 2
        if best is not None and failed is not None:
            mid = (best * failed) ** 0.5
            t = live_trial(broker, mid, seconds, partitions, users, keys, str(key_file))
            trials.append(t)
            _print_trial(t)
            if t["steady"]:
                best = mid
    bulk = run_kafka_bench(broker, users, keys, repeats, partitions, None, workers=1, baselines=False)
    result = {"live_steady_rate": best, "bulk_rate": bulk["medians"]["worker"], "trials": trials, "seconds": seconds,
              "partitions": partitions, "ratio_bulk_to_live": (bulk["medians"]["worker"] / best) if best else None}
    print(f"bench kafka --live: highest steady live rate {best or 0:,.0f} events/s; bulk {result['bulk_rate']:,.0f} events/s "
          f"(median of {repeats}); bulk / live {result['ratio_bulk_to_live'] or float('inf'):.2f}", file=sys.stderr)
    if json_path:
        Path(json_path).write_text(json.dumps({**result, "machine": machine()}, indent=2) + "\n")
    return result
