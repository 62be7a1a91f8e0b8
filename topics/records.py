"""Record contracts (docs/operations.md, "Topics and records"): input events, release records, dead letters.

Parsing never raises on bad input: it returns an :class:`InvalidRecord` whose ``reason`` names
the field and the problem but never quotes the record's content (reasons end up in logs and
metrics; raw data and user ids must not). The original bytes travel only inside dead-letter
records, which go to the dead-letter topic/file, never to logs.
"""
from __future__ import annotations

import base64
import datetime
import functools
import hashlib
import json
import math
import operator
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np

MAX_FIELD_CHARS = 4096


@dataclass(frozen=True)
class Event:
    user: str
    key: str  # the GROUP BY key: the field's text, or a JSON list for several key fields
    value: float
    ts: int  # event time, epoch milliseconds


@dataclass(frozen=True)
class InvalidRecord:
    reason: str  # e.g. "missing field 'user_id'"; never contains record content


#: what every decoder gives for a record without a value: a Kafka tombstone (the record a
#: compacted topic's producer writes after a delete, as Debezium does after each delete event).
#: Invalid for queries of events; a change stream's tombstones carry nothing and are skipped
TOMBSTONE = InvalidRecord("no value (a tombstone)")


def _text(value, name: str) -> Union[str, InvalidRecord]:
    if isinstance(value, bool) or value is None:
        return InvalidRecord(f"field {name!r} is missing or null")
    if isinstance(value, str):
        text = value
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        text = str(int(value))
    else:
        return InvalidRecord(f"field {name!r} must be a string or an integer")
    if not text:
        return InvalidRecord(f"field {name!r} is empty")
    if len(text) > MAX_FIELD_CHARS:
        return InvalidRecord(f"field {name!r} is longer than {MAX_FIELD_CHARS} characters")
    return text


def field_reader(name: str):
    """Reads a field of a decoded record by the name a query gives it. A dotted name
    (``after.user_id``) reads nested objects, as in a Debezium change event's envelope, unless the
    record has a field of that very name; a missing step reads as None (missing)."""
    if "." not in name:
        return lambda obj: obj.get(name)
    steps = name.split(".")

    def read(obj: Mapping):
        if name in obj:
            return obj[name]
        for step in steps:
            if not isinstance(obj, Mapping):
                return None
            obj = obj.get(step)
        return obj

    return read


def set_field(obj: dict, name: str, value) -> None:
    """Writes the field :func:`field_reader` reads (``produce --rebase-time``)."""
    if "." in name and name not in obj:
        *steps, last = name.split(".")
        for step in steps:
            obj = obj[step]
        obj[last] = value
    else:
        obj[name] = value


def _event_time(ts, name: str) -> Union[int, InvalidRecord]:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts != int(ts):
        return InvalidRecord(f"field {name!r} must be an integer (epoch milliseconds)")
    return int(ts)


class EventParser:
    """A query's event from a decoded record (a mapping: dpstream.topics.decoding), by its field names."""

    def __init__(self, user_field: str, key_fields: Sequence[str], value_field: Optional[str], time_field: str):
        self.user_field = user_field
        self.key_fields = list(key_fields)
        self.value_field = value_field
        self.time_field = time_field
        self._user, self._time = field_reader(user_field), field_reader(time_field)
        self._keys = [(name, field_reader(name)) for name in self.key_fields]
        self._value = None if value_field is None else field_reader(value_field)
        self._flat = "." not in "".join([user_field, time_field, *self.key_fields, value_field or ""])

    @classmethod
    def for_query(cls, query) -> "EventParser":
        return cls(query.user_field, query.key_fields, query.value_field, query.time_field)

    def from_mapping(self, obj: Union[Mapping, InvalidRecord]) -> Union[Event, InvalidRecord]:
        if isinstance(obj, InvalidRecord):
            return obj
        user = _text(self._user(obj), self.user_field)
        if isinstance(user, InvalidRecord):
            return user
        parts = []
        for name, read in self._keys:
            part = _text(read(obj), name)
            if isinstance(part, InvalidRecord):
                return part
            parts.append(part)
        key = parts[0] if len(parts) == 1 else key_text(parts)
        if self.value_field is None:
            value = 1.0
        else:
            raw_value = self._value(obj)
            if isinstance(raw_value, bool) or not isinstance(raw_value, (int, float)):
                return InvalidRecord(f"field {self.value_field!r} must be a number")
            value = float(raw_value)
            if not math.isfinite(value):
                return InvalidRecord(f"field {self.value_field!r} is not finite")
        ts = _event_time(self._time(obj), self.time_field)
        if isinstance(ts, InvalidRecord):
            return ts
        if not 0 <= ts < 1 << 53:
            return InvalidRecord(f"field {self.time_field!r} is out of range")
        return Event(user, key, value, ts)

    def parse_batch(self, objs: Sequence[Union[Mapping, InvalidRecord]]) -> "EventBatch":
        """The events of a batch of decoded records, as columns: the same events and the same
        reasons as :meth:`from_mapping` on each record. A batch of plain records (string user and
        key fields, integer times, numeric values) is checked and converted column by column;
        any other batch is parsed record by record."""
        fast = self._plain_batch(objs)
        if fast is not None:
            return fast
        index, users, keys, values, ts, invalid = [], [], [], [], [], {}
        for i, obj in enumerate(objs):
            event = self.from_mapping(obj)
            if isinstance(event, InvalidRecord):
                invalid[i] = event.reason
                continue
            index.append(i)
            users.append(event.user)
            keys.append(event.key)
            values.append(event.value)
            ts.append(event.ts)
        return EventBatch(np.array(index, dtype=np.int64), users, keys, np.array(values, dtype=np.float64), np.array(ts, dtype=np.int64),
                          invalid)

    def _plain_batch(self, objs: Sequence) -> Optional["EventBatch"]:
        if not objs or set(map(type, objs)) != {dict}:
            return None
        if self._flat:
            try:  # a missing field: parsed record by record, for its reason
                columns = [list(map(operator.itemgetter(name), objs)) for name in (self.user_field, *self.key_fields)]
                times = list(map(operator.itemgetter(self.time_field), objs))
                raw = None if self.value_field is None else list(map(operator.itemgetter(self.value_field), objs))
            except KeyError:
                return None
        else:  # nested fields read as None when missing: the checks below send such a batch record by record
            columns = [list(map(read, objs)) for read in (self._user, *(r for _, r in self._keys))]
            times = list(map(self._time, objs))
            raw = None if self._value is None else list(map(self._value, objs))
        for column in columns:  # exactly what _text accepts unchanged: non-empty strings, not too long
            if set(map(type, column)) != {str} or min(map(len, column)) == 0 or max(map(len, column)) > MAX_FIELD_CHARS:
                return None
        if set(map(type, times)) != {int} or min(times) < 0 or max(times) >= 1 << 53:
            return None
        if self.value_field is None:
            values = np.ones(len(objs), dtype=np.float64)
        else:
            if not set(map(type, raw)) <= {int, float}:
                return None
            values = np.array([float(v) for v in raw], dtype=np.float64)
            if not np.isfinite(values).all():
                return None
        users, parts = columns[0], columns[1:]
        keys = parts[0] if len(parts) == 1 else [key_text(list(k)) for k in zip(*parts)]
        return EventBatch(np.arange(len(objs), dtype=np.int64), users, keys, values, np.array(times, dtype=np.int64), {})


@dataclass
class EventBatch:
    """A batch's valid events as columns (``index``: their positions in the batch) and the
    reason for each invalid record, by position."""

    index: np.ndarray
    users: list[str]
    keys: list[str]
    values: np.ndarray
    ts: np.ndarray
    invalid: dict[int, str]


@dataclass(frozen=True)
class Update:
    """An insert or delete of a dynamic query (docs/privacy.md, "Dynamic counts")."""

    item: str
    op: str  # "insert" or "delete"
    tick: int  # 1-based tick of its time
    ts: int  # event time, epoch milliseconds
    unit: Optional[str]  # the privacy unit's id, if the query has a unit field


def _update_time(ts, name: str, start: int) -> Union[int, InvalidRecord]:
    """A dynamic query's update time: epoch milliseconds, not before the query's start (an int,
    the usual case, is taken as it is)."""
    if type(ts) is not int:
        ts = _event_time(ts, name)
        if isinstance(ts, InvalidRecord):
            return ts
    if ts < start:
        return InvalidRecord(f"field {name!r} is before the query's start")
    return ts


@dataclass
class UpdateColumns:
    """The updates of many update records at once (:meth:`UpdateParser.columns`), one row per
    record, in order. A row in ``invalid`` holds no update (its other columns are meaningless)."""

    items: np.ndarray  # int64 index into the query's declared items
    ops: np.ndarray  # int64 op code: 1 insert, 2 delete
    ts: np.ndarray  # int64 event time, epoch milliseconds
    ticks: np.ndarray  # int64 1-based tick of ``ts``
    units: Optional[list]  # each row's unit id (with a unit field), else None
    invalid: dict  # row -> InvalidRecord

    def __len__(self) -> int:
        return len(self.items)


#: op codes of UpdateColumns.ops (and of the update log: processor/engine/dynamic_stream.py)
UPDATE_OPS = {"insert": 1, "delete": 2}

#: event times at or past this are parsed one by one (their ticks do not fit the int64 columns)
_COLUMN_TS_LIMIT = 2 ** 62

#: what :meth:`UpdateParser.columns` reads a non-mapping record as (then parsed one by one)
_NOT_A_DICT: dict = {}


class UpdateParser:
    """A dynamic query's update from a decoded record, by its field names, declared items and ticks."""

    OPS = ("insert", "delete")

    def __init__(self, query, items: Sequence[str]):
        self.query = query
        self.items = frozenset(items)
        self._item, self._op, self._time = field_reader(query.item_field), field_reader(query.op_field), field_reader(query.time_field)
        self._unit = None if query.unit_field is None else field_reader(query.unit_field)
        self._start, self._tick_ms = query.start, query.tick_ms  # read once: every record uses them
        self._index = {item: i for i, item in enumerate(items)}

    def from_mapping(self, obj: Union[Mapping, InvalidRecord]) -> Union[Update, InvalidRecord]:
        if isinstance(obj, InvalidRecord):
            return obj
        q = self.query
        item = self._item(obj)
        if type(item) is not str or item not in self.items:  # the usual case skips _text: a declared item is valid text
            item = _text(item, q.item_field)
            if isinstance(item, InvalidRecord):
                return item
            if item not in self.items:
                return InvalidRecord(f"field {q.item_field!r} is not in the query's declared items")
        op = self._op(obj)
        if op not in self.OPS:
            return InvalidRecord(f"field {q.op_field!r} must be 'insert' or 'delete'")
        ts = _update_time(self._time(obj), q.time_field, self._start)
        if isinstance(ts, InvalidRecord):
            return ts
        unit = None
        if self._unit is not None:
            unit = _text(self._unit(obj), q.unit_field)
            if isinstance(unit, InvalidRecord):
                return unit
        return Update(item, op, (ts - self._start) // self._tick_ms + 1, ts, unit)

    def columns(self, objs: Sequence[Union[Mapping, InvalidRecord]]) -> Optional[UpdateColumns]:
        """:meth:`from_mapping` of every record at once, as columns: the same updates and the same
        refusals. The usual record (flat fields, a declared item as text, an op, an integer time,
        a unit as text) is read in a few list passes and numpy; any other record goes through
        :meth:`from_mapping`. None (then parse one by one) for a batch the columns cannot hold: a
        valid time past 2^62 ms, or field names with dots."""
        q = self.query
        names = [q.item_field, q.op_field, q.time_field, *([q.unit_field] if self._unit is not None else [])]
        if any("." in name for name in names):
            return None
        index = self._index
        dicts = [o if type(o) is dict else _NOT_A_DICT for o in objs]
        try:
            items = [index.get(o.get(q.item_field), -1) for o in dicts]
            ops = [UPDATE_OPS.get(o.get(q.op_field), 0) for o in dicts]
        except TypeError:  # an unhashable value (a list, an object): no item, no op; one by one
            items = [index.get(v, -1) if type(v) is str else -1 for v in (o.get(q.item_field) for o in dicts)]
            ops = [UPDATE_OPS.get(v, 0) if type(v) is str else 0 for v in (o.get(q.op_field) for o in dicts)]
        start = self._start
        ts = [t if type(t) is int and start <= t < _COLUMN_TS_LIMIT else -1 for t in (o.get(q.time_field) for o in dicts)]
        units = ok_unit = None
        if self._unit is not None:
            units = [o.get(q.unit_field) for o in dicts]
            ok_unit = [type(u) is str and 0 < len(u) <= MAX_FIELD_CHARS for u in units]
        invalid = {}
        for i, (item, op, t) in enumerate(zip(items, ops, ts)):
            if item >= 0 and op and t >= 0 and (ok_unit is None or ok_unit[i]):
                continue
            parsed = self.from_mapping(objs[i])  # the exact judgement, or an unusual valid record
            if isinstance(parsed, InvalidRecord):
                invalid[i] = parsed
                continue
            if parsed.ts >= _COLUMN_TS_LIMIT:
                return None
            items[i], ops[i], ts[i] = index[parsed.item], UPDATE_OPS[parsed.op], parsed.ts
            if units is not None:
                units[i] = parsed.unit
        ts_array = np.array(ts, dtype=np.int64)
        return UpdateColumns(np.array(items, dtype=np.int64), np.array(ops, dtype=np.int64), ts_array,
                             (ts_array - start) // self._tick_ms + 1, units, invalid)


class ChangeEventParser:
    """A dynamic query's updates from a database change event in Debezium's envelope (the query's
    ``envelope: debezium``; docs/user-guide.md, "Change streams"): ``op`` ``c`` (insert) and
    ``r`` (a snapshot's read) insert the ``after`` row's item, ``d`` deletes the ``before`` row's,
    and ``u`` deletes the ``before`` row's and inserts the ``after`` row's, or carries nothing when
    the item did not change. A record with a ``schema`` and a ``payload`` (Kafka Connect's
    JsonConverter with schemas) is read from its payload. A tombstone carries nothing (skipped).

    Which updates a record carries depends on that record alone, so one more change event in a
    stream is at most two more updates, each at the record's own tick (docs/privacy.md, "Change
    streams"). With a ``unit_field``, an event is its row's unit's: the ``after`` row's, the
    ``before`` row's for a delete. ``t`` (a truncate) names no rows: invalid, like any other op."""

    INSERT_OPS = ("c", "r")

    def __init__(self, query, items: Sequence[str]):
        self.query = query
        self.items = frozenset(items)
        self._item, self._time = field_reader(query.item_field), field_reader(query.time_field)
        self._unit = None if query.unit_field is None else field_reader(query.unit_field)
        self._start, self._tick_ms = query.start, query.tick_ms  # read once: every record uses them

    def _image(self, event: Mapping, side: str, op: str) -> Union[tuple[str, Optional[str]], InvalidRecord]:
        """The (item, unit) of the event's ``before`` or ``after`` row."""
        row = event.get(side)
        if type(row) is not dict and not isinstance(row, Mapping):  # decoded JSON: a dict, checked at once
            why = " (a delete or update needs the row's old values: PostgreSQL tables need REPLICA IDENTITY FULL)" \
                if side == "before" else ""
            return InvalidRecord(f"field {side!r} is missing or null for op {op!r}{why}")
        q = self.query
        item = self._item(row)
        if type(item) is not str or item not in self.items:  # the usual case skips _text: a declared item is valid text
            item = _text(item, f"{side}.{q.item_field}")
            if isinstance(item, InvalidRecord):
                return item
            if item not in self.items:
                return InvalidRecord(f"field {side}.{q.item_field!r} is not in the query's declared items")
        unit = None
        if self._unit is not None:
            unit = _text(self._unit(row), f"{side}.{q.unit_field}")
            if isinstance(unit, InvalidRecord):
                return unit
        return item, unit

    def from_mapping(self, obj: Union[Mapping, InvalidRecord]) -> Union[list[Update], InvalidRecord]:
        if type(obj) is not dict:  # decoded JSON is a dict: the other checks are for the rest
            if obj is TOMBSTONE or obj == TOMBSTONE:
                return []
            if isinstance(obj, InvalidRecord):
                return obj
        if len(obj) == 2 and "payload" in obj and "schema" in obj:  # JsonConverter with schemas.enable=true
            obj = obj["payload"]
            if not isinstance(obj, Mapping):
                return InvalidRecord("field 'payload' is not an object (a Debezium change event)")
        q = self.query
        op = obj.get("op")
        if op not in ("c", "r", "u", "d"):
            return InvalidRecord("field 'op' must be 'c', 'r', 'u' or 'd' (a Debezium change event's)")
        ts = _update_time(self._time(obj), q.time_field, self._start)
        if isinstance(ts, InvalidRecord):
            return ts
        tick = (ts - self._start) // self._tick_ms + 1
        out = []
        if op in ("u", "d"):
            old = self._image(obj, "before", op)
            if isinstance(old, InvalidRecord):
                return old
            out.append(Update(old[0], "delete", tick, ts, old[1]))
        if op != "d":
            new = self._image(obj, "after", op)
            if isinstance(new, InvalidRecord):
                return new
            if op == "u":
                if new[0] == out[0].item:
                    return []  # the row stayed under its item: the counts do not move
                # an event belongs to one unit, its row's now (after), whose bound it counts against
                out[0] = Update(out[0].item, "delete", tick, ts, new[1])
            out.append(Update(new[0], "insert", tick, ts, new[1]))
        return out


def key_text(parts: Sequence[str]) -> str:
    """The text of a key of several fields (a JSON list): one form for parsing, the levels of a
    hierarchy and the published view, so a prefix's text is the same wherever it is built."""
    return json.dumps(list(parts), ensure_ascii=False, separators=(",", ":"))


def key_for_output(key: str, key_fields: Sequence[str]):
    """The GROUP BY key as published: a string for one field, a list for several."""
    return key if len(key_fields) == 1 else json.loads(key)


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


@functools.lru_cache(maxsize=4096)  # a trigger's releases share their three times
def iso_utc(ms: int) -> str:
    """An epoch-millisecond time as ISO-8601 UTC: ``2026-11-20T00:00:00Z``, with ``.mmm`` before
    the ``Z`` when the time is not a whole second. Exact (integer arithmetic), the twin of the
    epoch field it sits beside (docs/operations.md, "Topics and records")."""
    ms = int(ms)
    moment = _EPOCH + datetime.timedelta(milliseconds=ms)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{ms % 1000:03d}Z" if ms % 1000 else f"{text}Z"


def release_record(*, query: str, window_start: int, window_end: int, trigger: int, trigger_time: int, key, fields: dict,
                   epsilon: float, delta: float, mechanism: str = "dp-sqlp") -> dict:
    """One published histogram update: ``fields`` are the aggregate's released values, their
    noise scales and confidence intervals (dpstream.processor.mechanisms.aggregates). Every epoch-ms
    time has an ISO-8601 UTC twin (``<field>_iso``). Never raw counts, never user ids."""
    return {
        "query": query,
        "window_start": window_start,
        "window_start_iso": iso_utc(window_start),
        "window_end": window_end,
        "window_end_iso": iso_utc(window_end),
        "trigger": trigger,
        "trigger_time": trigger_time,
        "trigger_time_iso": iso_utc(trigger_time),
        "key": key,
        **fields,
        "mechanism": mechanism,
        "epsilon": epsilon,
        "delta": delta,
    }


#: the fields an adapter adds to every release about the run that made it (the worker: ``app_id``
#: and ``run``, whose ``noise_label`` replay reproduces; replay: ``run``); the rest is the
#: mechanism's own, the same for a worker and a replay under its noise label (docs/user-guide.md)
RUN_FIELDS = ("app_id", "run")


def release_key(query: str, window_start: int, key) -> bytes:
    """Kafka message key of a release: (query, window, key), so a compacted topic keeps the latest."""
    return json.dumps([query, window_start, key], ensure_ascii=False, separators=(",", ":")).encode()


def encode_json(record: dict) -> bytes:
    """Canonical JSON (sorted keys, no spaces): byte-identical for identical records."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


#: bytes of an original record a dead letter carries at most. Apache Kafka's default record limit is
#: 1 MB, and base64 grows the bytes by a third: a larger original is cut to its first 256 KiB, with
#: its size and SHA-256 kept, so no input record can make a dead letter the broker refuses (and
#: so stop the worker on every restart: docs/operations.md, "Topics and records")
MAX_DEAD_LETTER_ORIGINAL = 256 * 1024


def dead_letter(reason: str, original: bytes, source: str) -> dict:
    """A dead-letter record: the reason, where it came from (``topic/partition@offset``), and the
    original bytes (base64), cut to :data:`MAX_DEAD_LETTER_ORIGINAL` with the whole record's size
    and SHA-256 when longer."""
    body = {"reason": reason, "source": source}
    if len(original) > MAX_DEAD_LETTER_ORIGINAL:
        body.update(original_bytes=len(original), original_sha256=hashlib.sha256(original).hexdigest(), truncated=True)
        original = original[:MAX_DEAD_LETTER_ORIGINAL]
    body["original_b64"] = base64.b64encode(original).decode("ascii")
    return body


#: Message key of a watermark marker on a repartition topic (stage-1 data messages have no key)
WATERMARK_KEY = b"dpstream-watermark"


def encode_watermark(topic: str, partition: int, watermark_ms: int) -> bytes:
    """A stage-1 partition's progress marker: every input record of ``topic``/``partition`` with a
    Kafka timestamp up to ``watermark_ms`` is already on the repartition topic, before this marker
    (docs/privacy.md, "Time")."""
    return encode_json({"topic": topic, "partition": int(partition), "watermark": int(watermark_ms)})


def decode_watermark(value: bytes) -> tuple[str, int, int]:
    obj = json.loads(value)
    return str(obj["topic"]), int(obj["partition"]), int(obj["watermark"])
