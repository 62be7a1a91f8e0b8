"""Query configuration: one YAML file of queries, plus environment overrides.

A bad config fails at start with a message naming the field, e.g.
``queries[0].epsilon: must be a positive finite number, got -1``. Unknown fields are errors (a
typo must not silently fall back to a default budget).

Environment overrides: ``DPSTREAM_QUERY_<NAME>_<FIELD>=<yaml scalar>``, with the query name
upper-cased and non-alphanumerics as ``_``; e.g. ``DPSTREAM_QUERY_URL_CLICKS_EPSILON=3``.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal, Mapping, Optional, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dpstream.accountant import (
    BudgetError,
    PrivacyPlan,
    QueryBudget,
    plan_levels,
    plan_query,
)
from dpstream.accountant.dynamic import DynamicPlan
from dpstream.accountant.ledger import BudgetPolicy
from dpstream.accountant.pins import PLAN
from dpstream.accountant.plan import plan_fingerprint
from dpstream.processor.mechanisms.aggregates import AGGREGATES, aggregate_named
from dpstream.processor.mechanisms.linear_queries import MAX_RANGE_ITEMS

_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class ConfigError(ValueError):
    """Invalid configuration; the message names the file and the field."""


@lru_cache(maxsize=256, typed=True)  # typed: True is refused, 1 is not; per-record callers read tick_ms
def parse_duration_ms(text: str | int, allow_zero: bool = False) -> int:
    """``'1d'``, ``'15m'``, ``'30s'``, ``'250ms'`` or an integer number of milliseconds."""
    if isinstance(text, bool):
        raise ValueError("must be a duration like '1d', '15m', '30s'")
    if isinstance(text, int):
        value = text
    else:
        match = _DURATION.match(str(text))
        if not match:
            raise ValueError(f"must be a duration like '1d', '15m', '30s', got {text!r}")
        value = int(match.group(1)) * _UNIT_MS[match.group(2)]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError("must be positive")
    return value


def duration_text(ms: int) -> str:
    """A duration in its largest whole unit (``86400000`` -> ``'1d'``): how pins record one, so
    that ``1d`` and ``24h`` are the same setting."""
    for unit in ("d", "h", "m", "s"):
        if ms and ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


#: QueryConfig fields a window is *not* pinned to, and why; every other field is (docs/privacy.md,
#: "Windows and budget"), so a field added later is pinned unless it is listed here
UNPINNED_FIELDS = {
    "name": "the query itself: another name is another query, with windows of its own",
    "tenant": "who is charged: a window's charge stays with the principal it was made to",
    "output_topic": "where releases go, not what they are",
    "allowed_lateness": "the public trigger schedule: no noise scale, unit or field depends on it",
    "max_skew": "which records are refused as future: no noise scale, unit or field depends on it",
    "input_format": "how the input's records are encoded, not what events they hold",
    "public_keys_file": "where the key list is read from: the keys themselves are pinned (public_keys, as their digest)",
}
#: DynamicQueryConfig fields a dynamic query is not pinned to (see :data:`UNPINNED_FIELDS`)
UNPINNED_DYNAMIC_FIELDS = {
    "name": UNPINNED_FIELDS["name"],
    "tenant": UNPINNED_FIELDS["tenant"],
    "output_topic": UNPINNED_FIELDS["output_topic"],
    "max_skew": UNPINNED_FIELDS["max_skew"],
}


def _pinned_settings(model: BaseModel, unpinned: Mapping[str, str], durations: Mapping[str, int]) -> dict:
    """The public settings of a query a window (or a dynamic query) is pinned to, in the config's
    field order: every field not in ``unpinned``, durations as :func:`duration_text`."""
    out = {}
    for name in type(model).model_fields:
        if name in unpinned:
            continue
        value = getattr(model, name)
        out[name] = duration_text(durations[name]) if name in durations else value
    return out


def _check_max_skew(value: str | int) -> None:
    """A clock moved only by accepted events needs room ahead of it: with max_skew 0 an in-order
    stream's next event is never within reach, so replay would hold almost everything
    (docs/privacy.md, "Time")."""
    if parse_duration_ms(value, allow_zero=True) == 0:
        raise ValueError("must be positive (the event-time clock accepts events dated up to max_skew after it; 0 would "
                         "hold back every event after the clock)")


def parse_time_ms(value: str | int) -> int:
    """A point in time: epoch milliseconds, or ISO-8601 (``2026-11-20``, ``2026-11-20T06:00:00Z``;
    a time without a zone is UTC)."""
    if isinstance(value, bool):
        raise ValueError("must be epoch milliseconds or an ISO-8601 time")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    from datetime import datetime, timezone

    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"must be epoch milliseconds or an ISO-8601 time like 2026-11-20T00:00:00Z, got {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


#: the most keys a public key domain may declare (every one is released at every trigger)
MAX_PUBLIC_KEYS = 1_000_000


def _frozen(value):
    """A hashable copy of a YAML list (lists as tuples)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


@lru_cache(maxsize=64)
def public_key_texts(entries: Optional[tuple], path: Optional[str], fields: int) -> tuple[str, ...]:
    """Key texts of a declared key domain (``public_keys`` entries, or the lines of
    ``public_keys_file``), each checked as stage 1 checks a record's key fields. Raises
    ValueError naming the field and the entry (public configuration, never data)."""
    from dpstream.topics.records import InvalidRecord, _text, key_text

    name = "public_keys" if path is None else "public_keys_file"
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"public_keys_file: {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"public_keys_file: {path}: not UTF-8 text") from None
        entries = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if fields == 1:
                entries.append(line)
                continue
            try:
                entries.append(_frozen(json.loads(line)))
            except json.JSONDecodeError:
                raise ValueError(f"public_keys_file: {path} line {number}: with {fields} key fields, each line is a JSON "
                                 f"list of {fields} values") from None
    texts, seen = [], set()
    for j, entry in enumerate(entries):
        where = f"{name}[{j}]" if path is None else f"public_keys_file: {path} key {j + 1}"
        parts = [entry] if fields == 1 and not isinstance(entry, tuple) else list(entry) if isinstance(entry, tuple) else None
        if parts is None or len(parts) != fields:
            raise ValueError(f"{where}: a key of {fields} key fields is a list of {fields} values, got {entry!r}")
        checked = [_text(part, f"key_fields[{k}]") for k, part in enumerate(parts)]
        bad = next((c for c in checked if isinstance(c, InvalidRecord)), None)
        if bad is not None:
            raise ValueError(f"{where}: {bad.reason}")
        text = checked[0] if fields == 1 else key_text(checked)
        if text in seen:
            raise ValueError(f"{where}: {entry!r} is declared twice")
        seen.add(text)
        texts.append(text)
    if not texts:
        raise ValueError(f"{name}: declares no key")
    if len(texts) > MAX_PUBLIC_KEYS:
        raise ValueError(f"{name}: {len(texts):,} keys, more than {MAX_PUBLIC_KEYS:,} (each is released at every trigger)")
    return tuple(texts)


class QueryConfig(BaseModel):
    """One continually released DP histogram (DP-SQLP section 3), all fields public."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    tenant: Optional[str] = None  # budget principal when budget.principal is 'tenant'
    input_topic: str = "events"
    output_topic: str = "dp-histograms"
    user_field: str = "user_id"
    key_fields: list[str] = Field(default_factory=lambda: ["key"], min_length=1)
    value_field: Optional[str] = None
    time_field: str = "ts"
    #: an entry of dpstream.processor.mechanisms.aggregates.AGGREGATES: count, sum or mean
    aggregate: str = "count"
    clamp: float = 1.0
    contribution_bound: int = Field(32, ge=1)
    window: str = "1d"
    allowed_lateness: str = "1m"
    #: events dated more than this after the clock (the worker's: the record's Kafka timestamp;
    #: replay's: its event-time clock) are dead-lettered as ``future`` and never move a clock
    max_skew: str = "1h"
    #: this query's input topic's format (null: the config's input_format); every query of one
    #: topic must agree (docs/operator-guide.md, "Formats and schema registries")
    input_format: Optional[str] = None
    triggers: int = Field(100, ge=1, le=1 << 24)
    key_threshold: float = Field(0.0, ge=0)
    epsilon: float
    delta: float
    beta: Optional[float] = None
    key_selection_share: float = 0.5
    #: how the Gaussian parts compose: gdp (exact Gaussian DP, the default: the tightest), zcdp
    #: (with the CKS conversion) or basic (the paper's split); docs/privacy.md, "Accounting"
    composition: Literal["zcdp", "gdp", "basic"] = "gdp"
    #: the continual counter of key selection and perturbation: blt (Buffered Linear Toeplitz,
    #: the default: less worst-step noise variance than the tree, 1.3x at T = 2 to 5x at T = 1000)
    #: or tree (binary tree + Honaker, the paper's); docs/privacy.md, "Counters"
    counter: Literal["tree", "blt"] = "blt"
    #: records a user may add to one key (c_k): null (up to contribution_bound) or an integer from
    #: 1 to contribution_bound, the user's first c_k records per key; the perturbation noise then
    #: scales with sqrt(C c_k) instead of C (docs/privacy.md, "Per-key bound")
    per_key_bound: Optional[int] = None
    #: the perturbation counter's step: trigger (the paper's layout) or release (one step per
    #: release of the key: fewer steps, less noise); docs/privacy.md, "Perturbation steps"
    perturbation_steps: Literal["trigger", "release"] = "trigger"
    #: key selection's integer weights for a user's 1st, 2nd, ... key (needs per_key_bound 1);
    #: null: 1 each. Same worst-case sensitivity when sum w^2 = C; docs/privacy.md, "Weighted key selection"
    selection_weights: Optional[list[int]] = None
    resolution: Optional[float] = None
    #: key_fields are a hierarchy, coarse to fine (country > state > city): one histogram per
    #: level (key = prefix of key_fields), published consistent (docs/privacy.md, "Post-processing: hierarchical consistency")
    hierarchy: bool = False
    level_shares: Optional[list[float]] = None  # budget share per level (sum 1); null: equal
    #: the key domain, when it is public (PipelineDP's and Tumult's public partitions): exactly
    #: these keys are released at every trigger, with no key selection and no threshold, and the
    #: whole budget goes to perturbation; records of other keys are dropped (``not_public_key``).
    #: A key is a string (an integer reads as its digits), or a list of one per key field; with a
    #: hierarchy, the finest level's keys (their prefixes are the coarser levels'). docs/privacy.md, "Public keys"
    public_keys: Optional[list[Union[str, int, list[Union[str, int]]]]] = None
    #: the same from a file: one key per line (with several key fields, a JSON list per line);
    #: a relative path is read from the config file's folder
    public_keys_file: Optional[str] = None

    @field_validator("window")
    @classmethod
    def _window(cls, value: str) -> str:
        parse_duration_ms(value)
        return value

    @field_validator("allowed_lateness")
    @classmethod
    def _lateness(cls, value: str) -> str:
        parse_duration_ms(value, allow_zero=True)
        return value

    @field_validator("max_skew")
    @classmethod
    def _max_skew(cls, value: str) -> str:
        _check_max_skew(value)
        return value

    @field_validator("epsilon", "delta", "clamp")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    @field_validator("input_format")
    @classmethod
    def _query_input_format(cls, value: Optional[str]) -> Optional[str]:
        from dpstream.topics.decoding import DECODERS

        if value is not None and value not in DECODERS:
            raise ValueError(f"must be one of {', '.join(DECODERS)}, got {value!r}")
        return value

    @field_validator("aggregate")
    @classmethod
    def _aggregate(cls, value: str) -> str:
        if aggregate_named(value) is None:
            raise ValueError(f"must be one of {', '.join(AGGREGATES)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _value_matches_aggregate(self) -> "QueryConfig":
        aggregate = aggregate_named(self.aggregate)
        if aggregate.needs_value and not self.value_field:
            raise ValueError(f"value_field: aggregate {self.aggregate!r} needs a value_field")
        if not aggregate.needs_value and self.value_field:
            raise ValueError(f"value_field: must be null for aggregate {self.aggregate!r} (COUNT(*))")
        if self.window_ms % self.triggers:
            raise ValueError(f"triggers: the window ({self.window}) must split into {self.triggers} whole milliseconds")
        if self.hierarchy:
            if len(self.key_fields) < 2:
                raise ValueError("key_fields: a hierarchy needs at least two key fields, coarse to fine")
            if self.aggregate != "count":
                raise ValueError("hierarchy: consistent hierarchies publish non-negative integer counts; aggregate must be 'count'")
            if len(set(self.key_fields)) != len(self.key_fields):
                raise ValueError("key_fields: the levels of a hierarchy must be distinct fields")
        elif self.level_shares is not None:
            raise ValueError("level_shares: only a hierarchy (hierarchy: true) has levels")
        if self.public_keys is not None and self.public_keys_file is not None:
            raise ValueError("public_keys_file: give the key domain once, as public_keys or as public_keys_file")
        self.public_key_texts  # read and checked now: a bad list fails at start, naming its field
        return self

    @property
    def public_key_texts(self) -> Optional[tuple[str, ...]]:
        """The declared key domain as key texts (what stage 1 makes of a record's key fields:
        dpstream.topics.records.EventParser), in the order declared; None without public keys."""
        if self.public_keys is not None:
            return public_key_texts(_frozen(self.public_keys), None, len(self.key_fields))
        if self.public_keys_file is not None:
            return public_key_texts(None, self.public_keys_file, len(self.key_fields))
        return None

    @property
    def public_keys_digest(self) -> Optional[str]:
        """SHA-256 of the declared key domain (what a window is pinned to), None without one."""
        texts = self.public_key_texts
        if texts is None:
            return None
        return hashlib.sha256("\n".join(texts).encode()).hexdigest()

    @property
    def hierarchy_depth(self) -> int:
        """Histograms kept: one per prefix of key_fields for a hierarchy, else one."""
        return len(self.key_fields) if self.hierarchy else 1

    @property
    def window_ms(self) -> int:
        return parse_duration_ms(self.window)

    def window_pins(self, plans: Optional[tuple[PrivacyPlan, ...]] = None) -> dict:
        """What a window of this query is pinned to (docs/privacy.md, "Windows and budget"): every
        public setting but those in :data:`UNPINNED_FIELDS` (who the user is, the key, value and
        time fields, the window, the input topic, the hierarchy, the budget and every other
        calibration setting), and the calibration's fingerprint (:data:`dpstream.accountant.pins.PLAN`;
        ``plans``: the query's level plans, when already computed). The one definition, used by
        the window's state (:class:`dpstream.processor.engine.pipeline.QueryPipeline`) and its
        ledger charge (:class:`dpstream.processor.engine.budget.BudgetGate`)."""
        pins = _pinned_settings(self, UNPINNED_FIELDS, {"window": self.window_ms})
        pins["public_keys"] = self.public_keys_digest  # the keys, however given: not a list of thousands in every pin
        pins[PLAN] = plan_fingerprint(plans if plans is not None else level_plans_for(self)).hex()
        return pins

    def budget(self) -> QueryBudget:
        return QueryBudget(
            epsilon=self.epsilon,
            delta=self.delta,
            triggers=self.triggers,
            contribution_bound=self.contribution_bound,
            clamp=self.clamp,
            aggregate=self.aggregate,
            columns=aggregate_named(self.aggregate).column_kinds,
            key_threshold=self.key_threshold,
            beta=self.beta,
            key_selection_share=self.key_selection_share,
            composition=self.composition,
            counter=self.counter,
            per_key_bound=self.per_key_bound,
            perturbation_steps=self.perturbation_steps,
            selection_weights=tuple(self.selection_weights) if self.selection_weights is not None else None,
            resolution=self.resolution,
            hierarchy_depth=self.hierarchy_depth,
            level_shares=tuple(self.level_shares) if self.level_shares is not None else None,
            public_keys=self.public_key_texts is not None,
        )


class DynamicQueryConfig(BaseModel):
    """Per-item counts of a multiset under inserts and deletes (Qiu & Yi; docs/privacy.md, "Dynamic counts").

    Input records ``{"item": ..., "op": "insert"|"delete", "ts": ...}``; ``ts`` falls in tick
    ``(ts - start) // tick + 1`` (the paper's timestamps; records must not go back to a decided
    tick); ``items`` is the public domain of items (a noisy count is published for every one of them, so the domain must not
    depend on the data). Without ``unit_field`` the privacy unit is one update; with it, each
    unit's first ``contribution_bound`` updates count and the mechanisms run at
    ``epsilon / contribution_bound`` (group privacy for pure DP).

    ``envelope: debezium``: the records are a database's change events in Debezium's envelope
    (``op`` c, r, u, d with the row's ``before`` and ``after``; topics/records.py,
    :class:`ChangeEventParser`); ``item_field`` and ``unit_field`` name a column of the row,
    ``time_field`` a field of the envelope (default ``ts_ms``). One change event is up to two
    updates (an update moving a row from one item to another deletes one and inserts the other):
    without ``unit_field`` the privacy unit is one change event, and the mechanisms run at
    ``epsilon / 2`` (docs/privacy.md, "Change streams")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    tenant: Optional[str] = None  # budget principal when budget.principal is 'tenant'
    input_topic: str = "dpstream-dynamic-updates"
    output_topic: str = "dp-dynamic-counts"
    item_field: str = "item"
    op_field: str = "op"
    time_field: str = "ts"
    start: int = Field(ge=0)  # epoch ms of tick 1: public, fixed before the data
    tick: str = "1s"  # the paper's timestamp unit: updates in one tick share a timestamp
    #: a tick is decided (with or without updates) once the clock passes its end plus this;
    #: updates for a decided tick are late
    allowed_lateness: str = "1s"
    #: updates dated more than this after the clock they arrive at are dead-lettered as ``future``
    max_skew: str = "1h"
    unit_field: Optional[str] = None
    contribution_bound: int = Field(1, ge=1)
    items: list[str] = Field(min_length=1, max_length=100_000)
    epsilon: float = Field(gt=0)
    delta: float = Field(0.0, ge=0, lt=1)
    beta: float = Field(0.05, gt=0, lt=1)
    partition_share: float = Field(0.25, gt=0, lt=1)
    mechanism: Literal["baseline", "interval_tree"] = "baseline"
    #: what each node releases (docs/user-guide.md, "Range counts"): ``histogram`` (a noisy count
    #: per item) or ``mwem_ranges`` (a synthetic histogram fitted to every range of the items, in
    #: the order declared, by multiplicative weights; at most MAX_RANGE_ITEMS items)
    static_release: Literal["histogram", "mwem_ranges"] = "histogram"
    #: the items' fixed split into shards (item i, in declared order, in shard i % shards), each
    #: with a mechanism of its own at this epsilon (docs/user-guide.md, "Shards"); 1: one mechanism
    shards: int = Field(1, ge=1)
    #: how a record holds its updates: ``none`` (one update per record, the fields above) or
    #: ``debezium`` (a change event: ChangeEventParser)
    envelope: Literal["none", "debezium"] = "none"

    @model_validator(mode="before")
    @classmethod
    def _envelope_defaults(cls, data):
        # a Debezium envelope's time is its ts_ms (when the connector read the change); the row's
        # columns are read from before and after alike, so "after.plan" means the column "plan"
        if isinstance(data, dict) and data.get("envelope") == "debezium":
            data = dict(data)
            data.setdefault("time_field", "ts_ms")
            for name in ("item_field", "unit_field"):
                value = data.get(name)
                if isinstance(value, str) and value.startswith(("after.", "before.")):
                    data[name] = value.split(".", 1)[1]
        return data

    @field_validator("epsilon")
    @classmethod
    def _finite_eps(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    @property
    def updates_per_record(self) -> int:
        """The most updates one record carries: 2 for a change event (an update moving its row to
        another item), else 1."""
        return 2 if self.envelope == "debezium" else 1

    @field_validator("tick")
    @classmethod
    def _tick(cls, value: str) -> str:
        parse_duration_ms(value)
        return value

    @field_validator("allowed_lateness")
    @classmethod
    def _dyn_lateness(cls, value: str) -> str:
        parse_duration_ms(value, allow_zero=True)
        return value

    @field_validator("max_skew")
    @classmethod
    def _dyn_max_skew(cls, value: str) -> str:
        _check_max_skew(value)
        return value

    @property
    def tick_ms(self) -> int:
        return parse_duration_ms(self.tick)

    @property
    def lateness_ms(self) -> int:
        return parse_duration_ms(self.allowed_lateness, allow_zero=True)

    @property
    def max_skew_ms(self) -> int:
        return parse_duration_ms(self.max_skew)

    def fingerprint(self) -> str:
        """Hex fingerprint of what the query's counters were built and charged under: the
        mechanism plan, the item domain and the tick schedule. A dynamic query runs its whole life
        on one plan (docs/privacy.md, "Windows and budget"): a node's noise recomputed under
        another scale would release two noisy values of one node."""
        schedule = {"items": list(self.items), "start": self.start, "tick": self.tick_ms, "lateness": self.lateness_ms,
                    "unit_field": self.unit_field, "contribution_bound": self.contribution_bound,
                    # every delete is taken in, present or not (docs/privacy.md, "Dynamic counts"): a
                    # state logged when absent deletes were refused would recompute released nodes
                    # on other data under the same noise, so it must not resume under this rule
                    "absent_deletes": "taken_in"}
        if self.envelope != "none":  # (absent before envelopes existed: those states keep their fingerprint)
            schedule["envelope"] = self.envelope
        if self.shards != 1:  # (likewise before shards)
            schedule["shards"] = self.shards
        return plan_fingerprint([self.plan(), schedule]).hex()

    def pins(self) -> dict:
        """What a dynamic query is pinned to for its whole life: every public setting but those in
        :data:`UNPINNED_DYNAMIC_FIELDS` (the budget, the item domain and tick schedule, the privacy
        unit, the item, op and time fields, the input topic), and :meth:`fingerprint` as
        :data:`dpstream.accountant.pins.PLAN`. Its state and its ledger charge record them."""
        pins = _pinned_settings(self, UNPINNED_DYNAMIC_FIELDS, {"tick": self.tick_ms, "allowed_lateness": self.lateness_ms})
        # up to 10^5 items: recorded as their number and a digest, not one by one
        digest = hashlib.blake2b(json.dumps(list(self.items)).encode(), digest_size=8).hexdigest()
        pins["items"] = f"{len(self.items)} items, digest {digest}"
        pins[PLAN] = self.fingerprint()
        return pins

    def decided_through(self, clock_ms: int) -> int:
        """The last tick whose end plus the allowed lateness the clock has passed (0: none)."""
        return max(0, (clock_ms - self.lateness_ms - self.start) // self.tick_ms)

    @field_validator("items")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("must be distinct")
        return value

    @model_validator(mode="after")
    def _shards(self):
        if self.shards > len(self.items):
            raise ValueError(f"shards: at most the number of items ({len(self.items)}), got {self.shards}")
        return self

    @model_validator(mode="after")
    def _range_items(self):
        if self.static_release == "mwem_ranges" and len(self.items) > MAX_RANGE_ITEMS:
            raise ValueError(f"items: static_release mwem_ranges answers every range of the items, at most {MAX_RANGE_ITEMS} "
                             f"of them (this query declares {len(self.items)}); bucket the attribute more coarsely")
        return self

    def plan(self) -> DynamicPlan:
        # group privacy (pure DP): a unit moves at most contribution_bound updates, a record (the
        # privacy unit without unit_field) at most updates_per_record (docs/privacy.md, "Change streams")
        return DynamicPlan(self.epsilon / (self.contribution_bound if self.unit_field else self.updates_per_record), self.delta,
                           self.beta, self.partition_share, self.mechanism, self.static_release)


class BudgetLimit(BaseModel):
    """A principal's budget per refresh period, its charges composed as ``budget.accounting`` says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_epsilon: float = Field(gt=0)
    max_delta: float = Field(0.0, ge=0, lt=1)
    refresh: Optional[str] = None  # e.g. 30d; null: the budget never refreshes

    @field_validator("refresh")
    @classmethod
    def _refresh(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_duration_ms(value)
        return value

    @field_validator("max_epsilon")
    @classmethod
    def _finite_max(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    def policy(self, accounting: str = "basic") -> BudgetPolicy:
        return BudgetPolicy(self.max_epsilon, self.max_delta, parse_duration_ms(self.refresh) if self.refresh else None, accounting)


class BudgetConfig(BaseModel):
    """The budget ledger (docs/privacy.md, "Windows and budget"): who is charged, how much each may spend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    principal: Literal["query", "tenant", "input_topic"] = "query"
    shadow: bool = False  # track and report, never refuse
    #: how a principal's charges add up against its cap (docs/privacy.md, "Totals over time"):
    #: basic (epsilons and deltas add), zcdp (rho adds), pld (privacy-loss distributions compose;
    #: needs counter: tree in every query the ledger charges)
    accounting: Literal["basic", "zcdp", "pld"] = "basic"
    epoch: str = Field("1", min_length=1)  # a new epoch (lost state, new noise secret) is named here
    #: the public start of the window schedule: the first window charged (epoch ms or ISO-8601
    #: time). null: the worker's first start; a replay then needs --start
    start: Optional[str | int] = None
    default: Optional[BudgetLimit] = None
    principals: dict[str, BudgetLimit] = Field(default_factory=dict)

    @field_validator("start")
    @classmethod
    def _start(cls, value):
        if value is not None:
            parse_time_ms(value)
        return value

    @property
    def start_ms(self) -> Optional[int]:
        return None if self.start is None else parse_time_ms(self.start)

    def principal_of(self, query) -> str:
        if self.principal == "query":
            return query.name
        if self.principal == "input_topic":
            return query.input_topic
        return query.tenant


class SchemaRegistryConfig(BaseModel):
    """Where ``avro``, ``protobuf`` and ``json_schema`` input is decoded against
    (docs/operator-guide.md, "Formats and schema registries"): a Confluent-compatible schema
    registry. ``mock://NAME``: confluent-kafka's in-process mock (tests)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    #: ``user:password``; $DPSTREAM_SCHEMA_REGISTRY_USER_INFO wins (from a Kubernetes Secret)
    basic_auth_user_info: Optional[str] = Field(None, repr=False)
    ssl_ca_location: Optional[str] = None
    ssl_certificate_location: Optional[str] = None
    ssl_key_location: Optional[str] = None
    ssl_key_password: Optional[str] = Field(None, repr=False)
    #: decode into the subject's latest schema (a reader schema: Avro's schema resolution, or
    #: confluent-kafka's migration rules) instead of each record's writer schema
    use_latest_version: bool = False

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://", "mock://")):
            raise ValueError(f"must start with http://, https:// or mock://, got {value!r}")
        return value


class DpstreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    queries: list[QueryConfig] = Field(default_factory=list)
    dynamic: list[DynamicQueryConfig] = Field(default_factory=list)
    budget: Optional[BudgetConfig] = None
    #: how input records are encoded (dpstream.topics.decoding.DECODERS): json, avro, protobuf or
    #: json_schema; a query's own ``input_format`` wins for its input topic
    input_format: str = "json"
    #: the registry the avro, protobuf and json_schema formats are read against
    schema_registry: Optional[SchemaRegistryConfig] = None
    #: Kafka client properties for every client a command opens with this config, by librdkafka's
    #: names (topics/client_properties.py; docs/operator-guide.md, "Connecting to a secured cluster")
    kafka: dict[str, Union[str, int, float, bool]] = Field(default_factory=dict, repr=False)  # may hold a password

    @field_validator("kafka")
    @classmethod
    def _kafka(cls, value: dict) -> dict:
        from dpstream.topics.client_properties import ClientPropertyError, normalized

        try:
            return normalized(value, "kafka")
        except ClientPropertyError as exc:
            raise ValueError(str(exc).removeprefix("kafka: ")) from None

    def format_of(self, query) -> str:
        """The input format of a query's input topic."""
        return getattr(query, "input_format", None) or self.input_format

    @field_validator("input_format")
    @classmethod
    def _input_format(cls, value: str) -> str:
        from dpstream.topics.decoding import DECODERS

        if value not in DECODERS:
            raise ValueError(f"must be one of {', '.join(DECODERS)}, got {value!r}")
        return value

    def _check_composed_cap(self, kind: str, i: int, q, field: str, limit: "BudgetLimit") -> None:
        """With ``budget.accounting`` zcdp or pld: the query's windows must have the loss terms
        the accounting composes (pld: an exact curve, counter tree), and one window composed must
        fit the cap (else every window is refused: a mistake, not a budget)."""
        from dpstream.accountant.composition import Total, dynamic_loss, query_loss, total_epsilon

        accounting = self.budget.accounting
        loss = query_loss(level_plans_for(q)) if kind == "queries" else dynamic_loss(q.epsilon)
        if accounting == "pld" and loss.parts is None:
            raise ValueError(f"budget.accounting: 'pld' composes exact privacy-loss distributions, and {kind}[{i}] ({q.name!r}) "
                             f"uses counter {q.counter!r}, which has none: use counter: tree in every query, or accounting: zcdp")
        one = total_epsilon(Total().add(loss), accounting, limit.max_delta)
        if not self.budget.shadow and one > limit.max_epsilon:
            raise ValueError(f"{field}.max_epsilon: one window of {kind}[{i}] ({q.name!r}) composed by {accounting} at max_delta "
                             f"{limit.max_delta:g} is epsilon {one:.6g}, more than {limit.max_epsilon:g}, so every window would "
                             f"be refused; raise max_epsilon or max_delta (max_delta defaults to 0)")

    @model_validator(mode="after")
    def _unique_names(self) -> "DpstreamConfig":
        if not self.queries and not self.dynamic:
            raise ValueError("queries: the config needs at least one query (under 'queries' or 'dynamic')")
        for i, q in enumerate(self.queries):
            if q.public_key_texts is not None and self.budget is None:
                # every declared key is released in every open window: a window opened by its
                # first record would show, by its releases, that it has data (docs/privacy.md, "Public keys")
                raise ValueError(f"queries[{i}].public_keys: public keys need a budget section: their windows open on the "
                                 f"public schedule (budget.start), data or not, never on a window's first record")
        if self.budget is not None:
            for kind, qs in (("queries", self.queries), ("dynamic", self.dynamic)):
                for i, q in enumerate(qs):
                    principal = self.budget.principal_of(q)
                    if principal is None:
                        raise ValueError(f"{kind}[{i}].tenant: budget.principal is 'tenant', so every query needs a tenant")
                    if principal not in self.budget.principals and self.budget.default is None:
                        raise ValueError(f"budget.principals: no budget for {principal!r} ({kind}[{i}]) and no budget.default")
                    # a cap below one window's charge refuses every window of the query, forever: a
                    # mistake (max_delta defaults to 0), not a budget (docs/user-guide.md, "Budget ledger")
                    field = f"budget.principals.{principal}" if principal in self.budget.principals else "budget.default"
                    limit = self.budget.principals.get(principal, self.budget.default)
                    delta = q.delta if kind == "queries" else 0.0  # dynamic queries spend Laplace only
                    if self.budget.accounting != "basic":
                        self._check_composed_cap(kind, i, q, field, limit)
                    elif not self.budget.shadow and (limit.max_epsilon < q.epsilon or limit.max_delta < delta):
                        which, cap, need = (("max_delta", limit.max_delta, delta) if limit.max_delta < delta
                                            else ("max_epsilon", limit.max_epsilon, q.epsilon))
                        raise ValueError(f"{field}.{which}: {cap:g} is less than one window of {kind}[{i}] ({q.name!r} "
                                         f"spends {which[4:]} {need:g} per window), so every window would be refused; "
                                         f"raise it (max_delta defaults to 0)")
        seen = set()
        for q in [*self.queries, *self.dynamic]:
            if q.name in seen:
                raise ValueError(f"queries: duplicate query name {q.name!r}")
            seen.add(q.name)
        # stage 1 keeps each user's contributions in the state of the input partition the user
        # is keyed to: queries reading one topic must agree on who the user is
        formats: dict[str, str] = {}
        for q in [*self.queries, *self.dynamic]:
            fmt = self.format_of(q)
            if formats.setdefault(q.input_topic, fmt) != fmt:
                raise ValueError(f"queries: queries reading input_topic {q.input_topic!r} must share one input_format "
                                 f"(each record is decoded once)")
            if fmt in ("avro", "protobuf", "json_schema") and self.schema_registry is None:
                raise ValueError(f"schema_registry: input_format {fmt!r} ({q.name!r}) is read against a schema registry: "
                                 f"give its url")
        users_of: dict[str, str] = {}
        for q in self.queries:
            if users_of.setdefault(q.input_topic, q.user_field) != q.user_field:
                raise ValueError(f"queries: queries reading input_topic {q.input_topic!r} must share one user_field "
                                 f"(the topic is partitioned by it)")
        return self


def _format_location(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("function-after", "function-before") and not str(part).startswith("function-"):
            out += ("." if out else "") + str(part)
    return out


def _section_fields(loc: tuple) -> list[str]:
    """The field names of the config section holding the last part of ``loc`` (a pydantic error
    location): the model reached by walking the config's types along it, through lists, dicts
    (``budget.principals.NAME``) and nulls."""
    kind = DpstreamConfig
    for part in loc[:-1]:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            field = kind.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return []
            kind = field.annotation
        else:  # a list's index or a dict's key: the item's type
            kind = get_args(kind)[-1] if get_args(kind) else None
        while get_origin(kind) is Union:  # Optional[X]: X
            kind = next(arg for arg in get_args(kind) if arg is not type(None))
    return list(kind.model_fields) if isinstance(kind, type) and issubclass(kind, BaseModel) else []


def _did_you_mean(name, fields) -> str:
    """`` (did you mean 'x'?)`` with the known field closest to an unknown one, if any is close: a
    typo must be easy to find."""
    close = difflib.get_close_matches(str(name), fields, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _env_overrides(raw: dict, environ: Mapping[str, str]) -> None:
    fields = set(QueryConfig.model_fields)
    for i, query in enumerate(raw.get("queries") or []):
        if not isinstance(query, dict) or "name" not in query:
            continue
        prefix = "DPSTREAM_QUERY_" + re.sub(r"[^A-Za-z0-9]", "_", str(query["name"])).upper() + "_"
        for var, text in environ.items():
            if var.startswith(prefix):
                field_name = var[len(prefix):].lower()
                if field_name not in fields:
                    raise ConfigError(f"environment {var}: queries[{i}] has no field {field_name!r}"
                                      f"{_did_you_mean(field_name, list(QueryConfig.model_fields))}")
                query[field_name] = yaml.safe_load(text)


def load_config(path: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> DpstreamConfig:
    """Read, override from the environment, validate, and calibrate every query."""
    source = Path(path)
    try:
        raw = yaml.safe_load(source.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {source}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {source}: not valid YAML: {exc}") from None
    if isinstance(raw, dict) and isinstance(raw.get("queries"), list):
        for query in raw["queries"]:  # a relative key list is read from the config's own folder
            if isinstance(query, dict) and isinstance(query.get("public_keys_file"), str):
                query["public_keys_file"] = str(source.parent / query["public_keys_file"])
    return config_from_mapping(raw, f"config file {source}", environ)


def config_from_mapping(raw, source: str = "config", environ: Mapping[str, str] = os.environ) -> DpstreamConfig:
    """A config from the YAML's content (``dpstream.plan`` takes a dict), validated and calibrated
    as :func:`load_config` does; errors start with ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with a 'queries' list")
    _env_overrides(raw, environ)
    try:
        config = DpstreamConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = _format_location(err["loc"])
            if err["type"] == "extra_forbidden":
                message = "unknown field" + _did_you_mean(err["loc"][-1], _section_fields(err["loc"]))
            else:
                message = err["msg"].removeprefix("Value error, ")
            if ": " in message and where and not message.startswith(("must", "Input", "Field", "unknown")):
                field_name, message = message.split(": ", 1)
                where = f"{where}.{field_name}"
            problems.append(f"{where or 'config'}: {message}")
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None
    for i, query in enumerate(config.queries):
        try:
            plan_query(query.budget())
        except BudgetError as exc:
            raise ConfigError(f"{source}: queries[{i}].{exc}") from None
    return config


def plan_for(query: QueryConfig) -> PrivacyPlan:
    """The query's plan (for a hierarchy: its first level's, which carries the query's totals)."""
    return plan_query(query.budget())


def level_plans_for(query: QueryConfig) -> tuple[PrivacyPlan, ...]:
    """One plan per level (one for a flat query): what the mechanisms run with."""
    return plan_levels(query.budget())
