"""``dpstream bench dynamic --ranges``: where the interval tree earns its place (issue 33, item 5).

Qiu & Yi's online interval tree makes the error of a dynamic release depend on the live data size
n_t, where the insert/delete baseline's depends on the number of updates N_t (papers/dp-on-
dynamic-data-online-interval-tree.txt, section 1.3). That only matters for a static release whose
error grows with the data size. This benchmark takes one: range counts over ordered items
answered by multiplicative weights (``static_release: mwem_ranges``, the paper's PMW, Appendix
A.1: error ~ |D|^(2/3)), and runs all four combinations on the same heavy-churn streams:

* ``baseline`` + ``histogram`` - the product's default: Laplace noise per item, insert minus delete
  counters; a range's error does not grow with the data;
* ``baseline`` + ``mwem_ranges`` - the baseline the paper improves on, for this query class: two
  insertion-only MWEM constructions (inserts, deletes), whose error grows with N_t;
* ``interval_tree`` + ``mwem_ranges`` - the paper's construction (Algorithm 3 at each node, MWEM
  as its static release and in its Q-Ins), whose error should follow n_t;
* ``interval_tree`` + ``histogram``.

Workload: ``items`` ordered buckets (e.g. of a numeric attribute), inserts Zipf-distributed over
them (``dynamic.generate_stream``, heavy churn: n_t reverts to ``live``), deletes of present
copies; ``per_tick`` updates share a tick, so a stream of N updates has N / per_tick ticks and at
most that many segments. For each N in ``histories`` and each seed, all four run on the identical
stream and secret (their partitioners close segments at the same ticks).

Metric, at each release: the mean absolute error over all d (d + 1) / 2 ranges of the items (and
the largest), against the exact live counts; per run the median over the second half of the
releases. Also the paper's bound shape :func:`dpstream.accountant.dynamic.pmw_error` at n_t and at
N_t with the query's epsilon, and, per combination, the slope of log error against log N.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from dpstream.accountant.dynamic import DynamicPlan, level_epsilon, pmw_error, round_epsilon
from dpstream.processor.bench.dynamic import generate_stream
from dpstream.processor.bench.report import machine
from dpstream.processor.mechanisms.dynamic import DynamicCounter
from dpstream.processor.mechanisms.linear_queries import range_queries
from dpstream.processor.mechanisms.noise import NodeNoise

COMBINATIONS = (("baseline", "histogram"), ("baseline", "mwem_ranges"), ("interval_tree", "mwem_ranges"),
                ("interval_tree", "histogram"))


def run_ranges(plan: DynamicPlan, labels: list[str], secret: bytes, stream: tuple[np.ndarray, np.ndarray],
               per_tick: int) -> dict:
    """Feed one stream (``per_tick`` updates a tick) to a fresh counter; per release: N_t, n_t,
    the mean and the largest range error."""
    counter = DynamicCounter(plan, labels, NodeNoise(secret), "bench-ranges")
    queries = range_queries(len(labels))
    items, inserts = stream
    ticks = np.arange(len(items), dtype=np.int64) // per_tick + 1
    start = time.perf_counter()
    releases = counter.apply_many(items, inserts, ticks) + counter.advance_to(int(ticks[-1]) + 1)
    seconds = time.perf_counter() - start
    curve = {"N": [], "n": [], "mean_error": [], "max_error": [], "seconds": seconds}
    if plan.mechanism == "interval_tree":  # why the tree's nodes are noisy: levels and restarts
        kept = list(counter.tree.nodes.values())
        retired = [restarts for _, restarts in counter.tree.stats["restarts"]] + [node.restarts for node in kept]
        curve["tree"] = {"levels": max(node.level for node in kept), "restarts_median": float(np.median(retired)),
                         "restarts_max": int(max(retired)), "halted_at_end": sum(node.halted for node in kept),
                         "nodes_built": counter.tree.stats["nodes_built"]}
    for release in releases:
        error = np.abs(queries.answers(np.asarray(release.counts, dtype=np.float64)) - queries.answers(release.exact))
        curve["N"].append(int(min(release.position, ticks[-1]) * per_tick))
        curve["n"].append(int(release.exact.sum()))
        curve["mean_error"].append(float(error.mean()))
        curve["max_error"].append(float(error.max()))
    return curve


def _second_half_median(values: list[float]) -> float:
    return float(np.median(values[len(values) // 2:])) if values else float("nan")


def run_ranges_bench(histories: tuple[int, ...] = (20_000, 200_000, 2_000_000), items: int = 32, live: int = 2_000,
                     per_tick: int | None = None, epsilon: float = 1.0, beta: float = 0.05, partition_share: float = 0.25,
                     seeds: int = 3, json_path: str | None = None, out=sys.stderr) -> dict:
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    wall = time.perf_counter()
    labels = [f"bucket{k:03d}" for k in range(items)]
    queries = len(range_queries(items))
    p(f"bench dynamic --ranges: {items} ordered items ({queries:,} ranges), heavy churn around {live:,} live, "
      f"histories {', '.join(f'{h:,}' for h in histories)} updates, eps={epsilon:g}, {seeds} seed(s)")
    rows = []
    for history in histories:
        tick_size = per_tick or max(1, history // 100)  # about 100 ticks a stream: a bounded number of segments
        per_seed = {f"{m}+{r}": [] for m, r in COMBINATIONS}
        for seed in range(seeds):
            stream = generate_stream("heavy_churn", history, items, seed, target=live)
            secret = os.urandom(32)  # throwaway: synthetic data, nothing is published
            for mechanism, release in COMBINATIONS:
                plan = DynamicPlan(epsilon, 0.0, beta, partition_share, mechanism, release)
                curve = run_ranges(plan, labels, secret, stream, tick_size)
                per_seed[f"{mechanism}+{release}"].append({
                    "segments": len(curve["N"]), "mean_error": _second_half_median(curve["mean_error"]),
                    "max_error": _second_half_median(curve["max_error"]), "n": _second_half_median(curve["n"]),
                    "N": _second_half_median(curve["N"]), "seconds": curve["seconds"], **curve.get("tree", {})})
                p(f"  N={history:>9,} seed {seed} {mechanism:13s} {release:11s}: {len(curve['N']):3d} releases, "
                  f"mean range error {per_seed[f'{mechanism}+{release}'][-1]['mean_error']:9.1f}, {curve['seconds']:.1f} s")
        row = {"history": history, "per_tick": tick_size,
               "results": {name: {k: float(np.median([s[k] for s in runs])) for k in runs[0]} for name, runs in per_seed.items()},
               "per_seed": per_seed}
        base = row["results"]["baseline+histogram"]
        row["bound_at_n"] = pmw_error(base["n"], epsilon, items, queries, beta)
        row["bound_at_N"] = pmw_error(base["N"], epsilon, items, queries, beta)
        rows.append(row)
    slopes, steps = {}, []
    if len(rows) > 1:
        logn = np.log([r["history"] for r in rows])
        for name in rows[0]["results"]:
            errors = [max(r["results"][name]["mean_error"], 1e-9) for r in rows]
            slopes[name] = float(np.polyfit(logn, np.log(errors), 1)[0])
        # between consecutive histories: where the segment count stays (about 100 ticks each),
        # the growth is the static release's, not the tree's depth
        for a, b in zip(rows, rows[1:]):
            steps.append({"from": a["history"], "to": b["history"],
                          "segments": [a["results"]["baseline+histogram"]["segments"], b["results"]["baseline+histogram"]["segments"]],
                          **{name: float(np.log(max(b["results"][name]["mean_error"], 1e-9) / max(a["results"][name]["mean_error"], 1e-9))
                                         / np.log(b["history"] / a["history"])) for name in a["results"]}})
    elapsed = time.perf_counter() - wall

    p()
    names = [f"{m}+{r}" for m, r in COMBINATIONS]
    header = f"{'N (updates)':>12s} {'n_t':>6s} " + " ".join(f"{n:>27s}" for n in names) + f" {'tree/base MWEM':>14s}"
    p("mean error over every range, median of the second half of the releases (medians over seeds):")
    p(header)
    p("-" * len(header))
    for r in rows:
        res = r["results"]
        ratio = res["interval_tree+mwem_ranges"]["mean_error"] / max(res["baseline+mwem_ranges"]["mean_error"], 1e-9)
        p(f"{r['history']:12,d} {res['baseline+histogram']['n']:6.0f} " + " ".join(f"{res[n]['mean_error']:27.1f}" for n in names)
          + f" {ratio:13.2f}x")
    tree = rows[-1]["results"]["interval_tree+mwem_ranges"]
    plan = DynamicPlan(epsilon, 0.0, beta, partition_share, "interval_tree", "mwem_ranges")
    levels, restarts = int(tree["levels"]), int(round(tree["restarts_median"]))
    node_eps = {lvl: round_epsilon(level_epsilon(plan.epsilon_counts, lvl), 1 + restarts) for lvl in (1, levels)}
    p(f"why, at N={rows[-1]['history']:,}: the tree had {levels} levels and its nodes restarted {tree['restarts_median']:.0f} "
      f"times (median; at most {tree['restarts_max']:.0f}); each of a node's four mechanisms at level 1 or {levels} in round "
      f"{1 + restarts} runs at eps {node_eps[1]:.2g} or {node_eps[levels]:.2g}, its deletion counters at half that "
      f"(sensitivity 2), against the baseline's {plan.epsilon_counts:g} (section 4.3: 6 / (pi^2 l^2) per level, "
      f"3 / (2 pi^2 r^2) per round), and a release adds the answers of up to {levels} nodes")
    for step in steps:
        p(f"slope from N={step['from']:,} to {step['to']:,} ({step['segments'][0]:.0f} and {step['segments'][1]:.0f} segments): "
          + ", ".join(f"{n} {step[n]:+.2f}" for n in names))
    if slopes:
        p("slope of log(error) against log(N), all rows: " + ", ".join(f"{n} {s:+.2f}" for n, s in slopes.items())
          + " (the paper: ~0 for the tree, ~2/3 for the MWEM baseline)")
    p(f"(wall {elapsed:.1f} s)")
    report = {"machine": machine(),
              "workload": {"items": items, "ranges": queries, "live": live, "histories": list(histories), "seeds": seeds,
                           "epsilon": epsilon, "beta": beta, "partition_share": partition_share},
              "rows": rows, "slopes": slopes, "steps": steps, "node_epsilons_at_largest": node_eps, "wall_seconds": elapsed}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=1)
    return report
