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
import os
import statistics
import time

import numpy as np

from dpstream.accountant import QueryBudget, plan_query
from dpstream.processor.bench.report import Progress, machine
from dpstream.processor.mechanisms.key_selection import KeySelector
from dpstream.processor.mechanisms.noise import (
    NodeNoise,
    TreeIdentity,
    discrete_gaussian,
)
from dpstream.processor.mechanisms.perturbation import HierarchicalPerturber

#: Benchmarks noise synthetic data only; a one-off random secret per run (never a literal).
BENCH_SECRET = os.urandom(32)


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

    def scan():
        batch.noise_max[:] = np.nan  # forget the cached path maximum: measure the full scan
        selector.predict(batch)

    results["prediction_leaves_per_s"] = _median_rate(scan, keys * (triggers - 1), repeats)
    results.update(repeats=repeats, nodes=nodes, keys=keys, triggers=triggers, machine=machine())

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


def run_scaling_bench(seen_small: int = 10_000, seen_large: int = 1_000_000, batch_records: int = 20_000, batch_keys: int = 2_000,
                      repeats: int = 5, warmup: int = 3, users_small: int = 100_000, users_large: int = 10_000_000,
                      json_path: str | None = None) -> dict:
    """Stage 2: time of one trigger with the same micro-batch when 10^4 vs 10^6 keys were seen
    before. Stage 1: cost per record when 10^5 vs 10^7 users were seen before (:func:`_stage_one_cost`).

    DP-SQLP section 4.3: with release prediction a trigger loads only the micro-batch's keys and
    the keys predicted for it, so its cost must not grow with the number of keys ever seen. Each
    setting gets its own RocksDB store; trigger 1 brings ``seen`` one-user keys (one visit at
    trigger 2 predicts them), then triggers 3.. each get the same-shaped fresh micro-batch.
    """
    import tempfile

    from dpstream.processor.config import QueryConfig
    from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
    from dpstream.processor.engine.runner import QueryRunner
    from dpstream.processor.mechanisms.noise import Pseudonymizer
    from dpstream.state.store import RocksDBStore, WriteBatch

    query = QueryConfig(name="scaling", window="1d", triggers=100, contribution_bound=32, epsilon=6.0, delta=1e-9, allowed_lateness="0s")
    interval = 86_400_000 // 100
    pseudo = Pseudonymizer(BENCH_SECRET)
    noise = NodeNoise(BENCH_SECRET)
    rng = np.random.default_rng(0)
    batch_key_names = np.array([f"hot-{i}" for i in range(batch_keys)], dtype=object)
    batch_key_ids = pseudo.group_keys(batch_key_names.tolist())

    def feed(runner, store, trigger, users, key_names, key_ids):
        ts = np.full(len(users), (trigger - 1) * interval, dtype=np.int64)
        events = EventColumns(pseudo.integer_users(users), key_names, key_ids, np.ones(len(users)), ts)
        batch = WriteBatch()
        runner.ingest(events, ts, trigger, batch)  # each event arrives at its own time
        store.write(batch)

    def fire(runner, trigger):
        for fired in runner.fire_due(trigger * interval):  # the clock reaches the trigger's time
            runner.published(fired)

    results = {}
    for label, seen in (("small", seen_small), ("large", seen_large)):
        with tempfile.TemporaryDirectory(prefix="dpstream-scaling-") as tmp:
            store = RocksDBStore(tmp)
            pipe = QueryPipeline(query, noise, store)
            runner = QueryRunner(pipe)
            names = np.array([f"tail-{i}" for i in range(seen)], dtype=object)
            feed(runner, store, 1, np.arange(seen, dtype=np.uint64) + (1 << 40), names, pseudo.group_keys(names.tolist()))
            fire(runner, 2)
            times, loaded = [], []
            next_user = 1 << 41
            for trigger in range(3, 3 + warmup + repeats):
                picks = rng.integers(0, batch_keys, batch_records)
                feed(runner, store, trigger, np.arange(next_user, next_user + batch_records, dtype=np.uint64),
                     batch_key_names[picks], batch_key_ids[picks])
                next_user += batch_records
                t0 = time.perf_counter()
                fire(runner, trigger)
                if trigger >= 3 + warmup:  # steady state: not right after the bulk load
                    times.append(time.perf_counter() - t0)
                    loaded.append(pipe.stats.keys_loaded)
            store.close()
        results[label] = {"keys_seen": seen, "trigger_seconds_median": statistics.median(times), "keys_loaded_median": statistics.median(loaded)}
        print(f"{seen:>9,} keys seen: trigger {statistics.median(times) * 1e3:7.1f} ms (median of {repeats}), "
              f"{statistics.median(loaded):,.0f} keys loaded")
    results["ratio"] = results["large"]["trigger_seconds_median"] / results["small"]["trigger_seconds_median"]
    print(f"ratio (10^{len(str(seen_large)) - 1} / 10^{len(str(seen_small)) - 1} keys seen): {results['ratio']:.2f}")

    stage1 = {}
    for label, seen in (("small", users_small), ("large", users_large)):
        stage1[label] = _stage_one_cost(query, pseudo, noise, seen, batch_records, repeats, warmup)
        print(f"{seen:>10,} users seen: stage 1 {stage1[label]['microseconds_per_record_median']:6.2f} us/record "
              f"(median of {repeats} batches of {batch_records:,} returning users)")
    stage1["ratio"] = stage1["large"]["microseconds_per_record_median"] / stage1["small"]["microseconds_per_record_median"]
    print(f"stage-1 ratio ({users_large:,} / {users_small:,} users seen): {stage1['ratio']:.2f}")
    results["stage1"] = stage1
    results["machine"] = machine()
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


def _stage_one_cost(query, pseudo, noise, seen: int, batch_records: int, repeats: int, warmup: int) -> dict:
    """Stage 1 (contribution bounding, key histories, user states: :meth:`QueryPipeline.bound`
    and the write of its batch) per record, after ``seen`` users have each contributed one record
    in the window; measured batches are records of users drawn from those seen (each looks up
    and rewrites an existing state), on RocksDB."""
    import tempfile

    from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
    from dpstream.processor.engine.runner import QueryRunner
    from dpstream.state.store import RocksDBStore, WriteBatch

    rng = np.random.default_rng(1)
    keys = np.array([f"k{i}" for i in range(10_000)], dtype=object)
    key_ids = pseudo.group_keys(keys.tolist())
    interval = 86_400_000 // query.triggers
    user_ids = pseudo.integer_users(np.arange(seen, dtype=np.uint64))
    with tempfile.TemporaryDirectory(prefix="dpstream-scaling-users-") as tmp:
        store = RocksDBStore(tmp)
        runner = QueryRunner(QueryPipeline(query, noise, store))

        def bound(users, trigger):
            picks = rng.integers(0, len(keys), len(users))
            ts = np.full(len(users), (trigger - 1) * interval, dtype=np.int64)
            batch = WriteBatch()
            runner.stage_one(EventColumns(users, keys[picks], key_ids[picks], np.ones(len(users)), ts), ts, batch)
            store.write(batch)

        progress = Progress(f"stage 1, loading {seen:,} users", seen)
        for start in range(0, seen, 1_000_000):
            bound(user_ids[start:start + 1_000_000], 1)
            progress.step(min(start + 1_000_000, seen))
        times = []
        for i in range(warmup + repeats):
            users = user_ids[rng.choice(seen, min(batch_records, seen), replace=False)]  # distinct users in either setting
            t0 = time.perf_counter()
            bound(users, 2 + i)
            if i >= warmup:
                times.append((time.perf_counter() - t0) / len(users) * 1e6)
        store.close()
    return {"users_seen": seen, "microseconds_per_record_median": statistics.median(times), "microseconds_per_record": times}
