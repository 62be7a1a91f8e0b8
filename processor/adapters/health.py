"""The worker's health: the state ``/readyz`` reports and how long the broker has been silent
(docs/operations.md, "Health").

States: ``starting`` -> ``ready`` <-> ``waiting-for-broker``; ``ready`` <-> ``restoring``
(elastic workers); any -> ``stopping``. The broker counts as heard from when it answers
anything the worker asked: a fetch response, an acknowledged send or committed transaction,
a log-end or metadata question. A worker whose broker has been silent for ``BROKER_WAIT_S``
says it is waiting; after ``--broker-timeout`` it stops, for Kubernetes to restart it.
"""
from __future__ import annotations

import time
from typing import Optional

STARTING, READY, RESTORING, WAITING, STOPPING = "starting", "ready", "restoring", "waiting-for-broker", "stopping"
#: s without a broker answer before readiness says the worker is waiting for it
BROKER_WAIT_S = 10.0


class WorkerHealth:
    """The worker's state, its reason, and when the broker last answered."""

    def __init__(self, ready_gauge=None):
        self._gauge = ready_gauge
        self.state, self.reason = STARTING, "opening state"
        self.heard = time.monotonic()
        #: the failure that stops the worker (said again as the last line: faust_app.run_worker)
        self.stopped_by: Optional[BaseException] = None
        #: the signal (SIGTERM, SIGINT) that stopped the worker cleanly, for its last line
        self.stopped_by_signal: Optional[str] = None

    def set(self, state: str, reason: str = "") -> None:
        self.state, self.reason = state, reason
        if self._gauge is not None:
            self._gauge.set(1 if state == READY else 0)

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def stopping(self) -> bool:
        return self.state == STOPPING

    def heard_from_broker(self, monotonic_at: Optional[float] = None) -> None:
        """The broker answered (at ``monotonic_at``, default now)."""
        at = time.monotonic() if monotonic_at is None else monotonic_at
        self.heard = max(self.heard, at)

    def silence(self) -> float:
        """s since the broker last answered."""
        return time.monotonic() - self.heard

    def judge_silence(self, silent_s: float, timeout_s: float) -> Optional[str]:
        """Move between ``ready`` and ``waiting-for-broker`` by the broker's silence; returns
        ``"timeout"`` once it passed ``timeout_s`` (the caller stops the worker), ``"waiting"``
        or ``"answers"`` on a change (the caller logs it), else None."""
        if self.state not in (READY, WAITING):
            return None
        if silent_s > timeout_s:
            return "timeout"
        if silent_s > BROKER_WAIT_S:
            changed = self.state == READY
            self.set(WAITING, f"no answer from the broker for {silent_s:.0f} s")
            return "waiting" if changed else None
        if self.state == WAITING:
            self.set(READY)
            return "answers"
        return None
