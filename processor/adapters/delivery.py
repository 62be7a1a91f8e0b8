"""Who sends the worker's messages: one producer per role (docs/operations.md, "Delivery").

A role is one kind of batch the worker sends: stage 1's bounded records, stage 2's (and, for
elastic workers, the triggers') changelog, the timer's watermarks and releases, the dynamic
agent's counts. Exactly once, each role has its own transactional producer, so that a
transaction is one role's batch, and each transactional id fences its previous incarnation.
At least once, every role shares one plain producer. Each role has a lock: a batch is sent,
and the state it covers committed, before the role's next batch goes out.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from dpstream.topics.kafka import CHANGELOG_MAX_BYTES, DeliveryError, KafkaPublisher

log = logging.getLogger("dpstream.worker")

ROLES = ("stage1", "stage2", "timer", "dynamic")
#: elastic workers: a transaction left open by a killed worker holds its partitions' new owner
#: (stable offsets, the changelog's end) until the broker aborts it after this long (Kafka
#: Streams uses 10 s under exactly-once); every transaction must finish within it
GROUP_TRANSACTION_TIMEOUT_MS = 15_000
#: times a transaction refused for an old group generation is sent again (elastic workers)
GENERATION_RETRIES = 5


class RolePublishers:
    """The worker's producers, one per role, and the role locks."""

    def __init__(self, broker: str, app_id: str, delivery: str, assignment: str, instance: str, timeout: float,
                 heard: Callable[[], None] = lambda: None):
        self.broker, self.app_id, self.timeout = broker, app_id, timeout
        self.exactly_once = delivery == "exactly-once"
        self.group = assignment == "group"
        #: names this worker's transactional producers: its instance id (elastic workers: a
        #: restarted pod fences its earlier incarnation) or its worker index (static)
        self.instance = instance
        self._heard = heard  # the broker acknowledged something (health)
        self.producers: dict[str, KafkaPublisher] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def start(self) -> None:
        """Blocking: exactly once, each role's producer starts its transactions, fencing the
        previous incarnation of this worker (its open transactions abort)."""
        for role in ROLES:
            if self.group:
                self.producers[role] = self._transactional(role)
            elif self.exactly_once:
                self.producers[role] = self._transactional(role)
            else:
                self.producers[role] = self.producers.get("stage1") or KafkaPublisher(self.broker)

    def _transactional(self, role: str) -> KafkaPublisher:
        config = ({"message.max.bytes": CHANGELOG_MAX_BYTES + 1024 * 1024, "transaction.timeout.ms": GROUP_TRANSACTION_TIMEOUT_MS}
                  if self.group else None)
        return KafkaPublisher(self.broker, config, transactional_id=f"{self.app_id}-{self.instance}-{role}", timeout=self.timeout)

    def __getitem__(self, role: str) -> KafkaPublisher:
        return self.producers[role]

    def lock(self, role: str) -> asyncio.Lock:
        return self._locks.setdefault(role, asyncio.Lock())

    async def send(self, messages, role: str = "timer") -> None:
        """Send and wait until acknowledged (at least once) or committed as one transaction
        (exactly once), off the event loop; the caller commits state only after this."""
        async with self.lock(role):
            await self.send_locked(messages, role)

    async def send_locked(self, messages, role: str, offsets=None, consumer=None) -> None:
        """:meth:`send`, the caller holding the role's lock; ``offsets``: consumer offsets committed
        in the same transaction (elastic workers' fencing), with ``consumer`` the group member
        whose metadata they carry."""
        batch = [(m.topic, m.value, m.key, m.partition) for m in messages]
        if not batch:
            return
        loop = asyncio.get_running_loop()
        for attempt in range(GENERATION_RETRIES + 1):
            meta = consumer.group_metadata() if offsets else None
            try:
                await loop.run_in_executor(None, lambda: self.producers[role].send(batch, self.timeout, offsets=offsets, group=meta))
                break
            except DeliveryError as exc:
                # the group metadata is read by the poll thread (consumer_group.py): a rebalance
                # may have moved the generation since. The member is still in the group, and no
                # partition of ours can have moved: its hand-over waits for the lock we hold. So
                # the transaction (aborted) goes again with the new generation. An unknown member
                # (dropped from the group: its partitions may be another's now) is never retried
                if not offsets or "ILLEGAL_GENERATION" not in str(exc) or attempt == GENERATION_RETRIES:
                    raise
                log.info("a rebalance moved the group's generation during a transaction: sending it again")
                await consumer.metadata_after(meta)
        self._heard()

    async def wait_idle(self, role: str) -> None:
        """Until a send its (cancelled) caller left running has finished."""
        await asyncio.get_running_loop().run_in_executor(None, self.producers[role].wait_idle)

    def acknowledged(self, role: str) -> dict:
        return self.producers[role].acknowledged


def transactional_instance(group: bool, instance_id: str, index: Optional[int]) -> str:
    """The part of the transactional ids that names this worker (see :class:`RolePublishers`)."""
    return instance_id if group else str(index)
