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
import time
from typing import Callable, Optional

from dpstream.topics.kafka import CHANGELOG_MAX_BYTES, OFFSETS_STEP, DeliveryError, KafkaPublisher

log = logging.getLogger("dpstream.worker")

ROLES = ("stage1", "stage2", "timer", "dynamic")
#: elastic workers: a transaction left open by a killed worker holds its partitions' new owner
#: (stable offsets, the changelog's end) until the broker aborts it after this long (Kafka
#: Streams uses 10 s under exactly-once); every transaction must finish within it
GROUP_TRANSACTION_TIMEOUT_MS = 15_000
#: s the group coordinator may take to accept a transaction's consumer offsets (it holds them
#: while the group rebalances; elastic workers)
OFFSETS_TIMEOUT_S = 10.0


class OffsetsRefusedError(DeliveryError):
    """A transaction's consumer offsets were not taken by the group coordinator: this worker is no
    longer the member that owns them (dropped from the group, its generation gone), or the group
    is rebalancing. Nothing of the transaction counts, and its partitions may be another worker's
    now or soon."""


#: errors no retry mends: the operator must act
_PERMANENT = {"TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED", "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
              "CLUSTER_AUTHORIZATION_FAILED", "_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "MSG_SIZE_TOO_LARGE",
              "_MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE", "INVALID_CONFIG", "_INVALID_ARG", "INVALID_RECORD",
              "_SSL", "UNSUPPORTED_FOR_MESSAGE_FORMAT"}
_MEMBERSHIP = {"UNKNOWN_MEMBER_ID", "FENCED_INSTANCE_ID"}
_GENERATION = {"ILLEGAL_GENERATION", "REBALANCE_IN_PROGRESS"}
_FENCED = {"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH"}


def failure_kind(exc: DeliveryError) -> str:
    """How a failed send is handled: ``membership``, ``generation`` (elastic workers' offsets),
    ``fenced`` (the producer's epoch moved: a transaction the broker aborted on its timeout, or
    another incarnation), ``permanent``, or ``transient`` (anything else: retried)."""
    # the name of the error raised, and the broker's error librdkafka quotes in its text (a
    # failed offset commit is raised as an abortable error naming ILLEGAL_GENERATION in its text)
    text = str(exc)
    names = {exc.code_name} | {n for n in _MEMBERSHIP | _GENERATION if f"({n})" in text or f": {n}" in text}
    for kind, group in (("membership", _MEMBERSHIP), ("generation", _GENERATION), ("permanent", _PERMANENT), ("fenced", _FENCED)):
        if names & group:
            return kind
    return "transient"


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
        whose metadata they carry.

        A failure is not the end of the worker (docs/operations.md, "Health"): the same batch goes
        again until it is committed, for up to ``--broker-timeout`` (a broker restart, a short
        outage, a coordinator that moved). A producer librdkafka declares unusable (a fatal error,
        or a transaction it could not abort) is created anew with the same transactional id, which
        fences the old one, as Kafka Streams does. Consumer offsets the group coordinator does not
        take (a rebalance moved the generation or is under way, or this worker is no longer a
        member) are never retried with the lock held: the rebalance may be waiting for this very
        lock (the group's callbacks hand partitions over under it), so the caller gets
        :class:`OffsetsRefusedError` at once and gives the batch up (elastic_run.py). Errors no
        retry can mend (authorization, a message too large) are raised at once."""
        batch = [(m.topic, m.value, m.key, m.partition) for m in messages]
        if not batch:
            return
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout
        fences = 0
        backoff = 0.2
        while True:
            meta = consumer.group_metadata() if offsets else None
            try:
                await loop.run_in_executor(None, lambda: self.producers[role].send(
                    batch, self.timeout, offsets=offsets, group=meta, offsets_timeout=OFFSETS_TIMEOUT_S))
                break
            except DeliveryError as exc:
                kind = failure_kind(exc)
                if self.producers[role].broken:
                    fences += kind == "fenced"
                    if fences > 1:
                        raise DeliveryError(f"{exc}; fenced again after the producer was created anew: another worker "
                                            f"runs with transactional id {self.producers[role].transactional_id}", exc.error) from None
                    await self._renew(role, deadline)
                if offsets and (kind in ("membership", "generation") or str(exc).startswith(OFFSETS_STEP)):
                    raise OffsetsRefusedError(str(exc), exc.error) from None
                if kind == "permanent" or time.monotonic() >= deadline:
                    raise
                log.warning("sending %s's batch failed (%s): sending it again", role, exc)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        self._heard()

    async def _renew(self, role: str, deadline: float) -> None:
        """A broken producer replaced by a new one with the same transactional id: its
        ``init_transactions`` fences the old one and aborts its open transaction."""
        old = self.producers[role]
        old.discard()
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.producers[role] = await loop.run_in_executor(None, self._transactional, role)
                log.info("%s's producer was created anew (%s)", role, old.transactional_id)
                return
            except DeliveryError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("creating %s's producer anew failed (%s): trying again", role, exc)
                await asyncio.sleep(1.0)

    async def wait_idle(self, role: str) -> None:
        """Until a send its (cancelled) caller left running has finished."""
        await asyncio.get_running_loop().run_in_executor(None, self.producers[role].wait_idle)

    def acknowledged(self, role: str) -> dict:
        return self.producers[role].acknowledged


def transactional_instance(group: bool, instance_id: str, index: Optional[int]) -> str:
    """The part of the transactional ids that names this worker (see :class:`RolePublishers`)."""
    return instance_id if group else str(index)
