"""``dpstream bench engine``: throughput of the DP engine itself (no I/O), median of repeats.

Measured, each against a baseline run in the same process:

* noise values/s of the keyed-PRF discrete Gaussian vs numpy's (insecure, floating point)
  ``Generator.normal`` - the price of replayable, exact integer noise;
* key-selection tree updates/s (Algorithm 2 step for every key at every trigger);
* perturbation releases/s (Algorithm 3);
* release-prediction future leaves scanned/s (Algorithm 4).
"""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

from accountant import QueryBudget, plan_query
from processor.key_selection import KeySelector
from processor.noise import NodeNoise, TreeIdentity, discrete_gaussian
from processor.perturbation import HierarchicalPerturber

BENCH_SECRET = b"dpstream-benchmark-secret-0000"


def _median_rate(fn, work: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(work / (time.perf_counter() - t0))
    return statistics.median(rates)


def run_engine_bench(repeats: int = 5, nodes: int = 2_000_000, keys: int = 100_000, triggers: int = 100, json_path: str | None = None) -> dict:
    noise = NodeNoise(BENCH_SECRET)
    plan = plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=triggers, contribution_bound=32))
    sampler = discrete_gaussian(plan.sigma_perturbation_units)
    trees = np.repeat(noise.tree_ids([TreeIdentity("bench", 0, "k", "select", 0)]), nodes)
    node_ids = np.arange(nodes, dtype=np.uint32)
    rng = np.random.default_rng(0)
    results = {
        "sigma": sampler.sigma,
        "noise_values_per_s": _median_rate(lambda: noise.sample(sampler, trees, node_ids), nodes, repeats),
        "baseline_numpy_normal_per_s": _median_rate(lambda: rng.normal(0.0, sampler.sigma, nodes), nodes, repeats),
    }
    results["noise_vs_numpy_normal"] = results["noise_values_per_s"] / results["baseline_numpy_normal_per_s"]

    key_names = [f"key-{i}" for i in range(keys)]
    increments = rng.poisson(0.5, size=(triggers, keys))

    def selection_window():
        selector = KeySelector(plan, noise, "bench", 0)
        batch = selector.new_batch(key_names)
        for trigger in range(1, triggers + 1):
            selector.step(batch, trigger, increments[trigger - 1])
        return selector, batch

    results["selection_updates_per_s"] = _median_rate(selection_window, keys * triggers, repeats)

    def perturbation_window():
        perturber = HierarchicalPerturber(plan, noise, "bench", 0)
        batch = perturber.new_batch(key_names)
        for trigger in range(1, triggers + 1):
            perturber.release(batch, trigger, increments[trigger - 1])

    results["perturbation_releases_per_s"] = _median_rate(perturbation_window, keys * triggers, repeats)

    # prediction right after trigger 1: every key scans the remaining T-1 leaves
    selector = KeySelector(plan, noise, "bench", 0)
    batch = selector.new_batch(key_names)
    selector.step(batch, 1, np.ones(keys, dtype=np.int64))
    results["prediction_leaves_per_s"] = _median_rate(lambda: selector.predict(batch), keys * (triggers - 1), repeats)
    results.update(repeats=repeats, nodes=nodes, keys=keys, triggers=triggers)

    print(f"noise (keyed PRF + exact discrete Gaussian, sigma={sampler.sigma:.1f}): {results['noise_values_per_s'] / 1e6:8.2f} M values/s")
    print(f"  baseline numpy Generator.normal (float, not replayable): {results['baseline_numpy_normal_per_s'] / 1e6:8.2f} M values/s"
          f"  (ratio {results['noise_vs_numpy_normal']:.2f})")
    print(f"key selection (Alg. 2), {keys} keys x T={triggers}: {results['selection_updates_per_s'] / 1e6:8.2f} M tree updates/s")
    print(f"perturbation (Alg. 3), {keys} keys x T={triggers}:  {results['perturbation_releases_per_s'] / 1e6:8.2f} M releases/s")
    print(f"release prediction (Alg. 4) after trigger 1: {results['prediction_leaves_per_s'] / 1e6:8.2f} M future leaves/s")
    print(f"(median of {repeats} runs)")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(results, fh, indent=2)
    return results
