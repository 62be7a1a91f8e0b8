"""``dpstream check-input``: what a sample of an input topic says about its producers, before a
worker reads it (docs/operator-guide.md, "Writing to the input topic").

It reads the last records of every partition (at most ``sample`` in all) and reports, as counts
and shares only (never a record's content, key or user id):

* **keying**: records without a message key, keyed by the user field, keyed by something else;
* **partitioning**: for each partitioner the worker knows (topics/partitioner.py), the share of
  keyed records that sit on the partition it maps their key to, the partitioner the producers
  most likely use, and the share of records the worker, with ``--partitioner``, would not find
  on their user's partition: those take the rerouted path (the query's by-user topic);
* **timestamps**: the topic's ``message.timestamp.type`` and the records' own types;
* **format**: JSON objects, the Confluent schema-registry wire format (magic byte 0 and a
  schema id), or neither.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from dpstream.topics.partitioner import PARTITIONERS, partition_for

#: what each partitioner is the default of (topics/partitioner.py)
PARTITIONER_USERS = {
    "murmur2": "the Java client, Kafka Streams and Connect, aiokafka, Faust, `dpstream produce`",
    "consistent": "every librdkafka client by default (confluent-kafka for Python, Go, .NET; rust-rdkafka)",
    "fnv1a": "Sarama (Go) by default, librdkafka's fnv1a",
}


@dataclass
class SampledRecord:
    partition: int
    key: Optional[bytes]
    value: Optional[bytes]
    timestamp_type: str  # CreateTime, LogAppendTime or none


@dataclass
class InputReport:
    topic: str
    partitions: int
    user_field: str
    partitioner: str
    records: int = 0
    unkeyed: int = 0
    keyed_by_user: int = 0
    keyed_otherwise: int = 0
    #: per partitioner: keyed records on the partition it maps their key to
    in_place: dict = field(default_factory=dict)
    #: records not on the partition ``partitioner`` maps their user field to: the worker sends them
    #: there through the query's by-user topic (docs/operator-guide.md, "Writing to the input topic")
    misplaced: int = 0
    #: records without a user field the worker can read (dead-lettered as malformed)
    no_user: int = 0
    formats: Counter = field(default_factory=Counter)
    schema_ids: set = field(default_factory=set)
    record_timestamps: Counter = field(default_factory=Counter)
    topic_timestamp_type: Optional[str] = None

    def likely_partitioner(self) -> Optional[str]:
        keyed = self.keyed_by_user + self.keyed_otherwise
        if not keyed or self.partitions == 1:
            return None
        best = max(PARTITIONERS, key=lambda p: self.in_place.get(p, 0))
        return best if self.in_place.get(best, 0) == keyed else None

    def as_dict(self) -> dict:
        return {"topic": self.topic, "partitions": self.partitions, "records": self.records,
                "keying": {"none": self.unkeyed, "user_field": self.keyed_by_user, "other": self.keyed_otherwise},
                "keyed_in_place": dict(self.in_place), "likely_partitioner": self.likely_partitioner(),
                "partitioner": self.partitioner, "not_on_their_users_partition": self.misplaced, "without_user_field": self.no_user,
                "formats": dict(self.formats), "schema_ids": sorted(self.schema_ids),
                "timestamp_type": {"topic": self.topic_timestamp_type, "records": dict(self.record_timestamps)}}

    def lines(self) -> list[str]:
        n = max(self.records, 1)

        def share(k: int) -> str:
            return f"{k:,} ({100 * k / n:.1f}%)"

        out = [f"check-input: topic {self.topic}, {self.partitions} partitions, {self.records:,} records sampled "
               f"(the last ones of each partition)"]
        if not self.records:
            out.append("  the topic holds no records yet")
            return out
        out.append(f"  keying: {share(self.keyed_by_user)} keyed by the {self.user_field!r} field, {share(self.keyed_otherwise)} "
                   f"keyed by something else, {share(self.unkeyed)} without a key")
        keyed = self.keyed_by_user + self.keyed_otherwise
        if keyed and self.partitions > 1:
            matches = ", ".join(f"{p} {self.in_place.get(p, 0):,}/{keyed:,}" for p in PARTITIONERS)
            likely = self.likely_partitioner()
            guess = (f"the producers partition keys with {likely} ({PARTITIONER_USERS[likely]})" if likely
                     else "no one partitioner places every keyed record (several producers, or keys ignored)")
            out.append(f"  partitioning: keyed records on their key's partition by partitioner: {matches}: {guess}")
        out.append(f"  with --partitioner {self.partitioner}: {share(self.misplaced)} are not on the partition of their "
                   f"{self.user_field!r}: the worker sends them there through its by-user topic (each is counted, at the cost "
                   f"of a second trip through Kafka); the others are bounded where they are")
        if self.no_user:
            out.append(f"  {share(self.no_user)} have no {self.user_field!r} the worker can read: dead-lettered as malformed")
        likely = self.likely_partitioner()
        if self.misplaced and likely and likely != self.partitioner and self.keyed_otherwise == 0:
            rest = (f"; the {self.unkeyed:,} without a key have no partition of their own (every client spreads them)"
                    if self.unkeyed else "")
            out.append(f"  hint: start the worker with --partitioner {likely}: every keyed record sampled is then in place, "
                       f"with no second trip{rest}")
        ts = ", ".join(f"{k} {v:,}" for k, v in sorted(self.record_timestamps.items()))
        out.append(f"  timestamps: topic message.timestamp.type {self.topic_timestamp_type or 'unknown'}; records: {ts}")
        fmt = ", ".join(f"{k} {share(v)}" for k, v in self.formats.most_common())
        ids = f" (schema ids {', '.join(map(str, sorted(self.schema_ids)[:10]))})" if self.schema_ids else ""
        out.append(f"  format: {fmt}{ids}")
        return out


def detect_format(value: Optional[bytes]) -> tuple[str, Optional[int]]:
    """``json`` (an object), ``schema-registry`` (the Confluent wire format: magic byte 0 and a
    4-byte schema id; Avro, Protobuf or JSON Schema), ``json-not-object``, ``empty`` or
    ``unknown``; and the schema id when there is one."""
    if not value:
        return "empty", None
    if value[0] == 0 and len(value) >= 5:
        return "schema-registry", int.from_bytes(value[1:5], "big")
    try:
        obj = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return "unknown", None
    return ("json", None) if isinstance(obj, dict) else ("json-not-object", None)


def user_of(value: Optional[bytes], user_field: str) -> Optional[bytes]:
    """The user field of a JSON object record as the message key bytes ``dpstream produce``
    would give it (a dotted path reaches into nested objects: topics/records.py field_reader);
    None when there is none."""
    from dpstream.processor.adapters.kafka_tools import user_key

    try:
        obj = json.loads(value) if value else None
    except (ValueError, UnicodeDecodeError):
        return None
    return user_key(obj, user_field)


def analyse(topic: str, partitions: int, records: list[SampledRecord], user_field: str, partitioner: str,
            topic_timestamp_type: Optional[str] = None) -> InputReport:
    """The report of a sample (pure: no I/O)."""
    report = InputReport(topic, partitions, user_field, partitioner, records=len(records),
                         topic_timestamp_type=topic_timestamp_type)
    keyed = [r for r in records if r.key is not None]
    for name in PARTITIONERS:
        where = partition_for([r.key for r in keyed], partitions, name) if keyed else []
        report.in_place[name] = sum(int(p == r.partition) for p, r in zip(where, keyed))
    users = [user_of(r.value, user_field) for r in records]
    with_user = [(r, u) for r, u in zip(records, users) if u is not None]
    home = partition_for([u for _, u in with_user], partitions, partitioner) if with_user else []
    report.misplaced = sum(int(p != r.partition) for p, (r, _) in zip(home, with_user))
    report.no_user = len(records) - len(with_user)
    for r, u in zip(records, users):
        if r.key is None:
            report.unkeyed += 1
        elif u is not None and r.key == u:
            report.keyed_by_user += 1
        else:
            report.keyed_otherwise += 1
        fmt, schema_id = detect_format(r.value)
        report.formats[fmt] += 1
        if schema_id is not None:
            report.schema_ids.add(schema_id)
        report.record_timestamps[r.timestamp_type] += 1
    return report


def sample_shares(sizes: dict[int, int], sample: int) -> dict[int, int]:
    """How many of its last records to read from each partition: all of a topic that holds at
    most ``sample``, else ``sample`` split as evenly as the partitions allow (a small partition
    gives its share to the others), so that uneven partitioning does not cut the sample short."""
    shares = {p: 0 for p in sizes}
    left, open_ = sample, sorted((p for p in sizes if sizes[p] > 0), key=lambda p: sizes[p])
    while open_ and left > 0:
        even = max(1, left // len(open_))
        p = open_.pop(0)
        shares[p] = min(sizes[p], even, left)
        left -= shares[p]
    return shares


def sample_topic(broker: str, topic: str, sample: int, timeout: float) -> tuple[int, list[SampledRecord]]:
    """The partition count and the last records of each partition (``sample`` in all at most),
    read with ``read_committed``."""
    import time

    from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, Consumer, TopicPartition

    from dpstream.processor.adapters.kafka_tools import RDKAFKA_LOG, KafkaToolError
    from dpstream.topics.kafka import client_security

    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-check-input", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "logger": RDKAFKA_LOG, **client_security()})
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaToolError(f"check-input: no topic {topic} on {broker}", 2)
        partitions = len(meta.partitions)
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout) for p in range(partitions)}
        shares = sample_shares({p: high - low for p, (low, high) in marks.items()}, sample)
        assign, ends = [], {}
        for p, take in shares.items():
            if take > 0:
                assign.append(TopicPartition(topic, p, marks[p][1] - take))
                ends[p] = marks[p][1]
        out: list[SampledRecord] = []
        if assign:
            consumer.assign(assign)
            kinds = {TIMESTAMP_CREATE_TIME: "CreateTime", TIMESTAMP_LOG_APPEND_TIME: "LogAppendTime"}
            deadline = time.monotonic() + timeout
            while ends and time.monotonic() < deadline:
                for msg in consumer.consume(500, 0.5):
                    if msg.error() is not None:
                        continue
                    p = msg.partition()
                    if p in ends:
                        out.append(SampledRecord(p, msg.key(), msg.value(), kinds.get(msg.timestamp()[0], "none")))
                        if msg.offset() + 1 >= ends[p]:
                            del ends[p]
                if ends:  # a partition whose end is a transaction marker has no record at high - 1
                    for tp in consumer.position([TopicPartition(topic, p) for p in list(ends)]):
                        if tp.offset >= ends.get(tp.partition, 0):
                            ends.pop(tp.partition, None)
        return partitions, out
    finally:
        consumer.close()
