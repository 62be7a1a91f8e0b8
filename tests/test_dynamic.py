"""Tests of the fully dynamic counter (processor/mechanisms/dynamic.py, accountant/dynamic.py) against Qiu & Yi,
*Differential Privacy on Dynamic Data* (papers/dp-on-dynamic-data-online-interval-tree.txt):
Algorithm 2 (infinite private partitioning), section 4.1 / Lemma 9 (online interval tree),
Algorithm 3 (per-node deletion-only mechanism with restarts), section 4.3 (level budgets).

All randomness is fixed: streams come from numpy ``default_rng`` with fixed seeds, noise from the
keyed PRF with ``TEST_SECRET`` and fixed labels, so every test is deterministic; the statistical
tolerances below are derived from the distributions (see the comments) so that a correct
implementation passes with overwhelming probability over the choice of seed/secret, while a wrong
scale, a wrong node set or a biased sampler fails.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpstream.accountant.dynamic import (
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
from dpstream.processor.mechanisms.dynamic import (
    DynamicCounter,
    DynamicNoise,
    InsertionOnlyCounter,
    InvalidUpdate,
    NodeMechanism,
    PrivatePartitioner,
    interval_tree_level,
    query_nodes,
)
from dpstream.processor.mechanisms.noise import NodeNoise
from tests.conftest import TEST_SECRET

OTHER_SECRET = b"another-dpstream-test-secret-0123456789"
MECHANISMS = ("interval_tree", "baseline")


# ---------------------------------------------------------------------------- helpers
def make_stream(seed: int, phases: list[tuple[int, float]], n_items: int) -> list[tuple[str, str]]:
    """A valid insert/delete stream over a multiset (items repeat many times): in each phase
    (length, p_delete) an update is a delete of a uniformly chosen *present* item with
    probability p_delete (if anything is present), else an insert of a uniform item."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(n_items, dtype=np.int64)
    out = []
    for length, p_delete in phases:
        for _ in range(length):
            if counts.sum() > 0 and rng.random() < p_delete:
                x = int(rng.choice(np.nonzero(counts)[0]))
                counts[x] -= 1
                out.append((f"item{x}", "delete"))
            else:
                x = int(rng.integers(n_items))
                counts[x] += 1
                out.append((f"item{x}", "insert"))
    return out


def items(n: int) -> list[str]:
    return [f"item{x}" for x in range(n)]


class InstanceModel:
    """Independent record of the stream: instance ids are sequential over inserts (id -> item,
    insertion segment) and per-item counts. Which copy a delete removes is the counter's choice
    (any interval representation is fine, section 4), so the live set itself is read from
    ``counter.live`` and checked against this record."""

    def __init__(self, n_items: int):
        self.n_items = n_items
        self.inserted: list[tuple[int, int]] = []  # id -> (item, insertion segment)
        self.counts = np.zeros(n_items, dtype=np.int64)

    def apply(self, item: str, op: str, segment: int) -> None:
        x = int(item[len("item"):])
        if op == "insert":
            self.inserted.append((x, segment))
            self.counts[x] += 1
        else:
            self.counts[x] -= 1

    def check_live(self, live: dict) -> dict[int, tuple[int, int]]:
        """``counter.live`` as {id: (item, segment)}, after checking it against the record."""
        out = {iid: (inst.item, inst.segment) for iid, inst in live.items()}
        assert all(self.inserted[iid] == v for iid, v in out.items())
        assert np.array_equal(self.histogram(out, out), self.counts)
        return out

    def histogram(self, live: dict, ids) -> np.ndarray:
        h = np.zeros(self.n_items, dtype=np.int64)
        for iid in ids:
            h[live[iid][0]] += 1
        return h


def trailing_zeros(i: int) -> int:
    z = 0
    while i % 2 == 0:
        i //= 2
        z += 1
    return z


def discrete_laplace_moments(scale: float) -> tuple[float, float]:
    """(variance, fourth moment) of P[x] ~ q^|x|, q = exp(-1/scale), by direct summation of the
    pmf (1-q)/(1+q) q^|x| over |x| <= K with q^K < 1e-30 (the rest is negligible)."""
    q = math.exp(-1.0 / scale)
    k_max = int(math.ceil(70.0 * scale)) + 10
    x = np.arange(-k_max, k_max + 1, dtype=np.float64)
    p = (1 - q) / (1 + q) * q ** np.abs(x)
    return float((p * x ** 2).sum()), float((p * x ** 4).sum())


# ---------------------------------------------------------------------------- 1. Lemma 9
LEMMA9_CASES = [
    # (seed, phases, n_items, epsilon, partition_share)
    (11, [(2500, 0.45)], 6, 8.0, 0.25),  # steady churn, no restarts
    (12, [(2500, 0.45)], 3, 8.0, 0.25),
    (13, [(800, 0.2), (800, 0.7), (800, 0.45)], 4, 8.0, 0.25),
    (1, [(1500, 0.1), (1500, 0.9)] * 2, 5, 50.0, 0.02),  # sawtooth: long segments, restarts and halts
    (2, [(1500, 0.1), (1500, 0.9)] * 2, 5, 50.0, 0.02),
    (1, [(1500, 0.1), (1500, 0.9)] * 2, 5, 20.0, 0.1),
    (2, [(1500, 0.1), (1500, 0.9)] * 2, 5, 20.0, 0.1),
]


def test_lemma9_query_nodes_cover_live_instances_exactly_once():
    """At every segment close j (noise=None): the ranges (i & (i-1), i] of the nodes i in
    query_nodes(j) tile (0, j]; every non-halted query node holds exactly the live instances
    inserted in its range (so the nodes' members are disjoint and, when no node has halted, their
    union is the whole live multiset: Lemma 9); the noiseless release equals the exact counts
    (minus, by design of Algorithm 3 line 23, the live items of halted nodes, which answer 0)."""
    full_checks = halted_checks = restarts_seen = 0
    for seed, phases, n_items, eps, share in LEMMA9_CASES:
        plan = DynamicPlan(eps, 0.0, 0.05, share, "interval_tree")
        counter = DynamicCounter(plan, items(n_items), None, "lemma9")
        model = InstanceModel(n_items)
        segment = 1
        for item, op in make_stream(seed, phases, n_items):
            model.apply(item, op, segment)
            release = counter.update(item, op)
            if release is None:
                continue
            j = release.segment
            assert j == segment
            segment += 1
            tree = counter.tree

            # the counter's live instances agree with the independent record of the stream
            live = model.check_live(counter.live)
            assert np.array_equal(release.exact, model.counts)

            # query nodes: ranges tile (0, j]; one node per level; only they are kept
            qn = sorted(query_nodes(j))
            assert qn[-1] == j
            lo = 0
            for i in qn:
                assert (i & (i - 1)) == lo, (j, qn)
                lo = i
                assert interval_tree_level(i) == trailing_zeros(i) + 1
            assert len({interval_tree_level(i) for i in qn}) == len(qn)
            assert set(tree.nodes) == set(qn)

            members = tree.members_by_query_node(j)
            assert set(members) == set(qn)
            expected = {i: {iid: x for iid, (x, s) in live.items() if (i & (i - 1)) < s <= i} for i in qn}
            assert sum(len(e) for e in expected.values()) == len(live)  # the ranges tile (0, j]
            halted = [i for i in qn if tree.nodes[i].halted]
            for i in qn:
                if not tree.nodes[i].halted:
                    assert members[i] == expected[i], f"node {i} at segment {j}"
            if not halted:
                union = [iid for i in qn for iid in members[i]]
                assert len(union) == len(set(union)) == len(live)  # no instance twice
                assert set(union) == set(live)  # none missing, none dead
                assert np.array_equal(release.counts, release.exact)
                full_checks += 1
            else:
                lost = model.histogram(live, (iid for i in halted for iid in expected[i]))
                assert np.array_equal(release.counts, release.exact - lost)
                halted_checks += 1
        restarts_seen += sum(r for _, r in counter.tree.stats["restarts"]) + sum(
            n.restarts for n in counter.tree.nodes.values())
    # not vacuous: many fully checked closes, restarts (members carried across rounds), halts
    assert full_checks >= 300
    assert restarts_seen >= 2
    assert halted_checks >= 1


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_baseline_noiseless_counts_are_exact(seed):
    plan = DynamicPlan(8.0, 0.0, 0.05, 0.25, "baseline")
    counter = DynamicCounter(plan, items(4), None, "baseline")
    model = InstanceModel(4)
    n_releases = 0
    for item, op in make_stream(seed, [(1000, 0.3), (1000, 0.6)], 4):
        model.apply(item, op, 0)
        release = counter.update(item, op)
        if release is not None:
            n_releases += 1
            assert np.array_equal(release.exact, model.counts)
            assert np.array_equal(release.counts, release.exact)
    assert n_releases >= 10


# ---------------------------------------------------------------------------- 2. budgets
@pytest.mark.parametrize("eps_c", [0.1, 1.0, 7.5])
def test_level_budgets_sum_to_at_most_eps_and_tend_to_it(eps_c):
    partial = 0.0
    for depth in range(1, 2001):
        partial += level_epsilon(eps_c, depth)
        assert partial <= eps_c * (1 + 1e-12)
        # sum_{l > L} 6/(pi^2 l^2) < 6/(pi^2 L): the gap closes like 1/L
        assert eps_c - partial <= 6 * eps_c / (math.pi ** 2 * depth) + 1e-12
    assert partial == pytest.approx(eps_c, rel=1e-3)
    assert level_epsilon(eps_c, 3) == pytest.approx(6 * eps_c / (math.pi ** 2 * 9))


@pytest.mark.parametrize("eps_v", [0.05, 1.0, 30.0])
def test_round_budgets_and_failures_sum_to_at_most_declared(eps_v):
    beta = 0.05
    spent = failures = 0.0
    for r in range(1, 2001):
        spent += 4 * round_epsilon(eps_v, r)  # four mechanisms per round (Algorithm 3)
        failures += 2 * round_beta(beta, r)  # two Laplace error events per round (Lemma 10)
        assert spent <= eps_v * (1 + 1e-12)
        assert failures <= beta / 3 * (1 + 1e-12)
    assert spent == pytest.approx(eps_v, rel=1e-3)
    assert failures == pytest.approx(beta / 3, rel=1e-3)
    assert round_epsilon(eps_v, 2) == pytest.approx(3 * eps_v / (2 * math.pi ** 2 * 4))
    assert round_beta(beta, 1) == pytest.approx(beta / math.pi ** 2)


def test_svt_failures_sum_to_at_most_beta():
    beta = 0.05
    total = 0.0
    for j in range(1, 5001):
        total += svt_beta(beta, j)
        assert total <= beta * (1 + 1e-12)
    assert total == pytest.approx(beta, rel=1e-3)


@pytest.mark.parametrize("eps_p,horizon,beta_j", [(0.25, 2, 0.03), (1.0, 256, 0.001), (10.0, 65536 ** 2, 1e-6)])
def test_svt_threshold_and_scales_match_the_paper(eps_p, horizon, beta_j):
    # Algorithm 2: theta_j = (7 / eps) ln(2 T_j / beta_j); Algorithm 1: Lap(2/eps), Lap(4/eps)
    assert svt_threshold(eps_p, horizon, beta_j) == pytest.approx(7.0 / eps_p * math.log(2.0 * horizon / beta_j), rel=1e-12)
    assert svt_scales(eps_p) == pytest.approx((2.0 / eps_p, 4.0 / eps_p))


@pytest.mark.parametrize("epsilon,share", [(1.0, 0.25), (3.3, 0.1), (0.7, 0.5), (100.0, 0.02)])
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_plan_split_is_exact_and_pure(epsilon, share, mechanism):
    plan = DynamicPlan(epsilon, 1e-6, 0.05, share, mechanism)
    assert plan.epsilon_partition + plan.epsilon_counts == plan.epsilon
    assert plan.epsilon_spent == plan.epsilon
    assert plan.epsilon_partition == pytest.approx(share * epsilon)
    assert plan.delta_spent == 0.0  # Laplace only: pure DP
    d = plan.to_dict()
    assert d["first_svt_threshold"] == pytest.approx(7.0 / (share * epsilon) * math.log(2 * 2 / (6 * 0.05 / math.pi ** 2)))


def test_counter_scales_split_eps_between_blocks_and_tree():
    # a step in block b is in one block total (eps/2) and one node per level of the b+1 levels
    for eps in (0.3, 1.0, 4.0):
        for step in (1, 2, 3, 4, 7, 8, 1000, 2 ** 20):
            b = step.bit_length() - 1
            total_scale, node_scale = counter_scales(eps, step)
            spent = 1 / total_scale + (b + 1) / node_scale  # sensitivity 1: eps = 1/scale per release
            assert spent == pytest.approx(eps)
            assert 2 ** b <= step < 2 ** (b + 1)


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0, 2.5, 17.0, 400.0])
@pytest.mark.parametrize("failure", [0.5, 0.05, 1e-3, 1e-6, 1e-12])
def test_discrete_laplace_tail_is_smallest_valid_m(scale, failure):
    q = math.exp(-1.0 / scale)

    def tail(m: int) -> float:  # P[|X| > m] = 2 q^(m+1) / (1+q), exact for the discrete Laplace
        return 2 * q ** (m + 1) / (1 + q)

    m = discrete_laplace_tail(scale, failure)
    assert isinstance(m, int) and m >= 0
    assert tail(m) <= failure * (1 + 1e-9)
    if m > 0:
        assert tail(m - 1) > failure * (1 - 1e-9)


# ---------------------------------------------------------------------------- 3. restarts
RESTART_CASES = [
    # (seed, phases, n_items, epsilon, share): heavy deletions; eps large so that the per-node
    # deletion-count error gamma is small next to the node sizes (see the test docstring)
    (1, [(1500, 0.1), (1500, 0.9)] * 2, 5, 400.0, 0.05),
    (2, [(1500, 0.1), (1500, 0.9)] * 2, 5, 400.0, 0.05),
    (3, [(3000, 0.49)], 5, 400.0, 0.25),
]


def test_node_restarts_are_logarithmic_in_node_size():
    """Lemma 10: conditioned on the Laplace errors being within gamma (probability >= 1 - beta/3
    per node), a restart means at least half of the round's items were really deleted, so a node
    built with n(v) items restarts at most floor(log2 n(v)) + 1 times (0 times if n(v) = 0).
    We allow log2(max(n, 1)) + 2.

    Why eps = 400: with eps_c ~ 380, a level-1 node runs Algorithm 3 at eps_r = 3 eps(v) /
    (2 pi^2) ~ 35, so gamma (a sum of discrete Laplace tails of scale ~2 * 2(b+1)/eps_r: the
    deletion counters have sensitivity 2) is a few units, while nodes hold tens to hundreds of
    items; at eps ~ 1 gamma is in the hundreds, the restart test n_del > n/2 + 2 gamma never
    fires and the bound would be checked vacuously."""
    noise = NodeNoise(TEST_SECRET)
    total = 0
    for seed, phases, n_items, eps, share in RESTART_CASES:
        plan = DynamicPlan(eps, 0.0, 0.05, share, "interval_tree")
        counter = DynamicCounter(plan, items(n_items), noise, f"restarts-{seed}")
        for item, op in make_stream(seed, phases, n_items):
            counter.update(item, op)
        records = counter.tree.stats["restarts"] + [(n.initial_size, n.restarts) for n in counter.tree.nodes.values()]
        assert len(records) == counter.tree.stats["nodes_built"]
        for initial_size, restarts in records:
            assert restarts <= math.log2(max(initial_size, 1)) + 2, (initial_size, restarts)
        total += sum(r for _, r in records)
    assert total >= 10  # restarts do happen in these heavy-delete streams


@pytest.mark.parametrize("eps_node", [300.0, 3000.0])
def test_node_mechanism_restarts_after_half_really_deleted(eps_node):
    """Algorithm 3 on one node of 4096 items losing 3% of its remaining items per segment: every
    restart happens after more than half of the round's initial items were really deleted (the
    good event of Lemma 10, probability >= 1 - 2 beta_r per round), so the rounds' sizes halve and
    restarts <= floor(log2 4096) + 1; several restarts do happen; a halted node answers 0."""
    rng = np.random.default_rng(7)
    n0, dims = 4096, 4
    members = {i: int(rng.integers(dims)) for i in range(n0)}
    node = NodeMechanism(1, 1, members, eps_node, 0.05, dims, DynamicNoise(NodeNoise(TEST_SECRET), "node-mech"),
                         f"node-eps{eps_node}")
    assert node.initial_size == n0 and node.restarts == 0
    alive = list(members)
    round_size, deleted_in_round = n0, 0
    for _ in range(400):
        if not alive or node.halted:
            break
        k = max(1, int(0.03 * len(alive)))
        picks = set(rng.choice(len(alive), size=k, replace=False).tolist())
        gone = [a for idx, a in enumerate(alive) if idx in picks]
        alive = [a for idx, a in enumerate(alive) if idx not in picks]
        before = node.restarts
        node.step(gone + [10 ** 9])  # ids that are not members are ignored
        deleted_in_round += k
        if node.restarts > before:
            assert deleted_in_round > round_size / 2, (round_size, deleted_in_round)
            assert set(node.members) == set(alive) or node.halted
            round_size, deleted_in_round = len(alive), 0
    assert 3 <= node.restarts <= math.floor(math.log2(n0)) + 1
    if node.halted:
        assert np.array_equal(node.answer(), np.zeros(dims))


def reference_gamma(eps: float, failure: float, k: int) -> int:
    """Public error bound of the Lap-Ins counter at its step k (Chan, Shi, Song with the paper's
    union bound): the k-th release reads b completed block totals (scale 2 s/eps) and
    popcount(k - 2^b + 1) dyadic nodes of block b (scale 2 s (b+1)/eps), b = floor(log2 k); each
    node gets failure / #nodes. s = 2: a node's deletion counters are calibrated to sensitivity 2
    (which instance a delete removes depends on other updates: docs/privacy.md, "Dynamic counts")."""
    b = k.bit_length() - 1
    s = 2
    scales = [2 * s / eps] * b + [2 * s * (b + 1) / eps] * bin(k - 2 ** b + 1).count("1")
    return sum(discrete_laplace_tail(s, failure / len(scales)) for s in scales)


@pytest.mark.parametrize("eps_node", [10.0, 60.0, 2000.0])  # the deletion counters' gamma of 5, 30, 1000 at sensitivity 1
def test_node_mechanism_follows_algorithm_3_without_noise(eps_node):
    """Algorithm 3 written from the paper with noise = 0 (so n~ = |D(v)| and n~del = the true
    deletions of the round): restart at the first segment where n_del > n/2 + 2 gamma_{t,r}
    (gamma of the round's Lap-Ins at its current step, failure beta_r = beta/(pi^2 r^2)); on a
    restart r += 1, D(v) = the remaining items, halt if |D(v)| < 2 gamma of the fresh counter
    (its step 1); the answer is the histogram of the remaining items, 0 once halted. Segments
    delete 2%, 10%, 60% or 98% of the remaining items at random (bursts make nodes halt)."""
    beta, dims, n0 = 0.05, 4, 4096
    restarts = halts = 0
    for seed in (1, 2, 3):
        rng = np.random.default_rng(seed)
        members = {i: int(rng.integers(dims)) for i in range(n0)}
        node = NodeMechanism(3, 1, members, eps_node, beta, dims, DynamicNoise(None, "alg3"), "alg3")
        # reference state
        alive, r, n_tilde, deleted, step, halted = dict(members), 1, n0, 0, 0, False
        while alive:
            frac = float(rng.choice([0.02, 0.1, 0.6, 0.98]))
            gone = rng.choice(sorted(alive), size=max(1, int(frac * len(alive))), replace=False).tolist()
            node.step(gone + [-1])  # -1: a deletion of an instance the node does not hold
            for iid in gone:
                del alive[iid]
            if not halted:
                deleted += len(gone)
                step += 1
                eps_r, beta_r = 3 * eps_node / (2 * math.pi ** 2 * r ** 2), beta / (math.pi ** 2 * r ** 2)
                if deleted > n_tilde / 2 + 2 * reference_gamma(eps_r, beta_r, step):
                    r += 1
                    eps_r, beta_r = 3 * eps_node / (2 * math.pi ** 2 * r ** 2), beta / (math.pi ** 2 * r ** 2)
                    n_tilde, deleted, step = len(alive), 0, 0
                    halted = n_tilde < 2 * reference_gamma(eps_r, beta_r, 1)
            assert (node.r, node.restarts, node.halted) == (r, r - 1, halted)
            expected = np.zeros(dims) if halted else np.bincount(list(alive.values()), minlength=dims)
            assert np.array_equal(node.answer(), expected)
        restarts += r - 1
        halts += halted
    assert restarts >= 3 and (halts >= 1 or eps_node >= 2000)


# ---------------------------------------------------------------------------- 4. invalid input
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_invalid_updates_are_rejected_without_changing_state(mechanism):
    """An unknown item, a bad op or a late tick is refused on the update's own fields (and the
    clock), leaving the counter as it was."""
    plan = DynamicPlan(2.0, 0.0, 0.05, 0.25, mechanism)
    counter = DynamicCounter(plan, ["a", "b", "c"], NodeNoise(TEST_SECRET), "invalid")
    for item, op in [("a", "insert"), ("a", "insert"), ("b", "insert"), ("a", "delete"), ("b", "delete")]:
        assert counter.check(item, op) is None
        counter.update(item, op)

    def snapshot():
        return (counter.exact.copy(), counter.updates, dict(counter.live), counter.segment, counter.partitioner.t,
                list(counter._inserted), list(counter._deleted), counter._next_id)

    before = snapshot()
    for item, op, tick in [("zzz", "insert", None), ("a", "upsert", None), ("a", "insert", counter.decided)]:
        reason = counter.check(item, op, tick)
        assert isinstance(reason, str) and reason
        with pytest.raises(InvalidUpdate):
            if tick is None:
                counter.update(item, op)
            else:
                counter.apply(item, op, tick)
        after = snapshot()
        assert np.array_equal(after[0], before[0]) and after[1:] == before[1:]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_delete_of_an_absent_item_is_taken_in_whatever_the_other_updates(mechanism):
    """Whether an update is taken in never depends on other updates (docs/privacy.md, "Dynamic
    counts"): a delete of an item with no live copy is valid; the partitioner counts it like any
    update; the baseline's delete counter counts it (inserts minus deletes goes below zero); the
    interval tree finds no instance to delete, so its live multiset is unchanged."""
    plan = DynamicPlan(2.0, 0.0, 0.05, 0.25, mechanism)
    counter = DynamicCounter(plan, ["a", "b", "c"], None, "absent")
    for item, op in [("a", "insert"), ("b", "delete"), ("c", "delete"), ("a", "delete"), ("a", "delete")]:
        assert counter.check(item, op) is None
        counter.update(item, op)
    assert counter.updates == 5 and counter.partitioner.t == 5  # five ticks decided, each with its update
    if mechanism == "baseline":
        assert counter.exact.tolist() == [-1, -1, -1]
    else:
        assert counter.exact.tolist() == [0, 0, 0] and not counter.live
    released = [r for r in (counter.update(i, o) for i, o in [("c", "insert")] * 200) if r is not None]
    # noise=None: a release is the noiseless counts (the baseline's: inserts minus deletes, fed to its counters)
    assert released and np.array_equal(released[-1].counts, released[-1].exact)
    assert counter.exact[2] == (199 if mechanism == "baseline" else 200)


# ---------------------------------------------------------------------------- 5. replay
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_noise_is_identical_on_replay_and_depends_on_secret(mechanism):
    plan = DynamicPlan(3.0, 0.0, 0.05, 0.25, mechanism)
    stream = make_stream(31, [(700, 0.2), (700, 0.6)], 5)

    def run(secret):
        counter = DynamicCounter(plan, items(5), NodeNoise(secret), "replay")
        return [r for r in (counter.update(i, o) for i, o in stream) if r is not None]

    first, second, other = run(TEST_SECRET), run(TEST_SECRET), run(OTHER_SECRET)
    assert len(first) >= 5 and len(first) == len(second)
    for a, b in zip(first, second):
        assert (a.segment, a.position) == (b.segment, b.position)
        assert np.array_equal(a.counts, b.counts) and np.array_equal(a.exact, b.exact)
    # another secret: other noise (same exact counts where the positions coincide)
    by_pos = {r.position: r for r in first}
    common = [r for r in other if r.position in by_pos]
    assert common
    assert any(not np.array_equal(r.counts, by_pos[r.position].counts) for r in common)
    assert any(not np.array_equal(r.counts, r.exact) for r in first)  # noise present at all


# ---------------------------------------------------------------------------- 6. statistics
@pytest.mark.parametrize("scale", [0.7, 3.0, 40.0])
def test_discrete_laplace_sampler_moments_and_pmf(scale):
    """200k draws of DynamicNoise.laplace. X has P[x] = (1-q)/(1+q) q^|x|, q = exp(-1/scale),
    mean 0, variance s2 = 2q/(1-q)^2. With n iid draws: mean(X) has standard error
    sqrt(s2/n); mean(X^2) estimates s2 with standard error sqrt((E X^4 - s2^2)/n) (E X^4 by
    summing the pmf). Both must lie within 5 standard errors (two-sided normal tail 5.7e-7).
    The pmf: chi-square goodness of fit over the cells |x| <= K with expected count >= 20 plus
    the two lumped tails; reject below p = 1e-6."""
    n = 200_000
    draws = DynamicNoise(NodeNoise(TEST_SECRET), "sampler").laplace(scale, f"moments-{scale}", n)
    assert draws.dtype == np.int64 and draws.shape == (n,)
    q = math.exp(-1.0 / scale)
    var, m4 = discrete_laplace_moments(scale)
    assert var == pytest.approx(2 * q / (1 - q) ** 2, rel=1e-9)
    x = draws.astype(np.float64)
    assert abs(x.mean()) <= 5 * math.sqrt(var / n)
    assert abs((x ** 2).mean() - var) <= 5 * math.sqrt((m4 - var ** 2) / n)

    p0 = (1 - q) / (1 + q)
    k_max = 0
    while n * p0 * q ** (k_max + 1) >= 20:
        k_max += 1
    cells = np.arange(-k_max, k_max + 1)
    expected = n * p0 * q ** np.abs(cells)
    tail = n * q ** (k_max + 1) / (1 + q)  # P[X > K] = q^(K+1)/(1+q), same for X < -K
    observed = np.array([(draws == k).sum() for k in cells] + [(draws < -k_max).sum(), (draws > k_max).sum()])
    expected = np.concatenate([expected, [tail, tail]])
    assert expected.sum() == pytest.approx(n, rel=1e-9)
    assert stats.chisquare(observed, expected).pvalue > 1e-6


def test_sampler_depends_on_label_index_and_secret():
    a = DynamicNoise(NodeNoise(TEST_SECRET), "q")
    b = DynamicNoise(NodeNoise(OTHER_SECRET), "q")
    base = a.laplace(5.0, "lab", 64)
    assert np.array_equal(base, a.laplace(5.0, "lab", 64))
    assert np.array_equal(base[10:30], a.laplace(5.0, "lab", 20, start=10))  # a draw is a function of its index
    assert not np.array_equal(base, a.laplace(5.0, "lab2", 64))
    assert not np.array_equal(base, b.laplace(5.0, "lab", 64))
    assert not np.array_equal(base, DynamicNoise(NodeNoise(TEST_SECRET), "q2").laplace(5.0, "lab", 64))
    assert np.array_equal(DynamicNoise(None, "q").laplace(5.0, "lab", 7), np.zeros(7, dtype=np.int64))


def test_insertion_only_bound_holds_with_probability_beta():
    """3000 independent counters (distinct labels, eps = 1) at a uniformly random step in
    [1, 5000]: |noise| > bound(beta) must have probability <= beta = 0.05 (union bound over the
    nodes read). The exceedance count is Binomial(3000, p <= 0.05): mean <= 150, sd <= 11.9; we
    allow beta + 4 sd / 3000 (one-sided tail 3e-5)."""
    beta, n = 0.05, 3000
    noise = DynamicNoise(NodeNoise(TEST_SECRET), "bound")
    rng = np.random.default_rng(41)
    exceed = 0
    for k in range(n):
        counter = InsertionOnlyCounter(1.0, 1, noise, f"counter{k}")
        counter.step = int(rng.integers(1, 5001))  # the released noise only depends on the step
        err = counter.estimate()[0] - counter.exact[0]
        exceed += abs(err) > counter.bound(beta)
    assert exceed / n <= beta + 4 * math.sqrt(beta * (1 - beta) / n)


def test_insertion_only_bound_is_exact_quantile_at_one_node():
    """At step 1 the release reads one node of scale 2/eps, so bound(f) is the discrete Laplace
    quantile m = discrete_laplace_tail(2/eps, f) and P[|noise| > m] = 2 q^(m+1)/(1+q) =: p exactly
    (<= f, and not far below it). With 200k independent coordinates the exceedance frequency is
    within 5 sd = 5 sqrt(p(1-p)/n) of p."""
    eps, failure, n = 0.8, 0.05, 200_000
    counter = InsertionOnlyCounter(eps, n, DynamicNoise(NodeNoise(TEST_SECRET), "quantile"), "one-node")
    counter.feed(np.ones(n, dtype=np.int64))
    assert len(counter._nodes()) == 1
    m = counter.bound(failure)
    q = math.exp(-eps / 2.0)
    p = 2 * q ** (m + 1) / (1 + q)
    assert p <= failure and m == discrete_laplace_tail(2.0 / eps, failure)
    freq = float((np.abs(counter.estimate() - counter.exact) > m).mean())
    assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("step", [1, 5, 13, 64, 1023])
def test_insertion_only_noise_reads_the_right_nodes(step):
    """Release noise at step k = sum of independent discrete Laplace noises: one per completed
    block [2^c, 2^(c+1)), c < b (scale 2/eps) and one per dyadic node of the current block's
    prefix (popcount(k - 2^b + 1) nodes, scale 2(b+1)/eps). Over 100k coordinates the sample
    variance must match sum var_i within 5 standard errors, with fourth moment
    E S^4 = sum m4_i + 3 ((sum var_i)^2 - sum var_i^2) for independent zero-mean terms."""
    eps, n = 1.0, 100_000
    counter = InsertionOnlyCounter(eps, n, DynamicNoise(NodeNoise(TEST_SECRET), "nodes"), f"step{step}")
    for _ in range(step):
        counter.feed(None)
    b = step.bit_length() - 1
    scales = [2.0 / eps] * b + [2.0 * (b + 1) / eps] * bin(step - 2 ** b + 1).count("1")
    assert sorted(s for s, _ in counter._nodes()) == sorted(scales)
    moments = [discrete_laplace_moments(s) for s in scales]
    var = sum(v for v, _ in moments)
    m4 = sum(m for _, m in moments) + 3 * (var ** 2 - sum(v ** 2 for v, _ in moments))
    err = counter.estimate() - counter.exact
    assert np.array_equal(err, np.round(err))  # integer noise
    assert abs(err.mean()) <= 5 * math.sqrt(var / n)
    assert abs((err ** 2).mean() - var) <= 5 * math.sqrt((m4 - var ** 2) / n)
    # a node keeps its noise: step 5 reads block0, block1 and [4, 5] of block 2; step 6 reads the
    # same three plus the node [6] (scale 2*3/eps), so the noise difference has that one node's
    # variance, not the sum of four nodes' variances
    if step == 5:
        counter.feed(np.arange(n))
        diff = (counter.estimate() - counter.exact) - err
        v1, m41 = discrete_laplace_moments(6.0 / eps)
        assert abs((diff ** 2).mean() - v1) <= 5 * math.sqrt((m41 - v1 ** 2) / n)


# ---------------------------------------------------------------------------- 7. mechanisms, partitioning
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_both_mechanisms_release_one_count_per_item(mechanism):
    plan = DynamicPlan(1.0, 0.0, 0.05, 0.25, mechanism)
    labels = items(7)
    counter = DynamicCounter(plan, labels, NodeNoise(TEST_SECRET), "shape")
    releases = []
    for item, op in make_stream(51, [(1500, 0.4)], 7):
        r = counter.update(item, op)
        if r is not None:
            assert np.array_equal(r.exact, counter.exact) and r.position == counter.updates
            releases.append(r)
    assert len(releases) >= 5
    for r in releases:
        assert r.counts.shape == (len(labels),) and r.exact.shape == (len(labels),)
        assert np.all(np.isfinite(r.counts))
    assert [r.segment for r in releases] == list(range(1, len(releases) + 1))


def reference_partition(noise: DynamicNoise, eps: float, beta: float, n: int) -> list[int]:
    """Algorithm 2 written from the paper, one step at a time: instance j has threshold
    theta_j = (7/eps) ln(2 T_j / beta_j) + Lap(2/eps), beta_j = 6 beta / (pi^2 j^2), T_1 = 2,
    T_{j+1} = t_j^2; the query at step t is the number of updates since t_{j-1} (one update per
    step) + Lap(4/eps); close when it exceeds the noisy threshold or t >= T_j. Noise is read
    from the PRF under the instance's labels so the noisy case can be compared exactly."""
    closes, prev, j, horizon = [], 0, 1, 2
    while True:
        beta_j = 6 * beta / (math.pi ** 2 * j ** 2)
        noisy_theta = 7 / eps * math.log(2 * horizon / beta_j) + float(noise.laplace(2 / eps, f"svt{j}:threshold", 1)[0])
        offset, closed, block = 0, None, 4
        while closed is None:
            block = min(2 * block, 1024)  # query noise fetched in growing blocks (speed only)
            q_noise = noise.laplace(4 / eps, f"svt{j}:queries", block, start=offset)
            for i in range(block):
                t = prev + offset + i + 1
                if t > n:
                    return closes
                if (t - prev) + q_noise[i] > noisy_theta or t >= horizon:
                    closed = t
                    break
            offset += block
        closes.append(closed)
        prev, j, horizon = closed, j + 1, closed * closed


@pytest.mark.parametrize("epsilon,share", [(0.04, 0.25), (1.0, 0.25), (20.0, 0.25), (400.0, 0.5)])
@pytest.mark.parametrize("secret", [None, TEST_SECRET], ids=["noiseless", "noisy"])
def test_partitioner_matches_algorithm_2_and_respects_horizons(epsilon, share, secret):
    n = 30_000 if epsilon < 100 else 5_000  # at eps_p = 200 segments are 1-2 steps long
    eps_p, beta = epsilon * share, 0.05
    noise = DynamicNoise(NodeNoise(secret) if secret else None, "partition")
    closes = PrivatePartitioner(eps_p, beta, noise).advance(n)
    assert closes == reference_partition(noise, eps_p, beta, n)
    # horizons: first close <= T_1 = 2; then t_j <= T_j = t_{j-1}^2, except that a segment holds
    # at least one step (if t_{j-1} = 1 then T_j = 1 and the close comes at t_{j-1} + 1 = 2)
    assert closes and closes[0] <= 2
    for prev, t in zip(closes, closes[1:]):
        assert prev < t <= max(prev * prev, prev + 1)
    # chunked feeding (across NOISE_CHUNK boundaries) gives the same closes
    rng = np.random.default_rng(61)
    part, fed, chunked = PrivatePartitioner(eps_p, beta, noise), 0, []
    while fed < n:
        k = min(n - fed, int(rng.choice([1, 3, 4095, 4096, 4097, 9000])))
        chunked += part.advance(k)
        fed += k
    assert chunked == closes


def test_partitioner_noiseless_segment_lengths():
    """Without noise SVT fires at the first step whose count exceeds theta_j, i.e. after
    floor(theta_j) + 1 updates, unless the horizon T_j comes first."""
    eps_p, beta = 0.5, 0.05
    closes = PrivatePartitioner(eps_p, beta, DynamicNoise(None, "p")).advance(200_000)
    prev, horizon = 0, 2
    for j, t in enumerate(closes, start=1):
        theta = 7 / eps_p * math.log(2 * horizon / (6 * beta / (math.pi ** 2 * j ** 2)))
        assert t == min(prev + math.floor(theta) + 1, max(horizon, prev + 1))
        prev, horizon = t, t * t
    assert closes[:3] == [2, 4, 16]


# ---------------------------------------------------------------------------- time model and extremes
def test_tail_and_interval_tree_survive_very_large_epsilon():
    # q = exp(-1/scale) underflows for scale < 1/745: the tail is then 0 (it used to raise)
    assert discrete_laplace_tail(1e-3, 0.01) == 0
    plan = DynamicPlan(30000.0, 0.0, 0.05, 0.25, "interval_tree")
    counter = DynamicCounter(plan, ["a", "b"], None, "huge-eps")
    for _ in range(50):
        counter.update("a", "insert")
    assert counter.exact[0] == 50


def test_neighbouring_streams_change_segment_inputs_by_one_update():
    """With ticks (the agent's time model), adding one update moves no other update: whenever the
    two runs close the same segments at the same ticks, the per-segment inputs of the counters
    differ by exactly that one update (L1 = 1 in total). Noise off so the closes coincide: the
    SVT's decisions may legitimately differ between neighbours (that is what its epsilon pays)."""
    plan = DynamicPlan(1.0, 0.0, 0.05, 0.25, "baseline")
    base = [("a" if k % 2 else "b", "insert", 3 + k // 3) for k in range(4000)]  # three updates a tick
    neighbour = base[:1000] + [("c", "insert", base[1000][2])] + base[1000:]  # one more, same tick as its successor

    def per_segment_inserts(stream):
        counter = DynamicCounter(plan, ["a", "b", "c"], None, "neighbours")
        out, last = {}, np.zeros(3, dtype=np.int64)
        for item, op, tick in stream:
            for r in counter.apply(item, op, tick):
                out[(r.segment, r.position)] = r.exact - last
                last = r.exact
        return out

    a, b = per_segment_inserts(base), per_segment_inserts(neighbour)
    common = sorted(set(a) & set(b))
    assert len(common) >= 5
    l1 = sum(int(np.abs(a[s] - b[s]).sum()) for s in common)
    assert l1 == 1, f"L1 change of the per-segment inputs over {len(common)} segments: {l1}"


def test_empty_ticks_are_decided_and_late_updates_rejected():
    plan = DynamicPlan(1.0, 0.0, 0.05, 0.25, "baseline")
    counter = DynamicCounter(plan, ["a"], NodeNoise(TEST_SECRET), "ticks")
    assert [r.position for r in counter.apply("a", "insert", 5)] == [2, 4]  # empty ticks 1..4: horizons T_1 = 2, T_2 = 4
    releases = counter.apply("a", "insert", 300)  # ticks 5..299 decided: horizons 2, 4, 16, 256 close
    assert [(r.segment, r.position) for r in releases] == [(3, 16), (4, 256)]  # T_3 = 4^2, T_4 = 16^2
    assert releases[0].exact.tolist() == [1]
    assert counter.decided == 299
    assert counter.check("a", "insert", 299) is not None
    with pytest.raises(InvalidUpdate):
        counter.apply("a", "insert", 10)
