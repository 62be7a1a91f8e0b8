"""The budget ledger wired to the queries: who is charged what, and when (docs/privacy.md, "Windows and budget").

* A DP-SQLP query is charged its plan's (epsilon, delta) for each window as the clock reaches
  the window's start, with or without data (:meth:`processor.engine.pipeline.QueryPipeline.open_due`),
  with charge id ``query:window_start`` and the time of the charge the window's start: the
  guarantee is per user and window, so each window is one spend, and what is spent or refused
  follows the public schedule only (docs/privacy.md). The charge records the plan's fingerprint;
  a window is never charged under one plan and run under another. A refused window's records
  are dropped (``dpstream_events_dropped_total{reason="budget"}``) and the error names requested
  vs remaining.
* A dynamic query runs over an unbounded stream under one guarantee: it is charged once, when
  it starts (charge id ``query:start``); refused, it does not run.

The principal (query, tenant or input topic) is the ledger's business; the pipeline only sees a
yes/no gate per window.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

from accountant.ledger import BudgetExceeded, BudgetLedger
from accountant.plan import plan_fingerprint
from processor.config import DpstreamConfig, level_plans_for, plan_for
from state.store import RocksDBStore, Store

log = logging.getLogger("dpstream.budget")
LEDGER_STORE = "ledger"


def _now_ms() -> int:
    return int(time.time() * 1000)


def open_ledger(config: DpstreamConfig, store: Store, read_only: bool = False) -> Optional[BudgetLedger]:
    b = config.budget
    if b is None:
        return None
    return BudgetLedger(store, {name: limit.policy() for name, limit in b.principals.items()},
                        b.default.policy() if b.default else None, b.epoch, shadow=b.shadow, read_only=read_only)


def open_ledger_readonly(config: DpstreamConfig, state_dir: str) -> BudgetLedger:
    """The ledger of a state directory, readable while a worker or replay holds it."""
    store = RocksDBStore(Path(state_dir) / f"partition-{LEDGER_STORE}", block_cache_mb=8, write_buffer_mb=4, read_only=True)
    return open_ledger(config, store, read_only=True)


class BudgetGate:
    def __init__(self, config: DpstreamConfig, ledger: BudgetLedger, clock: Callable[[], int] = _now_ms):
        self.config, self.ledger, self.clock = config, ledger, clock
        self.refused: set[str] = set()

    def window_gate(self, query) -> Callable[[int], bool]:
        plan = plan_for(query)
        fingerprint = plan_fingerprint(level_plans_for(query)).hex()
        principal = self.config.budget.principal_of(query)

        def gate(window_start: int) -> bool:
            return self._charge(principal, plan.epsilon_spent, plan.delta_spent, f"{query.name}:{window_start}",
                                at_ms=int(window_start), plan=fingerprint)

        return gate

    def start_dynamic(self, query) -> bool:
        plan = query.plan()
        return self._charge(self.config.budget.principal_of(query), query.epsilon, plan.delta_spent, f"{query.name}:start",
                            plan=query.fingerprint())

    def _charge(self, principal: str, epsilon: float, delta: float, charge_id: str, at_ms: Optional[int] = None,
                plan: Optional[str] = None) -> bool:
        try:
            result = self.ledger.charge(principal, epsilon, delta, charge_id, self.clock() if at_ms is None else at_ms, plan=plan)
        except BudgetExceeded as exc:
            log.error("%s (charge %s refused)", exc, charge_id)
            self.refused.add(charge_id)
            return False
        if result.would_refuse:
            log.warning("shadow mode: charge %s of %r would have been refused (remaining epsilon %.6g)", charge_id, principal,
                        result.entry.remaining[0])
        return True
