"""Issue 30, item 2: whether one update is taken in never depends on another party's updates.

Claim under attack (docs/privacy.md, "Dynamic counts"): the dynamic agent is epsilon-DP for adding
or removing one update on *any* stream - valid or not (a delete may name an item that is not
present), with several updates per tick, copies of one item, and an insert and a delete of it in
one segment. The old code refused a delete of an absent item (in tick order), so removing one
party's insert turned another party's later delete from applied to refused: one update changed
the mechanism's input in two.

What is checked, through the real code paths:

* **Filter-free path** (the partitioner, the baseline's two counters): the updates the counter
  takes in are exactly the logged updates of declared items, so removing any one update removes
  exactly that one from what the partitioner counts (one tick, by one) and from what the
  baseline's insert and delete counters are fed (one item, by one).
* **The interval tree's matching** (a delete takes its item's newest live instance, LIFO; one
  with none takes nothing): for a fixed segmentation - the analysis conditions on the
  partitioner's output (adaptive composition) - removing one update changes at most one node per
  level, and each such node's live count by one (one item, one sign) over one contiguous window
  of segment closes. So a node's size and static histogram change by at most 1 and its deletion
  counters' input by at most 2 (the window's two ends): the sensitivity the accountant calibrates
  them to (``TREE_DELETION_SENSITIVITY``). A fixed stream shows that 2 is reached.
* **End to end**: replay takes absent deletes in (no dead letter, nothing counted as invalid) and
  recomputes identical releases on a restart from its state (same updates, same noise).
"""
from __future__ import annotations

import contextlib
import json
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.accountant.dynamic import DynamicPlan
from dpstream.processor.config import DpstreamConfig, DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms import dynamic as mech
from dpstream.processor.mechanisms.dynamic import DynamicCounter, interval_tree_level
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from tests.conftest import TEST_SECRET
from tests.privacy._helpers import START, replay, write_jsonl

ITEMS = ["a", "b", "c"]
OPS = ("insert", "delete")
LAST_TICK = 12
#: ticks decided at the end: past the SVT horizons 2, 4, 16 and 256 (Algorithm 2: T_{j+1} = t_j^2),
#: so some segment closes after the last update and every update reaches the baseline's counters
DECIDE_THROUGH = 300


# ---------------------------------------------------------------------------- strategies
@st.composite
def update_streams(draw, max_tick: int = LAST_TICK, max_size: int = 40):
    """(item index, op, tick) in arrival order, ticks in any order. Three items and many deletes:
    copies of one item, deletes of absent items and inserts and deletes of one item in one tick
    are all common."""
    p_delete = draw(st.sampled_from([0.2, 0.5, 0.7]))
    n = draw(st.integers(1, max_size))
    out = []
    for _ in range(n):
        item = draw(st.integers(0, len(ITEMS) - 1))
        op = "delete" if draw(st.floats(0, 1)) < p_delete else "insert"
        out.append((item, op, draw(st.integers(1, max_tick))))
    return out


def tick_order(stream):
    """The order the engine feeds logged updates in: (tick, arrival)."""
    return sorted(range(len(stream)), key=lambda i: (stream[i][2], i))


# ---------------------------------------------------------------------------- what the counter takes in
@contextlib.contextmanager
def recording():
    """Record what the real counter takes in, by wrapping (and calling through) the real
    methods: each update given to DynamicCounter.apply or apply_many (the engine's path: decided
    updates by the stretch), the per-tick counts given to the partitioner, and the increments fed
    to the baseline's two insertion-only counters."""
    rec = {"taken": [], "ticks": Counter(), "fed": defaultdict(lambda: np.zeros(len(ITEMS), dtype=np.int64))}
    apply, advance, feed = mech.DynamicCounter.apply, mech.PrivatePartitioner.advance, mech.InsertionOnlyCounter.feed
    apply_many = mech.DynamicCounter.apply_many

    def spy_apply(self, item, op, tick):
        rec["taken"].append((self.index[item], op, tick))
        return apply(self, item, op, tick)

    def spy_apply_many(self, items, inserts, ticks):
        rec["taken"] += [(x, "insert" if ins else "delete", t) for x, ins, t in
                         zip(np.asarray(items).tolist(), np.asarray(inserts).tolist(), np.asarray(ticks).tolist())]
        return apply_many(self, items, inserts, ticks)

    def spy_advance(self, counts):
        for k, c in enumerate(np.asarray(counts).tolist()):
            if c:
                rec["ticks"][self.t + 1 + k] += c
        return advance(self, counts)

    def spy_feed(self, increment=None):
        if self.label.startswith("baseline:") and increment is not None:
            rec["fed"][self.label] += increment
        return feed(self, increment)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mech.DynamicCounter, "apply", spy_apply)
        mp.setattr(mech.DynamicCounter, "apply_many", spy_apply_many)
        mp.setattr(mech.PrivatePartitioner, "advance", spy_advance)
        mp.setattr(mech.InsertionOnlyCounter, "feed", spy_feed)
        yield rec


def engine_take_in(stream, mechanism: str) -> dict:
    """Log the stream through DynamicQueryState (the path of replay and the worker), decide the
    ticks up to DECIDE_THROUGH; what the counter took in."""
    q = DynamicQueryConfig(name="nb", items=ITEMS, epsilon=1.0, start=0, tick="1ms", allowed_lateness="0ms",
                           mechanism=mechanism)
    state = DynamicQueryState(q, NodeNoise(TEST_SECRET), Pseudonymizer(TEST_SECRET), MemoryStore())
    batch = WriteBatch()
    with recording() as rec:
        for item, op, tick in stream:
            assert state.apply({"item": ITEMS[item], "op": op, "ts": tick - 1}, batch) is None
        refused = state.advance_clock(DECIDE_THROUGH, batch)
    rec["refused"] = refused or []
    rec["dropped"] = dict(state.dropped)
    return rec


@settings(deadline=None, derandomize=True, max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(update_streams(), st.data(), st.sampled_from(["baseline", "interval_tree"]))
def test_property_removing_one_update_changes_what_the_counter_takes_in_by_exactly_that_update(stream, data, mechanism):
    k = data.draw(st.integers(0, len(stream) - 1), label="removed update")
    neighbour = stream[:k] + stream[k + 1:]
    x, y = engine_take_in(stream, mechanism), engine_take_in(neighbour, mechanism)

    # every logged update of a declared item is taken in, in (tick, arrival) order: nothing refused
    assert x["taken"] == [stream[i] for i in tick_order(stream)]
    assert x["refused"] == [] and x["dropped"].get("malformed", 0) == 0
    # so the neighbour's input is the stream's minus exactly the removed update
    at = tick_order(stream).index(k)
    assert y["taken"] == x["taken"][:at] + x["taken"][at + 1:]

    # the partitioner counts one update less at the removed update's tick, and nothing else moves
    diff = {t: x["ticks"][t] - y["ticks"][t] for t in set(x["ticks"]) | set(y["ticks"])}
    assert {t: d for t, d in diff.items() if d} == {stream[k][2]: 1}

    if mechanism == "baseline":
        # the inserts and deletes counters: one item of one of them, by one (parallel composition)
        label = "baseline:inserts" if stream[k][1] == "insert" else "baseline:deletes"
        for name in ("baseline:inserts", "baseline:deletes"):
            change = x["fed"][name] - y["fed"][name]
            want = np.eye(len(ITEMS), dtype=np.int64)[stream[k][0]] if name == label else np.zeros(len(ITEMS))
            assert np.array_equal(change, want), (name, change)
            # and the counters were fed every update (a segment closed after the last one)
            ops = [u for u in stream if u[1] == ("insert" if name == "baseline:inserts" else "delete")]
            assert np.array_equal(x["fed"][name], np.bincount([u[0] for u in ops], minlength=len(ITEMS)))


# ---------------------------------------------------------------------------- the interval tree's matching
class FixedSegmentation:
    """The partitioner's output held fixed: segments close at the given ticks. The privacy
    argument of the counts is conditional on it (the partitioner is an eps_p-DP mechanism whose
    output the counts then take as given: adaptive composition), so the node inputs of two
    neighbouring streams are compared under one segmentation."""

    def __init__(self, closes):
        self.closes = sorted(closes)
        self.t = 0

    def advance(self, counts) -> list[int]:
        n = len(counts)
        out = [c for c in self.closes if self.t < c <= self.t + n]
        self.t += n
        return out


@contextlib.contextmanager
def node_inputs():
    """Each node's input, by node index: its live count per item at its construction and after
    every later segment close it is stepped at (its own members only, whether or not it halted
    or restarted: the input Algorithm 3 is offered). Recorded by wrapping the real NodeMechanism."""
    traj: dict[int, list[np.ndarray]] = {}
    init, step = mech.NodeMechanism.__init__, mech.NodeMechanism.step

    def spy_init(self, index, level, members, *args, **kwargs):
        self._shadow = dict(members)
        traj[index] = [np.bincount(list(members.values()), minlength=len(ITEMS)).astype(np.int64)]
        init(self, index, level, members, *args, **kwargs)

    def spy_step(self, deleted):
        for iid in deleted:
            self._shadow.pop(iid, None)
        traj[self.index].append(np.bincount(list(self._shadow.values()), minlength=len(ITEMS)).astype(np.int64))
        step(self, deleted)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mech.NodeMechanism, "__init__", spy_init)
        mp.setattr(mech.NodeMechanism, "step", spy_step)
        yield traj


def tree_node_inputs(stream, closes) -> dict[int, list[np.ndarray]]:
    plan = DynamicPlan(2.0, 0.0, 0.05, 0.25, "interval_tree")
    counter = DynamicCounter(plan, ITEMS, None, "nb-tree")
    counter.partitioner = FixedSegmentation(closes)
    with node_inputs() as traj:
        for i in tick_order(stream):
            item, op, tick = stream[i]
            counter.apply(ITEMS[item], op, tick)
        counter.advance_to(max(closes) + 1)
    assert counter.segment == len(closes) + 1
    return traj


def node_differences(a: dict, b: dict) -> dict[int, list[np.ndarray]]:
    """Per node index, the difference of its live counts at each of its closes (same segmentation:
    the same nodes, stepped the same number of times)."""
    assert set(a) == set(b)
    out = {}
    for index in a:
        assert len(a[index]) == len(b[index])
        out[index] = [u - v for u, v in zip(a[index], b[index])]
    return out


def check_one_window_per_level(diffs: dict[int, list[np.ndarray]]) -> int:
    """The lemma of docs/privacy.md, "Dynamic counts"; returns the largest L1 change of a node's
    deletion-counter input (and checks it against the accountant's sensitivity)."""
    from dpstream.accountant.dynamic import TREE_DELETION_SENSITIVITY

    levels_changed = Counter()
    worst = 0
    for index, diff in diffs.items():
        nonzero = [t for t, d in enumerate(diff) if d.any()]
        if not nonzero:
            continue
        levels_changed[interval_tree_level(index)] += 1
        # one item, one sign, by one, over one contiguous window of closes
        assert all(int(np.abs(d).sum()) == 1 for d in diff if d.any()), (index, diff)
        assert all(np.array_equal(diff[t], diff[nonzero[0]]) for t in nonzero), (index, diff)
        assert nonzero == list(range(nonzero[0], nonzero[-1] + 1)), (index, nonzero)
        # so: size and histogram at any round start change by <= 1; the deletion stream (the
        # count lost at each close) by <= 2 in L1, and by <= 1 if the construction's histogram changed
        deletions = [int(np.abs(diff[t - 1] - diff[t]).sum()) for t in range(1, len(diff))]
        assert int(np.abs(diff[0]).sum()) <= 1
        assert sum(deletions) <= TREE_DELETION_SENSITIVITY
        assert sum(deletions) <= 1 or not diff[0].any()
        worst = max(worst, sum(deletions))
    assert all(n == 1 for n in levels_changed.values()), levels_changed  # at most one node per level
    return worst


@st.composite
def segmented_streams(draw):
    last = draw(st.integers(4, 40))
    stream = draw(update_streams(max_tick=last, max_size=60))
    closes = set(draw(st.lists(st.integers(1, last), max_size=last))) | {last}
    return stream, sorted(closes)


@settings(deadline=None, derandomize=True, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(segmented_streams(), st.data())
def test_property_interval_tree_one_update_changes_one_node_per_level_over_one_window(case, data):
    stream, closes = case
    k = data.draw(st.integers(0, len(stream) - 1), label="removed update")
    neighbour = stream[:k] + stream[k + 1:]
    check_one_window_per_level(node_differences(tree_node_inputs(stream, closes), tree_node_inputs(neighbour, closes)))


def test_interval_tree_deletion_counters_need_sensitivity_two():
    """A fixed pair where one node's deletion stream changes at both ends of its window. Segments
    1..7 close at ticks 1..7; node v4 (level 3) holds the live instances inserted in segments
    1..4 and is read at closes 4..7. x: insert a at 1 and 3, delete a at 5, 6 and 7 (the last
    finds nothing: refused in the old code). The neighbour adds an insert of a at 5, before the
    delete there: that delete takes the new copy (same segment: discarded), the delete at 6 takes
    v4's newer copy, the one at 7 its older. v4 loses one copy at closes 5 and 6 under x, at 6 and
    7 under the neighbour: -1 at 5 and +1 at 7, an L1 change of 2."""
    x = [(0, "insert", 1), (0, "insert", 3), (0, "delete", 5), (0, "delete", 6), (0, "delete", 7)]
    neighbour = x[:2] + [(0, "insert", 5)] + x[2:]
    closes = list(range(1, 8))
    diffs = node_differences(tree_node_inputs(neighbour, closes), tree_node_inputs(x, closes))
    assert [d.tolist() for d in diffs[4]] == [[0, 0, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert check_one_window_per_level(diffs) == 2


def test_the_accountant_calibrates_the_tree_deletion_counters_to_sensitivity_two():
    """The interval tree's node budget stays eps(v) = 4 sum_r eps_r with its deletion counters
    calibrated to the lemma's sensitivity 2 (twice the noise scale of a sensitivity-1 counter at
    the same eps_r), its size and histogram to 1; `plan` reports it. The baseline's counters
    keep sensitivity 1."""
    from dpstream.accountant.dynamic import TREE_DELETION_SENSITIVITY, counter_scales

    assert TREE_DELETION_SENSITIVITY == 2
    tree = DynamicPlan(2.0, 0.0, 0.05, 0.25, "interval_tree")
    assert tree.to_dict()["deletion_counter_sensitivity"] == 2
    assert DynamicPlan(2.0, 0.0, 0.05, 0.25, "baseline").to_dict()["deletion_counter_sensitivity"] is None
    for step in (1, 2, 3, 7, 8, 100):
        one, two = counter_scales(0.3, step), counter_scales(0.3, step, 2)
        assert two == pytest.approx((2 * one[0], 2 * one[1]))

    noise = mech.DynamicNoise(NodeNoise(TEST_SECRET), "calibration")
    node = mech.NodeMechanism(1, 1, {i: i % 3 for i in range(50)}, 0.9, 0.05, 3, noise, "v1")
    for _ in range(5):
        node.step([])
    eps_r = node.eps_r
    reference = mech.InsertionOnlyCounter(eps_r, 3, noise, "reference")
    for _ in range(5):
        reference.feed(None)
    assert node.q_ins.scales() == pytest.approx([2 * s for s in reference.scales()])
    assert node.lap_ins.scales() == pytest.approx([2 * s for s in reference.scales()])
    # an item's interval: the static histogram's 1 / eps_r and the deletion counter's nodes
    assert node.noise_scales() == pytest.approx([1 / eps_r] + [2 * s for s in reference.scales()])
    baseline = DynamicCounter(DynamicPlan(2.0, 0.0, 0.05, 0.25, "baseline"), ITEMS, NodeNoise(TEST_SECRET), "b")
    assert baseline.inserts.sensitivity == baseline.deletes.sensitivity == 1


# ---------------------------------------------------------------------------- end to end (replay)
def absent_delete_stream() -> list[dict]:
    """Updates one per tick (ms 0..), many of them deletes of absent items: 'c' is deleted before
    it is ever inserted, 'b' more often than it was inserted."""
    rng = np.random.default_rng(30)
    out = [{"item": "c", "op": "delete", "ts": START + 1}]
    for t in range(1, 3000):
        item = ITEMS[int(rng.integers(2))] if rng.random() < 0.9 else "c"
        op = "delete" if (item == "b" and rng.random() < 0.6) or rng.random() < 0.3 else "insert"
        out.append({"item": item, "op": op, "ts": START + t * 1000 + 1})
    return out


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
def test_replay_takes_in_absent_deletes_and_recomputes_identical_releases(tmp_path, mechanism):
    config = DpstreamConfig(dynamic=[DynamicQueryConfig(name="plans", items=ITEMS, epsilon=1.0, start=START, tick="1s",
                                                        mechanism=mechanism)])
    rows = absent_delete_stream()
    path = write_jsonl(tmp_path / "u.jsonl", rows)
    until = START + 3100 * 1000
    whole = replay(config, path, state_dir=tmp_path / "whole", until_ms=until)
    # no update is refused for what other updates did: no dead letter, nothing counted as invalid
    assert whole.dead == [] and not whole.summary.invalid
    releases = [r for r in whole.records if "segment" in r]
    assert len(releases) >= 5
    if mechanism == "baseline":
        # inserts minus deletes: 'c' starts with a delete and 'b' is deleted more than inserted,
        # so the truth the baseline estimates is negative; its noisy count follows it
        truth_b = sum(1 if r["op"] == "insert" else -1 for r in rows if r["item"] == "b")
        assert truth_b < -100 and releases[-1]["counts"]["b"] < 0
    # stopped mid-way and resumed from its state: the same releases (same updates, same noise)
    first = replay(config, path, state_dir=tmp_path / "split", stop_after=1400)
    rest = replay(config, path, state_dir=tmp_path / "split", until_ms=until)
    canon = [json.dumps(r, sort_keys=True) for r in whole.records]
    assert [json.dumps(r, sort_keys=True) for r in first.records + rest.records] == canon
