"""Compiled kernels for the trigger's hot loops, with the numpy versions they replace
(docs/architecture.md, "Kernels").

A kernel computes exactly what its numpy twin computes, in the same int64 arithmetic (products
wrap alike, ``>>`` is arithmetic on both), so outputs are byte-identical whichever runs
(tests/test_kernels.py checks them against each other, and the gold replays are unchanged). The
compiled ones come from numba, a PyPI wheel (no compiler at install time); they are compiled on
first use in a process (:func:`prepare`, which a worker calls at start) and cached on disk where
numba finds a writable place (the package's ``__pycache__``, or ``NUMBA_CACHE_DIR``); a
read-only install without one compiles in each process instead (about a second).

``DPSTREAM_KERNELS=numpy`` (or :func:`use`) selects the numpy versions: the baseline
``dpstream bench dpsqlp --kernels numpy,numba`` measures in one run.

Kernels:

* :func:`blt_walk`: the BLT counter's noise recurrence over every (stream, step) of a walk
  (dpstream.processor.mechanisms.counters.BLTCounter). numpy advances all streams one step at a
  time (a Python loop over the steps); the kernel runs each stream's steps in one compiled loop.
* :func:`table_lookup`: the discrete Gaussian table sampler's map from 128-bit uniforms to
  samples (dpstream.processor.mechanisms.noise.DiscreteGaussian.from_uniform): a guide-table
  bucket, then a binary search of the bucket's entries on the high and low words.
* :func:`stream_steps`, :func:`lattice_scan`: the (stream, step) entries of a walk, and release
  prediction's pass over a lattice counter's future steps (first step above the threshold,
  largest margin), in one loop each where numpy materializes several arrays per step.
* :func:`key_histories`, :func:`group_ranks`: stage 1's predecessors and new user states, one
  user at a time, and each record's rank among its user's (its contribution slot).
* :func:`first_occurrences`: the first record of each key id in a batch (key id collisions).
* :func:`node_blocks`: the second AES blocks of the noise PRF, ``AES(tree_id) XOR node_id``
  per draw (dpstream.processor.mechanisms.noise.NodeNoise), laid out in one pass where numpy
  gathers, copies and XORs in three.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from dpstream.state import kernels as state_kernels

KERNEL_NAMES = ("numba", "numpy")
_INT_GUARD = 1 << 61

_choice = os.environ.get("DPSTREAM_KERNELS", "numba")
_compiled: Optional[dict] = None


def use(name: str) -> None:
    """Select the kernels: ``numba`` (compiled; numpy if numba is not installed) or ``numpy``."""
    global _choice
    if name not in KERNEL_NAMES:
        raise ValueError(f"kernels: must be one of {', '.join(KERNEL_NAMES)}, got {name!r}")
    _choice = name
    state_kernels.use(name)  # the state caches' id search follows the same choice


def active() -> str:
    """The kernels in use: ``numba`` or ``numpy``."""
    return "numba" if _choice == "numba" and _numba() is not None else "numpy"


def prepare() -> None:
    """Compile the kernels now (a worker calls this off its event loop at start)."""
    state_kernels.prepare()
    if active() == "numba":
        kernels = _numba()
        kernels["blt_walk"](np.zeros(1, dtype=np.int64), np.zeros(2, dtype=np.int64), np.zeros((1, 4), dtype=np.int64),
                            np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64), 1, 1, 1,
                            np.zeros(1, dtype=np.int64), np.zeros((1, 4), dtype=np.int64))
        one = np.zeros(1, dtype=np.int64)
        kernels["stream_steps"](np.array([0, 1]), one, one.copy(), one.copy())
        kernels["key_histories"](one, np.zeros(1, dtype=np.uint64), one, np.zeros(2, dtype=np.int64), np.zeros(0, dtype=np.uint64),
                                 np.zeros(0, dtype=np.int64), True, True, one.copy(), one.copy(), np.zeros(1, dtype=np.int64),
                                 np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.int64))
        kernels["group_ranks"](one, 1, one.copy())
        kernels["first_occurrences"](np.zeros(1, dtype=np.uint64), 4, one.copy())
        kernels["lattice_scan"](one, np.array([0, 1]), one, one, np.zeros(1), 1, one.copy(), np.zeros(1), np.zeros(1, dtype=np.bool_))
        words = np.zeros((1, 2), dtype=np.uint64)
        for edges in (np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.int64)):
            for hi, lo in ((words[:, 0], words[:, 1]), (np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64))):
                kernels["table_lookup"](hi, lo, np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64), edges, 1)
        kernels["node_blocks"](words, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.uint32), np.empty((1, 2), dtype=np.uint64))


def _numba() -> Optional[dict]:
    global _compiled
    if _compiled is None:
        try:
            import numba
        except ImportError:
            _compiled = {}
        else:
            _compiled = _compile(numba)
    return _compiled or None


def _compile(numba) -> dict:
    try:
        return _kernels(numba, cache=True)
    except RuntimeError:  # numba finds no writable cache directory: compile in each process
        return _kernels(numba, cache=False)


def _kernels(numba, cache: bool) -> dict:
    @numba.njit(cache=cache, nogil=True)
    def blt_walk(z, offsets, state, theta, omega, bits, fine_bits, shift, W_out, final):
        n, d = state.shape[0], theta.shape[0]
        buf = np.empty(d, dtype=np.int64)
        limit = (1 << 61) >> bits
        worst = 0
        half_shift = np.int64(1) << (shift - 1)
        half_bits = np.int64(1) << (bits - 1)
        for s in range(n):
            for k in range(d):
                buf[k] = state[s, k]
            W = state[s, d]
            for pos in range(offsets[s], offsets[s + 1]):
                acc = np.int64(0)
                for k in range(d):
                    acc += buf[k] * omega[k]
                w = z[pos] - ((acc + half_shift) >> shift)
                W += w
                for k in range(d):
                    b = ((buf[k] * theta[k] + half_bits) >> bits) + (w << fine_bits)
                    buf[k] = b
                    a = -b if b < 0 else b
                    if a > worst:
                        worst = a
                W_out[pos] = W
            for k in range(d):
                final[s, k] = buf[k]
            final[s, d] = W
        return worst >= limit

    @numba.njit(cache=cache, nogil=True)
    def stream_steps(offsets, done, stream, step):
        for s in range(offsets.shape[0] - 1):
            first = offsets[s]
            for pos in range(first, offsets[s + 1]):
                stream[pos] = s
                step[pos] = done[s] + 1 + (pos - first)

    @numba.njit(cache=cache, nogil=True)
    def lattice_scan(W, offsets, done, base, release_at, scale, first_hit, max_margin, unsure):
        exact = np.int64(1) << 53
        scale_f = np.float64(scale)
        for s in range(offsets.shape[0] - 1):
            found = 0
            best = -np.inf
            doubt = False
            for pos in range(offsets[s], offsets[s + 1]):
                step = done[s] + 1 + (pos - offsets[s])
                threshold = release_at[step - 1]
                margin = np.float64(W[pos]) / scale_f - threshold
                if margin > best:
                    best = margin
                if found == 0 and not doubt:
                    x = base[s] * scale + W[pos]
                    if (-x if x < 0 else x) >= exact:
                        doubt = True
                    elif np.float64(x) > threshold * scale_f:
                        found = step
            first_hit[s] = found
            max_margin[s] = best
            unsure[s] = doubt

    @numba.njit(cache=cache, nogil=True)
    def table_lookup(hi, lo, table_hi, table_lo, edges, guide_bits):
        out = np.empty(hi.shape[0], dtype=np.int64)
        drop = 64 - guide_bits
        for i in range(hi.shape[0]):
            h = hi[i]
            b = np.int64(h >> np.uint64(drop))
            left, right = np.int64(edges[b]), np.int64(edges[b + 1])
            # k = #{j : (hi_j, lo_j) <= (h, l)}: entries before the bucket are all below, after it above
            while left < right:
                mid = (left + right) >> 1
                th = table_hi[mid]
                if th < h or (th == h and table_lo[mid] <= lo[i]):
                    left = mid + 1
                else:
                    right = mid
            out[i] = left
        return out

    @numba.njit(cache=cache, nogil=True)
    def node_blocks(first, tree_of, nodes, out):
        for i in range(tree_of.shape[0]):
            t = tree_of[i]
            out[i, 0] = first[t, 0] ^ np.uint64(nodes[i])
            out[i, 1] = first[t, 1]

    @numba.njit(cache=cache, nogil=True)
    def key_histories(g, k, t, bounds, sk, st, distinct, whole, previous, amend, out_g, out_k, out_t):
        n, groups = g.shape[0], bounds.shape[0] - 1
        big = np.iinfo(np.int64).max
        # the records of each group in arrival order (a counting sort: groups are dense)
        start = np.zeros(groups + 1, dtype=np.int64)
        for i in range(n):
            start[g[i] + 1] += 1
        for j in range(groups):
            start[j + 1] += start[j]
        order = np.empty(n, dtype=np.int64)
        fill = start[:-1].copy()
        for i in range(n):
            order[fill[g[i]]] = i
            fill[g[i]] += 1
        fresh = np.empty(n, dtype=np.int64)
        w = 0
        for grp in range(groups):
            a, b = start[grp], start[grp + 1]
            e0, e1 = bounds[grp], bounds[grp + 1]
            if whole:
                for e in range(e0, e1):  # the group's entries stay, in their order
                    out_g[w], out_k[w], out_t[w] = grp, sk[e], st[e]
                    w += 1
            m = 0
            for x in range(a, b):
                i = order[x]
                ki, ti = k[i], t[i]
                prev, later, known = 0, big, False
                for e in range(e0, e1):  # the user's state entries
                    if sk[e] == ki:
                        te = st[e]
                        if te <= ti:
                            prev = max(prev, te)
                        else:
                            later = min(later, te)
                        known |= te == ti
                for y in range(a, x):  # the user's earlier records of the batch
                    j = order[y]
                    if k[j] == ki:
                        tj = t[j]
                        if tj <= ti:
                            prev = max(prev, tj)
                        else:
                            later = min(later, tj)
                        known |= tj == ti
                previous[i] = prev
                amend[i] = 0 if later == big else later
                if not distinct or not known:
                    # new entries by (key, arrival): insertion into the group's sorted few
                    p = m
                    while p > 0 and k[fresh[p - 1]] > ki:
                        fresh[p] = fresh[p - 1]
                        p -= 1
                    fresh[p] = i
                    m += 1
            for p in range(m):
                i = fresh[p]
                out_g[w], out_k[w], out_t[w] = grp, k[i], t[i]
                w += 1
        return w

    @numba.njit(cache=cache, nogil=True)
    def group_ranks(group_of, groups, out):
        seen = np.zeros(groups, dtype=np.int64)
        for i in range(group_of.shape[0]):
            out[i] = seen[group_of[i]]
            seen[group_of[i]] += 1

    @numba.njit(cache=cache, nogil=True)
    def first_occurrences(ids, bits, out):
        size = np.int64(1) << bits
        mask = size - 1
        table_ids = np.zeros(size, dtype=np.uint64)
        table_at = np.full(size, -1, dtype=np.int64)
        shift = np.uint64(64 - bits)
        for i in range(ids.shape[0]):
            x = ids[i]
            h = np.int64((x * np.uint64(0x9E3779B97F4A7C15)) >> shift)  # Fibonacci hashing, open addressing
            while table_at[h] >= 0 and table_ids[h] != x:
                h = (h + 1) & mask
            if table_at[h] < 0:
                table_ids[h], table_at[h] = x, i
            out[i] = table_at[h]

    return {"blt_walk": blt_walk, "table_lookup": table_lookup, "node_blocks": node_blocks, "stream_steps": stream_steps,
            "lattice_scan": lattice_scan, "key_histories": key_histories, "group_ranks": group_ranks,
            "first_occurrences": first_occurrences}


# ------------------------------------------------------------------------- the BLT recurrence

def blt_walk(z: np.ndarray, offsets: np.ndarray, state: np.ndarray, theta: np.ndarray, omega: np.ndarray, bits: int,
             fine_bits: int, feedback: Callable, advance: Callable) -> tuple[np.ndarray, np.ndarray]:
    """(W after every (stream, step) of a walk, each stream's state after its last step):
    stream s's steps are the entries ``offsets[s]:offsets[s+1]`` of ``z`` (its noise draws, in
    step order), its state before them ``state[s]`` (d buffers, then W; a stream with no steps
    keeps it). ``feedback``/``advance``: the counter's own one-step functions, which the numpy
    version calls (the kernel inlines the same arithmetic). The buffers of steps before the last
    are not kept: no caller reads a state but the walk's end."""
    n, d = state.shape[0], len(theta)
    total = int(offsets[-1])
    W_out = np.empty(total, dtype=np.int64)
    final = np.array(state, dtype=np.int64)
    if not total:
        return W_out, final
    kernels = _numba() if _choice == "numba" else None
    if kernels is not None:
        beyond = kernels["blt_walk"](z, offsets, state, theta, omega, bits, fine_bits, fine_bits + bits, W_out, final)
        if beyond:
            raise AssertionError("BLT buffer beyond its proven bound")
        return W_out, final
    count = np.diff(offsets)
    # longest walks first: the streams still walking at offset j are a prefix of this order
    order = np.argsort(-count, kind="stable")
    sorted_count = count[order]
    buf = state[order, :d].copy()
    W = state[order, d].copy()
    first = offsets[:-1][order]
    for j in range(int(sorted_count[0]) if n else 0):
        m = int(np.searchsorted(-sorted_count, -j, side="left"))  # streams with count > j
        if m == 0:
            break
        pos = first[:m] + j
        w = z[pos] - feedback(buf[:m])
        W[:m] += w
        buf[:m] = advance(buf[:m], w)
        W_out[pos] = W[:m]
    final[order, :d] = buf
    final[order, d] = W
    return W_out, final


def stream_steps(offsets: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stream, step) of every entry of a walk: stream s walks steps ``done[s]+1`` on, one entry
    per step, in ``offsets[s]:offsets[s+1]``."""
    total = int(offsets[-1])
    kernels = _numba() if _choice == "numba" else None
    if kernels is not None:
        stream, step = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
        kernels["stream_steps"](offsets, done, stream, step)
        return stream, step
    stream = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return stream, done[stream] + 1 + (np.arange(total) - offsets[stream])


def lattice_scan(W: np.ndarray, offsets: np.ndarray, done: np.ndarray, base: np.ndarray, release_at: np.ndarray, scale: int
                 ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Release prediction's scan of a lattice counter's future (Algorithm 4), compiled: per
    stream, the first step whose noisy prefix ``base + W / scale`` exceeds ``release_at[step-1]``
    (0: none) by the exact comparison of dpstream.processor.mechanisms.counters.LatticePrefix,
    the largest margin ``W / scale - release_at[step-1]`` in floats, and whether an integer too
    large for floats came before the first hit (then the caller decides that stream exactly).
    None when the numpy version is in use."""
    kernels = _numba() if _choice == "numba" else None
    if kernels is None:
        return None
    n = len(offsets) - 1
    first_hit, max_margin, unsure = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.float64), np.empty(n, dtype=np.bool_)
    kernels["lattice_scan"](W, offsets, np.asarray(done, dtype=np.int64), np.asarray(base, dtype=np.int64),
                            np.asarray(release_at, dtype=np.float64), int(scale), first_hit, max_margin, unsure)
    return first_hit, max_margin, unsure


# ------------------------------------------------------------------------- stage 1's key histories

def key_histories(g: np.ndarray, k: np.ndarray, t: np.ndarray, sg: np.ndarray, sk: np.ndarray, st: np.ndarray, distinct: bool,
                  appended: bool = False) -> Optional[tuple]:
    """dpstream.processor.mechanisms.bounding.key_histories, compiled: per group (user), each
    record against the group's state entries and its earlier records of the batch, and the new
    state (the group's entries, then its new ones by (key, arrival)), one group at a time in one
    loop where numpy sorts the batch and expands every (record, entry) pair. (previous, amend,
    state group, key, trigger; ``appended``: the new entries only), or None when the numpy
    version is in use."""
    kernels = _numba() if _choice == "numba" else None
    if kernels is None:
        return None
    n = len(g)
    groups = max(int(g.max(initial=-1)), int(sg.max(initial=-1))) + 1
    bounds = np.zeros(groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(sg, minlength=groups), out=bounds[1:])
    previous, amend = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    size = (0 if appended else len(sg)) + n
    out_g, out_k, out_t = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.int64)
    w = kernels["key_histories"](g, k, t, bounds, sk, st, distinct, not appended, previous, amend, out_g, out_k, out_t)
    return previous, amend, out_g[:w], out_k[:w], out_t[:w]


def group_ranks(group_of: np.ndarray, groups: int) -> Optional[np.ndarray]:
    """Each record's rank among its group's records in arrival order (0 for the first), compiled
    (one pass with a counter per group, where numpy sorts); None when numpy is in use."""
    kernels = _numba() if _choice == "numba" else None
    if kernels is None:
        return None
    out = np.empty(len(group_of), dtype=np.int64)
    kernels["group_ranks"](group_of, int(groups), out)
    return out


def first_occurrences(ids: np.ndarray) -> np.ndarray:
    """Per entry, the index of the first entry with the same 64-bit id (a hash table, compiled;
    numpy: a sort)."""
    ids = np.asarray(ids, dtype=np.uint64)
    kernels = _numba() if _choice == "numba" else None
    if kernels is not None:
        out = np.empty(len(ids), dtype=np.int64)
        kernels["first_occurrences"](ids, max(4, (2 * len(ids)).bit_length()), out)
        return out
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    return first[inverse.ravel()]


# ------------------------------------------------------------------------- the table sampler

def table_lookup(hi: np.ndarray, lo: np.ndarray, table_hi: np.ndarray, table_lo: np.ndarray, edges: np.ndarray,
                 guide_bits: int) -> Optional[np.ndarray]:
    """``#{j : (table_hi_j, table_lo_j) <= (hi, lo)}`` per uniform, compiled (bucket b of the
    guide holds entries ``edges[b]:edges[b+1]``); None when the numpy version is in use (the
    sampler then runs its own)."""
    kernels = _numba() if _choice == "numba" else None
    if kernels is None:
        return None
    return kernels["table_lookup"](hi, lo, table_hi, table_lo, edges, guide_bits)


# ------------------------------------------------------------------------- the noise PRF's blocks

def node_blocks(first: np.ndarray, tree_of: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The (n, 2) uint64 blocks ``first[tree_of[i]]`` with ``nodes[i]`` XORed into word 0 (the
    node id in the block's first 4 bytes, little-endian)."""
    kernels = _numba() if _choice == "numba" else None
    if kernels is not None:
        out = np.empty((len(tree_of), 2), dtype=np.uint64)
        kernels["node_blocks"](first, tree_of, nodes, out)
        return out
    out = first[tree_of]
    out[:, 0] ^= nodes.astype(np.uint64)
    return out
