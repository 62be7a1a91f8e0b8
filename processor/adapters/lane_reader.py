"""Elastic workers' by-user partitions: read with the input partition they belong to.

Stage 1 of input partition p reads partition p of each query's by-user topic into its own state
(its lanes: processor/adapters/worker.py, stage 1). With static ownership one consumer is
assigned both. An elastic worker's input partitions come from the consumer group, whose
cooperative-sticky assignor knows nothing of co-partitioning: it could give partition p of the
input topic and partition p of a by-user topic to two workers. So the by-user topics are not in
the group's subscription. Each worker reads the by-user partitions of the input partitions the
group gave it, with a consumer of its own (no group), from the offsets kept in the input
partition's state: they move with that state through its changelog, and every transaction that
covers them carries the input partition's group offsets, so a worker that lost the input
partition cannot commit them either (docs/operations.md, "Elastic workers").
"""
from __future__ import annotations

import logging

from dpstream.topics.kafka import aiokafka_security, client_security

log = logging.getLogger("dpstream.worker")


class LaneReader:
    """The by-user partitions of the owned input partitions, read from their states' offsets."""

    def __init__(self, broker: str):
        self.broker = broker
        self.consumer = None
        #: (by-user topic, partition) -> the stage-1 source it is read into, as last assigned
        self.sources: dict = {}

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        # read_committed: a by-user record counts once the transaction that sent it committed
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.broker, group_id=None, enable_auto_commit=False,
                                         auto_offset_reset="earliest", isolation_level="read_committed",
                                         max_partition_fetch_bytes=8 * 1024 * 1024, **aiokafka_security(client_security()))
        await self.consumer.start()

    def follow(self, lanes: dict, batches) -> None:
        """Assign the by-user partitions of ``lanes`` ((topic, partition) -> source: the worker's
        now). A partition whose source changed (gained, given up, taken up again from its
        changelog) is read from its state's offset, and what was gathered for it is dropped; one
        that stayed goes on from where it was fetched to."""
        from aiokafka import TopicPartition

        if self.consumer is None or {k: id(s) for k, s in lanes.items()} == {k: id(s) for k, s in self.sources.items()}:
            return
        for key, source in self.sources.items():
            if lanes.get(key) is not source:
                batches.drop(key)
        kept = {key: batches.fetched.get(key) for key, source in lanes.items() if self.sources.get(key) is source}
        self.consumer.assign([TopicPartition(*key) for key in lanes])
        for key, source in lanes.items():
            at = kept.get(key)
            self.consumer.seek(TopicPartition(*key), at if at is not None else source.lane_offset(key[0]) + 1)
        self.sources = dict(lanes)

    async def fetch(self, max_records: int) -> dict:
        """What has arrived for the assigned partitions (no wait): (topic, partition) -> records."""
        if self.consumer is None or not self.sources or max_records <= 0:
            return {}
        fetched = await self.consumer.getmany(timeout_ms=0, max_records=max_records)
        return {(tp.topic, tp.partition): records for tp, records in fetched.items() if records}

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
