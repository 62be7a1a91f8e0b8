"""``dpstream bench dynamic --throughput``: updates/s of one dynamic query, through Kafka (one
worker) and through replay, on the same update records in the same run.

The records are a heavy-churn stream (:func:`dpstream.processor.bench.dynamic.generate_stream`,
its live items reverting to ``--restart-live``) over ``--items`` labels in the
``{"item", "op", "ts"}`` format, dated at the moment they are produced, in the order produced:
the update topic (``LogAppendTime``; one partition, or ``--partitions N`` with the query in N
shards, each record keyed by its row or its position as a producer keying by anything would)
holds them before a worker starts. Then,
``--seeds`` times each, alternating:

* replay: ``ReplayRunner`` (``dpstream replay``) reads the same records from a file, with the
  same query on a fresh state directory, to the end, every tick decided (``--until`` the last
  record's time plus the lateness);
* worker: ``dpstream worker`` in a subprocess, fresh state and a fresh application id, timed
  from its readiness until its metrics show every record read and logged
  (``dpstream_events_in_total``) and its status page every tick up to the last record's decided
  (``decided_tick``): its timer decides ticks as its watermark (the records' broker times)
  passes them, so the counter's work is in the time. The run fails if the worker dropped any
  update. ``--compare-with REV``: the same with that commit's worker (timed to the updates
  logged if it does not report its decided tick).

Reported: each median, and the worker's rate against replay's.
"""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from dpstream.processor.bench.dynamic import generate_stream
from dpstream.processor.bench.kafka import _metrics, _start_workers, _stop_workers, older_code
from dpstream.processor.bench.report import machine
from dpstream.processor.config import parse_duration_ms

TICK = "1s"
LATENESS_MS = 1000


def query_yaml(name: str, topic: str, items: int, start_ms: int, envelope: str = "none", shards: int = 1,
               unit_bound: int | None = None) -> str:
    """The bench's query; ``unit_bound``: with a unit bound of that many updates (the unit is
    ``user``, a Debezium row's ``customer_id``), high enough that no update is dropped: the bound's
    work is in the time, and the releases are those without it."""
    labels = ", ".join(f'"item{k}"' for k in range(items))
    shape = "    envelope: debezium\n    item_field: plan\n" if envelope == "debezium" else ""
    if unit_bound is not None:
        shape += f"    unit_field: {'customer_id' if envelope == 'debezium' else 'user'}\n    contribution_bound: {unit_bound}\n"
    return (f"dynamic:\n  - name: {name}\n    input_topic: {topic}\n    output_topic: {topic}-counts\n{shape}"
            f"    items: [{labels}]\n    start: {start_ms}\n    tick: {TICK}\n    allowed_lateness: {LATENESS_MS}ms\n"
            f"    epsilon: 1.0\n    mechanism: baseline\n    shards: {shards}\n")


class ChangeEvents:
    """The stream as a table's Debezium change events (plain envelope, JSON without schemas, as
    Kafka Connect's JsonConverter with ``schemas.enable=false`` writes them): an insert is a
    ``c`` event of a new row, a delete a ``d`` event of a live row of that item (its ``before``
    image), and after every fourth insert a ``u`` event edits a live row without moving it to
    another item (most updates of a real table touch other columns), which carries no update."""

    def __init__(self):
        self.rows: dict[int, list[int]] = {}  # item -> live row ids
        self.next_id = 1

    def row(self, rid: int, item: int) -> bytes:
        return b'{"id":%d,"customer_id":"c%d","plan":"item%d","seats":%d,"renews_at":"2027-01-%02dT00:00:00Z"}' % (
            rid, rid % 99_991, item, rid % 7 + 1, rid % 28 + 1)

    def event(self, op: bytes, before: bytes, after: bytes, ts: int, rid: int) -> bytes:
        return (b'{"before":%s,"after":%s,"source":{"version":"2.7.3.Final","connector":"postgresql","name":"dbserver1",'
                b'"ts_ms":%d,"db":"app","schema":"public","table":"subscriptions","txId":%d,"lsn":%d},"op":"%s",'
                b'"ts_ms":%d,"transaction":null}') % (before, after, ts - 5, rid, rid * 8, op, ts)

    def lines(self, item: int, insert: bool, ts: int) -> list[bytes]:
        if insert:
            rid, self.next_id = self.next_id, self.next_id + 1
            self.rows.setdefault(item, []).append(rid)
            out = [self.event(b"c", b"null", self.row(rid, item), ts, rid)]
            if rid % 4 == 0:
                out.append(self.event(b"u", self.row(rid, item), self.row(rid + 1, item).replace(b'"id":%d' % (rid + 1), b'"id":%d' % rid),
                                      ts, rid))
            return out
        rid = self.rows[item].pop()
        return [self.event(b"d", self.row(rid, item), b"null", ts, rid)]


def produce_updates(broker: str, topic: str, updates: int, items: int, live: int, seed: int, envelope: str = "none",
                    partitions: int = 1, units: int = 0) -> tuple[list[bytes], int]:
    """The stream, dated as produced (``LogAppendTime`` topic of ``partitions``), as update
    records or (``envelope`` debezium) as :class:`ChangeEvents`, keyed (several partitions) by
    the record's row id or position; returns the records as written and the last one's time.
    ``units``: update records carry a ``user`` of that many, at random (Debezium rows carry
    their ``customer_id`` always)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_topics([NewTopic(topic, partitions, 1, config={"message.timestamp.type": "LogAppendTime"})])[topic].result(30)
    which, inserts = generate_stream("heavy_churn", updates, items, seed, target=live)
    producer = Producer({"bootstrap.servers": broker, "linger.ms": 20, "batch.size": 1_000_000, "compression.type": "lz4",
                         "queue.buffering.max.messages": 2_000_000})
    lines, last = [], 0
    ops = (b'"delete"', b'"insert"')
    table = ChangeEvents() if envelope == "debezium" else None
    users = iter(np.random.default_rng(seed + 1).integers(0, max(units, 1), updates).tolist())
    for lo in range(0, updates, 10_000):
        now = int(time.time() * 1000)
        for x, ins in zip(which[lo:lo + 10_000].tolist(), inserts[lo:lo + 10_000].tolist()):
            plain = b'{"item": "item%d", "op": %s, "ts": %d}' % (x, ops[ins], now) if not units else \
                b'{"item": "item%d", "op": %s, "ts": %d, "user": "u%d"}' % (x, ops[ins], now, next(users))
            for line in table.lines(x, ins, now) if table else [plain]:
                lines.append(line)
                key = None if partitions == 1 else (line[line.index(b'"id":') + 5:line.index(b",", line.index(b'"id":'))]
                                                    if table else b"%d" % len(lines))
                while True:
                    try:
                        producer.produce(topic, line, key)
                        break
                    except BufferError:
                        producer.poll(0.05)
        producer.poll(0)
        last = now
    if producer.flush(120):
        raise RuntimeError("the update records were not all acknowledged")
    return lines, last


def replay_rate(config_text: str, lines: list[bytes], until_ms: int, updates: int | None = None) -> tuple[float, int]:
    """Updates/s of a replay of ``lines`` (fresh state; ``updates`` they carry, default one
    each), and its releases."""
    from dpstream.processor.adapters.replay import ReplayRunner
    from dpstream.processor.config import load_config

    with tempfile.TemporaryDirectory(prefix="dpstream-bench-") as tmp:
        path, config_path = Path(tmp) / "updates.jsonl", Path(tmp) / "q.yaml"
        path.write_bytes(b"\n".join(lines) + b"\n")
        config_path.write_text(config_text)
        runner = ReplayRunner(load_config(str(config_path)), bytes(range(1, 33)), None, log=io.StringIO(), noise_label="bench")
        out = io.StringIO()
        started = time.perf_counter()
        try:
            runner.run(str(path), out, until_ms=until_ms)
        finally:
            runner.close()
        elapsed = time.perf_counter() - started
    return (updates or len(lines)) / elapsed, out.getvalue().count("\n")


def _decided_tick(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as r:
        status = json.loads(r.read())
    return max((q.get("decided_tick") or 0 for q in status["queries"] if q.get("kind") == "dynamic"), default=0)


def worker_rate(broker: str, config_text: str, key_file: str, expected: int, last_tick: int, code: str | None = None,
                updates: int | None = None, workers: int = 1) -> tuple[float, dict]:
    """The updates/s of one worker, or of ``workers`` static ones sharing the partitions
    (``code``: another commit's worker, :func:`older_code`): until every update is read and
    logged and every tick up to ``last_tick`` decided on every worker, so the counter's work is
    in the time. (A worker that does not report its decided tick is timed to the updates logged.)"""
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-") as state:
        config_path = Path(state) / "q.yaml"
        config_path.write_text(config_text)
        procs, ports = _start_workers(broker, str(config_path), key_file, 1, Path(state), workers, code=code)
        try:
            started = time.perf_counter()
            while True:
                try:
                    ms = [_metrics(port) for port in ports]
                except OSError:  # busy (a large batch holds its event loop longer than the scrape waits), or stopped
                    if all(proc.poll() is None for proc in procs) and time.perf_counter() - started < 600:
                        time.sleep(0.2)
                        continue
                    time.sleep(2)  # its last lines written
                    tails = "\n".join(f"worker {i} ({'exited ' + str(proc.returncode) if proc.poll() is not None else 'running'}):\n"
                                      + (Path(state) / f"worker{i}.log").read_text(errors="replace")[-3000:]
                                      for i, proc in enumerate(procs))
                    raise RuntimeError(f"a worker stopped answering during the run; the logs end:\n{tails}") from None
                m = {k: sum(x.get(k, 0) for x in ms) for k in ms[0]}
                if m.get("dpstream_events_in_total", 0) >= expected and \
                        (code is not None or min(_decided_tick(port) for port in ports) >= last_tick):
                    elapsed = time.perf_counter() - started
                    m["elapsed_s"] = elapsed
                    return (updates or expected) / elapsed, m
                if time.perf_counter() - started > 600:
                    raise RuntimeError(f"the worker read {m.get('dpstream_events_in_total', 0):.0f} of {expected} updates in 600 s")
                time.sleep(0.05)
        finally:
            _stop_workers(procs)


def run_throughput_bench(broker: str, updates: int, items: int, live: int, repeats: int, json_path: str | None,
                         compare_with: str | None = None, envelope: str = "none", partitions: int = 1, workers: int = 1,
                         units: int = 0, out=sys.stderr) -> dict:
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    topic = f"bench-updates-{uuid.uuid4().hex[:8]}"
    start_ms = int(time.time() * 1000) // 1000 * 1000 - 60_000
    config_text = query_yaml("bench_dynamic", topic, items, start_ms, envelope, shards=partitions,
                             unit_bound=updates if units else None)
    shape = "Debezium change events (c, d, and u events that move no row)" if envelope == "debezium" else "update records"
    p(f"bench dynamic --throughput: {updates:,} updates over {items} items (heavy churn, live items ~{live:,}) as {shape}, "
      f"tick {TICK}, " + ("one partition" if partitions == 1 else f"{partitions} partitions and {partitions} shards") +
      ("" if workers == 1 else f", {workers} workers") + (f", a unit bound ({units:,} units)" if units else "") +
      f", {repeats} run(s) each")
    lines, last = produce_updates(broker, topic, updates, items, live, seed=7, envelope=envelope, partitions=partitions,
                                  units=units)
    if len(lines) != updates:
        p(f"  {len(lines):,} records carry the {updates:,} updates")
    until = last + LATENESS_MS + 1000
    last_tick = (last - start_ms) // parse_duration_ms(TICK) + 1
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dpstream-bench-key-"))
        older = stack.enter_context(older_code(compare_with)) if compare_with else None
        key_file = Path(tmp) / "noise.key"
        key_file.write_text(bytes(range(1, 33)).hex())
        key_file.chmod(0o600)
        runs: dict[str, list[float]] = {"replay": [], "worker": [], **({"older": []} if older else {})}
        releases = []
        for r in range(repeats):
            rate, n = replay_rate(config_text, lines, until, updates)
            runs["replay"].append(rate)
            releases.append(n)
            p(f"  run {r + 1}: replay {rate:,.0f} updates/s ({n} releases)")
            for kind, code in [("worker", None), *([("older", older)] if older else [])]:
                rate, m = worker_rate(broker, config_text, str(key_file), len(lines), last_tick, code, updates, workers)
                if m.get("dpstream_events_dropped_total", 0):
                    raise RuntimeError(f"the {kind} worker dropped {m['dpstream_events_dropped_total']:.0f} updates")
                runs[kind].append(rate)
                p(f"  run {r + 1}: {'worker' if code is None else 'worker at ' + compare_with} {rate:,.0f} updates/s "
                  f"({m['elapsed_s']:.1f} s from ready)")
    report = {"machine": machine(), "updates": updates, "records": len(lines), "envelope": envelope, "partitions": partitions,
              "workers": workers, "units": units,
              "items": items,
              "live": live, "tick": TICK, "runs": runs,
              "replay_releases": releases, **{f"{k}_updates_per_s": statistics.median(v) for k, v in runs.items()}}
    report["worker_over_replay"] = report["worker_updates_per_s"] / report["replay_updates_per_s"]
    line = (f"medians: worker {report['worker_updates_per_s']:,.0f} updates/s, replay {report['replay_updates_per_s']:,.0f} "
            f"updates/s (worker/replay {report['worker_over_replay']:.2f}x)")
    if older:
        report["compare_with"] = compare_with
        report["worker_over_older"] = report["worker_updates_per_s"] / report["older_updates_per_s"]
        line += f"; worker at {compare_with} {report['older_updates_per_s']:,.0f} updates/s ({report['worker_over_older']:.2f}x)"
    p(line)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report
