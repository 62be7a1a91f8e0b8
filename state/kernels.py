"""The state caches' array kernels (dpstream.state.tables), compiled where numba is installed, as
the trigger kernels are (docs/architecture.md, "Kernels"); numpy otherwise. Both give the same
results.

* :func:`positions`: search of sorted 64-bit ids, the caches' index.
* :func:`scatter_spans`: the reverse, parts written into their spans.
* :func:`merged`: new ids merged into a cache's sorted index in one pass.
* :func:`pack_words`: (u64, u32) pairs packed as 12-byte little-endian records (a user state's
  entries), where numpy writes the two fields of a packed record one slow pass each.
* :func:`gather_spans`: ragged parts (user states' key histories) copied out of the spans of
  the array that keeps them, without the index array of every item numpy's gather needs.

The ids are keyed hashes, spread evenly over 64 bits, so a directory of where each value of their
top bits starts narrows a search to a bucket of a few ids; the kernel then finds each id with a
short binary search in one compiled loop. At 10^7 ids numpy's vectorized version of the same
search, one pass over the whole batch per halving, took four times as long, and a plain
``searchsorted`` misses the CPU cache at almost every step. ``DPSTREAM_KERNELS=numpy`` (or
:func:`use`, which dpstream.processor.mechanisms.kernels.use calls too) selects numpy.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

_choice = os.environ.get("DPSTREAM_KERNELS", "numba")
_compiled = None
#: below this many ids numpy's own ``searchsorted`` is as fast as the directory (numpy path)
NUMPY_DIRECTORY_FROM = 1 << 16


def use(name: str) -> None:
    global _choice
    _choice = name


def _kernel():
    global _compiled
    if _compiled is None:
        try:
            import numba
        except ImportError:
            _compiled = False
        else:
            try:
                _compiled = _build(numba, cache=True)
            except RuntimeError:  # no writable cache directory: compile in each process
                _compiled = _build(numba, cache=False)
    return _compiled or None


def _build(numba, cache: bool):
    @numba.njit(cache=cache, nogil=True)
    def positions(sorted_ids, directory, bits, queries, out):
        shift = np.uint64(64 - bits)
        for i in range(queries.shape[0]):
            q = queries[i]
            b = np.int64(q >> shift)
            lo, hi = directory[b], directory[b + 1]
            while lo < hi:
                mid = (lo + hi) >> 1
                if sorted_ids[mid] < q:
                    lo = mid + 1
                else:
                    hi = mid
            out[i] = lo

    @numba.njit(cache=cache, nogil=True)
    def gather_spans(data, starts, lengths, out):
        w = 0
        for j in range(starts.shape[0]):
            a = starts[j]
            for i in range(lengths[j]):
                for b in range(data.shape[1]):
                    out[w, b] = data[a + i, b]
                w += 1
    @numba.njit(cache=cache, nogil=True)
    def pack_words(keys, triggers, keep, out):
        w = 0
        for i in range(keys.shape[0]):
            if keep[i]:
                out[w, 0] = np.uint32(keys[i] & np.uint64(0xFFFFFFFF))
                out[w, 1] = np.uint32(keys[i] >> np.uint64(32))
                out[w, 2] = np.uint32(triggers[i])
                w += 1

    @numba.njit(cache=cache, nogil=True)
    def scatter_spans(data, starts, src, src_starts, lengths):
        for j in range(starts.shape[0]):
            a, s = starts[j], src_starts[j]
            for i in range(lengths[j]):
                for b in range(data.shape[1]):
                    data[a + i, b] = src[s + i, b]

    @numba.njit(cache=cache, nogil=True)
    def merged(ids, slots, new_ids, new_slots, out_ids, out_slots):
        i = 0
        j = 0
        for w in range(out_ids.shape[0]):
            if j < new_ids.shape[0] and (i == ids.shape[0] or new_ids[j] < ids[i]):
                out_ids[w] = new_ids[j]
                out_slots[w] = new_slots[j]
                j += 1
            else:
                out_ids[w] = ids[i]
                out_slots[w] = slots[i]
                i += 1

    return {"positions": positions, "gather_spans": gather_spans, "pack_words": pack_words, "scatter_spans": scatter_spans,
            "merged": merged}


def prepare() -> None:
    """Compile the search now (a worker's start calls this through the trigger kernels')."""
    if _choice == "numba" and _kernel() is not None:
        ids = np.zeros(1, dtype=np.uint64)
        positions(ids, directory(ids, 8), 8, ids)
        gather_spans(np.zeros(1, dtype=np.dtype([("a", "<u8"), ("b", "<u4")])), np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64))
        pack_words(np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.int64), np.ones(1, dtype=bool))
        item = np.zeros(1, dtype=np.dtype([("a", "<u8"), ("b", "<u4")]))
        scatter_spans(item, np.zeros(1, dtype=np.int64), item.copy(), np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64))
        merged(ids, np.zeros(1, dtype=np.int64), ids + np.uint64(1), np.ones(1, dtype=np.int64))


def directory_bits(n: int) -> int:
    """Top bits of the directory for ``n`` ids: about four ids per bucket (2^8 to 2^22 buckets)."""
    return min(22, max(8, int(n).bit_length() - 2))


def directory(sorted_ids: np.ndarray, bits: int) -> np.ndarray:
    """``d`` with ``d[b]`` = the number of ids whose top ``bits`` bits are below ``b`` (length 2^bits + 1)."""
    out = np.zeros((1 << bits) + 1, dtype=np.int64)
    np.cumsum(np.bincount((sorted_ids >> np.uint64(64 - bits)).astype(np.int64), minlength=1 << bits), out=out[1:])
    return out


def added(directory_: np.ndarray, bits: int, new_ids: np.ndarray) -> np.ndarray:
    """The directory once ``new_ids`` are inserted."""
    grown = directory_.copy()
    grown[1:] += np.cumsum(np.bincount((new_ids >> np.uint64(64 - bits)).astype(np.int64), minlength=1 << bits))
    return grown


def positions(sorted_ids: np.ndarray, directory_: Optional[np.ndarray], bits: int, queries: np.ndarray) -> np.ndarray:
    """``np.searchsorted(sorted_ids, queries)`` (left), through the directory."""
    kernel = _kernel() if _choice == "numba" else None
    if kernel is not None:
        out = np.empty(len(queries), dtype=np.int64)
        kernel["positions"](sorted_ids, directory_, bits, queries, out)
        return out
    if directory_ is None or len(sorted_ids) < NUMPY_DIRECTORY_FROM:
        return np.searchsorted(sorted_ids, queries)
    # numpy: the same search, vectorized over the queries (one pass per halving of a bucket)
    bucket = (queries >> np.uint64(64 - bits)).astype(np.int64)
    lo, hi = directory_[bucket], directory_[bucket + 1]
    last = len(sorted_ids) - 1
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) >> 1
        right = open_ & (sorted_ids[np.minimum(mid, last)] < queries)
        lo = np.where(right, mid + 1, lo)
        hi = np.where(open_ & ~right, mid, hi)


def gather_spans(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``data[starts[j]:starts[j]+lengths[j]]`` for every j, back to back (items of any fixed width)."""
    starts, lengths = np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    kernel = _kernel() if _choice == "numba" else None
    if kernel is not None and data.flags.c_contiguous:
        out = np.empty(total, dtype=data.dtype)
        kernel["gather_spans"](_words(data), starts, lengths, _words(out))
        return out
    if not total:
        return data[:0].copy()
    first = np.cumsum(lengths) - lengths
    index = np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)
    if data.dtype.names is None:
        return data[index]
    records = data.view(np.dtype((np.void, data.dtype.itemsize)))  # whole records: numpy moves fields one by one
    return records[index].view(data.dtype)


def pack_words(keys: np.ndarray, triggers: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """(m, 3) uint32 words of the kept (key, trigger) pairs: key low and high, then trigger, i.e.
    the little-endian bytes of a packed ``[("key", "<u8"), ("trigger", "<u4")]`` record each."""
    keys, triggers, keep = np.asarray(keys, dtype=np.uint64), np.asarray(triggers, dtype=np.int64), np.asarray(keep, dtype=bool)
    out = np.empty((int(keep.sum()), 3), dtype="<u4")
    kernel = _kernel() if _choice == "numba" else None
    if kernel is not None:
        kernel["pack_words"](keys, triggers, keep, out)
        return out
    out[:, :2] = keys[keep].astype("<u8").view("<u4").reshape(-1, 2)
    out[:, 2] = triggers[keep]
    return out


def scatter_spans(data: np.ndarray, starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray) -> None:
    """``data[starts[j]:starts[j]+lengths[j]] = src[src_starts[j]:src_starts[j]+lengths[j]]`` for every j."""
    starts, src_starts, lengths = (np.ascontiguousarray(a, dtype=np.int64) for a in (starts, src_starts, lengths))
    if not len(src) or not len(starts):
        return
    kernel = _kernel() if _choice == "numba" else None
    if kernel is not None and data.flags.c_contiguous and src.flags.c_contiguous:
        kernel["scatter_spans"](_words(data), starts, _words(src), src_starts, lengths)
        return
    first = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    index = np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)
    taken = np.repeat(src_starts - first, lengths) + np.arange(total, dtype=np.int64)
    if data.dtype.names is None:
        data[index] = src[taken]
    else:  # whole records: numpy moves the fields of a structured array one by one
        void = np.dtype((np.void, data.dtype.itemsize))
        data.view(void)[index] = np.ascontiguousarray(src).view(void)[taken]


def merged(ids: np.ndarray, slots: np.ndarray, new_ids: np.ndarray, new_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``ids`` (with their ``slots``) and sorted ``new_ids`` (none of them in ``ids``; with
    their slots) merged into one sorted pair of arrays: one pass, where ``np.insert`` makes
    several over the whole index (tens of megabytes at 10^7 ids) for each batch of new ids."""
    new_ids, new_slots = np.asarray(new_ids, dtype=np.uint64), np.asarray(new_slots, dtype=np.int64)
    kernel = _kernel() if _choice == "numba" else None
    if kernel is None:
        pos = np.searchsorted(ids, new_ids)
        return np.insert(ids, pos, new_ids), np.insert(slots, pos, new_slots)
    out_ids = np.empty(len(ids) + len(new_ids), dtype=np.uint64)
    out_slots = np.empty(len(out_ids), dtype=np.int64)
    kernel["merged"](ids, slots, new_ids, new_slots, out_ids, out_slots)
    return out_ids, out_slots


def _words(items: np.ndarray) -> np.ndarray:
    """Fixed-width items as rows of the widest machine words that tile them (a 12-byte user
    entry: three 4-byte words), so the span kernels move words, not single bytes (half the time
    of a byte loop for the key histories)."""
    width = items.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if width % w == 0)
    return items.view(np.dtype(f"<u{word}")).reshape(-1, width // word)
