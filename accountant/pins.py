"""What a window (or a dynamic query) was opened under, compared setting by setting.

A window is pinned to the public settings it was opened and charged under (docs/privacy.md,
"Windows and budget"): its calibration, and what its records mean (who the user is, which
fields make the key, the value and the time, the window, the input). Which settings those are is
defined once per kind of query, :meth:`dpstream.processor.config.QueryConfig.window_pins` and
:meth:`dpstream.processor.config.DynamicQueryConfig.pins`: a mapping from setting name to its
public value, plus :data:`PLAN`, the calibration's fingerprint
(:func:`dpstream.accountant.plan.plan_fingerprint`), which also catches a calibration that changed
with the same settings (another dpstream version). Stored with the window's state and in its
ledger charge, and compared here, so a refusal can name the setting that changed.

All public configuration, never data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Optional

#: the pin holding the calibration's fingerprint (hex)
PLAN = "plan"


@dataclass(frozen=True)
class PinChange:
    setting: str  # a config field, or PLAN
    opened: object  # its value when the window was opened
    now: object  # its value in this run


def encode(pins: Mapping[str, object]) -> bytes:
    """The canonical stored form: compact JSON, keys sorted."""
    return json.dumps(dict(pins), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def decode(raw: bytes) -> dict:
    """Stored pins. A value that is not JSON is a plan fingerprint alone (hex), as state and
    ledger charges written before the settings were recorded hold it."""
    raw = bytes(raw)
    if raw[:1] == b"{":
        return json.loads(raw)
    return {PLAN: raw.decode()}


def changes(opened: Mapping[str, object], now: Mapping[str, object]) -> list[PinChange]:
    """The settings whose value in ``now`` differs from ``opened``, in ``now``'s order. A setting
    only one side recorded is not compared (pins written by a version that had no such setting);
    the calibration (:data:`PLAN`) is named only when no named setting explains it."""
    current = json.loads(json.dumps(dict(now)))  # as stored: tuples are lists, and so on
    named = [PinChange(k, opened[k], v) for k, v in current.items() if k != PLAN and k in opened and opened[k] != v]
    if named:
        return named
    if PLAN in opened and PLAN in current and opened[PLAN] != current[PLAN]:
        return [PinChange(PLAN, opened[PLAN], current[PLAN])]
    return []


def field_names(found: list[PinChange], where: Optional[str] = None) -> str:
    """``queries[0].user_field, queries[0].epsilon`` (``where``: the config path of the query)."""
    prefix = f"{where}." if where else ""
    return ", ".join(f"{where}" if c.setting == PLAN and where else prefix + c.setting for c in found)


def describe(found: list[PinChange]) -> str:
    """``user_field 'user_id' (this run: 'device_id'), epsilon 6.0 (this run: 3.0)``."""
    parts = []
    for c in found:
        if c.setting == PLAN:
            parts.append(f"another calibration (plan fingerprint {c.opened}, this run: {c.now}; epsilon, delta, C, L, T, "
                         f"grid, thresholds, counter or composition, or the dpstream version's calibration, differ)")
        else:
            parts.append(f"{c.setting} {c.opened!r} (this run: {c.now!r})")
    return ", ".join(parts)
