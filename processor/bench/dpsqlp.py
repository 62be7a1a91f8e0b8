"""``dpstream bench dpsqlp``: the DP-SQLP paper's Table 1 workload, DP-SQLP vs its two baselines.

The DP-SQLP column runs the product's own :class:`dpstream.processor.engine.pipeline.QueryPipeline` over a
RocksDB store, micro-batch by micro-batch (stage 1, pending micro-batch, stage 2 at each
trigger), exactly as the replay runner does; only the event generation is vectorized here.

The baselines are the paper's (section 5), each a one-shot DP histogram (contribution bounding,
Gaussian noise, thresholded partition selection) with the budget composed over the T runs:

* Baseline 1 repeats the one-shot query at every trigger over all data so far and publishes its
  latest output;
* Baseline 2 runs the one-shot query on each micro-batch, with global contribution bounding,
  and publishes the running sum of the outputs.

One-shot query, per run: a user's bounded records (at most C, the first C in time) may all hit
one key, so the count vector has L2 sensitivity C; Gaussian noise N(0, sigma_q^2) with
``sigma_q = C / sqrt(2 rho_q)``, ``rho_q = rho / T`` and ``rho = cks_rho(eps, delta / 2)`` (zCDP
composition over the T runs, converted once: at least as tight as the optimal (eps, delta)
composition the paper uses for Gaussian mechanisms); a key is kept if its noisy count exceeds
``C + sigma_q * Phi^-1(1 - delta / (2 T C))`` (a key only one user supports has count <= C and
each user can create at most C such keys, so selection costs delta/2 over the T runs).

Metrics (paper section 5) against the true histogram of all raw records over the whole key
space, unreleased keys counting 0: retained keys, l_inf, l_1, l_2.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np
from scipy.stats import norm

from dpstream.accountant.calibration import cks_rho
from dpstream.processor.bench.report import machine, pss_gb, summary
from dpstream.processor.bench.simulation import simulate
from dpstream.processor.config import QueryConfig
from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
from dpstream.processor.engine.runner import QueryRunner
from dpstream.processor.mechanisms import kernels
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.processor.synthetic import generate
from dpstream.state.store import MemoryStore, RocksDBStore, WriteBatch

PAPER = {
    100: {"DP-SQLP": (28338, 1391, 17741225, 50039), "Baseline 1": (435, 18077, 50835203, 430547), "Baseline 2": (191, 21913, 58551587, 576425)},
    1000: {"DP-SQLP": (22280, 1563, 19395721, 58237), "Baseline 1": (0, 25497, 59052062, 594382), "Baseline 2": (0, 25497, 59052062, 594382)},
}


def _errors(truth: np.ndarray, estimate: np.ndarray, released: np.ndarray) -> dict:
    err = np.abs(estimate - truth)
    return {"keys": int(released.sum()), "linf": float(err.max()), "l1": float(err.sum()), "l2": float(np.sqrt(np.square(err).sum()))}


def _rank_in_user(users: np.ndarray) -> np.ndarray:
    """0-based position of each record among its user's records, in time (array) order."""
    order = np.argsort(users, kind="stable")
    sorted_users = users[order]
    start = np.ones(len(order), dtype=bool)
    start[1:] = sorted_users[1:] != sorted_users[:-1]
    first = np.nonzero(start)[0]
    group = np.cumsum(start) - 1
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - first[group]
    return rank


def run_dpsqlp_bench(users: int = 10_000_000, keys: int = 1_000_000, triggers: int = 100, seed: int = 1, epsilon: float = 6.0,
                     delta: float = 1e-9, contribution_bound: int = 32, json_path: str | None = None, plot_path: str | None = None,
                     state: str = "rocksdb", processes: int = 2, runs: int = 1, counter: str = "blt", composition: str = "gdp",
                     per_key_bound: int | None = None, key_selection_share: float = 0.5, perturbation_steps: str = "trigger",
                     selection_weights: list | None = None, top_keys: int | None = None, public_keys: bool = False,
                     out=None) -> dict:
    """The workload ``runs`` times (each from a fresh store); the report's times are medians over
    the runs, its releases those of every run (they must agree: same secret, same data).
    ``top_keys``: also score the workload's ``top_keys`` keys by true count alone (``top`` in the
    results); ``public_keys``: declare those keys as the query's public key domain (a stand-in
    for a public catalogue: docs/privacy.md, "Public keys")."""
    out = sys.stdout if out is None else out  # resolved per call (a default would bind stdout at import)
    reports = []
    args = (users, keys, triggers, seed, epsilon, delta, contribution_bound, state, processes, counter, composition, per_key_bound,
            key_selection_share, perturbation_steps, selection_weights, top_keys, public_keys)
    for run in range(runs):
        if runs > 1:
            print(f"run {run + 1}/{runs}", file=out, flush=True)
        if (runs > 1 or _ran_here) and processes > 1:
            # RocksDB keeps its thread pool after a store closes, and a process forked from one
            # that has it can deadlock in its first write (stage 1's fork in the second run did,
            # and so did --public-keys-top's second workload): with several runs, or after one in
            # this interpreter, each starts in a fresh interpreter and prints to our stdout
            import multiprocessing as mp

            out.flush()
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=_dpsqlp_once_to_queue, args=(queue, args))  # not a daemon: it forks stage 1
            child.start()
            report = queue.get()
            child.join()
            if isinstance(report, BaseException):
                raise report
            reports.append(report)
        else:
            _mark_ran()
            reports.append(_dpsqlp_once(*args, out))
        if reports[-1]["results"] != reports[0]["results"]:
            raise RuntimeError("bench dpsqlp: two runs of the same workload released different values")
    report = dict(reports[0])
    for name in ("pipeline_seconds", "wall_seconds", "fire_seconds_median"):
        report[name] = statistics.median(r[name] for r in reports)
    report["peak_rss_gb"] = max(r["peak_rss_gb"] for r in reports)
    report["peak_pss_gb"] = max(r["peak_pss_gb"] for r in reports)
    report["timing"] = {name: summary([r[name] for r in reports]) for name in ("pipeline_seconds", "wall_seconds", "peak_rss_gb", "peak_pss_gb")}
    report["machine"] = machine()
    if runs > 1:
        print(f"median of {runs} runs: pipeline {report['pipeline_seconds']:.1f} s, wall {report['wall_seconds']:.1f} s; "
              f"peak RSS at most {report['peak_rss_gb']:.2f} GB", file=out, flush=True)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    if plot_path:
        _plot(report["curve"], triggers, plot_path)
    return report


#: whether this interpreter has run the workload (and so holds RocksDB's thread pool): a later
#: run with two processes then starts in a fresh interpreter (see run_dpsqlp_bench)
_ran_here = False


def _mark_ran() -> None:
    global _ran_here
    _ran_here = True


def _dpsqlp_once_to_queue(queue, args) -> None:
    try:
        queue.put(_dpsqlp_once(*args, sys.stdout))
    except BaseException as exc:  # the parent re-raises it
        queue.put(RuntimeError(f"bench dpsqlp run failed: {exc!r}"))


def _dpsqlp_once(users: int, keys: int, triggers: int, seed: int, epsilon: float, delta: float, contribution_bound: int, state: str,
                 processes: int, counter: str, composition: str, per_key_bound: int | None, key_selection_share: float,
                 perturbation_steps: str, selection_weights: list | None, top_keys: int | None, public_keys: bool, out) -> dict:
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    stream = generate(users, keys, seed)
    n = len(stream)
    t_gen = time.perf_counter() - t_start
    p(f"bench dpsqlp: {users:,} users, {n:,} records, {keys:,} keys, T={triggers}, C={contribution_bound}, "
      f"eps={epsilon:g}, delta={delta:g}, counter {counter}, composition {composition}, per-key bound {per_key_bound or 'none'}, "
      f"key selection share {key_selection_share:g}, perturbation steps per {perturbation_steps}, selection weights "
      f"{selection_weights or 'none'}" + (f", public keys: the top {top_keys:,} by true count" if public_keys else "")
      + f" (generated in {t_gen:.1f} s)")
    truth = np.bincount(stream.keys, minlength=keys).astype(np.float64)
    # the workload's top keys by true count (ties: the lower key number): what --top-keys scores
    # and, with --public-keys, the declared domain (the synthetic data's own, a stand-in for a catalogue)
    top = np.sort(np.argsort(-truth, kind="stable")[:top_keys]) if top_keys else None
    query = QueryConfig(name="dpsqlp", window="1d", triggers=triggers, contribution_bound=contribution_bound, epsilon=epsilon,
                        delta=delta, allowed_lateness="0s", counter=counter, composition=composition, per_key_bound=per_key_bound,
                        key_selection_share=key_selection_share, perturbation_steps=perturbation_steps,
                        selection_weights=selection_weights, public_keys=[f"k{i}" for i in top.tolist()] if public_keys else None)
    # synthetic data only: the secret is derived from --seed so that published numbers can be
    # reproduced exactly; real data always takes its secret from a file or the environment
    secret = hashlib.sha256(f"dpstream bench seed {seed}".encode()).digest()
    pseudo = Pseudonymizer(secret)
    user_ids = pseudo.integer_users(stream.users.astype(np.uint64))
    key_text = np.array([f"k{i}" for i in range(keys)], dtype=object)
    key_ids = pseudo.group_keys(key_text.tolist())
    interval = 86_400_000 // triggers
    bounds = np.searchsorted(stream.ts, np.arange(triggers + 1) * interval)

    # ---- baselines' shared pieces
    kept = _rank_in_user(stream.users) < contribution_bound  # the ranks themselves are not kept (0.5 GB at 10M users)
    rho = cks_rho(epsilon, delta / 2)
    sigma_q = contribution_bound / math.sqrt(2 * rho / triggers)
    threshold_q = contribution_bound + sigma_q * float(norm.isf(delta / (2 * triggers * contribution_bound)))
    rng = np.random.default_rng(seed + 1)

    estimate = np.zeros(keys)
    released = np.zeros(keys, dtype=bool)
    truth_so_far = np.zeros(keys)
    b1_counts = np.zeros(keys)
    b2_sum = np.zeros(keys)
    b2_released = np.zeros(keys, dtype=bool)
    curve = {"trigger": [], "DP-SQLP": [], "Baseline 1": [], "Baseline 2": []}
    fire_seconds, stage_one_seconds = [], []
    t_pipe = 0.0
    peak_pss = 0.0  # sampled after every trigger, both processes together
    waited = 0.0

    def bound_trigger(stage1: QueryRunner, stage1_store, i):
        """Stage 1 (by user) for micro-batch i: what the repartition topic would carry, and the
        seconds stage 1 took (its own store's write included)."""
        sl = slice(bounds[i - 1], bounds[i])
        kk = stream.keys[sl]
        events = EventColumns(user_ids[sl], key_text[kk], key_ids[kk], np.ones(len(kk)), stream.ts[sl])
        started = time.perf_counter()
        batch = WriteBatch()
        records = stage1.stage_one(events, stream.ts[sl], batch).records  # each event arrives at its own time
        stage1_store.write(batch)
        return records, time.perf_counter() - started

    # fork stage 1 before this process opens RocksDB: RocksDB's background threads do not survive
    # a fork, and a child that inherited them could never flush or close its own database
    feeder = _StageOneProcess(bound_trigger, query, secret, state, triggers) if processes == 2 else None
    tmp = tempfile.TemporaryDirectory(prefix="dpstream-bench-")
    store = RocksDBStore(tmp.name) if state == "rocksdb" else MemoryStore()
    pipe = QueryPipeline(query, NodeNoise(secret), store, pseudo)
    runner = QueryRunner(pipe)
    kernels.prepare()  # as a worker does at start: no trigger or micro-batch times the loading of compiled kernels
    for i in range(1, triggers + 1):
        sl = slice(bounds[i - 1], bounds[i])
        kk = stream.keys[sl]
        t0 = time.perf_counter()
        records, seconds = feeder.next() if feeder else bound_trigger(runner, store, i)
        stage_one_seconds.append(seconds)
        waited += time.perf_counter() - t0  # with two processes: stage 2 idle, waiting for stage 1
        batch = WriteBatch()
        runner.stage_two(records, i, batch)
        store.write(batch)
        t1 = time.perf_counter()
        # the clock reaches trigger i's time: it fires (the data's end never decides)
        releases = []
        for fired in runner.fire_due(i * interval):
            releases += fired.releases
            runner.published(fired)
        t2 = time.perf_counter()
        fire_seconds.append(t2 - t1)
        t_pipe += t2 - t0
        if releases:
            idx = np.fromiter((int(r["key"][1:]) for r in releases), dtype=np.int64, count=len(releases))
            estimate[idx] = [r["count"] for r in releases]
            released[idx] = True
        # baselines
        truth_so_far += np.bincount(kk, minlength=keys)
        batch_counts = np.bincount(kk[kept[sl]], minlength=keys).astype(np.float64)
        b1_counts += batch_counts
        noisy1 = b1_counts + rng.normal(0.0, sigma_q, keys)
        b1_keep = noisy1 > threshold_q
        b1_estimate = np.where(b1_keep, noisy1, 0.0)
        noisy2 = batch_counts + rng.normal(0.0, sigma_q, keys)
        b2_keep = noisy2 > threshold_q
        b2_sum += np.where(b2_keep, noisy2, 0.0)
        b2_released |= b2_keep
        curve["trigger"].append(i)
        curve["DP-SQLP"].append(_errors(truth_so_far, estimate, released))
        curve["Baseline 1"].append(_errors(truth_so_far, b1_estimate, b1_keep))
        curve["Baseline 2"].append(_errors(truth_so_far, b2_sum, b2_released))
        peak_pss = max(peak_pss, pss_gb([os.getpid(), *([feeder.pid] if feeder else [])]))
        if i % max(1, triggers // 10) == 0:
            p(f"  trigger {i}/{triggers}: {released.sum():,} keys released so far, pipeline {t_pipe:.0f} s")
    results = {
        "DP-SQLP": _errors(truth, estimate, released),
        "Baseline 1": _errors(truth, b1_estimate, b1_keep),
        "Baseline 2": _errors(truth, b2_sum, b2_released),
    }
    if top is not None:  # the same metrics over the top keys alone (unreleased ones count 0)
        results["top"] = {"keys_scored": len(top), **_errors(truth[top], estimate[top], released[top])}
    stats = pipe.stats
    if feeder:
        child_stats, child_rss = feeder.finish()
        stats.events_in += child_stats.events_in
        stats.dropped.update(child_stats.dropped)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    if feeder:
        peak_gb += child_rss  # two processes: report their sum
    # stage 1's cost per record, over the whole run and over its first and last tenths of
    # micro-batches: the users it has seen grow through the window, and its state with them
    tenth = max(1, triggers // 10)
    per_batch = np.diff(bounds)
    stage_one = {"seconds": float(sum(stage_one_seconds)),
                 "us_per_record": 1e6 * sum(stage_one_seconds) / max(n, 1),
                 "us_per_record_first_tenth": 1e6 * sum(stage_one_seconds[:tenth]) / max(int(per_batch[:tenth].sum()), 1),
                 "us_per_record_last_tenth": 1e6 * sum(stage_one_seconds[-tenth:]) / max(int(per_batch[-tenth:].sum()), 1)}
    simulated = None
    if not public_keys and selection_weights is None and per_key_bound is None:
        # the speed baseline: the same mechanism in plain numpy, no state, no persistence
        sim = simulate(stream.users, stream.keys, bounds, keys, pipe.plan, kept, seed + 2)
        simulated = {"seconds": sim["seconds"], **_errors(truth, sim["estimate"], sim["released"])}
    report = {
        "users": users, "records": n, "keys": keys, "triggers": triggers, "contribution_bound": contribution_bound,
        "epsilon": epsilon, "delta": delta, "seed": seed, "state": state, "processes": processes, "counter": counter, "composition": composition,
        "per_key_bound": per_key_bound, "key_selection_share": key_selection_share, "perturbation_steps": perturbation_steps,
        "kernels": kernels.active(),
        "selection_weights": selection_weights, "top_keys": top_keys, "public_keys": public_keys, "results": results,
        "paper": {m: dict(zip(("keys", "linf", "l1", "l2"), v)) for m, v in PAPER.get(triggers, {}).items()},
        "pipeline_seconds": t_pipe, "fire_seconds_median": float(np.median(fire_seconds)), "fire_seconds_max": float(np.max(fire_seconds)),
        "wall_seconds": time.perf_counter() - t_start, "peak_rss_gb": peak_gb, "peak_pss_gb": peak_pss, "stage_one_wait_seconds": waited if feeder else None,
        "stage_one": stage_one,
        "dropped": dict(stats.dropped), "releases": stats.releases,
        "sigma_perturbation": pipe.plan.sigma_perturbation, "perturbation_l2_sensitivity": pipe.plan.perturbation_l2_sensitivity,
        "baseline_sigma": sigma_q, "baseline_threshold": threshold_q, "curve": curve,
        "numpy_simulation": simulated,
    }
    p(f"\n{'metric':<8}" + "".join(f"{m:>26}" for m in results if m != "top"))
    for metric in ("keys", "linf", "l1", "l2"):
        row = f"{metric:<8}"
        for m, r in results.items():
            if m == "top":
                continue
            paper = PAPER.get(triggers, {}).get(m)
            ref = f" (paper {paper[('keys', 'linf', 'l1', 'l2').index(metric)]:,})" if paper else ""
            row += f"{r[metric]:>12,.0f}{ref:>14}"
        p(row)
    if top is not None:
        t = results["top"]
        p(f"over the top {len(top):,} keys by true count: {t['keys']:,} released, l_inf {t['linf']:,.0f}, l_1 {t['l1']:,.0f}, "
          f"l_2 {t['l2']:,.0f}")
    b1 = max(results["Baseline 1"]["keys"], 1)
    p(f"\nDP-SQLP keeps {results['DP-SQLP']['keys'] / b1:.1f}x Baseline 1's keys; l2 ratio DP-SQLP / Baseline 1 = "
      f"{results['DP-SQLP']['l2'] / results['Baseline 1']['l2']:.3f}")
    p(f"pipeline {t_pipe:.1f} s with {processes} process(es) (median trigger {report['fire_seconds_median']:.2f} s), wall {report['wall_seconds']:.1f} s, "
      f"peak RSS {peak_gb:.2f} GB (summed over processes; proportional set size {peak_pss:.2f} GB, copy-on-write pages counted "
      f"once); dropped {dict(stats.dropped)}")
    p(f"stage 1: {stage_one['seconds']:.1f} s, {stage_one['us_per_record']:.2f} us per record ({stage_one['us_per_record_first_tenth']:.2f} "
      f"in the first tenth of micro-batches, {stage_one['us_per_record_last_tenth']:.2f} in the last, with every user of the day seen)")
    if feeder:
        p(f"stage 2 waited {waited:.1f} s of the pipeline's {t_pipe:.1f} s for stage 1's micro-batches")
    if simulated is not None:
        p(f"the same mechanism in plain numpy (no state, no persistence, float noise): {simulated['seconds']:.1f} s, "
          f"{simulated['keys']:,} keys, l_2 {simulated['l2']:,.0f}; pipeline / numpy = {t_pipe / simulated['seconds']:.2f}x")
    store.close()
    tmp.cleanup()
    return report


class _StageOneProcess:
    """Stage 1 in its own process with its own store, one micro-batch ahead of stage 2: the
    deployment's shape (stage-1 agents by user, stage-2 agents by key), on two cores."""

    def __init__(self, bound_trigger, query, secret, state, triggers):
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # the generated stream is shared copy-on-write
        self._queue = ctx.Queue(maxsize=2)
        self._proc = ctx.Process(target=self._run, args=(bound_trigger, query, secret, state, triggers), daemon=True)
        self._proc.start()

    def _run(self, bound_trigger, query, secret, state, triggers):
        with tempfile.TemporaryDirectory(prefix="dpstream-bench-stage1-") as tmp:
            store = RocksDBStore(tmp) if state == "rocksdb" else MemoryStore()
            stage1 = QueryRunner(QueryPipeline(query, NodeNoise(secret), store, Pseudonymizer(secret)))
            kernels.prepare()
            for i in range(1, triggers + 1):
                self._queue.put(bound_trigger(stage1, store, i))
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
            self._queue.put((stage1.pipeline.stats, rss))
            store.close()
        # the child was forked from a process with RocksDB threads: skip interpreter teardown
        # (which could wait on the parent's copied locks) once the queue has flushed
        self._queue.close()
        self._queue.join_thread()
        os._exit(0)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def next(self):
        return self._queue.get()

    def finish(self):
        result = self._queue.get()
        self._proc.join(timeout=60)
        return result


def _plot(curve: dict, triggers: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in ("DP-SQLP", "Baseline 1", "Baseline 2"):
        axes[0].plot(curve["trigger"], [e["l2"] for e in curve[method]], label=method)
        axes[1].plot(curve["trigger"], [e["keys"] for e in curve[method]], label=method)
    axes[0].set(xlabel="trigger", ylabel="l2 error vs data so far", yscale="log", title=f"Error over the day (T={triggers})")
    axes[1].set(xlabel="trigger", ylabel="keys released", yscale="symlog", title="Retained keys")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_dpsqlp_compare(counters: list, triggers: int, json_path: str | None = None, plot_path: str | None = None, out=None,
                       **kwargs) -> dict:
    """The workload once per counter (same data, same secret, same budget and options), then
    the counters side by side with the paper's DP-SQLP and the best baseline."""
    out = sys.stdout if out is None else out
    reports = {c: run_dpsqlp_bench(triggers=triggers, counter=c, out=out, **kwargs) for c in counters}
    paper = PAPER.get(triggers, {}).get("DP-SQLP")
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    first = reports[counters[0]]
    p(f"\ncounters compared (T={triggers}, composition {first['composition']}, per-key bound {first['per_key_bound'] or 'none'}, "
      f"key selection share {first['key_selection_share']:g}, perturbation steps per {first['perturbation_steps']}):")
    p(f"{'':14}" + "".join(f"{c:>14}" for c in counters) + f"{'paper DP-SQLP':>16}{'Baseline 1':>14}")
    for i, metric in enumerate(("keys", "linf", "l1", "l2")):
        row = f"{metric:14}" + "".join(f"{reports[c]['results']['DP-SQLP'][metric]:>14,.0f}" for c in counters)
        row += f"{paper[i]:>16,}" if paper else f"{'':>16}"
        row += f"{first['results']['Baseline 1'][metric]:>14,.0f}"
        p(row)
    comparison = {"triggers": triggers, "counters": counters, "runs": reports}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(comparison, fh, indent=2)
    if plot_path:
        _plot_counters({c: r["curve"] for c, r in reports.items()}, triggers, plot_path)
    return comparison


def run_dpsqlp_public(top_keys: int, triggers: int, json_path: str | None = None, out=None, **kwargs) -> dict:
    """Public keys against key selection on the same workload, secret and budget (issue 34): the
    workload's ``top_keys`` keys by true count are declared public (a stand-in for a public
    catalogue), and both runs are scored over those keys alone. The selection run keeps the
    options given (selection weights too); the public run has no selection to weigh."""
    out = sys.stdout if out is None else out
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    selection = run_dpsqlp_bench(triggers=triggers, top_keys=top_keys, out=out, **kwargs)
    public = run_dpsqlp_bench(triggers=triggers, top_keys=top_keys, public_keys=True, out=out,
                              **{**kwargs, "selection_weights": None})
    rows = {"key selection": selection["results"]["top"], "public keys": public["results"]["top"]}
    p(f"\nover the top {top_keys:,} keys by true count (T={triggers}, {selection['users']:,} users):")
    p(f"{'':16}" + "".join(f"{m:>14}" for m in ("keys", "linf", "l1", "l2")))
    for name, r in rows.items():
        p(f"{name:16}" + "".join(f"{r[m]:>14,.0f}" for m in ("keys", "linf", "l1", "l2")))
    ratio = rows["public keys"]["l2"] / rows["key selection"]["l2"]
    p(f"l_2 public keys / key selection = {ratio:.3f}")
    comparison = {"triggers": triggers, "top_keys": top_keys, "l2_ratio": ratio, "top": rows,
                  "runs": {"key selection": selection, "public keys": public}}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(comparison, fh, indent=2)
    return comparison


def run_dpsqlp_per_key(bounds: list, triggers: int, json_path: str | None = None, out=None, **kwargs) -> dict:
    """The workload once per per-key bound (None: the default, up to C records on one key), on the
    same data, secret and budget, side by side (issue 34): keys released and error over all keys,
    the perturbation's sensitivity and noise from the accountant, and what each bound dropped."""
    out = sys.stdout if out is None else out
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    reports = {b: run_dpsqlp_bench(triggers=triggers, per_key_bound=b, out=out, **kwargs) for b in bounds}
    first = reports[bounds[0]]
    name = lambda b: "none" if b is None else str(b)  # noqa: E731
    p(f"\nper-key bounds compared (T={triggers}, {first['users']:,} users, {first['records']:,} records, C={first['contribution_bound']}, "
      f"counter {first['counter']}, composition {first['composition']}, key selection share {first['key_selection_share']:g}, "
      f"perturbation steps per {first['perturbation_steps']}):")
    columns = ("keys", "linf", "l1", "l2")
    p(f"{'per_key_bound':>14}" + "".join(f"{m:>14}" for m in columns) + f"{'sensitivity':>13}{'sigma_m':>10}"
      f"{'dropped c_k':>13}{'dropped C':>11}")
    rows = {}
    for b in bounds:
        r = reports[b]
        res = r["results"]["DP-SQLP"]
        rows[name(b)] = {**res, "perturbation_l2_sensitivity": r["perturbation_l2_sensitivity"],
                         "sigma_perturbation": r["sigma_perturbation"],
                         "dropped_per_key_bound": r["dropped"].get("per_key_bound", 0),
                         "dropped_contribution_bound": r["dropped"].get("contribution_bound", 0)}
        row = rows[name(b)]
        p(f"{name(b):>14}" + "".join(f"{res[m]:>14,.0f}" for m in columns) + f"{row['perturbation_l2_sensitivity']:>13.4g}"
          f"{row['sigma_perturbation']:>10.1f}{row['dropped_per_key_bound']:>13,}{row['dropped_contribution_bound']:>11,}")
    comparison = {"triggers": triggers, "per_key_bounds": bounds, "rows": rows, "runs": {name(b): r for b, r in reports.items()}}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(comparison, fh, indent=2)
    return comparison


def run_dpsqlp_kernels(names: list, triggers: int, json_path: str | None = None, out=None, **kwargs) -> dict:
    """The workload once per kernel set (dpstream.processor.mechanisms.kernels: ``numba``, the
    compiled kernels, and ``numpy``, the versions they replace), on the same data, secret and
    budget (issue 35): the releases must be identical, and the times are compared in one run."""
    out = sys.stdout if out is None else out
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    before = os.environ.get("DPSTREAM_KERNELS")
    reports = {}
    try:
        for name in names:
            os.environ["DPSTREAM_KERNELS"] = name  # a run in a fresh interpreter reads it
            kernels.use(name)
            p(f"kernels {name}:")
            reports[name] = run_dpsqlp_bench(triggers=triggers, out=out, **kwargs)
    finally:
        if before is None:
            os.environ.pop("DPSTREAM_KERNELS", None)
        else:
            os.environ["DPSTREAM_KERNELS"] = before
        kernels.use(before or "numba")
    first = reports[names[0]]
    if any(r["results"] != first["results"] for r in reports.values()):
        raise RuntimeError("bench dpsqlp: the kernel sets released different values")
    p(f"\nkernels compared (T={triggers}, {first['users']:,} users; releases identical):")
    p(f"{'kernels':>10}{'pipeline s':>12}{'median trigger s':>18}{'wall s':>9}")
    rows = {}
    for name, r in reports.items():
        rows[name] = {"kernels": r["kernels"], "pipeline_seconds": r["pipeline_seconds"], "fire_seconds_median": r["fire_seconds_median"],
                      "wall_seconds": r["wall_seconds"]}
        p(f"{r['kernels']:>10}{r['pipeline_seconds']:>12.1f}{r['fire_seconds_median']:>18.3f}{r['wall_seconds']:>9.1f}")
    if len(names) > 1:
        base = rows[names[-1]]
        for name in names[:-1]:
            p(f"{name} / {names[-1]}: pipeline {rows[name]['pipeline_seconds'] / base['pipeline_seconds']:.2f}x, median trigger "
              f"{rows[name]['fire_seconds_median'] / base['fire_seconds_median']:.2f}x")
    comparison = {"triggers": triggers, "kernels": names, "rows": rows, "runs": reports}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(comparison, fh, indent=2)
    return comparison


def _plot_counters(curves: dict, triggers: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    any_curve = next(iter(curves.values()))
    for name, curve in curves.items():
        axes[0].plot(curve["trigger"], [e["l2"] for e in curve["DP-SQLP"]], label=f"dpstream, {name}")
        axes[1].plot(curve["trigger"], [e["keys"] for e in curve["DP-SQLP"]], label=f"dpstream, {name}")
    axes[0].plot(any_curve["trigger"], [e["l2"] for e in any_curve["Baseline 1"]], label="Baseline 1", linestyle=":")
    axes[1].plot(any_curve["trigger"], [e["keys"] for e in any_curve["Baseline 1"]], label="Baseline 1", linestyle=":")
    axes[0].set(xlabel="trigger", ylabel="l2 error vs data so far", yscale="log", title=f"Error over the day (T={triggers})")
    axes[1].set(xlabel="trigger", ylabel="keys released", title="Retained keys")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left", framealpha=0.6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
