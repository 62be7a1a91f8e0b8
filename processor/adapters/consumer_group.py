"""Elastic workers' reading side: a Kafka consumer group with cooperative-sticky assignment.

``dpstream worker --assignment group`` (docs/operations.md, "Elastic workers"). Every worker of an
application joins one consumer group (the app id) on every topic it reads: the input topics
(stage 1), the repartition topics (stage 2) and the dynamic update topics. The group's
cooperative-sticky assignor spreads their partitions over the workers; a worker joining or
leaving moves only the partitions that must move, and the others go on being processed during
the rebalance.

aiokafka has no cooperative protocol, so the membership is librdkafka's (confluent-kafka), whose
``poll`` runs off the event loop. Its rebalance callbacks run in that thread; they hand the
change to the event loop (``on_gain``/``on_lose`` coroutines) and wait: a gained partition is
assigned only once its store was restored from its changelog; a lost one is given up only after
the transaction that may be carrying its outputs has finished. The assigned partitions are
paused at once: the worker fetches them with a reader of its own (partition_reader.py), which
decodes records faster than librdkafka's Python objects are built.

Fencing: every transaction of an elastic worker carries its partitions' consumer offsets
(``send_offsets_to_transaction`` with :meth:`GroupConsumer.group_metadata`), which the group
coordinator accepts only from the partition's owner in the current generation (KIP-447): a
worker that lost a partition and did not notice can commit nothing more for it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Awaitable, Callable, Optional

from dpstream.topics.kafka import client_security, kafka_error

log = logging.getLogger("dpstream.worker")

#: s a rebalance waits for the worker to hand over the partitions it gives up
LOSE_TIMEOUT_S = 60.0

Key = tuple[str, int]


class GroupConsumer:
    """One worker's membership of the application's consumer group."""

    def __init__(self, broker: str, group_id: str, topics: list[str], loop: asyncio.AbstractEventLoop,
                 on_gain: Callable[[list[Key]], Awaitable[dict[Key, int]]], on_lose: Callable[[list[Key]], Awaitable[None]],
                 session_timeout: float = 10.0, heartbeat_interval: float = 1.0,
                 on_lost: Optional[Callable[[list[Key]], Awaitable[None]]] = None):
        from confluent_kafka import Consumer

        self.loop = loop
        self.broker, self.group_id = broker, group_id
        self._side = None  # see _side_client
        self._side_lock = threading.Lock()
        #: held by a poll and by close: librdkafka's consumer is not closed under a running poll
        self._poll_lock = threading.Lock()
        self.closed = False
        self.on_gain, self.on_lose = on_gain, on_lose
        #: partitions taken away without a hand-over (this member was dropped from the group): the
        #: worker must not send anything for them, another may own them already
        self.on_lost = on_lost or on_lose
        #: the partitions assigned to this member as of the last poll (kept by the poll thread)
        self.assigned: frozenset = frozenset()
        #: the partitions of an assignment whose gain is under way (the worker restores them in the
        #: on_assign callback, before librdkafka counts them assigned): a batch given up meanwhile
        #: must be taken up again (elastic_run.py, _regain), not left unread
        self.assigning: frozenset = frozenset()
        self.stopping = False
        self.failure: Optional[BaseException] = None  # raised by the next fetch
        self.consumer = Consumer({
            "bootstrap.servers": broker, "group.id": group_id,
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            # our own transactions' records count once committed (docs/operations.md, "Delivery")
            "isolation.level": "read_committed",
            # never fetched here (paused), but never a silent reset either
            "auto.offset.reset": "error",
            "session.timeout.ms": int(session_timeout * 1000), "heartbeat.interval.ms": int(heartbeat_interval * 1000),
            # a restore runs inside the rebalance callback, off the poll loop's clock
            "max.poll.interval.ms": 30 * 60 * 1000,
            **client_security(),
        })
        self.consumer.subscribe(topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost)
        self._metadata = self.consumer.consumer_group_metadata()  # before any poll: no callback runs yet

    # -- rebalance callbacks: in the poll thread, handed to the event loop
    def _assigned(self, consumer, partitions) -> None:
        from confluent_kafka import TopicPartition

        self._refresh_metadata()
        if self.stopping or not partitions:
            return
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self.assigning = frozenset(keys)
        try:
            try:
                offsets = asyncio.run_coroutine_threadsafe(self.on_gain(keys), self.loop).result()
            except BaseException as exc:  # noqa: BLE001 - the worker stops (restore failed, input went back, ...)
                self.failure = exc
                return
            tps = [TopicPartition(t, p, offsets[(t, p)]) for t, p in keys]
            consumer.incremental_assign(tps)
            consumer.pause(tps)  # fetched by the worker's own reader (partition_reader.py)
            self.assigned = frozenset((tp.topic, tp.partition) for tp in consumer.assignment())
        finally:
            self.assigning = frozenset()

    def _revoked(self, consumer, partitions) -> None:
        self._refresh_metadata()
        if self.stopping or not partitions:
            return
        keys = [(tp.topic, tp.partition) for tp in partitions]
        try:
            # bounded: while the worker stops, its event loop may no longer run the hand-over
            asyncio.run_coroutine_threadsafe(self.on_lose(keys), self.loop).result(LOSE_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001
            self.failure = exc

    def _lost(self, consumer, partitions) -> None:
        """The member was dropped from the group (its session timed out, e.g. through a network
        outage): its partitions are gone without a hand-over. Librdkafka rejoins the group next."""
        self._refresh_metadata()
        if self.stopping or not partitions:
            return
        keys = [(tp.topic, tp.partition) for tp in partitions]
        log.warning("this worker was dropped from the consumer group (lost %d partitions): rejoining", len(keys))
        try:
            asyncio.run_coroutine_threadsafe(self.on_lost(keys), self.loop).result(LOSE_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001
            self.failure = exc

    # -- membership
    def _poll(self, timeout: float) -> None:
        """In the poll thread: serve the group (rebalance callbacks run here). Every assigned
        partition is paused, so no record comes; an error event is only logged (librdkafka
        retries on its own, and the broker watch stops a worker that hears nothing)."""
        with self._poll_lock:
            if self.closed:
                return
            msg = self.consumer.poll(timeout)
            self.assigned = frozenset((tp.topic, tp.partition) for tp in self.consumer.assignment())
            self._refresh_metadata()
        if msg is not None and msg.error() is not None:
            log.debug("consumer group: %s", msg.error())

    async def poll(self, timeout: float) -> None:
        """Serve the group for up to ``timeout`` s, off the event loop; raises what a rebalance
        callback failed with (a restore failed, the input went back, ...)."""
        await self.loop.run_in_executor(None, self._poll, timeout)
        if self.failure is not None:
            raise self.failure

    def log_ends(self, keys: list[Key], timeout: float = 5.0) -> dict[Key, tuple[int, int]]:
        """Blocking: each partition's high watermark, with the wall-clock time (ms) taken just
        before the broker was asked: every record appended before that time is below it."""
        from confluent_kafka import TopicPartition

        # asked by a client that does not fetch: the member's own client would queue each
        # question behind its fetch long-poll (about 0.5 s per partition)
        side = self._side_client()
        out = {}
        for key in keys:
            asked = int(time.time() * 1000)
            out[key] = (side.get_watermark_offsets(TopicPartition(*key), timeout=timeout, cached=False)[1], asked)
        return out

    def committed(self, keys: list[Key], timeout: float = 60.0) -> dict[Key, int]:
        """Blocking: the group's committed offsets of ``keys`` (-1: none). With
        ``read_committed`` librdkafka asks for *stable* offsets (KIP-447): the answer waits
        until every transaction that sent offsets for these partitions has committed or aborted,
        so once it returns, a previous owner's last transaction is settled, its changelog records
        appended and marked, before the new owner reads the changelog to its end."""
        from confluent_kafka import KafkaException, TopicPartition

        # asked by a client of its own, which never joins the group: the member's own client is
        # inside its rebalance callback, and its offset requests wait for that to end
        try:
            got = self._side_client().committed([TopicPartition(*k) for k in keys], timeout=timeout)
        except KafkaException as exc:
            raise kafka_error(f"reading the committed offsets of group {self.group_id} for "
                              f"{', '.join(f'{t}-{p}' for t, p in keys)}", exc) from None
        return {(tp.topic, tp.partition): tp.offset for tp in got}

    def _side_client(self):
        """A client of the group's id that never joins it nor fetches: for questions to the broker."""
        from confluent_kafka import Consumer

        with self._side_lock:
            if self._side is None:
                self._side = Consumer({"bootstrap.servers": self.broker, "group.id": self.group_id,
                                       "isolation.level": "read_committed", "enable.auto.commit": False, **client_security()})
            return self._side

    def ping(self, timeout: float = 5.0) -> dict:
        """Blocking: ask the broker for the cluster's metadata (raises if it does not answer)."""
        self.consumer.list_topics(timeout=timeout)
        return {}

    def _refresh_metadata(self) -> None:
        """In the poll thread only: librdkafka answers there at once, also inside a rebalance
        callback, while a call from another thread waits until the callback has returned (and
        ours waits on the event loop: a deadlock)."""
        self._metadata = self.consumer.consumer_group_metadata()

    def group_metadata(self):
        """The group metadata (member id, generation) as of the last poll or rebalance callback,
        for the transactions' consumer offsets."""
        return self._metadata

    def close(self) -> None:
        """Blocking (off the event loop: the hand-over of the partitions runs on it). Leave the
        group: the partitions are handed over (their last changes sent) and move at once,
        without waiting for the session timeout."""
        with self._poll_lock:
            self.consumer.close()
            self.closed = self.stopping = True
        if self._side is not None:
            self._side.close()
