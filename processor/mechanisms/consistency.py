"""Consistent, non-negative integer post-processing of noisy hierarchical counts.

Given a forest of counts (e.g. country > state > city) whose nodes carry independent noisy
measurements, find integer values ``v`` minimising

    sum over measured nodes i of  weight_i * (v_i - noisy_i)**2

subject to ``v >= 0`` integer, ``v_parent == sum(v_children)`` for *closed* nodes,
``v_parent >= sum(v_children)`` for *open* nodes (an implicit, free, non-negative "other" child:
children not released yet) and ``v_i == fixed_i`` for nodes with a public value. This is the
quadratic integer program of Fioretto, Van Hentenryck and Zhu, "Differential Privacy of
Hierarchical Census Data: an optimization approach", section 5 (Model 1: objective H1,
faithfulness H2, consistency H3, validity H4), solved *exactly* with their dynamic program
(section 6, eq. 4a-4d) over convex cost tables (section 7, Lemma 5 / Theorem 3) computed by
greedy slope merging (section 7.1, Algorithm 1, eq. 7).

Privacy: this module only reads already-released noisy values and public facts (the tree shape,
public totals, the noise scale), so it costs **no privacy budget**: post-processing immunity
(the paper's Lemma 3). It must stay pure (no I/O, no data access) to keep that true; it depends
on numpy only.

Cost tables
-----------
The cost table of node i (eq. 4a-4d) maps each value ``v`` of its domain to the least cost of
its subtree when ``v_i = v``. By Lemma 5 it is convex piecewise linear, so it is stored as a
:class:`CostTable`: ``lo``, the cost ``base`` at ``lo``, and the non-decreasing ``slopes``
``cost(lo+j+1) - cost(lo+j)``; ``open_tail`` means the table continues flat forever after its
last slope (an unmeasured open node, or a slack child, can absorb any extra amount at no cost).

* Bottom-up (eq. 4b-4d): the children's combined table is their min-plus (infimal)
  convolution. For convex tables it is obtained by merging all children's slopes in ascending
  order (Algorithm 1's ``Merge``, eq. 7): the cheapest next unit always goes to the child with
  the smallest next slope, and the result is convex again (Lemma 5). With a slack child (open
  node) or an open-tailed child only the strictly negative slopes matter (zero slopes forever
  after). A node only needs the merged slopes at the positions its own domain covers, so those
  are selected with ``np.partition`` instead of a full sort (the fan-outs here reach thousands
  of children with ~1000-value domains each).
* A measured node adds ``weight*(v-noisy)**2`` (eq. 4a) on its domain intersected with the
  children's range; a sum of convex functions is convex (Theorem 3).
* Top-down (end of section 6): a root takes the smallest minimiser of its table; a node with
  value ``v`` gives its children the ``v - sum(lo_c)`` smallest slopes of the merged pool
  (ties in child order, so the result is deterministic); in the open case what remains after the
  negative slopes goes to the slack (``other``).

Domains and exactness
---------------------
The paper bounds each node's domain by a multiple of the noise variance (footnote to section
11.2). Here the caller passes ``spread`` (e.g. 3 noise standard deviations): the domain of a
measured node starts as ``[max(0, floor(noisy - spread)), max(ceil(noisy + spread), lo + 1)]``.
The upper bound and a positive lower bound are *artificial* (not constraints of the problem);
0 and public values (``fixed``) are real. Such a box makes the DP fast but could cut off the
optimum, so after each pass any node sitting on an artificial bound gets that bound widened
(its width on that side doubled) and its tree is solved again, until no node is on one.

Why the final answer is the global optimum of the unboxed problem: write every node value as the
sum of the *atoms* of its subtree (the leaf values and the slacks of open nodes; unmeasured
closed leaves are the constant 0). The objective plus the indicators of the constraints is then
a sum of univariate convex functions of subset sums over a laminar family (each node's subtree,
including the ``v_i == fixed_i`` and artificial-box constraints), i.e. a laminar convex
function, which is M-natural-convex (Murota, *Discrete Convex Analysis*, SIAM 2003, ch. 6).
For an M-natural-convex function a point is a global minimiser as soon as no exchange
``x + e_j - e_k`` or ``x +- e_j`` improves it (the M-optimality criterion, same chapter;
``tests/test_consistency.py`` checks exactly this neighbourhood). Such a move changes every
node value by at most 1, so from a box optimum that is strictly inside every artificial bound
all these moves stay inside the box; the box optimum therefore beats all of them and is the
global optimum of the problem without the box.

Infeasibility inside a pass is repaired, not reported: if a measured node's box misses the range
its children can reach, its artificial bound is moved to meet it (the node then sits on that
bound and the next pass widens it); if a fixed node's value is out of its children's reach,
all its descendants' artificial bounds are widened and the tree is solved again. Real
infeasibility (e.g. nested public totals that cannot add up) is detected up front and raised as
``ValueError``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CostTable", "Solution", "solve", "convolve", "clamp_and_round"]

MAX_PASSES = 64

_EMPTY = np.zeros(0, dtype=np.float64)


@dataclass
class CostTable:
    """Discrete convex cost table (the paper's cost table, section 6; CPWL by Lemma 5).

    ``cost(lo) = base`` and ``cost(lo + j + 1) - cost(lo + j) = slopes[j]`` (non-decreasing).
    The domain is ``[lo, lo + len(slopes)]``, or ``[lo, infinity)`` with cost constant after the
    last slope when ``open_tail`` (only when all slopes are negative).
    """

    lo: int
    base: float
    slopes: np.ndarray
    open_tail: bool = False

    @property
    def hi(self) -> Optional[int]:
        """Largest value of the domain; ``None`` when the table is open-tailed."""
        return None if self.open_tail else self.lo + int(self.slopes.size)

    def values(self) -> np.ndarray:
        """Costs at ``lo, lo+1, ..., lo+len(slopes)`` (for an open tail, constant beyond)."""
        out = np.empty(self.slopes.size + 1, dtype=np.float64)
        out[0] = 0.0
        np.cumsum(self.slopes, out=out[1:])
        return out + self.base

    def value(self, v: int) -> float:
        """Cost at ``v``; ``inf`` outside the domain."""
        v = int(v)
        if v < self.lo or (not self.open_tail and v > self.lo + self.slopes.size):
            return math.inf
        j = min(v - self.lo, self.slopes.size)
        return float(self.base + self.slopes[:j].sum())

    def argmin(self) -> int:
        """Smallest minimiser: ``lo`` + number of strictly negative slopes."""
        return self.lo + int(np.searchsorted(self.slopes, 0.0, side="left"))


@dataclass
class Solution:
    values: np.ndarray  # int64, per node
    other: np.ndarray  # int64, v_i - sum of children (the slack of open nodes; 0 for leaves)
    objective: float
    iterations: int
    tables: Optional[list] = None


def clamp_and_round(noisy) -> np.ndarray:
    """The naive baseline: ``max(0, round(noisy))`` as int64 (NaN -> 0). Not consistent."""
    x = np.asarray(noisy, dtype=np.float64)
    return np.maximum(0.0, np.nan_to_num(np.rint(x), nan=0.0)).astype(np.int64)


# --------------------------------------------------------------------- min-plus convolution


def _select(pool: np.ndarray, a: int, b: int) -> Tuple[float, np.ndarray]:
    """Sum of the ``a`` smallest elements of ``pool`` and its ``a``..``b-1``-th smallest, sorted.

    ``np.partition`` places the a-th and b-th order statistics, so only ``b - a`` elements are
    sorted (Algorithm 1 sorts all of them; the values outside the node's domain are not needed).
    """
    n = pool.size
    if a >= n:
        return float(pool.sum()), _EMPTY
    if a == 0 and b >= n:
        return 0.0, np.sort(pool)
    kth = [a] if b >= n or b == a else [a, b]
    part = np.partition(pool, kth)
    return float(part[:a].sum()), np.sort(part[a:b])


def _merged_range(tables: Sequence[CostTable], open_: bool, a: int, b: int) -> Tuple[float, np.ndarray]:
    """Cost offset at position ``a`` and the slopes at positions ``[a, b)`` of the children's
    min-plus convolution (greedy slope merge, eq. 7), relative to ``sum(base)``.

    ``open_`` (a slack child, or an open-tailed child): only strictly negative slopes are
    merged, followed by zeros forever.
    """
    if not tables:
        pool = _EMPTY
    elif len(tables) == 1:
        pool = tables[0].slopes
    else:
        pool = np.concatenate([t.slopes for t in tables])
    if not open_:
        return _select(pool, a, b)
    neg = pool[pool < 0.0]
    k = neg.size
    if a >= k:
        return float(neg.sum()), np.zeros(b - a)
    bb = min(b, k)
    s, sl = _select(neg, a, bb)
    if bb < b:
        sl = np.concatenate([sl, np.zeros(b - bb)])
    return s, sl


def _is_open(tables: Sequence[CostTable], slack: bool) -> bool:
    return slack or any(t.open_tail for t in tables)


def convolve(tables: Sequence[CostTable], slack: bool = False) -> CostTable:
    """Min-plus convolution of convex cost tables (eq. 4b-4d via Algorithm 1 / eq. 7).

    ``result(v) = min { sum_c t_c(v_c) : sum_c v_c = v }`` over the tables' domains; with
    ``slack`` an extra free child with domain ``[0, inf)`` and zero cost is added (an open
    node). Convex in, convex out (Lemma 5). The empty convolution is the table ``{0: 0}``
    (``[0, inf)`` at cost 0 with ``slack``).
    """
    tables = list(tables)
    lo = int(sum(t.lo for t in tables))
    base = float(sum(t.base for t in tables))
    open_ = _is_open(tables, slack)
    if open_:  # the full table: every strictly negative slope, then flat
        total = sum(int(np.count_nonzero(t.slopes < 0.0)) for t in tables)
    else:
        total = sum(int(t.slopes.size) for t in tables)
    _, slopes = _merged_range(tables, open_, 0, total)
    return CostTable(lo, base, slopes, open_)


def _split(tables: Sequence[CostTable], slack: bool, m: int) -> Tuple[np.ndarray, int]:
    """Top-down step: distribute ``m = v - sum(lo_c)`` units over the children by taking the
    ``m`` smallest slopes of the merged pool (ties in child order). Returns the per-child
    increments and the amount left to the node's slack (its ``other``)."""
    k = len(tables)
    lens = np.fromiter((t.slopes.size for t in tables), dtype=np.int64, count=k)
    counts = np.zeros(k, dtype=np.int64)
    if m <= 0:
        return counts, 0
    pool = np.concatenate([t.slopes for t in tables]) if k > 1 else tables[0].slopes
    ids = np.repeat(np.arange(k), lens)
    if _is_open(tables, slack):
        neg = pool < 0.0
        nneg = int(np.count_nonzero(neg))
        if m >= nneg:
            counts += np.bincount(ids[neg], minlength=k)
            rest = m - nneg
            if rest and not slack:  # a closed node: the surplus goes to the first open-tailed child
                first = next(j for j, t in enumerate(tables) if t.open_tail)
                counts[first] += rest
                rest = 0
            return counts, rest
    elif m >= pool.size:
        if m > pool.size:
            raise AssertionError("value outside the children's range")
        return lens.copy(), 0
    t = np.partition(pool, m - 1)[m - 1]
    less = pool < t
    r = m - int(np.count_nonzero(less))
    eq = pool == t
    take = less | (eq & (np.cumsum(eq) <= r))
    counts += np.bincount(ids[take], minlength=k)
    return counts, 0


# --------------------------------------------------------------------------------- the solver


def _as_array(x, n, default, dtype, name):
    if x is None:
        return np.full(n, default, dtype=dtype)
    a = np.asarray(x, dtype=dtype)
    if a.ndim == 0:
        return np.full(n, a.item(), dtype=dtype)
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {a.shape}")
    return a.copy()


def _structure(parent: np.ndarray):
    """Depth and root of every node (pointer jumping), and children lists in index order."""
    n = parent.size
    depth = np.zeros(n, dtype=np.int64)
    root = np.arange(n, dtype=np.int64)
    cur = parent.copy()
    steps = 0
    while True:
        has = cur >= 0
        if not has.any():
            break
        steps += 1
        if steps > n:
            raise ValueError("parent contains a cycle")
        depth[has] += 1
        root[has] = cur[has]
        cur[has] = parent[cur[has]]
    order = np.argsort(parent, kind="stable")
    nroot = int(np.count_nonzero(parent < 0))
    kids = order[nroot:]
    starts = np.searchsorted(parent[kids], np.arange(n), side="left")
    ends = np.searchsorted(parent[kids], np.arange(n), side="right")
    children = [kids[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
    return depth, root, children


def _true_ranges(parent, depth, measured, open_, fixed, nchild):
    """Reachable ``[lo, hi]`` of every node without artificial bounds; raises if a public value
    cannot be met (real infeasibility of H2-H4)."""
    n = parent.size
    lo = np.zeros(n, dtype=np.float64)
    hi = np.zeros(n, dtype=np.float64)
    leaf = nchild == 0
    hi[leaf & (measured | open_)] = np.inf
    internal_open = (~leaf) & open_
    hi[internal_open] = np.inf
    clo = np.zeros(n)
    chi = np.zeros(n)
    for d in range(int(depth.max(initial=0)), -1, -1):
        at = np.flatnonzero(depth == d)
        inner = at[~leaf[at]]
        lo[inner] = clo[inner]
        hi[inner] = np.where(open_[inner], np.inf, chi[inner])
        f = fixed[at]
        isf = f >= 0
        bad = isf & ((f < lo[at]) | (f > hi[at]))
        if bad.any():
            raise ValueError(f"infeasible: public value of node {int(at[bad][0])} cannot be met")
        lo[at[isf]] = f[isf]
        hi[at[isf]] = f[isf]
        p = parent[at]
        has = p >= 0
        np.add.at(clo, p[has], lo[at[has]])
        np.add.at(chi, p[has], hi[at[has]])
    return lo, hi


def solve(parent, noisy, weight=None, spread=None, open=None, fixed=None, keep_tables=False) -> Solution:
    """Exact consistent non-negative integer estimate of a forest of noisy counts.

    Parameters (arrays of length n, scalars broadcast):
      parent: int, -1 for roots (any node order).
      noisy: float, NaN = unmeasured (no cost term).
      weight: float > 0 (default 1); cost of a measured node is ``weight * (v - noisy)**2``.
      spread: float > 0 (default 3): initial half-width of a measured node's domain, e.g.
        3 noise standard deviations (the paper's domain from the noise variance, sec. 11.2).
      open: bool (default False): ``v >= sum(children)`` (free slack) instead of equality.
        Ignored for measured leaves; an unmeasured leaf is 0 when closed and free ``>= 0``
        (cost 0, taking only what its parent needs) when open.
      fixed: int, -1 = none: public values the nodes must take (H2).
      keep_tables: also return every node's final :class:`CostTable`.

    Returns a :class:`Solution`. ``iterations`` counts the passes (bottom-up + top-down over the
    trees still unsettled), including re-solves after widening an artificial bound. Raises
    ``ValueError`` if the constraints cannot be met, ``RuntimeError`` after ``MAX_PASSES``.
    """
    parent = np.asarray(parent, dtype=np.int64).copy()
    if parent.ndim != 1:
        raise ValueError("parent must be one-dimensional")
    n = parent.size
    noisy = _as_array(noisy, n, np.nan, np.float64, "noisy")
    weight = _as_array(weight, n, 1.0, np.float64, "weight")
    spread = _as_array(spread, n, 3.0, np.float64, "spread")
    open_ = _as_array(open, n, False, bool, "open")
    fixed = _as_array(fixed, n, -1, np.int64, "fixed")
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return Solution(e, e.copy(), 0.0, 0, [] if keep_tables else None)
    if ((parent < -1) | (parent >= n)).any() or (parent == np.arange(n)).any():
        raise ValueError("parent entries must be -1 or another node's index")
    if np.isinf(noisy).any():
        raise ValueError("noisy must be finite or NaN")
    measured = ~np.isnan(noisy)
    if not (np.isfinite(weight[measured]).all() and (weight[measured] > 0).all()):
        raise ValueError("weight must be finite and > 0")
    if not (np.isfinite(spread[measured]).all() and (spread[measured] > 0).all()):
        raise ValueError("spread must be finite and > 0")
    if (fixed < -1).any():
        raise ValueError("fixed must be a non-negative value or -1")

    depth, root, children = _structure(parent)
    nchild = np.fromiter((c.size for c in children), dtype=np.int64, count=n)
    _true_ranges(parent, depth, measured, open_, fixed, nchild)

    boxed = measured & (fixed < 0)  # nodes with artificial bounds
    y = np.where(measured, noisy, 0.0)
    lo_b = np.zeros(n, dtype=np.int64)
    hi_b = np.zeros(n, dtype=np.int64)
    lo_b[boxed] = np.maximum(0.0, np.floor(y[boxed] - spread[boxed])).astype(np.int64)
    hi_b[boxed] = np.maximum(np.ceil(y[boxed] + spread[boxed]).astype(np.int64), lo_b[boxed] + 1)

    # per tree: nodes deepest first (bottom-up), ties by index; reversed for top-down
    key = np.lexsort((np.arange(n), -depth, root))
    roots = np.flatnonzero(parent < 0)
    rstart = np.searchsorted(root[key], roots, side="left")
    rend = np.searchsorted(root[key], roots, side="right")
    tree_nodes = {int(r): key[s:e] for r, s, e in zip(roots, rstart, rend)}

    values = np.zeros(n, dtype=np.int64)
    other = np.zeros(n, dtype=np.int64)
    tables: List[Optional[CostTable]] = [None] * n
    kept: List[Optional[CostTable]] = [None] * n

    def widen_hi(idx):
        hi_b[idx] = hi_b[idx] + np.maximum(1, np.ceil(hi_b[idx] - y[idx]).astype(np.int64))

    def widen_lo(idx):
        lo_b[idx] = np.maximum(0, lo_b[idx] - np.maximum(1, np.ceil(y[idx] - lo_b[idx]).astype(np.int64)))

    def descendants(i, nodes):
        # nodes of i's tree whose ancestor chain passes through i
        cur = parent[nodes].copy()
        inside = np.zeros(nodes.size, dtype=bool)
        while True:
            inside |= cur == i
            live = cur >= 0
            if not live.any():
                return nodes[inside]
            cur[live] = parent[cur[live]]

    def bottom_up(nodes) -> bool:
        for i in nodes.tolist():
            ch = children[i]
            meas = measured[i]
            f = int(fixed[i])
            if ch.size == 0:
                if f >= 0:
                    lo_i, hi_i = f, f
                elif meas:
                    lo_i, hi_i = int(lo_b[i]), int(hi_b[i])
                else:  # unmeasured leaf: 0, or free when open
                    tables[i] = CostTable(0, 0.0, _EMPTY, bool(open_[i]))
                    continue
                base, sl = 0.0, np.zeros(hi_i - lo_i)
            else:
                ct = [tables[c] for c in ch.tolist()]
                slack = bool(open_[i])
                opn = _is_open(ct, slack)
                lo_c = sum(t.lo for t in ct)
                hi_c = None if opn else lo_c + sum(int(t.slopes.size) for t in ct)
                if f >= 0:
                    if f < lo_c or (hi_c is not None and f > hi_c):
                        sub = descendants(i, nodes)
                        sub = sub[boxed[sub]]
                        if f < lo_c:
                            sub = sub[lo_b[sub] > 0]
                            widen_lo(sub)
                        else:
                            widen_hi(sub)
                        if sub.size == 0:  # unreachable after _true_ranges
                            raise ValueError(f"infeasible: public value of node {i} cannot be met")
                        return False
                    lo_i, hi_i = f, f
                elif meas:
                    if hi_c is not None and lo_b[i] > hi_c:
                        lo_b[i] = hi_c  # move the artificial bound to meet the children's range
                    if hi_b[i] < lo_c:
                        hi_b[i] = lo_c
                    lo_i = max(int(lo_b[i]), lo_c)
                    hi_i = int(hi_b[i]) if hi_c is None else min(int(hi_b[i]), hi_c)
                else:
                    tables[i] = convolve(ct, slack)
                    continue
                off, sl = _merged_range(ct, opn, lo_i - lo_c, hi_i - lo_c)
                base = float(sum(t.base for t in ct)) + off
            if meas:  # eq. 4a on [lo_i, hi_i]
                w, yi = float(weight[i]), float(y[i])
                base += w * (lo_i - yi) ** 2
                sl = sl + w * (2.0 * (np.arange(lo_i, hi_i, dtype=np.float64) - yi) + 1.0)
            tables[i] = CostTable(lo_i, base, sl, False)
        return True

    def top_down(nodes):
        for i in nodes[::-1].tolist():
            if parent[i] < 0:
                values[i] = tables[i].argmin()
            ch = children[i]
            if ch.size == 0:
                continue
            ct = [tables[c] for c in ch.tolist()]
            lo_c = sum(t.lo for t in ct)
            inc, rest = _split(ct, bool(open_[i]), int(values[i]) - lo_c)
            values[ch] = np.fromiter((t.lo for t in ct), dtype=np.int64, count=len(ct)) + inc
            other[i] = rest

    pending = [int(r) for r in roots]
    passes = 0
    while pending:
        passes += 1
        if passes > MAX_PASSES:
            raise RuntimeError(f"consistency: no exact solution after {MAX_PASSES} passes")
        still = []
        for r in pending:
            nodes = tree_nodes[r]
            if not bottom_up(nodes):
                still.append(r)
                continue
            top_down(nodes)
            b = nodes[boxed[nodes]]
            v = values[b]
            at_hi = b[v == hi_b[b]]
            at_lo = b[(v == lo_b[b]) & (lo_b[b] > 0)]
            if at_hi.size or at_lo.size:
                widen_hi(at_hi)
                widen_lo(at_lo)
                still.append(r)
            elif keep_tables:
                for i in nodes.tolist():
                    kept[i] = tables[i]
            for i in nodes.tolist():
                tables[i] = None
        pending = still

    d = values[measured] - noisy[measured]
    objective = float(np.sum(weight[measured] * d * d))
    return Solution(values, other, objective, passes, kept if keep_tables else None)
