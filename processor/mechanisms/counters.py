"""Continual counters: the seam between DP-SQLP's algorithms and the mechanism that releases
noisy prefix sums (docs/architecture.md, "Where to add").

Key selection (Algorithm 2) keeps one counter stream per (key, round) fed with users new to the
round; perturbation (Algorithm 3) one per (key, column) fed with the key's buffered aggregate.
Both use a counter only through :class:`ContinualCounter`: they advance many streams at once from
the step each has processed to a later one, read exact noisy prefixes (compared with thresholds
and rounded exactly, never ``raw + noise`` in floating point: docs/privacy.md, "The arithmetic of
releases"), and carry a fixed-width int64 state per stream between steps, which the key rows store
(dpstream.state.tables: ``sel_cache``, ``pcache``). The accountant calibrates a counter from its
:class:`dpstream.accountant.counters.CounterCalibration` (sensitivity and per-step variance), found by
the counter's name.

Implementations:

* the binary tree with Honaker estimation (:mod:`dpstream.processor.mechanisms.tree`): its state is the
  frontier of complete nodes, one per tree level;
* the Buffered Linear Toeplitz counter (:class:`BLTCounter`): correlated noise from a
  matrix factorization, 4 numbers of state per stream, about a quarter of the tree's worst-step
  noise variance at T = 100 to 1000 (docs/privacy.md, "Counters").
"""
from __future__ import annotations

from fractions import Fraction
from typing import Protocol

import numpy as np

from dpstream.accountant.counters import (
    BINARY_TREE,
    BLT,
    CounterCalibration,
    blt_parameters,
    lattice_scale,
)
from dpstream.processor.mechanisms import kernels
from dpstream.processor.mechanisms.noise import NodeNoise, discrete_gaussian, node_ids
from dpstream.processor.mechanisms.tree import HonakerForest


class NoisyPrefixes(Protocol):
    """Noisy prefixes of a batch of (stream, step) pairs, held exactly."""

    def exceeds(self, base: np.ndarray, threshold: np.ndarray) -> np.ndarray:
        """``base + noise > threshold``, decided exactly."""

    def rounded(self, base: np.ndarray) -> np.ndarray:
        """``base + noise`` rounded to the nearest integer, exactly (int64)."""

    def approx(self) -> np.ndarray:
        """The noise as floats: statistics and shortcuts only, never a decision or a release."""


class CounterWalk(Protocol):
    """Many streams advanced from their processed step ``done`` to ``upto``."""

    def prefix(self, stream: np.ndarray, step: np.ndarray) -> NoisyPrefixes:
        """Noisy prefixes for (stream, step) pairs with done <= step <= upto of that stream."""

    def state_at(self, step: np.ndarray) -> np.ndarray:
        """Each stream's state (n, state_width) once ``step`` is processed: ``upto``, or ``done``
        for a stream that did not move (a walk need keep no other)."""

    def future(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (stream, step) with done < step <= upto, stream-major, steps ascending."""

    def scan(self, base: np.ndarray, release_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per stream, the first future step whose noisy prefix exceeds its threshold (0: none)
        and the largest float margin over the future steps (:func:`scan_future`)."""


class ContinualCounter(Protocol):
    name: str
    calibration: CounterCalibration
    steps: int  # T
    state_width: int  # int64 numbers of state per stream

    def empty_state(self, n: int) -> np.ndarray:
        """State of ``n`` streams before their first step."""

    def prepare(self) -> None:
        """Build what a first step would, such as a sampler table: a worker calls this off its
        event loop at start, so that its first trigger does not (docs/architecture.md, "Noise
        tables")."""

    def walk(self, streams: np.ndarray, done: np.ndarray, upto: np.ndarray, state: np.ndarray) -> CounterWalk:
        """Advance streams (16-byte ids naming their noise) from ``done`` (with ``state``) to ``upto``."""


class _TreeWalk:
    def __init__(self, walk):
        self._walk = walk

    def prefix(self, stream, step):
        return self._walk.prefix(stream, step)

    def state_at(self, step):
        return self._walk.cache_at(step)

    def future(self):
        return self._walk.future()

    def scan(self, base, release_at):
        return scan_future(self, base, release_at)


class BinaryTreeCounter:
    """The binary tree with bottom-up Honaker estimation (DP-SQLP section 2.2) over T steps."""

    name = BINARY_TREE.name
    calibration = BINARY_TREE

    def __init__(self, steps: int, sigma_units: float, noise: NodeNoise):
        self._use(HonakerForest(steps, discrete_gaussian(sigma_units), noise))

    @classmethod
    def over(cls, forest: HonakerForest) -> "BinaryTreeCounter":
        """A counter over a given forest (tests inject forests with known node noise)."""
        counter = cls.__new__(cls)
        counter._use(forest)
        return counter

    def _use(self, forest: HonakerForest) -> None:
        self._forest = forest
        self.steps = forest.capacity
        self.state_width = forest.tree_levels
        self.sampler = forest.sampler  # the node noise's distribution (statistical tests)

    def empty_state(self, n: int) -> np.ndarray:
        return self._forest.empty_cache(n)

    def prepare(self) -> None:
        """The forest's sampler table was built with it; the sampler's compiled lookup is made now."""
        kernels.prepare()

    def walk(self, streams, done, upto, state) -> CounterWalk:
        return _TreeWalk(self._forest.walk(streams, done, upto, state))


#: BLT noise draws are named (level BLT_NODE_LEVEL, index step - 1) in their stream: apart from
#: any tree node (levels < 25), so the two counters never share a draw
BLT_NODE_LEVEL = 255
#: |W|, |buffer| above this would come near int64 limits; the noise bounds keep them far below
_INT_GUARD = 1 << 61
_EXACT_FLOAT = 1 << 53


class LatticePrefix:
    """Noisy prefixes ``base + W / K`` of a lattice counter: W the integer prefix of the noise in
    lattice units. Exact: ``base * K + W`` is an integer and ``K`` a power of two."""

    def __init__(self, W: np.ndarray, scale: int):
        self.W = W
        self.scale = scale
        self._shift = scale.bit_length() - 1

    def __len__(self) -> int:
        return len(self.W)

    def exceeds(self, base: np.ndarray, threshold: np.ndarray) -> np.ndarray:
        """``base + W / K > threshold``, i.e. ``base * K + W > threshold * K``: both sides are exact
        floats (an integer below 2^53, and a float times a power of two); larger integers are
        compared as Python integers against the float's exact rational value."""
        x = np.asarray(base, dtype=np.int64) * self.scale + self.W
        scaled = np.broadcast_to(np.asarray(threshold, dtype=np.float64) * self.scale, x.shape)
        out = x.astype(np.float64) > scaled
        for i in np.nonzero(np.abs(x) >= _EXACT_FLOAT)[0].tolist():
            out[i] = Fraction(int(x[i])) > Fraction(float(scaled[i]))
        return out

    def rounded(self, base: np.ndarray) -> np.ndarray:
        """The integer nearest to ``base + W / K`` (halves up: a fixed rule, post-processing)."""
        return np.asarray(base, dtype=np.int64) + ((self.W + (self.scale >> 1)) >> self._shift)

    def approx(self) -> np.ndarray:
        return self.W / self.scale


class _BLTWalk:
    """Streams advanced step by step through the BLT noise recurrence (see :class:`BLTCounter`):
    W after every step, the buffers only at each stream's end (``upto``)."""

    def __init__(self, counter: "BLTCounter", streams, done, upto, state):
        self._scale = counter.scale
        self.done = np.asarray(done, dtype=np.int64)
        self.upto = np.asarray(upto, dtype=np.int64)
        state = np.asarray(state, dtype=np.int64)
        n = len(self.done)
        count = np.maximum(self.upto - self.done, 0)
        self._offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(count, out=self._offsets[1:])
        total = int(self._offsets[-1])
        self._state = state
        self._W = np.empty(total, dtype=np.int64)
        self._final = state
        if not total:
            return
        stream, step = kernels.stream_steps(self._offsets, self.done)
        z = counter.noise.sample_indexed(counter.sampler, streams, stream, node_ids(np.full(total, BLT_NODE_LEVEL), step - 1))
        z = z.astype(np.int64)
        # the recurrence over every (stream, step): compiled, or numpy one step at a time
        self._W, self._final = kernels.blt_walk(z, self._offsets, state, counter.theta_int, counter.omega_int, counter.bits,
                                                counter.fine_bits, counter.feedback, counter.advance)

    def _index(self, stream: np.ndarray, step: np.ndarray) -> np.ndarray:
        return self._offsets[stream] + (step - self.done[stream] - 1)

    def prefix(self, stream, step) -> LatticePrefix:
        stream = np.asarray(stream, dtype=np.int64)
        step = np.asarray(step, dtype=np.int64)
        W = np.empty(len(stream), dtype=np.int64)
        at_done = step == self.done[stream]
        W[at_done] = self._state[stream[at_done], -1]
        walked = ~at_done
        W[walked] = self._W[self._index(stream[walked], step[walked])]
        return LatticePrefix(W, self._scale)

    def state_at(self, step) -> np.ndarray:
        """Each stream's state at ``step``: its end (``upto``), or ``done`` where it did not move."""
        step = np.asarray(step, dtype=np.int64)
        walked = step > self.done
        if (step[walked] != self.upto[walked]).any():
            raise ValueError("a BLT walk keeps the state at its end only (upto)")
        out = self._state.copy()
        out[walked] = self._final[walked]
        return out

    def future(self) -> tuple[np.ndarray, np.ndarray]:
        if not len(self._W):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return kernels.stream_steps(self._offsets, self.done)

    def scan(self, base: np.ndarray, release_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:func:`scan_future`, in one compiled pass over W where the kernels are compiled (a
        stream whose integers outgrow floats before its first hit is decided exactly, as
        :meth:`LatticePrefix.exceeds` does)."""
        compiled = kernels.lattice_scan(self._W, self._offsets, self.done, base, release_at, self._scale)
        if compiled is None:
            return scan_future(self, base, release_at)
        first_hit, max_margin, unsure = compiled
        for s in np.nonzero(unsure)[0].tolist():
            steps = np.arange(self.done[s] + 1, self.upto[s] + 1)
            hit = self.prefix(np.full(len(steps), s), steps).exceeds(np.full(len(steps), base[s]), release_at[steps - 1])
            first_hit[s] = steps[np.argmax(hit)] if hit.any() else 0
        return first_hit, max_margin


def scan_future(walk: CounterWalk, base: np.ndarray, release_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Release prediction's pass over every stream's future steps (Algorithm 4): per stream, the
    first step s > done whose noisy prefix ``base + noise_s`` exceeds ``release_at[s-1]``,
    decided exactly (0: none), and the largest ``noise_s - release_at[s-1]`` in floats (-inf for
    a stream with no future step): a bound that lets later predictions skip the scan."""
    stream, step = walk.future()
    n = len(base)
    first_hit, max_margin = np.zeros(n, dtype=np.int64), np.full(n, -np.inf)
    if not len(stream):
        return first_hit, max_margin
    prefix = walk.prefix(stream, step)
    threshold = release_at[step - 1]
    hit = prefix.exceeds(np.asarray(base)[stream], threshold)
    hit_stream, first = np.unique(stream[hit], return_index=True)
    first_hit[hit_stream] = step[hit][first]
    np.maximum.at(max_margin, stream, prefix.approx() - threshold)
    return first_hit, max_margin


class BLTCounter:
    """Buffered Linear Toeplitz counter (Dvijotham et al., FOCS 2024; McMahan, Xu and Zhang 2024)
    in exact integer arithmetic.

    The encoder C is lower-triangular Toeplitz with ``c_0 = 1``, ``c_m = sum_k omega_k
    theta_k^(m-1)`` (3 buffers, fitted by scripts/fit_blt.py, exact dyadic numbers). The counter
    privatizes ``C x + z`` and releases ``A C^-1 (C x + z) = S + A C^-1 z``: the exact prefix S
    plus correlated noise. Noise lives on the lattice ``1 / K`` of the data grid (K a power of
    two, :func:`dpstream.accountant.counters.lattice_scale`): ``z_t`` is discrete Gaussian with scale
    ``sigma_units * K`` from the keyed PRF per (stream, step), and the noise increment is

        w_t = z_t - round(sum_k omega_k buf_k / 2^F),    buf_k <- round(theta_k buf_k) + w_t 2^F

    in integers (buffers hold lattice units times 2^F). The prefix noise is ``W_t / K`` with
    ``W_t = sum_{j<=t} w_j``. Given the data, the published prefixes determine the ``w``, hence
    the ``z``; conditionally on the past, each step's value is a discrete Gaussian centred on a
    lattice point, and two neighbouring inputs move that centre by ``K (C Delta)_t`` up to the
    rounding slack (dpstream.accountant.counters.BLT). So every release is post-processing of an exact
    lattice mechanism, nothing is ``raw + noise`` in floating point, and the noise W depends on
    the stream's identity alone: release prediction reads it ahead, as with the tree.

    State per stream: the 3 buffers and W (int64).
    """

    name = BLT.name
    calibration = BLT

    def __init__(self, steps: int, sigma_units: float, noise: NodeNoise):
        self.steps = int(steps)
        params = blt_parameters(self.steps)
        self.buffers = params.buffers
        self.bits = params.bits
        self.fine_bits = params.fine_bits
        self.theta_int = np.array(params.theta_int, dtype=np.int64)
        self.omega_int = np.array(params.omega_int, dtype=np.int64)
        self.scale = lattice_scale(sigma_units)
        self.sigma_units = float(sigma_units)
        self.state_width = self.buffers + 1
        self.noise = noise
        self._sampler = None

    @property
    def sampler(self):
        """The discrete Gaussian on the lattice (built on first use: tables take a second)."""
        if self._sampler is None:
            self._sampler = discrete_gaussian(self.sigma_units * self.scale)
        return self._sampler

    def prepare(self) -> None:
        self.sampler
        kernels.prepare()

    def empty_state(self, n: int) -> np.ndarray:
        return np.zeros((n, self.state_width), dtype=np.int64)

    def feedback(self, buffers: np.ndarray) -> np.ndarray:
        """``round(sum_k omega_k buf_k / 2^F)`` per row, halves up, in lattice units: the part of
        ``(C w)_t - w_t`` the buffers carry (exact integers; dpstream.accountant.counters bounds its
        distance from the linear value)."""
        shift = self.fine_bits + self.bits
        return ((buffers * self.omega_int).sum(axis=1) + (1 << (shift - 1))) >> shift

    def advance(self, buffers: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Buffers after a step with noise increments ``w``: ``round(theta_k buf_k) + w 2^F``."""
        out = ((buffers * self.theta_int + (1 << (self.bits - 1))) >> self.bits) + (np.asarray(w, dtype=np.int64) << self.fine_bits)[:, None]
        if np.abs(out).max(initial=0) >= _INT_GUARD >> self.bits:
            raise AssertionError("BLT buffer beyond its proven bound")
        return out

    def walk(self, streams, done, upto, state) -> CounterWalk:
        if (np.asarray(upto) > self.steps).any():
            raise ValueError("step beyond the counter's horizon")
        return _BLTWalk(self, streams, done, upto, state)


COUNTER_TYPES: dict[str, type] = {BinaryTreeCounter.name: BinaryTreeCounter, BLTCounter.name: BLTCounter}


def counter_for(name: str, steps: int, sigma_units: float, noise: NodeNoise) -> ContinualCounter:
    """The counter a plan names, at the plan's noise scale (grid units)."""
    from dpstream.accountant.counters import CONFIG_NAMES

    return COUNTER_TYPES[CONFIG_NAMES.get(name, name)](steps, sigma_units, noise)
