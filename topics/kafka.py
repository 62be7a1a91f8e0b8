"""Declarations of every Kafka topic the service uses (docs/operations.md, "Topics and records").

Per query: the input events topic (partitioned by user by the producer or repartitioned by stage
1), the stage-1 -> stage-2 repartition topic keyed by the group-by key, the output releases topic
(compacted, keyed by (query, window, key) so the latest release per key is kept), and one
dead-letter topic. The dynamic-updates topic is declared for the fully dynamic agent.

Creation goes through confluent-kafka's AdminClient; existing topics are left as they are.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from dpstream.topics.client_properties import (  # noqa: F401 - re-exported: the one door of every client's settings
    SECRET_SETTINGS,
    SECURITY_ENV,
    KafkaSettingError,
    client_security,
    setting_name,
)

DEAD_LETTER_TOPIC = "dpstream-dead-letters"
#: The dead-letter topic holds raw input records, user ids included (docs/threat-model.md), so it
#: is created with a retention: ``$DPSTREAM_DEAD_LETTER_RETENTION`` (a duration: '7d', '36h'),
#: default 7 days. Kafka deletes whole segments only, and only closed ones: the segments roll
#: every day (or every retention, if shorter), so a record is gone at most a segment's time plus
#: the broker's retention check (log.retention.check.interval.ms, 5 min) after its retention
#: (docs/operations.md, "Topics and records"). An existing topic keeps its settings.
DEAD_LETTER_RETENTION_ENV = "DPSTREAM_DEAD_LETTER_RETENTION"
DEAD_LETTER_RETENTION_DEFAULT = "7d"
_DAY_MS = 86_400_000
DYNAMIC_UPDATES_TOPIC = "dpstream-dynamic-updates"
#: Which budget epoch and noise secret each worker's state belongs to, kept outside the worker's
#: volume so that a lost volume is noticed (docs/privacy.md, "Failures"): compacted, keyed by
#: ``<app id>/<worker index>``, value ``{"budget_epoch", "noise", "since_ms"}``.
EPOCH_TOPIC = "dpstream-epochs"
#: What each worker has delivered, written in the same Kafka transaction as the outputs it covers
#: (``--delivery exactly-once``; docs/operations.md, "Delivery"): compacted, keyed by
#: ``<app id>/<source topic-partition>`` (value ``{"offset"}``: the outputs of every input record
#: up to it are on Kafka), ``<app id>/<source topic-partition>/published`` (value
#: ``{"window", "trigger"}``: the releases of every trigger up to it are on Kafka) and
#: ``<app id>/<update topic-partition>/published/<dynamic query>`` (value ``{"segment"}``: the last
#: release's number, which is its segment with one shard).
PROGRESS_TOPIC = "dpstream-progress"


#: Elastic workers (``--assignment group``; docs/operations.md, "Elastic workers"): each source
#: topic's stores have a compacted changelog topic with as many partitions, partition p holding
#: every change of the store of source partition p, written in the same transaction as the
#: outputs those changes go with. Values up to this size (a commit's blob of user states can be
#: tens of MB; producer and topic allow it).
CHANGELOG_MAX_BYTES = 64 * 1024 * 1024
CHANGELOG_TOPIC_CONFIG = {"cleanup.policy": "compact", "max.message.bytes": str(CHANGELOG_MAX_BYTES + 1024)}


def changelog_topic(app_id: str, epoch: str, source_topic: str) -> str:
    """The changelog of the stores of ``source_topic``'s partitions, for one application and
    budget epoch (a new epoch starts from new changelogs)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{app_id}-{epoch}")
    return f"{safe}-{source_topic}-changelog"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict = field(default_factory=dict)
    role: str = ""


#: Input topics the worker creates are stamped by the broker (LogAppendTime). A record's Kafka
#: timestamp decides whether it is late; the broker's stamps rise with the offsets, so they also
#: tell how far a partition has been read, and a backlog's triggers fire as it is read. A
#: producer's stamps (CreateTime) never move a watermark: such a partition's watermark moves only
#: when it has been read to its end (dpstream.processor.adapters.worker.broker_stamped_max; docs/privacy.md, "Time").
INPUT_TOPIC_CONFIG = {"message.timestamp.type": "LogAppendTime"}


def repartition_topic(query_name: str, app_id: str = "dpstream", epoch: str = "1") -> str:
    """Stage 1 -> stage 2 of one query, for one application and epoch: a new application id, a
    new ``budget.epoch`` or a ``dpstream reset`` reads its input from the start into a fresh
    state, and must never also read another run's bounded records, which would count a user's
    records twice (docs/privacy.md, "Failures"). The default application's first epoch keeps
    the name it always had, ``dpstream-<query>-by-key``."""
    prefix = app_id if epoch == "1" else f"{app_id}-{epoch}"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in prefix)
    return f"{safe}-{query_name}-by-key"


def rerouting_topic(query_name: str, app_id: str = "dpstream", epoch: str = "1") -> str:
    """Stage 1 -> stage 1 of one query: events read on an input partition that does not own
    their user, on their way to the one that does (docs/operations.md, "Writing to the input
    topic"). As many partitions as the query's input topic; partition p is read with input
    partition p, into the same state. Named per application and epoch like
    :func:`repartition_topic`: ``<app id>-<query>-by-user``."""
    return repartition_topic(query_name, app_id, epoch)[:-len("-by-key")] + "-by-user"


def item_topic(query_name: str, app_id: str = "dpstream", epoch: str = "1") -> str:
    """A dynamic query's updates on their way from the partitions of an update topic of several
    to the shard of their item: one partition per shard (``shards``), partition k read into
    shard k's state (docs/user-guide.md, "Partitions"). Named per application and epoch like
    :func:`repartition_topic`: ``<app id>-<query>-by-item``."""
    return repartition_topic(query_name, app_id, epoch)[:-len("-by-key")] + "-by-item"


def unit_topic(query_name: str, app_id: str = "dpstream", epoch: str = "1") -> str:
    """A dynamic query's updates with a unit bound on their way from the partitions of an update
    topic of several to the unit step of their unit (keyed pseudonyms, never ids): one partition
    per shard, partition j read into unit step j's state (docs/user-guide.md, "Partitions").
    Named per application and epoch like :func:`repartition_topic`: ``<app id>-<query>-by-unit``."""
    return repartition_topic(query_name, app_id, epoch)[:-len("-by-key")] + "-by-unit"


def dead_letter_retention_ms(environ: Optional[Mapping[str, str]] = None) -> int:
    """How long the dead-letter topic keeps a record, from ``$DPSTREAM_DEAD_LETTER_RETENTION``
    (default 7 days); a bad value is an error naming the variable."""
    from dpstream.processor.config import ConfigError, parse_duration_ms

    text = (os.environ if environ is None else environ).get(DEAD_LETTER_RETENTION_ENV) or DEAD_LETTER_RETENTION_DEFAULT
    try:
        return parse_duration_ms(text.strip())
    except ValueError as exc:
        raise ConfigError(f"{DEAD_LETTER_RETENTION_ENV}: {exc} (how long the dead-letter topic keeps raw input, "
                          f"e.g. 7d)") from None


def dead_letter_topic_config(environ: Optional[Mapping[str, str]] = None) -> dict:
    """The dead-letter topic's config: deleted after its retention, in segments of at most a day."""
    retention = dead_letter_retention_ms(environ)
    return {"cleanup.policy": "delete", "retention.ms": str(retention), "segment.ms": str(min(retention, _DAY_MS))}


def topics_for(queries: Iterable, partitions: int = 8, dynamic: Iterable = (), app_id: str = "dpstream",
               epoch: str = "1") -> list[TopicSpec]:
    """Every topic the queries need, deduplicated by name (queries may share input/output).
    A dynamic query's update topic is created with one partition when missing; one of several
    (yours, or Debezium's) is routed to the query's shards through its by-item topic, which the
    worker creates once it knows (processor/adapters/worker_startup.py)."""
    specs: dict[str, TopicSpec] = {}

    def add(spec: TopicSpec) -> None:
        specs.setdefault(spec.name, spec)

    for q in queries:
        add(TopicSpec(q.input_topic, partitions, INPUT_TOPIC_CONFIG, "input events"))
        add(TopicSpec(repartition_topic(q.name, app_id, epoch), partitions, {"cleanup.policy": "delete"}, "stage 1 -> stage 2, keyed by group-by key"))
        add(TopicSpec(q.output_topic, partitions, {"cleanup.policy": "compact"}, "releases, keyed by (query, window, key)"))
    for q in dynamic:
        add(TopicSpec(q.input_topic, 1, INPUT_TOPIC_CONFIG, "insert/delete updates for the dynamic agent (one partition)"))
        add(TopicSpec(q.output_topic, 1, {"cleanup.policy": "compact"}, "dynamic counts, keyed by query"))
    add(TopicSpec(DEAD_LETTER_TOPIC, 1, dead_letter_topic_config(), "invalid records with reason and original bytes"))
    add(TopicSpec(DYNAMIC_UPDATES_TOPIC, 1, INPUT_TOPIC_CONFIG, "insert/delete updates for the dynamic agent (one partition)"))
    add(TopicSpec(EPOCH_TOPIC, 1, {"cleanup.policy": "compact"}, "each worker's budget epoch and noise fingerprint (lost-volume check)"))
    add(TopicSpec(PROGRESS_TOPIC, 1, {"cleanup.policy": "compact"}, "what each source partition's outputs have delivered (exactly-once)"))
    return list(specs.values())


def read_up_to(consumer, topic: str, ends: dict, timeout_s: float, what: str):
    """The records of ``topic`` a consumer already assigned to its partitions (and created with
    ``enable.partition.eof``) fetches, each partition up to its end offset in ``ends`` (partition
    -> offset, taken when the read began: records appended meanwhile are not waited for). Raises
    RuntimeError, saying it could not read ``what``, after ``timeout_s``."""
    from confluent_kafka import KafkaError

    todo, deadline = set(ends), time.monotonic() + timeout_s
    while todo:
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not read {what} within {timeout_s:g} s")
        for msg in consumer.consume(1000, 0.5):
            if msg.error() is not None:
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading {topic}: {msg.error()}")
                todo.discard(msg.partition())
                continue
            end = ends[msg.partition()]
            if msg.offset() >= end - 1:
                todo.discard(msg.partition())
            if msg.offset() < end:
                yield msg


def read_compacted(bootstrap: str, topic: str, prefix: str = "", timeout: float = 30.0) -> dict[str, dict]:
    """The latest JSON value per key (keys starting with ``prefix``) of a small compacted
    one-partition topic, read with ``read_committed`` (a transaction's records count once it
    committed; an aborted one's never) up to the end offset it had when the read began: other
    writers' transactions keep it growing, and an open one holds back what can be read (so no
    end-of-partition event may come), but every record the caller wrote before is below that
    offset. Raises if it cannot be reached: a worker must not decide what it has done without
    knowing it."""
    import json
    import time

    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    no_leader_yet = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART)
    common = {"bootstrap.servers": bootstrap, "group.id": f"dpstream-read-{topic}", "enable.auto.commit": False, **client_security()}
    # the log's end (high watermark): a read_committed consumer would be told the last stable
    # offset, which another writer's open transaction can hold before records the caller wrote
    ends = Consumer({**common, "isolation.level": "read_uncommitted"})
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                low, high = ends.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout)
                break
            except KafkaException as exc:  # a topic created a moment ago may have no leader yet
                waiting = exc.args[0].retriable() or exc.args[0].code() in no_leader_yet
                if not waiting or time.monotonic() > deadline:
                    raise kafka_error(f"reading the end offset of topic {topic}", exc) from None
                time.sleep(0.2)
    finally:
        ends.close()
    consumer = Consumer({**common, "auto.offset.reset": "earliest", "isolation.level": "read_committed", "enable.partition.eof": True})
    try:
        values: dict[str, dict] = {}
        if high <= low:
            return values
        consumer.assign([TopicPartition(topic, 0, low)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error():
                # the end of what can be read now is the last stable offset, which an open
                # transaction holds back: not necessarily past ``high``, so read on
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    raise KafkaOperationError(f"reading topic {topic}: {msg.error().name()}: {msg.error().str()}")
                msg = None
            if msg is not None:
                if msg.offset() >= high:
                    return values
                key = msg.key().decode() if msg.key() is not None else None
                if key is not None and key.startswith(prefix):
                    if msg.value() is None:
                        values.pop(key, None)
                    else:
                        values[key] = json.loads(msg.value())
            if consumer.position([TopicPartition(topic, 0)])[0].offset >= high:  # past aborted records and markers too
                return values
        raise KafkaOperationError(f"reading topic {topic}: could not read it to its end offset {high} within {timeout:g} s")
    finally:
        consumer.close()


def changelog_ends_client(bootstrap: str):
    """A client for :func:`read_changelog`'s end offsets, to share over the partitions of one
    restore (a client per partition cost a connection and a metadata round trip each)."""
    from confluent_kafka import Consumer

    return Consumer({**_changelog_common(bootstrap, "ends"), "isolation.level": "read_uncommitted"})


def _changelog_common(bootstrap: str, topic: str) -> dict:
    return {"bootstrap.servers": bootstrap, "group.id": f"dpstream-restore-{topic}", "enable.auto.commit": False,
            "fetch.max.bytes": CHANGELOG_MAX_BYTES + 1024 * 1024, "receive.message.max.bytes": 2 * CHANGELOG_MAX_BYTES,
            **client_security()}


def read_changelog(bootstrap: str, topic: str, partition: int, start: int, timeout: float = 120.0,
                   batch: int = 10_000, ends=None) -> tuple[int, Iterable[list[tuple[int, bytes, bytes | None]]]]:
    """The end offset of a changelog partition, and its committed records from offset ``start``
    to that end, in batches of ``(offset, key, value)`` (value None: a tombstone).

    ``read_committed``: an aborted transaction's records (a fenced owner's) are never restored.
    A transaction still open below the end (the partition's previous owner, still finishing)
    holds the read until it commits or aborts; after ``timeout`` s this raises, and nothing
    is processed with a partial state."""

    from confluent_kafka import TopicPartition

    common = _changelog_common(bootstrap, topic)
    client = ends if ends is not None else changelog_ends_client(bootstrap)
    try:
        low, high = client.get_watermark_offsets(TopicPartition(topic, partition), timeout=min(timeout, 30), cached=False)
    finally:
        if ends is None:
            client.close()
    return high, _read_changelog(common, topic, partition, max(start, low), high, timeout, batch)


def _read_changelog(common: dict, topic: str, partition: int, start: int, high: int, timeout: float, batch: int):
    import time

    from confluent_kafka import Consumer, KafkaError, TopicPartition

    if start >= high:
        return
    consumer = Consumer({**common, "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    try:
        tp = TopicPartition(topic, partition, start)
        consumer.assign([tp])
        deadline = time.monotonic() + timeout
        while True:
            msgs = consumer.consume(batch, 0.1)
            out = []
            for m in msgs:
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(f"restoring from {topic}-{partition}: {m.error()}")
                if m.offset() < high:
                    out.append((m.offset(), m.key(), m.value()))
            if out:
                yield out
                deadline = time.monotonic() + timeout
            if consumer.position([TopicPartition(topic, partition)])[0].offset >= high:  # past markers too
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not read the changelog {topic}-{partition} to its end offset {high} within "
                                   f"{timeout:g} s (a transaction open below it?)")
    finally:
        consumer.close()


def read_epoch_marks(bootstrap: str, timeout: float = 30.0) -> dict[str, dict]:
    """The latest epoch mark per worker (``<app id>/<index>`` -> mark) in :data:`EPOCH_TOPIC`."""
    return read_compacted(bootstrap, EPOCH_TOPIC, timeout=timeout)


#: how long a worker waits to read the progress topic to its end: a previous incarnation's open
#: transaction (one cut off by a broker outage) holds it back until the coordinator aborts it,
#: at the latest after the producers' transaction timeout (librdkafka's default, 60 s)
PROGRESS_READ_TIMEOUT_S = 75.0


def read_progress(bootstrap: str, app_id: str, timeout: float = PROGRESS_READ_TIMEOUT_S) -> dict[str, dict]:
    """What the application's workers have delivered (:data:`PROGRESS_TOPIC`), by key without
    the ``<app id>/`` prefix."""
    prefix = f"{app_id}/"
    return {k[len(prefix):]: v for k, v in read_compacted(bootstrap, PROGRESS_TOPIC, prefix, timeout).items()}


def restarts_key(app_id: str) -> str:
    """The :data:`EPOCH_TOPIC` key counting ``dpstream reset``'s start-overs of an application
    (docs/operator-guide.md, "Start over"): ``{"count": N}``; the workers' noise label and
    changelogs follow it."""
    return f"{app_id}/restarts"


def write_epoch_mark(bootstrap: str, worker: str, mark: dict) -> None:
    """Record (acknowledged) the epoch mark of ``<app id>/<index>``."""
    import json

    publisher = KafkaPublisher(bootstrap)
    publisher.produce(EPOCH_TOPIC, json.dumps(mark, sort_keys=True).encode(), worker.encode())
    publisher.flush()


def timestamp_types(bootstrap: str, topics: Iterable[str], timeout: float = 15.0) -> dict[str, str]:
    """Each topic's ``message.timestamp.type`` (``CreateTime`` or ``LogAppendTime``), from
    DescribeConfigs; topics the broker does not describe are left out."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap, **client_security()})  # kept alive until the futures resolve
    out = {}
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in sorted(set(topics))], request_timeout=timeout)
    for resource, future in futures.items():
        try:
            entry = future.result(timeout).get("message.timestamp.type")
        except Exception as exc:  # noqa: BLE001 - a broker without DescribeConfigs (e.g. Tansu): unknown
            err = exc.args[0] if exc.args else None
            if getattr(err, "code", None) is not None and err.code() not in _UNSUPPORTED:
                # the input's timestamp type decides lateness (docs/privacy.md, "Time"): never skipped on a passing error
                raise kafka_error(f"describing the configuration of topic {resource.name}", exc) from None
            continue
        if entry is not None:
            out[resource.name] = entry.value
    return out


class KafkaOperationError(RuntimeError):
    """A request to Kafka failed; the message names the operation, the topic and the broker's
    (or librdkafka's) error."""


def kafka_error(operation: str, exc: BaseException) -> KafkaOperationError:
    """``exc`` (a KafkaException or a future's error) as a :class:`KafkaOperationError` naming
    ``operation`` (e.g. ``"creating topic t"``)."""
    err = exc.args[0] if exc.args else exc
    name = getattr(err, "name", None)
    text = getattr(err, "str", None)
    detail = f"{name()}: {text()}" if callable(name) and callable(text) else str(err)
    return KafkaOperationError(f"{operation}: {detail}")


#: s :func:`create_topics` waits for every topic to be usable (in the metadata, a leader for
#: each partition) after it was created, here or by a worker starting at the same moment
TOPIC_READY_TIMEOUT_S = 60.0


def create_topics(bootstrap: str, specs: list[TopicSpec], replication: int = 1, timeout: float = 15.0,
                  client_config: dict | None = None, ready_timeout: float = TOPIC_READY_TIMEOUT_S) -> list[str]:
    """Create the topics that do not exist yet, then wait until every topic of ``specs`` is
    usable: in the broker's metadata with a leader for each partition. Returns the names created
    here. Workers started at the same moment create the same topics (the Helm chart starts its
    pods in parallel): a topic another client created first, or is still creating, is waited for,
    never an error; any other failure names the operation and the topic."""
    import time

    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, **client_security(), **(client_config or {})})
    try:
        existing = set(admin.list_topics(timeout=timeout).topics)
    except KafkaException as exc:
        raise kafka_error(f"listing the topics on {bootstrap}", exc) from None
    missing = [s for s in specs if s.name not in existing]
    created = []
    if missing:
        futures = admin.create_topics([NewTopic(s.name, num_partitions=s.partitions, replication_factor=replication, config=s.config)
                                       for s in missing], request_timeout=timeout)
        for name, future in futures.items():
            try:
                future.result(timeout)
                created.append(name)
            except KafkaException as exc:  # a concurrent creator is fine
                if exc.args[0].code() != _TOPIC_ALREADY_EXISTS:
                    raise kafka_error(f"creating topic {name}", exc) from None
    deadline = time.monotonic() + ready_timeout
    waiting = sorted(s.name for s in specs)
    while waiting:
        try:
            meta = admin.list_topics(timeout=min(timeout, max(1.0, deadline - time.monotonic())))
            waiting = [n for n in waiting if not _topic_usable(meta, n)]
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise kafka_error(f"waiting for topics {', '.join(waiting)} on {bootstrap}", exc) from None
        if waiting:
            if time.monotonic() >= deadline:
                raise KafkaOperationError(f"waiting for topics {', '.join(waiting)} on {bootstrap}: not in the broker's "
                                          f"metadata with a leader for every partition after {ready_timeout:g} s")
            time.sleep(0.1)
    return created


#: librdkafka's KafkaError.TOPIC_ALREADY_EXISTS (36), without importing confluent_kafka at module load
_TOPIC_ALREADY_EXISTS = 36
#: KafkaError codes of a broker that does not answer a request kind: UNSUPPORTED_VERSION (35),
#: INVALID_REQUEST (42), _UNSUPPORTED_FEATURE (-165)
_UNSUPPORTED = (35, 42, -165)


def _topic_usable(meta, name: str) -> bool:
    topic = meta.topics.get(name)
    return (topic is not None and topic.error is None and len(topic.partitions) > 0
            and all(p.leader >= 0 and p.error is None for p in topic.partitions.values()))


class DeliveryError(RuntimeError):
    """The broker did not acknowledge a message: the caller must not commit what it covers.
    ``error``: librdkafka's error (a ``KafkaError``) when one was raised, else None (messages
    left unacknowledged at a flush's timeout)."""

    def __init__(self, message: str, error=None):
        super().__init__(message)
        self.error = error

    @property
    def code_name(self) -> str:
        """The error's name (e.g. ``ILLEGAL_GENERATION``, ``_TIMED_OUT``), or ``""``."""
        return self.error.name() if self.error is not None and hasattr(self.error, "name") else ""

    @property
    def fatal(self) -> bool:
        """The producer cannot go on: it must be created anew (librdkafka's fatal errors)."""
        return bool(self.error is not None and getattr(self.error, "fatal", lambda: False)())


#: the step of a transaction that commits consumer offsets (named in its DeliveryError)
OFFSETS_STEP = "sending the consumer offsets"
#: s a failed transaction's abort may take before its producer counts as broken (created anew)
ABORT_TIMEOUT_S = 10.0


class _CoordinatorRetries(logging.Filter):
    """librdkafka retries finding the transaction coordinator while the broker creates or loads
    ``__transaction_state`` (the first transactional producer of a fresh cluster, a coordinator
    that moved): a normal path, logged at DEBUG only. When it persists, ``init_transactions``
    times out and the worker stops saying so (:meth:`KafkaPublisher._call`); other lines pass."""

    RETRIED = ("Not coordinator", "Coordinator load in progress", "Coordinator not available")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "GETPID" in text and text.endswith("retrying") and any(r in text for r in self.RETRIED):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return PRODUCER_LOG.isEnabledFor(logging.DEBUG)
        return True


#: librdkafka's own lines of the producers, through Python logging (formatted as the worker's
#: lines, not printed by librdkafka straight to stderr)
PRODUCER_LOG = logging.getLogger("dpstream.librdkafka.producer")
PRODUCER_LOG.addFilter(_CoordinatorRetries())


class KafkaPublisher:
    """A confluent-kafka producer that reports whether everything sent was acknowledged.

    At least once (no ``transactional_id``): ``acks=all`` and no idempotence; the worker
    tolerates duplicates by design (docs/privacy.md, "Failures"), and it commits state only after
    :meth:`flush` returns without error.

    Exactly once (``transactional_id``): each :meth:`send` is one Kafka transaction. A consumer
    reading with ``read_committed`` sees all of its messages or none; starting a publisher with
    the same id fences the previous one (a worker's earlier incarnation can no longer commit).
    """

    def __init__(self, bootstrap: str, client_config: dict | None = None, transactional_id: str | None = None,
                 timeout: float = 60.0):
        from confluent_kafka import Producer

        self._errors: list[str] = []
        self._busy = threading.Lock()  # held through each send (a transaction)
        #: a send its caller stopped waiting for (:meth:`abandon`): it may no longer commit
        self.abandoned = False
        self._phase = threading.Lock()  # abandoning against starting the commit
        self._committing = False
        #: while the consumer offsets are being sent: when the coordinator should have answered
        self._offsets_due: float | None = None
        #: a transactional producer that can no longer be used (a fatal error, or a failed
        #: transaction it could not abort): its owner creates another with the same id
        self.broken = False
        #: the offset of the last message acknowledged per (topic, partition), since :meth:`send` began
        self.acknowledged: dict[tuple[str, int], int] = {}
        self.transactional = transactional_id is not None
        self.transactional_id = transactional_id
        delivery = {"enable.idempotence": True, "transactional.id": transactional_id} if self.transactional else {"enable.idempotence": False}
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                                  "queue.buffering.max.messages": 1_000_000, "message.max.bytes": 8 * 1024 * 1024,
                                  "logger": PRODUCER_LOG, **delivery, **client_security(), **(client_config or {})})
        if self.transactional:
            self._call("starting transactions", lambda: self.producer.init_transactions(timeout))

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            self._errors.append(f"{msg.topic()}: {err}")
        else:
            key = (msg.topic(), msg.partition())
            self.acknowledged[key] = max(self.acknowledged.get(key, -1), msg.offset())

    def produce(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None) -> None:
        args = {"on_delivery": self._on_delivery}
        if partition is not None:
            args["partition"] = partition
        while True:
            try:
                self.producer.produce(topic, value, key, **args)
                return
            except BufferError:  # local queue full: let deliveries drain
                self.producer.poll(0.05)

    def _produce_transaction(self, messages: list) -> None:
        """Produce a transaction's messages. A failed one fails the commit, so only the last
        message of each partition named asks for its delivery report (the offset of a
        changelog's last record: :attr:`acknowledged`): a Python callback per message cost
        about a microsecond each, and elastic workers send a changelog record per state key."""
        produce, poll, report = self.producer.produce, self.producer.poll, self._on_delivery
        last = {(m[0], m[3]): i for i, m in enumerate(messages) if m[3] is not None}
        asks = set(last.values())
        for i, (topic, value, key, partition) in enumerate(messages):
            while True:
                try:
                    produce(topic, value, key, -1 if partition is None else partition, report if i in asks else None)
                    break
                except BufferError:  # local queue full: let deliveries drain
                    poll(0.05)

    def flush(self, timeout: float = 60.0) -> None:
        left = self.producer.flush(timeout)
        errors, self._errors = self._errors, []
        if left or errors:
            raise DeliveryError(f"{left} messages not acknowledged after {timeout:g} s; errors: {errors[:5]}")

    def send(self, messages: Iterable[tuple[str, bytes | None, bytes | None, int | None]], timeout: float = 60.0,
             offsets: list | None = None, group=None, offsets_timeout: float | None = None) -> None:
        """Send ``(topic, value, key, partition)`` messages and wait until they are acknowledged
        (at least once) or committed as one transaction (exactly once). Raises
        :class:`DeliveryError` otherwise: then none of them counts for a ``read_committed``
        consumer, and the caller must not commit what they cover.

        ``offsets`` (confluent-kafka ``TopicPartition``s) and ``group`` (the consumer's group
        metadata): consumer offsets committed in the same transaction. The group coordinator
        checks the consumer's generation, so a worker that lost those partitions in a rebalance
        can no longer commit anything for them (KIP-447; docs/operations.md, "Elastic workers").
        ``offsets_timeout``: how long the coordinator may take to accept them (it holds them while
        the group rebalances)."""
        with self._busy:
            self._send(messages, timeout, offsets, group, timeout if offsets_timeout is None else min(timeout, offsets_timeout))

    def discard(self) -> None:
        """Drop what this producer still holds (a broken one, replaced by another with the same
        transactional id, which fences it)."""
        try:
            self.producer.purge(in_queue=True, in_flight=True, blocking=False)
        except Exception:  # noqa: BLE001 - a fatal producer may refuse even this
            pass
        self.broken = True

    def wait_idle(self) -> None:
        """Blocking: until no :meth:`send` is running (one its caller stopped waiting for goes on;
        an abandoned one is not waited for)."""
        if self.abandoned:
            return
        with self._busy:
            pass

    def offsets_overdue(self, grace: float) -> bool:
        """The running send has been sending its consumer offsets for ``grace`` s longer than
        its ``offsets_timeout``. Librdkafka does not bound that step when the group coordinator
        is down (librdkafka issues 5456 and 5511: the coordinator request's timeout is never
        checked), e.g. after a broker restart."""
        due = self._offsets_due
        return due is not None and time.monotonic() > due + grace

    def abandon(self) -> bool:
        """The caller stops waiting for the running send: it may no longer commit (it aborts if
        it ever returns), and the producer is broken (its owner creates another with the same
        transactional id, which fences it; or the broker aborts the open transaction after
        ``transaction.timeout.ms``). False when the send already began its commit, which is
        bounded: then the caller waits for it."""
        with self._phase:
            if self._committing:
                return False
            self.abandoned = self.broken = True
            return True

    def _send(self, messages, timeout: float, offsets, group, offsets_timeout: float = 60.0) -> None:
        self.acknowledged = {}
        messages = list(messages)
        self._topics = sorted({m[0] for m in messages})  # named in a failure
        if not self.transactional:
            for m in messages:
                self.produce(*m)
            self.flush(timeout)
            return
        if self.broken:
            raise DeliveryError("the producer failed before and must be created anew")
        self._committing = False
        self._call("beginning a transaction", self.producer.begin_transaction)
        try:
            self._produce_transaction(messages)
            if offsets:
                self._offsets_due = time.monotonic() + offsets_timeout
                try:
                    self._call(OFFSETS_STEP, lambda: self.producer.send_offsets_to_transaction(offsets, group, offsets_timeout))
                finally:
                    self._offsets_due = None
            with self._phase:
                if self.abandoned:  # its caller gave the batch up meanwhile: it must not count
                    raise DeliveryError("the transaction was abandoned by its caller")
                self._committing = True
            self._call("committing a transaction", lambda: self.producer.commit_transaction(timeout))
        except BaseException as exc:
            if isinstance(exc, DeliveryError) and exc.fatal:
                self.broken = True  # nothing more is possible with it; the broker aborts the transaction
            else:
                try:
                    # bounded: an abort that needs an epoch bump the coordinator keeps refusing
                    # (CONCURRENT_TRANSACTIONS after a broker restart) is cut short: a new
                    # producer with this transactional id aborts the transaction as it fences this one
                    self.producer.abort_transaction(min(timeout, ABORT_TIMEOUT_S))
                except Exception:  # noqa: BLE001 - fenced or fatal: the transaction aborts on the broker anyway
                    self.broken = True  # its state is unknown (librdkafka refuses the next begin: _STATE)
            raise
        finally:
            self._errors = []

    def _call(self, what: str, action) -> None:
        from confluent_kafka import KafkaException

        try:
            action()
        except KafkaException as exc:
            topics = getattr(self, "_topics", None)
            where = f" (to {', '.join(topics)})" if topics else ""
            error = exc.args[0] if exc.args else None
            raise DeliveryError(f"{what}{where}: {error if error is not None else exc}", error) from None


def _check(*keys: str) -> str:
    names = [setting_name(k) for k in keys]
    return "check " + (" and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1])


def _redacted(text: str, settings: dict) -> str:
    for key in SECRET_SETTINGS:
        if settings.get(key):
            text = text.replace(str(settings[key]), "***")
    return text


#: TLS alerts a broker sends when it refuses the client's certificate (or its absence)
_CERTIFICATE_ALERTS = ("bad certificate", "certificate required", "unknown ca", "certificate unknown", "certificate expired",
                       "certificate revoked", "unsupported certificate", "access denied")


def setting_error(error, settings: dict | None = None) -> "KafkaSettingError | None":
    """librdkafka's error (a ``KafkaError``, or its text) as a :class:`KafkaSettingError` when it
    is one of the client's settings' (authentication, TLS, an invalid value), else None: a broker
    that is not there (yet) is waited for, these are not (docs/operations.md, "Kafka security").

    What librdkafka 2.x says, as seen against scripts/broker start-secure: a client that cannot be
    created raises ``_INVALID_ARG`` with ``Invalid value "V" for configuration property "P"`` or
    ``P failed: <OpenSSL error>`` (a file of ssl.*.location); refused credentials come to
    ``error_cb`` as ``_AUTHENTICATION``, a broker certificate the CA did not sign as ``_SSL``
    (certificate verify failed), a client certificate the broker refused as ``_TRANSPORT`` with
    the broker's TLS alert (bad certificate, certificate required, ...)."""
    from confluent_kafka import KafkaError

    settings = client_security() if settings is None else settings
    code = error.code() if hasattr(error, "code") else None
    text = _redacted(error.str() if hasattr(error, "str") else str(error), settings)
    found = _creation_error(text, settings) or _connection_error(code, text)
    if found is None and code == KafkaError._INVALID_ARG:  # any other client that cannot be created: its settings
        found = f"invalid Kafka client settings: {_reason(text)}; check the DPSTREAM_KAFKA_* variables"
    return KafkaSettingError(found) if found else None


def _reason(text: str) -> str:
    """librdkafka's text without the client, the connection's name and its timing."""
    import re

    text = re.sub(r"^Failed to create [a-z ]+: ", "", text)
    text = re.sub(r"^\S+/(bootstrap|\d+): ", "", text)
    return re.sub(r" \(after \d+ms in state \w+\)$", "", text)


def _creation_error(text: str, settings: dict) -> str | None:
    """What a client that cannot be created says of its settings (a value, a file)."""
    import os
    import re

    if m := re.search(r'Invalid value "(.*?)" for configuration property "([^"]+)"', text):
        key = m.group(2)
        value = "" if key in SECRET_SETTINGS else f" {m.group(1)!r}"
        return f"invalid Kafka client setting: {key}{value} is not a valid value; {_check(key)}"
    if m := re.search(r"(ssl\.(?:ca|certificate|key|crl)\.location) failed: (.*)", text):
        key = m.group(1)
        path = settings.get(key, "")
        what = {"ssl.ca.location": "the CA certificate", "ssl.certificate.location": "the client certificate",
                "ssl.key.location": "the client's private key", "ssl.crl.location": "the CRL"}[key]
        if path and not os.path.exists(path):
            return f"TLS: {what} file {path} does not exist; {_check(key)}"
        if key == "ssl.key.location":
            return (f"TLS: cannot read {what} {path} (not a PEM key, or encrypted with another password: "
                    f"{_reason(m.group(2))}); {_check(key, 'ssl.key.password')}")
        return f"TLS: cannot read {what} {path} as PEM ({_reason(m.group(2))}); {_check(key)}"
    if "sasl.username and sasl.password must be set" in text:
        return f"SASL needs a username and a password; {_check('sasl.username', 'sasl.password')}"
    if "Unsupported hash function" in text:
        return f"SASL mechanism not known: {_reason(text)}; {_check('sasl.mechanisms')}"
    return None


def _connection_error(code, text: str) -> str | None:
    """What the broker's refusal of a connection says of the client's settings (credentials,
    certificates); None for a broker away or going away."""
    import re

    from confluent_kafka import KafkaError

    if re.search(r"mechanism handshake failed.*supported mechanisms: *(\(after|$)", text):  # the broker offers none
        return f"SASL refused: the listener at --broker takes no SASL ({_reason(text)}); {_check('security.protocol')}"
    if "mechanism handshake failed" in text or "Unsupported SASL mechanism" in text:
        return f"SASL mechanism refused: {_reason(text)}; {_check('sasl.mechanisms')}"
    if "OAUTHBEARER token" in text:  # librdkafka's own token request (sasl.oauthbearer.method oidc) was refused
        return (f"OAUTHBEARER: no token: {_reason(text)}; "
                f"{_check('sasl.oauthbearer.client.id', 'sasl.oauthbearer.client.secret', 'sasl.oauthbearer.token.endpoint.url')}")
    if code == KafkaError._AUTHENTICATION or "SASL authentication error" in text:
        return (f"Kafka authentication failed: {_reason(text)}; {_check('sasl.username', 'sasl.password')} "
                f"(and {setting_name('sasl.mechanisms')})")
    if "certificate verify failed" in text:
        return (f"TLS: the broker's certificate could not be verified (not signed by the CA in "
                f"{setting_name('ssl.ca.location')}, or not issued for the address in --broker): "
                f"{_reason(text).split(': broker certificate could not be verified')[0]}; {_check('ssl.ca.location')}")
    if any(f"alert {a}" in text for a in _CERTIFICATE_ALERTS):
        return (f"TLS: the broker refused this client's certificate (the listener requires one its CA signed): "
                f"{_reason(text)}; {_check('ssl.certificate.location', 'ssl.key.location')} "
                f"(and {setting_name('security.protocol')} against the listener in --broker)")
    # other TLS failures, but not a connection cut in the handshake: a broker going away does that
    if (code == KafkaError._SSL or "SSL handshake failed" in text) and not re.search(
            r"Disconnected|closed by peer|reset by peer|unexpected eof|SSL_ERROR_SYSCALL|timed out", text, re.I):
        return (f"TLS handshake with the broker failed: {_reason(text)}; "
                f"{_check('security.protocol', 'ssl.ca.location', 'ssl.certificate.location')}")
    return None


class SettingErrors:
    """A librdkafka ``error_cb`` keeping the first error that is a setting's
    (:func:`setting_error`); librdkafka reports refused credentials and TLS failures only
    there, and retries them as if the broker were away."""

    def __init__(self, settings: dict | None = None):
        self.settings = client_security() if settings is None else settings
        self.first: KafkaSettingError | None = None

    def __call__(self, error) -> None:
        if self.first is None:
            self.first = setting_error(error, self.settings)

    def raise_first(self) -> None:
        if self.first is not None:
            raise self.first


def open_client(kind, config: dict):
    """``kind(config)`` (a confluent-kafka Producer, Consumer or AdminClient); a client its
    settings do not allow to be created raises :class:`KafkaSettingError`."""
    from confluent_kafka import KafkaException

    try:
        return kind(config)
    except KafkaException as exc:
        error = setting_error(exc.args[0] if exc.args else exc, config)
        if error is None:
            raise
        raise error from None


def _ssl_context(settings: dict):
    """Python's TLS context for aiokafka and Faust from the same settings: the CA, and the
    client certificate and key if given. A file that cannot be used raises :class:`KafkaSettingError`."""
    import os
    import ssl

    from aiokafka.helpers import create_ssl_context

    for key in ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location"):
        if settings.get(key) and not os.path.exists(settings[key]):
            raise KafkaSettingError(f"TLS: the file {settings[key]} does not exist; {_check(key)}")
    try:
        context = create_ssl_context(cafile=settings.get("ssl.ca.location"), certfile=settings.get("ssl.certificate.location"),
                                     keyfile=settings.get("ssl.key.location"), password=settings.get("ssl.key.password"))
        # librdkafka's ssl.endpoint.identification.algorithm: https (its default) checks the host name
        context.check_hostname = settings.get("ssl.endpoint.identification.algorithm", "https") != "none"
        return context
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise KafkaSettingError(f"TLS: cannot use the CA, certificate or key files ({_redacted(str(exc), settings)}); "
                                f"{_check('ssl.ca.location', 'ssl.certificate.location', 'ssl.key.location', 'ssl.key.password')}") from None


def aiokafka_security(settings: dict) -> dict:
    """The same settings as aiokafka keyword arguments (the worker's input consumer)."""
    if not settings:
        return {}
    out = {"security_protocol": settings.get("security.protocol", "PLAINTEXT")}
    if settings.get("client.id"):  # the worker's own (client_properties.use_client_id)
        out["client_id"] = settings["client.id"]
    if "SSL" in out["security_protocol"]:
        out["ssl_context"] = _ssl_context(settings)
    if "SASL" in out["security_protocol"]:
        out["sasl_mechanism"] = settings.get("sasl.mechanisms", "PLAIN")
        if out["sasl_mechanism"] == "OAUTHBEARER":
            from dpstream.topics.oauth_token import OidcTokenProvider

            out["sasl_oauth_token_provider"] = OidcTokenProvider(settings)
        else:
            out["sasl_plain_username"] = settings.get("sasl.username")
            out["sasl_plain_password"] = settings.get("sasl.password")
    return out
