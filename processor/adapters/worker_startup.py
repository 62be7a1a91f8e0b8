"""A worker's start: its topics, its input checks and its state (docs/operations.md, "Topics"
and "Elastic workers").

Order matters: the start-over count in ``dpstream-epochs`` names the repartition and changelog
topics, so it is read first, with the run the application's workers agree on (its nonce is in
the noise label: run_identity.py); then the topics the worker needs are created (or found, when
another worker of the application created them first), the input topics are checked (their
timestamps, partition counts), and the state is opened against the epoch mark the application
left outside the volume.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from dpstream.processor.adapters.metrics import PipelineMetrics
from dpstream.processor.adapters.output_claims import claim_outputs
from dpstream.processor.adapters.run_identity import agree_run
from dpstream.processor.adapters.worker import (
    DpstreamWorker,
    LostStateError,
    lost_state_message,
    worker_epoch,
)
from dpstream.processor.engine.dynamic_stream import SEQ_PARTITION_BITS, unit_step_partitions
from dpstream.topics.kafka import (
    CHANGELOG_TOPIC_CONFIG,
    EPOCH_TOPIC,
    TopicSpec,
    client_security,
    create_topics,
    item_topic,
    kafka_error,
    read_epoch_marks,
    repartition_topic,
    rerouting_topic,
    restarts_key,
    timestamp_types,
    topics_for,
    unit_topic,
    write_epoch_mark,
)

log = logging.getLogger("dpstream.worker")


class CreateTimeInputError(RuntimeError):
    """An input topic's timestamps are its producers' (CreateTime), and --allow-create-time was not given."""


class TopicLayoutError(RuntimeError):
    """The topics on the broker do not fit the config (a missing topic, partition counts)."""


def partition_counts(broker: str, topics: set[str]) -> dict[str, int]:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": broker, **client_security()}).list_topics(timeout=15)
    counts = {}
    for topic in topics:
        if topic not in meta.topics or meta.topics[topic].error is not None:
            raise TopicLayoutError(f"topic {topic!r} does not exist on {broker}")
        counts[topic] = len(meta.topics[topic].partitions)
    return counts


class WorkerStartup:
    """Blocking steps of a worker's start (run off the event loop); ``s``: its WorkerSettings."""

    def __init__(self, s, broker: str, metrics: PipelineMetrics):
        self.s, self.broker, self.metrics = s, broker, metrics
        self.group = s.assignment == "group"

    def open(self) -> DpstreamWorker:
        """Create missing topics, check the input topics, open the state (static: the owned
        partitions'; group: none yet, each is restored as the group assigns it)."""
        s, broker = self.s, self.broker
        # the epoch first: the start-over count in dpstream-epochs names the repartition topics
        create_topics(broker, [t for t in topics_for([]) if t.name == EPOCH_TOPIC])
        marks = read_epoch_marks(broker)
        # `dpstream reset` counts start-overs here: each moves the worker to a new noise label
        restarts = int((marks.get(restarts_key(s.app_id)) or {}).get("count", 0))
        # each output topic belongs to one application id: another's is refused (output_claims.py)
        claim_outputs(broker, s.app_id, s.config, marks)
        # the run nonce of the noise label, the same for every worker of the application; a
        # fresh start over releases of a window still open is refused (run_identity.py)
        run = agree_run(broker, s, marks, restarts)
        epoch = worker_epoch(s.config, restarts)
        create_topics(broker, topics_for(s.config.queries, s.partitions, s.config.dynamic, s.app_id, epoch))
        inputs = {q.input_topic for q in s.config.queries}
        dynamic_inputs = {q.input_topic for q in s.config.dynamic}
        counts = partition_counts(broker, inputs | dynamic_inputs | {repartition_topic(q.name, s.app_id, epoch) for q in s.config.queries})
        self.check_timestamps(inputs | dynamic_inputs)
        self.open_item_topics(epoch, counts)
        # existing topics keep their partition counts: use what the broker has
        repartitions = {counts[repartition_topic(q.name, s.app_id, epoch)] for q in s.config.queries}
        if len(repartitions) > 1:
            raise TopicLayoutError(f"repartition topics have different partition counts: {sorted(repartitions)}")
        self.open_rerouting_topics(epoch, counts)
        # what this worker's state belonged to when it last started, kept outside its volume:
        # an empty state directory under the same epoch is a lost volume, refused (static); a
        # lost changelog topic, refused (group)
        mark_key = f"{s.app_id}/group" if self.group else f"{s.app_id}/{s.ownership.index}"
        previous = marks.get(mark_key)
        worker = DpstreamWorker(
            s.config, s.secret, s.state_dir, None if self.group else s.ownership, {t: counts[t] for t in inputs},
            repartitions.pop() if repartitions else s.partitions, self.metrics, previous_mark=previous, app_id=s.app_id,
            partitioner=s.partitioner, watermark_delay_ms=s.watermark_delay_ms, restarts=restarts, run_nonce=run.nonce,
            dynamic_partitions={t: counts[t] for t in dynamic_inputs})
        log.info(run.log_line(worker.noise.label))
        mark = dict(worker.epoch_mark)
        if self.group:
            mark["changelogs"] = self.open_changelogs(worker, counts, previous)
        if previous is None or {k: previous.get(k) for k in mark} != mark:
            mark["since_ms"] = int(time.time() * 1000)
            write_epoch_mark(broker, mark_key, mark)
        return worker

    def open_rerouting_topics(self, epoch: str, counts: dict) -> None:
        """Each query's by-user topic, with its input topic's partition count: its partition p is
        read into input partition p's state (processor/adapters/worker.py, stage 1)."""
        wanted = {rerouting_topic(q.name, self.s.app_id, epoch): counts[q.input_topic] for q in self.s.config.queries}
        create_topics(self.broker, [TopicSpec(t, n, {"cleanup.policy": "delete"}, "stage 1 -> stage 1, events to the partition "
                                              "that owns their user") for t, n in wanted.items()])
        have = partition_counts(self.broker, set(wanted))
        for topic, n in sorted(wanted.items()):
            if have[topic] != n:
                raise TopicLayoutError(f"by-user topic {topic} has {have[topic]} partitions, its input topic {n}: they must be "
                                       f"equal (partition p of each is read into one state); delete it (dpstream reset) or "
                                       f"give it {n} partitions")

    def open_item_topics(self, epoch: str, counts: dict) -> None:
        """A dynamic query on an update topic of several partitions: its by-item topic, one
        partition per shard (processor/adapters/worker.py, "dynamic queries"), and with a
        ``unit_field`` its by-unit topic, one partition per unit step (as many); their counts join
        ``counts``. Refused: more partitions than a routed update's sequence number holds, a
        by-item or by-unit topic of another partition count."""
        wanted, purpose = {}, {}
        for q in self.s.config.dynamic:
            n = counts[q.input_topic]
            if n == 1:
                continue
            if n > 2 ** SEQ_PARTITION_BITS:
                raise TopicLayoutError(f"dynamic update topic {q.input_topic!r} has {n} partitions, more than "
                                       f"{2 ** SEQ_PARTITION_BITS}")
            topic = item_topic(q.name, self.s.app_id, epoch)
            wanted[topic], purpose[topic] = q.shards, ("by-item", "shard k's", "dynamic updates to the shard of their item")
            if q.unit_field is not None:
                topic = unit_topic(q.name, self.s.app_id, epoch)
                wanted[topic] = unit_step_partitions(q)
                purpose[topic] = ("by-unit", "unit step k's", "dynamic updates to the bound of their unit (pseudonyms)")
        if not wanted:
            return
        create_topics(self.broker, [TopicSpec(t, k, {"cleanup.policy": "delete"}, purpose[t][2]) for t, k in wanted.items()])
        have = partition_counts(self.broker, set(wanted))
        for topic, k in sorted(wanted.items()):
            if have[topic] != k:
                kind, owner, _ = purpose[topic]
                raise TopicLayoutError(f"{kind} topic {topic} has {have[topic]} partitions, its query {k} shards: they must be "
                                       f"equal (partition k is {owner}); delete it (dpstream reset) or give it {k} partitions")
        counts.update(have)

    def check_timestamps(self, topics: set[str]) -> None:
        """Input topics must be stamped by the broker (LogAppendTime) unless --allow-create-time."""
        stamps = timestamp_types(self.broker, topics)
        for topic in sorted(t for t, kind in stamps.items() if kind != "LogAppendTime"):
            # the producers' stamps decide lateness: a record reaching the broker more than the
            # watermark delay after its stamp is late or not depending on how far behind the
            # worker was, which other users' records influence (docs/privacy.md, "Time")
            if not self.s.allow_create_time:
                raise CreateTimeInputError(
                    f"input topic {topic} has message.timestamp.type={stamps[topic]}: its producers' timestamps would "
                    f"decide which records are late, and the guarantee would rest on every producer delivering within "
                    f"the watermark delay. Set it to LogAppendTime (kafka-configs.sh --alter --entity-type topics "
                    f"--entity-name {topic} --add-config message.timestamp.type=LogAppendTime), or start with "
                    f"--allow-create-time. See docs/privacy.md, \"Time\"")
            log.warning("input topic %s has message.timestamp.type=%s (--allow-create-time): its producers' timestamps "
                        "decide which records are late (docs/operations.md, \"Time and lateness\")", topic, stamps[topic])

    def open_changelogs(self, worker: DpstreamWorker, counts: dict, previous: Optional[dict]) -> dict:
        """Create the changelog topics (one per source topic, as many partitions) and return their
        topic ids. A changelog this application epoch already had under another id (deleted,
        recreated) is refused: its stores' state is gone, and starting afresh would forget spent
        budget and released values (docs/privacy.md, "Failures")."""
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient

        names = {worker.changelog_topic(t): counts.get(t, 1) for t in worker.source_topics()}
        create_topics(self.broker, [TopicSpec(n, k, CHANGELOG_TOPIC_CONFIG, "changelog") for n, k in names.items()])
        admin = AdminClient({"bootstrap.servers": self.broker, **client_security()})
        ids = {}
        for name, future in admin.describe_topics(TopicCollection(sorted(names))).items():
            try:
                ids[name] = str(future.result(15).topic_id)
            except Exception as exc:  # noqa: BLE001 - named: the operation and the topic
                raise kafka_error(f"describing changelog topic {name}", exc) from None
        recorded = (previous or {}).get("changelogs") or {}
        same_epoch = previous is not None and {k: previous.get(k) for k in worker.epoch_mark} == worker.epoch_mark
        for name, topic_id in ids.items():
            if same_epoch and recorded.get(name) not in (None, topic_id):
                raise LostStateError(lost_state_message(
                    f"changelog topic {name} was recreated (its id is {topic_id}, this application epoch wrote topic id "
                    f"{recorded[name]}): the state it held is lost", self.s.app_id, self.s.config))
        return ids
