"""Elastic workers' reading: the partitions a worker owns, fetched with aiokafka.

An elastic worker's partitions come from the consumer group (consumer_group.py), but it does not
fetch them through the group's client: librdkafka hands each record over as a Python object
built field by field, and a worker holding the GIL for that (and for wrapping each one) took in
about a fifth fewer events per second than a static worker reading the same partitions with
aiokafka, whose fetch decodes a batch in C (docs/benchmarks.md, "Elastic against static"). So the
group's client keeps the membership with its partitions paused, and this reader, a consumer of its
own with no group, is assigned the same partitions by hand and reads them from the offsets their
states have read to.

It also reads the by-user partitions of the owned input partitions (their lanes: stage 1 in
processor/adapters/worker.py). The group's cooperative-sticky assignor knows nothing of
co-partitioning: it could give partition p of the input and partition p of a by-user topic to two
workers, so the by-user topics are not in the group's subscription. Their offsets travel in the
input partition's state and changelog, and every transaction that covers them carries the input
partition's group offsets, so a worker that lost the input partition cannot commit them either
(docs/operations.md, "Elastic workers").

Fencing does not depend on who fetches: a transaction's consumer offsets are accepted only from
the partition's owner in the group's current generation (KIP-447).
"""
from __future__ import annotations

import logging
from typing import Optional

from dpstream.processor.adapters.worker import InputWentBackError
from dpstream.topics.kafka import aiokafka_security, client_security

log = logging.getLogger("dpstream.worker")


class OwnedPartitionReader:
    """The partitions a worker owns now (each with the source it is read into), read from the
    offsets their states have read to."""

    def __init__(self, broker: str):
        self.broker = broker
        self.consumer = None
        #: (topic, partition) -> the source it is read into, as last assigned
        self.sources: dict = {}
        #: (topic, partition) -> the consumer's position after the last fetch (past transaction
        #: markers and aborted records, which no record's offset stands for)
        self.positions: dict = {}
        #: the by-user partitions among them: one whose records retention deleted before they were
        #: read goes on from the log's start (as a static worker's does), an input's is refused
        self.lanes: set = set()
        #: partitions not fetched for now (their stage holds a full batch)
        self.paused: set = set()

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        # read_committed: our own records (by-user, repartition) count once their transaction
        # committed; "none": an offset out of range (the log went back) is an error, never a reset
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.broker, group_id=None, enable_auto_commit=False,
                                         auto_offset_reset="none", isolation_level="read_committed",
                                         max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=32 * 1024 * 1024,
                                         **aiokafka_security(client_security()))
        await self.consumer.start()

    def follow(self, owned: dict, lanes: dict, batches, first: dict) -> None:
        """Assign ``owned`` and ``lanes`` ((topic, partition) -> source, the worker's now). A
        partition whose source changed (gained, given up, taken up again from its changelog) is
        read from ``first`` (its offset there, taken out) or its state's offset, and what was
        gathered for it is dropped; one that stayed goes on from where it was fetched to."""
        from aiokafka import TopicPartition

        wanted = {**owned, **lanes}
        if self.consumer is None or wanted.keys() == self.sources.keys() and all(
                self.sources[k] is s for k, s in wanted.items()):
            return
        for key, source in self.sources.items():
            if wanted.get(key) is not source:
                batches.drop(key)
        kept = {key: batches.fetched.get(key) for key, source in wanted.items() if self.sources.get(key) is source}
        self.consumer.assign([TopicPartition(*key) for key in wanted])
        for key, source in wanted.items():
            at = kept.get(key)
            if at is None:
                at = first.pop(key, None)
            if at is None:
                at = (source.lane_offset(key[0]) if key in lanes else source.last_offset) + 1
            self.consumer.seek(TopicPartition(*key), at)
        self.sources, self.lanes = wanted, set(lanes)
        self.paused = set()  # an assignment resumes every partition
        self.positions = {k: v for k, v in self.positions.items() if k in wanted and kept.get(k) is not None}

    def pause_only(self, keys: set) -> None:
        """Fetch nothing for ``keys`` (assigned partitions) until a later call leaves them out."""
        from aiokafka import TopicPartition

        keys = keys & self.sources.keys()
        if self.consumer is None or keys == self.paused:
            return
        self.consumer.pause(*(TopicPartition(*k) for k in keys - self.paused))
        self.consumer.resume(*(TopicPartition(*k) for k in self.paused - keys))
        self.paused = keys

    async def fetch(self, max_records: int, timeout_ms: int) -> dict:
        """Records of the assigned partitions, waiting up to ``timeout_ms`` for some:
        (topic, partition) -> (the source they were read for, records)."""
        import asyncio

        from aiokafka import TopicPartition
        from aiokafka.errors import OffsetOutOfRangeError

        if self.consumer is None or not self.sources or max_records <= 0:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        sources = self.sources
        try:
            fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        except OffsetOutOfRangeError as exc:
            for tp, offset in exc.args[0].items():
                if (tp.topic, tp.partition) not in self.lanes:
                    raise InputWentBackError(
                        f"{tp.topic}-{tp.partition}: offset {offset}, where this worker's state goes on, is no longer in "
                        f"the log: the topic was recreated or the broker lost data. See docs/operations.md, \"When the "
                        f"input goes back\"") from None
                log.error("%s-%d: records from offset %d were deleted (retention) before this worker read them; going on "
                          "from the log's start", tp.topic, tp.partition, offset)
                await self.consumer.seek_to_beginning(TopicPartition(tp.topic, tp.partition))
            return {}
        out = {}
        for tp, records in fetched.items():
            key = (tp.topic, tp.partition)
            if records and sources.get(key) is not None:
                out[key] = (sources[key], records)
        if self.sources is sources:  # not reassigned while fetching
            for tp in self.consumer.assignment():
                self.positions[(tp.topic, tp.partition)] = await self.consumer.position(tp)
        return out

    def position(self, key) -> Optional[int]:
        return self.positions.get(key)

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
