"""The ``dpstream`` command line."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from accountant import PrivacyPlan
from processor.config import ConfigError, QueryConfig, load_config, plan_for

PLAN_HELP = """Print, for each query of a config, the noise scales, thresholds, budget split and
expected error, before anything runs. Needs no noise secret and no broker."""


def _plan_entry(query: QueryConfig, plan: PrivacyPlan) -> dict:
    entry = {"name": query.name, "window": query.window, **plan.to_dict()}
    return entry


def _human_plan(query: QueryConfig, plan: PrivacyPlan) -> str:
    T, C = plan.triggers, plan.contribution_bound
    taus = plan.thresholds
    lines = [
        f"query {query.name}: ({plan.epsilon:g}, {plan.delta:g})-DP per user and window "
        f"({query.window}, T={T} triggers, C={C} records per user, L={plan.clamp:g})",
        f"  composition        {plan.composition}"
        + ("  (key selection and perturbation add in zCDP; one optimal CKS conversion)" if plan.composition == "zcdp" else "  (paper's split, parts added)"),
        f"  tree height h      {plan.tree_height} levels read by some output (floor(lg {T}) + 1)",
        f"  rho total          {plan.rho_total:.6g}   conversion delta {plan.delta_conversion:.4g}",
        f"  key selection      rho {plan.rho_key_selection:.6g} = C x {plan.rho_key_selection_per_tree:.4g} per round tree "
        f"(sensitivity 1, h levels); sigma_k = {plan.sigma_key_selection:.4f} users",
        f"                     on its own: eps {plan.epsilon_key_selection:.4f}, delta {plan.delta_key_selection:.4g} (incl. beta term)",
        f"  thresholds         beta {plan.beta:.4g}; (e^eps+1) C beta = {plan.delta_beta:.4g}; z = {plan.tail_multiplier:.4f} ({plan.tail_bound})",
        f"                     release when noisy users > mu + tau_i, mu = {plan.key_threshold:g}: tau_1 = {taus[0]:.2f}, "
        f"tau_T = {taus[-1]:.2f}, min {min(taus):.2f}, max {max(taus):.2f}",
        f"  perturbation       rho {plan.rho_perturbation:.6g}, sensitivity C*L = {C * plan.clamp:g}; sigma_m = {plan.sigma_perturbation:.4f}"
        + (f" (grid {plan.resolution:g})" if plan.aggregate == "sum" else ""),
        f"                     on its own: eps {plan.epsilon_perturbation:.4f}, delta {plan.delta_perturbation:.4g}",
        f"  sampler            TV <= 2^-100 per node -> delta += {plan.delta_sampler:.3g}",
        f"  total spent        eps {plan.epsilon_spent:.6f}, delta {plan.delta_spent:.6g}  (declared {plan.epsilon:g}, {plan.delta:g})",
        f"  expected stddev    {plan.expected_stddev:.2f} of a released {plan.aggregate} at the last trigger",
    ]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    entries = [(q, plan_for(q)) for q in config.queries]
    if args.json:
        json.dump({"queries": [_plan_entry(q, p) for q, p in entries]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n\n".join(_human_plan(q, p) for q, p in entries))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from processor.bench import run_engine_bench

    run_engine_bench(repeats=args.repeats, nodes=args.nodes, keys=args.keys, triggers=args.triggers, json_path=args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpstream", description="Continually released, user-level differentially private histograms.")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="show the privacy calibration of a config", description=PLAN_HELP)
    plan.add_argument("--config", required=True, help="YAML file with a 'queries' list")
    plan.add_argument("--json", action="store_true", help='print one JSON object {"queries": [...]} instead of text')
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="micro-benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="noise nodes/s and tree updates/s of the DP engine (no I/O)")
    engine.add_argument("--repeats", type=int, default=5, help="runs per measurement; the median is reported")
    engine.add_argument("--nodes", type=int, default=2_000_000, help="noise values per noise run")
    engine.add_argument("--keys", type=int, default=100_000, help="keys per tree-update run")
    engine.add_argument("--triggers", type=int, default=100, help="T for the tree-update runs")
    engine.add_argument("--json", help="also write the results to this JSON file")
    engine.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"dpstream: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
