"""Budgets and thresholds of the fully dynamic counter (Qiu & Yi, *Differential Privacy on Dynamic
Data*, sections 3.2 and 4; docs/privacy.md, "Dynamic counts"). Every formula of the dynamic agent lives here.

All mechanisms of the dynamic agent add (discrete) Laplace noise, so it is pure epsilon-DP; the
declared delta is not spent (reported as 0). The budget is split between

* infinite private partitioning (Algorithm 2), ``epsilon_partition = partition_share * epsilon``:
  SVT instance j has threshold ``theta_j = (7 / eps_p) ln(2 T_j / beta_j)``,
  ``beta_j = 6 beta / (pi^2 j^2)``, ``T_1 = 2`` and ``T_{j+1} = t_j^2``; Theorem 6 (adaptive
  parallel composition) makes the whole partitioning eps_p-DP;
* the counts, ``epsilon_counts = epsilon - epsilon_partition``:
  - ``interval_tree``: a node at level l of the online interval tree gets
    ``eps(v) = 6 eps_c / (pi^2 l^2)`` (section 4.3; an update changes the input of at most one
    node per level, and sum_l 6 / (pi^2 l^2) = 1); within a node, round r of Algorithm 3 gives
    each of its four mechanisms ``eps_r = 3 eps(v) / (2 pi^2 r^2)`` (4 sum_r eps_r = eps(v)) and
    ``beta_r = beta / (pi^2 r^2)``. The node's two deletion counters are calibrated to
    sensitivity :data:`TREE_DELETION_SENSITIVITY` = 2, its size and histogram to 1;
  - ``baseline``: two insertion-only counters (inserts, deletes); every update of a declared
    item is in exactly one of them, so each gets the whole eps_c (parallel composition).

The neighbour relation is one update, added or removed, on any stream (valid or not: a delete
may name an item that is not present). The partitioner and the baseline take in every update,
so one update changes their input in exactly one update. The interval tree matches a delete to
its item's newest live instance, which depends on the other updates; docs/privacy.md, "Dynamic
counts", proves that one update then changes at most one node per level, and a node's live count
by one over one window of segments: at most 1 in its size and histogram at a round's start and
at most 2 (the window's two ends) in its deletion counters' input, hence their sensitivity 2.

The insertion-only counters follow Chan, Shi, Song (the paper's [5], section 2.3): blocks
[2^b, 2^{b+1}) of steps, each block's total released with eps/2, and inside block b a binary
tree of b + 1 levels sharing the other eps/2.

Range counts through multiplicative weights (``static_release: mwem_ranges``; the paper's
Appendix A.1, PMW; Hardt, Ligett and McSherry's MWEM): a static release of a histogram over the
ordered items, answering every range [a, b] of them. Of its epsilon, :data:`MWEM_SIZE_SHARE`
protects its noisy size, and each of its :data:`MWEM_ROUNDS` rounds spends the rest in halves on
selecting a badly answered range (report noisy max with discrete Laplace noise of scale
``2 / eps_select``: a range's error score moves by at most 1 between neighbours, up or down) and
on measuring it (scale ``1 / eps_measure``). Basic composition: the parts add up to epsilon.
With it, an insertion-only counter becomes the same block/tree construction with a static
release at each node (:func:`insertion_only_epsilons`), Algorithm 3's Q-Ins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

PI2 = math.pi ** 2


def svt_beta(beta: float, j: int) -> float:
    """Failure probability of the j-th SVT instance (Algorithm 2): 6 beta / (pi^2 j^2)."""
    return 6.0 * beta / (PI2 * j * j)


def svt_threshold(eps_partition: float, horizon: float, beta_j: float) -> float:
    """theta_j = (7 / eps) ln(2 T_j / beta_j) (Algorithm 2)."""
    return 7.0 / eps_partition * math.log(2.0 * horizon / beta_j)


def svt_scales(eps_partition: float) -> tuple[float, float]:
    """Laplace scales of SVT (Algorithm 1): threshold 2/eps, each query 4/eps."""
    return 2.0 / eps_partition, 4.0 / eps_partition


def level_epsilon(eps_counts: float, level: int) -> float:
    """eps(v) = 6 eps / (pi^2 l^2) for a node at level l >= 1 (section 4.3)."""
    return 6.0 * eps_counts / (PI2 * level * level)


def round_epsilon(eps_node: float, r: int) -> float:
    """eps_r = 3 eps(v) / (2 pi^2 r^2), each of Algorithm 3's four mechanisms in round r."""
    return 3.0 * eps_node / (2.0 * PI2 * r * r)


def round_beta(beta: float, r: int) -> float:
    """beta_r = beta / (pi^2 r^2) (Algorithm 3)."""
    return beta / (PI2 * r * r)


#: L1 sensitivity of the input of an interval-tree node's two deletion counters (Q-Ins and
#: Lap-Ins of Algorithm 3) to one update of the stream: the window of segments over which the
#: node's live count differs has two ends, each one deletion more or less (docs/privacy.md,
#: "Dynamic counts"). The node's noisy size and static histogram see at most 1.
TREE_DELETION_SENSITIVITY = 2


def counter_scales(eps: float, step: int, sensitivity: int = 1) -> tuple[float, float]:
    """Laplace scales of the insertion-only counter at step >= 1 whose input (the sequence of
    its increments) changes by at most ``sensitivity`` in L1 between neighbours: a block total
    gets scale 2 sensitivity / eps; a node of block b's tree (b + 1 levels) gets
    2 sensitivity (b + 1) / eps."""
    b = step.bit_length() - 1
    return 2.0 * sensitivity / eps, 2.0 * sensitivity * (b + 1) / eps


def discrete_laplace_tail(scale: float, failure: float) -> int:
    """Smallest m with P[|X| > m] <= failure for X discrete Laplace, P[x] ~ exp(-|x| / scale):
    P[|X| > m] = 2 q^(m+1) / (1 + q), q = exp(-1 / scale)."""
    if scale <= 0 or 1.0 / scale > 700:  # q underflows: the noise is 0 except w.p. < e^-700
        return 0
    q = math.exp(-1.0 / scale)
    m = math.log(failure * (1 + q) / 2.0) / math.log(q) - 1
    return max(0, math.ceil(m))


@dataclass(frozen=True)
class DynamicPlan:
    epsilon: float
    delta: float
    beta: float
    partition_share: float
    mechanism: str
    #: the static release at the interval tree's nodes, or at the baseline's counter nodes:
    #: ``histogram`` (Laplace per item) or ``mwem_ranges`` (:class:`MwemBudget`)
    static_release: str = "histogram"

    @property
    def epsilon_partition(self) -> float:
        return self.partition_share * self.epsilon

    @property
    def epsilon_counts(self) -> float:
        return self.epsilon - self.epsilon_partition

    @property
    def epsilon_spent(self) -> float:
        return self.epsilon_partition + self.epsilon_counts

    @property
    def delta_spent(self) -> float:
        return 0.0

    def to_dict(self) -> dict:
        first = svt_threshold(self.epsilon_partition, 2, svt_beta(self.beta, 1))
        return {
            "mechanism": self.mechanism, "epsilon": self.epsilon, "delta": self.delta, "beta": self.beta,
            "epsilon_partition": self.epsilon_partition, "epsilon_counts": self.epsilon_counts,
            "epsilon_spent": self.epsilon_spent, "delta_spent": self.delta_spent,
            "first_svt_threshold": first,
            # the interval tree's per-node deletion counters are calibrated to this sensitivity
            # (a delete's match depends on other updates: docs/privacy.md, "Dynamic counts")
            "deletion_counter_sensitivity": TREE_DELETION_SENSITIVITY if self.mechanism == "interval_tree" else None,
            "node_epsilon_by_level": [level_epsilon(self.epsilon_counts, lvl) for lvl in range(1, 9)]
            if self.mechanism == "interval_tree" else None,
            # (None for the histogram: the plans written before static releases had a choice)
            "static_release": None if self.static_release == "histogram" else self.static_release,
            "mwem": {"rounds": MWEM_ROUNDS, "size_share": MWEM_SIZE_SHARE} if self.static_release == "mwem_ranges" else None,
        }


#: share of an MWEM release's epsilon spent on its noisy size (the synthetic histogram's mass)
MWEM_SIZE_SHARE = 0.1
#: rounds of an MWEM release: a public constant (the error-optimal number grows with the data
#: size, which is private; 8 is near it for the sizes docs/benchmarks.md measures)
MWEM_ROUNDS = 8


@dataclass(frozen=True)
class MwemBudget:
    """How one MWEM release of epsilon ``eps`` spends it (module docstring): the parts add up to
    eps (basic composition of pure-DP steps)."""

    eps: float
    rounds: int = MWEM_ROUNDS

    @property
    def eps_size(self) -> float:
        return MWEM_SIZE_SHARE * self.eps

    @property
    def eps_select(self) -> float:
        return (1.0 - MWEM_SIZE_SHARE) * self.eps / (2 * self.rounds)

    @property
    def eps_measure(self) -> float:
        return (1.0 - MWEM_SIZE_SHARE) * self.eps / (2 * self.rounds)

    @property
    def size_scale(self) -> float:
        return 1.0 / self.eps_size

    @property
    def select_scale(self) -> float:
        """Report noisy max over error scores of sensitivity 1 that can move either way: the
        winner's margin moves by up to 2, so scale 2 / eps (docs/privacy.md, "Range counts")."""
        return 2.0 / self.eps_select

    @property
    def measure_scale(self) -> float:
        return 1.0 / self.eps_measure

    @property
    def spent(self) -> float:
        return self.eps_size + self.rounds * (self.eps_select + self.eps_measure)


def insertion_only_epsilons(eps: float, step: int, sensitivity: int = 1) -> tuple[float, float]:
    """The epsilon of a static release at a node of an insertion-only counter whose input changes by
    at most ``sensitivity`` updates (group privacy): a block total's ``eps / (2 sensitivity)``, a
    node of block b's tree ``eps / (2 sensitivity (b + 1))``. For the Laplace histogram these are
    the reciprocals of :func:`counter_scales`."""
    b = step.bit_length() - 1
    return eps / (2.0 * sensitivity), eps / (2.0 * sensitivity * (b + 1))


def pmw_error(size: float, eps: float, domain: int, queries: int, beta: float) -> float:
    """The paper's Appendix A.1 bound for PMW/MWEM with delta = 0, without its constant:
    ``|D|^(2/3) (log |X| log(|Q| / beta) / eps)^(1/3)``, the shape the benchmark compares the
    measured error with (docs/benchmarks.md, "Where the interval tree earns its place")."""
    return max(size, 1.0) ** (2.0 / 3.0) * (math.log(domain) * math.log(queries / beta) / eps) ** (1.0 / 3.0)
