"""`dpstream plan --sample`: a utility preview of a config on the user's own events (docs/plan.md,
"A utility preview on your own data").

The config's DP-SQLP queries run over the sample through the product's own replay path
(:class:`dpstream.processor.adapters.replay.ReplayRunner`, one runner core) with a **throwaway
random secret** (never the configured one: no DPSTREAM_NOISE_KEY* is read), a random noise label
and a temporary state directory, and **publish nothing**: the releases are collected in memory
and the state directory is deleted. The budget section is left out (nothing is charged, no window
refused) and so are dynamic queries (their updates are another format).

What it reports per query, comparing the releases with the sample's true values (fine here: the
user's own data, run locally, with a secret that is thrown away; the report says so, and it is
not itself differentially private, so it must never be published):

* keys released per trigger, over the sample's triggers (in each window, from the first to the
  last trigger holding sample events), and at the last of them;
* error by key-frequency bucket: the (window, key) pairs bucketed by their true number of
  distinct users in the sample (1-9, 10-99, 100-999, 1000+), with how many were released and the
  median absolute and relative error of each released key's last release in the window against
  the true value at that trigger (count, or sum; for a mean its sum);
* the share of records dropped by the contribution bound C (the pipeline's own count);
* a suggested C, PipelineDP's parameter tuning rule (analysis/parameter_tuning.py: candidates
  from quantiles of the per-user contribution histogram, the one with the least RMSE chosen),
  with dpstream's own error model: :func:`suggest_contribution_bound`.

The replay runs to the end of the sample's last window (``until``), so a sample shorter than one
window still fires every trigger of it (docs/privacy.md, "Time": the clock starts from the
sample's own times).
"""
from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from dpstream.processor.config import (
    ConfigError,
    DpstreamConfig,
    QueryConfig,
    level_plans_for,
    parse_duration_ms,
)

#: key-frequency buckets: distinct users of a (window, key) in the sample
BUCKETS: tuple[tuple[int, Optional[int]], ...] = ((1, 9), (10, 99), (100, 999), (1000, None))
#: quantiles of the per-(user, window) record counts tried as C (PipelineDP's QUANTILES strategy
#: uses 0.9 to 0.995 and the maximum; lower ones added, since dpstream's noise grows with C)
C_QUANTILES = (0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995)
TRUTH_NOTE = ("compared with the sample's true values: your own data, run locally with a throwaway random secret; "
              "this report is not differentially private, keep it to yourself")
SUGGESTION_RULE = ("candidates: the configured C, the 0.5 to 0.995 quantiles and the maximum of the records per user and "
                   "window in the sample; for each, every (window, key) of the sample gets the squared error it would "
                   "have: (true value - value kept under that C)^2 + (noise stddev at the last trigger under that C)^2 "
                   "when its distinct users kept exceed mu + the lowest threshold tau, else its whole true value squared "
                   "(not released); the suggestion is the candidate with the least root mean squared error (ties: the "
                   "smaller C). PipelineDP's parameter tuning rule, with dpstream's own noise and thresholds")
WEIGHTS_RULE = ("the sample's participation shape p_j: the share of (user, key) pairs in a window that are the user's "
                "j-th distinct key (in line order), j <= C. Weights proportional to p (Cauchy-Schwarz: the most signal "
                "per participation for the same L2 charge), as integers w_j = round(s p_j / p_1) for the smallest scale "
                "s <= 16 within 1% of the best gain; the gain is sum_j p_j w_j / sqrt(sum_j w_j^2 / C), 1 for no weights "
                "(docs/privacy.md, \"Weighted key selection\"). They need per_key_bound: 1")
#: weights are integers in [0, 1024] (dpstream.accountant.plan); the scales tried reach 16
MAX_WEIGHT_SCALE = 16
CHUNK = 50_000


def bucket_label(lo: int, hi: Optional[int]) -> str:
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def bucket_of(users: int) -> int:
    for i, (lo, hi) in enumerate(BUCKETS):
        if users >= lo and (hi is None or users <= hi):
            return i
    raise ValueError(users)


@dataclass
class _Events:
    """A query's valid events of the sample, in line order, as columns."""

    users: np.ndarray  # int64 codes
    cells: list  # per level: int64 cell codes ((window, level key))
    values: np.ndarray
    triggers: np.ndarray
    windows: np.ndarray
    eligible: np.ndarray  # competes for the user's C slots (per_key_bound c_k: among the user's first c_k records of the key)
    rank: np.ndarray  # among the user's eligible records of the window, 0-based, in line order
    cell_keys: list  # per level: cell code -> (window, level, key parts)


def _open_lines(path: Path):
    from dpstream.processor.adapters.replay import _open_lines as open_lines

    return open_lines(path)


def _read_events(config: DpstreamConfig, path: Path) -> dict[str, _Events]:
    """Parse the sample once per query with the product's decoder and event parser."""
    from dpstream.topics.decoding import decoder_for
    from dpstream.topics.records import EventParser

    decoder = decoder_for("json")  # a sample file is JSON lines, whatever the topic's input_format
    parsers = {q.name: EventParser.for_query(q) for q in config.queries}
    cols = {q.name: ([], [], [], []) for q in config.queries}  # users, keys, values, ts

    def flush(raws):
        objs = decoder.decode(raws)
        for q in config.queries:
            batch = parsers[q.name].parse_batch(objs)
            u, k, v, t = cols[q.name]
            u.extend(batch.users)
            k.extend(batch.keys)
            v.append(batch.values)
            t.append(batch.ts)

    raws = []
    for raw in _open_lines(path):
        raws.append(raw)
        if len(raws) >= CHUNK:
            flush(raws)
            raws = []
    flush(raws)
    return {q.name: _columns(q, *cols[q.name]) for q in config.queries}


def _columns(q: QueryConfig, users: list, keys: list, values: list, ts: list) -> _Events:
    W = q.window_ms
    step = W // q.triggers
    ts = np.concatenate(ts) if ts else np.zeros(0, dtype=np.int64)
    values = np.concatenate(values) if values else np.zeros(0)
    windows = ts - ts % W
    triggers = (ts - windows) // step + 1
    user_codes: dict = {}
    ucode = np.fromiter((user_codes.setdefault(u, len(user_codes)) for u in users), dtype=np.int64, count=len(users))
    parts = [(k,) if len(q.key_fields) == 1 else tuple(json.loads(k)) for k in keys]
    depth = q.hierarchy_depth
    levels = range(1, depth + 1) if q.hierarchy else (1,)
    cells, cell_keys = [], []
    for level in levels:
        codes: dict = {}
        col = np.fromiter((codes.setdefault((w, p[:level] if q.hierarchy else p), len(codes))
                           for w, p in zip(windows.tolist(), parts)), dtype=np.int64, count=len(parts))
        cells.append(col)
        cell_keys.append([(w, level, p) for (w, p) in codes])
    # bounding as stage 1 does it, in line order: per (user, window), with per_key_bound c_k only
    # a user's first c_k records of a key compete for the C slots; the first C of those are kept
    eligible = np.ones(len(ts), dtype=bool)
    rank = np.zeros(len(ts), dtype=np.int64)
    seen: dict = {}
    per_cell: dict = {}  # (user, cell): the user's records of the key so far
    full = cells[-1]  # the full key's cell (window, key)
    per_key = q.per_key_bound
    for i, (u, w, c) in enumerate(zip(ucode.tolist(), windows.tolist(), full.tolist())):
        if per_key is not None:
            m = per_cell.get((u, c), 0)
            if m >= per_key:
                eligible[i] = False
                continue
            per_cell[(u, c)] = m + 1
        n = seen.get((u, w), 0)
        rank[i] = n
        seen[(u, w)] = n + 1
    return _Events(ucode, cells, values, triggers, windows, eligible, rank, cell_keys)


class _Collect(io.StringIO):
    """Where the replay writes its releases: memory only (nothing is published)."""


def _until_ms(config: DpstreamConfig, events: dict[str, _Events]) -> Optional[int]:
    """The end of the sample's last window (plus the query's allowed lateness), over the queries."""
    ends = []
    for q in config.queries:
        ev = events[q.name]
        if len(ev.windows):
            ends.append(int(ev.windows.max()) + q.window_ms + parse_duration_ms(q.allowed_lateness, allow_zero=True))
    return max(ends) if ends else None


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def _median(values: list) -> Optional[float]:
    return float(np.median(values)) if values else None


def _quantile(sorted_counts: np.ndarray, q: float) -> int:
    """Nearest-rank quantile of per-user counts (an integer C)."""
    n = len(sorted_counts)
    return int(sorted_counts[min(n - 1, max(0, math.ceil(q * n) - 1))])


def suggest_contribution_bound(q: QueryConfig, ev: _Events) -> dict:
    """The suggested C (module docstring; SUGGESTION_RULE): each candidate's plan comes from the
    accountant (noise stddev and thresholds under that C), its bias from the sample."""
    if not len(ev.values):
        return {"value": None, "rule": SUGGESTION_RULE, "candidates": []}
    n_users = int(ev.users.max()) + 1
    groups = np.unique((ev.windows // q.window_ms) * n_users + ev.users, return_counts=True)[1]
    counts = np.sort(groups)
    candidates = sorted({q.contribution_bound, int(counts[-1]), *(_quantile(counts, x) for x in C_QUANTILES)})
    n_levels = len(ev.cells)
    totals = [np.bincount(ev.cells[lv], weights=ev.values) for lv in range(n_levels)]
    rows = []
    for c in candidates:
        try:
            # a per-key bound above a candidate C bounds nothing that C does not (and is refused): C
            update = {"contribution_bound": c}
            if q.per_key_bound is not None and q.per_key_bound > c:
                update["per_key_bound"] = c
            plans = level_plans_for(q.model_copy(update=update))
        except (ConfigError, ValueError):
            continue  # beyond the sampler's range, or weights longer than C: not a candidate
        kept = ev.eligible & (ev.rank < c)
        sq, n = 0.0, 0
        for lv in range(n_levels):
            p = plans[lv]
            cells = ev.cells[lv]
            size = len(totals[lv])
            kept_total = np.bincount(cells[kept], weights=ev.values[kept], minlength=size)
            kept_users = _distinct_users(cells[kept], ev.users[kept], size)
            released = kept_users > p.key_threshold + min(p.thresholds)
            err = np.where(released, (totals[lv] - kept_total) ** 2 + p.expected_stddev ** 2, totals[lv] ** 2)
            sq += float(err.sum())
            n += size
        dropped = int(len(ev.values) - kept.sum())
        rows.append({"C": c, "dropped_share": dropped / len(ev.values), "expected_stddev": plans[0].expected_stddev,
                     "min_users_to_release": min(p.key_threshold + min(p.thresholds) for p in plans),
                     "rmse": math.sqrt(sq / n)})
    best = min(rows, key=lambda r: (r["rmse"], r["C"])) if rows else None
    return {"value": best["C"] if best else None, "rule": SUGGESTION_RULE, "candidates": rows,
            "records_per_user_window": {"median": _quantile(counts, 0.5), "p90": _quantile(counts, 0.9),
                                        "p99": _quantile(counts, 0.99), "max": int(counts[-1])}}


def participation_shape(ev: _Events, contribution_bound: int) -> np.ndarray:
    """p_j, j = 1..C: the share of (user, window, key) pairs that are the user's j-th distinct
    key of the window, in line order (what slot a record of the key takes with per_key_bound 1)."""
    full = ev.cells[-1]  # (window, key) cells
    if not len(full):
        return np.zeros(contribution_bound)
    n_cells = int(full.max()) + 1
    _, first = np.unique(ev.users * n_cells + full, return_index=True)
    first = np.sort(first)  # each pair's first record, in line order
    keys = np.stack([ev.windows[first], ev.users[first]])
    order = np.lexsort(keys[::-1])  # by (window, user), line order kept within
    w, u = ev.windows[first][order], ev.users[first][order]
    start = np.r_[True, (w[1:] != w[:-1]) | (u[1:] != u[:-1])]
    rank = np.arange(len(order)) - np.nonzero(start)[0][np.cumsum(start) - 1]
    counts = np.bincount(rank[rank < contribution_bound], minlength=contribution_bound).astype(np.float64)
    return counts / max(counts.sum(), 1.0)


def selection_gain(shape: np.ndarray, weights, contribution_bound: int) -> float:
    """Signal per participation over the noise scale of weights against none (docs/privacy.md,
    "Weighted key selection"): ``sum_j p_j w_j / sqrt(sum_j w_j^2 / C)``."""
    w = np.zeros(contribution_bound)
    w[:len(weights)] = weights
    return float((shape * w).sum() / math.sqrt((w ** 2).sum() / contribution_bound))


def suggest_selection_weights(shape: np.ndarray, contribution_bound: int) -> dict:
    """Integer weights proportional to the participation shape (WEIGHTS_RULE)."""
    if not shape.any() or shape[0] == 0:
        return {"weights": None, "gain": None, "shape": shape.tolist(), "rule": WEIGHTS_RULE}
    tried = []
    for scale in range(1, MAX_WEIGHT_SCALE + 1):
        w = [int(round(scale * x / shape[0])) for x in shape.tolist()]
        while w and w[-1] == 0:
            w.pop()
        tried.append((selection_gain(shape, w, contribution_bound), w))
    best = max(g for g, _ in tried)
    gain, weights = next((g, w) for g, w in tried if g >= 0.99 * best)
    return {"weights": weights, "gain": gain, "shape": shape.tolist(), "rule": WEIGHTS_RULE}


def _distinct_users(cells: np.ndarray, users: np.ndarray, size: int) -> np.ndarray:
    """Distinct users per cell code (0..size-1)."""
    if not len(cells):
        return np.zeros(size, dtype=np.int64)
    n_users = int(users.max()) + 1
    pairs = np.unique(cells * n_users + users)
    return np.bincount(pairs // n_users, minlength=size)


def _key_parts(key) -> tuple:
    return tuple(key) if isinstance(key, list) else (key,)


def _query_report(q: QueryConfig, ev: _Events, releases: list, stats) -> dict:
    """Per-trigger releases, error by bucket, dropped share and the suggested C of one query."""
    from dpstream.processor.mechanisms.aggregates import aggregate_named

    field = aggregate_named(q.aggregate).columns[0].name
    per_trigger: dict = {}
    last: dict = {}  # (window, level, key parts) -> (trigger, released value)
    for r in releases:
        w, t = int(r["window_start"]), int(r["trigger"])
        per_trigger[(w, t)] = per_trigger.get((w, t), 0) + 1
        cell = (w, int(r.get("level", 1)), _key_parts(r["key"]))
        if cell not in last or t >= last[cell][0]:
            last[cell] = (t, float(r[field]))
    # the sample's triggers: in each window, from the first to the last trigger holding its events
    windows = sorted(set(ev.windows.tolist()))
    span = {w: (int(ev.triggers[ev.windows == w].min()), int(ev.triggers[ev.windows == w].max())) for w in windows}
    series = [per_trigger.get((w, t), 0) for w in windows for t in range(span[w][0], span[w][1] + 1)]
    # truth per (window, key): distinct users, and the value up to each trigger (cumulative sums
    # over the events sorted by key cell, then trigger)
    buckets = [{"users": bucket_label(lo, hi), "keys": 0, "released": 0, "_abs": [], "_rel": []} for lo, hi in BUCKETS]
    for lv, cells in enumerate(ev.cells):
        keys = ev.cell_keys[lv]
        users = _distinct_users(cells, ev.users, len(keys))
        order = np.lexsort((ev.triggers, cells))
        sorted_cells, sorted_triggers = cells[order], ev.triggers[order]
        cumulative = np.concatenate([[0.0], np.cumsum(ev.values[order])])
        for c, key in enumerate(keys):
            b = buckets[bucket_of(int(users[c]))]
            b["keys"] += 1
            hit = last.get(key)
            if hit is None:
                continue
            trigger, value = hit
            start, end = np.searchsorted(sorted_cells, c, "left"), np.searchsorted(sorted_cells, c, "right")
            upto = start + int(np.searchsorted(sorted_triggers[start:end], trigger, "right"))
            truth = float(cumulative[upto] - cumulative[start])
            b["released"] += 1
            b["_abs"].append(abs(value - truth))
            b["_rel"].append(abs(value - truth) / max(abs(truth), 1.0))
    for b in buckets:
        b["median_abs_error"] = _median(b.pop("_abs"))
        b["median_rel_error"] = _median(b.pop("_rel"))
    dropped = {k: int(v) for k, v in sorted(stats.dropped.items()) if v}
    events_in = int(stats.events_in)
    return {
        "name": q.name,
        "public_keys": q.public_key_texts is not None,  # every declared key at every trigger, no selection
        "field": field,
        "events": events_in,
        "windows": len(windows),
        "triggers": len(series),
        "keys_released_per_trigger": {
            "median": float(np.median(series)) if series else None, "min": min(series, default=None),
            "max": max(series, default=None), "last": series[-1] if series else None, "series": series},
        "error_by_users": buckets,
        "dropped": dropped,
        "dropped_by_contribution_bound": dropped.get("contribution_bound", 0),
        "dropped_share_by_contribution_bound": dropped.get("contribution_bound", 0) / events_in if events_in else 0.0,
        "contribution_bound": q.contribution_bound,
        "suggested_contribution_bound": suggest_contribution_bound(q, ev),
        # public keys have no selection to weigh
        "suggested_selection_weights": (None if q.public_key_texts is not None else
                                        suggest_selection_weights(participation_shape(ev, q.contribution_bound), q.contribution_bound)),
    }


def preview(config, sample: Union[str, os.PathLike]) -> dict:
    """Run the config's DP-SQLP queries over ``sample`` (JSONL or .jsonl.gz) and report their
    utility; see the module docstring. ``config``: a path, a mapping or a loaded config."""
    from dpstream.processor.adapters.replay import ReplayRunner
    from dpstream.processor.planning import as_config

    path = Path(sample)
    if not path.is_file():
        raise ConfigError(f"--sample: {sample}: no such file")
    config = as_config(config)
    skipped = [q.name for q in config.dynamic]
    config = config.model_copy(update={"budget": None, "dynamic": []})
    if not config.queries:
        return {"note": TRUTH_NOTE, "sample": str(sample), "queries": [], "skipped_dynamic": skipped}
    events = _read_events(config, path)
    until = _until_ms(config, events)
    if until is None:
        raise ConfigError(f"--sample: {sample}: no line is a valid event for any query (check the field names: "
                          f"{', '.join(sorted({q.user_field for q in config.queries}))}, the key fields and time fields)")
    # a throwaway secret: never the configured one, never from the environment
    runner = ReplayRunner(config, os.urandom(32), None, log=io.StringIO())
    try:
        out = _Collect()
        summary = runner.run(str(path), out, until_ms=until)
        stats = {p.query.name: p.stats for p in runner.pipelines}
    finally:
        runner.close()
    by_query: dict = {q.name: [] for q in config.queries}
    for line in out.getvalue().splitlines():
        record = json.loads(line)
        by_query[record["query"]].append(record)
    return {
        "note": TRUTH_NOTE,
        "sample": str(sample),
        "secret": "a throwaway random secret and a temporary state directory; nothing was published",
        "lines": summary.lines,
        "invalid": dict(sorted(summary.invalid.items())),
        "until": until,
        "until_iso": _iso(until),
        "skipped_dynamic": skipped,
        "buckets": [bucket_label(lo, hi) for lo, hi in BUCKETS],
        "queries": [_query_report(q, events[q.name], by_query[q.name], stats[q.name]) for q in config.queries],
    }


def human_preview(report: dict) -> str:
    lines = [f"utility preview on {report['sample']} ({report.get('lines', 0):,} lines; {report.get('secret', '')}; replayed "
             f"to {report.get('until_iso', '-')}, the end of the sample's last window)",
             f"  {report['note']}"]
    for reason, n in (report.get("invalid") or {}).items():
        lines.append(f"  invalid: {reason}: {n:,}")
    if report.get("skipped_dynamic"):
        lines.append(f"  not previewed (dynamic queries): {', '.join(report['skipped_dynamic'])}")
    for r in report["queries"]:
        k = r["keys_released_per_trigger"]
        lines.append(f"query {r['name']}: {r['events']:,} events in {r['windows']} window{'s' if r['windows'] != 1 else ''}; "
                     f"{r['triggers']} trigger{'s' if r['triggers'] != 1 else ''} from each window's first to its last trigger "
                     f"holding sample events")
        if k["median"] is not None:
            lines.append(f"  keys released per trigger   median {k['median']:g}, min {k['min']}, max {k['max']}, at the last "
                         f"trigger {k['last']}")
        lines.append(f"  error of the released {r['field']} by distinct users of a key in a window (its last release vs the "
                     f"true value then):")
        lines.append(f"    {'users':<10}{'keys':>9}{'released':>10}{'median |err|':>15}{'median rel':>12}")
        for b in r["error_by_users"]:
            abs_err = "-" if b["median_abs_error"] is None else f"{b['median_abs_error']:,.1f}"
            rel_err = "-" if b["median_rel_error"] is None else f"{b['median_rel_error']:.3g}"
            lines.append(f"    {b['users']:<10}{b['keys']:>9,}{b['released']:>10,}{abs_err:>15}{rel_err:>12}")
        s = r["suggested_contribution_bound"]
        lines.append(f"  dropped by C = {r['contribution_bound']}: {r['dropped_by_contribution_bound']:,} records, "
                     f"{100 * r['dropped_share_by_contribution_bound']:.2f}% of {r['events']:,}"
                     + (f" (other drops: {', '.join(f'{k} {v:,}' for k, v in r['dropped'].items() if k != 'contribution_bound')})"
                        if len(r["dropped"]) > (1 if "contribution_bound" in r["dropped"] else 0) else ""))
        if s["value"] is not None:
            d = s["records_per_user_window"]
            lines.append(f"  records per user and window: median {d['median']}, p90 {d['p90']}, p99 {d['p99']}, max {d['max']}")
            lines.append(f"  suggested C = {s['value']}  (least RMSE; docs/plan.md):")
            for row in s["candidates"]:
                mark = " <" if row["C"] == s["value"] else ""
                bar = "public keys" if r.get("public_keys") else f"key needs > {row['min_users_to_release']:,.0f} users"
                lines.append(f"    C {row['C']:>6}: drops {100 * row['dropped_share']:6.2f}%, stddev {row['expected_stddev']:10,.1f}, "
                             f"{bar}, RMSE {row['rmse']:,.1f}{mark}")
        w = r.get("suggested_selection_weights")
        if w and w["weights"]:
            shape = ", ".join(f"{x:.3f}" for x in w["shape"][:6])
            lines.append(f"  suggested selection_weights: {w['weights']} (with per_key_bound: 1; {w['gain']:.2f}x the signal per "
                         f"participation of no weights at C = {r['contribution_bound']}); the sample's share of a user's 1st, 2nd, "
                         f"... key: {shape}, ...")
            lines.append("    like the suggested C, these come from the sample: use them only if the sample is not the data "
                         "you will release (a previous period, a public sample; docs/plan.md, \"Selection weights\")")
    return "\n".join(lines)


def check_plotting() -> None:
    """Before anything runs: --plot needs matplotlib (one clear line when it is missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot: needs matplotlib, which is not installed (pip install 'dpstream[bench]')") from None


def plot_preview(report: dict, path: str) -> None:
    """Keys released per trigger, and the median relative error by bucket, to a PNG."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(report["queries"]))
    for i, r in enumerate(report["queries"]):
        series = r["keys_released_per_trigger"]["series"]
        left.plot(range(1, len(series) + 1), series, label=r["name"])
        rel = [b["median_rel_error"] if b["median_rel_error"] is not None else np.nan for b in r["error_by_users"]]
        x = np.arange(len(rel)) + i * width
        right.bar(x, rel, width=width, label=r["name"])
        for xi, b in zip(x, r["error_by_users"]):  # released of all keys, at the foot of each bar
            right.text(xi, 0.01, f"{b['released']}/{b['keys']}", transform=right.get_xaxis_transform(), ha="center",
                       va="bottom", fontsize=7, rotation=90)
    left.set_xlabel("trigger (in time order over the sample's windows)")
    left.set_ylabel("keys released")
    left.set_title("keys released per trigger")
    right.set_xticks(np.arange(len(report["buckets"])) + 0.4 - width / 2, report["buckets"])
    right.set_xlabel("distinct users of a key in a window (labels: released/keys)")
    right.set_ylabel("median relative error of released keys")
    if any(b["median_rel_error"] for r in report["queries"] for b in r["error_by_users"]):
        right.set_yscale("log")
    right.set_title("error by key frequency")
    for ax in (left, right):
        ax.legend(fontsize=8)
    fig.suptitle("dpstream plan --sample (throwaway secret; compared with the sample's true values)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
