"""``dpstream bench dynamic``: the fully dynamic counter's two mechanisms on churning streams.

Compares the two mechanisms of :class:`dpstream.processor.mechanisms.dynamic.DynamicCounter` (Qiu & Yi,
*Differential Privacy on Dynamic Data*):

* ``interval_tree`` - the paper's online interval tree with Algorithm 3 at each node, whose error
  is meant to depend on the live data size n_t (polylog n_t + log t);
* ``baseline`` - the standard reduction the paper improves on: two insertion-only counters
  (inserts, deletes) whose difference is published, with error polylog in the number of updates
  N_t.

For plain counts the Laplace error does not grow with the data size, so the tree has nothing to
gain, while splitting its budget costs a lot: a level-l node in round r gets
eps_c / (10.8 l^2 r^2) for each of its four mechanisms (section 4.3, Algorithm 3). The baseline is
expected to win here. The tree pays off only for static mechanisms whose error grows with |D|.

Workload. A stream is a sequence of updates (item, insert|delete) over a small domain of
``items`` labels; inserted labels follow a Zipf-like law (P[label k] ~ 1 / (k + 1)^1.1) and a
delete removes a uniformly random live copy, so it only ever deletes present items. Two kinds,
generated with ``numpy.random.default_rng(seed)``:

* ``heavy_churn``: a ramp-up of 350 inserts, then a mean-reverting walk: each update is an insert
  with probability ``0.5 + (350 - n) / 22400`` (clipped to [0.05, 0.95]), so the multiset size n_t
  hovers around 350 (roughly 200-500) while the update count N_t grows to ``updates``: N_t >> n_t;
* ``little_churn``: 90% inserts, 10% deletes (of present items), so n_t ~ 0.8 N_t.

Both mechanisms run on the identical stream with the identical throwaway secret
(``os.urandom(32)``, one per seed and stream kind; nothing is published). The partitioner's noise
labels are shared, so both close their segments at the same positions and their releases pair
one-to-one.

Metrics, at each segment close (a release): position t = N_t, n_t = number of live items, the
error of the total |sum(counts) - sum(exact)|, and the max per-item error max_x |counts_x -
exact_x|. Per stream kind and mechanism (each a median over seeds): the median and the 90th
percentile of the max per-item error over the second half of the releases, the final release's
max per-item and total error, the number of segments, and the median (second half) of the max
per-item error divided by n_t and by N_t.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from dpstream.accountant.dynamic import DynamicPlan
from dpstream.processor.bench.report import machine
from dpstream.processor.mechanisms.dynamic import DynamicCounter
from dpstream.processor.mechanisms.noise import NodeNoise

MECHANISMS = ("interval_tree", "baseline")
KINDS = ("heavy_churn", "little_churn")
HEAVY_TARGET = 350  # live items the heavy-churn walk reverts to
LITTLE_INSERT_SHARE = 0.9
ZIPF_EXPONENT = 1.1


def generate_stream(kind: str, updates: int, items: int, seed: int, target: int = HEAVY_TARGET) -> tuple[np.ndarray, np.ndarray]:
    """(item index, is_insert) per update. Deletes remove a uniformly random live copy. ``target``:
    the live items heavy churn reverts to."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, items + 1) ** ZIPF_EXPONENT
    insert_items = rng.choice(items, size=updates, p=weights / weights.sum()).tolist()
    coin = rng.random(updates).tolist()
    pick = rng.random(updates).tolist()
    counts = [0] * items
    n = 0
    out_item = np.empty(updates, dtype=np.int64)
    out_insert = np.empty(updates, dtype=bool)
    for t in range(updates):
        if kind == "heavy_churn":
            p_insert = 1.0 if t < target else min(0.95, max(0.05, 0.5 + (target - n) / (64 * target)))
        elif kind == "little_churn":
            p_insert = LITTLE_INSERT_SHARE
        else:
            raise ValueError(f"unknown stream kind {kind!r}")
        if n == 0 or coin[t] < p_insert:
            x = insert_items[t]
            counts[x] += 1
            n += 1
            out_insert[t] = True
        else:
            r = int(pick[t] * n)  # uniform live copy -> its item
            x = 0
            while r >= counts[x]:
                r -= counts[x]
                x += 1
            counts[x] -= 1
            n -= 1
            out_insert[t] = False
        out_item[t] = x
    return out_item, out_insert


def run_stream(plan: DynamicPlan, labels: list[str], secret: bytes, stream: tuple[np.ndarray, np.ndarray]) -> dict:
    """Feed one stream to a fresh counter; per-release curves and the wall time."""
    counter = DynamicCounter(plan, labels, NodeNoise(secret), "bench-dynamic")
    ops = ("delete", "insert")
    curve = {"position": [], "n": [], "total_error": [], "max_error": []}
    start = time.perf_counter()
    for x, ins in zip(stream[0].tolist(), stream[1].tolist()):
        release = counter.update(labels[x], ops[ins])
        if release is None:
            continue
        diff = np.abs(release.counts - release.exact)
        curve["position"].append(release.position)
        curve["n"].append(int(release.exact.sum()))
        curve["total_error"].append(float(abs(release.counts.sum() - release.exact.sum())))
        curve["max_error"].append(float(diff.max()))
    curve["seconds"] = time.perf_counter() - start
    return curve


def summarize(curve: dict) -> dict:
    pos = np.asarray(curve["position"], dtype=np.float64)
    n = np.asarray(curve["n"], dtype=np.float64)
    err = np.asarray(curve["max_error"])
    half = slice(len(err) // 2, None)
    return {
        "segments": len(err),
        "max_error_median": float(np.median(err[half])),
        "max_error_p90": float(np.percentile(err[half], 90)),
        "total_error_median": float(np.median(np.asarray(curve["total_error"])[half])),
        "final_max_error": float(err[-1]),
        "final_total_error": float(curve["total_error"][-1]),
        "final_n": int(n[-1]),
        "final_N": int(pos[-1]),
        "n_median": float(np.median(n[half])),
        "error_over_n": float(np.median(err[half] / np.maximum(n[half], 1))),
        "error_over_N": float(np.median(err[half] / pos[half])),
        "seconds": curve["seconds"],
    }


def run_dynamic_bench(items: int = 8, updates: int = 150_000, epsilon: float = 1.0, beta: float = 0.05,
                      partition_share: float = 0.25, seeds: int = 3, json_path: str | None = None,
                      plot_path: str | None = None, out=sys.stderr) -> dict:
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    wall = time.perf_counter()
    labels = [f"item{k}" for k in range(items)]
    plans = {m: DynamicPlan(epsilon, 0.0, beta, partition_share, m) for m in MECHANISMS}
    p(f"bench dynamic: {updates:,} updates per stream, {items} items, {seeds} seed(s), eps={epsilon:g} "
      f"(partition {plans['baseline'].epsilon_partition:g}, counts {plans['baseline'].epsilon_counts:g}), beta={beta:g}")
    per_seed = {k: {m: [] for m in MECHANISMS} for k in KINDS}
    curves = {}
    for kind in KINDS:
        for seed in range(seeds):
            stream = generate_stream(kind, updates, items, seed)
            secret = os.urandom(32)  # throwaway: synthetic data, nothing is published
            runs = {m: run_stream(plans[m], labels, secret, stream) for m in MECHANISMS}
            if runs["baseline"]["position"] != runs["interval_tree"]["position"]:
                raise RuntimeError("the two mechanisms closed segments at different positions")
            for m in MECHANISMS:
                per_seed[kind][m].append(summarize(runs[m]))
                p(f"  {kind:12s} seed {seed} {m:13s}: {len(runs[m]['position'])} segments, "
                  f"median max error {per_seed[kind][m][-1]['max_error_median']:.1f}, {runs[m]['seconds']:.1f} s")
            if seed == 0:
                curves[kind] = {"position": runs["baseline"]["position"], "n": runs["baseline"]["n"],
                                **{m: {"max_error": runs[m]["max_error"], "total_error": runs[m]["total_error"]} for m in MECHANISMS}}
    results = {kind: {m: {key: float(np.median([s[key] for s in per_seed[kind][m]])) for key in per_seed[kind][m][0]}
                      for m in MECHANISMS} for kind in KINDS}
    elapsed = time.perf_counter() - wall

    p()
    header = (f"{'stream':12s} {'mechanism':13s} {'segs':>5s} {'n_t(med)':>8s} {'err med':>8s} {'err p90':>8s} {'tot med':>8s} "
              f"{'final':>7s} {'fin tot':>7s} {'err/n_t':>8s} {'err/N_t':>9s}")
    p(header)
    p("-" * len(header))
    for kind in KINDS:
        for m in MECHANISMS:
            r = results[kind][m]
            p(f"{kind:12s} {m:13s} {r['segments']:5.0f} {r['n_median']:8.0f} {r['max_error_median']:8.1f} {r['max_error_p90']:8.1f} "
              f"{r['total_error_median']:8.1f} {r['final_max_error']:7.1f} {r['final_total_error']:7.1f} {r['error_over_n']:8.4f} "
              f"{r['error_over_N']:9.2e}")
        ratio = results[kind]["interval_tree"]["max_error_median"] / max(results[kind]["baseline"]["max_error_median"], 1e-9)
        p(f"{'':12s} interval_tree / baseline median max error: {ratio:.2f}x")
    p(f"(medians over {seeds} seed(s); 'err' = max per-item error, 'tot' = total-count error, over the second half of the "
      f"releases; wall {elapsed:.1f} s)")

    report = {
        "machine": machine(),
        "workload": {"items": items, "updates": updates, "seeds": seeds, "zipf_exponent": ZIPF_EXPONENT,
                     "heavy_churn_target": HEAVY_TARGET, "little_churn_insert_share": LITTLE_INSERT_SHARE},
        "plan": {m: plans[m].to_dict() for m in MECHANISMS},
        "results": results,
        "per_seed": per_seed,
        "curves_seed0": curves,
        "wall_seconds": elapsed,
    }
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=1)
    if plot_path:
        _plot(curves, epsilon, items, plot_path)
    return report


def _rolling_median(values: list[float], window: int = 15) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    half = window // 2
    return np.array([np.median(v[max(0, i - half): i + half + 1]) for i in range(len(v))])


def _plot(curves: dict, epsilon: float, items: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"interval_tree": "tab:blue", "baseline": "tab:orange"}
    titles = {"heavy_churn": "heavy churn (N_t >> n_t)", "little_churn": "little churn (n_t ~ N_t)"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, KINDS):
        c = curves[kind]
        for m in MECHANISMS:
            ax.plot(c["position"], c[m]["max_error"], color=colors[m], alpha=0.25, lw=0.8)
            ax.plot(c["position"], _rolling_median(c[m]["max_error"]), color=colors[m], lw=2,
                    label=f"{m}: max per-item error (rolling median)")
        ax.plot(c["position"], c["n"], color="black", ls="--", lw=1.2, label="n_t (live items)")
        ax.set(xlabel="N_t (updates so far)", ylabel="count", yscale="log", title=titles[kind])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Fully dynamic DP counts, {items} items: interval tree vs baseline (eps={epsilon:g}, seed 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # until the CLI is wired: python -m dpstream.processor.bench.dynamic [JSON [PNG]]
    run_dynamic_bench(json_path=sys.argv[1] if len(sys.argv) > 1 else None, plot_path=sys.argv[2] if len(sys.argv) > 2 else None)
