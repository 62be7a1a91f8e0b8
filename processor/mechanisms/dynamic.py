"""DP counts over a fully dynamic (insert/delete) stream: Qiu & Yi, *Differential Privacy on
Dynamic Data* (papers/dp-on-dynamic-data-online-interval-tree.txt), sections 2-4 and Algorithm 3.

Pure: no I/O. Every budget and threshold comes from :mod:`dpstream.accountant.dynamic`. Every noise value
is a keyed PRF of its position (:class:`DynamicNoise`), so replaying the same updates with the
same secret gives identical outputs, which is how the agent recovers its state.

Time is ticks (the paper's timestamps t = 1, 2, ...): each update carries its tick, several
updates may share one, and ticks without updates are the paper's empty steps (x_t = bottom), at
which SVT still draws. Neighbouring streams differ by one update; every other update keeps its
tick. (:meth:`DynamicCounter.update` gives each update its own new tick, for benchmarks.)
Any update of a declared item is taken in, whatever the others are: a delete of an item that is
not present is counted by the partitioner and the baseline's delete counter like any other, and
the interval tree finds no instance for it (docs/privacy.md, "Dynamic counts").
The pieces:

* :class:`PrivatePartitioner` - Algorithm 2: SVT instances with thresholds theta_j over the count
  of updates since the last segment closed; a segment closes when SVT fires or t >= T_j.
* :class:`InsertionOnlyCounter` - the continual counter the paper feeds segments to (Theorem 8,
  after Chan, Shi, Song): noisy totals of blocks [2^b, 2^{b+1}) plus a dyadic tree inside the
  current block. Laplace noise, not the DP-SQLP engine's discrete Gaussian trees: SVT and the
  paper's accounting are pure epsilon-DP with Laplace, and a node's tree restarts every round
  with its own budget, so the Gaussian engine's per-key tree layout does not fit.
* :class:`OnlineIntervalTree` - section 4.1: node v_i is built when segment s_i closes, holding
  the live items inserted after its closest left ancestor (``i & (i - 1)``); a query at segment
  q reads v_q and its left ancestors - the prefixes of q's binary form - which cover each live
  item exactly once (Lemma 9). Only those nodes can be read again, so only they are kept.
* :class:`NodeMechanism` - Algorithm 3 at one node: a noisy size, a static release of the item
  histogram (pluggable: ``static_release``), two insertion-only counters over the node's
  deletions, and a restart with fresh budget when about half its items are gone.
* :class:`DynamicCounter` - partitioning plus either the interval tree or the baseline (two
  insertion-only counters, inserts minus deletes), publishing per-item counts at each segment.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from dpstream.accountant.dynamic import (
    TREE_DELETION_SENSITIVITY,
    DynamicPlan,
    counter_scales,
    discrete_laplace_tail,
    level_epsilon,
    round_beta,
    round_epsilon,
    svt_beta,
    svt_scales,
    svt_threshold,
)
from dpstream.processor.mechanisms import discrete_laplace
from dpstream.processor.mechanisms.linear_queries import InsertionOnlyRelease, mwem_ranges
from dpstream.processor.mechanisms.noise import NodeNoise, TreeIdentity

NOISE_CHUNK = 4096
FIRST_CHUNK = 16


class DynamicNoise:
    """Discrete Laplace noise (P[x] ~ exp(-|x| / scale), every integer possible) as a keyed PRF of
    (label, index), sampled exactly (:mod:`dpstream.processor.mechanisms.discrete_laplace`: Canonne, Kamath and
    Steinke 2020, Algorithms 1 and 2) from the words of :meth:`NodeNoise.uniforms`. Integer
    arithmetic only, so the mechanisms are pure epsilon-DP as the accountant reports; the value
    at an index does not depend on how draws are batched. ``noise=None`` gives zeros (for
    structural tests)."""

    def __init__(self, noise: Optional[NodeNoise], query: str):
        self.noise = noise
        self.query = query

    def laplace(self, scale: float, label: str, count: int, start: int = 0) -> np.ndarray:
        if self.noise is None or count == 0:
            return np.zeros(count, dtype=np.int64)
        trees: dict = {}

        def words(page: int, high: int, nodes: np.ndarray):
            key = (page, high)
            if key not in trees:
                name = label if key == (0, 0) else f"{label}#page{page}#high{high}"
                trees[key] = self.noise.tree_id(TreeIdentity(self.query, 0, name, "dynamic"))
            return self.noise.uniforms_indexed(np.array([trees[key]]), np.zeros(len(nodes), dtype=np.int64), nodes)

        return discrete_laplace.sample(words, scale, np.arange(start, start + count, dtype=np.int64))


# ---------------------------------------------------------------------- insertion-only counter
class InsertionOnlyCounter:
    """Continual sum of vectors fed once per step, eps-DP when neighbouring inputs (sequences of
    increments) differ by at most ``sensitivity`` in L1 (1: one update).

    Released value at step k = exact prefix sum + the noise of the nodes that cover [1, k]: the
    noisy totals of the completed blocks [2^b, 2^{b+1}) (scale 2 sensitivity / eps) and the
    dyadic nodes of the current block's prefix (scale 2 sensitivity (b + 1) / eps). Node noises
    are PRF values of the node's position, so the same node always carries the same noise."""

    def __init__(self, eps: float, dims: int, noise: DynamicNoise, label: str, sensitivity: int = 1):
        self.eps, self.dims, self.noise, self.label, self.sensitivity = eps, dims, noise, label, sensitivity
        self.step = 0
        self.exact = np.zeros(dims, dtype=np.int64)

    def feed(self, increment: Optional[np.ndarray] = None) -> None:
        self.step += 1
        if increment is not None:
            self.exact += increment

    def snapshot(self) -> dict:
        """Its state: the step and the exact sums (node noises are PRF values: not state)."""
        return {"step": self.step, "exact": self.exact.copy()}

    def restore(self, state: dict) -> None:
        self.step, self.exact = int(state["step"]), np.array(state["exact"], dtype=np.int64)

    def _nodes(self) -> list[tuple[float, str]]:
        """(scale, label) of every noisy node read by the release at the current step."""
        k = self.step
        if k == 0:
            return []
        b = k.bit_length() - 1
        total_scale, node_scale = counter_scales(self.eps, k, self.sensitivity)
        nodes = [(total_scale, f"{self.label}:block{c}") for c in range(b)]
        length, offset = k - (1 << b) + 1, 0
        for level in range(b, -1, -1):
            size = 1 << level
            if length & size:
                nodes.append((node_scale, f"{self.label}:b{b}:l{level}:i{offset // size}"))
                offset += size
        return nodes

    def scales(self) -> list[float]:
        """Public discrete Laplace scales of the nodes the release at the current step reads (one
        independent draw each per coordinate): the noise of a coordinate is their sum."""
        return [scale for scale, _ in self._nodes()]

    def estimate(self) -> np.ndarray:
        out = self.exact.astype(np.float64)
        for scale, label in self._nodes():
            out += self.noise.laplace(scale, label, self.dims)
        return out

    def bound(self, failure: float) -> float:
        """Public bound on one coordinate's noise at this step, exceeded with probability <=
        failure (union bound over the nodes read)."""
        nodes = self._nodes()
        return float(sum(discrete_laplace_tail(scale, failure / len(nodes)) for scale, _ in nodes)) if nodes else 0.0


# ---------------------------------------------------------------------- private partitioning
class PrivatePartitioner:
    """Algorithm 2 (infinite private partitioning). :meth:`advance` consumes updates and returns
    the positions t at which segments close."""

    def __init__(self, eps: float, beta: float, noise: DynamicNoise):
        self.eps, self.beta, self.noise = eps, beta, noise
        self.threshold_scale, self.query_scale = svt_scales(eps)
        self.t = 0  # last decided tick
        self.count = 0  # updates since the open segment started
        self.j = 0
        self._open_instance(horizon=2)

    def _open_instance(self, horizon: int) -> None:
        self.j += 1
        self.start = self.t
        self.horizon = horizon
        self.theta = svt_threshold(self.eps, horizon, svt_beta(self.beta, self.j))
        self.noisy_theta = self.theta + float(self.noise.laplace(self.threshold_scale, f"svt{self.j}:threshold", 1)[0])

    _STATE = ("t", "count", "j", "start", "horizon", "theta", "noisy_theta")

    def snapshot(self) -> dict:
        """Its state: the open SVT instance and how far it has decided."""
        return {name: getattr(self, name) for name in self._STATE}

    def restore(self, state: dict) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])

    def advance(self, counts) -> list[int]:
        """Decide the next ticks: ``counts[k]`` updates arrived at tick t + 1 + k (an int n means
        n ticks of one update each). Returns the ticks at which segments closed."""
        counts = np.ones(counts, dtype=np.int64) if isinstance(counts, (int, np.integer)) else np.asarray(counts, dtype=np.int64)
        closes, pos, n = [], 0, len(counts)
        chunk = FIRST_CHUNK
        while pos < n:
            # draw noise only as far as this instance can run: a short chunk first (instances
            # often close soon), doubling while nothing fires, never past the forced close at the
            # horizon. A value depends only on its position, so chunking changes nothing.
            m = max(1, min(chunk, NOISE_CHUNK, n - pos, self.horizon - self.t))
            chunk *= 2
            steps = np.arange(self.t + 1, self.t + m + 1, dtype=np.int64)
            running = self.count + np.cumsum(counts[pos:pos + m])  # updates since the segment opened
            noise = self.noise.laplace(self.query_scale, f"svt{self.j}:queries", m, start=int(self.t - self.start))
            fire = (running + noise > self.noisy_theta) | (steps >= self.horizon)
            hits = np.nonzero(fire)[0]
            if not len(hits):
                self.t += m
                self.count = int(running[-1])
                pos += m
                continue
            k = int(hits[0])
            self.t = int(steps[k])
            pos += k + 1
            closes.append(self.t)
            self.count = 0
            self._open_instance(horizon=self.t * self.t)
            chunk = FIRST_CHUNK
        return closes


# ---------------------------------------------------------------------- Algorithm 3 at a node
def noisy_histogram(counts: np.ndarray, eps: float, noise: DynamicNoise, label: str) -> np.ndarray:
    """Default static mechanism: the item histogram plus Laplace(1/eps) per item (an update
    changes one count by one: L1 sensitivity 1)."""
    return counts.astype(np.float64) + noise.laplace(1.0 / eps, label, len(counts))


StaticRelease = Callable[[np.ndarray, float, DynamicNoise, str], np.ndarray]

#: the static releases a dynamic query can name (``static_release``), each eps-DP for a histogram
#: whose neighbour differs by one in one item: the extension point's one home
STATIC_RELEASES: dict[str, StaticRelease] = {"histogram": noisy_histogram, "mwem_ranges": mwem_ranges}


def insertion_only(eps: float, dims: int, noise: DynamicNoise, label: str, static_release: StaticRelease,
                   sensitivity: int = 1):
    """An insertion-only mechanism for what ``static_release`` answers (Algorithm 3's Q-Ins, and the
    baseline's two counters): for the Laplace histogram its own counter (:class:`InsertionOnlyCounter`,
    whose noise is known and drawn lazily), for any other the same block/tree construction with
    that release at each node (:class:`InsertionOnlyRelease`)."""
    if static_release is noisy_histogram:
        return InsertionOnlyCounter(eps, dims, noise, label, sensitivity)
    return InsertionOnlyRelease(eps, dims, noise, label, static_release, sensitivity)


class NodeMechanism:
    """Algorithm 3 at node v_i (section 4.2), with node budget eps(v) (section 4.3). Its size and
    static histogram have sensitivity 1; its two deletion counters are calibrated to
    :data:`TREE_DELETION_SENSITIVITY` (which instance a delete removes depends on other updates:
    docs/privacy.md, "Dynamic counts")."""

    def __init__(self, index: int, level: int, members: dict[int, int], eps_node: float, beta: float, dims: int,
                 noise: DynamicNoise, label: str, static_release: StaticRelease = noisy_histogram):
        self.index, self.level, self.eps_node, self.beta, self.dims = index, level, eps_node, beta, dims
        self.noise, self.label, self.static_release = noise, label, static_release
        self.members = dict(members)  # instance id -> item, live items of the current round
        self.halted = False
        self.restarts = 0
        self.initial_size = len(members)
        self.r = 0
        self._start_round(check_termination=False)

    def _histogram(self) -> np.ndarray:
        return np.bincount(np.fromiter(self.members.values(), dtype=np.int64, count=len(self.members)), minlength=self.dims)

    def _start_round(self, check_termination: bool) -> None:
        self.r += 1
        self.eps_r = round_epsilon(self.eps_node, self.r)
        self.beta_r = round_beta(self.beta, self.r)
        tag = f"{self.label}:r{self.r}"
        self.n_tilde = len(self.members) + float(self.noise.laplace(1.0 / self.eps_r, f"{tag}:size", 1)[0])
        sens = TREE_DELETION_SENSITIVITY
        self.q_ins = insertion_only(self.eps_r, self.dims, self.noise, f"{tag}:q-ins", self.static_release, sens)
        self.lap_ins = InsertionOnlyCounter(self.eps_r, 1, self.noise, f"{tag}:lap-ins", sens)
        if check_termination:
            # gamma of the fresh Lap-Ins counter at its first step, with probability 1 - beta_r
            probe = InsertionOnlyCounter(self.eps_r, 1, self.noise, f"{tag}:lap-ins", sens)
            probe.step = 1
            if self.n_tilde < 2 * probe.bound(self.beta_r):
                self.halted = True  # line 23: answer 0 from now on
                return
        self.base = self.static_release(self._histogram(), self.eps_r, self.noise, f"{tag}:static")

    def step(self, deleted: list[int]) -> None:
        """One later segment: ``deleted`` are instance ids deleted in it (any ids; members only
        count). Lines 6-26."""
        if self.halted:
            return
        inc = np.zeros(self.dims, dtype=np.int64)
        gone = 0
        for iid in deleted:
            item = self.members.pop(iid, None)
            if item is not None:
                inc[item] += 1
                gone += 1
        self.q_ins.feed(inc if gone else None)
        self.lap_ins.feed(np.array([gone]) if gone else None)
        n_del = float(self.lap_ins.estimate()[0])
        gamma = self.lap_ins.bound(self.beta_r)
        if n_del > self.n_tilde / 2 + 2 * gamma:  # line 18: restart with the remaining items
            self.restarts += 1
            self._start_round(check_termination=True)

    def answer(self) -> np.ndarray:
        if self.halted:
            return np.zeros(self.dims)
        return self.base - self.q_ins.estimate()

    def snapshot(self) -> dict:
        """Its state: members, round, decisions taken, the round's noisy size and static release
        (kept, not recomputed: the histogram it was taken of is gone) and its two counters."""
        # in id order: the members dict is filled from sets, whose order depends on their history,
        # and one state should give one snapshot, byte for byte
        ids = np.array(sorted(self.members), dtype=np.int64)
        items = np.fromiter((self.members[i] for i in ids.tolist()), dtype=np.int32, count=len(ids))
        state = {"index": self.index, "ids": ids, "items": items, "halted": self.halted, "restarts": self.restarts,
                 "initial_size": self.initial_size, "r": self.r, "n_tilde": self.n_tilde}
        if not self.halted:
            state.update(base=np.asarray(self.base, dtype=np.float64), q_ins=self.q_ins.snapshot(), lap_ins=self.lap_ins.snapshot())
        return state

    @classmethod
    def restored(cls, state: dict, eps_node: float, beta: float, dims: int, noise: DynamicNoise,
                 static_release: StaticRelease) -> "NodeMechanism":
        node = cls.__new__(cls)
        node.index, node.level = int(state["index"]), interval_tree_level(int(state["index"]))
        node.eps_node, node.beta, node.dims, node.noise, node.static_release = eps_node, beta, dims, noise, static_release
        node.label = f"node{node.index}"
        node.members = dict(zip(np.asarray(state["ids"]).tolist(), np.asarray(state["items"]).tolist()))
        node.halted, node.restarts, node.initial_size = bool(state["halted"]), int(state["restarts"]), int(state["initial_size"])
        node.r, node.n_tilde = int(state["r"]), float(state["n_tilde"])
        node.eps_r, node.beta_r = round_epsilon(eps_node, node.r), round_beta(beta, node.r)
        tag, sens = f"{node.label}:r{node.r}", TREE_DELETION_SENSITIVITY
        node.q_ins = insertion_only(node.eps_r, dims, noise, f"{tag}:q-ins", static_release, sens)
        node.lap_ins = InsertionOnlyCounter(node.eps_r, 1, noise, f"{tag}:lap-ins", sens)
        if not node.halted:
            node.base = np.array(state["base"], dtype=np.float64)
            node.q_ins.restore(state["q_ins"])
            node.lap_ins.restore(state["lap_ins"])
        return node

    def noise_scales(self) -> Optional[list[float]]:
        """Discrete Laplace scales of the independent draws in one item's :meth:`answer`: the
        static release's ``1 / eps_r`` and the deletion counter's nodes. They depend on the round
        r (how often the node restarted), on the counter's step and on whether the node halted:
        decisions taken on the node's noisy size and deletion count, so privatized, not public
        constants (docs/privacy.md, "Error bars"). A halted node answers 0 with no noise (its items
        are then missing: a bias, not noise). None for a static release other than
        :func:`noisy_histogram`, whose noise this does not know."""
        if self.static_release is not noisy_histogram:
            return None  # (even when halted: such a release never carries intervals)
        if self.halted:
            return []
        return [1.0 / self.eps_r] + self.q_ins.scales()


# ---------------------------------------------------------------------- online interval tree
def interval_tree_level(index: int) -> int:
    """Level of node v_i in the in-order numbered tree: leaves (odd i) are level 1."""
    return (index & -index).bit_length()


def query_nodes(q: int) -> list[int]:
    """v_q and its left ancestors: the prefixes of q's binary form (section 4.1.2)."""
    out = []
    while q:
        out.append(q)
        q &= q - 1
    return out


@dataclass
class Instance:
    item: int
    segment: int  # segment whose close inserted it (the open segment until then)


class OnlineIntervalTree:
    """Section 4.1 with Algorithm 3 at every node; :meth:`close_segment` returns the answer."""

    def __init__(self, plan: DynamicPlan, dims: int, noise: DynamicNoise, static_release: StaticRelease = noisy_histogram):
        self.plan, self.dims, self.noise, self.static_release = plan, dims, noise, static_release
        self.nodes: dict[int, NodeMechanism] = {}
        self.by_segment: dict[int, set[int]] = defaultdict(set)  # live instance ids by insertion segment
        self.stats = {"nodes_built": 0, "restarts": [], "max_members": 0}

    def close_segment(self, j: int, live: dict[int, Instance], inserted: list[int], deleted: list[tuple[int, int]]) -> np.ndarray:
        """Segment j closed: ``inserted`` instance ids are new and live; ``deleted`` are (id,
        insertion segment) of older instances deleted in it (same-segment pairs never get here)."""
        for iid, segment in deleted:
            self.by_segment[segment].discard(iid)
        deleted = [iid for iid, _ in deleted]
        for node in self.nodes.values():  # Algorithm 3, line 6: every node sees every later segment
            node.step(deleted)
        for iid in inserted:
            self.by_segment[j].add(iid)
        lo = j & (j - 1)  # closest left ancestor; 0: none (left-most path)
        members = {iid: live[iid].item for s in range(lo + 1, j + 1) for iid in self.by_segment.get(s, ())}
        level = interval_tree_level(j)
        eps_v = level_epsilon(self.plan.epsilon_counts, level)
        self.nodes[j] = NodeMechanism(j, level, members, eps_v, self.plan.beta, self.dims, self.noise, f"node{j}",
                                      self.static_release)
        self.stats["nodes_built"] += 1
        self.stats["max_members"] = max(self.stats["max_members"], len(members))
        keep = set(query_nodes(j))
        for index in [i for i in self.nodes if i not in keep]:  # never read again
            self.stats["restarts"].append((self.nodes[index].initial_size, self.nodes[index].restarts))
            del self.nodes[index]
        for s in [s for s in self.by_segment if not self.by_segment[s]]:
            del self.by_segment[s]
        return sum((self.nodes[i].answer() for i in keep), np.zeros(self.dims))

    def noise_scales(self, j: int) -> Optional[list[float]]:
        """The scales of the draws in one item's answer at segment j (after :meth:`close_segment`):
        those of v_j and its left ancestors, whose answers are added. None if one is unknown."""
        out = []
        for i in query_nodes(j):
            scales = self.nodes[i].noise_scales()
            if scales is None:
                return None
            out += scales
        return out

    def members_by_query_node(self, j: int) -> dict[int, dict[int, int]]:
        """For tests (Lemma 9): the live members each node read at segment j holds."""
        return {i: dict(self.nodes[i].members) for i in query_nodes(j)}

    def snapshot(self) -> dict:
        """Its state: the nodes that can be read again (``by_segment`` follows from the counter's
        live instances: DynamicCounter.restore). ``stats`` are this process's, not state."""
        return {"nodes": [node.snapshot() for node in self.nodes.values()]}

    def restore(self, state: dict, live: dict[int, "Instance"], open_segment: int) -> None:
        self.nodes = {}
        for node in state["nodes"]:
            level = interval_tree_level(int(node["index"]))
            self.nodes[int(node["index"])] = NodeMechanism.restored(node, level_epsilon(self.plan.epsilon_counts, level),
                                                                    self.plan.beta, self.dims, self.noise, self.static_release)
        self.by_segment = defaultdict(set)
        for iid, inst in live.items():
            if inst.segment < open_segment:  # the open segment's are added when it closes
                self.by_segment[inst.segment].add(iid)


# ---------------------------------------------------------------------- the whole counter
@dataclass
class DynamicRelease:
    segment: int
    position: int  # the tick at which the segment closed (an SVT output)
    counts: np.ndarray  # noisy count per item
    #: the noiseless counts the mechanism estimates, for benchmarks and tests only (never published,
    #: never used for a decision): live instances per item for the interval tree, inserts minus
    #: deletes for the baseline (the two differ only on a stream that deletes an absent item)
    exact: np.ndarray = field(repr=False, default=None)
    #: discrete Laplace scales of the independent draws in each item's count (the same for every
    #: item; None: unknown): what its confidence interval is computed from. Functions of the budget
    #: and of privatized decisions (segment closes, node restarts and halts), never of raw data
    noise_scales: Optional[tuple] = None
    #: the shard whose items it counts (:class:`ShardedCounter`; 0 with one shard), and its place
    #: among all the query's releases (1, 2, ...; the segment itself with one shard)
    shard: int = 0
    sequence: int = 0


class InvalidUpdate(ValueError):
    pass


class DynamicCounter:
    """Per-item counts of a multiset under inserts and deletes, published at each segment."""

    def __init__(self, plan: DynamicPlan, items: list[str], noise: Optional[NodeNoise], query: str,
                 static_release: Optional[StaticRelease] = None):
        """``static_release``: the plan's (:data:`STATIC_RELEASES`) unless given (tests)."""
        self.plan = plan
        static_release = STATIC_RELEASES[plan.static_release] if static_release is None else static_release
        self.static_release = static_release
        self.items = list(items)
        self.index = {item: i for i, item in enumerate(self.items)}
        self.dims = len(self.items)
        self.noise = DynamicNoise(noise, query)
        self.partitioner = PrivatePartitioner(plan.epsilon_partition, plan.beta, self.noise)
        self.live: dict[int, Instance] = {}
        self.stacks: dict[int, list[int]] = defaultdict(list)  # item -> live instance ids, newest last
        self.exact = np.zeros(self.dims, dtype=np.int64)  # see DynamicRelease.exact: never decides anything
        self.segment = 1
        self._inserted: list[int] = []
        self._deleted: list[int] = []
        self._ins_counts = np.zeros(self.dims, dtype=np.int64)
        self._del_counts = np.zeros(self.dims, dtype=np.int64)
        self._next_id = 0
        self.updates = 0
        self.tick = 0  # tick of the updates not yet decided (0: none)
        self.decided = 0  # every tick <= decided has been decided by the partitioner
        self._undecided = 0
        if plan.mechanism == "interval_tree":
            self.tree = OnlineIntervalTree(plan, self.dims, self.noise, static_release)
        else:
            eps = plan.epsilon_counts  # inserts and deletes are disjoint: parallel composition
            self.inserts = insertion_only(eps, self.dims, self.noise, "baseline:inserts", static_release)
            self.deletes = insertion_only(eps, self.dims, self.noise, "baseline:deletes", static_release)

    def live_size(self) -> int:
        """Live instances: what a snapshot holds (in proportion), whatever the history. The
        baseline keeps none (its counts are its state): 0."""
        return len(self.live)

    def snapshot(self) -> dict:
        """The whole state, as plain numbers and integer arrays: a restored counter goes on
        exactly as this one would (tests/test_dynamic.py). Its size is in proportion to the live
        instances (each also in at most one kept node of the interval tree), not to the updates
        taken in so far (docs/user-guide.md, "Dynamic queries": state)."""
        ids = np.fromiter(self.live.keys(), dtype=np.int64, count=len(self.live))
        state = {
            "segment": self.segment, "decided": self.decided, "tick": self.tick, "undecided": self._undecided,
            "updates": self.updates, "next_id": self._next_id, "exact": self.exact.copy(),
            "live_ids": ids,
            "live_items": np.fromiter((i.item for i in self.live.values()), dtype=np.int32, count=len(ids)),
            "live_segments": np.fromiter((i.segment for i in self.live.values()), dtype=np.int64, count=len(ids)),
            "inserted": np.array(self._inserted, dtype=np.int64),
            "deleted": np.array(self._deleted, dtype=np.int64).reshape(-1, 2),
            "ins_counts": self._ins_counts.copy(), "del_counts": self._del_counts.copy(),
            "partitioner": self.partitioner.snapshot(),
        }
        if self.plan.mechanism == "interval_tree":
            state["tree"] = self.tree.snapshot()
        else:
            state["inserts"], state["deletes"] = self.inserts.snapshot(), self.deletes.snapshot()
        return state

    def restore(self, state: dict) -> None:
        """Take up a :meth:`snapshot` (of a counter of the same plan and items)."""
        self.segment, self.decided, self.tick = int(state["segment"]), int(state["decided"]), int(state["tick"])
        self._undecided, self.updates, self._next_id = int(state["undecided"]), int(state["updates"]), int(state["next_id"])
        self.exact = np.array(state["exact"], dtype=np.int64)
        # the baseline keeps no instances (a snapshot of an earlier version may list some: unused)
        ids = np.asarray(state["live_ids"]).tolist() if self.plan.mechanism == "interval_tree" else []
        self.live = {iid: Instance(item, segment) for iid, item, segment in
                     zip(ids, np.asarray(state["live_items"]).tolist(), np.asarray(state["live_segments"]).tolist())}
        self.stacks = defaultdict(list)  # newest last: ids grow with insertion
        for iid in sorted(ids):
            self.stacks[self.live[iid].item].append(iid)
        self._inserted = np.asarray(state["inserted"]).tolist()
        self._deleted = [(int(a), int(b)) for a, b in np.asarray(state["deleted"]).reshape(-1, 2).tolist()]
        self._ins_counts = np.array(state["ins_counts"], dtype=np.int64)
        self._del_counts = np.array(state["del_counts"], dtype=np.int64)
        self.partitioner.restore(state["partitioner"])
        if self.plan.mechanism == "interval_tree":
            self.tree.restore(state["tree"], self.live, self.segment)
        else:
            self.inserts.restore(state["inserts"])
            self.deletes.restore(state["deletes"])

    def check(self, item: str, op: str, tick: Optional[int] = None) -> Optional[str]:
        """Why an update is invalid (None if valid): unknown item, unknown op, or a tick already
        decided (late). Each depends on the update alone (and the public clock), never on other
        updates: a delete of an item that is not present is valid (docs/privacy.md, "Dynamic
        counts")."""
        if tick is not None and (tick <= self.decided or tick < self.tick):
            return "late: its time is before an already decided tick"
        if item not in self.index:
            return "field 'item' is not in the query's declared items"
        if op not in ("insert", "delete"):
            return "field 'op' must be 'insert' or 'delete'"
        return None

    def apply(self, item: str, op: str, tick: int) -> list[DynamicRelease]:
        """Apply one valid update at ``tick`` (>= 1; ticks must not go back). Ticks before it are
        decided first - including empty ones, where SVT still draws (section 2.4: x_t = bottom) -
        and the releases of the segments that closed are returned. The paper's time model:
        an update's tick is its own, so adding or removing one update moves no other; and every
        valid update is taken in, so adding or removing one changes what the partitioner and the
        baseline take in by exactly that update."""
        reason = self.check(item, op, tick)
        if reason is not None:
            raise InvalidUpdate(reason)
        releases = self.advance_to(tick)
        self._record(item, op)
        self.tick = tick
        self._undecided += 1
        return releases

    def apply_many(self, items: np.ndarray, inserts: np.ndarray, ticks: np.ndarray) -> list[DynamicRelease]:
        """:meth:`apply` for each update in turn - item indices, whether each is an insert, and
        ticks that never go back - with the same result, state and releases as one call per
        update (tests/test_dynamic_batches.py). The baseline takes a tick's updates as counts
        (bincount), the interval tree one at a time (its deletes match instances in order)."""
        items = np.asarray(items, dtype=np.int64)
        inserts = np.asarray(inserts, dtype=bool)
        ticks = np.asarray(ticks, dtype=np.int64)
        if not len(ticks):
            return []
        first = int(ticks[0])
        if first <= self.decided or first < self.tick or (len(ticks) > 1 and bool((np.diff(ticks) < 0).any())):
            raise InvalidUpdate("late: its time is before an already decided tick")
        if len(items) and (int(items.min()) < 0 or int(items.max()) >= self.dims):
            raise InvalidUpdate("field 'item' is not in the query's declared items")
        releases = []
        starts = np.flatnonzero(np.r_[True, ticks[1:] != ticks[:-1]])
        ends = np.r_[starts[1:], len(ticks)]
        for lo, hi in zip(starts.tolist(), ends.tolist()):
            tick = int(ticks[lo])
            releases += self.advance_to(tick)
            if self.plan.mechanism == "interval_tree":
                for x, ins in zip(items[lo:hi].tolist(), inserts[lo:hi].tolist()):
                    self._record(self.items[x], "insert" if ins else "delete")
            else:
                added = np.bincount(items[lo:hi][inserts[lo:hi]], minlength=self.dims)
                removed = np.bincount(items[lo:hi][~inserts[lo:hi]], minlength=self.dims)
                self._ins_counts += added
                self._del_counts += removed
                self.exact += added - removed
                self.updates += hi - lo
            self.tick = tick
            self._undecided += hi - lo
        return releases

    def advance_to(self, tick: int) -> list[DynamicRelease]:
        """Decide every tick before ``tick``; returns the releases of the segments closed."""
        n = tick - 1 - self.decided
        if n <= 0:
            return []
        counts = np.zeros(n, dtype=np.int64)
        consumed = self._undecided and self.tick <= tick - 1  # updates of a later tick stay undecided
        if consumed:
            counts[self.tick - self.decided - 1] = self._undecided
        closes = self.partitioner.advance(counts)
        self.decided = tick - 1
        if consumed:
            self._undecided = 0
        return [self._close(t) for t in closes]

    def update(self, item: str, op: str) -> Optional[DynamicRelease]:
        """One update at its own new tick, decided at once (sequence time, for benchmarks and
        tests; the agent uses :meth:`apply` with the records' times)."""
        tick = max(self.decided, self.tick) + 1
        self.apply(item, op, tick)
        releases = self.advance_to(tick + 1)
        return releases[-1] if releases else None

    def _record(self, item: str, op: str) -> None:
        x = self.index[item]
        if self.plan.mechanism == "baseline":
            # inserts minus deletes, whatever is present (below zero only on an invalid stream):
            # the baseline's releases need no instances, so it keeps none
            if op == "insert":
                self._ins_counts[x] += 1
                self.exact[x] += 1
            else:
                self._del_counts[x] += 1
                self.exact[x] -= 1
            self.updates += 1
            return
        if op == "insert":
            iid = self._next_id
            self._next_id += 1
            self.live[iid] = Instance(x, self.segment)
            self.stacks[x].append(iid)
            self._inserted.append(iid)
            self._ins_counts[x] += 1
            self.exact[x] += 1
        else:
            self._del_counts[x] += 1
            if self.stacks[x]:
                self._match_delete(x)
            # else: no live instance, the interval tree has nothing to delete
        self.updates += 1

    def _match_delete(self, x: int) -> None:
        """A delete of item x takes x's newest live instance (LIFO). Any interval representation
        is fine for the paper's accuracy (section 4); LIFO is the one whose dependence on other
        updates docs/privacy.md, "Dynamic counts", bounds: one update more or less moves a single
        extra instance to ever older instances, so each node sees one window of difference."""
        iid = self.stacks[x].pop()
        inst = self.live.pop(iid)
        if inst.segment == self.segment:
            self._inserted.remove(iid)  # inserted and deleted in one segment: discarded
        else:
            self._deleted.append((iid, inst.segment))
        self.exact[x] -= 1

    def _close(self, tick: int) -> DynamicRelease:
        j = self.segment
        if self.plan.mechanism == "interval_tree":
            counts = self.tree.close_segment(j, self.live, self._inserted, self._deleted)
            scales = self.tree.noise_scales(j)
        else:
            self.inserts.feed(self._ins_counts.copy())
            self.deletes.feed(self._del_counts.copy())
            counts = self.inserts.estimate() - self.deletes.estimate()
            scales = self.inserts.scales() + self.deletes.scales() if self.static_release is noisy_histogram else None
        self._inserted, self._deleted = [], []
        self._ins_counts[:] = 0
        self._del_counts[:] = 0
        self.segment += 1
        return DynamicRelease(j, tick, counts, self.exact.copy(), None if scales is None else tuple(scales))


# ---------------------------------------------------------------------- shards
class ShardedCounter:
    """A dynamic query's items split into ``shards`` fixed, public shards - item i (in declared
    order) in shard ``i % shards`` - each with a :class:`DynamicCounter` of its own: its own
    partitioner, counters and noise (named ``<query>#shard<k>``; with one shard, the query's own
    name, so a one-shard query is the plain counter, byte for byte). An update is of one item, so
    it reaches one shard's mechanism: parallel composition, each shard at the query's epsilon
    (docs/privacy.md, "Shards"). Segments close per shard, so a busy shard releases more often
    than a quiet one, and how one shard's segments close never depends on another's updates.

    Releases come in (position, shard) order and are numbered in it (:attr:`DynamicRelease.sequence`),
    however the ticks are decided: in one call or in many."""

    def __init__(self, plan: DynamicPlan, items: list[str], noise: Optional[NodeNoise], query: str, shards: int = 1,
                 static_release: Optional[StaticRelease] = None, owned: Optional[Sequence[int]] = None):
        """``owned``: the shards this instance runs (default: all). A worker that reads a
        partitioned update topic runs one shard per partition of the query's by-item topic
        (docs/user-guide.md, "Partitions"); its releases are numbered among its own shards'."""
        if not 1 <= shards <= len(items):
            raise ValueError(f"shards must be in [1, {len(items)}] (the number of items), got {shards}")
        self.plan = plan
        self.items = list(items)
        self.index = {item: i for i, item in enumerate(self.items)}
        self.shards = shards
        self.shard_of = np.arange(len(self.items)) % shards
        self.local_of = np.arange(len(self.items)) // shards
        self.owned = list(range(shards)) if owned is None else sorted(set(int(k) for k in owned))
        if not self.owned or not all(0 <= k < shards for k in self.owned):
            raise ValueError(f"owned shards must be among 0..{shards - 1}, got {list(owned or [])}")
        self.counters = {k: DynamicCounter(plan, self.items[k::shards], noise, query if shards == 1 else f"{query}#shard{k}",
                                           static_release) for k in self.owned}
        self.released = 0  # releases numbered so far

    def shard_items(self, shard: int) -> list[str]:
        return self.counters[shard].items

    def owns(self, items: np.ndarray) -> np.ndarray:
        """Whether each item (global index) is in a shard this instance runs."""
        return np.isin(self.shard_of[np.asarray(items, dtype=np.int64)], self.owned)

    @property
    def decided(self) -> int:
        return self.counters[self.owned[0]].decided

    @property
    def exact(self) -> np.ndarray:
        """The noiseless counts of every item of the shards run here (zero elsewhere), in declared
        order (benchmarks and tests only)."""
        out = np.zeros(len(self.items), dtype=np.int64)
        for k, counter in self.counters.items():
            out[k::self.shards] = counter.exact
        return out

    def live_size(self) -> int:
        return sum(c.live_size() for c in self.counters.values())

    def decide(self, items: np.ndarray, inserts: np.ndarray, ticks: np.ndarray, last: int) -> list[DynamicRelease]:
        """Feed updates (global item indices, in the order to take them in, ticks that never go
        back) and decide every tick up to ``last``: each shard takes its own updates in that
        order. Returns the releases, numbered."""
        items = np.asarray(items, dtype=np.int64)
        inserts = np.asarray(inserts, dtype=bool)
        ticks = np.asarray(ticks, dtype=np.int64)
        if len(items) and len(self.owned) < self.shards and not self.owns(items).all():
            raise ValueError("an update of a shard this counter does not run")
        releases = []
        for k, counter in self.counters.items():
            if self.shards == 1:
                mine = slice(None)
            else:
                mine = np.flatnonzero(self.shard_of[items] == k) if len(items) else np.zeros(0, dtype=np.int64)
            if len(ticks):
                releases += [(r, k) for r in counter.apply_many(self.local_of[items[mine]], inserts[mine], ticks[mine])]
            releases += [(r, k) for r in counter.advance_to(last + 1)]
        releases.sort(key=lambda rk: (rk[0].position, rk[1]))
        out = []
        for release, k in releases:
            self.released += 1
            release.shard = k
            release.sequence = release.segment if self.shards == 1 else self.released
            out.append(release)
        return out

    def snapshot(self) -> dict:
        """With one shard, the counter's own snapshot (as before shards existed); else each
        shard's and the number of releases so far."""
        if self.shards == 1:
            return self.counters[0].snapshot()
        # the owned shards' snapshots, in shard order (all of them unless a worker runs one)
        return {"shards": [c.snapshot() for c in self.counters.values()], "released": self.released}

    def restore(self, state: dict) -> None:
        if self.shards == 1:
            self.counters[0].restore(state)
            self.released = self.counters[0].segment - 1
            return
        for counter, shard_state in zip(self.counters.values(), state["shards"], strict=True):
            counter.restore(shard_state)
        self.released = int(state["released"])
