"""Which application an output topic belongs to (docs/operations.md, "Output topics").

Releases are keyed by ``[query, window_start, key]`` on a compacted topic, so that a consumer
(and compaction) keeps the latest value per (query, window, key), across a ``dpstream reset``
too. Two applications writing the same topic would put two unrelated series of values under
the same keys, and nothing in the key tells them apart (issue 32: three values, 169, 317 and
140, for one trigger). So each output topic belongs to one application id, and a worker of any
other application is refused at start, before it writes anything to it.

The claim lives in ``dpstream-epochs`` (one partition, compacted), as the run does
(:mod:`dpstream.processor.adapters.run_identity`): a worker that finds no claim on a topic
appends one under its own key ``@output/<topic>/<app id>/<random>`` and reads the topic back;
the first claim in log order owns the topic, for every reader alike, so of two applications
starting at the same moment exactly one goes on. Each claim has its own key because compaction
keeps a key's *last* record: a claim written again under one key would move behind a rival's.
Claims that lost are tombstoned. ``@`` cannot begin an application id that works (app ids name
topics, which allow ``[a-zA-Z0-9._-]``), so no ``<app id>/...`` key of ``dpstream reset`` is one.

``dpstream reset`` keeps the application's claims (its next run writes to the same topics);
``reset --delete-outputs`` deletes the topics and tombstones their claims
(:mod:`dpstream.processor.adapters.start_over`). A topic with no claim that already holds
releases of another application (written before claims existed) is refused as well: its last
records are read, which is cheap and sees a writer that is still active.
"""
from __future__ import annotations

import json
import secrets
import time
from collections import defaultdict
from typing import Optional

from dpstream.processor.adapters.worker import StateLayoutError
from dpstream.processor.config import DpstreamConfig
from dpstream.topics.kafka import EPOCH_TOPIC, KafkaPublisher, client_security, read_compacted, read_up_to

CLAIM_PREFIX = "@output/"
#: records read from the end of each partition of an unclaimed output topic
TAIL_RECORDS = 20
#: s to read those
TAIL_READ_TIMEOUT_S = 30.0


class OutputClaimError(StateLayoutError):
    """An output topic of the config belongs to another application id (refused at start)."""


def output_topics(config: DpstreamConfig) -> list[str]:
    """The topics the config's queries and dynamic queries release to."""
    return sorted({q.output_topic for q in config.queries} | {q.output_topic for q in config.dynamic})


def claim_key(topic: str, app_id: str, nonce: str) -> str:
    return f"{CLAIM_PREFIX}{topic}/{app_id}/{nonce}"


def claims_by_topic(marks: dict[str, dict]) -> dict[str, list[tuple[str, str]]]:
    """Per output topic, its claims as (key, app id) in log order (``marks``: as
    :func:`dpstream.topics.kafka.read_compacted` returns them, in the order of the keys' first
    records): the first one owns the topic."""
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key, value in marks.items():
        if key.startswith(CLAIM_PREFIX) and isinstance(value, dict) and isinstance(value.get("topic"), str):
            out[value["topic"]].append((key, str(value.get("app_id"))))
    return dict(out)


def claim_outputs(broker: str, app_id: str, config: DpstreamConfig, marks: dict[str, dict]) -> None:
    """Blocking: make sure this application owns every output topic of ``config``, claiming the
    unclaimed ones; raises :class:`OutputClaimError` (having written nothing that stays) when
    another application owns one or, unclaimed, holds releases of another application."""
    held = claims_by_topic(marks)
    unclaimed = []
    for topic in output_topics(config):
        if topic in held:
            key, owner = held[topic][0]
            if owner != app_id:
                raise OutputClaimError(claimed_message(topic, owner, key, app_id))
            continue
        others = other_writers(broker, topic, app_id)
        if others:
            raise OutputClaimError(unclaimed_message(topic, others, app_id))
        unclaimed.append(topic)
    if unclaimed:
        _claim(broker, app_id, unclaimed)


def _claim(broker: str, app_id: str, topics: list[str]) -> None:
    """Append a claim per topic, read the claims back: the first in log order owns each topic.
    Lost claims, and this start's won ones if any is lost, are tombstoned."""
    mine = {topic: claim_key(topic, app_id, secrets.token_hex(8)) for topic in topics}
    publisher = KafkaPublisher(broker)
    for topic, key in mine.items():
        value = {"topic": topic, "app_id": app_id, "since_ms": int(time.time() * 1000)}
        publisher.produce(EPOCH_TOPIC, json.dumps(value, sort_keys=True).encode(), key.encode())
    publisher.flush()
    held = claims_by_topic(read_compacted(broker, EPOCH_TOPIC, CLAIM_PREFIX))
    lost = []
    for topic, key in mine.items():
        if key not in (k for k, _ in held.get(topic, [])):  # our own claim is below the end the read went to
            raise RuntimeError(f"{EPOCH_TOPIC}: the claim of output topic {topic} by application {app_id!r} was not read back")
        first_key, owner = held[topic][0]
        if first_key != key:
            if owner != app_id:
                lost.append((topic, owner, first_key))
            publisher.produce(EPOCH_TOPIC, None, key.encode())  # another worker of this application came first
    if lost:
        for topic, key in mine.items():
            if held[topic][0][0] == key:
                publisher.produce(EPOCH_TOPIC, None, key.encode())
    publisher.flush()
    if lost:
        raise OutputClaimError(claimed_message(*lost[0], app_id))


#: seconds to wait for the leaders of a topic another worker created a moment ago
NEW_TOPIC_LEADER_WAIT_S = 30.0


def once_leaders_are_elected(ask):
    """``ask()`` (an offsets query), asked again while the topic's partitions have no leader yet:
    workers of a new application started together see the output topic one of them has just
    created before its leaders are elected, and librdkafka then raises NOT_LEADER_FOR_PARTITION
    (or LEADER_NOT_AVAILABLE, UNKNOWN_TOPIC_OR_PART) instead of waiting. Other errors, and these
    after NEW_TOPIC_LEADER_WAIT_S, are raised."""
    from confluent_kafka import KafkaError, KafkaException

    not_yet = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART}
    deadline = time.monotonic() + NEW_TOPIC_LEADER_WAIT_S
    while True:
        try:
            return ask()
        except KafkaException as exc:
            if exc.args[0].code() not in not_yet or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def other_writers(broker: str, topic: str, app_id: str, per_partition: int = TAIL_RECORDS) -> list[str]:
    """The application ids other than ``app_id`` among the releases in the last ``per_partition``
    records of each partition of ``topic`` (none for a topic that does not exist yet)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-output-claims", "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted", "enable.partition.eof": True, **client_security()})
    try:
        meta = consumer.list_topics(timeout=15).topics.get(topic)  # not by name: that could create it
        if meta is None or meta.error is not None:
            return []
        starts, ends = [], {}
        for p in sorted(meta.partitions):
            low, high = once_leaders_are_elected(lambda: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=15))
            if high > low:
                starts.append(TopicPartition(topic, p, max(low, high - per_partition)))
                ends[p] = high
        if not starts:
            return []
        consumer.assign(starts)
        found: set[str] = set()
        for msg in read_up_to(consumer, topic, ends, TAIL_READ_TIMEOUT_S, f"the last records of output topic {topic}"):
            writer = release_app_id(msg.value())
            if writer is not None and writer != app_id:
                found.add(writer)
        return sorted(found)
    finally:
        consumer.close()


def release_app_id(value: Optional[bytes]) -> Optional[str]:
    """The ``app_id`` of a record that is a worker's release, else None (a tombstone, replay's
    releases, which carry none, another producer's record)."""
    try:
        record = json.loads(value) if value is not None else None
    except ValueError:
        return None
    if isinstance(record, dict) and isinstance(record.get("app_id"), str) and isinstance(record.get("run"), dict):
        return record["app_id"]
    return None


def _ways_on(other: str) -> str:
    return (f"give this application's queries an output topic of their own (output_topic in the config), or, if application "
            f"{other!r} is done, delete its outputs: `dpstream reset --config ITS_CONFIG --app-id {other} --state-dir ITS_DIR "
            f"--broker BROKER --delete-outputs --yes`. See docs/operations.md, \"Output topics\"")


def claimed_message(topic: str, owner: str, key: str, app_id: str) -> str:
    """The refusal of an output topic another application owns."""
    return (f"output topic {topic} belongs to application {owner!r} ({EPOCH_TOPIC}, key {key}), not to {app_id!r}: two "
            f"applications' releases under the same keys [query, window_start, key] could not be told apart by a consumer "
            f"or by compaction. To go on, {_ways_on(owner)}")


def unclaimed_message(topic: str, others: list[str], app_id: str) -> str:
    """The refusal of an unclaimed output topic that holds another application's releases."""
    names = ", ".join(repr(o) for o in others)
    return (f"output topic {topic} holds releases of application {names} (written before output topics were claimed), "
            f"and application {app_id!r} may not write beside them: a consumer could not tell the two apart. To go on, "
            f"{_ways_on(others[0])}")
