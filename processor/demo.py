"""``dpstream demo``: a scaled-down DP-SQLP workload replayed through the real pipeline."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import DpstreamConfig, QueryConfig, plan_for
from dpstream.processor.mechanisms.noise import NoiseSecretError, load_noise_secret
from dpstream.processor.synthetic import KEYS_Q, generate

DEMO_START_MS = 1_795_132_800_000  # 2026-11-20T00:00:00Z
PAPER_KEYS = 1_000_000


def histogram_errors(truth: np.ndarray, released: np.ndarray) -> dict:
    """The paper's metrics over the whole key space (unreleased keys count as 0)."""
    err = np.abs(released - truth)
    return {"linf": float(err.max(initial=0.0)), "l1": float(err.sum()), "l2": float(np.sqrt((err ** 2).sum()))}


def run_demo(users: int = 50_000, keys: int = 5_000, triggers: int = 24, seed: int = 7, epsilon: float = 6.0,
             delta: float = 1e-9, contribution_bound: int = 32, output_dir: Optional[str] = None, out=sys.stdout) -> dict:
    try:
        secret = load_noise_secret()
        secret_note = "noise secret from the environment"
    except NoiseSecretError:
        secret = os.urandom(32)
        secret_note = "one-off random noise secret (demo only; set DPSTREAM_NOISE_KEY for repeatable runs)"
    query = QueryConfig(name="demo_clicks", key_fields=["key"], window="1d", triggers=triggers,
                        contribution_bound=contribution_bound, epsilon=epsilon, delta=delta)
    config = DpstreamConfig(queries=[query])
    plan = plan_for(query)
    # scale the key law's offset with the key space so the head/tail shape stays the paper's
    stream = generate(users, keys, seed, start_ms=DEMO_START_MS, key_q=KEYS_Q * keys / PAPER_KEYS)
    tmp = None
    if output_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="dpstream-demo-")
        output_dir = tmp.name
    work = Path(output_dir)
    work.mkdir(parents=True, exist_ok=True)
    events_path, releases_path = work / "events.jsonl", work / "releases.jsonl"
    with open(events_path, "w") as fh:
        for u, k, t in zip(stream.users.tolist(), stream.keys.tolist(), stream.ts.tolist()):
            fh.write(f'{{"user_id":"user-{u}","key":"page-{k}","ts":{t}}}\n')
    runner = ReplayRunner(config, secret, state_dir=None)
    try:
        with open(releases_path, "w") as fh:
            summary = runner.run(str(events_path), fh)
        stats = runner.pipelines[0].stats
    finally:
        runner.close()
    final = {}
    per_trigger = np.zeros(triggers + 1, dtype=np.int64)
    with open(releases_path) as fh:
        for line in fh:
            record = json.loads(line)
            final[record["key"]] = record["count"]
            per_trigger[record["trigger"]] += 1
    truth = np.bincount(stream.keys, minlength=keys).astype(np.float64)
    released = np.zeros(keys)
    for key, value in final.items():
        released[int(key.split("-")[1])] = value
    seen = int((truth > 0).sum())
    rel = np.array([int(k.split("-")[1]) for k in final], dtype=np.int64)
    errors = histogram_errors(truth, released)
    result = {
        "records": len(stream), "users": users, "keys_seen": seen, "keys_released": len(final),
        "releases": summary.releases, "triggers": triggers, "errors": errors,
        "median_abs_error_released": float(np.median(np.abs(released[rel] - truth[rel]))) if len(rel) else None,
        "dropped": dict(stats.dropped), "epsilon_spent": plan.epsilon_spent, "delta_spent": plan.delta_spent,
        "seconds": summary.seconds,
    }
    p = lambda s="": print(s, file=out)  # noqa: E731
    p(f"dpstream demo: {len(stream):,} synthetic click events from {users:,} users on {keys:,} pages over one day")
    p(f"  ({secret_note})")
    p(f"  query: COUNT(*) per page, window 1d, T={triggers} triggers, C={contribution_bound}, eps={epsilon:g}, delta={delta:g}")
    p(f"  replayed through the pipeline in {summary.seconds:.1f} s: {summary.triggers_fired} triggers fired, {summary.releases:,} releases")
    p(f"  records dropped by the contribution bound: {stats.dropped['contribution_bound']:,}, late: {stats.dropped['late']:,}")
    p(f"  pages seen: {seen:,}; pages released: {len(final):,} (a page needs about tau = {plan.thresholds[0]:.0f}-{max(plan.thresholds):.0f} distinct users)")
    if len(rel):
        top = rel[np.argsort(-truth[rel])][:5]
        p("  largest pages, true vs published count:")
        for k in top.tolist():
            p(f"    page-{k:<8} true {int(truth[k]):>8,}   published {int(released[k]):>8,}")
        p(f"  median |error| on released pages: {result['median_abs_error_released']:.1f} (noise stddev at the last trigger {plan.expected_stddev:.1f})")
    p(f"  error over all {keys:,} pages (unreleased count as 0): l_inf {errors['linf']:,.0f}, l_1 {errors['l1']:,.0f}, l_2 {errors['l2']:,.0f}")
    p(f"  privacy spent: ({plan.epsilon_spent:.3f}, {plan.delta_spent:.3g})-DP per user for the day (declared ({epsilon:g}, {delta:g}))")
    if tmp is None:
        p(f"  files: {events_path}, {releases_path}")
    else:
        tmp.cleanup()
    return result
