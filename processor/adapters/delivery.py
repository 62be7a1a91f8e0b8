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
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

from dpstream.processor.adapters.health import BROKER_WAIT_S
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
#: s a broken producer's replacement may take to start its transactions (one attempt)
RENEW_TIMEOUT_S = 10.0


class TransactionAbandonedError(DeliveryError):
    """An elastic worker's transaction (with consumer offsets) failed and was not sent again: the
    group coordinator did not take its offsets (a rebalance under way or done, this worker dropped
    from the group), or the broker did not commit it in time. Nothing of it counts (an aborted
    transaction; or, if it did commit after all, the changelog says so to the restore that takes
    its partitions up again), and its partitions may be another worker's now or soon."""


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


class RoleLock:
    """A role's lock that knows who holds it: a wait of more than ``LOCK_WAIT_REPORT_S`` logs the
    holder's task and where it is (what a rebalance callback, which must finish within its
    timeout, is waiting for)."""

    def __init__(self, role: str):
        self.role = role
        self._lock = asyncio.Lock()
        self.holder: Optional[asyncio.Task] = None

    def locked(self) -> bool:
        return self._lock.locked()

    async def acquire(self, waiter: str = "") -> None:
        # no wait_for: a timeout racing the grant would leave the lock held by nobody
        report = asyncio.get_running_loop().call_later(LOCK_WAIT_REPORT_S, self._report, waiter or "a task")
        try:
            await self._lock.acquire()
        finally:
            report.cancel()
        self.holder = asyncio.current_task()

    def _report(self, waiter: str) -> None:
        log.warning("%s has waited %g s for the %s lock, held by %s", waiter, LOCK_WAIT_REPORT_S, self.role, _where(self.holder))

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    async def __aenter__(self):
        await self.acquire()

    async def __aexit__(self, *exc):
        self.release()


def _where(task: Optional[asyncio.Task]) -> str:
    """The task and the chain of coroutines it is awaiting in, innermost last."""
    if task is None:
        return "no task"
    where, coro = [], task.get_coro()
    while coro is not None and len(where) < 16:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        nxt = (getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
               or getattr(coro, "it", None))  # faust's Actor awaits its agent coroutine as .it
        if nxt is None and frame is None:
            where.append(type(coro).__name__)
        coro = nxt
    return f"{task.get_name()} in " + " -> ".join(where)


#: s a task waits for a role's lock before it says who holds it (and goes on waiting)
LOCK_WAIT_REPORT_S = 15.0
#: how often a running send is looked at, and how long past its offsets timeout it may run
STUCK_CHECK_S, STUCK_GRACE_S = 0.5, 5.0


class SendThread:
    """One daemon thread running a role's blocking producer calls in turn (an executor for
    ``run_in_executor``). Daemon: one left stuck in librdkafka (an abandoned send) neither keeps
    the process from exiting nor delays the next send, which goes to a new thread."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

    def shutdown(self, wait: bool = False) -> None:
        self._calls.put(None)  # ends after the running call (if it ever returns)


class RolePublishers:
    """The worker's producers, one per role, and the role locks."""

    def __init__(self, broker: str, app_id: str, delivery: str, assignment: str, instance: str, timeout: float,
                 heard: Callable[[], None] = lambda: None, silence: Callable[[], float] = lambda: 0.0):
        self.broker, self.app_id, self.timeout = broker, app_id, timeout
        self.exactly_once = delivery == "exactly-once"
        self.group = assignment == "group"
        #: names this worker's transactional producers: its instance id (elastic workers: a
        #: restarted pod fences its earlier incarnation) or its worker index (static)
        self.instance = instance
        self._heard = heard  # the broker acknowledged something (health)
        self._silence = silence  # s since the broker last answered anything (health)
        self.producers: dict[str, KafkaPublisher] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._executors: dict[str, SendThread] = {}
        #: sends abandoned so far (:meth:`_attempt`), each leaving a thread and a producer behind
        self.abandoned = 0

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

    def _transactional(self, role: str, timeout: Optional[float] = None) -> KafkaPublisher:
        config = ({"message.max.bytes": CHANGELOG_MAX_BYTES + 1024 * 1024, "transaction.timeout.ms": GROUP_TRANSACTION_TIMEOUT_MS}
                  if self.group else None)
        return KafkaPublisher(self.broker, config, transactional_id=f"{self.app_id}-{self.instance}-{role}",
                              timeout=self.timeout if timeout is None else timeout)

    def __getitem__(self, role: str) -> KafkaPublisher:
        return self.producers[role]

    def lock(self, role: str) -> "RoleLock":
        return self._locks.setdefault(role, RoleLock(role))

    async def send(self, messages, role: str = "timer") -> None:
        """Send and wait until acknowledged (at least once) or committed as one transaction
        (exactly once), off the event loop; the caller commits state only after this."""
        async with self.lock(role):
            await self.send_locked(messages, role)

    async def send_locked(self, messages, role: str, offsets=None, consumer=None) -> None:
        """:meth:`send`, the caller holding the role's lock; ``offsets``: consumer offsets committed
        in the same transaction (elastic workers' fencing), with ``consumer`` the group member
        whose metadata they carry.

        A failure is not the end of the worker (docs/operations.md, "Health"). A producer
        librdkafka declares unusable (a fatal error, a transaction it could not abort) is created
        anew with the same transactional id, which fences the old one, as Kafka Streams does.

        * Without offsets (static workers, the timer's watermarks, hand-overs) the same batch goes
          again until it is committed (a broker restart, a short outage, a coordinator that
          moved). While the broker is silent the broker watch decides when to give up
          (``--broker-timeout`` of silence); a send that keeps failing for that long while the
          broker answers is raised.
        * With offsets (an elastic worker's batch or trigger) one attempt is made, bounded by the
          transaction timeout: a failure raises :class:`TransactionAbandonedError` at once. The
          lock is never held through retries, because the group may be waiting for it: a
          rebalance hands partitions over under it, and a member dropped from the group gives
          them up under it (elastic_run.py gives the batch up and takes it up again).

        Errors no retry can mend (authorization, a message too large) are raised at once."""
        batch = [(m.topic, m.value, m.key, m.partition) for m in messages]
        if not batch and not offsets:  # offsets alone: an elastic worker's commit past transaction markers
            return
        attempt_timeout = GROUP_TRANSACTION_TIMEOUT_MS / 1000 if self.group else self.timeout
        first_failure = None
        fences = 0
        backoff = 0.2
        while True:
            try:
                if self.producers[role].broken:
                    await self._renew(role)
                meta = consumer.group_metadata() if offsets else None
                await self._attempt(role, lambda p: p.send(batch, attempt_timeout, offsets=offsets, group=meta,
                                                           offsets_timeout=OFFSETS_TIMEOUT_S))
                break
            except DeliveryError as exc:
                kind = failure_kind(exc)
                first_failure = time.monotonic() if first_failure is None else first_failure
                if kind == "fenced" and self.producers[role].broken:
                    fences += 1
                    if fences > 1:
                        raise DeliveryError(f"{exc}; fenced again after the producer was created anew: another worker "
                                            f"runs with transactional id {self.producers[role].transactional_id}", exc.error) from None
                if kind == "permanent":
                    raise
                if offsets:
                    raise TransactionAbandonedError(str(exc), exc.error) from None
                if time.monotonic() - first_failure >= self.timeout and self._silence() < BROKER_WAIT_S:
                    raise
                log.warning("sending %s's batch failed (%s): sending it again", role, exc)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        self._heard()

    async def _attempt(self, role: str, call) -> None:
        """``call(producer)`` in the role's own thread, watched: a send stuck sending consumer
        offsets past their timeout (librdkafka does not bound that step while the group
        coordinator is down: :meth:`KafkaPublisher.offsets_overdue`) is abandoned, so that the
        role's lock, which the group's callbacks may be waiting for, is not held without end. Its
        thread and producer are left behind (they can no longer commit) and the role gets a new
        thread; the next send creates a new producer."""
        publisher = self.producers[role]
        future = asyncio.get_running_loop().run_in_executor(self._executor(role), call, publisher)
        while True:
            done, _ = await asyncio.wait({future}, timeout=STUCK_CHECK_S)
            if done:
                return future.result()
            if publisher.offsets_overdue(STUCK_GRACE_S) and publisher.abandon():
                future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its outcome no longer matters
                self._executors.pop(role).shutdown(wait=False)
                self.abandoned += 1
                log.warning("%s's transaction got no answer to its consumer offsets in %g s: it is abandoned (it can no "
                            "longer commit) and its producer left behind (%d so far)", role, OFFSETS_TIMEOUT_S + STUCK_GRACE_S,
                            self.abandoned)
                raise DeliveryError(f"{OFFSETS_STEP}: no answer from the group coordinator in "
                                    f"{OFFSETS_TIMEOUT_S + STUCK_GRACE_S:g} s; the transaction was abandoned")

    def _executor(self, role: str) -> "SendThread":
        """The role's one thread for its producer's blocking calls: they never wait for the
        event loop's shared executor (restores, metadata questions)."""
        if role not in self._executors:
            self._executors[role] = SendThread(f"dpstream-send-{role}")
        return self._executors[role]

    async def _renew(self, role: str) -> None:
        """A broken producer replaced by a new one with the same transactional id: its
        ``init_transactions`` fences the old one and aborts its open transaction. One attempt,
        bounded: raises DeliveryError when the broker does not answer in time."""
        old = self.producers[role]
        old.discard()
        self.producers[role] = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._transactional(role, min(self.timeout, RENEW_TIMEOUT_S)))
        log.info("%s's producer was created anew (%s)", role, old.transactional_id)

    async def wait_idle(self, role: str) -> None:
        """Until a send its (cancelled) caller left running has finished."""
        await asyncio.get_running_loop().run_in_executor(None, self.producers[role].wait_idle)

    def acknowledged(self, role: str) -> dict:
        return self.producers[role].acknowledged


def transactional_instance(group: bool, instance_id: str, index: Optional[int]) -> str:
    """The part of the transactional ids that names this worker (see :class:`RolePublishers`)."""
    return instance_id if group else str(index)
