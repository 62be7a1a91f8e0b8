"""The DP-SQLP pipeline of one query (DP-SQLP sections 3-4): one code path for the local replay
runner, the benchmarks and the Kafka worker's agents.

Stage 1, by user (:meth:`QueryPipeline.bound`): event-time window and trigger of each event,
late events dropped, contribution bounding (at most C records per user and window, each with a
slot 1..C; values clamped and put on the grid), and for each admitted record the trigger of the
same user's previous record for the same key.

Stage 2, by key: bounded records are appended to the pending micro-batch of their (window,
trigger) (:meth:`QueryPipeline.accumulate`); at the trigger, :meth:`QueryPipeline.fire`

1. loads only the keys in the micro-batch plus the keys the prediction index names for this
   trigger (section 4.3) - never all keys;
2. drops replayed stage-1 output (a (user, slot) pair seen twice in the micro-batch: DESIGN.md
   section 12) and counts users new to each key's current round (their previous record for the
   key came before the round started);
3. merges the micro-batch into each key's data buffer and runs key selection (Algorithm 2);
4. releases selected keys' buffers through their perturbation trees (Algorithm 3);
5. re-plans when each key must next be looked at: a key that had data is visited again at the
   next trigger (cheap, and most active keys have data again); a key visited without data gets
   the full release prediction (Algorithm 4) and is indexed under its predicted trigger, if any;
6. journals the releases and writes all state, the index and the window's progress in one atomic
   write before anything is published; firing an already fired trigger returns the journal, so
   a (window, key, trigger) is never released twice with different values.

Micro-batch membership is by event time: an event with time t belongs to trigger
``i = floor((t - window_start) / (window / T)) + 1`` of its window; the trigger fires once the
clock (the watermark in replay, wall time in the worker) passes ``window_start + i * window / T
+ allowed_lateness``. Events for a trigger that has fired are late and dropped (counted).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from processor.bounding import ContributionBounder, last_contributions
from processor.config import QueryConfig, level_plans_for, parse_duration_ms
from processor.consistency import solve as solve_consistency
from processor.key_selection import KeySelector, SelectionBatch
from processor.noise import NodeNoise, Pseudonymizer
from processor.perturbation import HierarchicalPerturber, PerturbationBatch
from state import keys as sk
from state.store import Store, WriteBatch
from topics.records import encode_json, key_for_output, key_text, release_record

_USER_ENTRY = np.dtype([("key", "<u8"), ("trigger", "<u4")])
#: a hierarchy's published view, per released key: what the consistency step starts from
_VIEW_ENTRY = np.dtype([("level", "<u4"), ("released_at", "<u4"), ("count", "<f8"), ("stddev", "<f8"), ("consistent", "<i8"),
                        ("other", "<i8")])
#: initial half-width of a value's domain in the consistency program, in standard deviations of
#: its noise (Fioretto et al. section 11.2 size domains from the noise; the solver widens them
#: whenever the optimum touches a bound, so this only affects speed, never the result)
CONSISTENCY_SPREAD = 3.0


def level_key_texts(text: str, depth: int) -> list[str]:
    """The key of each level 1..depth of a hierarchy for a full key (its prefixes, coarse first)."""
    parts = json.loads(text)
    return [key_text(parts[:level]) for level in range(1, depth)] + [text]


def _parse_user_states(values: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage-1 user states: admitted count (u16) then (key, last trigger) entries, one per key."""
    lengths = np.fromiter((len(v) if v else 0 for v in values), dtype=np.int64, count=len(values))
    raw = np.frombuffer(b"".join(v for v in values if v), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    present = lengths > 0
    before = np.zeros(len(values), dtype=np.int64)
    before[present] = raw[starts[present]].astype(np.int64) + 256 * raw[starts[present] + 1].astype(np.int64)
    per_user = np.maximum(lengths - 2, 0) // _USER_ENTRY.itemsize
    group = np.repeat(np.arange(len(values), dtype=np.int64), per_user)
    if not len(group):
        return before, group, np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    first_entry = np.cumsum(per_user) - per_user
    entry_start = starts[group] + 2 + (np.arange(len(group)) - first_entry[group]) * _USER_ENTRY.itemsize
    entries = raw[entry_start[:, None] + np.arange(_USER_ENTRY.itemsize)].copy().view(_USER_ENTRY).ravel()
    return before, group, entries["key"].astype(np.uint64), entries["trigger"].astype(np.int64)


#: Version of the state layout (key rows, pending micro-batches, tables). 2: key rows carry the
#: level and level-1 key of hierarchies, bounded records their levels and roots.
STATE_FORMAT = b"2"


def check_noise_epoch(store: Store, noise: NodeNoise) -> None:
    """State written under another noise secret must never be mixed with this one: the secret
    defines the budget epoch (DESIGN.md section 12). Nor may state of another layout version be
    read as this one."""
    key, format_key = sk.META + b"noise-epoch", sk.META + b"state-format"
    stored = store.get(key)
    mine = noise.fingerprint.encode()
    if stored is None:
        batch = WriteBatch()
        batch.put(key, mine)
        batch.put(format_key, STATE_FORMAT)
        store.write(batch)
        return
    if stored != mine:
        raise RuntimeError("the state directory was written with a different noise secret (another budget epoch); "
                           "use a new state directory")
    fmt = store.get(format_key) or b"1"
    if fmt != STATE_FORMAT:
        raise RuntimeError(f"the state directory was written by dpstream state format {fmt.decode()}, this is format "
                           f"{STATE_FORMAT.decode()}: use a new state directory (a new epoch)")


def _ordered(releases: list[dict]) -> list[dict]:
    """Releases of one trigger in a fixed order (by key), for byte-identical output."""
    return sorted(releases, key=lambda r: json.dumps(r["key"], ensure_ascii=False))


@dataclass
class EventColumns:
    """Parsed, valid events of one query, in arrival order."""

    users: np.ndarray  # uint64 pseudonyms
    keys: np.ndarray  # object array of group-by key text
    key_ids: np.ndarray  # uint64 pseudonyms of the keys
    values: np.ndarray  # float64
    ts: np.ndarray  # int64 event time (ms)

    def __len__(self) -> int:
        return len(self.ts)


@dataclass
class BoundedRecords:
    """Stage 1 output (what the repartition topic carries), in arrival order."""

    window: np.ndarray  # int64 window start
    trigger: np.ndarray  # int64
    key_ids: np.ndarray  # uint64
    keys: np.ndarray  # object (text)
    users: np.ndarray  # uint64
    slots: np.ndarray  # int64, 1..C
    units: np.ndarray  # int64, value on the grid
    previous: np.ndarray  # int64, trigger of the user's previous record for this key (0: none)
    levels: np.ndarray  # int64, level of the key (1 = coarsest; always 1 for a flat query)
    roots: np.ndarray  # uint64, id of the key's level-1 prefix (the key itself for a flat query): routes stage 2

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, index) -> "BoundedRecords":
        return BoundedRecords(*(getattr(self, f)[index] for f in self.__dataclass_fields__))

    _COLUMNS = (("window", "<i8"), ("trigger", "<u4"), ("key_ids", "<u8"), ("users", "<u8"), ("slots", "<u2"), ("units", "<i8"),
                ("previous", "<u4"), ("levels", "<u1"), ("roots", "<u8"))

    def encode(self) -> bytes:
        """Wire form of stage-1 output (the repartition topic's message value): fixed-width
        little-endian columns, then the JSON list of the distinct keys' texts."""
        uniq, first = np.unique(self.key_ids, return_index=True)
        texts = json.dumps([self.keys[j] for j in first.tolist()], ensure_ascii=False).encode()
        head = np.array([len(self), len(uniq)], dtype="<u4").tobytes()
        cols = [getattr(self, name).astype(dtype).tobytes() for name, dtype in self._COLUMNS]
        return b"".join([head, *cols, uniq.astype("<u8").tobytes(), texts])

    @classmethod
    def decode_columns(cls, blob: bytes) -> tuple[dict, dict]:
        """The columns of :meth:`encode` as arrays, and {key id: key text}."""
        n, m = np.frombuffer(blob[:8], dtype="<u4").tolist()
        pos, cols = 8, {}
        for name, dtype in cls._COLUMNS + (("uniq", "<u8"),):
            count = m if name == "uniq" else n
            size = np.dtype(dtype).itemsize * count
            cols[name] = np.frombuffer(blob[pos:pos + size], dtype=dtype)
            pos += size
        return cols, dict(zip(cols.pop("uniq").tolist(), json.loads(blob[pos:].decode())))

    @classmethod
    def decode(cls, blob: bytes) -> "BoundedRecords":
        cols, texts = cls.decode_columns(blob)
        keys = np.array([texts[k] for k in cols["key_ids"].tolist()], dtype=object)
        return cls(cols["window"].astype(np.int64), cols["trigger"].astype(np.int64), cols["key_ids"].astype(np.uint64), keys,
                   cols["users"].astype(np.uint64), cols["slots"].astype(np.int64), cols["units"].astype(np.int64),
                   cols["previous"].astype(np.int64), cols["levels"].astype(np.int64), cols["roots"].astype(np.uint64))


@dataclass
class MicroBatch:
    """What stage 2 merges at a trigger: de-duplicated bounded records and new keys' texts."""

    key_ids: np.ndarray
    users: np.ndarray
    previous: np.ndarray
    units: np.ndarray
    texts: dict
    levels: np.ndarray  # per record
    roots: np.ndarray  # per record


@dataclass
class PipelineStats:
    events_in: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    releases: int = 0
    keys_released: set = field(default_factory=set, repr=False)
    keys_loaded: int = 0  # keys loaded by the last fire()
    keys_tracked: int = 0  # key states held in open windows
    accumulated: int = 0  # bounded records appended to pending micro-batches (stage 2 input)
    triggers_fired: int = 0
    consistency_updates: int = 0  # records re-issued only because a key's consistent value changed
    consistency_seconds: float = 0.0  # time spent in the consistency step (hierarchies)


class Schedule:
    """Event-time windows and the fixed trigger schedule of a query (public)."""

    def __init__(self, query: QueryConfig):
        self.window_ms = query.window_ms
        self.triggers = query.triggers
        self.interval = self.window_ms // self.triggers
        self.lateness = parse_duration_ms(query.allowed_lateness, allow_zero=True)

    def window_of(self, ts: np.ndarray) -> np.ndarray:
        return ts - ts % self.window_ms

    def trigger_of(self, ts: np.ndarray, window: np.ndarray) -> np.ndarray:
        return (ts - window) // self.interval + 1

    def trigger_time(self, window, trigger):
        return window + trigger * self.interval

    def fire_time(self, window, trigger):
        return self.trigger_time(window, trigger) + self.lateness


class QueryPipeline:
    def __init__(self, query: QueryConfig, noise: NodeNoise, store: Store, pseudonyms: Optional[Pseudonymizer] = None):
        self.query = query
        #: one plan per level (DESIGN.md section 8); a flat query has one level
        self.plans = level_plans_for(query)
        self.plan = self.plans[0]  # shared terms: C, L, grid, mu, the query's (epsilon, delta)
        self.depth = query.levels
        if self.depth > 1 and pseudonyms is None:
            raise ValueError(f"query {query.name}: a hierarchy needs the pseudonymizer for its level keys")
        self.pseudonyms = pseudonyms
        self.noise = noise
        self.store = store
        self.schedule = Schedule(query)
        self.qid = sk.query_id(query.name)
        self.stats = PipelineStats()
        plan = self.plan
        self.levels = KeySelector(plan, noise, query.name, 0).levels
        self.bounder = ContributionBounder(plan.contribution_bound, plan.clamp, plan.resolution)
        L = self.levels
        self._row = np.dtype([
            ("round", "<u4"), ("start", "<u4"), ("done", "<u4"), ("predicted", "<u4"),
            ("count", "<i8"), ("participations", "<i8"), ("buffer", "<i8"), ("released", "<i8"),
            ("pdone", "<u4"), ("level", "<u4"), ("noise_max", "<f8"), ("root", "<u8"), ("sel_tree", "S12"), ("pert_tree", "S12"),
            ("sel_cache", "<f8", (L,)), ("pcache", "<f8", (L,)),
        ])
        #: Called with a window start before the window opens; False refuses it (the budget
        #: ledger's check, DESIGN.md section 7). The pipeline never sees who is charged.
        self.window_gate: Optional[Callable[[int], bool]] = None
        self._progress: dict[int, int] = {}
        for key, value in store.scan_prefix(sk.PROGRESS + self.qid):
            self._progress[int.from_bytes(key[5:13], "big")] = int.from_bytes(value, "little")
        self.stats.keys_tracked = sum(1 for w in self.open_windows() for _ in store.scan_prefix(sk.window_prefix(sk.KEYS, self.qid, w)))

    # ------------------------------------------------------------------ windows and progress
    def open_windows(self) -> list[int]:
        """Windows with state whose last trigger has not fired, in time order."""
        return sorted(w for w, p in self._progress.items() if p < self.schedule.triggers)

    def progress(self, window: int) -> int:
        return self._progress.get(int(window), 0)

    def next_fire(self) -> Optional[tuple[int, int, int]]:
        """(fire time, window, trigger) of the earliest trigger still to fire, or None."""
        best = None
        for w in self.open_windows():
            i = self.progress(w) + 1
            t = self.schedule.fire_time(w, i)
            if best is None or t < best[0]:
                best = (t, w, i)
        return best

    # ------------------------------------------------------------------ stage 1
    def bound(self, events: EventColumns, prior_watermark: np.ndarray, batch: WriteBatch) -> BoundedRecords:
        """Contribution bounding (section 3.2). ``prior_watermark[e]`` is the clock when event e
        arrived; events whose trigger has already fired by then are late and dropped."""
        n = len(events)
        self.stats.events_in += n
        window = self.schedule.window_of(events.ts)
        trigger = self.schedule.trigger_of(events.ts, window)
        on_time = self.schedule.fire_time(window, trigger) > prior_watermark
        self.stats.dropped["late"] += int(n - on_time.sum())
        idx = np.nonzero(on_time)[0]
        window, trigger = window[idx], trigger[idx]
        users = events.users[idx]
        units = self.bounder.units(events.values[idx])
        # group by (window, user): one contribution budget per privacy unit
        order = np.lexsort((users, window))
        boundary = np.ones(len(order), dtype=bool)
        boundary[1:] = (window[order][1:] != window[order][:-1]) | (users[order][1:] != users[order][:-1])
        group_of = np.empty(len(order), dtype=np.int64)
        group_of[order] = np.cumsum(boundary) - 1
        firsts = order[boundary]
        gw, gu = window[firsts], users[firsts]
        state_keys = []
        for w in np.unique(gw).tolist():  # groups are sorted by window, so this keeps group order
            state_keys += sk.fixed_keys(sk.window_prefix(sk.USERS, self.qid, w), gu[gw == w])
        before, st_group, st_key, st_trigger = _parse_user_states(self.store.get_many(state_keys))
        assigned = self.bounder.assign_slots(before, group_of)
        admitted = assigned.admitted
        self.stats.dropped["contribution_bound"] += int(len(order) - admitted.sum())
        keep = idx[admitted]
        rec_group, rec_trigger = group_of[admitted], trigger[admitted]
        rec_keys, rec_ids, rec_levels, rec_roots = events.keys[keep], events.key_ids[keep], np.ones(len(keep), dtype=np.int64), events.key_ids[keep]
        rec_window, rec_users, rec_slots, rec_units = window[admitted], users[admitted], assigned.slots[admitted], units[admitted]
        if self.depth > 1:
            # a hierarchy: each admitted record adds one to one key of every level (the prefixes
            # of its key), record-major; the user's C slots are shared by the levels and stage 2
            # de-duplicates per (user, slot, level)
            texts, ids = self._level_keys(rec_keys)
            d = self.depth
            rec_keys, rec_ids = texts.ravel(), ids.ravel()
            rec_levels = np.tile(np.arange(1, d + 1, dtype=np.int64), len(keep))
            rec_roots = np.repeat(ids[:, 0], d)
            rec_group, rec_trigger, rec_window, rec_users, rec_slots, rec_units = (
                np.repeat(a, d) for a in (rec_group, rec_trigger, rec_window, rec_users, rec_slots, rec_units))
        last = last_contributions(rec_group, rec_ids, rec_trigger, st_group, st_key, st_trigger)
        entries = np.empty(len(last.group), dtype=_USER_ENTRY)
        entries["key"], entries["trigger"] = last.key, last.trigger
        raw = entries.tobytes()
        bounds = np.searchsorted(last.group, np.arange(len(state_keys) + 1)).tolist()
        changed = (assigned.counts != before).tolist()
        full = (assigned.counts >= self.plan.contribution_bound).tolist()
        for g, (key, count) in enumerate(zip(state_keys, assigned.counts.tolist())):
            if changed[g]:
                # a user at the bound admits nothing more: the per-key entries are never needed again
                entries_raw = b"" if full[g] else raw[bounds[g] * _USER_ENTRY.itemsize:bounds[g + 1] * _USER_ENTRY.itemsize]
                batch.put(key, count.to_bytes(2, "little") + entries_raw)
        return BoundedRecords(rec_window, rec_trigger, rec_ids, rec_keys, rec_users, rec_slots, rec_units, last.previous,
                              rec_levels, rec_roots.astype(np.uint64))

    def _level_keys(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(texts, ids), each (records, depth): the key of every level for each record's key."""
        distinct, inverse = np.unique(keys.astype(str), return_inverse=True)
        texts = np.array([level_key_texts(k, self.depth) for k in distinct.tolist()], dtype=object).reshape(len(distinct), self.depth)
        ids = self.pseudonyms.group_keys(texts.ravel().tolist()).reshape(len(distinct), self.depth)
        return texts[inverse], ids[inverse]

    # ------------------------------------------------------------------ stage 2 input
    def accumulate(self, records: BoundedRecords, seq: int, batch: WriteBatch) -> None:
        """Append bounded records to their (window, trigger) pending micro-batch. ``seq`` must be
        unique per call (e.g. the input offset) so the pending blob keys do not collide."""
        if not len(records):
            return
        windows, inverse = np.unique(records.window, return_inverse=True)
        if self.window_gate is not None:
            refused = np.array([w not in self._progress and not self.window_gate(w) for w in windows.tolist()], dtype=bool)
            if refused.any():
                self.stats.dropped["budget"] += int(refused[inverse].sum())
                records = records.take(np.nonzero(~refused[inverse])[0])
                if not len(records):
                    return
                windows, inverse = np.unique(records.window, return_inverse=True)
        fired = np.array([self.progress(w) for w in windows.tolist()], dtype=np.int64)[inverse]
        on_time = records.trigger > fired
        self.stats.dropped["late"] += int(len(records) - on_time.sum())
        records = records.take(np.nonzero(on_time)[0])
        self.stats.accumulated += len(records)
        groups = np.lexsort((records.trigger, records.window))
        wt = np.stack([records.window[groups], records.trigger[groups]], axis=1)
        cut = np.nonzero(np.any(wt[1:] != wt[:-1], axis=1))[0] + 1
        for part in np.split(groups, cut):
            if not len(part):
                continue
            w, i = int(records.window[part[0]]), int(records.trigger[part[0]])
            if w not in self._progress:
                self._progress[w] = 0
                batch.put(sk.window_prefix(sk.PROGRESS, self.qid, w), (0).to_bytes(4, "little"))
            key = sk.trigger_prefix(sk.PENDING, self.qid, w, i) + int(seq).to_bytes(8, "big")
            batch.put(key, records.take(part).encode())

    # ------------------------------------------------------------------ publication
    def _published_key(self, window: int) -> bytes:
        return sk.META + b"published" + self.qid + int(window).to_bytes(8, "big")

    def mark_published(self, window: int, trigger: int, batch: WriteBatch) -> None:
        """Record that a trigger's journaled releases reached the output (after they did)."""
        batch.put(self._published_key(window), int(trigger).to_bytes(4, "little"))

    def unpublished(self) -> list[tuple[int, int, list[dict]]]:
        """(window, trigger, journaled releases) fired but not yet marked published, in order:
        after a crash these are republished from the journal, never recomputed (DESIGN.md 12)."""
        out = []
        for window, fired in sorted(self._progress.items()):
            raw = self.store.get(self._published_key(window))
            published = int.from_bytes(raw, "little") if raw else 0
            out += [(window, trigger, self.journaled(window, trigger)) for trigger in range(published + 1, fired + 1)]
        return out

    # ------------------------------------------------------------------ stage 2 at a trigger
    def journaled(self, window: int, trigger: int) -> list[dict]:
        prefix = sk.trigger_prefix(sk.JOURNAL, self.qid, window, trigger)
        return _ordered([json.loads(v) for _, v in self.store.scan_prefix(prefix)])

    def fire(self, window: int, trigger: int) -> list[dict]:
        """Run trigger ``trigger`` of ``window``; returns its releases (journaled before return)."""
        window, trigger = int(window), int(trigger)
        done = self.progress(window)
        if trigger <= done:
            return self.journaled(window, trigger)
        if trigger != done + 1:
            raise ValueError(f"trigger {trigger} of window {window} fired out of order (last fired: {done})")
        batch = WriteBatch()
        micro = self._take_pending(window, trigger, batch)
        rec_key, rec_prev, rec_units, texts = micro.key_ids, micro.previous, micro.units, micro.texts
        # --- keys: micro-batch + prediction index for this trigger (never all keys)
        pred_prefix = sk.trigger_prefix(sk.PREDICTIONS, self.qid, window, trigger)
        predicted_keys = [k for k, _ in self.store.scan_prefix(pred_prefix)]
        for k in predicted_keys:
            batch.delete(k)
        all_ids = np.unique(np.concatenate([rec_key, sk.suffix_u64(predicted_keys, len(pred_prefix))]))
        n = len(all_ids)
        self.stats.keys_loaded = n
        kidx = np.searchsorted(all_ids, rec_key)
        has_data = np.zeros(n, dtype=bool)
        has_data[kidx] = True
        rows, names = self._load_keys(window, all_ids, texts)
        fresh = rows["level"] == 0  # new keys: level and root come with their records
        if fresh.any():
            level_of, root_of = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64)
            level_of[kidx], root_of[kidx] = micro.levels, micro.roots
            rows["level"][fresh], rows["root"][fresh] = level_of[fresh], root_of[fresh]
        # --- merge the micro-batch: users new to each key's round (their previous record for the
        # key came before the round started), buffered aggregate
        delta_units = np.zeros(n, dtype=np.int64)
        np.add.at(delta_units, kidx, rec_units)
        new_users = np.bincount(kidx[rec_prev < rows["start"][kidx]], minlength=n).astype(np.int64)
        rows["buffer"] += delta_units
        # --- key selection, perturbation and visit planning, each level with its own plan
        released: list[tuple[int, int, dict]] = []
        levels = np.unique(rows["level"]).tolist()
        if len(levels) == 1:  # a flat query (or one level only): no per-level copies on the hot path
            released += self._fire_level(self.plans[levels[0] - 1], window, trigger, all_ids, rows, names, has_data, new_users, batch)
        else:
            for level in levels:
                idx = np.nonzero(rows["level"] == level)[0]
                sub = rows[idx]
                released += self._fire_level(self.plans[level - 1], window, trigger, all_ids[idx], sub, [names[j] for j in idx],
                                             has_data[idx], new_users[idx], batch)
                rows[idx] = sub
        if self.depth > 1 and released:
            started = time.perf_counter()
            released = self._consistent(window, trigger, released, batch)
            self.stats.consistency_seconds += time.perf_counter() - started
        journal = sk.trigger_prefix(sk.JOURNAL, self.qid, window, trigger)
        for key_id, _, record in released:
            batch.put(journal + int(key_id).to_bytes(8, "big"), encode_json(record))
        releases = [record for _, _, record in released]
        # --- key states, journal and progress: one atomic write
        prefix = sk.window_prefix(sk.KEYS, self.qid, window)
        encoded = [name.encode() for name in names]
        raw, width = rows.tobytes(), self._row.itemsize
        for j, key_id in enumerate(all_ids.tolist()):
            batch.put(prefix + key_id.to_bytes(8, "big"), raw[j * width:(j + 1) * width] + encoded[j])
        batch.put(sk.window_prefix(sk.PROGRESS, self.qid, window), trigger.to_bytes(4, "little"))
        self.store.write(batch)
        self._progress[window] = trigger
        self.stats.triggers_fired += 1
        if trigger == self.schedule.triggers:
            self.collect_window(window)
        return _ordered(releases)

    def _fire_level(self, plan, window, trigger, ids, rows, names, has_data, new_users, batch) -> list[tuple[int, int, dict]]:
        """Key selection (Algorithm 2), perturbation (Algorithm 3) and the next visit (Algorithm 4)
        for the keys of one level; mutates ``rows``. Returns (key id, root id, release record) triples."""
        selector = KeySelector(plan, self.noise, self.query.name, window)
        sel = SelectionBatch(names, rows["round"].astype(np.int64), rows["start"].astype(np.int64), rows["done"].astype(np.int64),
                             rows["count"].copy(), rows["participations"].copy(), rows["sel_cache"].copy(),
                             self._tree_ids(window, rows, "sel_tree", names, "select"), rows["noise_max"].copy())
        step = selector.step(sel, trigger, new_users)
        selected = step.selected
        releases = self._release(plan, window, trigger, ids, rows, names, selected) if selected.any() else []
        for f in ("round", "start", "done", "count", "participations"):
            rows[f] = getattr(sel, f)
        rows["sel_cache"] = sel.cache
        rows["sel_tree"][selected] = b""  # a new round, a new tree: its id is derived on first use
        self._plan_visits(window, trigger, ids, rows, has_data, selector, sel, batch)
        rows["noise_max"] = sel.noise_max  # prediction may have learnt it
        return releases

    def _take_pending(self, window: int, trigger: int, batch: WriteBatch) -> "MicroBatch":
        """The trigger's micro-batch, with replayed stage-1 output removed.

        Stage 1 gives each admitted record a (user, slot), and a replayed copy carries the same
        pair and the same event time, hence lands in this same bucket: keeping the first record
        per (user, slot) here is the de-duplication of DESIGN.md section 12.
        """
        parts, texts = [], {}
        columns = ("key_ids", "users", "slots", "units", "previous", "levels", "roots")
        for key, blob in self.store.scan_prefix(sk.trigger_prefix(sk.PENDING, self.qid, window, trigger)):
            cols, key_texts = BoundedRecords.decode_columns(blob)
            parts.append([cols[c] for c in columns])
            texts.update(key_texts)
            batch.delete(key)
        if not parts:
            empty, none = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
            return MicroBatch(none, none, empty, empty, texts, empty, none)
        rec_key, rec_user, rec_slot, rec_units, rec_prev, rec_level, rec_root = (np.concatenate([p[c] for p in parts])
                                                                                  for c in range(len(columns)))
        # one record per (user, slot) and level: every level of a hierarchy gets each admitted record once
        order = np.lexsort((np.arange(len(rec_user)), rec_level, rec_slot, rec_user))
        u, sl, lv = rec_user[order], rec_slot[order], rec_level[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = (u[1:] != u[:-1]) | (sl[1:] != sl[:-1]) | (lv[1:] != lv[:-1])
        keep = np.sort(order[first])
        self.stats.dropped["duplicate"] += int(len(rec_user) - len(keep))
        return MicroBatch(rec_key[keep].astype(np.uint64), rec_user[keep].astype(np.uint64), rec_prev[keep].astype(np.int64),
                          rec_units[keep].astype(np.int64), texts, rec_level[keep].astype(np.int64), rec_root[keep].astype(np.uint64))

    def _release(self, plan, window, trigger, all_ids, rows, names, selected) -> list[tuple[int, int, dict]]:
        sidx = np.nonzero(selected)[0]
        perturber = HierarchicalPerturber(plan, self.noise, self.query.name, window)
        sub = rows[sidx]
        pb = PerturbationBatch([names[j] for j in sidx], sub["released"].copy(), sub["pdone"].astype(np.int64), sub["pcache"].copy(),
                               self._tree_ids(window, sub, "pert_tree", [names[j] for j in sidx], perturber.kind))
        rows["pert_tree"][sidx] = sub["pert_tree"]
        values = perturber.release(pb, trigger, rows["buffer"][sidx])
        rows["released"][sidx] = pb.released_units
        rows["pdone"][sidx] = pb.done
        rows["pcache"][sidx] = pb.cache
        rows["buffer"][sidx] = 0
        stddev = perturber.stddev(trigger)
        releases = []
        for j, value in zip(sidx.tolist(), values.tolist()):
            record = release_record(
                query=self.query.name, window_start=window, window_end=window + self.schedule.window_ms, trigger=trigger,
                trigger_time=self.schedule.trigger_time(window, trigger), key=key_for_output(names[j], self.query.key_fields),
                aggregate=self.query.aggregate, value=value, stddev=stddev, epsilon=plan.epsilon, delta=plan.delta,
            )
            if self.depth > 1:
                record["level"] = plan.level
            releases.append((int(all_ids[j]), int(rows["root"][j]), record))
        self.stats.releases += len(sidx)
        self.stats.keys_released.update((self.query.name, window, names[j]) for j in sidx.tolist())
        return releases

    def _consistent(self, window: int, trigger: int, released: list, batch: WriteBatch) -> list[tuple[int, int, dict]]:
        """Consistent, non-negative integer counts for the published view of a hierarchy
        (DESIGN.md section 8; Fioretto, Van Hentenryck and Zhu, sections 6-7).

        The view is every key of the window released so far at its latest noisy count (a
        compacted output topic holds exactly that). Only subtrees (level-1 roots) with a release
        at this trigger can change. Their released keys form a forest (a key's parent is its
        nearest released ancestor: an unreleased key in between is unknown, so it only adds to
        the ancestor's remainder), and :func:`processor.consistency.solve` finds the
        non-negative integers closest to the noisy counts in L2, weighted by each count's inverse
        variance (the paper's plain L2 when all variances are equal), such that every released
        parent is at least the sum of its released descendants. Each record then carries
        ``consistent_count`` and, below the finest level, ``consistent_other``: the part of the
        parent not in its released children (children not, or not yet, released).

        Post-processing of released values and public parameters only: no budget (the paper's
        Lemma 3). Keys released now get the consistent fields on their records; keys released
        earlier whose consistent values changed are re-issued with their unchanged noisy count
        (``released_at`` says when it was released), so the latest record of every key is
        consistent once a trigger's records are all read. Written with the trigger's state.
        """
        view = sk.window_prefix(sk.HIERARCHY_VIEW, self.qid, window)
        width = _VIEW_ENTRY.itemsize
        entries: dict[int, dict] = {}
        for root in sorted({root for _, root, _ in released}):
            prefix = view + root.to_bytes(8, "big")
            for key, value in self.store.scan_prefix(prefix):
                row = np.frombuffer(value[:width], dtype=_VIEW_ENTRY)[0]
                entries[int.from_bytes(key[len(prefix):], "big")] = {
                    "root": root, "level": int(row["level"]), "released_at": int(row["released_at"]), "count": float(row["count"]),
                    "stddev": float(row["stddev"]), "consistent": int(row["consistent"]), "other": int(row["other"]),
                    "parts": json.loads(value[width:].decode())}
        now = {}
        for key_id, root, record in released:
            old = entries.get(key_id, {"consistent": -1, "other": -1})
            entries[key_id] = {"root": root, "level": record["level"], "released_at": trigger, "count": record["count"],
                               "stddev": record["stddev"], "consistent": old["consistent"], "other": old["other"], "parts": record["key"]}
            now[key_id] = record
        ids = sorted(entries)
        nodes = [entries[k] for k in ids]
        index = {key_text(e["parts"]): i for i, e in enumerate(nodes)}
        parent = np.full(len(nodes), -1, dtype=np.int64)
        direct = np.full(len(nodes), -1, dtype=np.int64)
        for i, e in enumerate(nodes):
            for up in range(len(e["parts"]) - 1, 0, -1):
                j = index.get(key_text(e["parts"][:up]))
                if j is not None:
                    parent[i] = j
                    if up == len(e["parts"]) - 1:
                        direct[i] = j
                    break
        noisy = np.array([e["count"] for e in nodes])
        stddev = np.array([e["stddev"] for e in nodes])
        solution = solve_consistency(parent, noisy, weight=1.0 / stddev ** 2, spread=CONSISTENCY_SPREAD * stddev,
                                     open=np.ones(len(nodes), dtype=bool))
        values = solution.values
        in_children = np.zeros(len(nodes), dtype=np.int64)
        has_parent = direct >= 0
        np.add.at(in_children, direct[has_parent], values[has_parent])
        other = values - in_children
        out = []
        for i, (key_id, e) in enumerate(zip(ids, nodes)):
            value, rest = int(values[i]), int(other[i])
            record = now.get(key_id)
            if record is None:
                if (value, rest) == (e["consistent"], e["other"]):
                    continue
                record = release_record(
                    query=self.query.name, window_start=window, window_end=window + self.schedule.window_ms, trigger=trigger,
                    trigger_time=self.schedule.trigger_time(window, trigger), key=e["parts"], aggregate=self.query.aggregate,
                    value=e["count"], stddev=e["stddev"], epsilon=self.plan.epsilon, delta=self.plan.delta)
                record["level"] = e["level"]
                self.stats.consistency_updates += 1
            record["released_at"] = e["released_at"]
            record["consistent_count"] = value
            if e["level"] < self.depth:
                record["consistent_other"] = rest
            out.append((key_id, e["root"], record))
            row = np.zeros(1, dtype=_VIEW_ENTRY)
            row["level"], row["released_at"], row["count"], row["stddev"] = e["level"], e["released_at"], e["count"], e["stddev"]
            row["consistent"], row["other"] = value, rest
            batch.put(view + int(e["root"]).to_bytes(8, "big") + int(key_id).to_bytes(8, "big"),
                      row.tobytes() + key_text(e["parts"]).encode())
        return out

    def _tree_ids(self, window: int, rows: np.ndarray, field_name: str, names: list, kind: str) -> np.ndarray:
        """Tree ids cached in the key rows; missing ones (new key or new round) derived and stored."""
        ids = rows[field_name]
        missing = np.nonzero(ids == b"")[0]
        if len(missing):
            rounds = rows["round"][missing].tolist() if kind == "select" else [0] * len(missing)
            ids[missing] = self.noise.tree_ids_for(self.query.name, window, kind, [names[j] for j in missing], rounds)
        return ids.copy()

    def _load_keys(self, window: int, ids: np.ndarray, texts: dict):
        """Key states (fixed rows) and key texts; new keys get a fresh row."""
        prefix = sk.window_prefix(sk.KEYS, self.qid, window)
        values = self.store.get_many(sk.fixed_keys(prefix, ids))
        width = self._row.itemsize
        rows = np.zeros(len(ids), dtype=self._row)
        rows["start"] = 1
        rows["noise_max"] = np.nan
        rows["sel_cache"] = np.nan
        rows["pcache"] = np.nan
        present = [j for j, v in enumerate(values) if v is not None]
        self.stats.keys_tracked += len(ids) - len(present)
        if present:
            rows[present] = np.frombuffer(b"".join(values[j][:width] for j in present), dtype=self._row)
        names = [texts[i] if v is None else v[width:].decode() for i, v in zip(ids.tolist(), values)]
        return rows, names

    def _plan_visits(self, window, trigger, all_ids, rows, has_data, selector, sel, batch) -> None:
        """Prediction-index entries of these keys (their own level's selector)."""
        T = self.schedule.triggers
        prefix = sk.window_prefix(sk.PREDICTIONS, self.qid, window)
        old = rows["predicted"].astype(np.int64)
        nxt = np.zeros(len(all_ids), dtype=np.int64)
        if trigger < T:
            open_gate = sel.participations > self.plan.key_threshold
            # keys with data now: look again at the next trigger (they usually have data again)
            nxt[has_data & open_gate] = trigger + 1
            # keys looked at without data: full release prediction (Algorithm 4)
            idle = np.nonzero(~has_data & open_gate)[0]
            if len(idle):
                sub = sel.take(idle)
                nxt[idle] = selector.predict(sub)
                sel.noise_max[idle] = sub.noise_max
        stale = np.nonzero((old > trigger) & (old != nxt))[0]
        for j in stale.tolist():
            batch.delete(prefix + int(old[j]).to_bytes(4, "big") + int(all_ids[j]).to_bytes(8, "big"))
        for j in np.nonzero((nxt > 0) & (nxt != old))[0].tolist():
            batch.put(prefix + int(nxt[j]).to_bytes(4, "big") + int(all_ids[j]).to_bytes(8, "big"), b"")
        rows["predicted"] = nxt

    def collect_window(self, window: int) -> None:
        """Drop a finished window's working state (the journal and progress stay)."""
        self.stats.keys_tracked -= sum(1 for _ in self.store.scan_prefix(sk.window_prefix(sk.KEYS, self.qid, window)))
        for table in sk.WINDOW_TABLES:
            self.store.delete_prefix(sk.window_prefix(table, self.qid, window))
