"""Static ownership (``--worker-index i --workers n``): worker i owns partitions p % n == i of
every topic it reads, read with aiokafka from the offsets its own state has read to
(docs/operations.md, "Scaling").
"""
from __future__ import annotations

import asyncio
import logging
import time

from dpstream.processor.adapters.worker import InputWentBackError
from dpstream.processor.adapters.worker_run import WorkerRun, group_id, log_positions
from dpstream.topics.kafka import aiokafka_security, client_security, read_progress

log = logging.getLogger("dpstream.worker")


def lane_positions(broker: str, lanes) -> dict:
    """The log start offset of each by-user topic partition in ``lanes``."""
    lanes = list(lanes)
    return {key: start for key, (start, _, _) in log_positions(broker, lanes).items()} if lanes else {}


def _tp(topic: str, partition: int):
    from aiokafka import TopicPartition

    return TopicPartition(topic, partition)


class MonitoringOffsets:
    """Static workers commit what their state has read to Kafka as the consumer group
    ``<app id>-workers``, after the state committed it, so that standard lag tools (Kafka's
    consumer-groups tool, exporters) see them. For monitoring only: the worker resumes from its
    own state, never from these (docs/operations.md, "Consumer offsets")."""

    def __init__(self, broker: str, app_id: str):
        self.broker, self.group = broker, group_id(app_id)
        self.client = None
        self.committed: dict = {}
        self.failing = False

    def commit(self, offsets: dict) -> None:
        """Blocking: commit ``offsets`` for the group from a client that never joins it (a
        commit outside any generation, which Kafka keeps for a group without members)."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        if self.client is None:
            self.client = Consumer({"bootstrap.servers": self.broker, "group.id": self.group, "enable.auto.commit": False,
                                    "socket.timeout.ms": 10_000, **client_security()})
        tps = [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())]
        for attempt in range(3):
            try:
                self.client.commit(offsets=tps, asynchronous=False)
                return
            except KafkaException as exc:  # the group's coordinator is looked up on the first commit
                if attempt == 2 or not exc.args[0].retriable() and "COORDINATOR" not in exc.args[0].name():
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


class StaticRun(WorkerRun):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: by partition: the consumer's position after the last fetch (past transaction markers
        #: and aborted records, which no record's offset stands for)
        self.positions: dict = {}
        self.offsets = MonitoringOffsets(self.broker, self.s.app_id)

    async def consume(self, loop) -> None:
        """Republish the journal, then read the owned partitions from the offsets their state
        has read to."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.errors import OffsetOutOfRangeError

        worker, s = self.worker, self.s
        if self.exactly_once:  # what the last incarnation delivered: never sent again
            progress = await loop.run_in_executor(None, lambda: read_progress(self.broker, s.app_id))
            worker.resume(progress)
        await self.publish(worker.unpublished())
        worker.log_triggers(force=True)  # what an earlier run fired and this one sent
        for key in list(worker.dynamic_states):  # releases recomputed from the update log, not yet sent
            await self.publish_dynamic(key)
        # the logs must still hold what the state has read (a recreated topic, a broker that
        # lost data: refused, never silently counted from wherever the log is now)
        positions = await self.check_logs()
        # "none": an offset out of range later (the log went back while running) raises
        # read_committed: our own repartition records count once their transaction committed
        consumer = AIOKafkaConsumer(bootstrap_servers=self.broker, group_id=None, enable_auto_commit=False,
                                    auto_offset_reset="none", isolation_level="read_committed",
                                    max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=32 * 1024 * 1024,
                                    **aiokafka_security(client_security()))
        await consumer.start()
        self.consumer = consumer
        stage_of = {}
        for key, src in [*worker.stage1.items(), *worker.stage2.items(), *worker.dynamic.items(), *worker.dynamic_shards.items(),
                         *worker.dynamic_units.items(), *worker.lanes.items()]:
            stage_of[_tp(*key)] = (self.stage_of(key), src)
        lane_starts = await loop.run_in_executor(None, lambda: lane_positions(self.broker, worker.lanes))
        consumer.assign(list(stage_of))
        for tp, (_, src) in stage_of.items():
            key = (tp.topic, tp.partition)
            start = positions[key][0] if key in positions else lane_starts[key]
            offset = src.lane_offset(tp.topic) if key in worker.lanes else src.last_offset
            if offset + 1 < start:  # deleted by retention before this worker read them
                log.error("%s-%d: records at offsets %d to %d were deleted (retention) before this worker read them; "
                          "going on from offset %d", tp.topic, tp.partition, offset + 1, start - 1, start)
            consumer.seek(tp, max(offset + 1, start))  # the state's own offset, not a group commit
        self.health.set("ready")
        log.info("dpstream worker %d/%d ready: %d input and %d repartition partitions", s.ownership.index, s.ownership.workers,
                 len(worker.stage1), len(worker.stage2))
        batches = self.batches
        paused: set = set()
        while True:
            await asyncio.sleep(0)  # a fetch that returns at once does not yield: let the agents and the web server run
            # a stage holding a full batch's records is not fetched for; the others go on
            full = batches.full()
            pause = {tp for tp, (stage, _) in stage_of.items() if stage in full}
            if pause != paused:
                consumer.pause(*(pause - paused))
                consumer.resume(*(paused - pause))
                paused = pause
            room = batches.room()
            if room <= 0:
                fetched = {}
                await asyncio.sleep(0.02)  # full: wait for a busy stage to take its batch
            else:
                try:
                    fetched = await consumer.getmany(timeout_ms=batches.wait_ms(), max_records=room)
                except OffsetOutOfRangeError as exc:
                    tp, offset = next(iter(exc.args[0].items()))
                    raise InputWentBackError(
                        f"{tp.topic}-{tp.partition}: offset {offset}, where this worker's state goes on, is no longer in "
                        f"the log: the topic was recreated or the broker lost data. See docs/operations.md, \"When the "
                        f"input goes back\"") from None
            for tp, records in fetched.items():
                stage, src = stage_of[tp]
                batches.add(stage, (tp.topic, tp.partition), src, records)
            for tp in stage_of:
                self.positions[(tp.topic, tp.partition)] = await consumer.position(tp)
            await batches.dispatch()

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.offsets.close)

    async def process(self, items, stage: str) -> None:
        """One dispatched batch: every partition's records through the stage's step (each
        partition once, its own store), all their messages sent with one acknowledgement wait
        (exactly once: one transaction, with the progress record of each partition), then every
        state write committed: one broker round trip per batch, not per partition."""
        worker = self.worker
        results, again = worker.process_batch(stage, items)
        messages = [m for r in results for m in r.messages]
        if self.exactly_once:
            messages += [worker.progress_message(r) for r in results]
        elif stage == "stage1":  # at least once: what is about to go out, to send again as it was
            for r in results:
                if r.source.lanes:
                    r.source.write_plan(r.offsets())
        await self.publishers.send(messages, stage)  # bounded records and dead letters first,
        for r in results:  # then the state they cover
            r.commit()
        self.batches.hand_back(stage, again)

    async def fire(self, now: int) -> None:
        worker, publishers = self.worker, self.publishers
        # announce how far each owned input partition has been read (committed progress
        # only); stage 2 fires a trigger once every input partition is past it
        await publishers.send(worker.watermark_messages(now, self.read_to_end()))
        await self.noise_tables_built()
        for fired in worker.iter_fire_due(now):  # each published before the next is computed
            await self.publish([fired])
        # dynamic queries: every tick the clock has passed is decided, updates or not
        for key in worker.advance_dynamic(now, self.read_to_end()):
            await self.publish_dynamic(key)

    def read_to_end(self) -> dict:
        """Owned input (and dynamic update) partitions read to the end the broker last reported,
        every record fetched committed, with the time of that report (its fetch response). The
        end can be a transaction marker (an upstream producer's transactions), which no record
        holds: the consumer's position passes it."""
        consumer, worker = self.consumer, self.worker
        ends = {}
        if consumer is None:
            return ends
        for key, src in [*worker.stage1.items(), *worker.dynamic.items()]:
            tp = _tp(*key)
            high = consumer.highwater(tp)
            if high is None:
                continue
            committed = src.last_offset + 1
            position = self.positions.get(key, committed)
            if committed >= high or (position >= high and committed >= self.batches.fetched.get(key, 0)):
                ends[key] = consumer.last_poll_timestamp(tp)
        return ends

    def high_watermark(self, key):
        return self.consumer.highwater(_tp(*key)) if self.consumer is not None else None

    def broker_silence(self) -> float:
        """The freshest fetch response of any owned partition, or an acknowledged send."""
        consumer = self.consumer
        fetched = [consumer.last_poll_timestamp(tp) for tp in consumer.assignment()] if consumer is not None else []
        now_ms = time.time() * 1000
        return min([(now_ms - t) / 1000 for t in fetched if t] + [self.health.silence()])

    def read_offset(self, key, src) -> int:
        """As the monitoring offsets count it (:meth:`offsets_read`): past transaction markers
        once every record fetched is committed."""
        offset = src.last_offset + 1
        position = self.positions.get(key)
        return position if position is not None and position > offset >= self.batches.fetched.get(key, 0) else offset

    def offsets_read(self) -> dict:
        """Each owned partition's offset its committed state has read to, or the consumer's
        position when every record fetched from it is committed (the position passes
        transaction markers, which no record's offset stands for)."""
        worker = self.worker
        out = {}
        for key, src in [*worker.stage1.items(), *worker.stage2.items(), *worker.dynamic.items(), *worker.dynamic_shards.items(),
                         *worker.dynamic_units.items()]:
            offset = src.last_offset + 1
            position = self.positions.get(key)
            if position is not None and position > offset >= self.batches.fetched.get(key, 0):
                offset = position
            out[key] = offset
        return out

    async def commit_offsets(self) -> None:
        done = self.offsets.committed
        offsets = {k: o for k, o in self.offsets_read().items() if done.get(k) != o}
        if not offsets:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.offsets.commit(offsets))
        except Exception as exc:  # noqa: BLE001 - monitoring only: the worker goes on
            if not self.offsets.failing:
                log.warning("consumer offsets not committed to group %s (lag tools will not see this worker's "
                            "progress): %s", self.offsets.group, exc)
            self.offsets.failing = True
            return
        if self.offsets.failing:
            log.info("consumer offsets committed to group %s again", self.offsets.group)
        self.offsets.failing = False
        done.update(offsets)
