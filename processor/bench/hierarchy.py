"""``dpstream bench hierarchy``: consistent hierarchical counts (docs/privacy.md, "Post-processing: hierarchical consistency") on a skewed
synthetic three-level hierarchy, through the real pipeline.

Workload (``numpy.random.default_rng(seed)``): ``countries`` countries; country c has
``max(3, round(40 / (c + 1)^0.7))`` states, each with 5..39 cities (uniform): about 7,000 leaves for
20 countries. A leaf's weight is ``(c+1)^-1.2 (s+1)^-1 (t+1)^-1`` (Zipf-like at every level, so
counts are skewed at every level). Each of ``users`` users has ``1 + Geometric(0.4)`` records
(capped at 20), each at a leaf drawn by weight, at a uniform time of one window; C = 8, T =
``triggers``. Records go through :class:`dpstream.processor.engine.pipeline.QueryPipeline` (stage 1, stage 2,
key selection, perturbation, consistency) on RocksDB, one micro-batch per trigger, in time order.

Truth: each user's first C records (what bounding admits), counted at every level through each
trigger. Compared at the last trigger, over the published view (the latest record of every
released key, as a compacted topic holds it), each value against the true count through the
trigger its noisy count was released at (``released_at``; what it estimates, so staleness is not
counted as error), per level: mean absolute error of the raw noisy counts, of clamp-and-round
(``max(0, round(count))``), and of the consistent counts. A consistency violation is a released
parent whose value cannot be the sum of its released children plus a non-negative remainder
(value < sum of children), or a negative or fractional count; counted over the views after every
trigger. Time: each trigger's ``fire`` and the part spent in the consistency step (median, max).

With ``public_keys`` every leaf of the workload is declared (a public domain: the hierarchy's
parents are then closed, every key is released at every trigger, docs/privacy.md, "Public
keys"), and the consistency step has the whole tree at every trigger.

The noise secret is a one-off random one.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from dpstream.processor.bench.report import machine
from dpstream.processor.config import QueryConfig
from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
from dpstream.processor.engine.runner import QueryRunner
from dpstream.processor.mechanisms.consistency import clamp_and_round
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import PartitionStores, WriteBatch

DAY = 86_400_000
START = 1_795_132_800_000  # a window start (multiple of one day)
C = 8


def generate(countries: int, users: int, seed: int):
    """(leaf names [(country, state, city)], per record: user, leaf index, ts), ts-sorted."""
    rng = np.random.default_rng(seed)
    leaves, weights = [], []
    for c in range(countries):
        for s in range(max(3, round(40 / (c + 1) ** 0.7))):
            for t in range(int(rng.integers(5, 40))):
                leaves.append((f"c{c}", f"c{c}.s{s}", f"c{c}.s{s}.t{t}"))
                weights.append((c + 1) ** -1.2 * (s + 1) ** -1.0 * (t + 1) ** -1.0)
    p = np.array(weights) / np.sum(weights)
    per_user = np.minimum(1 + rng.geometric(0.4, size=users) - 1, 20)
    user = np.repeat(np.arange(users), per_user)
    leaf = rng.choice(len(leaves), size=len(user), p=p)
    ts = START + rng.integers(0, DAY, size=len(user))
    order = np.argsort(ts, kind="stable")
    return leaves, user[order], leaf[order], ts[order]


def bounded_truth(leaves, user, leaf, ts, triggers: int) -> dict:
    """Per key (every level): counts through trigger j (index j-1) of each user's first C records
    in arrival order - what a noisy count released at trigger j estimates."""
    order = np.argsort(user, kind="stable")
    u = user[order]
    first = np.r_[True, u[1:] != u[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(u)), 0))
    rank = np.empty(len(u), dtype=np.int64)
    rank[order] = np.arange(len(u)) - start
    admitted = rank < C
    trigger = (ts - START) // (DAY // triggers)
    counts = np.zeros((len(leaves), triggers), dtype=np.int64)
    np.add.at(counts, (leaf[admitted], trigger[admitted]), 1)
    cumulative = np.cumsum(counts, axis=1)
    truth = defaultdict(lambda: np.zeros(triggers, dtype=np.int64))
    for (country, state, city), row in zip(leaves, cumulative):
        for key in ((country,), (country, state), (country, state, city)):
            truth[key] = truth[key] + row
    return truth


def violations(view: dict, values: dict) -> int:
    """Released parents that cannot equal their released children plus a remainder >= 0, plus
    negative or fractional values."""
    children = defaultdict(float)
    for key in view:
        if len(key) > 1 and key[:-1] in view:
            children[key[:-1]] += values[key]
    bad = sum(1 for key in view if len(key) < 3 and values[key] < children[key] - 1e-9)
    return bad + sum(1 for v in values.values() if v < 0 or v != int(v))


def run_one(epsilon: float, leaves, user, leaf, ts, triggers: int, secret: bytes, public_keys: bool = False) -> dict:
    query = QueryConfig(name="geo", key_fields=["country", "state", "city"], hierarchy=True, window="1d", triggers=triggers,
                        allowed_lateness="0s", contribution_bound=C, epsilon=epsilon, delta=1e-9,
                        public_keys=[list(names) for names in leaves] if public_keys else None)
    noise, pseudo = NodeNoise(secret), Pseudonymizer(secret)
    texts = np.array([json.dumps(list(names), separators=(",", ":")) for names in leaves], dtype=object)
    leaf_ids = pseudo.group_keys(texts.tolist())
    users = pseudo.integer_users(user.astype(np.uint64))
    with tempfile.TemporaryDirectory(prefix="dpstream-bench-hierarchy-") as tmp:
        stores = PartitionStores(tmp)
        pipe = QueryPipeline(query, noise, stores.store(0), pseudo)
        runner = QueryRunner(pipe)
        interval = DAY // triggers
        records, fire_s, step_s, views = [], [], [], []
        latest: dict = {}
        bad = {"raw": 0, "rounded": 0, "consistent": 0}
        for i in range(1, triggers + 1):
            sl = slice(np.searchsorted(ts, START + (i - 1) * interval), np.searchsorted(ts, START + i * interval))
            batch = WriteBatch()
            ev = EventColumns(users[sl], texts[leaf[sl]], leaf_ids[leaf[sl]], np.ones(sl.stop - sl.start), ts[sl])
            runner.ingest(ev, ts[sl], i, batch)  # each event arrives at its own time
            pipe.store.write(batch)
            before = pipe.stats.consistency_seconds
            started = time.perf_counter()
            released = []
            for fired in runner.fire_due(START + i * interval):
                released += fired.releases
                runner.published(fired)
            fire_s.append(time.perf_counter() - started)
            step_s.append(pipe.stats.consistency_seconds - before)
            for r in released:
                latest[tuple(r["key"])] = r
            raw = {k: r["count"] for k, r in latest.items()}
            rounded = dict(zip(raw, clamp_and_round(np.array(list(raw.values()))).tolist()))
            consistent = {k: r["consistent_count"] for k, r in latest.items()}
            bad["raw"] += violations(latest, raw)
            bad["rounded"] += violations(latest, rounded)
            bad["consistent"] += violations(latest, consistent)
            records += released
            views.append(len(latest))
        stores.close()
    truth = bounded_truth(leaves, user, leaf, ts, triggers)
    per_level = []
    for level in (1, 2, 3):
        keys = [k for k in latest if len(k) == level]
        t = np.array([truth[k][latest[k]["released_at"] - 1] for k in keys], dtype=float)
        raw = np.array([latest[k]["count"] for k in keys])
        out = {"level": level, "keys_in_truth": sum(1 for k in truth if len(k) == level and truth[k][-1] > 0), "released": len(keys),
               "stddev_last": float(np.median([latest[k]["stddev"] for k in keys])) if keys else None}
        for name, values in (("raw", raw), ("rounded", clamp_and_round(raw).astype(float)),
                             ("consistent", np.array([latest[k]["consistent_count"] for k in keys], dtype=float))):
            err = np.abs(values - t)
            out[f"mae_{name}"] = float(err.mean()) if keys else None
            out[f"l1_{name}"] = float(err.sum())
        per_level.append(out)
    return {
        "epsilon": epsilon, "records": int(len(user)), "leaves": len(leaves), "triggers": triggers,
        "released_records": len(records), "reissued": pipe.stats.consistency_updates, "view_size_last": views[-1],
        "per_level": per_level, "violations": bad,
        "trigger_seconds_median": float(np.median(fire_s)), "trigger_seconds_max": float(np.max(fire_s)),
        "consistency_seconds_median": float(np.median(step_s)), "consistency_seconds_max": float(np.max(step_s)),
        "consistency_share_of_trigger": float(np.sum(step_s) / np.sum(fire_s)),
    }


def _median_run(runs: list[dict]) -> dict:
    """Per metric, the median over runs (seeds)."""
    med = lambda values: float(np.median([v for v in values if v is not None])) if any(v is not None for v in values) else None
    out = {k: med([r[k] for r in runs]) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    out["violations"] = {k: med([r["violations"][k] for r in runs]) for k in runs[0]["violations"]}
    out["per_level"] = [{k: med([r["per_level"][i][k] for r in runs]) for k in lv} for i, lv in enumerate(runs[0]["per_level"])]
    return out


def run_hierarchy_bench(countries: int = 20, users: int = 200_000, triggers: int = 10, epsilons=(1.0, 6.0), seed: int = 1,
                        repeats: int = 3, json_path: str | None = None, public_keys: bool = False, out=sys.stdout) -> dict:
    """Each epsilon on ``repeats`` workloads (seeds ``seed``, ``seed + 1``, ...); medians printed.
    ``public_keys``: every leaf declared (a public domain), no key selection."""
    workloads = [generate(countries, users, seed + r) for r in range(repeats)]
    leaves, user = workloads[0][0], workloads[0][1]
    print(f"bench hierarchy: ~{len(leaves):,} leaves in {countries} countries, {users:,} users, ~{len(user):,} records, "
          f"C={C}, T={triggers}; medians over {repeats} seeds from {seed}"
          + ("; public keys: every leaf declared, every key released at every trigger" if public_keys else ""), file=out)
    results = {"countries": countries, "users": users, "triggers": triggers, "seeds": [seed + r for r in range(repeats)],
               "public_keys": public_keys, "epsilons": []}
    for eps in epsilons:
        runs = [run_one(eps, *w, triggers, os.urandom(32), public_keys=public_keys) for w in workloads]
        r = _median_run(runs)
        results["epsilons"].append({"epsilon": eps, "median": r, "runs": runs})
        print(f"\nepsilon {eps:g}, delta 1e-9: {r['released_records']:,.0f} records published ({r['reissued']:,.0f} re-issued by "
              f"consistency), {r['view_size_last']:,.0f} keys in the final view", file=out)
        print("  level  released/true keys  median sd   MAE raw  MAE clamp+round  MAE consistent   consistent/raw", file=out)
        for lv in r["per_level"]:
            ratio = lv["mae_consistent"] / lv["mae_raw"] if lv["mae_raw"] else float("nan")
            print(f"  {lv['level']:>5.0f}  {lv['released']:>8,.0f}/{lv['keys_in_truth']:<8,.0f}  {lv['stddev_last'] or 0:>9.1f}  "
                  f"{lv['mae_raw'] or 0:>8.1f}  {lv['mae_rounded'] or 0:>15.1f}  {lv['mae_consistent'] or 0:>14.1f}   {ratio:>12.3f}", file=out)
        v = r["violations"]
        print(f"  violations over all {triggers} views: raw {v['raw']:,.0f}, clamp+round {v['rounded']:,.0f}, consistent "
              f"{v['consistent']:.0f} (max over seeds: {max(x['violations']['consistent'] for x in runs)})", file=out)
        print(f"  per trigger: fire {1000 * r['trigger_seconds_median']:.1f} ms median ({1000 * r['trigger_seconds_max']:.1f} max), "
              f"of which consistency {1000 * r['consistency_seconds_median']:.1f} ms median "
              f"({1000 * r['consistency_seconds_max']:.1f} max); {100 * r['consistency_share_of_trigger']:.1f}% of trigger time",
              file=out)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({**results, "machine": machine()}, fh, indent=2)
    return results
