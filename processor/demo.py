"""``dpstream demo``: a scaled-down DP-SQLP workload replayed through the real pipeline.

The printout is local, synthetic and not private: it shows raw counts of synthetic users next to
the published ones, to explain the two ways a published count differs from the raw one
(docs/privacy.md, "Error bars"):

* **bias** = bounded truth - raw count: contribution bounding keeps each user's first C records
  per window (DP-SQLP section 3.2), so heavy users' extra records never reach the mechanism;
* **noise** = published - bounded truth: the continual counter's noise (section 4, Algorithm 3),
  which the published 95% interval is about.

The bounded truth is computed from the synthetic events with the pipeline's own
:class:`ContributionBounder` and :class:`Schedule`, in the order the replay admits them; the
demo checks that it drops exactly the records the pipeline dropped, and tests/test_demo.py
checks with the noise switched off that it is exactly what the noise is added to.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, TextIO

import numpy as np

from dpstream.accountant.plan import BudgetError, PrivacyPlan
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import ConfigError, DpstreamConfig, QueryConfig, plan_for
from dpstream.processor.engine.pipeline import Schedule
from dpstream.processor.mechanisms.bounding import ContributionBounder
from dpstream.processor.mechanisms.noise import SECRET_ENV, SECRET_FILE_ENV, load_noise_secret
from dpstream.processor.synthetic import KEYS_Q, SyntheticStream, generate

DEMO_START_MS = 1_795_132_800_000  # 2026-11-20T00:00:00Z
PAPER_KEYS = 1_000_000
TOP_PAGES = 5
LEGEND = ("bias = bounded - raw: the records beyond C per user that contribution bounding drops (not noise: the interval",
          "does not cover it); noise = published - bounded: the DP noise, which the 95% interval is about")
NOT_PRIVATE_NOTE = "local, synthetic and not private: raw counts of synthetic users are shown next to the releases"


def histogram_errors(truth: np.ndarray, released: np.ndarray) -> dict:
    """The paper's metrics over the whole key space (unreleased keys count as 0)."""
    err = np.abs(released - truth)
    return {"linf": float(err.max(initial=0.0)), "l1": float(err.sum()), "l2": float(np.sqrt((err ** 2).sum()))}


def demo_noise(noise_key_file: Optional[str], noise_label: Optional[str],
               environ: Mapping[str, str] = os.environ) -> tuple[bytes, Optional[str], str]:
    """(secret, label, note) of the demo's run. A configured secret (``--noise-key-file``, else
    $DPSTREAM_NOISE_KEY_FILE, else $DPSTREAM_NOISE_KEY, read as ``dpstream replay`` reads it) is
    used; without one the demo makes a one-off secret, so its noise cannot be repeated, and
    ``--noise-label`` is refused (it would promise a repeatable run). A run repeats exactly with
    the same secret and label (docs/user-guide.md, "Replaying a file")."""
    configured = noise_key_file or environ.get(SECRET_FILE_ENV) or environ.get(SECRET_ENV)
    if not configured:
        if noise_label is not None:
            raise ConfigError(f"--noise-label: repeating a demo run needs the same noise secret too; give it with "
                              f"--noise-key-file, ${SECRET_FILE_ENV} or ${SECRET_ENV} (without one the demo makes a "
                              f"one-off secret)")
        return os.urandom(32), None, ("one-off random noise secret: this run's noise cannot be repeated; "
                                      "--noise-label with your own secret repeats runs, see dpstream demo --help")
    secret = load_noise_secret(noise_key_file, environ)
    where = f"file {noise_key_file}" if noise_key_file else (
        f"${SECRET_FILE_ENV}" if environ.get(SECRET_FILE_ENV) else f"${SECRET_ENV}")
    if noise_label is None:
        label = os.urandom(16).hex()
        return secret, label, f"noise secret from {where}, random noise label {label}: --noise-label {label} repeats this run"
    return secret, noise_label, f"noise secret from {where}, noise label {noise_label}: the same secret and label repeat this run"


@dataclass
class Counts:
    """Per (trigger, page), cumulative over triggers: records up to and including the trigger."""

    raw: np.ndarray  # int64 (T, keys): every record
    bounded: np.ndarray  # int64 (T, keys): the records contribution bounding admits
    dropped: int  # records contribution bounding drops


def bounded_counts(stream: SyntheticStream, query: QueryConfig, plan: PrivacyPlan, keys: int) -> Counts:
    """Raw and bounded counts of the demo's events with the pipeline's own bounding (stage 1 of
    dpstream.processor.engine.pipeline.QueryPipeline.bound): one contribution budget per (window,
    user), the first C records in arrival order admitted (ContributionBounder.assign_slots).

    Arrival order is the file's line order here: the events are written in time order with no
    gap longer than max_skew, so the replay's clock holds none back and none is late
    (docs/privacy.md, "Time"); :func:`run_demo` checks the drop count against the pipeline's."""
    schedule = Schedule(query)
    window = schedule.window_of(stream.ts)
    trigger = schedule.trigger_of(stream.ts, window)
    # one group per (window, user), as in the pipeline (the group numbers' order does not matter)
    _, window_index = np.unique(window, return_inverse=True)
    _, group_of = np.unique(window_index.ravel() * (int(stream.users.max(initial=0)) + 1) + stream.users, return_inverse=True)
    group_of = group_of.ravel()
    bounder = ContributionBounder(plan.contribution_bound, plan.clamp, plan.resolution)
    admitted = bounder.assign_slots(np.zeros(int(group_of.max(initial=-1)) + 1, dtype=np.int64), group_of).admitted
    shape = (query.triggers, keys)
    cell = (trigger - 1) * keys + stream.keys
    raw = np.bincount(cell, minlength=shape[0] * shape[1]).reshape(shape).cumsum(axis=0)
    bounded = np.bincount(cell[admitted], minlength=shape[0] * shape[1]).reshape(shape).cumsum(axis=0)
    return Counts(raw, bounded, int(len(admitted) - admitted.sum()))


def _write_events(stream: SyntheticStream, path: Path) -> None:
    with open(path, "w") as fh:
        for u, k, t in zip(stream.users.tolist(), stream.keys.tolist(), stream.ts.tolist()):
            fh.write(f'{{"user_id":"user-{u}","key":"page-{k}","ts":{t}}}\n')


def _final_releases(path: Path) -> dict[int, dict]:
    """Each released page's last release, by page number (releases come in trigger order)."""
    final: dict[int, dict] = {}
    with open(path) as fh:
        for line in fh:
            record = json.loads(line)
            final[int(record["key"].split("-")[1])] = record
    return final


def page_rows(final: dict[int, dict], counts: Counts, pages: list[int]) -> list[dict]:
    """Raw, bounded, published, interval, bias and noise of ``pages`` at their last release."""
    rows = []
    for page in pages:
        record = final[page]
        t = record["trigger"]
        raw, bounded, published = int(counts.raw[t - 1, page]), int(counts.bounded[t - 1, page]), int(record["count"])
        rows.append({"page": f"page-{page}", "trigger": t, "raw": raw, "bounded": bounded, "published": published,
                     "ci95": [record["ci95_low"], record["ci95_high"]], "bias": bounded - raw, "noise": published - bounded})
    return rows


def _print_pages(p, rows: list[dict]) -> None:
    p("  largest released pages at their last release (records up to that trigger):")
    p(f"    {'page':<10} {'trigger':>7} {'raw':>9} {'bounded':>9} {'published':>10}  {'95% interval':<20} {'bias':>7} {'noise':>7}")
    for r in rows:
        interval = f"[{r['ci95'][0]:,}, {r['ci95'][1]:,}]"
        p(f"    {r['page']:<10} {r['trigger']:>7} {r['raw']:>9,} {r['bounded']:>9,} {r['published']:>10,}  {interval:<20} "
          f"{r['bias']:>+7,} {r['noise']:>+7,}")
    for line in LEGEND:
        p(f"    {line}")


def run_demo(users: int = 50_000, keys: int = 5_000, triggers: int = 24, seed: int = 7, epsilon: float = 6.0,
             delta: float = 1e-9, contribution_bound: int = 32, output_dir: Optional[str] = None,
             noise_key_file: Optional[str] = None, noise_label: Optional[str] = None,
             out: Optional[TextIO] = None, log: Optional[TextIO] = None, environ: Mapping[str, str] = os.environ) -> dict:
    """Generate, replay and explain. ``out`` (default stdout) gets the printout, identical for the
    same arguments, secret and noise label; ``log`` (default stderr) gets the run's timing."""
    out, log = out or sys.stdout, log or sys.stderr
    secret, label, secret_note = demo_noise(noise_key_file, noise_label, environ)
    query = QueryConfig(name="demo_clicks", key_fields=["key"], window="1d", triggers=triggers,
                        contribution_bound=contribution_bound, epsilon=epsilon, delta=delta)
    try:
        plan = plan_for(query)
    except BudgetError as exc:  # the demo's query is made of its options: name the option
        raise ConfigError(f"--epsilon {epsilon:g}: {str(exc).removeprefix('epsilon: ')}") from None
    # scale the key law's offset with the key space so the head/tail shape stays the paper's
    stream = generate(users, keys, seed, start_ms=DEMO_START_MS, key_q=KEYS_Q * keys / PAPER_KEYS)
    tmp = tempfile.TemporaryDirectory(prefix="dpstream-demo-") if output_dir is None else None
    work = Path(output_dir if tmp is None else tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    events_path, releases_path = work / "events.jsonl", work / "releases.jsonl"
    try:
        _write_events(stream, events_path)
        started = time.perf_counter()
        runner = ReplayRunner(DpstreamConfig(queries=[query]), secret, state_dir=None, log=log, noise_label=label)
        try:
            with open(releases_path, "w") as fh:
                summary = runner.run(str(events_path), fh)
            stats = runner.pipelines[0].stats
        finally:
            runner.close()
        print(f"demo: replayed {len(stream):,} events in {time.perf_counter() - started:.1f} s", file=log)
        final = _final_releases(releases_path)
    finally:
        if tmp is not None:
            tmp.cleanup()
    counts = bounded_counts(stream, query, plan, keys)
    if counts.dropped != stats.dropped["contribution_bound"] or stats.dropped["late"] or stats.dropped["future"]:
        raise RuntimeError(f"demo: the bounded truth drops {counts.dropped:,} records but the pipeline dropped "
                           f"{dict(stats.dropped)}: it did not admit the events in line order, or dropped some as late or future")
    truth = counts.raw[-1].astype(np.float64)
    released = np.zeros(keys)
    for page, record in final.items():
        released[page] = record["count"]
    rel = np.array(sorted(final), dtype=np.int64)
    top = rel[np.argsort(-truth[rel], kind="stable")][:TOP_PAGES].tolist()
    rows = page_rows(final, counts, top)
    errors = histogram_errors(truth, released)
    result = {
        "records": len(stream), "users": users, "keys": keys, "keys_seen": int((truth > 0).sum()), "keys_released": len(final),
        "releases": summary.releases, "triggers_fired": summary.triggers_fired, "triggers": triggers, "errors": errors,
        "median_abs_error_released": float(np.median(np.abs(released[rel] - truth[rel]))) if len(rel) else None,
        "dropped": dict(stats.dropped), "epsilon_spent": plan.epsilon_spent, "delta_spent": plan.delta_spent,
        "seconds": summary.seconds, "noise_label": label, "pages": rows,
    }
    _print_report(lambda s="": print(s, file=out), result, query, plan, secret_note,
                  (events_path, releases_path) if tmp is None else None)
    return result


def _print_report(p, result: dict, query: QueryConfig, plan, secret_note: str, files: Optional[tuple]) -> None:
    C, errors = query.contribution_bound, result["errors"]
    p(f"dpstream demo: {result['records']:,} synthetic click events from {result['users']:,} users on "
      f"{result['keys']:,} pages over one day")
    p(f"  ({NOT_PRIVATE_NOTE})")
    p(f"  ({secret_note})")
    p(f"  query: COUNT(*) per page, window 1d, T={query.triggers} triggers, C={C}, eps={query.epsilon:g}, delta={query.delta:g}")
    p(f"  replayed through the pipeline: {result['triggers_fired']} triggers fired, {result['releases']:,} releases")
    p(f"  records dropped by the contribution bound: {result['dropped']['contribution_bound']:,}, late: {result['dropped']['late']:,}")
    p(f"  pages seen: {result['keys_seen']:,}; pages released: {result['keys_released']:,} "
      f"(a page needs about tau = {plan.thresholds[0]:.0f}-{max(plan.thresholds):.0f} distinct users)")
    if result["pages"]:
        _print_pages(p, result["pages"])
        p(f"  median |published - raw| on released pages (bias and noise): {result['median_abs_error_released']:.1f}; "
          f"noise stddev at the last trigger {plan.expected_stddev:.1f}")
    p(f"  error against raw counts over all pages (unreleased count as 0): l_inf {errors['linf']:,.0f}, "
      f"l_1 {errors['l1']:,.0f}, l_2 {errors['l2']:,.0f}")
    p(f"  privacy spent: ({plan.epsilon_spent:.3f}, {plan.delta_spent:.3g})-DP per user for the day "
      f"(declared ({query.epsilon:g}, {query.delta:g}))")
    if files is not None:
        p(f"  files: {files[0]}, {files[1]}")
