"""The ``dpstream`` command line."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Sequence

from dpstream.accountant import PrivacyPlan
from dpstream.accountant.plan import EXACT_DISCRETE_CONVERSION
from dpstream.processor.config import (
    ConfigError,
    QueryConfig,
    level_plans_for,
    load_config,
    plan_for,
)

PLAN_HELP = """Print, for each query of a config, the noise scales, thresholds, budget split and
expected error, before anything runs. Needs no noise secret and no broker (docs/plan.md).

Total privacy loss: the queries reading one input topic read the same users, so their losses
add up. Per topic, each query's (epsilon, delta) per window (what the budget ledger charges)
times the windows a UTC day and 30 UTC days reach (a 1h window: 24 a day), summed by basic
composition: epsilons and deltas add (docs/privacy.md, "The guarantee and the neighbour
relation"). That is an upper bound; any 24 hours not starting at midnight can reach one more
window of each query, shown as "any span". A dynamic query is charged once for its whole life
and counts once in every horizon (its privacy unit is an update, or its unit_field). Beside the
basic sum, the same windows composed: in zCDP (rho adds) and, where every mechanism has an exact
privacy-loss distribution (counter: tree), by composing those (pld), both at a stated delta
(--total-delta; by default the basic total's own delta), key selection's thresholding and the
samplers' terms added once (docs/privacy.md, "Totals over time"). With a budget: section each
principal's cap is shown beside its planned spend per refresh period, composed as
budget.accounting says.

Warnings (a "warning:" line on stderr, and "warnings" in --json), from the plan's public
numbers: a query releases nothing useful when a key needs more than --key-users distinct users
in one round to be released (mu + the lowest threshold tau), or when the noise stddev of a
release at the last trigger exceeds the value of a key whose --key-users users add one full
record each (times L for a sum); a topic whose users may lose more than --max-daily-epsilon per
day is warned about as advice (nothing enforces it); so is a budget cap that the planned spend
per refresh period exceeds, or that never refreshes and is reached within 30 days (the ledger
will refuse windows).

Utility preview (--sample EVENTS.jsonl): the queries run over your events through the replay
path with a throwaway random secret (never DPSTREAM_NOISE_KEY*) and a temporary state
directory, to the end of the sample's last window, publishing nothing. Per query: keys released
per trigger; error by key frequency (keys bucketed by their true distinct users, 1-9, 10-99,
100-999, 1000+: how many, how many released, median absolute and relative error against the
true value); the share of records dropped by C; and a suggested C (PipelineDP's rule: quantiles
of the records per user and window as candidates, the least RMSE of bias plus noise wins). It
compares with your true data: keep the report to yourself."""


REPLAY_HELP = """Replay events through the DP pipeline with an embedded RocksDB store.

Micro-batches follow event time: an event belongs to trigger i of its window when its time is
in [window_start + (i-1) * window/T, window_start + i * window/T).

Time (docs/privacy.md, "Time"): each query has an event-time clock that only accepted events
move, so that no single user moves it. An event dated more than the query's max_skew (default
1h) after the clock is held back and never moves it; the clock is the second-latest of the users'
latest accepted event times; when two users have held events within max_skew of each other (a
gap in the data) it jumps to the earlier. It starts at --start, else at the second-earliest
user's first event time in the first 50,000 lines. A trigger fires when the clock passes its end
plus allowed_lateness; events for a fired trigger are dropped as late.

End: with --until the clock walks to that public time (events still held and dated up to it are
accepted in time order, triggers due by then fire, dynamic queries decide every tick up to it,
events after it are "future"). Without it, events still held are "future", every trigger of
every opened window fires and dynamic queries stop at their last update: all of that follows the
data's time span. A config with a budget ledger charges every window from --start (or
budget.start) to --until as the clock reaches it, data or not, and needs both.

Noise: a fresh state directory gets a random noise label, so two replays of slightly different
data never share noise (their difference would be the exact change). --noise-label reproduces a
run on purpose; the worker's label is "worker:<app id>:<budget epoch>:<run nonce>" (its
releases, its status page and its start's log line show it). Same input, config, secret and
label: byte-identical output.

Resume: a --state-dir keeps the lines it consumed and their fingerprint (SHA-256). The same
--state-dir resumes the same --input where it stopped (the file may have grown by appended
lines); another file, or one whose first lines changed, is refused with exit code 2 before
anything is read or charged. --append says that --input continues the stream instead: it is read
from its first line (docs/user-guide.md, "Resuming and appending").

Invalid lines are reported by line number and reason (never content), counted and skipped;
late and future events are counted once in the summary, not listed (--dead-letter keeps each).
Releases of a hierarchical query also carry level, released_at, consistent_count and
consistent_other (docs/user-guide.md, "Hierarchies")."""


CONSISTENCY_NOTE = ("post-processing of released noisy counts and public parameters only: epsilon 0, delta 0 "
                    "(post-processing immunity; Fioretto, Van Hentenryck and Zhu, Lemma 3)")


def _plan_entry(query: QueryConfig, plan: PrivacyPlan) -> dict:
    entry = {"name": query.name, "window": query.window, **plan.to_dict()}
    if query.hierarchy:
        entry["levels"] = [{"key_fields": query.key_fields[:p.level], **p.to_dict()} for p in level_plans_for(query)]
        entry["consistency"] = {"epsilon": 0.0, "delta": 0.0, "why": CONSISTENCY_NOTE}
    return entry


def _human_levels(query: QueryConfig, plan: PrivacyPlan) -> list[str]:
    """The hierarchy's split: each level's share, noise and thresholds, and the free consistency step."""
    lines = [f"  hierarchy          {query.hierarchy_depth} histograms, one per prefix of key_fields (coarse to fine); every record "
             f"counts once in each; budget split by level (rho shares in zcdp, (eps, delta) shares in basic)"]
    for p in level_plans_for(query):
        taus = p.thresholds
        lines += [
            f"  level {p.level} ({', '.join(query.key_fields[:p.level])})",
            f"                     share {p.level_share:.4g}: key selection rho {p.rho_key_selection:.6g}, sigma_k = "
            f"{p.sigma_key_selection:.4f} users; perturbation rho {p.rho_perturbation:.6g}, sigma_m = {p.sigma_perturbation:.4f}",
            f"                     tau_1 = {taus[0]:.2f}, tau_T = {taus[-1]:.2f}, max {max(taus):.2f}; expected stddev at T "
            f"{p.expected_stddev:.2f}",
        ]
    lines.append(f"  consistency        parent = sum of released children + 'other', non-negative integers: {CONSISTENCY_NOTE}")
    return lines


def _column_names(query: QueryConfig) -> list[str]:
    from dpstream.processor.mechanisms.aggregates import aggregate_named

    return [c.name for c in aggregate_named(query.aggregate).columns]


def _human_plan(query: QueryConfig, plan: PrivacyPlan) -> str:
    T, C = plan.triggers, plan.contribution_bound
    taus = plan.thresholds
    lines = [
        f"query {query.name}: ({plan.epsilon:g}, {plan.delta:g})-DP per user and window "
        f"({query.window}, T={T} triggers, C={C} records per user, L={plan.clamp:g})",
        f"  composition        {plan.composition}"
        + ("  (the exact privacy curve of the worst-case user's discrete Gaussians, all parts composed; sigmas from "
           "Gaussian DP, grown until that curve meets delta)" if plan.conversion == EXACT_DISCRETE_CONVERSION else
           {"zcdp": "  (key selection and perturbation add in zCDP; one optimal CKS conversion)",
            "gdp": "  (key selection and perturbation add exactly in Gaussian DP, mu^2; one GDP conversion)"}.get(
               plan.composition, "  (paper's split, parts added)")),
        (f"  tree height h      {plan.tree_height} levels read by some output (floor(lg {T}) + 1)" if plan.counter is None else
         f"  counter            {plan.counter}: squared sensitivity of one increment h = {plan.counter_sensitivity_sq:.4f} "
         f"(plus the lattice rounding slack)"),
        f"  rho total          {plan.rho_total:.6g}   conversion delta {plan.delta_conversion:.4g}",
        (f"  key selection      rho {plan.rho_key_selection:.6g} = C x {plan.rho_key_selection_per_tree:.4g} per round tree "
         f"(sensitivity 1, h levels); sigma_k = {plan.sigma_key_selection:.4f} users" if plan.selection_weights is None else
         f"  key selection      rho {plan.rho_key_selection:.6g}, weights {list(plan.selection_weights)} "
         f"(sum of squares {sum(w * w for w in plan.selection_weights)}); sigma_k = {plan.sigma_key_selection:.4f} weighted users"),
        f"                     on its own: eps {plan.epsilon_key_selection:.4f}, delta {plan.delta_key_selection:.4g} (incl. beta term)",
        f"  thresholds         beta {plan.beta:.4g}; (e^eps+1) {'levels ' if plan.levels > 1 else ''}C beta = {plan.delta_beta:.4g}; z = sqrt(2 ln(T/beta)) = {plan.tail_multiplier:.4f}",
        f"                     release when noisy users > mu + tau_i, mu = {plan.key_threshold:g}: tau_1 = {taus[0]:.2f}, "
        f"tau_T = {taus[-1]:.2f}, min {min(taus):.2f}, max {max(taus):.2f}",
        (f"  perturbation       rho {plan.rho_perturbation:.6g}, sensitivity C*L = {C * plan.clamp:g}; sigma_m = {plan.sigma_perturbation:.4f}"
         if plan.per_key_bound is None else
         f"  perturbation       rho {plan.rho_perturbation:.6g}, per-key bound c_k = {plan.per_key_bound}: sensitivity sqrt(C c_k)*L = "
         f"{plan.perturbation_l2_sensitivity:.4g}; sigma_m = {plan.sigma_perturbation:.4f}")
        + (f" (grid {plan.resolution:g})" if plan.aggregate == "sum" else ""),
        *([f"                     {len(plan.columns)} columns, rho_m split equally: "
           + "; ".join(f"{name} sigma {sigma:.4f}" + (f" (grid {step:g})" if kind == "value" else "")
                       for name, (kind, sigma, _, step) in zip(_column_names(query), plan.columns))] if plan.columns else []),
        f"                     on its own: eps {plan.epsilon_perturbation:.4f}, delta {plan.delta_perturbation:.4g}",
        *(_human_levels(query, plan) if query.hierarchy else []),
        f"  sampler            TV <= 2^-100 per noise draw -> delta += {plan.delta_sampler:.3g}",
        f"  total spent        eps {plan.epsilon_spent:.6f}, delta {plan.delta_spent:.6g}  (declared {plan.epsilon:g}, {plan.delta:g})",
        f"  expected stddev    {plan.expected_stddev:.2f} of a released {_column_names(query)[0]} at the last trigger"
        + (" (level 1)" if query.hierarchy else ""),
    ]
    if plan.public_keys:  # no key selection: its lines say that instead
        at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("key selection"))
        lines[at:at + 4] = [f"  key selection      none: public keys, {len(query.public_key_texts):,} declared, each released at "
                            f"every trigger (no threshold, no beta term); the whole budget goes to perturbation "
                            f"(docs/privacy.md, \"Public keys\")"]
    if query.hierarchy:  # the per-part lines above are level 1's; the level block has them all
        lines = [line for line in lines if not line.lstrip().startswith(("key selection", "perturbation", "on its own", "release when"))]
    return "\n".join(lines)


def _human_dynamic_plan(q) -> str:
    plan = q.plan()
    d = plan.to_dict()
    unit = (f"per {q.unit_field!r} with at most {q.contribution_bound} updates (mechanisms at eps/{q.contribution_bound})"
            if q.unit_field else "per update")
    lines = [
        f"dynamic query {q.name}: {q.epsilon:g}-DP {unit}; per-item counts of {len(q.items)} items under insert/delete",
        f"  mechanism          {plan.mechanism}" + ("  (online interval tree, Algorithm 3 at every node)" if plan.mechanism == "interval_tree"
                                                    else "  (two insertion-only counters: inserts minus deletes)"),
        f"  partitioning       eps_p {plan.epsilon_partition:.4g} (SVT, Algorithm 2); first threshold theta_1 = {d['first_svt_threshold']:.1f} updates",
        f"  counts             eps {plan.epsilon_counts:.4g}" + (
            "; node eps by level 1..4: " + ", ".join(f"{e:.3g}" for e in d["node_epsilon_by_level"][:4])
            + f"; node deletion counters at sensitivity {d['deletion_counter_sensitivity']} (a delete takes its item's "
              "newest live copy, which depends on other updates: docs/privacy.md, \"Dynamic counts\")"
            if plan.mechanism == "interval_tree" else
            " for each of the insert and delete counters (every update is in one: parallel composition)"),
        f"  total spent        eps {plan.epsilon_spent:.6g}, delta 0 (Laplace only; declared delta {q.delta:g} unused)",
    ]
    if q.shards > 1:
        lines.insert(2, f"  shards             {q.shards}: item i (declared order) in shard i % {q.shards}, each shard its own mechanism "
                        "at this plan (an update reaches one: parallel composition)")
    if plan.static_release == "mwem_ranges":
        from dpstream.accountant.dynamic import MWEM_ROUNDS, MWEM_SIZE_SHARE

        lines.insert(-1, f"  static release     mwem_ranges: a synthetic histogram fitted to all {len(q.items) * (len(q.items) + 1) // 2} "
                         f"ranges of the items in their declared order by multiplicative weights; of each release's eps, "
                         f"{MWEM_SIZE_SHARE:g} for its size and the rest over {MWEM_ROUNDS} rounds (select by report noisy max, "
                         f"measure); no confidence intervals")
    return "\n".join(lines)


def config_with_kafka(path: str):
    """The config, whose ``kafka:`` client properties every Kafka client opened from now on takes
    (topics/client_properties.py)."""
    from dpstream.topics.client_properties import use_config_properties

    config = load_config(path)
    use_config_properties(config.kafka)
    return config


def cmd_plan(args: argparse.Namespace) -> int:
    from dpstream.processor import planning, preview

    if args.sample is None and args.plot is not None:
        raise ConfigError("--plot: needs --sample (the plot shows the utility preview)")
    if args.plot is not None:
        preview.check_plotting()
    config = load_config(args.config)
    doc = planning.plan_document(config, key_users=args.key_users, max_daily_epsilon=args.max_daily_epsilon,
                                 total_delta=args.total_delta)
    if args.sample is not None:
        doc["preview"] = preview.preview(config, args.sample)
        if args.plot is not None:
            preview.plot_preview(doc["preview"], args.plot)
    for warning in doc["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        entries = [(q, plan_for(q)) for q in config.queries]
        print("\n\n".join([_human_plan(q, p) for q, p in entries] + [_human_dynamic_plan(q) for q in config.dynamic]
                          + [planning.human_totals(doc)] + ([preview.human_preview(doc["preview"])] if "preview" in doc else [])))
    if args.plot is not None:
        print(f"plan: wrote {args.plot}", file=sys.stderr)
    return 0


def _time_arg(option: str, value):
    from dpstream.processor.config import parse_time_ms

    if value is None:
        return None
    try:
        return parse_time_ms(value)
    except ValueError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    from dpstream.processor.adapters.replay import ReplayRunner
    from dpstream.processor.mechanisms.noise import load_noise_secret

    config = load_config(args.config)
    secret = load_noise_secret(args.noise_key_file)
    start, until = _time_arg("--start", args.start), _time_arg("--until", args.until)
    runner = ReplayRunner(config, secret, args.state_dir, noise_label=args.noise_label, start_ms=start)
    log = (lambda line: print(line, file=sys.stderr)) if not args.quiet else None
    try:
        runner.check_input(args.input, append=args.append)  # another file is refused before the outputs are touched
        resuming = runner.lines_consumed > 0
        with open(args.output, "a" if resuming else "w") as out:
            dead = open(args.dead_letter, "a" if resuming else "w") if args.dead_letter else None
            try:
                summary = runner.run(args.input, out, dead_letters=dead, stop_after_lines=args.stop_after_lines, on_progress=log,
                                     until_ms=until, append=args.append)
            finally:
                if dead:
                    dead.close()
        stats = {p.query.name: p.stats for p in runner.pipelines}
        dynamic = [(d.query.name, d.updates_in, dict(d.dropped), d.counter.released) for d in runner.dynamic]
    finally:
        runner.close()
    invalid = sum(summary.invalid.values())
    print(f"replay: {summary.lines:,} lines{' (stopped early; resume with the same --state-dir)' if summary.stopped_early else ''}, "
          f"{invalid:,} invalid, {summary.triggers_fired:,} triggers fired, {summary.releases:,} releases in {summary.seconds:.1f} s", file=sys.stderr)
    for reason, count in sorted(summary.invalid.items()):
        print(f"  invalid: {reason}: {count:,}", file=sys.stderr)
    for name, st in stats.items():
        dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(st.dropped.items()) if v) or "none"
        print(f"  {name}: {st.events_in:,} events, dropped: {dropped}; {len(st.keys_released):,} keys released", file=sys.stderr)
    for name, updates, dropped, segments in dynamic:
        text = ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items()) if v) or "none"
        print(f"  {name}: {updates:,} updates, dropped: {text}; {segments:,} segments released", file=sys.stderr)
    return 0


WORKER_HELP = """Run the service: Faust agents on a Kafka broker.

Stage 1 (by user) reads the queries' input topics, bounds each user's contributions and sends
the bounded records to one repartition topic per query, partitioned by key; stage 2 (by key)
accumulates them per micro-batch and, at each trigger of the fixed schedule, once every input
partition has been read past it (the input watermark: the broker's timestamps, or the time a
partition was read to its end, never a producer's stamp, never past the wall clock), runs key
selection, perturbation and release prediction and publishes the releases to the output topic.
Each batch's messages, and each trigger's releases, go out in one Kafka transaction (--delivery
exactly-once): a read_committed consumer sees each release once, across crashes.
Input records must be keyed by the user id. Dynamic queries (insert/delete updates, one-partition
input topics) run in an agent of the worker that owns partition 0. A hierarchical query (hierarchy:
true) is partitioned by its level-1 key, so each subtree is made consistent on one worker. Worker
i of N owns partitions p with p % N == i of every topic it reads, and keeps their state under
--state-dir (keep it across restarts: it holds the contribution counts, the budget ledger, the
release journal and the input offsets). A worker whose --state-dir is empty but which already ran
under the configured budget epoch and noise secret (recorded in the dpstream-epochs topic)
refuses to start: its volume was lost (`dpstream reset` starts over on purpose). So does a worker whose input log
went back (a recreated topic, a broker that lost data), or whose input topic is stamped by its
producers (CreateTime) without --allow-create-time. With a budget and several workers,
budget.start is required: every worker charges the same windows. Topics are created if missing; the
dead-letter topic, which holds raw input, with a retention of $DPSTREAM_DEAD_LETTER_RETENTION (default 7d).
A refusal ends the worker with "dpstream worker: refused: REASON" as its last line on stderr and
exit code 2; any other failure with "dpstream worker: stopped: ..." and 1 (docs/operations.md,
"Health"); Faust's own logs show from WARNING up (all with --log-level debug).
Health and metrics: http://HOST:WEB_PORT/healthz, /readyz (starting, ready, waiting-for-broker,
stopping), /metrics, and a status page at / (/status.json: queries, windows, last and next trigger,
releases, dead letters by reason, budget, partitions). Each trigger logs one line for the worker ("trigger fired:
query=... window=... trigger=i/T keys_released=N duration_ms=... partitions=P"; a catch-up of more than 10, one
"caught up N triggers" line), and a stop one line with its reason. Consumer offsets are committed
to Kafka as the group <app id>-workers for lag tools (static workers: every 5 s, for monitoring
only; the state stays the source of truth). See docs/operations.md."""


def _env_int(name: str, default: int) -> int:
    import os

    value = os.environ.get(name)
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        raise ConfigError(f"environment {name}: must be an integer, got {value!r}") from None


def cmd_worker(args: argparse.Namespace) -> int:
    import logging

    from dpstream.processor.adapters.faust_app import WorkerSettings, run_worker
    from dpstream.processor.adapters.worker import Ownership
    from dpstream.processor.mechanisms.noise import load_noise_secret

    config = config_with_kafka(args.config)
    secret = load_noise_secret(args.noise_key_file)
    try:
        ownership = Ownership(args.worker_index, args.workers)
    except ValueError as exc:
        raise ConfigError(f"--worker-index: {exc}") from None
    from dpstream.processor.adapters.faust_app import ASSIGNMENTS

    if args.assignment not in ASSIGNMENTS:
        raise ConfigError(f"--assignment: must be one of {', '.join(ASSIGNMENTS)}, got {args.assignment!r}")
    group = args.assignment == "group"
    if group and args.workers > 1:
        raise ConfigError("--workers: the consumer group assigns the partitions with --assignment group; leave --workers and "
                          "--worker-index out")
    if group and args.delivery != "exactly-once":
        raise ConfigError("--delivery: --assignment group needs exactly-once: a partition's state moves through its changelog, "
                          "written in the transactions of the outputs it goes with (docs/operations.md, \"Elastic workers\")")
    if group and not args.instance_id:
        raise ConfigError("--instance-id: required with --assignment group (names this worker's transactional producers)")
    if config.budget is not None and config.budget.start_ms is None and group:
        raise ConfigError(f"config file {args.config}: budget.start: required with --assignment group: every worker "
                          f"charges the same windows from the same public start, so each holds the same ledger "
                          f"(docs/privacy.md, \"Windows and budget\")")
    if config.budget is not None and config.budget.start_ms is None and args.workers > 1:
        raise ConfigError(f"config file {args.config}: budget.start: required with --workers {args.workers}: every worker "
                          f"charges the same windows from the same public start, so each holds the same ledger "
                          f"(docs/privacy.md, \"Windows and budget\")")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dpstream.processor.adapters.faust_app import DELIVERIES
    from dpstream.topics.partitioner import PARTITIONERS

    if args.partitioner not in PARTITIONERS:
        raise ConfigError(f"--partitioner: must be one of {', '.join(PARTITIONERS)}, got {args.partitioner!r}")
    if args.fetch_records < 1:
        raise ConfigError(f"--fetch-records: must be at least 1, got {args.fetch_records}")
    if args.delivery not in DELIVERIES:
        raise ConfigError(f"--delivery: must be one of {', '.join(DELIVERIES)}, got {args.delivery!r}")
    from dpstream.processor.config import parse_duration_ms

    try:
        watermark_delay = parse_duration_ms(args.watermark_delay, allow_zero=True)
    except ValueError as exc:
        raise ConfigError(f"--watermark-delay: {exc}") from None
    try:
        broker_timeout = parse_duration_ms(args.broker_timeout) / 1000
    except ValueError as exc:
        raise ConfigError(f"--broker-timeout: {exc}") from None
    try:
        batch_linger = parse_duration_ms(args.batch_linger, allow_zero=True) / 1000
    except ValueError as exc:
        raise ConfigError(f"--batch-linger: {exc}") from None
    from dpstream.topics.kafka import dead_letter_retention_ms

    dead_letter_retention_ms()  # a bad $DPSTREAM_DEAD_LETTER_RETENTION is refused here, before the broker is asked
    settings = WorkerSettings(config=config, secret=secret, broker=args.broker, state_dir=args.state_dir, ownership=ownership,
                              partitions=args.partitions, web_port=args.web_port, web_host=args.web_host, app_id=args.app_id,
                              partitioner=args.partitioner, fetch_records=args.fetch_records, watermark_delay_ms=watermark_delay,
                              broker_timeout=broker_timeout, batch_linger=batch_linger, delivery=args.delivery,
                              allow_create_time=args.allow_create_time, assignment=args.assignment,
                              instance_id=args.instance_id)
    return run_worker(settings, loglevel=args.log_level)


BUDGET_HELP = """Show the privacy budget ledger of a state directory, as the ledger recorded it: per
principal charged, the limits applied at its last charge, epsilon and delta spent in the period
holding that charge, what is left of the limits, charges and refusals, and when the period began.
No number comes from the config: principals never charged are not listed, and a period that has
ended is said to (spent returns to 0 at the next charge). Without a ledger in the state directory
it says so. --config, if given, only adds a note where the config now differs from the recorded
limits. Opens the ledger read-only, so it works while the worker or a replay runs."""


def _iso_ms(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def cmd_budget(args: argparse.Namespace) -> int:
    from dpstream.accountant.ledger import recorded_entries, recorded_epoch
    from dpstream.processor.engine.budget import ledger_store_readonly

    config = load_config(args.config) if args.config else None
    if not os.path.isdir(args.state_dir):
        raise ConfigError(f"--state-dir: {args.state_dir} is not a directory")
    store = ledger_store_readonly(args.state_dir)
    epoch = recorded_epoch(store) if store is not None else None
    entries = recorded_entries(store) if epoch is not None else []
    now = int(time.time() * 1000)
    notes = []
    if epoch is None:
        notes.append(f"no budget ledger in {args.state_dir}: no worker or replay with a budget section has run on it, so "
                     f"nothing was charged there")
    elif not entries:
        notes.append("the ledger has recorded no charge yet")
    for e in entries:
        if e.refresh_ms and now >= e.last_reset_ms + e.refresh_ms:
            notes.append(f"{e.principal}: its period ended {_iso_ms(e.last_reset_ms + e.refresh_ms)}; what it spent returns "
                         f"to 0 at its next charge")
    if config is not None and epoch is not None:
        b = config.budget
        if b is None:
            notes.append(f"config {args.config} has no budget section now: the ledger above was recorded under epoch {epoch!r}")
        elif b.epoch != epoch:
            notes.append(f"config {args.config} names budget epoch {b.epoch!r}, this ledger is epoch {epoch!r}")
        else:
            for e in entries:
                limit = b.principals.get(e.principal, b.default)
                if limit is None:
                    notes.append(f"{e.principal}: config {args.config} no longer sets a budget for it")
                    continue
                policy = limit.policy(b.accounting)
                if (policy.max_epsilon, policy.max_delta, policy.refresh_ms) != (e.max_epsilon, e.max_delta, e.refresh_ms):
                    notes.append(f"{e.principal}: config {args.config} now sets max_epsilon {policy.max_epsilon:g}, max_delta "
                                 f"{policy.max_delta:g}: the ledger applies it at its next charge")
                if policy.accounting != e.accounting:
                    notes.append(f"{e.principal}: config {args.config} now sets budget.accounting {policy.accounting!r} (the ledger "
                                 f"composed with {e.accounting!r}): the ledger applies it at its next charge, to every charge of the period")
    if args.json:
        json.dump({"state_dir": args.state_dir, "ledger": epoch is not None, "epoch": epoch, "principals": [
            {"principal": e.principal, "max_epsilon": e.max_epsilon, "max_delta": e.max_delta, "refresh_ms": e.refresh_ms,
             "accounting": e.accounting, "spent_epsilon": e.spent_epsilon, "spent_delta": e.spent_delta,
             "spent_composed_epsilon": e.spent_composed_epsilon, "remaining_epsilon": e.remaining[0],
             "remaining_delta": e.remaining[1], "last_reset_ms": e.last_reset_ms, "last_reset": _iso_ms(e.last_reset_ms),
             "charges": e.charges, "refusals": e.refusals}
            for e in entries], "notes": notes}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if epoch is not None:
        print(f"budget ledger of {args.state_dir}, epoch {epoch!r}, as recorded at each principal's last charge")
    if entries:
        print(f"  {'principal':<24} {'accounting':>10} {'eps spent':>10} {'eps max':>9} {'eps left':>9} {'delta spent':>12} "
              f"{'delta left':>11} {'charges':>8} {'refused':>8}  refresh / period began")
        if any(e.accounting != "basic" for e in entries):
            print("  (zcdp, pld: eps spent is the period's charges composed, at the cap's delta; delta left is at the cap's "
                  "epsilon; delta spent is the sum of the charges' deltas)")
    for e in entries:
        refresh = f"every {e.refresh_ms / 86_400_000:g} d" if e.refresh_ms else "never"
        print(f"  {e.principal:<24} {e.accounting:>10} {e.spent_composed_epsilon:>10.4g} {e.max_epsilon:>9.4g} {e.remaining[0]:>9.4g} "
              f"{e.spent_delta:>12.3g} {e.remaining[1]:>11.3g} {e.charges:>8} {e.refusals:>8}  {refresh} / {_iso_ms(e.last_reset_ms)}")
    for note in notes:
        print(f"note: {note}")
    return 0


PRODUCE_HELP = """Send events to an input topic, for trying the worker (docs/operations.md, "Trying it
with a file"): the lines of a JSONL file (--input), or a synthetic stream of the DP-SQLP paper's
workload (--synthetic-users). Each record is keyed by its user (--user-field) and placed with
murmur2, as Java clients place keys, so that it lands on its user's partition. A missing topic is
created as the worker creates its input topics (LogAppendTime), not left to the broker's
auto-creation (CreateTime, which the worker refuses). With --config it says how many events the
worker's queries will drop as late or future; --rebase-time dates an old file from now. No broker
within --timeout: one line and exit code 1."""

TAIL_HELP = """Print the releases of an output topic, one JSON object per line, as they arrive: from
the topic's start (--latest: from now on), every partition, committed records only (a release of
an aborted transaction is never shown: librdkafka's read_committed), without joining a consumer
group or committing offsets. It runs until interrupted, or until --timeout seconds pass without a
record or --max-messages are printed. A topic that does not exist yet is waited for within
--timeout (the worker creates it when it starts); without --timeout it is an error at once."""


def cmd_produce(args: argparse.Namespace) -> int:
    from dpstream.processor.adapters import kafka_tools as kt
    from dpstream.processor.adapters.faust_app import broker_address

    if (args.input is None) == (args.synthetic_users is None):
        raise ConfigError("produce: give exactly one of --input or --synthetic-users")
    if args.rebase_time and args.input is None:
        raise ConfigError("--rebase-time: only with --input (a synthetic stream starts at --start-ms, default now)")
    if args.partitions < 1:
        raise ConfigError(f"--partitions: must be at least 1, got {args.partitions}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout: must be a positive number of seconds, got {args.timeout}")
    if args.input is not None and not os.path.isfile(args.input):
        raise kt.KafkaToolError(f"produce --input: no such file: {args.input}", 2)
    # the events' times are judged as the worker's queries reading this topic would (docs/operations.md, "Trying it with a file")
    queries = [q for q in config_with_kafka(args.config).queries if q.input_topic == args.topic] if args.config else []
    if args.config and not queries:
        raise ConfigError(f"--config: no query of {args.config} reads topic {args.topic!r} (--topic)")
    fields = {q.time_field for q in queries}
    if args.time_field is not None and queries and fields != {args.time_field}:
        raise ConfigError(f"--time-field: the queries of {args.config} reading {args.topic!r} read {', '.join(sorted(fields))}")
    if len(fields) > 1:
        raise ConfigError(f"--config: the queries reading {args.topic!r} read different time fields ({', '.join(sorted(fields))})")
    time_field = args.time_field or (fields.pop() if fields else "ts")
    broker = broker_address(args.broker)
    kt.check_broker("produce", broker, args.timeout)  # before anything else waits on it: one line, no traceback
    shifted = ""
    if args.input is not None:
        lines = kt.file_lines(args.input)
        if args.rebase_time:
            first = kt.earliest_time(kt.file_lines(args.input), time_field)
            if first is None:
                raise kt.KafkaToolError(f"produce --rebase-time: no line of {args.input} has an integer {time_field!r} "
                                        f"(epoch ms; --time-field)", 2)
            shift = int(time.time() * 1000) - first
            lines = kt.rebased(lines, time_field, shift)
            shifted = f"; {time_field!r} shifted by {shift / 3_600_000:+,.2f} h: the earliest event is dated now"
    else:
        start = args.start_ms if args.start_ms is not None else int(time.time() * 1000)
        lines = kt.synthetic_lines(args.synthetic_users, args.synthetic_keys, args.seed, start, args.span_ms)
    from dpstream.topics.kafka import INPUT_TOPIC_CONFIG, TopicSpec, create_topics

    # a topic the broker would auto-create has CreateTime, which the worker refuses: create it as the worker would
    try:
        create_topics(broker, [TopicSpec(args.topic, args.partitions, INPUT_TOPIC_CONFIG)], timeout=args.timeout,
                      client_config={"logger": kt.RDKAFKA_LOG})
    except Exception as exc:  # noqa: BLE001 - librdkafka's KafkaException (not authorized, a timeout): one line
        raise kt.KafkaToolError(f"produce: creating topic {args.topic} on {broker}: {exc.args[0] if exc.args else exc}") from None
    started = time.perf_counter()
    report = kt.TimeReport(time_field, queries)
    if args.input is None:
        report.advice = (f"a synthetic stream is dated from --start-ms (default now) over --span-ms: keep it within "
                         f"max_skew, e.g. --span-ms 600000 ({kt.DOC})")
    sent = kt.produce(broker, args.topic, lines, user_field=args.user_field, timeout=args.timeout, report=report)
    print(f"produce: {sent:,} records to {args.topic} in {time.perf_counter() - started:.1f} s{shifted}", file=sys.stderr)
    summary = report.summary()
    if summary:
        print(summary, file=sys.stderr)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from dpstream.processor.adapters.faust_app import broker_address
    from dpstream.processor.adapters.kafka_tools import tail

    if args.idle_seconds is not None and not args.idle_seconds > 0:
        raise ConfigError(f"--timeout: must be a positive number of seconds, got {args.idle_seconds}")
    if args.max_records is not None and args.max_records < 1:
        raise ConfigError(f"--max-messages: must be at least 1, got {args.max_records}")
    if args.config:
        config_with_kafka(args.config)
    try:
        seen = tail(broker_address(args.broker), args.topic, idle_seconds=args.idle_seconds, max_records=args.max_records,
                    from_beginning=not args.latest)
    except KeyboardInterrupt:  # the way to stop it without --timeout or --max-messages
        return 130
    if args.max_records is None or seen < args.max_records:
        print(f"tail: {seen:,} records; stopped after {args.idle_seconds:g} s without a new one", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dpstream.processor.demo import run_demo

    run_demo(users=args.users, keys=args.keys, triggers=args.triggers, seed=args.seed, epsilon=args.epsilon, output_dir=args.output_dir,
             noise_key_file=args.noise_key_file, noise_label=args.noise_label)
    return 0


def cmd_bench_dpsqlp(args: argparse.Namespace) -> int:
    from dpstream.processor.bench.dpsqlp import (
        run_dpsqlp_bench,
        run_dpsqlp_compare,
        run_dpsqlp_kernels,
        run_dpsqlp_per_key,
        run_dpsqlp_public,
    )

    counters = [c.strip() for c in args.counter.split(",") if c.strip()]
    bad = [c for c in counters if c not in ("tree", "blt")]
    if bad or not counters:
        raise ConfigError(f"--counter: tree, blt or a comma-separated list of them, got {args.counter!r}")
    common = dict(users=args.users, keys=args.keys, seed=args.seed, state=args.state, processes=args.processes, runs=args.runs,
                  composition=args.composition, per_key_bound=args.per_key_bound, key_selection_share=args.key_selection_share,
                  perturbation_steps=args.perturbation_steps, selection_weights=args.selection_weights)
    names = [k.strip() for k in (args.kernels or "").split(",") if k.strip()]
    if args.kernels is not None:
        if not names or len(set(names)) < len(names) or any(k not in ("numba", "numpy") for k in names):
            raise ConfigError(f"--kernels: numba, numpy or both, comma-separated, got {args.kernels!r}")
        if len(counters) > 1 or args.public_keys_top is not None or args.per_key_bounds is not None:
            raise ConfigError("--kernels: with one --counter, and without --per-key-bounds or --public-keys-top")
        run_dpsqlp_kernels(names, args.triggers, json_path=args.json, counter=counters[0], **common)
    elif args.per_key_bounds is not None:
        try:
            bounds = [None if b.strip() == "none" else int(b) for b in args.per_key_bounds.split(",") if b.strip()]
        except ValueError:
            bounds = []
        if not bounds or len(set(bounds)) < len(bounds):
            raise ConfigError(f"--per-key-bounds: distinct per-key bounds, comma-separated (none or integers), got "
                              f"{args.per_key_bounds!r}")
        if len(counters) > 1 or args.public_keys_top is not None or args.per_key_bound is not None:
            raise ConfigError("--per-key-bounds: with one --counter, and without --per-key-bound or --public-keys-top")
        common.pop("per_key_bound")
        run_dpsqlp_per_key(bounds, args.triggers, json_path=args.json, counter=counters[0], **common)
    elif args.public_keys_top is not None:
        if len(counters) > 1 or args.public_keys_top < 1:
            raise ConfigError("--public-keys-top: a positive number of keys, with one --counter")
        run_dpsqlp_public(args.public_keys_top, args.triggers, json_path=args.json, counter=counters[0], **common)
    elif len(counters) > 1:
        run_dpsqlp_compare(counters, args.triggers, json_path=args.json, plot_path=args.plot, **common)
    else:
        run_dpsqlp_bench(triggers=args.triggers, json_path=args.json, plot_path=args.plot, counter=counters[0], **common)
    return 0


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from dpstream.processor.bench.engine import run_scaling_bench

    run_scaling_bench(seen_small=args.small, seen_large=args.large, repeats=args.repeats, users_small=args.users_small,
                      users_large=args.users_large, json_path=args.json)
    return 0


def cmd_bench_kafka(args: argparse.Namespace) -> int:
    from dpstream.processor.adapters.faust_app import broker_address
    from dpstream.processor.bench.kafka import (
        run_kafka_bench,
        run_live_bench,
        run_partition_sweep,
    )

    try:
        counts = [int(p) for p in str(args.partitions).split(",")]
        if any(c < 1 for c in counts):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--partitions: a partition count or a list like 1,2,4, got {args.partitions!r}") from None
    if args.live is not None:
        if args.live <= 0:
            raise ConfigError(f"--live: must be a positive rate in events/s, got {args.live}")
        run_live_bench(broker_address(args.broker), start_rate=args.live, seconds=args.live_seconds, partitions=counts[0],
                       users=args.users, keys=args.keys, repeats=args.repeats, json_path=args.json)
    elif len(counts) > 1:
        run_partition_sweep(broker_address(args.broker), users=args.users, keys=args.keys, repeats=args.repeats,
                            partition_counts=counts, json_path=args.json, workers=args.workers)
    else:
        run_kafka_bench(broker_address(args.broker), users=args.users, keys=args.keys, repeats=args.repeats, partitions=counts[0],
                        json_path=args.json, workers=args.workers, compare_with=args.compare_with, fmt=args.format)
    return 0


def cmd_bench_restore(args: argparse.Namespace) -> int:
    from dpstream.processor.adapters.faust_app import broker_address
    from dpstream.processor.bench.restore import run_restore_bench

    if args.mb < 1:
        raise ConfigError(f"--mb: must be at least 1, got {args.mb}")
    if not 1 <= args.blob_kb <= 4096:
        raise ConfigError(f"--blob-kb: must be in [1, 4096], got {args.blob_kb}")
    run_restore_bench(broker_address(args.broker), mb=args.mb, blob_kb=args.blob_kb, repeats=args.repeats, json_path=args.json)
    return 0


def cmd_bench_dynamic(args: argparse.Namespace) -> int:
    from dpstream.processor.bench.dynamic import run_dynamic_bench

    if args.throughput:
        from dpstream.processor.adapters.faust_app import broker_address
        from dpstream.processor.bench.dynamic_throughput import run_throughput_bench

        if args.updates < 1 or args.restart_live < 1:
            raise ConfigError("--updates and --restart-live: positive counts")
        if not 1 <= args.workers <= args.partitions:
            raise ConfigError(f"--workers: from 1 to --partitions ({args.partitions}), got {args.workers}")
        if args.units < 0:
            raise ConfigError(f"--units: a count of units, 0 for no unit bound, got {args.units}")
        if not 1 <= args.partitions <= args.items:
            raise ConfigError(f"--partitions: from 1 to --items ({args.items}), one shard each, got {args.partitions}")
        run_throughput_bench(broker_address(args.broker), updates=args.updates, items=args.items, live=args.restart_live,
                             repeats=args.seeds, json_path=args.json, compare_with=args.compare_with, envelope=args.envelope,
                             partitions=args.partitions, workers=args.workers, units=args.units)
        return 0
    if args.ranges:
        from dpstream.processor.bench.dynamic_ranges import run_ranges_bench
        from dpstream.processor.mechanisms.linear_queries import MAX_RANGE_ITEMS

        try:
            histories = tuple(int(h) for h in args.range_histories.split(","))
        except ValueError:
            raise ConfigError(f"--range-histories: a comma-separated list of update counts, got {args.range_histories!r}") from None
        if not histories or min(histories) < 1:
            raise ConfigError(f"--range-histories: positive update counts, got {args.range_histories!r}")
        if not 2 <= args.range_items <= MAX_RANGE_ITEMS:
            raise ConfigError(f"--range-items: must be in [2, {MAX_RANGE_ITEMS}], got {args.range_items}")
        if args.range_live < 1:
            raise ConfigError(f"--range-live: a positive count, got {args.range_live}")
        run_ranges_bench(histories, items=args.range_items, live=args.range_live, epsilon=args.epsilon, beta=args.beta,
                         partition_share=args.partition_share, seeds=args.seeds, json_path=args.json)
        return 0
    if args.restart:
        from dpstream.processor.bench.dynamic_restart import run_restart_bench

        try:
            histories = tuple(int(h) for h in args.restart_histories.split(","))
        except ValueError:
            raise ConfigError(f"--restart-histories: a comma-separated list of update counts, got {args.restart_histories!r}") from None
        if len(histories) < 2 or min(histories) < 1:
            raise ConfigError(f"--restart-histories: at least two positive update counts, got {args.restart_histories!r}")
        for mechanism in ("baseline", "interval_tree") if args.mechanism == "both" else (args.mechanism,):
            run_restart_bench(histories, live=args.restart_live, items=args.items, mechanism=mechanism, repeats=args.seeds,
                              json_path=args.json)
        return 0
    run_dynamic_bench(items=args.items, updates=args.updates, epsilon=args.epsilon, beta=args.beta, partition_share=args.partition_share,
                      seeds=args.seeds, json_path=args.json, plot_path=args.plot)
    return 0


def cmd_bench_hierarchy(args: argparse.Namespace) -> int:
    from dpstream.processor.bench.hierarchy import run_hierarchy_bench

    run_hierarchy_bench(countries=args.countries, users=args.users, triggers=args.triggers, epsilons=args.epsilon, seed=args.seed,
                        repeats=args.repeats, json_path=args.json, public_keys=args.public_keys)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dpstream.processor.bench.engine import run_engine_bench

    run_engine_bench(repeats=args.repeats, nodes=args.nodes, keys=args.keys, triggers=args.triggers, json_path=args.json)
    return 0


def _broker_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", default=os.environ.get("DPSTREAM_BROKER", "127.0.0.1:19092"),
                        help="bootstrap servers, host:port[,host:port] or kafka://host:port (default $DPSTREAM_BROKER or 127.0.0.1:19092)")


def _version() -> str:
    import dpstream

    return dpstream.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpstream", description="Continually released, user-level differentially private histograms.")
    parser.add_argument("--version", action="version", version=f"dpstream {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="show a config's privacy calibration, total privacy loss per input topic, warnings, "
                          "and (--sample) a utility preview", description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--config", required=True, help="YAML file with a 'queries' list")
    plan.add_argument("--json", action="store_true",
                      help='print one JSON object instead of text: {"queries", "dynamic", "totals", "budget", "usefulness", '
                           '"rules", "warnings"} (and "preview" with --sample)')
    plan.add_argument("--key-users", type=float, default=10_000, metavar="N",
                      help="the plausible scale a key is judged against: distinct users per key and window you expect "
                           "(default 10,000); see 'Warnings' above")
    plan.add_argument("--max-daily-epsilon", type=float, default=10.0, metavar="EPS",
                      help="warn (advice only) when a topic's users may lose more than this epsilon per day (default 10)")
    plan.add_argument("--total-delta", type=float, default=None, metavar="DELTA",
                      help="the delta at which the composed totals (zcdp, pld) are stated (default: each horizon's basic "
                           "total delta, for a like-for-like comparison); see 'Total privacy loss' above")
    plan.add_argument("--sample", metavar="EVENTS.jsonl",
                      help="also preview utility on these events (JSONL or .jsonl.gz): a replay with a throwaway random "
                           "secret and a temporary state directory that publishes nothing; see 'Utility preview' above")
    plan.add_argument("--plot", metavar="FILE.png",
                      help="with --sample: draw keys released per trigger and the error by key frequency to this PNG "
                           "(needs matplotlib: pip install 'dpstream[bench]')")
    plan.set_defaults(func=cmd_plan)

    replay = sub.add_parser("replay", help="run the pipeline over a JSONL file with an embedded store (no broker)",
                            description=REPLAY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("--config", required=True, help="YAML file with a 'queries' list")
    replay.add_argument("--input", required=True, help="events, one JSON object per line (.jsonl or .jsonl.gz)")
    replay.add_argument("--output", required=True, help="releases are written here, one JSON object per line")
    replay.add_argument("--state-dir", help="RocksDB state directory; reuse it to resume a stopped run with the same --input, which "
                                            "may have grown (another file is refused; default: a temporary one)")
    replay.add_argument("--append", action="store_true",
                        help="with a used --state-dir: --input continues the stream after the lines the state covers; read it "
                             "from its first line (line numbers continue the stream's)")
    replay.add_argument("--noise-key-file", help="file holding the noise secret, mode 0600 (readable by group or others: refused; default: "
                        "$DPSTREAM_NOISE_KEY_FILE or $DPSTREAM_NOISE_KEY)")
    replay.add_argument("--dead-letter", help="write invalid lines here with their reason (JSONL; holds raw input)")
    replay.add_argument("--stop-after-lines", type=int,
                        help="stop after this many input lines, keeping state (for partial runs; with --append, lines count "
                             "from the first input's first line)")
    replay.add_argument("--start", help="the clock's public start, epoch ms or ISO-8601 (default: taken from the first 50,000 lines); "
                                        "with a budget ledger, the first window charged")
    replay.add_argument("--until", help="the clock's public end, epoch ms or ISO-8601: triggers and dynamic ticks due by then are decided "
                                        "(default: the end of the data); required with a budget ledger")
    replay.add_argument("--noise-label", help="reuse a run's noise on purpose (default: a random label per new state directory; a "
                                              "worker's is in its releases' run.noise_label and on its status page)")
    replay.add_argument("--quiet", action="store_true", help="no progress lines")
    replay.set_defaults(func=cmd_replay)

    worker = sub.add_parser("worker", help="run the service on a Kafka broker (Faust agents)", description=WORKER_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    worker.add_argument("--config", required=True, help="YAML file with a 'queries' list")
    _broker_arg(worker)
    worker.add_argument("--state-dir", default=os.environ.get("DPSTREAM_STATE_DIR", "./dpstream-state"),
                        help="RocksDB state of the owned partitions; must survive restarts (default $DPSTREAM_STATE_DIR or ./dpstream-state)")
    worker.add_argument("--noise-key-file", help="file holding the noise secret, mode 0600 (readable by group or others: refused; default: "
                        "$DPSTREAM_NOISE_KEY_FILE or $DPSTREAM_NOISE_KEY)")
    worker.add_argument("--worker-index", type=int, default=_env_int("DPSTREAM_WORKER_INDEX", 0),
                        help="this worker's index i in [0, N) (default $DPSTREAM_WORKER_INDEX or 0)")
    worker.add_argument("--workers", type=int, default=_env_int("DPSTREAM_WORKERS", 1),
                        help="number of workers N; worker i owns partitions p %% N == i (default $DPSTREAM_WORKERS or 1)")
    worker.add_argument("--assignment", default=os.environ.get("DPSTREAM_ASSIGNMENT", "static"),
                        help="static: worker i of N owns partitions p %% N == i (--worker-index/--workers), each keeping its "
                             "state on its own volume. group: the workers form a consumer group (the app id) with "
                             "cooperative-sticky assignment; add or remove workers at any time, and a partition's state "
                             "moves with it through its changelog topic, restored before it is processed (needs "
                             "exactly-once delivery; default $DPSTREAM_ASSIGNMENT or static; docs/operations.md, \"Elastic "
                             "workers\")")
    worker.add_argument("--instance-id", default=os.environ.get("DPSTREAM_INSTANCE_ID") or socket.gethostname(),
                        help="this worker's name in its group, unique among the running workers: it names the worker's "
                             "transactional producers, so a restarted worker fences its earlier incarnation (default "
                             "$DPSTREAM_INSTANCE_ID or the host name: the pod's name in a StatefulSet)")
    worker.add_argument("--partitions", type=int, default=_env_int("DPSTREAM_PARTITIONS", 8),
                        help="partitions of the topics the worker creates (repartition, output, ...) (default 8)")
    worker.add_argument("--web-port", type=int, default=_env_int("DPSTREAM_WEB_PORT", 9400),
                        help="port of the status page /, /healthz, /readyz and /metrics (default $DPSTREAM_WEB_PORT or 9400)")
    worker.add_argument("--web-host", default="0.0.0.0", help="address the web server binds (default 0.0.0.0)")
    worker.add_argument("--app-id", default=os.environ.get("DPSTREAM_APP_ID", "dpstream"),
                        help="Faust app id (default dpstream); with the budget epoch and the run nonce it names the worker's "
                             "noise label. It owns its output topics: another app id's worker on one of them is refused "
                             "(docs/operations.md, \"Output topics\")")
    worker.add_argument("--partitioner", default=os.environ.get("DPSTREAM_PARTITIONER", "murmur2"),
                        help="which input partition owns a user: the one this partitioner maps its user id to: murmur2 "
                             "(Java clients' default; dpstream produce), consistent (librdkafka's default crc32) or fnv1a. A "
                             "record on another partition, whatever its message key, is sent to the owner through the query's "
                             "by-user topic: counted, at the cost of a second trip through Kafka. Set it to your producers' "
                             "partitioner (dpstream check-input names it) to spare that (default $DPSTREAM_PARTITIONER or murmur2)")
    worker.add_argument("--fetch-records", type=int, default=_env_int("DPSTREAM_FETCH_RECORDS", 100_000),
                        help="most records one read from the broker hands over, over all owned partitions, and most a stage "
                             "gathers while busy (then its partitions wait, the other stages' are read on); each batch "
                             "has a fixed cost, so larger reads take in more events/s and hold the event loop longer "
                             "(default $DPSTREAM_FETCH_RECORDS or 100,000)")
    worker.add_argument("--watermark-delay", default=os.environ.get("DPSTREAM_WATERMARK_DELAY", "2s"),
                        help="how far an input partition's watermark stays behind the newest broker-stamped "
                             "(LogAppendTime) timestamp read from it, or the time it was read to its end: the broker's and "
                             "the worker's clocks may differ, and a producer's record (CreateTime) may reach the broker, by up "
                             "to this much without being late; triggers fire this much later (default "
                             "$DPSTREAM_WATERMARK_DELAY or 2s; docs/operations.md, \"Time and lateness\")")
    worker.add_argument("--batch-linger", default=os.environ.get("DPSTREAM_BATCH_LINGER", "100ms"),
                        help="how long fetched records gather before they are processed as one batch (or until "
                             "--fetch-records): each batch costs one broker round trip and one state write per "
                             "partition, so live traffic is taken in batches, with this much added latency "
                             "(default $DPSTREAM_BATCH_LINGER or 100ms)")
    worker.add_argument("--broker-timeout", default=os.environ.get("DPSTREAM_BROKER_TIMEOUT", "60s"),
                        help="how long the worker waits for a broker that does not answer (no fetch response, no "
                             "acknowledgement) before it exits non-zero for its supervisor to restart it; after 10 s "
                             "/readyz already says waiting-for-broker. At start, no broker answering within it is "
                             "refused before Faust starts (default $DPSTREAM_BROKER_TIMEOUT or 60s)")
    worker.add_argument("--delivery", default=os.environ.get("DPSTREAM_DELIVERY", "exactly-once"),
                        help="exactly-once: each batch's messages (repartition records, dead letters, a trigger's "
                             "releases) go out in one Kafka transaction with a record of what it completes, and the "
                             "worker's consumers read committed records only: a read_committed consumer sees each "
                             "release once, even across crashes. at-least-once: no transactions (a broker without "
                             "them); after a crash byte-identical releases can appear twice (default $DPSTREAM_DELIVERY "
                             "or exactly-once; docs/operations.md, \"Delivery\")")
    worker.add_argument("--allow-create-time", action="store_true",
                        default=os.environ.get("DPSTREAM_ALLOW_CREATE_TIME", "").lower() in ("1", "true", "yes"),
                        help="run on input topics with message.timestamp.type=CreateTime (the producers' stamps; Kafka's "
                             "default for topics you create). Without it the worker refuses them at start: with the "
                             "producers' stamps, a record reaching the broker more than --watermark-delay after its stamp "
                             "is late or not depending on how far behind the worker was, which other users' records "
                             "influence. Input topics the worker creates use LogAppendTime (default "
                             "$DPSTREAM_ALLOW_CREATE_TIME or off; docs/privacy.md, \"Time\")")
    worker.add_argument("--log-level", default="info", choices=["debug", "info", "warn", "error"])
    worker.set_defaults(func=cmd_worker)

    budget = sub.add_parser("budget", help="show the privacy budget ledger of a state directory", description=BUDGET_HELP)
    budget.add_argument("--config", help="optional: YAML config, only to note where it differs from what the ledger recorded")
    budget.add_argument("--state-dir", required=True, help="the worker's or replay's state directory")
    budget.add_argument("--json", action="store_true", help="print JSON")
    budget.set_defaults(func=cmd_budget)

    producer = sub.add_parser("produce", help="send a JSONL file or a synthetic stream to an input topic, keyed by user",
                              description=PRODUCE_HELP)
    _broker_arg(producer)
    producer.add_argument("--topic", default="events", help="input topic (default events)")
    producer.add_argument("--partitions", type=int, default=8,
                          help="partitions of the topic if it does not exist yet; it is then created as the worker creates "
                               "its input topics, with LogAppendTime (default 8)")
    producer.add_argument("--input", help="events, one JSON object per line (.jsonl or .jsonl.gz)")
    producer.add_argument("--user-field", default="user_id", help="field whose value becomes the message key (default user_id)")
    producer.add_argument("--synthetic-users", type=int, help="instead of --input: the DP-SQLP workload with this many users")
    producer.add_argument("--synthetic-keys", type=int, default=10_000, help="key space of the synthetic stream (default 10,000)")
    producer.add_argument("--seed", type=int, default=1, help="seed of the synthetic stream")
    producer.add_argument("--start-ms", type=int, help="first event time of the synthetic stream (default: now)")
    producer.add_argument("--span-ms", type=int, default=86_400_000,
                          help="event times spread over this many ms (default one day; the worker drops events dated more "
                               "than a query's max_skew, default 1h, after they arrive as future: use at most 3600000 for a "
                               "worker that reads them now)")
    producer.add_argument("--rebase-time", action="store_true",
                          help="with --input: shift every event's time field by one amount so that the file's earliest event "
                               "is dated now, keeping their spacing: the worker judges events by their arrival, so an old "
                               "file's events are dropped as late; rebased, each trigger fires as the clock reaches it "
                               "(docs/operations.md, \"Trying it with a file\")")
    producer.add_argument("--time-field", help="the events' time field, integer epoch ms (default: the --config queries', else ts)")
    producer.add_argument("--config", help="the worker's config: the events' times are judged as its queries reading --topic will "
                                           "judge them, and a summary line says how many they drop as late or future")
    producer.add_argument("--timeout", type=float, default=15.0,
                          help="seconds to wait for a broker that does not answer (at start, or acknowledging nothing while "
                               "records wait) before giving up with one line and exit code 1 (default 15)")
    producer.set_defaults(func=cmd_produce)

    tailer = sub.add_parser("tail", help="print releases from an output topic, one JSON object per line", description=TAIL_HELP)
    _broker_arg(tailer)
    tailer.add_argument("--topic", default="dp-histograms", help="output topic (default dp-histograms)")
    tailer.add_argument("--timeout", "--idle-seconds", dest="idle_seconds", type=float, metavar="SECONDS",
                        help="stop after this long without a new record (waiting for the topic to exist counts; default: "
                             "run until interrupted, and a missing topic is an error at once)")
    tailer.add_argument("--max-messages", "--max-records", dest="max_records", type=int, metavar="N",
                        help="stop after this many records")
    tailer.add_argument("--latest", action="store_true", help="only records published from now on")
    tailer.add_argument("--config", help="the worker's config: only its kafka: client properties are used "
                                         "(docs/operator-guide.md, \"Connecting to a secured cluster\")")
    tailer.set_defaults(func=cmd_tail)

    demo = sub.add_parser("demo", help="generate a small synthetic stream, replay it and summarize the result",
                          description="Generate a synthetic click stream, replay it through the pipeline and print, for the "
                                      "largest released pages, the raw count, the bounded truth (what contribution bounding "
                                      "keeps, what the noise is added to), the published count and its 95% interval, with "
                                      "bias (bounded - raw) and noise (published - bounded) apart. A local, synthetic, "
                                      "non-private printout: it shows raw counts of synthetic users.")
    demo.add_argument("--users", type=int, default=50_000, help="synthetic users (default 50,000)")
    demo.add_argument("--keys", type=int, default=5_000, help="key space size (default 5,000)")
    demo.add_argument("--triggers", type=int, default=24, help="triggers per one-day window (default 24)")
    demo.add_argument("--seed", type=int, default=7, help="seed of the synthetic stream (default 7)")
    demo.add_argument("--epsilon", type=float, default=6.0, help="the query's epsilon per user and day (default 6)")
    demo.add_argument("--output-dir", help="keep the generated events and releases here")
    demo.add_argument("--noise-key-file", help="file holding the noise secret (default: $DPSTREAM_NOISE_KEY_FILE or $DPSTREAM_NOISE_KEY, "
                                               "else a one-off random secret)")
    demo.add_argument("--noise-label", help="repeat a run: the same secret and label print the same output (needs a secret, "
                                            "as for replay; default: a random label)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="micro-benchmarks",
                           description="Measure the engine, the worker and the paper's workloads, each against a baseline "
                                       "run in the same process or the same run (docs/benchmarks.md); --json (and, where "
                                       "offered, --plot) keeps the results (benchmarks/results/ holds the project's).")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="noise nodes/s and tree updates/s of the DP engine (no I/O)")
    engine.add_argument("--repeats", type=int, default=5, help="runs per measurement; the median is reported")
    engine.add_argument("--nodes", type=int, default=2_000_000, help="noise values per noise run")
    engine.add_argument("--keys", type=int, default=100_000, help="keys per tree-update run")
    engine.add_argument("--triggers", type=int, default=100, help="T for the tree-update runs")
    engine.add_argument("--json", help="also write the results to this JSON file")
    engine.set_defaults(func=cmd_bench)
    scaling = bench_sub.add_parser("scaling", help="time of one trigger with 10^4 vs 10^6 keys already seen (same micro-batch), "
                                   "and stage 1's cost per record with 10^5 vs 10^7 users already seen")
    scaling.add_argument("--small", type=int, default=10_000, help="keys seen in the small setting")
    scaling.add_argument("--large", type=int, default=1_000_000, help="keys seen in the large setting")
    scaling.add_argument("--users-small", type=int, default=100_000, help="users seen in stage 1's small setting")
    scaling.add_argument("--users-large", type=int, default=10_000_000, help="users seen in stage 1's large setting")
    scaling.add_argument("--repeats", type=int, default=5, help="triggers timed per setting; the median is reported")
    scaling.add_argument("--json", help="also write the results to this JSON file")
    scaling.set_defaults(func=cmd_bench_scaling)
    kafka = bench_sub.add_parser("kafka", help="events/s of one worker and of N worker processes through the broker vs plain consume loops")
    _broker_arg(kafka)
    kafka.add_argument("--users", type=int, default=80_000, help="synthetic users (about 6.1 events each; default 80,000)")
    kafka.add_argument("--keys", type=int, default=100_000, help="key space (default 100,000)")
    kafka.add_argument("--partitions", default="8",
                       help="input and repartition partitions (default 8); a list such as 1,2,4 runs the whole comparison "
                            "once per count")
    kafka.add_argument("--repeats", type=int, default=3, help="runs of each; medians are reported")
    kafka.add_argument("--workers", type=int, default=2,
                       help="also time this many worker processes sharing the partitions, as scaled-out replicas "
                            "(worker i of N owns p %% N == i); 1: one worker only (default 2)")
    kafka.add_argument("--live", type=float, metavar="RATE",
                       help="instead: produce events live (dated and timestamped as they are sent) at RATE/s, doubling "
                            "until the worker no longer keeps up (a late drop, or records still unread 3 s after the "
                            "last one was sent), and report the highest steady rate against the bulk rate")
    kafka.add_argument("--live-seconds", type=float, default=20.0, help="seconds of live production per rate tried (default 20)")
    kafka.add_argument("--format", choices=("json", "avro"), default="json",
                       help="avro: also write the events as Avro records of confluent-kafka's serializer (through a small "
                            "in-memory schema registry) and run the worker on them, reporting avro / JSON events/s")
    kafka.add_argument("--compare-with", metavar="REV",
                       help="also run the worker of this git commit of the checkout (a temporary worktree) on the same topic, "
                            "in the same run, and report this worker's events/s over that one's")
    kafka.add_argument("--json", help="also write the results to this JSON file")
    kafka.set_defaults(func=cmd_bench_kafka)
    restore = bench_sub.add_parser("restore", help="seconds per GB for an elastic worker to restore a gained partition's "
                                   "store from its changelog, against only reading the changelog")
    _broker_arg(restore)
    restore.add_argument("--mb", type=int, default=512, help="MB of state in the changelog (default 512)")
    restore.add_argument("--blob-kb", type=int, default=64, help="size of the commit blobs among the records (default 64)")
    restore.add_argument("--repeats", type=int, default=3, help="runs of each; medians are reported")
    restore.add_argument("--json", help="also write the results to this JSON file")
    restore.set_defaults(func=cmd_bench_restore)
    dyn = bench_sub.add_parser("dynamic", help="dynamic counts: online interval tree vs baseline, heavy and little churn")
    dyn.add_argument("--items", type=int, default=8, help="item domain size (default 8)")
    dyn.add_argument("--updates", type=int, default=150_000, help="updates per stream (default 150,000)")
    dyn.add_argument("--epsilon", type=float, default=1.0)
    dyn.add_argument("--beta", type=float, default=0.05)
    dyn.add_argument("--partition-share", type=float, default=0.25, help="share of epsilon for private partitioning (default 0.25)")
    dyn.add_argument("--seeds", type=int, default=3, help="streams per kind; medians are reported")
    dyn.add_argument("--json", help="write the results to this JSON file")
    dyn.add_argument("--plot", help="draw error vs updates to this PNG")
    dyn.add_argument("--restart", action="store_true",
                     help="instead: the time a dynamic query's state takes to restart after a short and a long history with "
                          "the same live items (snapshots keep it in proportion to the live items; --seeds restarts each, median)")
    dyn.add_argument("--throughput", action="store_true",
                     help="instead: updates/s of one dynamic query through Kafka (a worker, one partition) and through "
                          "replay, on the same --updates records (heavy churn over --items, --restart-live live items), "
                          "--seeds runs each, medians; needs --broker")
    _broker_arg(dyn)
    dyn.add_argument("--compare-with", metavar="REV", help="--throughput: also time this repository's worker at another commit")
    dyn.add_argument("--envelope", choices=("none", "debezium"), default="none",
                     help="--throughput: the records' shape: update records (default) or a table's Debezium change events")
    dyn.add_argument("--partitions", type=int, default=1,
                     help="--throughput: the update topic's partitions, the query in as many shards (default 1)")
    dyn.add_argument("--workers", type=int, default=1,
                     help="--throughput: static workers sharing the partitions (default 1; more need --partitions)")
    dyn.add_argument("--units", type=int, default=0,
                     help="--throughput: with a unit bound (unit_field) over this many units, high enough to drop nothing "
                          "(Debezium events: their rows' customer_id); default 0, none")
    dyn.add_argument("--ranges", action="store_true",
                     help="instead: range counts over ordered items (static_release mwem_ranges vs histogram) under heavy churn, "
                          "all four mechanism and release pairs on the same streams, one row per --range-histories entry "
                          "(--seeds streams each, medians)")
    dyn.add_argument("--range-histories", default="20000,200000,2000000", metavar="N,N,...",
                     help="--ranges: the streams' update counts (default 20000,200000,2000000)")
    dyn.add_argument("--range-items", type=int, default=32, help="--ranges: ordered items (default 32)")
    dyn.add_argument("--range-live", type=int, default=2_000, help="--ranges: live items the streams revert to (default 2,000)")
    dyn.add_argument("--restart-histories", default="100000,10000000", metavar="N,N,...",
                     help="--restart: the histories' update counts (default 100000,10000000)")
    dyn.add_argument("--restart-live", type=int, default=10_000, help="--restart: live items the histories revert to (default 10,000)")
    dyn.add_argument("--mechanism", choices=("baseline", "interval_tree", "both"), default="baseline",
                     help="--restart: the mechanism (default baseline, the product's default)")
    dyn.set_defaults(func=cmd_bench_dynamic)
    hier = bench_sub.add_parser("hierarchy", help="consistent hierarchical counts: per-level error of raw, clamp-and-round and "
                                "consistent values, violations, time per trigger (synthetic three-level hierarchy)")
    hier.add_argument("--countries", type=int, default=20, help="top-level keys (~350 leaves each on average; default 20)")
    hier.add_argument("--users", type=int, default=200_000, help="users (~2.5 records each; default 200000)")
    hier.add_argument("--triggers", type=int, default=10, help="triggers per window (default 10)")
    hier.add_argument("--epsilon", type=float, nargs="+", default=[1.0, 6.0], help="epsilons to run (default 1 6)")
    hier.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    hier.add_argument("--repeats", type=int, default=3, help="workloads (seeds) per epsilon; medians are printed (default 3)")
    hier.add_argument("--public-keys", action="store_true",
                      help="declare every leaf of the workload as a public key (no key selection; every key released at "
                           "every trigger, the hierarchy's parents closed: docs/privacy.md, \"Public keys\")")
    hier.add_argument("--json", help="write the results as JSON here")
    hier.set_defaults(func=cmd_bench_hierarchy)
    dpsqlp = bench_sub.add_parser("dpsqlp", help="the DP-SQLP paper's synthetic workload: DP-SQLP vs Baselines 1 and 2")
    dpsqlp.add_argument("--users", type=int, default=10_000_000, help="users (paper: 10,000,000)")
    dpsqlp.add_argument("--keys", type=int, default=1_000_000, help="key space (paper: 1,000,000)")
    dpsqlp.add_argument("--triggers", type=int, default=100, help="T micro-batches in the day (paper: 100 and 1000)")
    dpsqlp.add_argument("--seed", type=int, default=1)
    dpsqlp.add_argument("--state", choices=["rocksdb", "memory"], default="rocksdb", help="state backend (default rocksdb)")
    dpsqlp.add_argument("--processes", type=int, choices=[1, 2], default=2,
                        help="2 (default): stage 1 (by user) and stage 2 (by key) in two processes with their own stores, "
                             "as deployed; 1: both in this process")
    dpsqlp.add_argument("--runs", type=int, default=1, help="run the workload this many times; times are medians (default 1)")
    dpsqlp.add_argument("--counter", default="blt",
                        help="continual counter of dpstream's run: blt (default, as in a query config) or tree (the paper's "
                             "binary tree); tree,blt runs the workload once per counter and compares them (one plot with both)")
    dpsqlp.add_argument("--composition", choices=["zcdp", "gdp", "basic"], default="gdp",
                        help="how the Gaussian parts compose (default gdp, exact Gaussian DP, as in a query config; zcdp: the "
                             "paper's analysis with the CKS conversion)")
    dpsqlp.add_argument("--per-key-bound", type=int, default=None,
                        help="records a user may add to one key, 1 to C (default: up to C); c_k keeps each user's first c_k "
                             "records per key")
    dpsqlp.add_argument("--per-key-bounds", default=None, metavar="LIST",
                        help="run the workload once per per-key bound, comma-separated (none: the default, up to C), e.g. "
                             "none,1,2,4, and compare them side by side (same data, secret and budget)")
    dpsqlp.add_argument("--kernels", default=None, metavar="LIST",
                        help="run the workload once per kernel set, comma-separated: numba (the compiled trigger kernels, "
                             "the default) and numpy (the versions they replace), e.g. numba,numpy: identical releases, times "
                             "compared in one run (docs/architecture.md, \"Kernels\"); DPSTREAM_KERNELS=numpy selects numpy "
                             "everywhere")
    dpsqlp.add_argument("--key-selection-share", type=float, default=0.5,
                        help="share of the Gaussian budget (mu^2 or rho) for key selection (default 0.5)")
    dpsqlp.add_argument("--selection-weights", type=lambda t: [int(x) for x in t.split(",")], default=None,
                        help="key selection's integer weights of a user's 1st, 2nd, ... key, comma-separated (needs --per-key-bound 1)")
    dpsqlp.add_argument("--perturbation-steps", choices=["trigger", "release"], default="trigger",
                        help="the perturbation counter steps once per trigger (default, the paper's) or once per release of the key")
    dpsqlp.add_argument("--public-keys-top", type=int, default=None, metavar="K",
                        help="run twice on the same workload: key selection, then the workload's top K keys by true count "
                             "declared as public keys (public_keys: a stand-in for a public catalogue); both scored over "
                             "those K keys (docs/privacy.md, \"Public keys\")")
    dpsqlp.add_argument("--json", help="write the results (and the per-trigger curve) to this JSON file")
    dpsqlp.add_argument("--plot", help="draw error and retained keys vs trigger to this PNG")
    dpsqlp.set_defaults(func=cmd_bench_dpsqlp)
    check = sub.add_parser("check-input", help="read a sample of an input topic and report how its records are keyed, "
                                               "partitioned, stamped and encoded (counts only)", description=CHECK_INPUT_HELP)
    _broker_arg(check)
    check.add_argument("--topic", default="events", help="the input topic (default events)")
    check.add_argument("--config", help="the worker's config: the user field of the queries reading --topic (else --user-field)")
    check.add_argument("--user-field", default="user_id", help="the records' user field, a dotted path for nested fields "
                                                               "(default user_id; --config sets it)")
    check.add_argument("--partitioner", default=os.environ.get("DPSTREAM_PARTITIONER", "murmur2"),
                       help="the worker's --partitioner to check against (default $DPSTREAM_PARTITIONER or murmur2)")
    check.add_argument("--sample", type=int, default=2000, help="records to read, the last ones of each partition (default 2,000)")
    check.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the broker and the sample (default 15)")
    check.add_argument("--json", action="store_true", help="print the report as one JSON object")
    check.set_defaults(func=cmd_check_input)
    reset = sub.add_parser("reset", help="start an application over: delete its state and internal topics, new noise label",
                           description=RESET_HELP)
    reset.add_argument("--config", required=True, help="the workers' query config (names the repartition topics)")
    reset.add_argument("--app-id", default=os.environ.get("DPSTREAM_APP_ID", "dpstream"),
                       help="the application to start over (default $DPSTREAM_APP_ID or dpstream)")
    reset.add_argument("--state-dir", default=os.environ.get("DPSTREAM_STATE_DIR", "./dpstream-state"),
                       help="the worker's state directory to delete (default $DPSTREAM_STATE_DIR or ./dpstream-state); "
                            "only a directory holding dpstream state is deleted")
    reset.add_argument("--delete-outputs", action="store_true", help="also delete the queries' output topics and release the "
                       "application's claim on them, so another application may use them (default: keep both)")
    reset.add_argument("--yes", action="store_true", help="do it (without: print what would be done)")
    _broker_arg(reset)
    reset.set_defaults(func=cmd_reset)
    keygen = sub.add_parser("keygen", help="write a new noise secret to a new file (mode 0600)", description=KEYGEN_HELP)
    keygen.add_argument("--out", default="noise.key", help="the file to create (default noise.key); never overwritten")
    keygen.set_defaults(func=cmd_keygen)
    return parser


RESET_HELP = """Start an application over on purpose (docs/operator-guide.md, "Start over"). A worker
refuses an empty state directory after it ran under the same epoch and noise secret: the state it
lost held the budget it spent. This command, with the workers stopped, deletes the state directory
and the application's internal topics (repartition topics of the config's queries, changelogs, its
consumer group's offsets), forgets its epoch marks and delivery progress, and counts a start-over
that gives the workers a new noise label (worker:<app id>:<epoch>.restart<N>:<new run nonce>). The next `dpstream
worker` with the same command line then starts afresh and reads the input topics from their start:
a second release of the same users' data under a fresh budget, which is the operator's choice: each
user's privacy loss adds up over the runs (docs/privacy.md, "Failures"). The output topics are kept,
and the application's claim on them (docs/operations.md, "Output topics"): the new run's releases
follow the old ones under the same keys, each naming its run. Without --yes it only prints what it
would do, and exits 0."""

KEYGEN_HELP = """Write a new noise secret: 32 random bytes as 64 hex digits and a newline (the one
documented format; docs/user-guide.md, "The noise secret"), to a new file created with mode 0600.
An existing file is never overwritten. Point DPSTREAM_NOISE_KEY_FILE (or --noise-key-file) at it;
keep it as long as the releases made with it matter: a new secret is a new epoch."""


CHECK_INPUT_HELP = """Read the last records of every partition of an input topic (--sample in all) and report,
as counts and shares only (never a record's content, key or user id): how the records are keyed (by
the user field, by something else, not at all); which partitioner places their keys
(murmur2: Java clients and dpstream produce; consistent: librdkafka's default; fnv1a: Sarama), and
how many are not on their user's partition under the worker's --partitioner (the worker sends
those to it through a by-user topic: counted, with a second trip through Kafka); the topic's and the records' timestamp
types (the worker needs LogAppendTime); and the records' format (JSON, the schema-registry wire
format with its schema ids, or neither). See docs/operator-guide.md, "Writing to the input topic"."""


def cmd_check_input(args: argparse.Namespace) -> int:
    import json

    from dpstream.processor.adapters import kafka_tools as kt
    from dpstream.processor.adapters.faust_app import broker_address
    from dpstream.processor.adapters.input_check import analyse, sample_topic
    from dpstream.topics.kafka import timestamp_types
    from dpstream.topics.partitioner import PARTITIONERS

    if args.partitioner not in PARTITIONERS:
        raise ConfigError(f"--partitioner: must be one of {', '.join(PARTITIONERS)}, got {args.partitioner!r}")
    if args.sample < 1:
        raise ConfigError(f"--sample: must be at least 1, got {args.sample}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout: must be a positive number of seconds, got {args.timeout}")
    user_field = args.user_field
    if args.config:
        fields = {q.user_field for q in config_with_kafka(args.config).queries if q.input_topic == args.topic}
        if len(fields) != 1:
            raise ConfigError(f"--config: {'no query' if not fields else 'queries with different user fields'} of "
                              f"{args.config} read topic {args.topic!r} (--topic)")
        user_field = fields.pop()
    broker = broker_address(args.broker)
    kt.check_broker("check-input", broker, args.timeout)
    partitions, records = sample_topic(broker, args.topic, args.sample, args.timeout)
    stamp = timestamp_types(broker, [args.topic], args.timeout).get(args.topic)
    report = analyse(args.topic, partitions, records, user_field, args.partitioner, stamp)
    print(json.dumps(report.as_dict()) if args.json else "\n".join(report.lines()))
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    from dpstream.processor.adapters.start_over import plan_start_over, start_over

    config = config_with_kafka(args.config)
    plan = plan_start_over(config, args.app_id, args.state_dir, args.broker, delete_outputs=args.delete_outputs)
    for line in plan.describe():
        print(("" if args.yes else "would ") + line)
    print(plan.privacy_note())
    if not args.yes:
        print("reset: nothing done; run again with --yes to start over", file=sys.stderr)
        return 0  # a dry run that printed its plan succeeded; a refusal is a ConfigError/StartOverError (exit 2)
    start_over(plan, args.broker)
    kept = "its output topics were deleted" if args.delete_outputs else "its output topics and their releases are kept"
    print(f"reset: application {args.app_id!r} starts over; its next worker reads the input from the start under "
          f"a new noise label (restart {plan.restarts}); {kept}; the same users' privacy loss adds up over the runs "
          f"(docs/privacy.md, \"Failures\")", file=sys.stderr)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    import secrets

    path = args.out
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"--out: {path} exists; a noise secret is never overwritten (a new secret is a new epoch)") from None
    except OSError as exc:
        raise ConfigError(f"--out: cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)  # whatever the umask
    print(f"keygen: wrote a new noise secret to {path} (mode 0600); export DPSTREAM_NOISE_KEY_FILE={path}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from dpstream.accountant.ledger import ChargePlanError
    from dpstream.processor.adapters.kafka_tools import KafkaToolError
    from dpstream.processor.engine.pipeline import StateMismatchError
    from dpstream.processor.mechanisms.noise import NoiseSecretError
    from dpstream.state.store import StateDirectoryError

    try:
        args = build_parser().parse_args(argv)  # defaults from the environment are checked here
        return args.func(args)
    except (ConfigError, NoiseSecretError, StateMismatchError, ChargePlanError, StateDirectoryError) as exc:
        print(f"dpstream: {exc}", file=sys.stderr)
        return 2
    except KafkaToolError as exc:  # produce, tail: one line naming the command, no traceback
        print(f"dpstream {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
