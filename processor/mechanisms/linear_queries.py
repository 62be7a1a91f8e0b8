"""Range counts over ordered items through multiplicative weights: a static release whose error grows
with the data size, the kind Qiu & Yi's interval tree is built for (papers/dp-on-dynamic-data-
online-interval-tree.txt, section 1.3 and Appendix A.1, PMW), and the insertion-only construction
that turns any static release into Algorithm 3's Q-Ins or the baseline's counters.

Pure: no I/O. Budgets come from :mod:`dpstream.accountant.dynamic` (:class:`MwemBudget`,
:func:`insertion_only_epsilons`); noise is :class:`DynamicNoise`, a keyed PRF of its position, so
a replay with the same secret releases the same values.

* :class:`RangeQueries` - the query class: every range [a, b] of d ordered items, d (d + 1) / 2
  queries, answered from prefix sums.
* :func:`mwem_ranges` - MWEM (Hardt, Ligett and McSherry, NeurIPS 2012): a synthetic histogram
  of the same (noisy) size as the data, improved over a fixed number of rounds, each selecting a
  badly answered range by report noisy max and measuring it with Laplace noise. Every draw is
  exact discrete Laplace (integer scores, integer measurements), so it is pure epsilon-DP as the
  accountant reports; the multiplicative-weights updates are post-processing of released values.
* :class:`InsertionOnlyRelease` - Chan, Shi and Song's block/tree counter (the paper's [5],
  section 2.3) with a static release at each node instead of per-item noise: blocks
  [2^b, 2^{b+1}) of steps, each block's total released at eps / 2, and inside block b a binary
  tree of b + 1 levels sharing the other eps / 2 (every step is in one node per level:
  sequential composition over levels, parallel within one). Only the nodes a release reads are
  computed (which those are depends on the step alone); a node computed or not spends the same
  budget in the accounting.

docs/privacy.md, "Range counts", gives the privacy argument; docs/benchmarks.md, "Where the
interval tree earns its place", the measured errors.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

import numpy as np

from dpstream.accountant.dynamic import MwemBudget, insertion_only_epsilons

#: multiplicative-weights passes over every measurement taken so far, after each new one
#: (post-processing: more passes fit the measurements more closely)
MW_PASSES = 4
#: the most items ``mwem_ranges`` takes: its rounds scan all d (d + 1) / 2 ranges, each with a
#: noise draw (128 items: 8,256 ranges)
MAX_RANGE_ITEMS = 128


class RangeQueries:
    """Every range [lo, hi] (lo <= hi) of ``dims`` ordered items, in ``numpy.triu_indices`` order."""

    def __init__(self, dims: int):
        self.dims = dims
        self.lo, self.hi = np.triu_indices(dims)

    def __len__(self) -> int:
        return len(self.lo)

    def answers(self, histogram: np.ndarray) -> np.ndarray:
        """Every range's count in ``histogram`` (integers stay integers)."""
        prefix = np.concatenate([np.zeros(1, dtype=histogram.dtype), np.cumsum(histogram)])
        return prefix[self.hi + 1] - prefix[self.lo]

    def mask(self, index: int) -> np.ndarray:
        """The items range ``index`` counts, as 0/1 floats."""
        out = np.zeros(self.dims)
        out[self.lo[index]:self.hi[index] + 1] = 1.0
        return out


@lru_cache(maxsize=16)
def range_queries(dims: int) -> RangeQueries:
    return RangeQueries(dims)


def report_noisy_max(scores: np.ndarray, noise: np.ndarray) -> int:
    """The index of the largest ``score + noise``, ties to the first (a fixed rule, so the choice
    is a function of the noisy scores alone). With integer scores of sensitivity 1 (either way)
    and discrete Laplace noise of scale ``2 / eps`` it is eps-DP (docs/privacy.md, "Range counts")."""
    return int(np.argmax(np.asarray(scores, dtype=np.int64) + np.asarray(noise, dtype=np.int64)))


def mwem_ranges(counts: np.ndarray, eps: float, noise, label: str, rounds: Optional[int] = None) -> np.ndarray:
    """An ``eps``-DP synthetic histogram of ``counts`` (one count per ordered item; neighbours differ
    by one in one item) that answers every range count (:class:`RangeQueries`). Its budget is
    :class:`MwemBudget`'s: a noisy size, then per round report noisy max over the ranges' error
    scores ``|true - round(synthetic)|`` and a noisy measurement of the chosen range.

    Every draw is taken whatever the data (the same work for any input, so its time says nothing
    of it); a noisy size below 1 releases zeros (post-processing of that size)."""
    budget = MwemBudget(eps) if rounds is None else MwemBudget(eps, rounds)
    counts = np.asarray(counts, dtype=np.int64)
    dims = len(counts)
    queries = range_queries(dims)
    size = int(counts.sum()) + int(noise.laplace(budget.size_scale, f"{label}:mwem-size", 1)[0])
    select = noise.laplace(budget.select_scale, f"{label}:mwem-select", budget.rounds * len(queries))
    select = select.reshape(budget.rounds, len(queries))
    measure = noise.laplace(budget.measure_scale, f"{label}:mwem-measure", budget.rounds)
    true = queries.answers(counts)
    mass = float(max(size, 1))
    synthetic = np.full(dims, mass / dims)
    taken: list[tuple[np.ndarray, float]] = []
    for t in range(budget.rounds):
        estimate = np.rint(queries.answers(synthetic)).astype(np.int64)
        chosen = report_noisy_max(np.abs(true - estimate), select[t])
        # a range holds between 0 and all of the (noisy) size: the measurement is moved into that
        # interval (post-processing), which also keeps every update's exponent within 1/2
        taken.append((queries.mask(chosen), min(max(float(true[chosen] + measure[t]), 0.0), mass)))
        for _ in range(MW_PASSES):
            for mask, value in taken:
                error = value - float(mask @ synthetic)
                synthetic = synthetic * np.exp(mask * error / (2.0 * mass))
                synthetic *= mass / synthetic.sum()
    return synthetic if size >= 1 else np.zeros(dims)


StaticRelease = Callable[..., np.ndarray]


class InsertionOnlyRelease:
    """Continual release of the running sum of vectors fed once per step, through a static release
    at each node of the block/tree counter (module docstring): eps-DP when neighbouring inputs
    differ by at most ``sensitivity`` updates in all (group privacy: each node's release runs at
    its epsilon divided by it). The value at step k is the sum of the releases of the completed
    blocks and of the dyadic nodes covering the current block's first steps.

    Same interface as :class:`dpstream.processor.mechanisms.dynamic.InsertionOnlyCounter`
    (``feed``, ``estimate``, ``snapshot``, ``restore``), which is this construction for the
    Laplace histogram with the noise added lazily."""

    def __init__(self, eps: float, dims: int, noise, label: str, static_release: StaticRelease, sensitivity: int = 1):
        self.eps, self.dims, self.noise, self.label = eps, dims, noise, label
        self.static_release, self.sensitivity = static_release, sensitivity
        self.step = 0
        self.exact = np.zeros(dims, dtype=np.int64)  # for benchmarks and tests only: decides nothing
        self._block = np.zeros(dims, dtype=np.int64)  # the current block's sum so far
        self._open = np.zeros((0, dims), dtype=np.int64)  # row h: the open level-h node's sum
        self._read: dict[int, np.ndarray] = {}  # level -> release of its last completed node, while read
        self._blocks = np.zeros(dims)  # sum of the releases of the completed blocks

    def feed(self, increment: Optional[np.ndarray] = None) -> None:
        self.step += 1
        k = self.step
        b = k.bit_length() - 1
        if k == 1 << b:  # block b starts; block b - 1 is complete
            if b > 0:
                eps_block, _ = insertion_only_epsilons(self.eps, k - 1, self.sensitivity)
                self._blocks = self._blocks + self.static_release(self._block, eps_block, self.noise,
                                                                  f"{self.label}:block{b - 1}")
            self._block = np.zeros(self.dims, dtype=np.int64)
            self._open = np.zeros((b + 1, self.dims), dtype=np.int64)
            self._read = {}
        if increment is not None:
            increment = np.asarray(increment, dtype=np.int64)
            self.exact += increment
            self._block += increment
            self._open += increment
        done = k - (1 << b) + 1  # steps of block b so far
        _, eps_node = insertion_only_epsilons(self.eps, k, self.sensitivity)
        for h in range(b + 1):
            if done % (1 << h):
                break  # nodes of higher levels are still open
            if (done >> h) & 1:  # read from now until the next node of level h completes
                self._read[h] = self.static_release(self._open[h].copy(), eps_node, self.noise,
                                                    f"{self.label}:b{b}:l{h}:i{(done >> h) - 1}")
            else:  # covered by a node of a higher level completing now: never read
                self._read.pop(h, None)
            self._open[h] = 0

    def estimate(self) -> np.ndarray:
        out = self._blocks.copy()
        for release in self._read.values():
            out += release
        return out

    def snapshot(self) -> dict:
        levels = sorted(self._read)
        return {"step": self.step, "exact": self.exact.copy(), "block": self._block.copy(), "open": self._open.copy(),
                "read_levels": np.array(levels, dtype=np.int64),
                "read": np.array([self._read[h] for h in levels], dtype=np.float64).reshape(len(levels), self.dims),
                "blocks": self._blocks.copy()}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])
        self.exact = np.array(state["exact"], dtype=np.int64)
        self._block = np.array(state["block"], dtype=np.int64)
        self._open = np.array(state["open"], dtype=np.int64).reshape(-1, self.dims)
        read = np.array(state["read"], dtype=np.float64).reshape(-1, self.dims)
        self._read = {int(h): read[i] for i, h in enumerate(np.asarray(state["read_levels"]).tolist())}
        self._blocks = np.array(state["blocks"], dtype=np.float64)
