"""Input from any producer is counted, not lost (issue 31, item 1), against the test broker.

A plain confluent-kafka ``Producer`` with every setting at its default (librdkafka's
consistent_random partitioner, not the worker's murmur2), keyed by user id, with every tenth
record keyless: the first worker to meet it dead-lettered 88% of its records as
``wrong_partition`` or ``malformed`` and released the hot key at an eighth of its count. Every
event must now be counted once and the releases must equal replay's of the same events, with
the static and the elastic (``--assignment group``) worker alike. Kafka's own console producer
(round-robin, keyless) is the second producer: its records land wherever it likes.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dpstream.topics.kafka import DEAD_LETTER_TOPIC, INPUT_TOPIC_CONFIG, TopicSpec, create_topics
from tests.conftest import ROOT
from tests.test_kafka_worker import running

pytestmark = pytest.mark.broker


def _events(sc, n: int, lead_s: float) -> list[bytes]:
    """``n`` events of the scenario's law, rewritten so that each user has exactly the
    contribution bound (3): every event is then admitted whatever order a user's events arrive
    in, and the releases must equal replay's. (A user over the bound keeps the first 3 to reach
    its partition; with records on several partitions Kafka orders them only per partition, so
    which 3 may differ from the file's order, the bound itself never.)"""
    sc.write_events(n, users=n // 3, keys=30, lead_s=lead_s)
    lines = []
    for i, line in enumerate(sc.events.read_bytes().splitlines()):
        obj = json.loads(line)
        obj["user_id"] = f"u{i % (n // 3)}"
        lines.append(json.dumps(obj, separators=(",", ":")).encode())
    sc.events.write_bytes(b"\n".join(lines) + b"\n")
    return lines


@pytest.mark.parametrize("assignment", ["static", "group"])
def test_a_stock_producers_records_keyed_by_user_or_not_are_all_counted_as_replay_counts_them(tmp_path, broker, assignment):
    from confluent_kafka import Producer

    with running(tmp_path, broker) as sc:
        create_topics(sc.broker, [TopicSpec(sc.input, 4, INPUT_TOPIC_CONFIG)])
        w = sc.ready_worker("one", extra=("--assignment", "group", "--instance-id", "one") if assignment == "group" else ())
        lines = _events(sc, 6_000, lead_s=4)
        producer = Producer({"bootstrap.servers": sc.broker})  # every setting left at its default
        for i, line in enumerate(lines):
            producer.produce(sc.input, line, key=None if i % 10 == 0 else json.loads(line)["user_id"].encode())
        assert producer.flush(30) == 0
        sc.wait_for_window_end()
        expected = sc.replay()
        assert len(expected) >= 8
        sc.assert_published_equal(expected)
        assert w.metric("dpstream_events_in_total", query=sc.query) == len(lines)
        # librdkafka's crc32 and murmur2 agree on about a quarter of 4 partitions: the rest moved
        assert w.metric("dpstream_events_rerouted_total", query=sc.query) > len(lines) / 2
        assert not [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == sc.query], "nothing is dead-lettered"


def _console_produce_keyless(broker: str, topic: str, lines: list[bytes]) -> None:
    """Kafka's own Java console producer (org.apache.kafka.tools.ConsoleProducer), every setting
    at its default: no key, records spread over the partitions as it likes."""
    libs = Path(os.environ.get("DPSTREAM_BROKER_DIR", ROOT / ".broker")) / "kafka-4.4.0" / "libs"
    if not list(libs.glob("kafka-tools-4*.jar")):
        libs = ROOT / ".broker" / "kafka-4.4.0" / "libs"
    proc = subprocess.run(["java", "-cp", f"{libs}/*", "org.apache.kafka.tools.ConsoleProducer", "--bootstrap-server", broker,
                           "--topic", topic], input=b"\n".join(lines) + b"\n", capture_output=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kafkas_console_producer_writes_keyless_records_and_every_one_is_counted(tmp_path, broker):
    with running(tmp_path, broker) as sc:
        create_topics(sc.broker, [TopicSpec(sc.input, 4, INPUT_TOPIC_CONFIG)])
        w = sc.ready_worker("one")
        lines = _events(sc, 3_000, lead_s=8)  # the JVM takes a few seconds to start
        _console_produce_keyless(sc.broker, sc.input, lines)
        sc.wait_for_window_end()
        sc.assert_published_equal(sc.replay())
        assert w.metric("dpstream_events_in_total", query=sc.query) == len(lines)


@pytest.mark.parametrize("assignment", ["static", "group"])
def test_compressed_input_of_every_codec_is_counted_as_replay_counts_it(tmp_path, broker, assignment):
    """Producers in production compress (lz4 and zstd above all): four stock producers, one per
    Kafka codec (gzip, snappy, lz4, zstd), each write a quarter of the events, keyed by user. On
    dd0e14a the worker's reader had only gzip: the first lz4 batch stopped it ("Libraries for lz4
    compression codec not found"). Every event must be counted and the releases equal replay's."""
    from confluent_kafka import Producer

    with running(tmp_path, broker) as sc:
        create_topics(sc.broker, [TopicSpec(sc.input, 4, INPUT_TOPIC_CONFIG)])
        w = sc.ready_worker("one", extra=("--assignment", "group", "--instance-id", "one") if assignment == "group" else ())
        lines = _events(sc, 4_200, lead_s=4)  # a multiple of 3: every user at the bound exactly (_events)
        codecs = ("gzip", "snappy", "lz4", "zstd")
        producers = [Producer({"bootstrap.servers": sc.broker, "compression.type": c, "linger.ms": 50}) for c in codecs]
        for i, line in enumerate(lines):
            producers[i % 4].produce(sc.input, line, key=json.loads(line)["user_id"].encode())
        assert all(p.flush(30) == 0 for p in producers)
        sc.wait_for_window_end()
        expected = sc.replay()
        assert len(expected) >= 8
        sc.assert_published_equal(expected)
        assert w.metric("dpstream_events_in_total", query=sc.query) == len(lines)
        assert not [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == sc.query], "nothing is dead-lettered"


def _placement(broker: str, topic: str, partitions: int, n: int) -> dict[bytes, tuple[int, int]]:
    """Where each of the ``n`` records of ``topic`` landed: value -> (partition, offset)."""
    import time

    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": broker, "group.id": f"placement-{topic}", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    placed, deadline = {}, time.time() + 60
    try:
        while len(placed) < n and time.time() < deadline:
            m = c.poll(1.0)
            if m is not None and m.error() is None:
                placed[m.value()] = (m.partition(), m.offset())
    finally:
        c.close()
    assert len(placed) == n
    return placed


def test_keyless_update_records_from_kafkas_console_producer_on_three_partitions_with_a_unit_bound(tmp_path, broker):
    """A dynamic query with a unit bound (``unit_field: user``, 6 users, 300 updates each at
    most: 1,200 of the 3,000 records are over it) on an update topic of 3 partitions that Kafka's
    own console producer fills with keyless records (they land wherever its sticky partitioner
    likes, so a user's records, even a tick's, are in several partitions). The worker releases exactly what ``dpstream replay`` releases
    from the same records listed in (tick, partition, offset) order - the order the unit step
    bounds in - with nothing dead-lettered and the records over the bound counted as such."""
    import time
    import uuid

    from tests.test_kafka_worker import Scenario, canonical, runs, write_dynamic_config

    tag = uuid.uuid4().hex[:8]
    sc = Scenario(tmp_path, broker)
    name, topic, out = f"tickets{tag}", f"ticket-updates-{tag}", f"it-ticket-counts-{tag}"
    tick_ms, lateness_ms, n = 100, 60_000, 3_000
    # dated from now: the broker stamps them after the JVM has started (seconds, longer on a
    # loaded machine), and they are on time while it does so within the lateness
    t0 = (int(time.time() * 1000) // 1000) * 1000
    write_dynamic_config(sc, name=name, input_topic=topic, output_topic=out, items="[open, pending, solved, closed]",
                         start=t0, tick=f"{tick_ms}ms", allowed_lateness=f"{lateness_ms}ms", epsilon=300.0, shards=2,
                         unit_field="user", contribution_bound=300)
    items, ops = ["open", "pending", "solved", "closed"], ["insert", "insert", "delete"]
    # 400 records a tick: the console producer's batches (its sticky partitioner) spread a tick
    # over several partitions, so the bound's order within a tick matters
    lines = [json.dumps({"item": items[(i * 7) % 4], "op": ops[i % 3], "ts": t0 + i // 4, "user": f"agent-{(i * 5) % 6}",
                         "n": i}, separators=(",", ":")).encode() for i in range(n)]
    create_topics(broker, [TopicSpec(topic, 3, INPUT_TOPIC_CONFIG)])
    _console_produce_keyless(broker, topic, lines)
    placed = _placement(broker, topic, 3, n)
    spread = {}
    for v, (p, _) in placed.items():
        spread.setdefault((json.loads(v)["ts"] - t0) // tick_ms, set()).add(p)
    assert max(map(len, spread.values())) >= 2, "the console producer spread a tick's records over partitions"
    w = sc.worker("console").start()
    try:
        w.wait_ready()
        until = t0 + n // 4 + tick_ms + lateness_ms
        time.sleep(max(0.0, until / 1000 + 3 - time.time()))  # every record's tick is due
        horizon = (n // 4 + tick_ms) // tick_ms
        deadline = time.time() + 120

        def decided() -> int:
            status = json.loads(w.get("/status.json")[1])
            return max((q.get("decided_tick") or 0) for q in status["queries"] if q["name"] == name)

        while decided() < horizon:  # a shard has decided every record's tick
            assert time.time() < deadline, f"ticks up to {horizon} not decided within 120 s"
            time.sleep(1)
        letters = [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == name]
        assert not letters, f"nothing is dead-lettered (late: the console producer took over a minute?): {letters[:3]}"
        order = sorted(lines, key=lambda v: ((json.loads(v)["ts"] - t0) // tick_ms, *placed[v]))
        sc.events.write_bytes(b"\n".join(order) + b"\n")
        [(_, label)] = runs(sc.read(out))
        expected = [r for r in sc.replay(label, until_ms=until) if r["tick"] <= horizon]
        assert len(expected) >= 5 and {r["shard"] for r in expected} == {0, 1}
        deadline = time.time() + 30
        while True:  # and the other shard too
            released = [r for r in sc.read(out) if r["tick"] <= horizon]
            if canonical(released) == canonical(expected) or time.time() > deadline:
                break
            time.sleep(1)
        assert canonical(released) == canonical(expected)
        assert w.metric("dpstream_events_dropped_total", query=name) == w.metric(
            "dpstream_events_dropped_total", query=name, reason="contribution_bound") > 0
    finally:
        w.stop()
