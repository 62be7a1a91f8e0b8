"""``dpstream produce`` and ``dpstream tail``: feed the input topic, read the releases topic.

Input records are keyed by the query's user field, the contract stage 1 relies on (a record
whose key is not its user id is dead-lettered). The producer uses librdkafka's
``murmur2_random`` partitioner, the one Java clients use by default, so records of one user land
in one partition whichever of these clients wrote them.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Iterator, Optional, TextIO

from dpstream.topics.records import MAX_FIELD_CHARS

PRODUCER_DEFAULTS = {"partitioner": "murmur2_random", "linger.ms": 20, "batch.num.messages": 10_000,
                     "queue.buffering.max.messages": 1_000_000, "acks": "all"}


def _user_key(raw: bytes, user_field: str) -> Optional[bytes]:
    """The record's user id as its message key (None for records that are not JSON objects:
    they are still sent, and the worker dead-letters them)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    user = obj.get(user_field)
    if isinstance(user, bool) or user is None:
        return None
    if isinstance(user, float) and user.is_integer():
        user = int(user)
    text = str(user)
    return text.encode()[: MAX_FIELD_CHARS * 4] if text else None


def file_lines(path: str) -> Iterator[bytes]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        for line in fh:
            line = line.rstrip(b"\r\n")
            if line:
                yield line


def synthetic_lines(users: int, keys: int, seed: int, start_ms: int, window_ms: int) -> Iterator[bytes]:
    """The DP-SQLP workload's shape (dpstream.processor.synthetic) as JSON events in time order."""
    from dpstream.processor.synthetic import KEYS_Q, generate

    stream = generate(users, keys, seed, window_ms=window_ms, start_ms=start_ms, key_q=KEYS_Q * keys / 1_000_000)
    for u, k, t in zip(stream.users.tolist(), stream.keys.tolist(), stream.ts.tolist()):
        yield f'{{"user_id":"user-{u}","key":"page-{k}","ts":{t}}}'.encode()


def produce(broker: str, topic: str, lines: Iterator[bytes], user_field: str = "user_id", client_config: Optional[dict] = None) -> int:
    from confluent_kafka import Producer

    from dpstream.topics.kafka import DeliveryError

    errors: list[str] = []

    def on_delivery(err, msg):
        if err is not None:
            errors.append(str(err))

    from dpstream.topics.kafka import client_security

    producer = Producer({"bootstrap.servers": broker, **PRODUCER_DEFAULTS, **client_security(), **(client_config or {})})
    sent = 0
    for raw in lines:
        while True:
            try:
                producer.produce(topic, raw, _user_key(raw, user_field), on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
        sent += 1
        if sent % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(120)
    if left or errors:
        raise DeliveryError(f"{left} records not acknowledged; errors: {errors[:5]}")
    return sent


def tail(broker: str, topic: str, out: TextIO = sys.stdout, idle_seconds: Optional[float] = None, max_records: Optional[int] = None,
         from_beginning: bool = True) -> int:
    """Print release records (one JSON object per line) as they arrive. Stops after
    ``idle_seconds`` without a record, or after ``max_records``; otherwise runs until interrupted."""
    from confluent_kafka import (
        OFFSET_BEGINNING,
        OFFSET_END,
        Consumer,
        KafkaError,
        TopicPartition,
    )

    from dpstream.topics.kafka import client_security

    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-tail", "enable.auto.commit": False, **client_security()})
    meta = consumer.list_topics(topic, timeout=15).topics.get(topic)
    if meta is None or meta.error is not None:
        consumer.close()
        raise RuntimeError(f"tail: topic {topic!r} not found on {broker}")
    # assigned, not subscribed: a reader needs every partition and no group membership
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(topic, p, start) for p in sorted(meta.partitions)])
    seen, last = 0, time.monotonic()
    try:
        while max_records is None or seen < max_records:
            msgs = consumer.consume(1000, 0.2)
            for msg in msgs:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"tail: {msg.error()}")
                    continue
                out.write(msg.value().decode() + "\n")
                seen += 1
            if msgs:
                out.flush()
                last = time.monotonic()
            elif idle_seconds is not None and time.monotonic() - last > idle_seconds:
                break
    finally:
        consumer.close()
    return seen

