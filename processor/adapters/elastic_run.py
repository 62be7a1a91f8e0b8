"""Elastic workers (``--assignment group``): partitions assigned by a consumer group, each
partition's state restored from its changelog before it is read, and every batch's state
changes, outputs and consumer offsets in one transaction (docs/operations.md, "Elastic
workers").
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from dpstream.processor.adapters.consumer_group import GroupConsumer
from dpstream.processor.adapters.stage_batches import STAGES
from dpstream.processor.adapters.worker_run import WorkerRun, group_id, log_positions
from dpstream.topics.kafka import read_changelog

log = logging.getLogger("dpstream.worker")


class _AllStageLocks:
    """Every stage's lock, taken in :data:`STAGES` order (never another: no deadlock)."""

    def __init__(self, publishers):
        self.publishers = publishers

    async def __aenter__(self):
        for role in STAGES:
            await self.publishers.lock(role).acquire()

    async def __aexit__(self, *exc):
        for role in reversed(STAGES):
            self.publishers.lock(role).release()


class ElasticRun(WorkerRun):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owned: dict = {}  # (topic, partition) -> (stage, source)
        #: each owned partition's (high watermark, time asked)
        self.highs: dict = {}

    # ------------------------------------------------------------------ transactions
    async def transact(self, role: str, sources, messages, offsets: Optional[dict] = None, fence: bool = True) -> None:
        """The role's lock held: ``messages``, every change the stores of ``sources`` made since
        their last transaction (their changelog records) and their consumer offsets, in one
        transaction; then each store's checkpoint. A worker that lost one of these partitions in
        a rebalance cannot commit it. ``fence=False``: no consumer offsets, for the changes a
        worker makes while the group waits on it (gaining or giving up a partition), which no
        other worker can own meanwhile."""
        from confluent_kafka import TopicPartition

        worker = self.worker
        changes, taken = worker.changelog_messages(sources)
        if not messages and not changes:
            return
        at = {(src.topic, src.partition): src.last_offset + 1 for src in sources}
        at.update(offsets or {})
        tps = [TopicPartition(t, p, max(0, o)) for (t, p), o in at.items()] if fence else None
        await self.publishers.send_locked(list(messages) + changes, role, tps, self.consumer)
        worker.checkpoint(taken, self.publishers.acknowledged(role), int(time.time() * 1000))

    async def process(self, items, stage: str) -> None:
        """The state first, then one transaction with its changelog, the outputs and the
        consumer offsets, then the records count as read (watermarks); partitions lost since
        these records were fetched are left to their new owner."""
        worker, step = self.worker, self.step(stage)
        async with self.publishers.lock(stage):
            results = [r for topic, partition, records, source in items
                       if worker.source_of((topic, partition)) is source and (r := step(topic, partition, records)) is not None]
            for r in results:
                r.write()
            await self.transact(stage, [r.source for r in results], [m for r in results for m in r.messages],
                                {(r.source.topic, r.source.partition): r.last_offset + 1 for r in results})
            for r in results:
                r.acknowledge()

    async def fire(self, now: int) -> None:
        """As for static ownership, but each trigger's state (its journal, published mark and
        opened windows) goes out in the transaction of its releases, under the stage-2 lock, so
        that a partition moving to another worker carries either all of a trigger or none of it."""
        worker, publishers = self.worker, self.publishers
        ends = await self.read_to_end()
        await publishers.send(worker.watermark_messages(now, ends))
        if worker.charges is not None:
            worker.charges.charge_due(now)
        for key, source in list(worker.stage2.items()):
            while True:
                async with publishers.lock("stage2"):
                    if worker.stage2.get(key) is not source:
                        break  # moved to another worker meanwhile
                    fired = worker.fire_next(source, now)
                    if fired is None:
                        break
                    worker.mark_published(fired)
                    await self.transact("stage2", [source], worker.release_messages(fired))
                    worker.trigger_fired(fired)
                await asyncio.sleep(0)  # one trigger at a time: probes and stage 2 go on
        async with publishers.lock("dynamic"):
            due, letters = worker.advance_dynamic(now, ends)
            messages = list(letters)
            for key in due:
                messages += worker.dynamic_releases(key)
                worker.mark_dynamic_published(key)
            await self.transact("dynamic", list(worker.dynamic.values()), messages)

    async def read_to_end(self) -> dict:
        """Each owned input and update partition's high watermark is asked of the broker; one
        the worker has read and committed up to counts as read to its end at the time just
        before it asked."""
        gc, worker = self.consumer, self.worker
        keys = [*worker.stage1, *worker.dynamic]
        if gc is None:
            return {}
        try:
            # no input partition owned: the question still tells the broker answers (watch_broker)
            highs = await asyncio.get_running_loop().run_in_executor(None, lambda: gc.log_ends(keys) if keys else gc.ping())
        except Exception as exc:  # noqa: BLE001 - the broker may be away: watch_broker handles that
            log.debug("log ends not known: %s", exc)
            return {}
        self.health.heard_from_broker()
        self.highs = highs
        ends = {}
        for key, (high, asked) in highs.items():
            src = worker.source_of(key)
            if src is None:
                continue
            committed = src.last_offset + 1
            position = gc.position(key)
            if committed >= high or (position is not None and position >= high and committed >= self.batches.fetched.get(key, 0)):
                ends[key] = asked
        return ends

    def high_watermark(self, key):
        return self.highs.get(key, (None,))[0]

    # ------------------------------------------------------------------ the group
    async def consume(self, loop) -> None:
        """Read what the consumer group assigns. A gained partition's store is restored from its
        changelog before the partition is assigned, at the offset the restored state has read to."""
        s, worker = self.s, self.worker
        gc = GroupConsumer(self.broker, group_id(s.app_id), worker.source_topics(), loop, self.gain, self.lose,
                           s.session_timeout, s.heartbeat_interval)
        self.consumer = gc
        self.health.heard_from_broker()
        self.health.set("ready")
        log.info("dpstream worker %s ready: joined consumer group %s", s.instance_id, group_id(s.app_id))
        batches = self.batches
        while True:
            await asyncio.sleep(0)  # let the agents and the web server run
            room = batches.room()
            if room <= 0:
                await asyncio.sleep(0.02)  # full: wait for a busy stage to take its batch
                fetched = {}
            else:
                fetched = await gc.fetch(room, batches.wait_ms() / 1000)
            for key, records in fetched.items():
                entry = self.owned.get(key)
                if entry is not None:  # not a partition given up meanwhile
                    batches.add(entry[0], key, entry[1], records)
            await batches.dispatch()

    async def close(self) -> None:
        if self.consumer is not None:  # hands over its partitions (on this loop) before it leaves
            await asyncio.get_running_loop().run_in_executor(None, self.consumer.close)

    async def gain(self, keys: list) -> dict:
        loop, worker, gc = asyncio.get_running_loop(), self.worker, self.consumer
        self.health.set("restoring", f"restoring {len(keys)} gained partitions from their changelogs")
        # a previous owner's last transaction settled first (stable offsets, KIP-447): its
        # changelog records are then below the end the restore reads to
        committed = await loop.run_in_executor(None, lambda: gc.committed(keys))
        now = int(time.time() * 1000)
        stores = {}
        for topic, partition in keys:
            changelog = worker.changelog_topic(topic)

            def reader(start, changelog=changelog, partition=partition):
                return read_changelog(self.broker, changelog, partition, start)

            stores[(topic, partition)] = await loop.run_in_executor(None, lambda t=topic, p=partition: worker.restore(t, p, reader, now))
        async with _AllStageLocks(self.publishers):
            gained = [worker.add_source(t, p, stores[(t, p)]) for t, p in keys]
        positions = await loop.run_in_executor(None, lambda: log_positions(self.broker, gained))
        offsets = {}
        for src in gained:
            key = (src.topic, src.partition)
            start, end, topic_id = positions[key]
            src.check_log(start, end, topic_id)  # a log that went back: refused (InputWentBackError)
            if src.last_offset + 1 < start:
                log.error("%s: records at offsets %d to %d were deleted (retention) before they were read; going on from "
                          "offset %d", src.name, src.last_offset + 1, start - 1, start)
            offsets[key] = max(src.last_offset + 1, start)
            if committed.get(key, -1) > src.last_offset + 1:
                log.error("%s: the group committed offset %d, but the restored state has read only to %d: its changelog "
                          "lost records", src.name, committed[key], src.last_offset)
            self.owned[key] = (self.stage_of(key), src)
        # what opening them wrote (noise and topic-id marks) goes to their changelogs now, so
        # that their stores stay at a checkpoint (an incremental restore when they come back)
        for role in STAGES:
            mine = [src for src in gained if self.stage_of((src.topic, src.partition)) == role]
            async with self.publishers.lock(role):
                await self.transact(role, mine, [], fence=False)
        log.info("gained %d partitions: %s", len(keys), ", ".join(f"{t}-{p}" for t, p in keys))
        self.health.heard_from_broker()  # it did, all along the restore
        self.health.set("ready")
        return offsets

    async def lose(self, keys: list) -> None:
        worker = self.worker
        async with _AllStageLocks(self.publishers):
            for key in keys:
                entry = self.owned.pop(key, None)
                self.batches.drop(key)
                if entry is None:
                    continue
                source = entry[1]
                # what its store wrote since its last transaction goes out before it moves
                role = self.stage_of(key)
                # a send its (cancelled) agent left running finishes first
                await self.publishers.wait_idle(role)
                try:
                    # only what the worker wrote on gaining it is not on the changelog yet
                    # (every batch and trigger goes out with its changes): while the group
                    # waits on this hand-over, no offsets (the coordinator may not take them now)
                    await self.transact(role, [source], [], fence=False)
                except Exception as exc:  # noqa: BLE001 - its next owner rebuilds the store in full
                    log.warning("%s: its last changes were not sent (%s); its next owner restores it in full", source.name, exc)
                worker.remove_source(*key)
        log.info("gave up %d partitions: %s", len(keys), ", ".join(f"{t}-{p}" for t, p in keys))

    def broker_silence(self) -> float:
        """The timer asks the broker for the log ends at every tick (read_to_end): its answers,
        and acknowledged transactions, count."""
        return self.health.silence()

