"""The tables of one query's state: every key layout, value layout and cache in one place.

One store holds all tables; a table is a key prefix (:mod:`dpstream.state.keys`). The pipeline
(:mod:`dpstream.processor.engine.pipeline`) decides *what* to keep; this module decides *how it is laid out* and
is the only code that builds or parses a state key or value. Nothing here knows about privacy:
the tables hold bytes, integers and arrays, and import nothing of ours outside ``state/``.

Every write goes into a :class:`dpstream.state.store.WriteBatch`; nothing reaches the store until the
caller writes the batch together with its input position (a commit point: docs/architecture.md,
"State"). The user, key-row and key-name tables keep a bounded cache of *committed* values in
memory (:class:`CommittedCache`, columnar arrays per window): a batch's reads of cached ids cost
one vectorized search instead of a RocksDB point read and a parse per id, and since the cache learns a value only once its batch is written
(``WriteBatch.on_commit``), evicting an entry, dropping the cache or crashing never loses or
invents state. Every batch the drivers write is a commit point, so this is the same as a
write-behind cache flushed at each commit (Kafka Streams' record cache), without a second copy of
uncommitted values.

Layout version: :data:`STATE_FORMAT` (a state directory of another version is refused, never
read as this one).
"""
from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from dpstream.state import kernels
from dpstream.state import keys as sk
from dpstream.state.store import Store, WriteBatch

#: Version of the state layout. 3: 16-byte tree ids, exact integer frontier caches, user states
#: per (key, trigger), predecessor amendments, the key-text registry, window status and plan
#: fingerprint in the progress table. 4: key rows are the fixed row only (the text is in the
#: key-text table) and the prediction index is their ``predicted`` column (no table of its own).
#: 5: user states and key rows are logs of one blob per commit (tables ``v`` and ``r``), spilled
#: per id only over the cache's bound (tables ``u`` and ``k``).
STATE_FORMAT = b"5"

#: window status in the progress table
WINDOW_OPEN, WINDOW_REFUSED = 1, 2

#: the top bit of a changelog blob's count: its parts are appends (:class:`_WindowLog`)
APPENDS = 1 << 31
#: a user-state entry: one distinct (key, trigger) of the user's admitted records in the window
USER_ENTRY = np.dtype([("key", "<u8"), ("trigger", "<u4")])
#: a predecessor amendment (dpstream.processor.mechanisms.bounding.key_histories): raise the predecessor trigger of
#: ``user``'s records for ``key`` in the target micro-batch to ``trigger``
AMEND_ENTRY = np.dtype([("key", "<u8"), ("user", "<u8"), ("trigger", "<u4")])
#: a hierarchy's published view, per released key: what the consistency step starts from
VIEW_ENTRY = np.dtype([("level", "<u4"), ("released_at", "<u4"), ("count", "<i8"), ("stddev", "<f8"), ("consistent", "<i8"),
                       ("other", "<i8")])
#: tree ids as stored in key rows (the 16 bytes of dpstream.processor.mechanisms.noise's tree ids; empty: not derived yet)
STORED_TREE_ID = np.dtype("S16")

#: default bounds of the caches of committed values (entries per query; about 200 bytes each)
USER_CACHE_ENTRIES = 12_000_000
KEY_CACHE_ENTRIES = 2_000_000


def key_row_dtype(tree_levels: int, columns: int = 1) -> np.dtype:
    """The fixed part of a key row: selection round and counters, the data buffer, the
    perturbation state and the frontier caches of both trees (``tree_levels`` entries each).
    An aggregate of several columns (a mean: sum and count) appends, for each column after the
    first, its buffer, released total, tree id and frontier cache (``buffer_2``, ...): rows of
    one column keep their layout."""
    L = int(tree_levels)
    fields = [
        ("round", "<u4"), ("start", "<u4"), ("done", "<u4"), ("predicted", "<u4"),
        ("count", "<i8"), ("participations", "<i8"), ("buffer", "<i8"), ("released", "<i8"),
        ("pdone", "<u4"), ("level", "<u4"), ("noise_max", "<f8"), ("root", "<u8"), ("sel_tree", STORED_TREE_ID),
        ("pert_tree", STORED_TREE_ID), ("sel_cache", "<i8", (L,)), ("pcache", "<i8", (L,)),
    ]
    for c in range(2, int(columns) + 1):
        fields += [(f"buffer_{c}", "<i8"), (f"released_{c}", "<i8"), (f"pert_tree_{c}", STORED_TREE_ID), (f"pcache_{c}", "<i8", (L,))]
    return np.dtype(fields)


def _records(rows: np.ndarray) -> np.ndarray:
    """Fixed rows seen as opaque records of their width (a view; rows must be contiguous)."""
    return rows.view(np.dtype((np.void, rows.dtype.itemsize)))


def take_rows(rows: np.ndarray, index) -> np.ndarray:
    """``rows[index]`` (integer positions or a mask), copied record by record. numpy moves a
    structured row field by field: 5x slower to take and up to 30x slower to put (43k key rows
    of 168 bytes: 30 ms against 1 ms), which was a sixth of a trigger at 1M users."""
    if rows.dtype.names is None or not rows.flags.c_contiguous:
        return rows[index]
    return _records(rows)[index].view(rows.dtype)


def put_rows(rows: np.ndarray, index, values: np.ndarray) -> None:
    """``rows[index] = values`` record by record (:func:`take_rows`); ``values`` may be one row."""
    if rows.dtype.names is None or not rows.flags.c_contiguous:
        rows[index] = values
        return
    _records(rows)[index] = _records(np.ascontiguousarray(values, dtype=rows.dtype))


class Ragged:
    """Variable parts of many ids back to back, in items of one fixed-width type: part j is
    ``data[offsets[j]:offsets[j+1]]``. A user state's key history is such a part (entries of
    :data:`USER_ENTRY`): kept, read and written this way, a batch of states costs whole-array
    operations, never a Python object per user (which was a third of stage 1 at 10^7 users)."""

    __slots__ = ("offsets", "data")

    def __init__(self, offsets: np.ndarray, data: np.ndarray):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.data = data

    @classmethod
    def of_lengths(cls, lengths: np.ndarray, data: np.ndarray) -> "Ragged":
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(offsets, data)

    @classmethod
    def empty(cls, n: int, item: np.dtype) -> "Ragged":
        return cls(np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=item))

    @classmethod
    def of_bytes(cls, parts: list, item: np.dtype) -> "Ragged":
        """From one bytes object per part (a whole number of items each)."""
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        if (lengths % item.itemsize).any():
            raise ValueError(f"a stored part is not a whole number of {item.itemsize}-byte items")
        return cls.of_lengths(lengths // item.itemsize, np.frombuffer(b"".join(parts), dtype=item).copy())

    @classmethod
    def concat(cls, pieces: list) -> "Ragged":
        lengths = np.concatenate([p.lengths for p in pieces])
        return cls.of_lengths(lengths, np.concatenate([p.data for p in pieces]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, index) -> "Ragged":
        """The parts at ``index`` (positions or a mask), in that order."""
        index = np.arange(len(self))[index] if np.asarray(index).dtype == bool else np.asarray(index, dtype=np.int64)
        starts, lengths = self.offsets[index], self.offsets[index + 1] - self.offsets[index]
        return Ragged.of_lengths(lengths, kernels.gather_spans(self.data, starts, lengths))

    def placed(self, n: int, at: np.ndarray) -> "Ragged":
        """These parts at positions ``at`` (ascending) of ``n`` parts, the others empty."""
        lengths = np.zeros(n, dtype=np.int64)
        lengths[at] = self.lengths
        return Ragged.of_lengths(lengths, self.data)

    def part_bytes(self, j: int) -> bytes:
        return self.data[self.offsets[j]:self.offsets[j + 1]].tobytes()


#: block sizes of the part arena: 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 times them):
#: a block holds at most 1.5 times its part
_BLOCK_SIZES = np.unique(np.concatenate([1 << np.arange(40), 3 << np.arange(39)])).astype(np.int64)
#: the columns of :attr:`_Arena.meta`
_START, _LENGTH, _CLS = 0, 1, 2


class _Arena:
    """One window's ragged parts by slot, in blocks of one growing array: a part of n items sits
    in the least block size of :data:`_BLOCK_SIZES` that holds it (its class). A rewritten part
    that still fits its block is written in place; one that outgrows it moves to a block of its
    new class and frees the old one, which the next part of that class takes (a free list per
    class). So nothing is ever compacted, a block is at most 1.5 times its part, and the array
    grows in place by a quarter at a time (``resize``: no copy of what it holds). Rewriting each touched user's whole history into
    fresh space instead, and collecting the stale copies, copied the live histories about ten
    times a day at 10^7 users."""

    def __init__(self, item: np.dtype, size: int = 1024):
        self.data = np.zeros(size, dtype=item)
        self.used = 0  # items below this are in blocks (in use or free)
        self.free: dict[int, np.ndarray] = {}  # class -> starts of its free blocks
        # per slot: its block's start, its part's length, the block's class (-1: no block, an
        # empty part); one row per slot, so a batch of slots reads all three in one pass (at 10^7
        # users each slot is a cache miss, three arrays were three)
        self.meta = np.zeros((0, 3), dtype=np.int64)

    def grow(self, size: int) -> None:
        grown = np.zeros((size, 3), dtype=np.int64)
        grown[:, _CLS] = -1
        grown[:len(self.meta)] = self.meta
        self.meta = grown

    def get(self, slots: np.ndarray) -> Ragged:
        meta = self.meta[slots]
        lengths = meta[:, _LENGTH]
        return Ragged.of_lengths(lengths, kernels.gather_spans(self.data, meta[:, _START], lengths))

    def set(self, slots: np.ndarray, parts: Ragged, pick: Optional[np.ndarray] = None, at: Optional[np.ndarray] = None) -> None:
        """Parts of ``slots`` (distinct): ``parts`` in order, or its parts at ``pick`` (positions),
        read where they are (no copy of the picked parts first). ``at`` (per part; default 0):
        the item of the slot's value the part starts at. 0 replaces the value; above 0 the part
        follows the value's first ``at`` items, which must be all it holds (an append)."""
        slots = np.asarray(slots, dtype=np.int64)
        firsts = parts.offsets[:-1] if pick is None else parts.offsets[:-1][pick]
        tails = parts.lengths if pick is None else parts.lengths[pick]
        at = np.zeros(len(slots), dtype=np.int64) if at is None else np.asarray(at, dtype=np.int64)
        meta = self.meta[slots]
        if (at > 0).any() and (meta[:, _LENGTH][at > 0] != at[at > 0]).any():
            raise ValueError("an append to a stored part does not start at the part's end: the state's changelog is inconsistent")
        lengths = at + tails
        new_cls = np.full(len(lengths), -1, dtype=np.int64)
        some = lengths > 0
        new_cls[some] = np.searchsorted(_BLOCK_SIZES, lengths[some])
        old_cls = meta[:, _CLS].copy()
        moving = np.nonzero(new_cls != old_cls)[0]
        if len(moving):
            old_starts = meta[moving, _START]
            starts = np.zeros(len(moving), dtype=np.int64)
            for c in np.unique(new_cls[moving]).tolist():
                if c >= 0:
                    here = np.nonzero(new_cls[moving] == c)[0]
                    starts[here] = self._blocks(c, len(here))
            kept = np.nonzero(at[moving] > 0)[0]  # an append that outgrew its block: its items so far move along
            kernels.scatter_spans(self.data, starts[kept], self.data, old_starts[kept], at[moving][kept])
            # freed only now: a block freed by this call is not handed to another part of it
            freed = np.nonzero(old_cls[moving] >= 0)[0]
            for c in np.unique(old_cls[moving][freed]).tolist():
                these = old_starts[freed[old_cls[moving][freed] == c]]
                self.free[c] = np.concatenate([self.free.get(c, np.zeros(0, dtype=np.int64)), these])
            meta[moving, _START] = starts
            meta[moving, _CLS] = new_cls[moving]
        meta[:, _LENGTH] = lengths
        self.meta[slots] = meta
        kernels.scatter_spans(self.data, meta[:, _START] + at, parts.data, firsts, tails)

    def _blocks(self, c: int, n: int) -> np.ndarray:
        """Starts of ``n`` blocks of class ``c``: free ones first, then new ones at the end."""
        free = self.free.get(c, np.zeros(0, dtype=np.int64))
        taken, self.free[c] = free[:n], free[n:]
        more = n - len(taken)
        size = int(_BLOCK_SIZES[c])
        if self.used + more * size > len(self.data):
            self.data.resize(max(len(self.data) * 5 // 4, self.used + more * size), refcheck=False)  # in place: no copy
        fresh = self.used + size * np.arange(more, dtype=np.int64)
        self.used += more * size
        return np.concatenate([taken, fresh])


class _SortedIds:
    """64-bit ids kept sorted, each with the slot that holds its values in append-only arrays
    elsewhere: a batch of ids is found with one search (:mod:`dpstream.state.kernels`: a directory
    of the ids' top bits narrows each search to a few ids first; a plain binary search over 10^7
    ids misses the CPU cache at almost every step, which made stage 1's per-record cost grow with
    the users seen in the window). The directory is kept up to date as ids are added."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.uint64)
        self.slots = np.zeros(0, dtype=np.int64)
        self._bits = 0
        self._directory: Optional[np.ndarray] = None  # built on first find

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where absent."""
        if not len(self.ids):
            return np.full(len(ids), -1, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.uint64)
        if self._directory is None:
            self._bits = kernels.directory_bits(len(self.ids))
            self._directory = kernels.directory(self.ids, self._bits)
        pos = kernels.positions(self.ids, self._directory, self._bits, ids)
        pos = np.minimum(pos, len(self.ids) - 1)
        return np.where(self.ids[pos] == ids, self.slots[pos], -1)

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Index ids not present yet (distinct) under their slots."""
        order = np.argsort(ids, kind="stable")
        self.ids, self.slots = kernels.merged(self.ids, self.slots, ids[order], np.asarray(slots, dtype=np.int64)[order])
        if self._directory is not None:
            if kernels.directory_bits(len(self.ids)) == self._bits:
                self._directory = kernels.added(self._directory, self._bits, np.asarray(ids, dtype=np.uint64))
            else:  # grown past its size: rebuilt on the next find
                self._directory = None


class _WindowRows:
    """One window's cached keys: their rows (if the cache has a row type) and variable parts in
    append-only arrays, found through a :class:`_SortedIds` (a new key appends; a known key is
    overwritten in place)."""

    def __init__(self, dtype: Optional[np.dtype], parts: bool = True, part_item: Optional[np.dtype] = None):
        self.index = _SortedIds()
        self.rows = None if dtype is None else np.zeros(0, dtype=dtype)
        self.names = np.zeros(0, dtype=object) if parts and part_item is None else None
        self.arena = _Arena(part_item) if parts and part_item is not None else None
        self.used = 0
        self.size = 0

    def get_parts(self, slots: np.ndarray):
        if self.arena is not None:
            return self.arena.get(slots)
        return None if self.names is None else self.names[slots]

    def set_parts(self, slots: np.ndarray, parts, pick: Optional[np.ndarray] = None, at: Optional[np.ndarray] = None) -> None:
        """``parts`` (or its parts at positions ``pick``) into ``slots`` (from item ``at``: :meth:`_Arena.set`)."""
        if self.arena is not None:
            self.arena.set(slots, parts, pick, at)
        elif self.names is not None:
            self.names[slots] = parts if pick is None else parts[pick]

    def find(self, ids: np.ndarray) -> np.ndarray:
        return self.index.find(ids)

    def append(self, ids: np.ndarray, rows: np.ndarray, names: np.ndarray, pick: Optional[np.ndarray] = None) -> None:
        """Add keys not cached yet (``ids`` distinct; their parts: ``names``, or its parts at ``pick``)."""
        n = len(ids)
        if self.used + n > self.size:  # grow by doubling: amortized O(1) per key
            size = self.size = max(2 * self.size, self.used + n, 1024)
            if self.names is not None:
                grown_names = np.empty(size, dtype=object)
                grown_names[:self.used] = self.names[:self.used]
                self.names = grown_names
            if self.rows is not None:
                grown = np.zeros(size, dtype=self.rows.dtype)
                put_rows(grown, slice(0, self.used), self.rows[:self.used])
                self.rows = grown
            if self.arena is not None:
                self.arena.grow(size)
        slots = np.arange(self.used, self.used + n, dtype=np.int64)
        self.set_parts(slots, names, pick)
        if self.rows is not None:
            put_rows(self.rows, slots, rows)
        self.used += n
        self.index.add(ids, slots)


@dataclass(frozen=True)
class Located:
    """Where a read found its ids in a window's cached rows (slot, -1 where absent)."""

    rows: "_WindowRows"
    slots: np.ndarray

    def take(self, index) -> "Located":
        return Located(self.rows, self.slots[index])


def _take_parts(parts, index):
    """Variable parts at ``index``: of a :class:`Ragged`, or of an object array."""
    return parts.take(index) if isinstance(parts, Ragged) else parts[index]


class CommittedCache:
    """Committed values of one table per window and 64-bit id, in memory and columnar, bounded
    to ``capacity`` ids: a fixed row (``dtype``; ``None``: none) and a variable part (a key's
    text, a user state's bytes).

    Stage 1 reads the state of every user in a micro-batch and stage 2 the row of every key it
    looks at, on every trigger. Keeping them as arrays per window makes a batch's reads one
    vectorized search (no RocksDB read, no per-key dictionary work) while RocksDB stays the
    truth: values enter only once their batch has been written (``WriteBatch.on_commit``) or as
    read from the store, so evicting an entry, dropping the cache or crashing never loses or
    invents state. Over capacity the oldest windows go first; a window that alone exceeds the
    capacity stops caching new ids (they are read from the store).

    A window the store held nothing of when this cache first read it, and that has kept every id
    committed since, is *complete*: an id missing from it has no stored value, so it is not read
    from the store. That is most reads of a live window: every new user and new key, each of
    which would otherwise cost a RocksDB miss.
    """

    def __init__(self, dtype: Optional[np.dtype], capacity: int, parts: bool = True, part_item: Optional[np.dtype] = None):
        """``parts``: whether values have a variable part after the row (False: rows only);
        ``part_item``: parts are :class:`Ragged` of this item type (None: Python objects)."""
        self.dtype = dtype
        self.parts = parts
        self.part_item = part_item
        self.capacity = int(capacity)
        self._windows: dict[int, _WindowRows] = {}
        self._complete: set[int] = set()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return sum(w.used for w in self._windows.values())

    def lookup(self, window: int, ids: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
        """(hit mask, their rows (``None`` without a row type), their texts) for ``ids``."""
        return self.located(window, ids)[:3]

    def located(self, window: int, ids: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray, "Located"]:
        """:meth:`lookup`, and where the ids were found, for :meth:`appended` to skip the search."""
        cached = self._windows.get(window)
        if cached is None:
            cached = _WindowRows(self.dtype, self.parts, self.part_item)
        slots = cached.find(ids)
        hit = slots >= 0
        found = slots[hit]
        self.hits += len(found)
        self.misses += len(ids) - len(found)
        return hit, None if cached.rows is None else take_rows(cached.rows, found), cached.get_parts(found), Located(cached, slots)

    def holds(self, window: int) -> bool:
        """Whether the cache has the window (it may have dropped it over its bound)."""
        return window in self._windows

    def hold(self, window: int) -> None:
        """Start caching a window (empty)."""
        self._windows.setdefault(window, _WindowRows(self.dtype, self.parts, self.part_item))

    def window_values(self, window: int) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
        """(ids, rows, parts) of every id cached for the window, in slot order."""
        cached = self._windows.get(window)
        if cached is None:
            parts = np.zeros(0, dtype=object) if self.part_item is None else Ragged.empty(0, self.part_item)
            return np.zeros(0, dtype=np.uint64), None if self.dtype is None else np.zeros(0, dtype=self.dtype), parts
        ids = np.empty(cached.used, dtype=np.uint64)
        ids[cached.index.slots] = cached.index.ids
        rows = None if cached.rows is None else cached.rows[:cached.used].copy()
        if cached.arena is not None:
            parts = cached.arena.get(np.arange(cached.used))
        else:
            parts = np.full(cached.used, None, dtype=object) if cached.names is None else cached.names[:cached.used].copy()
        return ids, rows, parts

    def upsert(self, window: int, ids: np.ndarray, rows: Optional[np.ndarray], names: Optional[np.ndarray]) -> np.ndarray:
        """Keys just committed or read from the store (``ids`` distinct; ``names``: their
        variable parts, ``None`` for a cache of rows only). Returns the positions in ``ids`` of
        the keys it declined (new keys of a window alone over the bound)."""
        return self.appended(window, ids, rows, names, None)[0]

    def appended(self, window: int, ids: np.ndarray, rows: Optional[np.ndarray], parts: Optional[Ragged],
                 at: Optional[np.ndarray], where: Optional["Located"] = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`upsert`, where each id's part starts at item ``at`` of its value (0: the whole
        value; above 0: an append to the cached value). Returns (positions declined, positions
        of appends to ids not cached): the caller completes the latter from the store (their
        earlier items are not here) and upserts them whole. ``where``: the ids' slots as
        :meth:`located` found them (same ids, same order)."""
        cached = self._windows.get(window)
        if cached is None:
            cached = self._windows[window] = _WindowRows(self.dtype, self.parts, self.part_item)
        if where is not None and where.rows is cached and len(where.slots) == len(ids):
            # found by the read before this commit: an id's slot never changes while its window's
            # rows are cached (appended, never compacted), so only ids absent then are searched
            slots = where.slots.copy()
            absent = np.nonzero(slots < 0)[0]
            if len(absent):
                slots[absent] = cached.find(ids[absent])
        else:
            slots = cached.find(ids)
        known = slots >= 0
        if self.parts:
            cached.set_parts(slots[known], parts, np.nonzero(known)[0], None if at is None else at[known])
        if rows is not None:
            put_rows(cached.rows, slots[known], take_rows(rows, known))
        new = np.nonzero(~known)[0]
        loose = new[:0]
        if at is not None and len(new):
            loose, new = new[at[new] > 0], new[at[new] == 0]
        room = self.capacity - len(self)
        if len(new) > room:
            for old in sorted(self._windows):  # oldest windows first, never this one
                if old < window and len(new) > room:
                    room += self._windows.pop(old).used
                    self._complete.discard(old)
            if len(new) > room:  # this window no longer holds every committed id
                self._complete.discard(window)
            new, declined = new[:max(room, 0)], new[max(room, 0):]
        else:
            declined = new[:0]
        if len(new):
            cached.append(ids[new], None if rows is None else take_rows(rows, new), parts if self.parts else None, new)
        return declined, loose

    def read_through(self, store: Store, prefix: bytes, window: int, ids: np.ndarray,
                     text: bool) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
        """(found mask, rows, variable parts) of ``ids`` (distinct) in a window's table under
        ``prefix``: cached ones from memory, the others read from the store in one batch (and
        cached). A stored value is the row's bytes, then the variable part (decoded as UTF-8 if
        ``text``). Rows (if the cache has a row type) and parts are full length, zero and None
        where not found."""
        ids = np.asarray(ids, dtype=np.uint64)
        complete = self._is_complete(store, prefix, window)
        hit, cached_rows, cached_parts = self.lookup(window, ids)
        rows = None if self.dtype is None else np.zeros(len(ids), dtype=self.dtype)
        parts = np.full(len(ids), None, dtype=object)
        if self.parts:
            parts[hit] = cached_parts
        if rows is not None:
            put_rows(rows, hit, cached_rows)
        found = hit.copy()
        miss = np.nonzero(~hit)[0]
        if len(miss) and not complete:
            stored = store.get_many(sk.fixed_keys(prefix, ids[miss]))
            present = [j for j, v in enumerate(stored) if v is not None]
            if present:
                at = miss[present]
                width = 0 if self.dtype is None else self.dtype.itemsize
                read = None
                if self.parts:
                    read = np.empty(len(present), dtype=object)
                    read[:] = [stored[j][width:].decode() if text else stored[j][width:] for j in present]
                    parts[at] = read
                if rows is not None:
                    rows[at] = np.frombuffer(b"".join(stored[j][:width] for j in present), dtype=self.dtype)
                found[at] = True
                self.upsert(window, ids[at], None if rows is None else rows[at], read)
        return found, rows, parts

    def _is_complete(self, store: Store, prefix: bytes, window: int) -> bool:
        if window in self._complete:
            return True
        if window in self._windows:
            return False  # cached from a store that held values of it: some may be missing here
        if next(iter(store.scan_prefix(prefix)), None) is not None:
            return False
        # the store has nothing of the window: from here on, every committed id comes through upsert
        self._windows[window] = _WindowRows(self.dtype, self.parts, self.part_item)
        self._complete.add(window)
        return True

    def drop_window(self, window: int) -> None:
        self._windows.pop(window, None)
        self._complete.discard(window)

    def clear(self) -> None:
        self._windows.clear()
        self._complete.clear()


@dataclass
class UserStateColumns:
    """Stage-1 states of a batch of (window, user) groups, parsed."""

    admitted: np.ndarray  # int64 per group: records admitted so far
    entries: np.ndarray  # int64 per group: its entries
    group: np.ndarray  # int64 per entry: the group it belongs to (sorted)
    key: np.ndarray  # uint64 per entry
    trigger: np.ndarray  # int64 per entry
    where: list = field(default_factory=list)  # per run of equal windows: where the cache had its users (:class:`Located`)


class _WindowLog:
    """A window table kept as a changelog: each commit writes the values it changed as **one**
    blob (``log`` table, keyed by a sequence number per window), not one RocksDB key per id. At
    10^7 users a stage-1 batch changes ~5 * 10^5 user states and a trigger ~10^5 key rows; one
    memtable insert per id costs about 1 us, sorted or not, with or without the write-ahead log,
    which was a quarter of stage 1. The table's values are the latest per id over the window's
    blobs in order (Kafka Streams' changelog, kept in the same store).

    The cache of committed values (:class:`CommittedCache`) holds a window's values as replayed
    from its log (on first use after a start, or after the cache dropped the window over its
    bound) plus every value committed since. A value the cache declines (a window alone over the
    bound) is also written under its id's own key (``spill`` table), at once: it is committed
    already, so writing it again is safe at any time, and the next replay writes it again if a
    crash came first. So the cache plus the spilled keys hold every committed value, and an id
    missing from both has none.

    Blob: count n (u32), n ids (u64), n rows (the cache's row type, if any), and for values
    with a variable part n lengths (u32) and the parts back to back. A spilled value is the
    row's bytes, then the part (always whole).

    Ragged parts that only grow (user states' key histories) are written as appends: the blob's
    count has its top bit set (:data:`APPENDS`), and n starts (u32, before the lengths) say at
    which item of its value each part starts, 0 for a whole value. A touched user's history is
    then written once per record rather than once per touch (whole histories made stage 1's
    changelog several gigabytes a day at 10^7 users, most of its bytes rewritten unchanged).
    Replayed in order, each append lands after the items the earlier blobs gave its id, in the
    cache or under its spilled key (read back, appended, written whole); an append that does not
    start where its value ends is refused as an inconsistent changelog. Blobs written before
    appends existed (no top bit) read as whole values."""

    def __init__(self, store: Store, qid: bytes, log: bytes, spill: bytes, cache: CommittedCache):
        if cache.parts and cache.part_item is None:
            raise ValueError("a changelog's variable parts are ragged arrays: give the cache a part item type")
        self.store, self.qid, self.log, self.spill, self.cache = store, qid, log, spill, cache
        self._spilled: dict[int, bool] = {}  # window -> it has values under the spill table (loaded windows only)
        self._next_seq: dict[int, int] = {}  # window -> sequence number of its next blob

    def load(self, window: int) -> None:
        """Make the cache hold the window: replay its log unless the cache holds it already."""
        if self.cache.holds(window) and window in self._next_seq:
            return
        self.cache.drop_window(window)
        self.cache.hold(window)
        spilled = next(iter(self.store.scan_prefix(sk.window_prefix(self.spill, self.qid, window))), None) is not None
        seq = -1
        for key, blob in self.store.scan_prefix(sk.window_prefix(self.log, self.qid, window)):
            seq = int.from_bytes(key[-8:], "big")
            spilled |= self._cache_or_spill(window, *self._unpack(blob))
        self._spilled[window] = spilled
        self._next_seq[window] = seq + 1

    def windows(self) -> list[int]:
        """Windows with a log, in order: one seek per window (no blob read beyond its first)."""
        found, table = [], self.log + self.qid
        start, stop = table, sk.window_prefix(self.log, self.qid, (1 << 64) - 1) + b"\xff"
        while (first := next(iter(self.store.scan(start, stop)), None)) is not None:
            found.append(sk.window_of(first[0]))
            start = sk.window_prefix(self.log, self.qid, found[-1] + 1)
        return found

    def read(self, window: int, ids: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray, Located]:
        """(found mask, rows, parts, where the cache has them) of ``ids`` (distinct); rows zero
        and parts None where not found."""
        self.load(window)
        ids = np.asarray(ids, dtype=np.uint64)
        hit, cached_rows, cached_parts, where = self.cache.located(window, ids)
        rows = None if self.cache.dtype is None else np.zeros(len(ids), dtype=self.cache.dtype)
        if rows is not None:
            put_rows(rows, hit, cached_rows)
        found = hit.copy()
        at_hit = np.nonzero(hit)[0]
        miss = np.nonzero(~hit)[0]
        if len(miss) and self._spilled[window]:
            stored = self.store.get_many(sk.fixed_keys(sk.window_prefix(self.spill, self.qid, window), ids[miss]))
            present = [j for j, v in enumerate(stored) if v is not None]
            if present:
                at = miss[present]
                spilled_rows, spilled_parts = self._split([stored[j] for j in present])
                if rows is not None:
                    rows[at] = spilled_rows
                if self.cache.parts:  # both sets of parts in position order
                    positions = np.concatenate([at_hit, at])
                    order = np.argsort(positions, kind="stable")
                    cached_parts = Ragged.concat([cached_parts, spilled_parts]).take(order)
                    at_hit = positions[order]
                found[at] = True
        parts = cached_parts.placed(len(ids), at_hit) if self.cache.parts else None
        return found, rows, parts, where

    def scan(self, window: int) -> tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
        """(ids, rows, parts) of every value of the window, in id order."""
        self.load(window)
        ids, rows, parts = self.cache.window_values(window)
        if self._spilled[window]:
            prefix = sk.window_prefix(self.spill, self.qid, window)
            keys, values = [], []
            for key, value in self.store.scan_prefix(prefix):
                keys.append(key)
                values.append(value)
            spilled_ids = sk.suffix_u64(keys, len(prefix))
            extra = np.nonzero(~np.isin(spilled_ids, ids))[0]  # where both have an id, the cache's value is the newer
            if len(extra):
                spilled_rows, spilled_parts = self._split([values[j] for j in extra.tolist()])
                ids = np.concatenate([ids, spilled_ids[extra]])
                rows = None if rows is None else np.concatenate([rows, spilled_rows])
                parts = Ragged.concat([parts, spilled_parts]) if self.cache.parts else None
        order = np.argsort(ids)
        return ids[order], None if rows is None else rows[order], None if parts is None else _take_parts(parts, order)

    def commit(self, batch: WriteBatch, window: int, ids: np.ndarray, rows: Optional[np.ndarray], parts: Optional[Ragged],
               at: Optional[np.ndarray] = None, where: Optional[Located] = None) -> None:
        """Write new values of ``ids`` (distinct) in ``batch``; the cache learns them once it is
        written. ``at`` (ragged parts only): where each part starts in its id's value (0: the
        whole value; above 0: appended to the value's first ``at`` items, all it held).
        ``where``: the slots :meth:`read` found these ids at (same order), if it read them."""
        self.load(window)
        ids = np.asarray(ids, dtype=np.uint64)
        seq = self._next_seq[window]
        self._next_seq[window] = seq + 1
        count = len(ids) | (APPENDS if at is not None else 0)
        pieces = [np.array([count], dtype="<u4").tobytes(), ids.astype("<u8").tobytes()]
        if rows is not None:
            rows = np.array(rows, dtype=self.cache.dtype)  # a copy: the caller may change its rows after this
            pieces.append(rows.tobytes())
        if at is not None:
            at = np.asarray(at, dtype=np.int64)
            pieces.append(at.astype("<u4").tobytes())
        if parts is not None:  # lengths in bytes, then the parts back to back
            pieces.append((parts.lengths * parts.data.dtype.itemsize).astype("<u4").tobytes())
            pieces.append(parts.data.tobytes())
        batch.put(sk.window_prefix(self.log, self.qid, window) + int(seq).to_bytes(8, "big"), b"".join(pieces))
        batch.on_commit(functools.partial(self._committed, window, ids, rows, parts, at, where))

    def _committed(self, window: int, ids: np.ndarray, rows: Optional[np.ndarray], parts: Optional[Ragged],
                   at: Optional[np.ndarray], where: Optional[Located]) -> None:
        if not self.cache.holds(window) or window not in self._next_seq:
            return  # the cache dropped the window meanwhile: its next use replays the log, this blob included
        if self._cache_or_spill(window, ids, rows, parts, at, where):
            self._spilled[window] = True

    def _cache_or_spill(self, window: int, ids: np.ndarray, rows: Optional[np.ndarray], parts: Optional[Ragged],
                        at: Optional[np.ndarray] = None, where: Optional[Located] = None) -> bool:
        """Committed values into the cache; those it declines under their ids' own keys. True if any was spilled."""
        declined, loose = self.cache.appended(window, ids, rows, parts, at, where)
        spilled = self._spill(window, ids, rows, parts, declined)
        if len(loose):  # appends to values that are not cached: completed from their spilled keys, then cached or spilled whole
            ids, rows, parts = ids[loose], None if rows is None else rows[loose], self._completed(window, ids[loose], parts.take(loose), at[loose])
            spilled |= self._spill(window, ids, rows, parts, self.cache.upsert(window, ids, rows, parts))
        return spilled

    def _spill(self, window: int, ids: np.ndarray, rows: Optional[np.ndarray], parts: Optional[Ragged], declined: np.ndarray) -> bool:
        """Whole values at positions ``declined`` under their ids' own keys, written at once. True if any."""
        if not len(declined):
            return False
        width = 0 if rows is None else rows.dtype.itemsize
        raw = b"" if rows is None else rows[declined].tobytes()
        values = [raw[j * width:(j + 1) * width] + (b"" if parts is None else parts.part_bytes(d)) for j, d in enumerate(declined.tolist())]
        spill = WriteBatch()
        spill.put_many(sk.fixed_keys(sk.window_prefix(self.spill, self.qid, window), ids[declined]), values)
        self.store.write(spill)
        return True

    def _completed(self, window: int, ids: np.ndarray, tails: Ragged, at: np.ndarray) -> Ragged:
        """Whole values of ids whose ``tails`` are appended at ``at`` to what their spilled keys hold."""
        stored = self.store.get_many(sk.fixed_keys(sk.window_prefix(self.spill, self.qid, window), ids))
        if any(v is None for v in stored):
            raise ValueError(f"window {window}: an append to a user state the changelog never wrote whole: the state is inconsistent")
        _, heads = self._split(stored)
        if (heads.lengths != at).any():
            raise ValueError(f"window {window}: an append does not start where its stored state ends: the state is inconsistent")
        # one array of the heads' items, then the tails'; value j is head j's span, then tail j's
        data = np.concatenate([heads.data, tails.data])
        firsts = np.stack([heads.offsets[:-1], len(heads.data) + tails.offsets[:-1]], axis=1).ravel()
        spans = np.stack([heads.lengths, tails.lengths], axis=1).ravel()
        return Ragged.of_lengths(heads.lengths + tails.lengths, kernels.gather_spans(data, firsts, spans))

    def _unpack(self, blob: bytes) -> tuple[np.ndarray, Optional[np.ndarray], Optional[Ragged], Optional[np.ndarray]]:
        n = int.from_bytes(blob[:4], "little")
        appends = bool(n & APPENDS)
        n &= APPENDS - 1
        pos = 4 + 8 * n
        ids = np.frombuffer(blob, dtype="<u8", count=n, offset=4).astype(np.uint64)
        rows = None
        if self.cache.dtype is not None:
            rows = np.frombuffer(blob, dtype=self.cache.dtype, count=n, offset=pos).copy()
            pos += n * self.cache.dtype.itemsize
        at = None
        if appends:
            at = np.frombuffer(blob, dtype="<u4", count=n, offset=pos).astype(np.int64)
            pos += 4 * n
        parts = None
        if self.cache.parts:
            item = self.cache.part_item
            lengths = np.frombuffer(blob, dtype="<u4", count=n, offset=pos).astype(np.int64)
            if (lengths % item.itemsize).any():
                raise ValueError(f"a changelog blob's part is not a whole number of {item.itemsize}-byte items")
            lengths //= item.itemsize
            parts = Ragged.of_lengths(lengths, np.frombuffer(blob, dtype=item, count=int(lengths.sum()), offset=pos + 4 * n).copy())
        return ids, rows, parts, at

    def _split(self, values: list[bytes]) -> tuple[Optional[np.ndarray], Optional[Ragged]]:
        """Spilled values as (rows, parts)."""
        width = 0 if self.cache.dtype is None else self.cache.dtype.itemsize
        rows = None if self.cache.dtype is None else np.frombuffer(b"".join(v[:width] for v in values), dtype=self.cache.dtype)
        parts = Ragged.of_bytes([v[width:] for v in values], self.cache.part_item) if self.cache.parts else None
        return rows, parts

    def drop_window(self, window: int) -> None:
        self.cache.drop_window(window)
        self._spilled.pop(window, None)
        self._next_seq.pop(window, None)


#: a user state's fixed part: the records admitted so far
USER_COUNT = np.dtype("<u2")


class UserStates:
    """Stage 1's per-(window, user) states: the number of admitted records (:data:`USER_COUNT`,
    the cache's row) and one :data:`USER_ENTRY` per distinct (key, trigger) of them (the user's
    key history: dpstream.processor.mechanisms.bounding.key_histories; the cache's variable part). A
    changelog (:class:`_WindowLog`): table ``v``, spilled states (count, then entries) in table ``u``."""

    def __init__(self, store: Store, qid: bytes, cache_entries: int = USER_CACHE_ENTRIES):
        self.store, self.qid = store, qid
        self.cache = CommittedCache(USER_COUNT, cache_entries, part_item=USER_ENTRY)
        self.log = _WindowLog(store, qid, sk.USER_LOG, sk.USERS, self.cache)

    def read(self, windows: np.ndarray, users: np.ndarray) -> UserStateColumns:
        """States of the groups ``(windows[g], users[g])`` (absent: nothing admitted yet)."""
        counts = np.zeros(len(users), dtype=np.int64)
        users = np.asarray(users, dtype=np.uint64)
        pieces, where = [], []
        for w, lo, hi in _runs(windows):
            found, rows, parts, located = self.log.read(w, users[lo:hi])
            counts[lo:hi] = rows
            pieces.append(parts)
            where.append(located)
        entries = Ragged.concat(pieces) if len(pieces) > 1 else pieces[0] if pieces else Ragged.empty(0, USER_ENTRY)
        lengths = entries.lengths
        group = np.repeat(np.arange(len(users), dtype=np.int64), lengths)
        return UserStateColumns(counts, lengths, group, entries.data["key"].astype(np.uint64), entries.data["trigger"].astype(np.int64),
                                where)

    def write(self, batch: WriteBatch, windows: np.ndarray, users: np.ndarray, admitted: np.ndarray, changed: np.ndarray,
              full: np.ndarray, entry_group: np.ndarray, entry_key: np.ndarray, entry_trigger: np.ndarray,
              before: Optional[np.ndarray] = None, where: Optional[list] = None) -> None:
        """New states of the ``changed`` groups (sorted by (window, user)). Entries are grouped by
        group (ascending); a ``full`` group (at the bound: it admits nothing more) keeps only its
        count. ``before`` (per group): the entries its stored state holds, and the entries given
        are the ones appended after them (key_histories keeps a group's entries, then appends),
        written as appends. ``None``: the entries given are each group's whole state.
        ``where``: the read's :attr:`UserStateColumns.where` for the same groups."""
        entry_group = np.asarray(entry_group, dtype=np.int64)
        full, changed = np.asarray(full, dtype=bool), np.asarray(changed, dtype=bool)
        # a full group's state is its count alone, written whole; another's entries after ``before``
        at = np.zeros(len(users), dtype=np.int64) if before is None else np.where(full, 0, np.asarray(before, dtype=np.int64))
        # the entries of changed groups, but none of a full one's (it admits nothing more)
        kept = changed[entry_group] & ~full[entry_group]
        entries = kernels.pack_words(entry_key, entry_trigger, kept).view(USER_ENTRY).reshape(-1)
        size = np.bincount(entry_group[kept], minlength=len(users))
        starts = np.cumsum(size) - size  # each group's first entry in ``entries`` (grouped, ascending)
        counts = np.asarray(admitted).astype(USER_COUNT)
        for run, (w, first, last) in enumerate(_runs(windows)):
            groups = first + np.nonzero(changed[first:last])[0]
            if not len(groups):
                continue
            lo = int(starts[groups[0]])
            hi = int(starts[groups[-1]] + size[groups[-1]])
            self.log.commit(batch, w, np.asarray(users, dtype=np.uint64)[groups], counts[groups],
                            Ragged.of_lengths(size[groups], entries[lo:hi]), None if before is None else at[groups],
                            None if where is None else where[run].take(groups - first))

    def drop_window(self, window: int) -> None:
        self.log.drop_window(window)


def _runs(windows: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(window, lo, hi) of each run of equal windows (``windows`` sorted)."""
    windows = np.asarray(windows, dtype=np.int64)
    if not len(windows):
        return
    cut = np.nonzero(windows[1:] != windows[:-1])[0] + 1
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), len(windows)]
    for lo, hi in zip(starts, ends):
        yield int(windows[lo]), lo, hi


class PendingBatches:
    """Table ``b``: stage 2's input, the packed records of each (window, trigger) micro-batch,
    one blob per input position ``seq``; the blob's first 4 bytes are its record count (u32)."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def append(self, batch: WriteBatch, window: int, trigger: int, seq: int, blob: bytes) -> None:
        batch.put(sk.trigger_prefix(sk.PENDING, self.qid, window, trigger) + int(seq).to_bytes(8, "big"), blob)

    def take(self, window: int, trigger: int, batch: WriteBatch) -> list[bytes]:
        """The micro-batch's blobs, deleted in ``batch``."""
        blobs = []
        for key, blob in self.store.scan_prefix(sk.trigger_prefix(sk.PENDING, self.qid, window, trigger)):
            blobs.append(blob)
            batch.delete(key)
        return blobs

    def records_in(self, window: int) -> int:
        """Records pending in a window (all its micro-batches)."""
        return sum(int.from_bytes(blob[:4], "little") for _, blob in self.store.scan_prefix(sk.window_prefix(sk.PENDING, self.qid, window)))


class Amendments:
    """Table ``a``: predecessor amendments addressed to a (window, trigger) micro-batch."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def append(self, batch: WriteBatch, window: int, trigger: int, seq: int, entries: np.ndarray) -> None:
        batch.put(sk.trigger_prefix(sk.AMENDS, self.qid, window, trigger) + int(seq).to_bytes(8, "big"),
                  np.asarray(entries, dtype=AMEND_ENTRY).tobytes())

    def take(self, window: int, trigger: int, batch: WriteBatch) -> np.ndarray:
        """The micro-batch's amendments (:data:`AMEND_ENTRY`), deleted in ``batch``."""
        parts = []
        for key, blob in self.store.scan_prefix(sk.trigger_prefix(sk.AMENDS, self.qid, window, trigger)):
            parts.append(np.frombuffer(blob, dtype=AMEND_ENTRY))
            batch.delete(key)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=AMEND_ENTRY)


class KeyNames:
    """Table ``t``: the key text that owns each 64-bit key id in a window (the first one seen: a
    different text under the same id is a collision, refused by the pipeline). Committed owners
    are kept in memory too (:class:`CommittedCache` without rows)."""

    def __init__(self, store: Store, qid: bytes, cache_entries: int = KEY_CACHE_ENTRIES):
        self.store, self.qid = store, qid
        self.cache = CommittedCache(None, cache_entries)
        #: owners registered in a batch not yet written, per batch: a later call with the same
        #: batch sees them; another batch does not, and an abandoned batch's vanish with it
        self._staged: weakref.WeakKeyDictionary[WriteBatch, dict[tuple[int, int], str]] = weakref.WeakKeyDictionary()

    def owners(self, window: int, ids: list[int], batch: Optional[WriteBatch] = None) -> list[Optional[str]]:
        """The owning text of each id (distinct), ``None`` where the id has none yet (counting
        what ``batch`` registered)."""
        id_array = np.asarray(ids, dtype=np.uint64)
        staged = self._staged.get(batch) if batch is not None else None
        if not staged:
            return self.cache.read_through(self.store, sk.window_prefix(sk.KEY_NAMES, self.qid, window), window, id_array, text=True)[2].tolist()
        # the batch's own registrations first (they are not in the store yet), then the store
        found = np.empty(len(id_array), dtype=object)
        found[:] = [staged.get((window, i)) for i in id_array.tolist()]
        rest = np.nonzero(np.equal(found, None))[0]
        if len(rest):
            found[rest] = self.cache.read_through(self.store, sk.window_prefix(sk.KEY_NAMES, self.qid, window), window, id_array[rest],
                                                  text=True)[2]
        return found.tolist()

    def register(self, batch: WriteBatch, window: int, ids: list[int], texts: list[str]) -> None:
        prefix = sk.window_prefix(sk.KEY_NAMES, self.qid, window)
        id_array = np.asarray(ids, dtype=np.uint64)
        batch.put_many(sk.fixed_keys(prefix, id_array), [t.encode() for t in texts])
        if batch not in self._staged:
            self._staged[batch] = {}
            batch.on_commit(lambda: self._staged.pop(batch, None))
        self._staged[batch].update(((window, i), t) for i, t in zip(id_array.tolist(), texts))
        committed = np.empty(len(texts), dtype=object)
        committed[:] = texts
        batch.on_commit(functools.partial(self.cache.upsert, window, id_array, None, committed))

    def drop_window(self, window: int) -> None:
        self.cache.drop_window(window)
        for staged in self._staged.values():
            for k in [k for k in staged if k[0] == window]:
                del staged[k]


class KeyRows:
    """Per (window, key id) the key's fixed row (:func:`key_row_dtype`); its text is in the
    key-text table (:class:`KeyNames`). A changelog (:class:`_WindowLog`): table ``r``, spilled
    rows in table ``k``."""

    def __init__(self, store: Store, qid: bytes, tree_levels: int, columns: int = 1, cache_entries: int = KEY_CACHE_ENTRIES):
        self.store, self.qid = store, qid
        self.dtype = key_row_dtype(tree_levels, columns)
        self.cache = CommittedCache(self.dtype, cache_entries, parts=False)
        self.log = _WindowLog(store, qid, sk.KEY_LOG, sk.KEYS, self.cache)

    def load(self, window: int, ids: np.ndarray, blank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``ids`` (``blank``, a one-row array, for a key not stored) and whether each was stored."""
        found, rows, _, _ = self.log.read(window, ids)
        put_rows(rows, ~found, np.asarray(blank, dtype=self.dtype).reshape(1))
        return rows, found

    def write(self, batch: WriteBatch, window: int, ids: np.ndarray, rows: np.ndarray) -> None:
        self.log.commit(batch, window, ids, rows, None)

    def scan(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of every stored key of the window, in id order."""
        ids, rows, _ = self.log.scan(window)
        return ids, rows

    def count(self, window: int) -> int:
        return len(self.scan(window)[0])

    def drop_window(self, window: int) -> None:
        self.log.drop_window(window)


class PredictionIndex:
    """Which keys must be looked at at a trigger: the key rows' ``predicted`` column (0: none),
    with no table of its own (it used to be one, and its puts and deletes were half of stage 2's
    writes). Entries at or before the window's last fired trigger are spent: triggers fire in
    order, so they are never asked for again.

    The index of a window is mirrored in memory once first used (:class:`_IndexMirror`, built by
    one scan of the key rows), so taking a trigger's keys is a vectorized selection, not a RocksDB
    scan; the mirror learns a batch's changes once the batch is written, as the row cache does."""

    def __init__(self, keys: KeyRows):
        self.keys = keys
        self._mirrors: dict[int, _IndexMirror] = {}

    def _mirror(self, window: int) -> "_IndexMirror":
        mirror = self._mirrors.get(window)
        if mirror is None:
            ids, rows = self.keys.scan(window)
            mirror = self._mirrors[window] = _IndexMirror(ids, rows["predicted"].astype(np.int64))
        return mirror

    def at(self, window: int, trigger: int) -> np.ndarray:
        """Key ids indexed under the trigger, in id order."""
        return self._mirror(window).at(trigger)

    def take(self, window: int, trigger: int, batch: WriteBatch) -> np.ndarray:
        """Key ids indexed under the trigger. The caller writes all of their rows in ``batch``,
        with a new ``predicted`` (:meth:`move`)."""
        ids = self.at(window, trigger)
        mirror = self._mirror(window)
        batch.on_commit(lambda: mirror.set(ids, np.zeros(len(ids), dtype=np.int64)))
        return ids

    def move(self, batch: WriteBatch, window: int, ids: np.ndarray, old: np.ndarray, new: np.ndarray, now: int) -> None:
        """Re-index keys from trigger ``old`` to ``new`` (0: not indexed); entries at or before
        ``now`` were already taken. The store learns it from the rows' ``predicted`` column, which
        the caller sets to ``new`` and writes in ``batch``; this updates the mirror on commit."""
        ids = np.asarray(ids, dtype=np.uint64)
        old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
        changed = np.nonzero(((old > now) & (old != new)) | ((new > 0) & (new != old)))[0]
        if len(changed):
            mirror = self._mirror(window)
            moved_ids, moved_to = ids[changed], new[changed]
            batch.on_commit(lambda: mirror.set(moved_ids, moved_to))

    def drop_window(self, window: int) -> None:
        self._mirrors.pop(window, None)


class _IndexMirror:
    """A window's prediction index in memory: per key id, the trigger it is indexed under (0:
    none). A key is indexed under one trigger at a time. Triggers and ids are kept in slot order,
    so a trigger's keys are one comparison over a contiguous array (no gather through the
    sorted index)."""

    def __init__(self, ids: np.ndarray, triggers: np.ndarray):
        self.index = _SortedIds()
        self.slot_ids = np.asarray(ids, dtype=np.uint64)
        self.triggers = np.asarray(triggers, dtype=np.int64)
        self.index.add(self.slot_ids, np.arange(len(ids), dtype=np.int64))

    def at(self, trigger: int) -> np.ndarray:
        """Ids indexed under ``trigger``, in id order."""
        return np.sort(self.slot_ids[np.flatnonzero(self.triggers == trigger)])

    def set(self, ids: np.ndarray, triggers: np.ndarray) -> None:
        slots = self.index.find(ids)
        known = slots >= 0
        self.triggers[slots[known]] = triggers[known]
        new = np.nonzero(~known & (triggers > 0))[0]
        if len(new):
            self.index.add(ids[new], np.arange(len(self.triggers), len(self.triggers) + len(new), dtype=np.int64))
            self.triggers = np.concatenate([self.triggers, triggers[new]])
            self.slot_ids = np.concatenate([self.slot_ids, ids[new]])


class Journal:
    """Table ``j``: the releases of each (window, trigger), per key id, as published bytes."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def put(self, batch: WriteBatch, window: int, trigger: int, key_id: int, record: bytes) -> None:
        batch.put(sk.trigger_prefix(sk.JOURNAL, self.qid, window, trigger) + int(key_id).to_bytes(8, "big"), record)

    def read(self, window: int, trigger: int) -> list[bytes]:
        return [v for _, v in self.store.scan_prefix(sk.trigger_prefix(sk.JOURNAL, self.qid, window, trigger))]

    def get(self, window: int, trigger: int, key_id: int) -> Optional[bytes]:
        """The release of one key at (window, trigger), if it was journaled."""
        return self.store.get(sk.trigger_prefix(sk.JOURNAL, self.qid, window, trigger) + int(key_id).to_bytes(8, "big"))


@dataclass(frozen=True)
class WindowProgress:
    fired: int  # last trigger fired
    status: int  # WINDOW_OPEN or WINDOW_REFUSED
    fingerprint: bytes  # the plan the window was opened under (16 bytes)


class Progress:
    """Table ``g``: per window the last trigger fired (u32), status (u8) and plan fingerprint (16)."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def scan(self) -> dict[int, WindowProgress]:
        prefix = sk.PROGRESS + self.qid
        out = {}
        for key, value in self.store.scan_prefix(prefix):
            window = int.from_bytes(key[len(prefix):][:8], "big")
            out[window] = WindowProgress(int.from_bytes(value[:4], "little"), value[4], bytes(value[5:21]))
        return out

    def put(self, batch: WriteBatch, window: int, fired: int, status: int, fingerprint: bytes) -> None:
        batch.put(sk.window_prefix(sk.PROGRESS, self.qid, window), int(fired).to_bytes(4, "little") + bytes([status]) + fingerprint)


class WindowPins:
    """Table ``p``: per window the settings it was first used under (opaque bytes: the caller's
    canonical JSON), written once, by whichever stage uses the window first: stage 1 when it
    bounds the window's first records, stage 2 when it opens the window. Kept with the progress
    row (never dropped with the window's working state). State written before this table
    existed has none: its windows carry the plan fingerprint of their progress row only."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def get(self, window: int) -> Optional[bytes]:
        return self.store.get(sk.window_prefix(sk.WINDOW_PINS, self.qid, window))

    def put(self, batch: WriteBatch, window: int, pins: bytes) -> None:
        batch.put(sk.window_prefix(sk.WINDOW_PINS, self.qid, window), pins)


class ScheduleMark:
    """Meta ``schedule``: the first window of a budgeted query's public schedule and the next
    window to open (two signed 64-bit integers)."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.key = store, sk.META + b"schedule" + qid

    def get(self) -> Optional[tuple[int, int]]:
        raw = self.store.get(self.key)
        if raw is None:
            return None
        return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True)

    def put(self, batch: WriteBatch, first: int, next_open: int) -> None:
        batch.put(self.key, int(first).to_bytes(8, "little", signed=True) + int(next_open).to_bytes(8, "little", signed=True))


class PublishedMarks:
    """Meta ``published``: per window the last trigger whose releases reached the output."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def _key(self, window: int) -> bytes:
        return sk.META + b"published" + self.qid + int(window).to_bytes(8, "big")

    def get(self, window: int) -> int:
        raw = self.store.get(self._key(window))
        return int.from_bytes(raw, "little") if raw else 0

    def put(self, batch: WriteBatch, window: int, trigger: int) -> None:
        batch.put(self._key(window), int(trigger).to_bytes(4, "little"))


@dataclass
class ViewEntry:
    key_id: int
    level: int
    released_at: int
    count: int
    stddev: float
    consistent: int
    other: int
    text: str


class HierarchyView:
    """Table ``h``: a hierarchy's published view, per (window, level-1 root, key id): one
    :data:`VIEW_ENTRY` then the key text."""

    def __init__(self, store: Store, qid: bytes):
        self.store, self.qid = store, qid

    def _prefix(self, window: int, root: int) -> bytes:
        return sk.window_prefix(sk.HIERARCHY_VIEW, self.qid, window) + int(root).to_bytes(8, "big")

    def read(self, window: int, root: int) -> list[ViewEntry]:
        prefix, width = self._prefix(window, root), VIEW_ENTRY.itemsize
        out = []
        for key, value in self.store.scan_prefix(prefix):
            row = np.frombuffer(value[:width], dtype=VIEW_ENTRY)[0]
            out.append(ViewEntry(int.from_bytes(key[len(prefix):], "big"), int(row["level"]), int(row["released_at"]), int(row["count"]),
                                 float(row["stddev"]), int(row["consistent"]), int(row["other"]), value[width:].decode()))
        return out

    def put(self, batch: WriteBatch, window: int, root: int, entry: ViewEntry) -> None:
        row = np.zeros(1, dtype=VIEW_ENTRY)
        row["level"], row["released_at"], row["count"], row["stddev"] = entry.level, entry.released_at, entry.count, entry.stddev
        row["consistent"], row["other"] = entry.consistent, entry.other
        batch.put(self._prefix(window, root) + int(entry.key_id).to_bytes(8, "big"), row.tobytes() + entry.text.encode())


class EpochMarks:
    """Meta ``noise-epoch``, ``state-format`` and ``noise-label``: which secret (its fingerprint),
    layout version and noise label the state directory was written under."""

    EPOCH, FORMAT, LABEL = sk.META + b"noise-epoch", sk.META + b"state-format", sk.META + b"noise-label"

    def __init__(self, store: Store):
        self.store = store

    def get(self) -> Optional[tuple[str, bytes, str]]:
        """(secret fingerprint, format, label), or None for a new state directory."""
        epoch = self.store.get(self.EPOCH)
        if epoch is None:
            return None
        return epoch.decode(), self.store.get(self.FORMAT) or b"1", (self.store.get(self.LABEL) or b"").decode()

    def label(self) -> Optional[str]:
        raw = self.store.get(self.LABEL)
        return None if raw is None else raw.decode()

    def put(self, fingerprint: str, label: str) -> None:
        batch = WriteBatch()
        batch.put(self.EPOCH, fingerprint.encode())
        batch.put(self.FORMAT, STATE_FORMAT)
        batch.put(self.LABEL, label.encode())
        self.store.write(batch)


class QueryTables:
    """All window tables of one query in one store."""

    def __init__(self, store: Store, query_name: str, tree_levels: int, columns: int = 1, user_cache_entries: int = USER_CACHE_ENTRIES,
                 key_cache_entries: int = KEY_CACHE_ENTRIES):
        self.store = store
        self.qid = qid = sk.query_id(query_name)
        self.users = UserStates(store, qid, user_cache_entries)
        self.pending = PendingBatches(store, qid)
        self.amends = Amendments(store, qid)
        self.names = KeyNames(store, qid, key_cache_entries)
        self.keys = KeyRows(store, qid, tree_levels, columns, key_cache_entries)
        self.predictions = PredictionIndex(self.keys)
        self.journal = Journal(store, qid)
        self.progress = Progress(store, qid)
        self.pins = WindowPins(store, qid)
        self.schedule = ScheduleMark(store, qid)
        self.published = PublishedMarks(store, qid)
        self.view = HierarchyView(store, qid)

    def load_logs(self, latest: int = 2) -> None:
        """Replay the changelogs (user states, key rows) of the ``latest`` windows that have one
        into memory now, rather than in the first batch that needs them: a start may be slow, a
        batch should not be. (A stage-1 store has user states but no window progress, so the
        windows are found from the logs themselves; older windows, which only late records
        could reach, still load on first use.)"""
        for log in (self.users.log, self.keys.log):
            for window in log.windows()[-latest:]:
                log.load(window)

    def drop_window(self, window: int) -> None:
        """Delete a window's working state (journal, progress and marks stay) and its cached values."""
        for table in sk.WINDOW_TABLES:
            self.store.delete_prefix(sk.window_prefix(table, self.qid, window))
        self.users.drop_window(window)
        self.names.drop_window(window)
        self.keys.drop_window(window)
        self.predictions.drop_window(window)


class IntegerMark:
    """Meta ``<name>``: one signed 64-bit integer a runner keeps with its state, such as the input
    position its state covers (replay's ``lines``, the worker's ``offset`` per partition) or the
    start of a budget schedule (``schedule-start``)."""

    def __init__(self, store: Store, name: bytes):
        self.store, self.key = store, sk.META + name

    def get(self, default: Optional[int] = None) -> Optional[int]:
        raw = self.store.get(self.key)
        return int.from_bytes(raw, "little", signed=True) if raw else default

    def put(self, batch: WriteBatch, value: int) -> None:
        batch.put(self.key, int(value).to_bytes(8, "little", signed=True))


class TextMark:
    """Meta ``<name>``: one short text a runner keeps with its state (a source topic's id)."""

    def __init__(self, store: Store, name: bytes):
        self.store, self.key = store, sk.META + name

    def get(self) -> Optional[str]:
        raw = self.store.get(self.key)
        return raw.decode() if raw else None

    def put(self, batch: WriteBatch, value: str) -> None:
        batch.put(self.key, value.encode())


class InputWatermarks:
    """Meta ``input-watermarks``: a stage-2 partition's view of how far each stage-1 input
    partition has been read (``topic/partition`` -> Kafka timestamp in ms), from the watermark
    markers on its repartition topic (docs/privacy.md, "Time"). JSON; only ever moves forward."""

    def __init__(self, store: Store, name: bytes = b"input-watermarks"):
        # b"rerouted-watermarks": a stage-1 partition's view of the other input partitions, from
        # the markers on its by-user topics (processor/adapters/worker.py, SourcePartition)
        self.store, self.key = store, sk.META + name

    def get(self) -> dict[tuple[str, int], int]:
        raw = self.store.get(self.key)
        if not raw:
            return {}
        return {(k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])): int(v) for k, v in json.loads(raw).items()}

    def put(self, batch: WriteBatch, marks: dict[tuple[str, int], int]) -> None:
        batch.put(self.key, json.dumps({f"{t}/{p}": int(v) for (t, p), v in sorted(marks.items())}, sort_keys=True).encode())


class ClockState:
    """Meta ``watermark<name>`` and ``held<name>``: a replay clock's state (an opaque blob) and the
    events it holds back, by input line."""

    def __init__(self, store: Store, name: bytes):
        self.store = store
        self._clock_key = sk.META + b"watermark" + name
        self._held_prefix = sk.META + b"held" + name

    def get(self) -> Optional[bytes]:
        return self.store.get(self._clock_key)

    def put(self, batch: WriteBatch, state: bytes) -> None:
        batch.put(self._clock_key, state)

    def held(self) -> Iterator[tuple[int, bytes]]:
        """(input line, raw event) of every held event, in line order."""
        for key, line in self.store.scan_prefix(self._held_prefix):
            yield int.from_bytes(key[-8:], "big"), line

    def hold(self, batch: WriteBatch, line_no: int, raw: bytes) -> None:
        batch.put(self._held_prefix + int(line_no).to_bytes(8, "big"), raw)

    def release(self, batch: WriteBatch, line_no: int) -> None:
        batch.delete(self._held_prefix + int(line_no).to_bytes(8, "big"))


#: the first bytes of a dynamic query's snapshot (its format)
SNAPSHOT_FORMAT = b"S1:"


def encode_snapshot(state: dict) -> bytes:
    """A snapshot of plain numbers, strings, lists, dicts and numpy arrays as bytes: the format
    mark, a u32 header length, a JSON header (floats as their shortest repr, which reads back to
    the same double; each array as its dtype, shape and place in the payload), then the arrays'
    raw little-endian bytes back to back."""
    parts: list[bytes] = []
    offset = 0

    def plain(obj):
        nonlocal offset
        if isinstance(obj, np.ndarray):
            raw = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<")).tobytes()
            parts.append(raw)
            offset += len(raw)
            return {"__array__": obj.dtype.newbyteorder("<").str, "shape": list(obj.shape), "at": offset - len(raw)}
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        raise TypeError(f"a snapshot holds no {type(obj).__name__}")
    header = json.dumps(state, default=plain, separators=(",", ":")).encode()
    return SNAPSHOT_FORMAT + len(header).to_bytes(4, "little") + header + b"".join(parts)


def decode_snapshot(raw: bytes) -> dict:
    if raw[:len(SNAPSHOT_FORMAT)] != SNAPSHOT_FORMAT:
        raise ValueError(f"a dynamic query's snapshot of an unknown format {raw[:4]!r}")
    start = len(SNAPSHOT_FORMAT) + 4
    end = start + int.from_bytes(raw[start - 4:start], "little")
    payload = memoryview(raw)[end:]

    def arrays(obj):
        if "__array__" in obj:
            dtype = np.dtype(obj["__array__"])
            count = int(np.prod(obj["shape"], dtype=np.int64))
            return np.frombuffer(payload, dtype=dtype, count=count, offset=obj["at"]).reshape(obj["shape"]).copy()
        return obj
    return json.loads(raw[start:end], object_hook=arrays)


class DynamicTables:
    """A dynamic query's tables (no windows): ``e`` the update log (tick u64, sequence u64 ->
    item u32, op u8; ``d``, keyed by sequence with the tick in the value, in state written before snapshots), ``n``
    updates counted per privacy unit (u32), and its meta marks: the settings it was started
    under (opaque bytes: the caller's canonical JSON; state written before they were recorded
    holds the plan fingerprint alone, as hex), the last tick decided, the last published, and a
    snapshot of the counter (:func:`encode_snapshot`): the log holds the updates the snapshot
    has not taken in, and those of the ticks since the snapshot before it, which a restart skips
    (docs/user-guide.md, "Dynamic queries")."""

    def __init__(self, store: Store, query_name: str):
        self.store = store
        self.qid = qid = sk.query_id(query_name)
        self.plan, self.decided, self.published, self.snapshot_key = (
            sk.META + name + qid for name in (b"dyn-plan", b"dyn-decided", b"dyn-published", b"dyn-snapshot"))
        self._legacy = False  # the log of a state written before snapshots has entries (``d``): log() finds them

    def snapshot(self) -> Optional[dict]:
        raw = self.store.get(self.snapshot_key)
        return None if raw is None else decode_snapshot(raw)

    def put_snapshot(self, batch: WriteBatch, state: dict, taken_in: list[int], covered_through: int) -> None:
        """The counter's state (:func:`encode_snapshot`) in ``batch``. The log entries it took
        in go: those of the table before snapshots (``d``, keyed by sequence: ``taken_in``) in the same
        batch, and those of ticks up to ``covered_through`` (the previous snapshot's last tick,
        written already) at once, as one range: no tombstone per update for scans to step over."""
        batch.put(self.snapshot_key, encode_snapshot(state))
        if self._legacy:
            for seq in taken_in:
                batch.delete(sk.DYNAMIC_LOG + self.qid + int(seq).to_bytes(8, "big"))
        if covered_through > 0:
            prefix = sk.DYNAMIC_TICK_LOG + self.qid
            self.store.delete_range(prefix, prefix + (int(covered_through) + 1).to_bytes(8, "big"))

    def units(self) -> Iterator[tuple[int, int]]:
        for key, value in self.store.scan_prefix(sk.DYNAMIC_UNITS + self.qid):
            yield int.from_bytes(key[-8:], "big"), int.from_bytes(value, "little")

    def put_unit(self, batch: WriteBatch, unit: int, used: int) -> None:
        batch.put(sk.DYNAMIC_UNITS + self.qid + int(unit).to_bytes(8, "big"), int(used).to_bytes(4, "little"))

    def log(self) -> Iterator[tuple[int, int, int, int]]:
        """(sequence, item index, op code, tick) of every logged update: those of the table
        before snapshots (by sequence), then the others by tick and sequence."""
        for key, value in self.store.scan_prefix(sk.DYNAMIC_LOG + self.qid):
            self._legacy = True
            yield int.from_bytes(key[-8:], "big"), int.from_bytes(value[:4], "little"), value[4], int.from_bytes(value[5:13], "little")
        for key, value in self.store.scan_prefix(sk.DYNAMIC_TICK_LOG + self.qid):
            yield int.from_bytes(key[-8:], "big"), int.from_bytes(value[:4], "little"), value[4], int.from_bytes(key[-16:-8], "big")

    def append_many(self, batch: WriteBatch, seqs, items, ops, ticks) -> None:
        """Log updates: one entry each, keyed by tick and sequence (big-endian, so that a scan
        and a range delete go by tick), holding the item index (u32) and the op code."""
        n = len(seqs)
        keys = np.empty(n, dtype=[("tick", ">u8"), ("seq", ">u8")])
        keys["tick"], keys["seq"] = ticks, seqs
        values = np.empty(n, dtype=[("item", "<u4"), ("op", "u1")])
        values["item"], values["op"] = items, ops
        prefix, raw_keys, raw_values = sk.DYNAMIC_TICK_LOG + self.qid, keys.tobytes(), values.tobytes()
        for k in range(n):
            batch.put(prefix + raw_keys[16 * k:16 * k + 16], raw_values[5 * k:5 * k + 5])

    def pinned_plan(self) -> Optional[bytes]:
        return self.store.get(self.plan)

    def pin_plan(self, pins: bytes) -> None:
        batch = WriteBatch()
        batch.put(self.plan, pins)
        self.store.write(batch)

    def last_decided(self) -> Optional[int]:
        raw = self.store.get(self.decided)
        return None if raw is None else int.from_bytes(raw, "little")

    def put_decided(self, batch: WriteBatch, tick: int) -> None:
        batch.put(self.decided, int(tick).to_bytes(8, "little"))

    def last_published(self) -> int:
        raw = self.store.get(self.published)
        return int.from_bytes(raw, "little") if raw else 0

    def put_published(self, batch: WriteBatch, segment: int) -> None:
        batch.put(self.published, int(segment).to_bytes(4, "little"))


class UnitStepTables(DynamicTables):
    """The tables of a dynamic query's unit step (one partition of its by-unit topic:
    processor/engine/dynamic_stream.py, UnitBounder): the settings pinned and the updates counted
    per privacy unit as a :class:`DynamicTables` has them, ``w`` the updates waiting for their
    tick to be bounded (tick u64, sequence u64 -> item u32, op u8, unit u64), and the last tick
    bounded. Entries of bounded ticks are deleted as one range once that mark is written."""

    def __init__(self, store: Store, query_name: str):
        super().__init__(store, query_name)
        self.bounded = sk.META + b"dyn-bounded" + self.qid

    def waiting(self) -> Iterator[tuple[int, int, int, int, int]]:
        """(tick, sequence, item index, op code, unit) of every update logged, by tick and sequence."""
        for key, value in self.store.scan_prefix(sk.DYNAMIC_UNIT_LOG + self.qid):
            yield (int.from_bytes(key[-16:-8], "big"), int.from_bytes(key[-8:], "big"), int.from_bytes(value[:4], "little"),
                   value[4], int.from_bytes(value[5:13], "little"))

    def append_waiting(self, batch: WriteBatch, ticks, seqs, items, ops, units) -> None:
        keys = np.empty(len(seqs), dtype=[("tick", ">u8"), ("seq", ">u8")])
        keys["tick"], keys["seq"] = ticks, seqs
        values = np.empty(len(seqs), dtype=[("item", "<u4"), ("op", "u1"), ("unit", "<u8")])
        values["item"], values["op"], values["unit"] = items, ops, units
        prefix, raw_keys, raw_values = sk.DYNAMIC_UNIT_LOG + self.qid, keys.tobytes(), values.tobytes()
        for k in range(len(seqs)):
            batch.put(prefix + raw_keys[16 * k:16 * k + 16], raw_values[13 * k:13 * k + 13])

    def last_bounded(self) -> int:
        raw = self.store.get(self.bounded)
        return int.from_bytes(raw, "little") if raw else 0

    def put_bounded(self, batch: WriteBatch, tick: int, written_before: int) -> None:
        """Every tick <= ``tick`` is bounded (in ``batch``); the entries of ticks up to
        ``written_before`` (the mark already written) go at once, as one range."""
        batch.put(self.bounded, int(tick).to_bytes(8, "little"))
        if written_before > 0:
            prefix = sk.DYNAMIC_UNIT_LOG + self.qid
            self.store.delete_range(prefix, prefix + (int(written_before) + 1).to_bytes(8, "big"))
