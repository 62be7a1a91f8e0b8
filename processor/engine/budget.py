"""The budget ledger wired to the queries: who is charged what, and when (docs/privacy.md, "Windows and budget").

* A DP-SQLP query is charged its plan's (epsilon, delta) for each window as the clock reaches
  the window's start, with or without data (:meth:`dpstream.processor.engine.pipeline.QueryPipeline.open_due`),
  with charge id ``query:window_start`` and the time of the charge the window's start: the
  guarantee is per user and window, so each window is one spend, and what is spent or refused
  follows the public schedule only (docs/privacy.md). The charge records the plan's fingerprint
  and the settings the window is pinned to (``QueryConfig.window_pins``); a window is never
  charged under one set of settings and run under another. A refused window's records
  are dropped (``dpstream_events_dropped_total{reason="budget"}``) and the error names requested
  vs remaining.
* A dynamic query runs over an unbounded stream under one guarantee: it is charged once, when
  it starts (charge id ``query:start``); refused, it does not run.

The principal (query, tenant or input topic) is the ledger's business; the pipeline only sees a
yes/no gate per window.

One ledger per application (:class:`ChargeSchedule`): every worker charges every query's windows,
owned partitions or not, in one public order (window start, then the config's query order), from
the same public start (``budget.start``, required with several workers). Charges depend on
nothing else, so each worker's ledger holds the same charges and refusals: a replicated ledger
with no coordination, and ``dpstream budget`` can read any worker's.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

from dpstream.accountant.composition import dynamic_loss, query_loss
from dpstream.accountant.ledger import BudgetExceeded, BudgetLedger, ChargePlanError
from dpstream.accountant.pins import PLAN
from dpstream.processor.config import DpstreamConfig, level_plans_for
from dpstream.state.store import RocksDBStore, Store, WriteBatch
from dpstream.state.tables import IntegerMark

log = logging.getLogger("dpstream.budget")
LEDGER_STORE = "ledger"


def _now_ms() -> int:
    return int(time.time() * 1000)


def open_ledger(config: DpstreamConfig, store: Store, read_only: bool = False) -> Optional[BudgetLedger]:
    b = config.budget
    if b is None:
        return None
    return BudgetLedger(store, {name: limit.policy(b.accounting) for name, limit in b.principals.items()},
                        b.default.policy(b.accounting) if b.default else None, b.epoch, shadow=b.shadow, read_only=read_only)


def ledger_store_readonly(state_dir: str) -> Optional[Store]:
    """The ledger store of a worker's or replay's state directory, opened read-only (readable
    while they hold it), or None when the directory has none. Whether it holds a ledger, and
    what: :func:`dpstream.accountant.ledger.recorded_epoch` and
    :func:`dpstream.accountant.ledger.recorded_entries` (no config involved)."""
    try:
        return RocksDBStore(Path(state_dir) / f"partition-{LEDGER_STORE}", block_cache_mb=8, write_buffer_mb=4, read_only=True)
    except FileNotFoundError:
        return None


class BudgetGate:
    def __init__(self, config: DpstreamConfig, ledger: BudgetLedger, clock: Callable[[], int] = _now_ms):
        self.config, self.ledger, self.clock = config, ledger, clock
        self.refused: set[str] = set()

    def window_gate(self, query) -> Callable[[int], bool]:
        plans = level_plans_for(query)
        plan = plans[0]
        loss = query_loss(plans)  # what the zcdp and pld accountings compose (docs/privacy.md, "Totals over time")
        pins = query.window_pins(plans)  # what the window is pinned to, recorded with its charge
        principal = self.config.budget.principal_of(query)
        where = self._where("queries", query)

        def gate(window_start: int) -> bool:
            return self._charge(principal, plan.epsilon_spent, plan.delta_spent, f"{query.name}:{window_start}",
                                at_ms=int(window_start), pins=pins, where=where, loss=loss)

        return gate

    def start_dynamic(self, query) -> bool:
        plan = query.plan()
        return self._charge(self.config.budget.principal_of(query), query.epsilon, plan.delta_spent, f"{query.name}:start",
                            pins=query.pins(), where=self._where("dynamic", query), loss=dynamic_loss(query.epsilon))

    def _where(self, kind: str, query) -> Optional[str]:
        """The query's config path (``queries[0]``), to name a setting a refusal is about."""
        listed = getattr(self.config, kind)
        return f"{kind}[{listed.index(query)}]" if query in listed else None

    def _charge(self, principal: str, epsilon: float, delta: float, charge_id: str, at_ms: Optional[int] = None,
                pins: Optional[dict] = None, where: Optional[str] = None, loss=None) -> bool:
        try:
            result = self.ledger.charge(principal, epsilon, delta, charge_id, self.clock() if at_ms is None else at_ms,
                                        plan=None if pins is None else pins[PLAN], pins=pins, loss=loss)
        except ChargePlanError as exc:
            if where is None:
                raise
            raise exc.at(where) from None
        except BudgetExceeded as exc:
            log.error("%s (charge %s refused)", exc, charge_id)
            self.refused.add(charge_id)
            return False
        if result.would_refuse:
            log.warning("shadow mode: charge %s of %r would have been refused (remaining epsilon %.6g)", charge_id, principal,
                        result.entry.remaining[0])
        return True


class ChargeSchedule:
    """Charges every query's windows in the order of the public schedule: by window start, ties in
    the config's query order, each once, as the wall clock reaches it. A refused window stays
    refused (the ledger records it), so which windows are charged or refused depends on the
    config, the start and the clock only: never on which partitions a worker owns, nor on when
    its timer happens to run (docs/privacy.md, "Windows and budget")."""

    def __init__(self, gate: BudgetGate, queries, start_ms: int, store: Store):
        self.queries = [(q, gate.window_gate(q)) for q in queries]
        self.first = {q.name: int(start_ms) - int(start_ms) % q.window_ms for q in queries}
        self.store = store
        self._mark = IntegerMark(store, b"charged-through")
        # nothing charged yet: through the instant before the earliest first window (which may
        # start before start_ms: the window holding the start is the first)
        self.through = self._mark.get(min(self.first.values(), default=int(start_ms)) - 1)

    def due(self, clock_ms: int) -> list[tuple[int, int, str]]:
        """(window start, query index, query name) of the windows started in (through, clock]."""
        out = []
        for order, (q, _) in enumerate(self.queries):
            w = max(self.first[q.name], self.through - self.through % q.window_ms + q.window_ms)
            while w <= clock_ms:
                out.append((w, order, q.name))
                w += q.window_ms
        return sorted(out)

    def charge_due(self, clock_ms: int) -> None:
        if clock_ms <= self.through:
            return
        for window, order, _ in self.due(clock_ms):
            self.queries[order][1](window)  # charged or refused, recorded by the ledger either way
        batch = WriteBatch()
        self._mark.put(batch, clock_ms)
        self.store.write(batch)
        self.through = clock_ms
