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
from dpstream.processor.adapters.delivery import TransactionAbandonedError, failure_kind
from dpstream.processor.adapters.partition_reader import OwnedPartitionReader
from dpstream.processor.adapters.stage_batches import STAGES
from dpstream.processor.adapters.worker_run import WorkerRun, group_id, log_positions
from dpstream.topics.kafka import changelog_ends_client, read_changelog

log = logging.getLogger("dpstream.worker")

#: s a partition taken up again after a refused transaction may wait for its changelog's end (a
#: new owner's open transaction holds it back: then the group is moving it away anyway)
REGAIN_TIMEOUT_S = 20.0
#: s a partition's read position must stay put before settle_offsets commits it (an idle partition)
SETTLE_IDLE_S = 5.0
#: s settle_offsets waits after any transaction of this worker failed: an offsets commit may wait
#: on the group coordinator for its whole timeout, holding the stage's lock, and a coordinator
#: just back from a broker restart is when it would
SETTLE_BACKOFF_S = 60.0


class _AllStageLocks:
    """Every stage's lock, taken in :data:`STAGES` order (never another: no deadlock)."""

    def __init__(self, publishers, waiter: str = ""):
        self.publishers, self.waiter = publishers, waiter

    async def __aenter__(self):
        for role in STAGES:
            await self.publishers.lock(role).acquire(self.waiter)

    async def __aexit__(self, *exc):
        for role in reversed(STAGES):
            self.publishers.lock(role).release()


class ElasticRun(WorkerRun):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owned: dict = {}  # (topic, partition) -> (stage, source)
        #: each owned partition's (high watermark, time asked)
        self.highs: dict = {}
        #: per partition, bumped whenever it is gained, given up or lost: a pending regain
        #: (:meth:`give_up_batch`) of an older turn is stale
        self.turns: dict = {}
        #: held through a gain's or a regain's restores: never two restores of one store at once
        self.restoring = asyncio.Lock()
        #: reads the owned partitions and the by-user partitions of the owned input partitions
        self.reader = OwnedPartitionReader(self.broker)
        #: (topic, partition) -> the offset a gained partition is read from first (its state's,
        #: or the log's start past records retention deleted)
        self.read_from: dict = {}
        #: (topic, partition) -> the consumer offset this worker's last transaction committed for it
        self.committed_at: dict = {}
        #: (topic, partition) -> (its read offset, monotonic time first seen there): settle_offsets
        self.settle_seen: dict = {}
        #: monotonic time before which settle_offsets does nothing (after a failed transaction)
        self.settle_after = 0.0
        #: gained partitions whose group offset is past their restored state's: (that offset, source),
        #: checked against the first records fetched (:meth:`check_committed_past`)
        self.committed_past: dict = {}

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
        if fence:
            self.committed_at.update(at)
        worker.checkpoint(taken, self.publishers.acknowledged(role), int(time.time() * 1000))

    async def settle_offsets(self) -> None:
        """Commit the reader's position of each owned partition whose every fetched record is
        committed, when it is past the committed offset: a transaction's commit marker takes an
        offset no record stands for, so the group's lag (as kafka-consumer-groups counts it)
        would stay at 1 per partition of a transactional topic forever. Offsets only, in a
        transaction of the partition's stage (fenced as every commit is, KIP-447); once per
        change, so an idle worker writes nothing periodic (docs/operations.md, "Consumer offsets").
        Only partitions idle for :data:`SETTLE_IDLE_S`, with the broker answering, and not within
        :data:`SETTLE_BACKOFF_S` of a failed transaction: such a commit holds the stage's lock
        while it waits on the group coordinator, and a busy partition's own transactions commit
        its offsets anyway."""
        from confluent_kafka import TopicPartition

        worker, due, now = self.worker, {}, time.monotonic()
        if now < self.settle_after or self.health.silence() > SETTLE_IDLE_S:
            return
        for key, (stage, src) in list(self.owned.items()):
            target = self.read_offset(key, src)
            seen = self.settle_seen.get(key)
            if seen is None or seen[0] != target:
                self.settle_seen[key] = (target, now)
                continue
            if now - seen[1] >= SETTLE_IDLE_S and target > self.committed_at.get(key, src.last_offset + 1):
                due.setdefault(stage, {})[key] = (src, target)
        for stage, entries in due.items():
            async with self.publishers.lock(stage):
                current = {k: t for k, (src, t) in entries.items() if worker.source_of(k) is src}
                if not current:
                    continue
                try:
                    await self.publishers.send_locked([], stage, [TopicPartition(t, p, o) for (t, p), o in current.items()],
                                                      self.consumer)
                except TransactionAbandonedError as exc:  # nothing to give up: tried again after the backoff
                    log.debug("offsets past transaction markers not committed: %s", exc)
                    self.settle_after = time.monotonic() + SETTLE_BACKOFF_S
                    continue
                self.committed_at.update(current)

    async def process(self, items, stage: str) -> None:
        """The state first, then one transaction with its changelog, the outputs and the
        consumer offsets, then the records count as read (watermarks); partitions lost since
        these records were fetched are left to their new owner."""
        worker = self.worker
        async with self.publishers.lock(stage):
            # not a partition given up since these records were fetched
            results, again = worker.process_batch(stage, [it for it in items if worker.source_of((it[0], it[1])) is it[3]])
            for r in results:
                r.write()
            try:
                await self.transact(stage, [r.source for r in results], [m for r in results for m in r.messages],
                                    {(r.source.topic, r.source.partition): r.last_offset + 1 for r in results})
            except TransactionAbandonedError as exc:
                self.give_up_batch([r.source for r in results], exc)
                return
            for r in results:
                r.acknowledge()
            self.batches.hand_back(stage, again)

    async def fire(self, now: int) -> None:
        """As for static ownership, but each trigger's state (its journal, published mark and
        opened windows) goes out in the transaction of its releases, under the stage-2 lock, so
        that a partition moving to another worker carries either all of a trigger or none of it."""
        worker, publishers = self.worker, self.publishers
        ends = await self.read_to_end()
        await publishers.send(worker.watermark_messages(now, ends))
        if worker.charges is not None:
            worker.charges.charge_due(now)
        await self.noise_tables_built()
        for key, source in list(worker.stage2.items()):
            while True:
                async with publishers.lock("stage2"):
                    if worker.stage2.get(key) is not source:
                        break  # moved to another worker meanwhile
                    fired = worker.fire_next(source, now)
                    if fired is None:
                        break
                    worker.mark_published(fired)
                    try:
                        await self.transact("stage2", [source], worker.release_messages(fired))
                    except TransactionAbandonedError as exc:
                        self.give_up_batch([source], exc)  # fired again from the restored state, same values
                        break
                    worker.trigger_fired(fired)
                await asyncio.sleep(0)  # one trigger at a time: probes and stage 2 go on
        async with publishers.lock("dynamic"):
            messages = []
            for key in worker.advance_dynamic(now, ends):
                messages += worker.dynamic_releases(key)
                worker.mark_dynamic_published(key)
            sources = [worker.source_of(key) for key in worker.dynamic_states]
            try:
                await self.transact("dynamic", sources, messages)
            except TransactionAbandonedError as exc:
                self.give_up_batch(sources, exc)
        await self.settle_offsets()

    async def read_to_end(self) -> dict:
        """Each owned input and update partition's high watermark is asked of the broker; one
        the worker has read and committed up to counts as read to its end at the time just
        before it asked."""
        gc, worker = self.consumer, self.worker
        # the by-key partitions' ends too: their lag on the status page (partition_status)
        keys = [*worker.stage1, *worker.dynamic, *worker.stage2, *worker.dynamic_shards, *worker.dynamic_units]
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
            if src is None or key in worker.stage2 or key in worker.dynamic_shards or key in worker.dynamic_units:
                continue
            committed = src.last_offset + 1
            position = self.reader.position(key)
            if committed >= high or (position is not None and position >= high and committed >= self.batches.fetched.get(key, 0)):
                ends[key] = asked
        return ends

    def high_watermark(self, key):
        return self.highs.get(key, (None,))[0]

    def read_offset(self, key, src) -> int:
        """Past transaction markers once every record fetched is committed (the reader's position)."""
        offset = src.last_offset + 1
        position = self.reader.position(key)
        return position if position is not None and position > offset >= self.batches.fetched.get(key, 0) else offset

    # ------------------------------------------------------------------ the group
    async def consume(self, loop) -> None:
        """Read what the consumer group assigns. A gained partition's store is restored from its
        changelog before the partition is assigned, at the offset the restored state has read to."""
        s, worker = self.s, self.worker
        gc = GroupConsumer(self.broker, group_id(s.app_id), worker.source_topics(), loop, self.gain, self.lose,
                           s.session_timeout, s.heartbeat_interval, on_lost=self.lost)
        self.consumer = gc
        await self.reader.start()
        self.health.heard_from_broker()
        self.health.set("ready")
        log.info("dpstream worker %s ready: joined consumer group %s", s.instance_id, group_id(s.app_id))
        membership = loop.create_task(self._keep_membership(gc))
        try:
            await self._read(membership)
        finally:
            membership.cancel()

    async def _keep_membership(self, gc: GroupConsumer) -> None:
        while True:
            await gc.poll(0.2)

    async def _read(self, membership: asyncio.Task) -> None:
        """Fetch what the worker owns now (partition_reader.py) into the stages' batches."""
        worker, batches, reader = self.worker, self.batches, self.reader
        while True:
            if membership.done():
                membership.result()  # a rebalance callback failed: the worker stops
            await asyncio.sleep(0)  # let the agents and the web server run
            owned = {key: entry[1] for key, entry in self.owned.items()}
            reader.follow(owned, worker.lanes, batches, self.read_from)
            # a stage holding a full batch's records is not fetched for; the others go on
            full = batches.full()
            reader.pause_only({key for key in reader.sources if self.stage_of(key) in full} if full else set())
            room = batches.room()
            if room <= 0:
                await asyncio.sleep(0.02)  # full: wait for a busy stage to take its batch
            fetched = await reader.fetch(room, batches.wait_ms()) if room > 0 else {}
            for key, (source, records) in fetched.items():
                entry = self.owned.get(key)
                if entry is not None:
                    if entry[1] is source:  # not given up nor taken up again while fetching
                        self.check_committed_past(key, source, records)
                        batches.add(entry[0], key, source, records)
                elif worker.lanes.get(key) is source:  # a by-user partition, its input partition still here
                    batches.add("stage1", key, source, records)
            await batches.dispatch()

    def check_committed_past(self, key, source, records) -> None:
        """A gained partition's first records: one before the offset the group committed was
        read by a previous owner, whose changelog should have carried it into the restored state."""
        committed, src = self.committed_past.pop(key, (None, None))
        if src is source and records and records[0].offset < committed:
            log.error("%s: the group committed offset %d, but the restored state has read only to %d: its changelog "
                      "lost records", src.name, committed, src.last_offset)

    async def close(self) -> None:
        if self.consumer is not None:  # hands over its partitions (on this loop) before it leaves
            await asyncio.get_running_loop().run_in_executor(None, self.consumer.close)
        await self.reader.close()

    async def gain(self, keys: list) -> dict:
        async with self.restoring:
            return await self._gain(keys)

    async def _gain(self, keys: list) -> dict:
        loop, worker, gc = asyncio.get_running_loop(), self.worker, self.consumer
        held = {k: self.owned[k][1].last_offset + 1 for k in keys if k in self.owned}  # taken up again already
        keys = [k for k in keys if k not in held]
        if not keys:
            return held
        self.health.set("restoring", f"restoring {len(keys)} gained partitions from their changelogs")
        # a previous owner's last transaction settled first (stable offsets, KIP-447): its
        # changelog records are then below the end the restore reads to
        committed = await loop.run_in_executor(None, lambda: gc.committed(keys))
        now = int(time.time() * 1000)
        stores = {}
        ends = await loop.run_in_executor(None, changelog_ends_client, self.broker)  # one for all their end offsets
        try:
            for topic, partition in keys:
                changelog = worker.changelog_topic(topic)

                def reader(start, changelog=changelog, partition=partition):
                    return read_changelog(self.broker, changelog, partition, start, ends=ends)

                stores[(topic, partition)] = await loop.run_in_executor(None, lambda t=topic, p=partition: worker.restore(t, p, reader, now))
        finally:
            await loop.run_in_executor(None, ends.close)
        positions = await loop.run_in_executor(None, log_positions, self.broker, keys)
        offsets = {}
        # one step with no await: a source the worker can read (its by-user partitions are read
        # as soon as it is added) is owned at once, with its turn, so that a failed batch of it
        # is given up and taken up again like any other (give_up_batch, _regain)
        async with _AllStageLocks(self.publishers):
            gained = [worker.add_source(t, p, stores[(t, p)]) for t, p in keys]
            for src in gained:
                key = (src.topic, src.partition)
                start, end, topic_id = positions[key]
                src.check_log(start, end, topic_id)  # a log that went back: refused (InputWentBackError)
                if src.last_offset + 1 < start:
                    log.error("%s: records at offsets %d to %d were deleted (retention) before they were read; going on from "
                              "offset %d", src.name, src.last_offset + 1, start - 1, start)
                offsets[key] = self.read_from[key] = max(src.last_offset + 1, start)
                if committed.get(key, -1) > src.last_offset + 1:
                    # transaction markers and aborted records between are no loss (settle_offsets commits
                    # past them): only a committed record the state has not read is
                    self.committed_past[key] = (committed[key], src)
                self.owned[key] = (self.stage_of(key), src)
                self.turns[key] = self.turns.get(key, 0) + 1
        # what opening them wrote (noise and topic-id marks) goes to their changelogs now, so
        # that their stores stay at a checkpoint (an incremental restore when they come back);
        # a source given up meanwhile (its batch failed) was rolled back: nothing of it to send
        for role in STAGES:
            async with self.publishers.lock(role):
                mine = [src for src in gained if self.stage_of((src.topic, src.partition)) == role
                        and worker.source_of((src.topic, src.partition)) is src]
                await self.transact(role, mine, [], fence=False)
        log.info("gained %d partitions: %s", len(keys), ", ".join(f"{t}-{p}" for t, p in keys))
        self.health.heard_from_broker()  # it did, all along the restore
        self.health.set("ready")
        return {**offsets, **held}

    async def lose(self, keys: list) -> None:
        worker = self.worker
        async with _AllStageLocks(self.publishers, "handing partitions over"):
            for key in keys:
                entry = self.owned.pop(key, None)
                self.batches.drop(key)
                self.turns[key] = self.turns.get(key, 0) + 1
                self.read_from.pop(key, None)
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

    async def lost(self, keys: list) -> None:
        """Partitions taken away without a hand-over: this worker was dropped from the group
        (its session timed out). Another worker may own them already, so nothing is sent for
        them: what their stores wrote since their last committed transaction is undone, and the
        stores stay on this volume at that checkpoint, for an incremental restore should they
        come back (state/changelog.py). Librdkafka rejoins the group next."""
        async with _AllStageLocks(self.publishers, "giving up lost partitions"):
            for key in keys:
                self.turns[key] = self.turns.get(key, 0) + 1
                self.batches.drop(key)
                entry = self.owned.pop(key, None)
                self.read_from.pop(key, None)
                if entry is not None:
                    entry[1].store.rollback()
                    self.worker.remove_source(*key)
        log.info("lost %d partitions: %s", len(keys), ", ".join(f"{t}-{p}" for t, p in keys))

    def give_up_batch(self, sources, exc: BaseException) -> None:
        """A batch's transaction failed and was abandoned (:class:`TransactionAbandonedError`: the
        group coordinator did not take its consumer offsets, a rebalance under way or done, this
        worker dropped from the group; or the broker did not commit it in time). Nothing of it
        counts: the stores' writes since their checkpoint are
        undone and the partitions given up here, at once, under the caller's lock, which a
        rebalance callback may be waiting for. If the group still assigns them to this worker
        they are taken up again from their changelog (a short, incremental restore) and read
        again from the restored offset; if not, the group's callbacks hand them to their new
        owner (docs/operations.md, "Elastic workers")."""
        worker = self.worker
        self.settle_after = time.monotonic() + SETTLE_BACKOFF_S  # no offsets-only commits meanwhile
        keys = []
        for src in sources:
            key = (src.topic, src.partition)
            if worker.source_of(key) is not src:
                continue
            src.store.rollback()
            self.batches.drop(key)
            self.owned.pop(key, None)
            worker.remove_source(*key)
            keys.append(key)
        if keys:
            # a generation that moved on is a rebalance, routine while workers join or leave: an
            # INFO line (docs/operations.md, "Elastic workers"); anything else is worth a warning
            rebalanced = isinstance(exc, TransactionAbandonedError) and failure_kind(exc) == "generation"
            log.log(logging.INFO if rebalanced else logging.WARNING,
                    "a transaction for %s failed (%s): %stheir state goes back to its last commit, and they are read again "
                    "from there", ", ".join(f"{t}-{p}" for t, p in keys), exc, "the group rebalanced meanwhile; " if rebalanced else "")
            turns = {key: self.turns.get(key, 0) for key in keys}
            asyncio.get_running_loop().create_task(self._regain_or_stop(turns))

    async def _regain_or_stop(self, turns: dict) -> None:
        try:
            await self._regain(turns)
        except Exception as exc:  # noqa: BLE001 - an assigned partition left unread would stall its triggers
            await self.crash(exc)

    async def _regain(self, turns: dict) -> None:
        """Take up again partitions given up by :meth:`give_up_batch` that the group still
        assigns to this worker (and that no rebalance moved since: their turn is unchanged). The
        restore reads what the changelog holds past the stores' checkpoint (usually nothing), and
        is tried again while the broker does not answer (the broker watch stops the worker after
        --broker-timeout)."""
        loop, worker = asyncio.get_running_loop(), self.worker

        def current() -> list:
            # assigned, or being assigned: a batch of a partition just gained can fail before
            # librdkafka counts the partition assigned (the gain runs in its on_assign callback);
            # such a partition must be taken up again too, or no one reads it
            group = self.consumer
            return [k for k, turn in turns.items()
                    if self.turns.get(k, 0) == turn and k not in self.owned and (k in group.assigned or k in group.assigning)]

        async with self.restoring:  # after a gain under way: then the partitions it gained are assigned
            stores: dict = {}
            while True:
                keys = [k for k in current() if k not in stores]
                if not keys:
                    break
                now = int(time.time() * 1000)
                try:
                    for topic, partition in keys:
                        changelog = worker.changelog_topic(topic)

                        def reader(start, changelog=changelog, partition=partition):
                            return read_changelog(self.broker, changelog, partition, start, timeout=REGAIN_TIMEOUT_S)

                        stores[(topic, partition)] = await loop.run_in_executor(
                            None, lambda t=topic, p=partition: worker.restore(t, p, reader, now))
                except Exception as exc:  # noqa: BLE001 - the broker may be away: again in a while
                    log.warning("taking up %s-%d again failed (%s): trying again", topic, partition, exc)
                    await asyncio.sleep(1.0)
            async with _AllStageLocks(self.publishers):
                taken = []
                for key, store in stores.items():
                    if key not in current():  # moved meanwhile: its store stays at its checkpoint
                        worker.stores.release(f"{key[0]}-{key[1]}")
                        continue
                    src = worker.add_source(*key, store)  # a new source: read again from its state's offset
                    self.owned[key] = (self.stage_of(key), src)
                    self.turns[key] = self.turns.get(key, 0) + 1
                    taken.append(key)
        if taken:
            log.info("took up %d partitions again: %s", len(taken), ", ".join(f"{t}-{p}" for t, p in taken))

    def broker_silence(self) -> float:
        """The timer asks the broker for the log ends at every tick (read_to_end): its answers,
        and acknowledged transactions, count."""
        return self.health.silence()

