"""`dpstream plan`'s document: every query's calibration, the total privacy loss per input topic
over a day and 30 days (by basic composition, and composed in zCDP and by privacy-loss
distributions: :mod:`dpstream.accountant.composition`), the budget caps beside it, and warnings
(docs/plan.md).

Every number comes from the accountant (:mod:`dpstream.accountant.plan`: the plans,
:func:`~dpstream.accountant.plan.compose_horizons`, :func:`~dpstream.accountant.plan.budget_outlook`,
:func:`~dpstream.accountant.plan.release_outlook`); this module only gathers them for the CLI and
for :func:`dpstream.plan`, which return the same dictionary. Needs no noise secret and no broker.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Union

from dpstream.accountant.composition import (
    Total,
    WindowLoss,
    composed_horizons,
    dynamic_loss,
    query_loss,
    total_epsilon,
)
from dpstream.accountant.plan import (
    BASIC_COMPOSITION,
    DAY_MS,
    HORIZONS,
    Spend,
    budget_outlook,
    compose_horizons,
    release_outlook,
)
from dpstream.processor.config import (
    ConfigError,
    DpstreamConfig,
    config_from_mapping,
    level_plans_for,
    load_config,
    plan_for,
)

#: the plausible scale a key is measured against, distinct users per key and window (--key-users)
DEFAULT_KEY_USERS = 10_000
#: advice: a topic whose users may lose more than this epsilon per day is warned about (--max-daily-epsilon)
DEFAULT_MAX_DAILY_EPSILON = 10.0

COMPOSED_TOTALS = ("composed: the same windows composed in zCDP (rho adds; one CKS conversion) and, where every "
                   "mechanism has an exact privacy-loss distribution (counter: tree, dynamic queries), by composing those "
                   "(pld); each at a stated delta (--total-delta; by default the basic total's delta), the thresholding and "
                   "sampler terms added once (docs/privacy.md, \"Totals over time\"); null: no total at that delta")
WARNING_RULES = (
    "a query releases nothing useful when a key needs more distinct users in one round than --key-users to be "
    "released at all (mu + the lowest threshold tau), or when the expected noise stddev of a release at the last "
    "trigger exceeds the value of a key whose --key-users users add one full record each (--key-users, times L for a "
    "sum); a topic's daily total above --max-daily-epsilon is advice, not a limit the product enforces; a budget "
    "cap that the planned spend per refresh period exceeds, or that never refreshes and is reached within 30 days, "
    "means the ledger will refuse windows")


def as_config(config: Union[str, os.PathLike, Mapping, DpstreamConfig]) -> DpstreamConfig:
    """A config from a path (YAML, with the environment's overrides), a mapping (the YAML's
    content, validated the same way) or a loaded config."""
    if isinstance(config, DpstreamConfig):
        return config
    if isinstance(config, Mapping):
        return config_from_mapping(dict(config), source="<dict>", environ={})
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    raise ConfigError(f"config: must be a path, a mapping or a DpstreamConfig, got {type(config).__name__}")


def spends(config: DpstreamConfig) -> list[Spend]:
    """Each query's per-window spend as the ledger charges it (the plan's epsilon_spent and
    delta_spent; a dynamic query's epsilon once, docs/privacy.md "Windows and budget")."""
    b = config.budget
    out = []
    for q in config.queries:
        p = plan_for(q)
        out.append(Spend(q.name, q.input_topic, p.epsilon_spent, p.delta_spent, q.window_ms,
                         principal=b.principal_of(q) if b else None))
    for q in config.dynamic:
        p = q.plan()
        unit = (f"{q.unit_field} (first {q.contribution_bound} updates)" if q.unit_field else "one update")
        out.append(Spend(q.name, q.input_topic, q.epsilon, p.delta_spent, None, unit=unit,
                         principal=b.principal_of(q) if b else None))
    return out


def losses(config: DpstreamConfig) -> dict[str, WindowLoss]:
    """Each query's per-window loss terms, by name, as the ledger's zcdp and pld accountings
    compose them (:func:`dpstream.accountant.composition.query_loss`)."""
    out = {q.name: query_loss(level_plans_for(q)) for q in config.queries}
    out.update({q.name: dynamic_loss(q.epsilon) for q in config.dynamic})
    return out


def composed_outlook(spent: list[Spend], loss: dict[str, WindowLoss], principal: str, max_epsilon: float, max_delta: float,
                     refresh_ms: Optional[int], accounting: str) -> dict:
    """What :func:`~dpstream.accountant.plan.budget_outlook` says, with the principal's charges
    composed by ``accounting`` (at the cap's delta) instead of added."""
    from dpstream.accountant.plan import windows_charged

    mine = [s for s in spent if s.principal == principal]

    def epsilon_of(days: float) -> float:  # the planned charges of `days` days (a refresh period's, or from the start)
        total = Total()
        for s in mine:
            count = 1 if s.window_ms is None else (windows_charged(refresh_ms, s.window_ms) if days is None
                                                   else math.ceil(days * DAY_MS / s.window_ms))
            total.add(loss[s.name], count)
        return total_epsilon(total, accounting, max_delta)

    out = {"accounting": accounting}
    if refresh_ms is not None:
        eps = epsilon_of(None)
        out.update(planned_composed_epsilon_per_period=eps, exceeds=eps > max_epsilon * (1 + 1e-12))
        return out
    if epsilon_of(0) > max_epsilon:
        out["days_until_exhausted"] = 0.0
        return out
    lo, hi = 0, 1
    while hi < 100_000 and epsilon_of(hi) <= max_epsilon:
        lo, hi = hi, hi * 2
    if hi >= 100_000:
        out["days_until_exhausted"] = None  # not within 270 years
        return out
    while hi - lo > 1:  # whole days: the last day whose charges still fit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if epsilon_of(mid) <= max_epsilon else (lo, mid)
    out.update(days_until_exhausted=float(hi), planned_composed_epsilon_per_day=epsilon_of(1))
    return out


def _fmt_days(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def plan_document(config: Union[str, os.PathLike, Mapping, DpstreamConfig], key_users: float = DEFAULT_KEY_USERS,
                  max_daily_epsilon: float = DEFAULT_MAX_DAILY_EPSILON, total_delta: Optional[float] = None) -> dict:
    """What ``dpstream plan --json`` prints: ``queries`` and ``dynamic`` (each query's terms),
    ``totals`` (per input topic over ``horizons``: basic sums, and under ``composed`` the zcdp and
    pld totals at ``total_delta``, by default each horizon's basic delta), ``budget`` (each ledger
    principal's cap and planned spend), ``usefulness`` (per query: :func:`release_outlook`) and
    ``warnings``."""
    from dpstream.processor.cli import _plan_entry

    if not key_users > 0:
        raise ConfigError(f"--key-users: must be positive, got {key_users!r}")
    if not max_daily_epsilon > 0:
        raise ConfigError(f"--max-daily-epsilon: must be positive, got {max_daily_epsilon!r}")
    if total_delta is not None and not 0 < total_delta < 1:
        raise ConfigError(f"--total-delta: must be in (0, 1), got {total_delta!r}")
    config = as_config(config)
    spent = spends(config)
    totals = compose_horizons(spent)
    loss = losses(config)
    composed = composed_horizons(spent, loss, HORIZONS, total_delta)
    for t in totals:
        t["composed"] = composed[t["topic"]]
    warnings = []
    usefulness = {}
    for q in config.queries:
        out = release_outlook(level_plans_for(q), key_users)
        usefulness[q.name] = out
        if out["releases_nothing"]:
            warnings.append(f"query {q.name}: releases nothing useful: a key needs more than "
                            f"{out['min_users_to_release']:,.0f} distinct users in one round to be released (tau_1 = "
                            f"{out['tau_1']:,.0f}), above the stated scale of {key_users:,.0f} users per key (--key-users)")
        if out["noise_dominates"]:
            warnings.append(f"query {q.name}: releases nothing useful: the noise stddev of a release is "
                            f"{out['expected_stddev']:,.0f}, {out['relative_stddev']:.3g} times the value of a key whose "
                            f"{key_users:,.0f} users add one full record each (--key-users)")
    for t in totals:
        daily = t["epsilon"]["1d"]
        if daily > max_daily_epsilon:
            warnings.append(f"topic {t['topic']}: a user of it may lose epsilon {daily:.4g} per day over its "
                            f"{len(t['queries'])} queries (basic composition), above {max_daily_epsilon:g} per day "
                            f"(--max-daily-epsilon; advice, not a limit the product enforces)")
    budget = []
    if config.budget is not None:
        b = config.budget
        for principal in dict.fromkeys(s.principal for s in spent):
            limit = b.principals.get(principal, b.default)
            policy = limit.policy(b.accounting)
            out = budget_outlook(spent, principal, policy.max_epsilon, policy.max_delta, policy.refresh_ms)
            out["kind"], out["shadow"], out["accounting"] = b.principal, b.shadow, b.accounting
            if b.accounting != "basic":
                # the ledger composes: what it allows, and when it refuses, follow the composed total
                out["basic"] = {k: out.pop(k) for k in ("exceeds", "days_until_exhausted") if k in out}
                out.update(composed_outlook(spent, loss, principal, policy.max_epsilon, policy.max_delta, policy.refresh_ms,
                                            b.accounting))
            budget.append(out)
            planned = (f"epsilon {out['planned_composed_epsilon_per_period']:.4g} (composed by {b.accounting} at delta "
                       f"{policy.max_delta:g})" if b.accounting != "basic" and policy.refresh_ms is not None else
                       f"epsilon {out.get('planned_epsilon_per_period', 0.0):.4g}, delta {out.get('planned_delta_per_period', 0.0):.3g}")
            if out.get("exceeds"):
                what = "would be refused, counted only (shadow mode)" if b.shadow else "will be refused"
                warnings.append(f"budget {principal!r}: planned {planned} per {_fmt_days(policy.refresh_ms)} exceed its cap "
                                f"(epsilon {policy.max_epsilon:g}, delta {policy.max_delta:g}): windows {what} once it is "
                                f"spent")
            days = out.get("days_until_exhausted")
            if days is not None and days < HORIZONS[-1][1] / 86_400_000:
                what = "would be refused, counted only (shadow mode)" if b.shadow else "are refused"
                rate = (f"composed by {b.accounting}" if b.accounting != "basic" else
                        f"epsilon {out['planned_epsilon_per_day']:.4g}, delta {out['planned_delta_per_day']:.3g} per day")
                warnings.append(f"budget {principal!r}: never refreshed, and its planned spend ({rate}) "
                                f"reaches its cap (epsilon {policy.max_epsilon:g}, delta {policy.max_delta:g}) after about "
                                f"{days:.3g} days; windows {what} from then on")
    return {
        "queries": [_plan_entry(q, plan_for(q)) for q in config.queries],
        "dynamic": [{"name": q.name, **q.plan().to_dict()} for q in config.dynamic],
        "totals": {"composition": BASIC_COMPOSITION, "composed": COMPOSED_TOTALS, "total_delta": total_delta,
                   "horizons": {name: ms for name, ms in HORIZONS},
                   "horizon_alignment": "UTC days (windows are epoch-aligned); *_any_span: any span of that length",
                   "topics": totals},
        "budget": budget,
        "usefulness": usefulness,
        "rules": {"key_users": key_users, "max_daily_epsilon": max_daily_epsilon, "warnings": WARNING_RULES},
        "warnings": warnings,
    }


def human_totals(doc: dict) -> str:
    """The totals, caps and usefulness of :func:`plan_document` as text (after the per-query blocks)."""
    lines = ["total privacy loss per input topic (a topic's queries read the same users: its privacy unit)",
             f"  by {doc['totals']['composition']}"]
    names = list(doc["totals"]["horizons"])
    caps = {b["principal"]: b for b in doc["budget"]}
    for t in doc["totals"]["topics"]:
        lines.append(f"  topic {t['topic']}")
        for q in t["queries"]:
            window = "its whole life (charged once)" if q["window_ms"] is None else f"window {_fmt_days(q['window_ms'])}"
            per = ", ".join(f"{q['windows'][n]} window{'s' if q['windows'][n] != 1 else ''} per {n}: eps {q['epsilon'][n]:.4g}"
                            for n in names) if q["window_ms"] is not None else "every horizon: eps " + f"{q['epsilon_per_window']:.4g}"
            unit = "" if q["unit"] == "user" else f" (its privacy unit: {q['unit']})"
            cap = ""
            if q["principal"] is not None and q["principal"] in caps and caps[q["principal"]]["kind"] == "query":
                cap = "  " + _cap_text(caps[q["principal"]])
            lines.append(f"    {q['name']:<22} eps {q['epsilon_per_window']:.4g}, delta {q['delta_per_window']:.3g} per "
                         f"{window}{unit}; {per}{cap}")
        lines.append(f"    {'one window of each':<22} eps {t['per_window']['epsilon']:.4g}, delta {t['per_window']['delta']:.3g}")
        for n in names:
            lines.append(f"    {'per ' + n + ' (UTC)':<22} eps {t['epsilon'][n]:.4g}, delta {t['delta'][n]:.3g}   (any span of "
                         f"{n}: eps {t['epsilon_any_span'][n]:.4g})")
            c = t["composed"][n]
            if c["delta"] == 0:
                lines.append(f"    {'  composed':<22} at delta 0 the basic sum is the total (pure epsilon-DP); --total-delta "
                             f"states another delta")
                continue
            lines.append(f"    {'  composed':<22} at delta {c['delta']:.3g}: zcdp eps {_eps_text(c['zcdp'])}, pld eps "
                         f"{_eps_text(c['pld'], c['terms']['exact_curve'])}")
        if t["topic"] in caps and caps[t["topic"]]["kind"] == "input_topic":
            lines.append(f"    {'budget cap':<22} {_cap_text(caps[t['topic']])}")
    for b in doc["budget"]:
        if b["kind"] == "tenant":
            lines.append(f"  tenant {b['principal']} ({', '.join(b['queries'])}): {_cap_text(b)}")
    use = doc["usefulness"]
    if use:
        k = doc["rules"]["key_users"]
        lines.append(f"usefulness at a stated scale of {k:,.0f} distinct users per key and window (--key-users):")
        for name, u in use.items():
            bar = ("public keys: each released at every trigger" if u["public_keys"] else
                   f"a key needs > {u['min_users_to_release']:,.0f} users in a round (tau_1 {u['tau_1']:,.0f})")
            lines.append(f"    {name:<22} {bar}; release stddev {u['expected_stddev']:,.1f} = {u['relative_stddev']:.3g} of "
                         f"such a key's value" + ("   RELEASES NOTHING USEFUL" if u["releases_nothing"] or u["noise_dominates"] else ""))
    return "\n".join(lines)


def _eps_text(eps: Optional[float], exact: bool = True) -> str:
    if eps is not None:
        return f"{eps:.4g}"
    return "n/a (no exact curve: counter blt)" if not exact else "n/a at this delta"


def _cap_text(b: dict) -> str:
    shadow = " (shadow: tracked, not enforced)" if b["shadow"] else ""
    if b.get("accounting", "basic") != "basic":
        how = f"composed by {b['accounting']} at its delta"
        if b["refresh_ms"] is not None:
            return (f"cap eps {b['max_epsilon']:g}, delta {b['max_delta']:g} per {_fmt_days(b['refresh_ms'])}{shadow}; planned "
                    f"eps {b['planned_composed_epsilon_per_period']:.4g} per {_fmt_days(b['refresh_ms'])}, {how}"
                    + ("  EXCEEDS THE CAP" if b["exceeds"] else ""))
        days = b["days_until_exhausted"]
        return (f"cap eps {b['max_epsilon']:g}, delta {b['max_delta']:g}, never refreshed{shadow}; planned spend, {how}, "
                + (f"reaches it after about {days:.3g} days" if days is not None else "does not reach it"))
    if b["refresh_ms"] is not None:
        return (f"cap eps {b['max_epsilon']:g}, delta {b['max_delta']:g} per {_fmt_days(b['refresh_ms'])}{shadow}; planned "
                f"eps {b['planned_epsilon_per_period']:.4g}, delta {b['planned_delta_per_period']:.3g} per "
                f"{_fmt_days(b['refresh_ms'])}" + ("  EXCEEDS THE CAP" if b["exceeds"] else ""))
    days = b["days_until_exhausted"]
    return (f"cap eps {b['max_epsilon']:g}, delta {b['max_delta']:g}, never refreshed{shadow}; planned eps "
            f"{b['planned_epsilon_per_day']:.4g} per day" + (f": spent after about {days:.3g} days" if days is not None else ""))
