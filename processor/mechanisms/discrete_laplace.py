"""Exact discrete Laplace noise driven by the keyed PRF (docs/privacy.md, "Dynamic counts").

The dynamic agent's mechanisms are pure epsilon-DP only if their noise is *exactly* discrete
Laplace, ``P[x] = (1 - q) / (1 + q) * q^|x|`` with ``q = exp(-1 / scale)``, on all the integers.
An inverse transform computed in floating point has bounded support (nothing beyond about 37
scales from 53-bit uniforms), and an output possible under one input but impossible under its
neighbour breaks pure DP. This module samples exactly, with integer arithmetic only, following
Canonne, Kamath and Steinke, *The Discrete Gaussian for Differential Privacy* (2020):

* **Algorithm 1**, ``Bernoulli(exp(-gamma))`` for rational ``gamma = n / d`` in [0, 1]: draw
  ``A_K ~ Bernoulli(gamma / K)`` for K = 1, 2, ... until one is 0; the answer is 1 iff that K is
  odd. (For gamma = 1 this is ``Bernoulli(exp(-1))``.)
* **Algorithm 2**, discrete Laplace with scale ``t / s`` (integers): draw U uniform in
  {0..t-1}, accept it with ``Bernoulli(exp(-U / t))`` (else restart), draw V geometric by
  counting successes of ``Bernoulli(exp(-1))``, set ``Y = floor((U + t V) / s)``, draw a sign bit
  B, restart if B = 1 and Y = 0, return ``(1 - 2B) Y``.
* **Bernoulli(n / m)** is ``u < n`` for u uniform in {0..m-1}, from 64-bit PRF words by exact
  rejection: a word w is used only if ``w < 2^64 - (2^64 mod m)``, then ``u = w mod m``.

The scale arrives as a float (e.g. ``2 / eps``). It is replaced by the rational ``t / s >= scale``
with ``s = 2^20`` (fewer bits for huge scales) and ``t = ceil(scale * s)``: at least as much noise
as declared, so the mechanism is at least as private as the accountant says.

Randomness: draw i of a stream reads 64-bit words from the keyed PRF at nodes
``(i mod 2^26) * 64 + j // 2`` of a tree named by the stream's label, page ``j // 128`` and
``i >> 26``: a fixed, unbounded word sequence per draw. A value depends only on (secret, query,
label, index, scale), never on how draws are batched. Draws run the rejection loops in lockstep
with numpy masks; words are fetched 32 at a time, only for the draws still running.
"""
from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Callable

import numpy as np

#: denominator of the rational scale (power of two)
SCALE_DENOMINATOR_BITS = 20
#: t must stay below this so that t * K and U + t * V fit in 63 bits
MAX_T = 1 << 52
WORDS_PER_PAGE = 128  # 64 AES blocks
FETCH = 32  # words fetched at a time per draw (most draws need fewer than 32 in all)
INDEX_BITS = 26
BATCH = 8192
SCALAR_DRAWS = 8
_TWO64 = 1 << 64


@lru_cache(maxsize=256)
def rational_scale(scale: float) -> tuple[int, int]:
    """(t, s) with ``t / s >= scale``, s a power of two, t < 2^52."""
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    exact = Fraction(scale)
    bits = SCALE_DENOMINATOR_BITS
    while bits > 0 and math.ceil(exact * (1 << bits)) >= MAX_T:
        bits -= 1
    t = math.ceil(exact * (1 << bits))
    if t >= MAX_T:
        raise ValueError(f"scale {scale!r} is too large for the exact sampler")
    return max(t, 1), 1 << bits


#: words(page, index_high, nodes) -> (hi, lo) uint64 arrays: 128 PRF bits per node
WordSource = Callable[[int, int, np.ndarray], tuple[np.ndarray, np.ndarray]]


class _Words:
    """The word sequences of a batch of draws, fetched lazily."""

    def __init__(self, source: WordSource, indices: np.ndarray):
        self.source = source
        self.indices = indices.astype(np.int64)
        n = len(indices)
        self.buffer = np.zeros((n, WORDS_PER_PAGE), dtype=np.uint64)
        self.fetched = np.zeros(n, dtype=np.int64)
        self.cursor = np.zeros(n, dtype=np.int64)
        if n:
            self._fill(np.arange(n))

    def _fill(self, rows: np.ndarray) -> None:
        """Fetch the next FETCH words of these rows (all within the first page)."""
        start = self.fetched[rows]
        blocks = FETCH // 2
        rep = np.repeat(rows, blocks)
        first_block = np.repeat(start // 2, blocks) + np.tile(np.arange(blocks), len(rows))
        idx = self.indices[rep]
        high = idx >> INDEX_BITS
        highs = np.unique(high)
        for h in highs.tolist():
            sel = np.nonzero(high == h)[0] if len(highs) > 1 else np.arange(len(idx))
            nodes = ((idx[sel] & ((1 << INDEX_BITS) - 1)) * (WORDS_PER_PAGE // 2) + first_block[sel]).astype(np.uint32)
            hi, lo = self.source(0, int(h), nodes)
            r, b = rep[sel], first_block[sel]
            self.buffer[r, 2 * b] = hi
            self.buffer[r, 2 * b + 1] = lo
        self.fetched[rows] += FETCH

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The next word of each of these draws (each row at most once per call)."""
        pos = self.cursor[rows]
        out = np.empty(len(rows), dtype=np.uint64)
        first = pos < WORDS_PER_PAGE
        need = rows[first & (pos >= self.fetched[rows])]
        if len(need):
            self._fill(need)
        out[first] = self.buffer[rows[first], pos[first]]
        for k in np.nonzero(~first)[0].tolist():  # beyond the first page: vanishingly rare
            p, i = int(pos[k]), int(self.indices[rows[k]])
            node = np.array([(i & ((1 << INDEX_BITS) - 1)) * (WORDS_PER_PAGE // 2) + (p % WORDS_PER_PAGE) // 2], dtype=np.uint32)
            hi, lo = self.source(p // WORDS_PER_PAGE, i >> INDEX_BITS, node)
            out[k] = hi[0] if p % 2 == 0 else lo[0]
        self.cursor[rows] += 1
        return out


def _uniform(words: _Words, rows: np.ndarray, m: int) -> np.ndarray:
    """Uniform integers in [0, m) (m < 2^63), one per row, by exact rejection."""
    limit = _TWO64 - (_TWO64 % m)  # accept w < limit: every residue equally often
    out = np.empty(len(rows), dtype=np.uint64)
    todo = np.arange(len(rows))
    while len(todo):
        w = words.take(rows[todo])
        ok = w < np.uint64(limit) if limit < _TWO64 else np.ones(len(w), dtype=bool)
        out[todo[ok]] = w[ok] % np.uint64(m)
        todo = todo[~ok]
    return out


def _bernoulli_exp(words: _Words, rows: np.ndarray, num: np.ndarray, den: int) -> np.ndarray:
    """Bernoulli(exp(-num/den)) per row, num in [0, den] (CKS Algorithm 1)."""
    num = np.asarray(num, dtype=np.uint64)
    result = np.zeros(len(rows), dtype=bool)
    active = np.arange(len(rows))
    k = 1
    while len(active):
        if den * k >= 1 << 63:
            raise AssertionError("Bernoulli(exp(-gamma)) ran past K = 2^63 / den (probability below 1/K!)")
        u = _uniform(words, rows[active], den * k)
        success = u < num[active]  # A_K ~ Bernoulli(gamma / K)
        stopped = active[~success]
        result[stopped] = k % 2 == 1
        active = active[success]
        k += 1
    return result


def sample(source: WordSource, scale: float, indices: np.ndarray) -> np.ndarray:
    """Exact discrete Laplace draws (int64) with scale ``scale`` (rounded up to t/s), one per
    index, each from its own word sequence (CKS Algorithm 2)."""
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) <= SCALAR_DRAWS:  # a few draws: plain Python beats numpy's per-call overhead
        t, s = rational_scale(scale)
        return np.array([_sample_one(source, t, s, int(i)) for i in indices.tolist()], dtype=np.int64)
    out = np.empty(len(indices), dtype=np.int64)
    for lo in range(0, len(indices), BATCH):
        out[lo:lo + BATCH] = _sample_batch(source, scale, indices[lo:lo + BATCH])
    return out


def _word_stream(source: WordSource, index: int):
    """The word sequence of one draw (the same words :class:`_Words` reads)."""
    position = 0
    low, high = index & ((1 << INDEX_BITS) - 1), index >> INDEX_BITS
    while True:
        page, offset = divmod(position, WORDS_PER_PAGE)
        nodes = (low * (WORDS_PER_PAGE // 2) + offset // 2 + np.arange(FETCH // 2)).astype(np.uint32)
        hi, lo = source(page, high, nodes)
        for a, b in zip(hi.tolist(), lo.tolist()):
            yield a
            yield b
        position += FETCH


def _sample_one(source: WordSource, t: int, s: int, index: int) -> int:
    """CKS Algorithm 2 for one draw, in Python integers (same words, same result as the batch)."""
    words = _word_stream(source, index)

    def uniform(m: int) -> int:
        limit = _TWO64 - (_TWO64 % m)
        while True:
            w = next(words)
            if w < limit:
                return w % m

    def bernoulli_exp(num: int, den: int) -> bool:
        k = 1
        while uniform(den * k) < num:
            k += 1
        return k % 2 == 1

    while True:
        u = uniform(t)
        if not bernoulli_exp(u, t):
            continue
        v = 0
        while bernoulli_exp(1, 1):
            v += 1
        y = (u + t * v) // s
        negative = next(words) & 1
        if negative and y == 0:
            continue
        return -y if negative else y


def _sample_batch(source: WordSource, scale: float, indices: np.ndarray) -> np.ndarray:
    t, s = rational_scale(scale)
    words = _Words(source, indices)
    out = np.zeros(len(indices), dtype=np.int64)
    pending = np.arange(len(indices))
    ones = None
    while len(pending):
        u = _uniform(words, pending, t)
        accept = _bernoulli_exp(words, pending, u, t)
        rows, u = pending[accept], u[accept]
        v = np.zeros(len(rows), dtype=np.uint64)
        going = np.arange(len(rows))
        while len(going):  # V: successes of Bernoulli(exp(-1)) before the first failure
            ones = np.ones(len(going), dtype=np.uint64)
            a = _bernoulli_exp(words, rows[going], ones, 1)
            v[going[a]] += np.uint64(1)
            going = going[a]
        y = ((u + np.uint64(t) * v) // np.uint64(s)).astype(np.int64)
        negative = (words.take(rows) & np.uint64(1)).astype(bool)
        done = ~(negative & (y == 0))
        out[rows[done]] = np.where(negative[done], -y[done], y[done])
        pending = np.concatenate([pending[~accept], rows[~done]])
    return out


def pmf(scale: float, x: np.ndarray) -> np.ndarray:
    """The exact law sampled (for tests): discrete Laplace with the rounded-up scale t/s."""
    t, s = rational_scale(scale)
    q = math.exp(-s / t)
    x = np.abs(np.asarray(x, dtype=np.float64))
    return (1 - q) / (1 + q) * q ** x
