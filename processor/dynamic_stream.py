"""A dynamic query over a stream of update records, with its state in a store: shared by
``dpstream replay`` and the Kafka worker's dynamic agent (DESIGN.md sections 3, 6 and 12).

Per record: validate (item in the declared domain, op, a delete only of a present item, a time
not before an already decided tick - else the record is invalid: dead-lettered, never a negative
count), bound the privacy unit's updates
when the query has a ``unit_field``, append the update to the query's *update log* in the
store, and feed it to :class:`processor.dynamic.DynamicCounter`, which returns a release when a
segment closes.

Recovery: the counter is a deterministic function of the update sequence and the secret (all
noise is a keyed PRF of its position), so its state is not stored: on start the log is replayed
through a fresh counter. Releases are published after the write that logged their updates;
``published`` (in the same store) names the last segment that reached the output, and the
releases the log replay recomputes past it are sent again - the same values, since the same
updates meet the same noise.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Optional, Union


from processor.config import DynamicQueryConfig
from processor.dynamic import DynamicCounter, DynamicRelease
from processor.noise import NodeNoise, Pseudonymizer
from state import keys as sk
from state.store import Store, WriteBatch
from topics.records import InvalidRecord, _text

OPS = {"insert": 1, "delete": 2}
OP_NAMES = {1: "insert", 2: "delete"}


def dynamic_release_record(query: DynamicQueryConfig, counter: DynamicCounter, release: DynamicRelease) -> dict:
    """One published update of a dynamic query: noisy counts of every declared item."""
    plan = counter.plan
    counts = {item: float(v) for item, v in zip(counter.items, release.counts.tolist())}
    return {"query": query.name, "segment": release.segment, "tick": release.position,
            "time": query.start + release.position * query.tick_ms, "counts": counts,
            "total": float(sum(counts.values())), "mechanism": f"dynamic:{plan.mechanism}",
            "epsilon": query.epsilon, "delta": plan.delta_spent}


class DynamicQueryState:
    def __init__(self, query: DynamicQueryConfig, noise: NodeNoise, pseudonyms: Pseudonymizer, store: Store):
        self.query = query
        self.store = store
        self.pseudonyms = pseudonyms
        self.qid = sk.query_id(query.name)
        self.counter = DynamicCounter(query.plan(), query.items, noise, query.name)
        self.dropped: Counter = Counter()
        self.refused = False  # the budget ledger refused this query: it does not run
        self.updates_in = 0
        self.releases = 0
        self._units: dict[int, int] = {}
        for key, value in store.scan_prefix(sk.DYNAMIC_UNITS + self.qid):
            self._units[int.from_bytes(key[-8:], "big")] = int.from_bytes(value, "little")
        raw = store.get(self._published_key)
        self.published = int.from_bytes(raw, "little") if raw else 0
        self.pending: list[DynamicRelease] = []  # recomputed by the log replay, not yet published
        for key, value in store.scan_prefix(sk.DYNAMIC_LOG + self.qid):
            item, op, tick = int.from_bytes(value[:4], "little"), OP_NAMES[value[4]], int.from_bytes(value[5:13], "little")
            for release in self.counter.apply(query.items[item], op, tick):
                if release.segment > self.published:
                    self.pending.append(release)

    @property
    def _published_key(self) -> bytes:
        return sk.META + b"dyn-published" + self.qid

    def parse(self, obj: Union[dict, InvalidRecord]) -> Union[tuple[str, str, int, Optional[str]], InvalidRecord]:
        if isinstance(obj, InvalidRecord):
            return obj
        q = self.query
        item = _text(obj.get(q.item_field), q.item_field)
        if isinstance(item, InvalidRecord):
            return item
        op = obj.get(q.op_field)
        if op not in OPS:
            return InvalidRecord(f"field {q.op_field!r} must be 'insert' or 'delete'")
        ts = obj.get(q.time_field)
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts != int(ts):
            return InvalidRecord(f"field {q.time_field!r} must be an integer (epoch milliseconds)")
        if ts < q.start:
            return InvalidRecord(f"field {q.time_field!r} is before the query's start")
        unit = None
        if q.unit_field is not None:
            unit = _text(obj.get(q.unit_field), q.unit_field)
            if isinstance(unit, InvalidRecord):
                return unit
        return item, op, (int(ts) - q.start) // q.tick_ms + 1, unit

    def apply(self, obj: Union[dict, InvalidRecord], batch: WriteBatch) -> tuple[list[DynamicRelease], Optional[str]]:
        """One record: (releases of the segments it closed, invalid reason if invalid). Updates
        the log and unit counts in ``batch``; the caller writes it, then publishes."""
        self.updates_in += 1
        if self.refused:
            self.dropped["budget"] += 1
            return [], None
        parsed = self.parse(obj)
        if isinstance(parsed, InvalidRecord):
            self.dropped["malformed"] += 1
            return [], parsed.reason
        item, op, tick, unit = parsed
        reason = self.counter.check(item, op, tick)
        if reason is not None:
            reason = reason.replace("'item'", repr(self.query.item_field))
            self.dropped["late" if reason.startswith("late") else "malformed"] += 1
            return [], reason
        if unit is not None:
            uid = int(self.pseudonyms.users([unit])[0])
            used = self._units.get(uid, 0)
            if used >= self.query.contribution_bound:
                self.dropped["contribution_bound"] += 1
                return [], None
            self._units[uid] = used + 1
            batch.put(sk.DYNAMIC_UNITS + self.qid + uid.to_bytes(8, "big"), (used + 1).to_bytes(4, "little"))
        seq = self.counter.updates
        batch.put(sk.DYNAMIC_LOG + self.qid + seq.to_bytes(8, "big"),
                  self.counter.index[item].to_bytes(4, "little") + bytes([OPS[op]]) + tick.to_bytes(8, "little"))
        releases = self.counter.apply(item, op, tick)
        self.pending += releases
        return releases, None

    def take_pending(self) -> list[dict]:
        """Releases to publish now (logged, not yet marked published), as records."""
        out = [dynamic_release_record(self.query, self.counter, r) for r in self.pending]
        return out

    def mark_published(self, batch: WriteBatch) -> None:
        if self.pending:
            self.published = self.pending[-1].segment
            self.releases += len(self.pending)
            batch.put(self._published_key, self.published.to_bytes(4, "little"))
            self.pending = []
