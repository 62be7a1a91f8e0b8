"""Confidence intervals on releases and ISO-8601 times (docs/privacy.md, "Error bars";
docs/operations.md, "Topics and records").

* The half-widths equal an independent computation: scipy's normal quantile times the noise
  standard deviation (the tree's from its Honaker weights), and the exact quantile of discrete
  Laplace sums (scipy's ``dlaplace``, convolved with numpy).
* Exact coverage of the binary tree's rounded release noise, computed from the discrete Gaussian
  probabilities of every node (no sampling), is at least the level.
* Statistical coverage through the real pipeline and the real dynamic counter: with the test
  secret and fixed data, the share of intervals containing the true (bounded) value is at least
  0.95 less a binomial tolerance: each test takes one release per key (or per item), so the
  intervals have independent noise, and refuses a share that a true coverage of 0.95 would give
  less than once in 1,000 (``scipy.stats.binom.ppf(0.001, n, 0.95)``).
* Bounds are integers for counts and on the grid for sums; ISO times equal the epoch ms.
"""
import datetime
import io
import json
import math
from collections import defaultdict

import numpy as np
import pytest
from scipy import signal, stats

from dpstream.accountant.counters import BINARY_TREE, BLT, lattice_scale
from dpstream.accountant.intervals import (
    CI_FIELD,
    CI_LEVEL,
    discrete_laplace_sum_halfwidth,
    gaussian_halfwidth_units,
    normal_quantile,
)
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import (
    DpstreamConfig,
    DynamicQueryConfig,
    QueryConfig,
    level_plans_for,
)
from dpstream.processor.engine.dynamic_stream import dynamic_release_record
from dpstream.processor.mechanisms.dynamic import ShardedCounter
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.topics.records import iso_utc
from tests.conftest import TEST_LABEL, TEST_SECRET

LOW, HIGH = f"{CI_FIELD}_low", f"{CI_FIELD}_high"
DAY = 86_400_000
START = 1_795_132_800_000  # 2026-11-20T00:00:00Z
#: a share of n intervals below this is refused: P(Binomial(n, 0.95) < it) <= 0.001
REFUSE_BELOW = 0.001


def min_covered(n: int) -> int:
    """The fewest covering intervals out of n that a coverage of 0.95 plausibly gives: the 0.1%
    quantile of Binomial(n, 0.95)."""
    return int(stats.binom.ppf(REFUSE_BELOW, n, CI_LEVEL))


# ------------------------------------------------------------------ half-widths, computed independently


def honaker_prefix_weights(step: int) -> list[tuple[float, int]]:
    """(weight, number of node draws) of the noise of the Honaker prefix at ``step``: the
    complete level-l node of each set bit, estimate ``F_l / D_l`` with ``F_l = sum_m 2^m (sum of
    the level-m draws below)`` and ``D_l = 2^(l+1) - 1`` (DP-SQLP eqs. (1)-(2))."""
    out = []
    for level in range(step.bit_length()):
        if step >> level & 1:
            denominator = 2 ** (level + 1) - 1
            out += [(2 ** m / denominator, 2 ** (level - m)) for m in range(level + 1)]
    return out


@pytest.mark.parametrize("sigma", [0.7, 3.0, 129.5])
@pytest.mark.parametrize("steps", [8, 100])
def test_tree_halfwidth_is_the_normal_quantile_of_the_honaker_stddev(sigma, steps):
    z = stats.norm.ppf(0.975)
    for step in range(1, steps + 1):
        sd = sigma * math.sqrt(sum(w * w * n for w, n in honaker_prefix_weights(step)))
        assert gaussian_halfwidth_units(BINARY_TREE, sigma, step, steps) == math.ceil(z * sd), step


@pytest.mark.parametrize("sigma", [2.5, 206.0, 5000.0])
def test_blt_halfwidth_adds_the_rounding_bound_on_its_lattice(sigma):
    z = stats.norm.ppf(0.975)
    for steps in (24, 1000):
        for step in (1, 2, steps // 2, steps):
            sd = sigma * math.sqrt(BLT.step_variance(step, steps))
            bias = BLT.bias_units(step, steps) / lattice_scale(sigma)
            half = gaussian_halfwidth_units(BLT, sigma, step, steps)
            assert half == math.ceil(z * sd + bias), (steps, step)
            assert half >= z * sd + bias


def test_normal_quantile_matches_scipy():
    for level in (0.5, 0.9, 0.95, 0.99):
        assert normal_quantile(level) == pytest.approx(stats.norm.ppf(0.5 + level / 2), rel=1e-12)


def exact_laplace_sum_quantile(scales, level=CI_LEVEL) -> int:
    """The smallest h with P(|sum| <= h) >= level, by convolving scipy's dlaplace pmfs on a range
    that holds all but 1e-15 of each draw."""
    pmf = np.array([1.0])
    for s in scales:
        a = 1.0 / s
        reach = int(stats.dlaplace.isf(1e-16, a)) + 1
        pmf = np.convolve(pmf, stats.dlaplace.pmf(np.arange(-reach, reach + 1), a))
    mid = len(pmf) // 2
    covered = pmf[mid] + 2 * np.cumsum(pmf[mid + 1:])
    return int(np.searchsorted(np.concatenate([[pmf[mid]], covered]), level - 1e-12))


@pytest.mark.parametrize("scales", [[1.0], [10.0], [333.3], [8.0, 8.0], [2.0, 30.0, 5.5], [40.0] * 6 + [120.0, 3.0]])
def test_laplace_sum_halfwidth_is_the_exact_quantile(scales):
    """Valid (never below the exact quantile) and tight (at most one above it)."""
    exact = exact_laplace_sum_quantile(scales)
    ours = discrete_laplace_sum_halfwidth(scales)
    assert exact <= ours <= exact + 1, (exact, ours)


def test_laplace_sum_halfwidth_is_valid_beyond_the_exact_range():
    """Sums too wide for the exact computation get the Chernoff or union bound: still at least the
    exact quantile (here: the central limit's normal quantile is within 1% of it, 300 equal draws)."""
    scales = [2000.0] * 300
    q = math.exp(-1 / 2000.0)
    normal = stats.norm.ppf(0.975) * math.sqrt(300 * 2 * q / (1 - q) ** 2)
    ours = discrete_laplace_sum_halfwidth(scales)
    assert normal * 0.99 <= ours <= 1.5 * normal
    assert discrete_laplace_sum_halfwidth([2000.0] * 3, copies=100) == ours  # copies are draws of each scale
    assert discrete_laplace_sum_halfwidth([]) == 0


# ------------------------------------------------------------------ exact coverage of the tree's noise


def discrete_gaussian_pmf(sigma: float) -> np.ndarray:
    reach = int(12 * sigma) + 2
    k = np.arange(-reach, reach + 1)
    p = np.exp(-k.astype(float) ** 2 / (2 * sigma ** 2))
    return p / p.sum()


def exact_tree_coverage(sigma: float, step: int, half: int) -> float:
    """P(|round(N)| <= half) for the tree's prefix noise N at ``step``, exactly: N times the
    common odd denominator L is an integer sum of integer multiples of independent discrete
    Gaussians, whose distribution is a convolution; round(N) = k means |N L| < (k + 1/2) L."""
    weights = honaker_prefix_weights(step)
    denominators = [2 ** (level + 1) - 1 for level in range(step.bit_length()) if step >> level & 1]
    L = math.lcm(*denominators)
    base = discrete_gaussian_pmf(sigma)
    pmf = np.array([1.0])
    for w, n in weights:
        c = round(w * L)
        assert c == w * L
        spread = np.zeros((len(base) - 1) * c + 1)
        spread[::c] = base
        for _ in range(n):
            pmf = signal.fftconvolve(pmf, spread)
    pmf = np.clip(pmf, 0, None)
    pmf /= pmf.sum()
    mid = len(pmf) // 2
    reach = int((half + 0.5) * L)  # (half + 1/2) L is a half-integer: no value on the boundary
    return float(pmf[mid - reach: mid + reach + 1].sum())


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.5, 7.0, 30.0, 100.0])
def test_tree_release_noise_is_covered_exactly_at_the_level(sigma):
    """Not sampled: the exact probability that the release's rounded noise is within the
    half-width, for every step of an 8-trigger tree (denominators 1, 3, 7, 15)."""
    for step in range(1, 9):
        half = gaussian_halfwidth_units(BINARY_TREE, sigma, step, 8)
        assert exact_tree_coverage(sigma, step, half) >= CI_LEVEL, (sigma, step, half)


# ------------------------------------------------------------------ coverage through the pipeline


def trigger_of(ts: int, triggers: int) -> int:
    return (ts - START) // (DAY // triggers) + 1


def coverage_run(tmp_path, aggregate: str, counter: str, keys: int = 1500, users: int = 40, triggers: int = 8):
    """A replay of ``keys`` keys with ``users`` distinct users each (one record per user, C = 1:
    nothing is dropped), spread over the window; returns the releases and, per (key, trigger),
    the true count and sum of the records up to that trigger."""
    rng = np.random.default_rng(11)
    extra = dict(aggregate="mean", value_field="v", clamp=8.0, resolution=1.0, composition="zcdp") if aggregate == "mean" else {}
    query = QueryConfig(name="q", window="1d", triggers=triggers, contribution_bound=1, epsilon=3.0, delta=1e-6,
                        key_selection_share=0.9, counter=counter, allowed_lateness="0s", **extra)
    events = []
    for k in range(keys):
        for u in range(users):
            events.append({"user_id": f"k{k}u{u}", "key": f"k{k}", "v": int(rng.integers(0, 8)), "ts": START + int(rng.integers(0, DAY))})
    events.sort(key=lambda e: e["ts"])
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    runner = ReplayRunner(DpstreamConfig(queries=[query]), TEST_SECRET, None, log=io.StringIO(), noise_label=TEST_LABEL)
    out = io.StringIO()
    try:
        runner.run(str(path), out)
        assert runner.pipelines[0].stats.dropped.total() == 0
    finally:
        runner.close()
    per_trigger = defaultdict(lambda: np.zeros((triggers + 1, 2)))
    for e in events:
        per_trigger[e["key"]][trigger_of(e["ts"], triggers)] += (1, e["v"])
    truth = {key: np.cumsum(a, axis=0) for key, a in per_trigger.items()}
    return [json.loads(line) for line in out.getvalue().splitlines()], truth, level_plans_for(query)[0]


def assert_covers(releases, truth, value: str, low: str, high: str, column: int):
    """One release per key is one independent interval: the first and the last release of each
    key are checked as two samples."""
    for pick in (0, -1):
        chosen = {}
        for r in releases:
            chosen.setdefault(r["key"], []).append(r)
        sample = [rs[pick] for rs in chosen.values()]
        n = len(sample)
        assert n >= 1000
        covered = sum(r[low] <= truth[r["key"]][r["trigger"], column] <= r[high] for r in sample)
        assert covered >= min_covered(n), f"{value}: {covered}/{n} = {covered / n:.4f} of the intervals cover the truth"


@pytest.mark.statistical
@pytest.mark.parametrize("counter", ["tree", "blt"])
def test_count_intervals_cover_the_bounded_truth(tmp_path, counter):
    releases, truth, plan = coverage_run(tmp_path, "count", counter)
    assert len({r["trigger"] for r in releases}) >= 4  # releases at many steps
    for r in releases:
        half = r[HIGH] - r["count"]
        assert type(r[LOW]) is int and type(r[HIGH]) is int and r["count"] - r[LOW] == half >= 1
        assert half >= 1.96 * r["stddev"]
    assert_covers(releases, truth, "count", LOW, HIGH, 0)


@pytest.mark.statistical
@pytest.mark.parametrize("counter", ["tree", "blt"])
def test_mean_intervals_cover_the_bounded_sum_and_count(tmp_path, counter):
    releases, truth, plan = coverage_run(tmp_path, "mean", counter)
    step = plan.resolution
    for r in releases:
        for column in ("sum", "count"):
            lo, hi = r[f"{column}_{LOW}"], r[f"{column}_{HIGH}"]
            assert r[column] - lo == hi - r[column] > 0
        assert type(r[f"count_{LOW}"]) is int and type(r[f"count_{HIGH}"]) is int
        assert (r[f"sum_{LOW}"] / step).is_integer() and (r[f"sum_{HIGH}"] / step).is_integer()
        assert "mean_" + LOW not in r
    assert_covers(releases, truth, "sum", f"sum_{LOW}", f"sum_{HIGH}", 1)
    assert_covers(releases, truth, "count", f"count_{LOW}", f"count_{HIGH}", 0)


# ------------------------------------------------------------------ dynamic counts


@pytest.mark.statistical
@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
def test_dynamic_intervals_cover_the_live_counts(mechanism):
    """3,000 items, inserts and deletes: each release's items have independent noise, so the last
    release and a middle one are two samples of 3,000 intervals each."""
    items = [f"i{j}" for j in range(3000)]
    query = DynamicQueryConfig(name=f"cover-{mechanism}", items=items, start=START, tick="1s", epsilon=1.0, mechanism=mechanism)
    counter = ShardedCounter(query.plan(), items, NodeNoise(TEST_SECRET, "intervals"), query.name)  # one shard
    rng = np.random.default_rng(3)
    live, releases = [], []
    for _ in range(30_000):
        if live and rng.random() < 0.3:
            item, op = live.pop(int(rng.integers(len(live)))), "delete"
        else:
            item, op = items[int(rng.integers(len(items)))], "insert"
            live.append(item)
        release = counter.counters[0].update(item, op)
        if release is not None:
            releases.append((release, dynamic_release_record(query, counter, release)))
    assert len(releases) >= 3
    for release, record in (releases[len(releases) // 2], releases[-1]):
        exact = dict(zip(items, release.exact.tolist()))
        assert record["time_iso"] == iso_utc(record["time"])
        assert all(type(record[b][i]) is int for b in (LOW, HIGH) for i in items)
        half = {record[HIGH][i] - record["counts"][i] for i in items}
        assert len(half) == 1 and half == {record["counts"][i] - record[LOW][i] for i in items}
        assert half.pop() == discrete_laplace_sum_halfwidth(release.noise_scales)
        covered = sum(record[LOW][i] <= exact[i] <= record[HIGH][i] for i in items)
        assert covered >= min_covered(len(items)), f"{covered}/{len(items)}"
        total = int(release.exact.sum())
        assert record[f"total_{LOW}"] <= record["total"] <= record[f"total_{HIGH}"]
        assert record[f"total_{HIGH}"] - record["total"] == discrete_laplace_sum_halfwidth(release.noise_scales, copies=len(items))
        assert record[f"total_{LOW}"] <= total <= record[f"total_{HIGH}"]


# ------------------------------------------------------------------ every release path: grid, integers, ISO times


def _epoch_ms(text: str) -> int:
    moment = datetime.datetime.fromisoformat(text)
    assert moment.utcoffset() == datetime.timedelta(0) and text.endswith("Z")
    return (moment - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)) // datetime.timedelta(milliseconds=1)


def test_iso_times_equal_their_epoch_ms():
    for ms in (0, -1, 1, 999, START, START + 84_375, 4_102_444_800_000, 253_402_300_799_999):
        assert _epoch_ms(iso_utc(ms)) == ms
    assert iso_utc(START) == "2026-11-20T00:00:00Z"
    assert iso_utc(START + 84_375) == "2026-11-20T00:01:24.375Z"


@pytest.mark.slow
def test_every_release_path_carries_intervals_and_iso_times(tmp_path):
    """One replay with a count (1,024 triggers: trigger times in milliseconds), a sum (BLT), a mean, a
    hierarchy (whose re-issued records repeat their release's interval) and a dynamic query."""
    rng = np.random.default_rng(8)
    queries = [
        QueryConfig(name="c", window="1d", triggers=1024, contribution_bound=2, epsilon=6.0, delta=1e-9, allowed_lateness="0s",
                    counter="tree"),
        QueryConfig(name="s", window="1d", triggers=6, contribution_bound=2, epsilon=6.0, delta=1e-9, allowed_lateness="0s",
                    aggregate="sum", value_field="v", clamp=10.0),
        QueryConfig(name="m", window="1d", triggers=4, contribution_bound=2, epsilon=6.0, delta=1e-9, allowed_lateness="0s",
                    aggregate="mean", value_field="v", clamp=10.0, composition="zcdp", counter="tree"),
        QueryConfig(name="h", window="1d", triggers=4, contribution_bound=4, epsilon=6.0, delta=1e-6, allowed_lateness="0s",
                    key_fields=["a", "b", "city"], hierarchy=True, counter="tree"),
    ]
    dynamic = [DynamicQueryConfig(name="d", items=["x", "y", "z"], start=START, tick="1s", epsilon=1.0, mechanism="interval_tree")]
    places = [(f"A{a}", f"B{b}", f"C{c}") for a in range(3) for b in range(4) for c in range(5)]
    zipf = 1.0 / np.arange(1, len(places) + 1) ** 1.1  # skewed: some keys are released at some triggers only
    rows = [dict(zip(("a", "b", "city"), places[int(rng.choice(len(places), p=zipf / zipf.sum()))]),
                 user_id=f"u{rng.integers(0, 3000)}", key=f"k{rng.geometric(0.3)}", v=float(rng.uniform(-3, 12)),
                 ts=START + int(rng.integers(0, DAY))) for _ in range(16_000)]
    rows.sort(key=lambda r: r["ts"])
    updates = [{"item": "xyz"[i % 3], "op": "insert", "ts": START + i * 500} for i in range(2000)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + updates))
    config = DpstreamConfig(queries=queries, dynamic=dynamic)

    def replay():
        runner = ReplayRunner(config, TEST_SECRET, None, log=io.StringIO(), noise_label=TEST_LABEL)
        out = io.StringIO()
        try:
            runner.run(str(path), out)
        finally:
            runner.close()
        return out.getvalue()

    text = replay()
    assert text == replay()  # byte-identical
    records = [json.loads(line) for line in text.splitlines()]
    by_query = defaultdict(list)
    for r in records:
        by_query[r["query"]].append(r)
    assert set(by_query) == {"c", "s", "m", "h", "d"}
    steps = {q.name: level_plans_for(q)[0].resolution for q in queries}
    for r in records:
        times = [f for f in ("window_start", "window_end", "trigger_time", "time") if f in r]
        assert times and all(_epoch_ms(r[f + "_iso"]) == r[f] for f in times)
        if r["query"] == "d":
            continue
        for value, low, high in (("count", LOW, HIGH), ("sum", LOW, HIGH), ("sum", f"sum_{LOW}", f"sum_{HIGH}"),
                                 ("count", f"count_{LOW}", f"count_{HIGH}")):
            if value in r and low in r:
                assert r[value] - r[low] == r[high] - r[value] > 0
                if value == "count":
                    assert type(r[value]) is int and type(r[low]) is int and type(r[high]) is int
                else:
                    assert (r[low] / steps[r["query"]]).is_integer() and (r[high] / steps[r["query"]]).is_integer()
        assert (LOW in r) != (r["query"] == "m") and (f"sum_{LOW}" in r) == (r["query"] == "m")
    assert any(not r["trigger_time_iso"].endswith(":00Z") and "." in r["trigger_time_iso"] for r in by_query["c"])
    # hierarchy: a re-issued record (its noisy count released earlier) carries its release's interval
    original = {(tuple(r["key"]), r["trigger"]): r for r in by_query["h"] if r["released_at"] == r["trigger"]}
    reissued = [r for r in by_query["h"] if r["released_at"] != r["trigger"]]
    assert reissued
    for r in reissued:
        first = original[(tuple(r["key"]), r["released_at"])]
        assert (r["count"], r[LOW], r[HIGH]) == (first["count"], first[LOW], first[HIGH])
        assert "consistent_" + LOW not in r
