"""The privacy budget ledger (docs/privacy.md, "Windows and budget"; Kenthapadi et al., LinkedIn Audience
Engagements API, sections 4.2 and 6).

One entry per *principal* (a query, a tenant or an input stream - configurable): the maximum
budget (epsilon, delta) allowed per refresh period, what has been spent, and when it was last
reset. As in the paper's key-value budget manager, every operation is an atomic read-modify-write
of one entry: :meth:`BudgetLedger.check` (checkBudget), :meth:`BudgetLedger.charge`
(updateBudget) and :meth:`BudgetLedger.get` (getBudget). Spend composes as the principal's
policy says (``budget.accounting``, :mod:`dpstream.accountant.composition`): ``basic`` adds
epsilons and deltas; ``zcdp`` and ``pld`` compose every charge of the period (each charge carries
its :class:`~dpstream.accountant.composition.WindowLoss`) and allow a charge when the composed
total, at the cap's delta, stays within the cap's epsilon (docs/privacy.md, "Totals over time").
The schedule of charges is the same in every accounting; only where the cap is reached moves.

The ledger never resets silently:

* entries and charges are persisted in a store (RocksDB through ``state/``) and recovered on
  restart; each charge has an id (e.g. ``query:window``) and charging the same id again is a
  no-op, so a replayed window is never charged twice and never refunded; a refused id stays
  refused, so every caller asking about the same window gets the same answer;
* spent budget returns to zero only at a configured refresh (``refresh`` period after
  ``last_reset``), recorded in the entry;
* the store carries its *epoch* (configured name + the noise secret's fingerprint); opening it
  under another epoch is refused. Losing the store or rotating the secret is a new epoch, which
  must be configured explicitly.

In shadow mode charges are tracked and would-be refusals counted, but nothing is refused.
The ledger sees principals and costs only; mechanisms never see the principal.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional

from dpstream.accountant import pins
from dpstream.accountant.composition import Total, WindowLoss, total_delta, total_epsilon
from dpstream.state.store import Store, WriteBatch

ENTRY = b"L"
CHARGE = b"C"
EPOCH_KEY = b"E"
TOLERANCE = 1e-12  # relative float slack when comparing sums of epsilons


class BudgetExceeded(RuntimeError):
    """A charge would overspend; the message names the principal, requested and remaining."""

    def __init__(self, principal: str, requested: tuple[float, float], remaining: tuple[float, float]):
        self.principal, self.requested, self.remaining = principal, requested, remaining
        super().__init__(f"privacy budget of {principal!r} exhausted: requested epsilon {requested[0]:.6g}, delta {requested[1]:.3g}; "
                         f"remaining epsilon {remaining[0]:.6g}, delta {remaining[1]:.3g}")


class LedgerEpochError(RuntimeError):
    pass


class ChargePlanError(RuntimeError):
    """A charge id was already charged under other settings (another plan, user field, key, ...:
    :mod:`dpstream.accountant.pins`): the window it names must finish on the settings it was
    charged under (docs/privacy.md, "Windows and budget"). The message starts with the settings
    that differ (``where``: the query's config path, e.g. ``queries[0]``)."""

    def __init__(self, charge_id: str, principal: str, changes: list, where: Optional[str] = None):
        self.charge_id, self.principal, self.changes, self.where = charge_id, principal, list(changes), where
        super().__init__(f"{pins.field_names(self.changes, where)}: charge {charge_id} of {principal!r} was made with "
                         f"{pins.describe(self.changes)}: its window must finish on the settings it was charged under "
                         f"(docs/privacy.md, \"Windows and budget\")")

    def at(self, where: str) -> "ChargePlanError":
        """The same refusal, its settings named under the query's config path."""
        return ChargePlanError(self.charge_id, self.principal, self.changes, where)


@dataclass(frozen=True)
class BudgetPolicy:
    max_epsilon: float
    max_delta: float
    refresh_ms: Optional[int] = None  # None: never refreshes
    accounting: str = "basic"  # how charges add up: dpstream.accountant.composition.ACCOUNTINGS


@dataclass
class BudgetEntry:
    principal: str
    max_epsilon: float
    max_delta: float
    refresh_ms: Optional[int]
    spent_epsilon: float = 0.0
    spent_delta: float = 0.0
    last_reset_ms: int = 0
    charges: int = 0
    refusals: int = 0  # refused (or, in shadow mode, would-be refused) charges
    accounting: str = "basic"
    #: this period's charges composed (dpstream.accountant.composition.Total), for every
    #: accounting; None: none yet, or an entry written before charges carried their loss terms
    composed: Optional[dict] = None

    def total(self) -> Total:
        """This period's charges composed; what was spent before charges carried their loss
        terms counts by basic composition (``legacy``)."""
        if self.composed is not None:
            return Total.from_dict(self.composed)
        return Total().add(None, epsilon=self.spent_epsilon, delta=self.spent_delta)

    @property
    def spent_composed_epsilon(self) -> float:
        """The period's spend as the entry's accounting composes it, at the cap's delta (the sum
        of epsilons under ``basic``)."""
        if self.accounting == "basic":
            return self.spent_epsilon
        return total_epsilon(self.total(), self.accounting, self.max_delta)

    @property
    def remaining(self) -> tuple[float, float]:
        if self.accounting == "basic":
            return max(0.0, self.max_epsilon - self.spent_epsilon), max(0.0, self.max_delta - self.spent_delta)
        # the epsilon left at the cap's delta, and the delta left at the cap's epsilon
        return (max(0.0, self.max_epsilon - self.spent_composed_epsilon),
                max(0.0, self.max_delta - total_delta(self.total(), self.accounting, self.max_epsilon)))

    def allows(self, epsilon: float, delta: float, loss: Optional[WindowLoss] = None) -> bool:
        if self.accounting == "basic":
            return (self.spent_epsilon + epsilon <= self.max_epsilon * (1 + TOLERANCE)
                    and self.spent_delta + delta <= self.max_delta * (1 + TOLERANCE))
        after = self.total().add(loss, epsilon=epsilon, delta=delta)
        return total_epsilon(after, self.accounting, self.max_delta) <= self.max_epsilon * (1 + TOLERANCE)

    def spend(self, epsilon: float, delta: float, loss: Optional[WindowLoss]) -> None:
        self.composed = self.total().add(loss, epsilon=epsilon, delta=delta).to_dict()
        self.spent_epsilon += epsilon
        self.spent_delta += delta
        self.charges += 1


@dataclass(frozen=True)
class ChargeResult:
    principal: str
    charged: bool  # False: refused (not in shadow mode), or already charged earlier
    duplicate: bool
    would_refuse: bool
    entry: BudgetEntry = field(repr=False)


def recorded_epoch(store: Store) -> Optional[str]:
    """The epoch a ledger store was written under, or None: no ledger was ever opened on it."""
    stored = store.get(EPOCH_KEY)
    return None if stored is None else stored.decode()


def recorded_entries(store: Store) -> list[BudgetEntry]:
    """Every principal's entry exactly as the ledger last wrote it (at its last charge or refusal):
    the limits it applied then, what was spent in the period holding that charge, and when that
    period began. No configuration is applied and no refresh computed: principals never charged
    are absent. ``dpstream budget`` and the worker's status page show these (docs/operations.md,
    "Status page")."""
    return [BudgetEntry(**json.loads(raw)) for _, raw in store.scan_prefix(ENTRY)]


def _changed_settings(record: dict, plan: Optional[str], now: Optional[Mapping[str, object]]) -> list:
    """What differs between a charge's record and a charge of the same id now: the settings both
    recorded (:func:`dpstream.accountant.pins.changes`), else the plan fingerprints (a charge
    recorded before its settings were)."""
    if now is not None and "pins" in record:
        return pins.changes(record["pins"], now)
    earlier = record.get("plan")
    if plan is not None and earlier is not None and earlier != plan:
        return [pins.PinChange(pins.PLAN, earlier, plan)]
    return []


class BudgetLedger:
    def __init__(self, store: Store, policies: dict[str, BudgetPolicy], default: Optional[BudgetPolicy], epoch: str,
                 shadow: bool = False, read_only: bool = False):
        self.store = store
        self.policies = policies
        self.default = default
        self.shadow = shadow
        self._lock = threading.Lock()
        stored = store.get(EPOCH_KEY)
        if stored is None:
            if not read_only:
                batch = WriteBatch()
                batch.put(EPOCH_KEY, epoch.encode())
                store.write(batch)
        elif stored.decode() != epoch:
            raise LedgerEpochError(f"the budget ledger belongs to epoch {stored.decode()!r}, not {epoch!r}: a new epoch "
                                   f"(lost state, new noise secret) needs a new ledger state directory, configured explicitly")

    def policy(self, principal: str) -> BudgetPolicy:
        policy = self.policies.get(principal, self.default)
        if policy is None:
            raise KeyError(f"no budget configured for principal {principal!r} (and no default)")
        return policy

    def _load(self, principal: str, now_ms: int) -> tuple[BudgetEntry, bool]:
        """The entry with the current policy's limits; refreshed if its period has passed."""
        policy = self.policy(principal)
        raw = self.store.get(ENTRY + principal.encode())
        if raw is None:
            entry = BudgetEntry(principal, policy.max_epsilon, policy.max_delta, policy.refresh_ms, last_reset_ms=now_ms,
                                accounting=policy.accounting, composed=Total().to_dict())
            changed = True
        else:
            entry = BudgetEntry(**json.loads(raw))
            now = (policy.max_epsilon, policy.max_delta, policy.refresh_ms, policy.accounting)
            changed = (entry.max_epsilon, entry.max_delta, entry.refresh_ms, entry.accounting) != now
            entry.max_epsilon, entry.max_delta, entry.refresh_ms, entry.accounting = now
        if entry.refresh_ms and now_ms >= entry.last_reset_ms + entry.refresh_ms:
            periods = (now_ms - entry.last_reset_ms) // entry.refresh_ms
            entry.last_reset_ms += periods * entry.refresh_ms  # the configured refresh, on its schedule
            entry.spent_epsilon = entry.spent_delta = 0.0
            entry.composed = Total().to_dict()
            changed = True
        return entry, changed

    def get(self, principal: str, now_ms: int) -> BudgetEntry:
        with self._lock:
            return self._load(principal, now_ms)[0]

    def entries(self, now_ms: int) -> list[BudgetEntry]:
        names = {k[len(ENTRY):].decode() for k, _ in self.store.scan_prefix(ENTRY)} | set(self.policies)
        return [self.get(name, now_ms) for name in sorted(names)]

    def check(self, principal: str, epsilon: float, delta: float, now_ms: int, loss: Optional[WindowLoss] = None) -> bool:
        return self.get(principal, now_ms).allows(epsilon, delta, loss)

    def charge(self, principal: str, epsilon: float, delta: float, charge_id: str, now_ms: int,
               plan: Optional[str] = None, pins: Optional[Mapping[str, object]] = None,
               loss: Optional[WindowLoss] = None) -> ChargeResult:
        """Spend (epsilon, delta) for ``charge_id`` atomically; idempotent per id. ``loss``: the
        charge's terms for the ``zcdp`` and ``pld`` accountings (without it, the charge composes
        with the rest by basic composition). Raises
        :class:`BudgetExceeded` when it would overspend (shadow mode: records and allows), and
        :class:`ChargePlanError` when the id was charged under another ``plan`` fingerprint or
        other ``pins`` (the settings its window is pinned to: :mod:`dpstream.accountant.pins`),
        naming each setting that differs. Both are recorded with the charge."""
        with self._lock:
            entry, _ = self._load(principal, now_ms)
            charge_key = CHARGE + principal.encode() + b"\0" + charge_id.encode()
            previous = self.store.get(charge_key)
            if previous is not None:
                record = json.loads(previous)
                if record.get("refused"):
                    # refused once, refused for good: a second partition of the same window, or
                    # a restart, gets the same answer whatever was charged since
                    raise BudgetExceeded(principal, (epsilon, delta), tuple(record["remaining"]))
                changed = _changed_settings(record, plan, pins)
                if changed:
                    raise ChargePlanError(charge_id, principal, changed)
                return ChargeResult(principal, False, True, False, entry)
            would_refuse = not entry.allows(epsilon, delta, loss)
            batch = WriteBatch()
            if would_refuse:
                entry.refusals += 1
                if not self.shadow:
                    batch.put(ENTRY + principal.encode(), json.dumps(asdict(entry)).encode())
                    batch.put(charge_key, json.dumps({"refused": True, "epsilon": epsilon, "delta": delta, "at_ms": now_ms,
                                                      "remaining": list(entry.remaining)}).encode())
                    self.store.write(batch)
                    raise BudgetExceeded(principal, (epsilon, delta), entry.remaining)
            entry.spend(epsilon, delta, loss)
            batch.put(ENTRY + principal.encode(), json.dumps(asdict(entry)).encode())
            record = {"epsilon": epsilon, "delta": delta, "at_ms": now_ms, "period_start_ms": entry.last_reset_ms}
            if loss is not None:
                record["loss"] = loss.to_dict()
            if plan is not None:
                record["plan"] = plan
            if pins is not None:
                record["pins"] = dict(pins)
            batch.put(charge_key, json.dumps(record).encode())
            self.store.write(batch)  # entry and charge record: one atomic write
            return ChargeResult(principal, True, False, would_refuse, entry)
