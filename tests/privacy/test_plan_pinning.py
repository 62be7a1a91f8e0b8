"""Fix 6: a window is pinned to the plan it was opened (and charged) under.

Claims under attack: the progress table stores the plan fingerprint; building a QueryPipeline
over a store with an OPEN window (progress < T) opened under another plan raises
PlanChangedError naming the query and the window; the ledger's charge records the fingerprint and
BudgetLedger.charge(..., plan=...) raises ChargePlanError for the same charge id under another
plan; once the window has closed, a changed plan is fine for new windows.
"""
from __future__ import annotations

import io

import numpy as np
import pytest

from dpstream.accountant.ledger import BudgetLedger, BudgetPolicy, ChargePlanError
from dpstream.accountant.plan import plan_fingerprint
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import (
    BudgetConfig,
    BudgetLimit,
    DpstreamConfig,
    DynamicQueryConfig,
    level_plans_for,
)
from dpstream.processor.engine.budget import BudgetGate
from dpstream.processor.engine.pipeline import PlanChangedError, QueryPipeline
from dpstream.state.store import MemoryStore
from tests.conftest import TEST_LABEL, TEST_SECRET
from tests.privacy._helpers import (
    DAY,
    HOUR,
    ROOT,
    START,
    events,
    query,
    replay,
    run_cli,
    write_jsonl,
)


def two_days(seed=1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return events(rng, records=1500, users=200) + events(rng, records=1500, users=200, start=START + DAY, prefix="v")


PLAN_CHANGES = {
    "epsilon": dict(epsilon=3.0),
    "delta": dict(delta=1e-8),
    "contribution_bound": dict(contribution_bound=8),
    "triggers": dict(triggers=48),
    "key_threshold": dict(key_threshold=5.0),
    "beta": dict(beta=1e-13),
}


@pytest.mark.parametrize("change", sorted(PLAN_CHANGES))
def test_resuming_an_open_window_under_another_plan_is_refused_naming_query_and_window(tmp_path, change):
    path = write_jsonl(tmp_path / "e.jsonl", two_days())
    state = tmp_path / "s"
    replay(DpstreamConfig(queries=[query()]), path, state_dir=state, stop_after=700)  # mid day 1
    changed = DpstreamConfig(queries=[query(**PLAN_CHANGES[change])])
    with pytest.raises(PlanChangedError) as info:
        ReplayRunner(changed, TEST_SECRET, str(state), log=io.StringIO(), noise_label=TEST_LABEL)
    message = str(info.value)
    assert "clicks" in message and str(START) in message and "2026-11-20" in message
    # the refusal left the state usable: the old plan resumes, and finishes as an uninterrupted run
    rest = replay(DpstreamConfig(queries=[query()]), path, state_dir=state)
    whole = replay(DpstreamConfig(queries=[query()]), path, state_dir=tmp_path / "whole")
    first = replay(DpstreamConfig(queries=[query()]), path, state_dir=tmp_path / "again", stop_after=700)
    assert first.output + rest.output == whole.output


def test_schedule_only_changes_are_not_plan_changes(tmp_path):
    """allowed_lateness and max_skew move no noise scale: resuming with them changed is allowed."""
    path = write_jsonl(tmp_path / "e.jsonl", two_days())
    replay(DpstreamConfig(queries=[query()]), path, state_dir=tmp_path / "s", stop_after=700)
    replay(DpstreamConfig(queries=[query(allowed_lateness="5m", max_skew="2h")]), path, state_dir=tmp_path / "s")


def test_after_the_window_closes_a_new_plan_is_fine_for_new_windows(tmp_path):
    rows = two_days()
    day1 = [r for r in rows if r["ts"] < START + DAY]
    path = tmp_path / "e.jsonl"
    write_jsonl(path, day1)
    state = tmp_path / "s"
    # the public end is the end of day 1 (allowed_lateness 0): every trigger of day 1 fires
    cfg = DpstreamConfig(queries=[query(allowed_lateness="0s")])
    first = replay(cfg, path, state_dir=state, until_ms=START + DAY)
    assert {r["epsilon"] for r in first.records} == {6.0} or not first.records
    write_jsonl(path, rows)  # more data arrives: day 2
    changed = DpstreamConfig(queries=[query(allowed_lateness="0s", epsilon=3.0)])
    second = replay(changed, path, state_dir=state, until_ms=START + 2 * DAY)
    windows = {r["window_start"] for r in second.records}
    assert windows == {START + DAY}, "day 2 released under the new plan"
    assert {r["epsilon"] for r in second.records} == {3.0}


def test_with_a_ledger_the_window_charged_at_the_end_is_pinned_too(tmp_path):
    """--until past a window start opens (charges) that window under the current plan: a later
    resume under another plan must be refused for it, even without data in it yet."""
    budget = BudgetConfig(default=BudgetLimit(max_epsilon=100, max_delta=1e-6))
    rows = two_days()
    path = write_jsonl(tmp_path / "e.jsonl", [r for r in rows if r["ts"] < START + DAY])
    state = tmp_path / "s"
    replay(DpstreamConfig(queries=[query(allowed_lateness="0s")], budget=budget), path, state_dir=state, start_ms=START,
           until_ms=START + DAY + HOUR)  # day 2 has started: charged and opened, no data yet
    changed = DpstreamConfig(queries=[query(allowed_lateness="0s", epsilon=3.0)], budget=budget)
    with pytest.raises(PlanChangedError, match=str(START + DAY)):
        ReplayRunner(changed, TEST_SECRET, str(state), log=io.StringIO(), noise_label=TEST_LABEL, start_ms=START)


def test_progress_rows_carry_the_plan_fingerprint_and_a_foreign_open_window_is_refused():
    q = query()
    noise = __import__("dpstream.processor.mechanisms.noise", fromlist=["NodeNoise"]).NodeNoise(TEST_SECRET, TEST_LABEL)
    store = MemoryStore()
    pipe = QueryPipeline(q, noise, store)
    pipe.set_schedule(lambda w: True, START)
    pipe.open_due(START)
    assert pipe.fingerprint == plan_fingerprint(level_plans_for(q))
    with pytest.raises(PlanChangedError, match="clicks"):
        QueryPipeline(query(epsilon=2.0), noise, store)
    QueryPipeline(q, noise, store)  # the same plan: fine
    # a closed window is no obstacle: fire every trigger, then a new plan opens
    while (nxt := pipe.next_fire()) is not None:
        pipe.fire(nxt[1], nxt[2])
    QueryPipeline(query(epsilon=2.0), noise, store)


def test_ledger_refuses_one_charge_id_under_two_plans():
    led = BudgetLedger(MemoryStore(), {}, BudgetPolicy(100, 1e-3), "1")
    assert led.charge("p", 1.0, 1e-9, "clicks:0", 0, plan="aa").charged
    with pytest.raises(ChargePlanError, match="clicks:0"):
        led.charge("p", 1.0, 1e-9, "clicks:0", 0, plan="bb")
    again = led.charge("p", 1.0, 1e-9, "clicks:0", 0, plan="aa")
    assert again.duplicate and not again.charged
    assert led.get("p", 0).spent_epsilon == 1.0 and led.get("p", 0).charges == 1


def test_gate_of_a_changed_plan_cannot_reuse_a_charge_made_under_the_old_one():
    """A crash between the ledger's charge and the progress row leaves the charge only; the window
    must still not open under another plan (it would run uncharged for the difference)."""
    budget = BudgetConfig(default=BudgetLimit(max_epsilon=100, max_delta=1e-6))
    old = DpstreamConfig(queries=[query()], budget=budget)
    new = DpstreamConfig(queries=[query(epsilon=12.0)], budget=budget)
    led = BudgetLedger(MemoryStore(), {}, BudgetPolicy(100, 1e-6), "1")
    assert BudgetGate(old, led).window_gate(old.queries[0])(START)
    with pytest.raises(ChargePlanError):
        BudgetGate(new, led).window_gate(new.queries[0])(START)
    assert led.get("clicks", 0).spent_epsilon == pytest.approx(6.0)


# REGRESSION: the refusal was a Python traceback with exit code 1 (PlanChangedError was not caught).
def test_cli_refuses_a_changed_plan_in_one_line_naming_query_and_window(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", two_days())
    cfg = tmp_path / "q.yaml"
    base = "queries:\n  - {{name: clicks, window: 1d, triggers: 24, contribution_bound: 4, epsilon: {eps}, delta: 1.0e-9}}\n"
    cfg.write_text(base.format(eps=6.0))
    args = ["replay", "--config", str(cfg), "--input", str(path), "--output", str(tmp_path / "o.jsonl"), "--quiet",
            "--state-dir", str(tmp_path / "s"), "--noise-label", "t"]
    proc = run_cli(ROOT, args + ["--stop-after-lines", "700"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg.write_text(base.format(eps=3.0))
    proc = run_cli(ROOT, args, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "clicks" in proc.stderr and "2026-11-20" in proc.stderr


# ---------------------------------------------------------------------------------------------
# REGRESSION: a dynamic query was not pinned to its plan: restarted with a larger epsilon it was
# neither refused nor charged, and nodes already released were recomputed under the new scale from
# the same uniforms (two noisy values of one node).
def test_regression_a_dynamic_query_restarted_with_a_larger_epsilon_is_refused(tmp_path):
    def cfg(eps):
        return DpstreamConfig(dynamic=[DynamicQueryConfig(name="plans", items=["a", "b"], epsilon=eps, start=START, tick="1s")],
                              budget=BudgetConfig(default=BudgetLimit(max_epsilon=10, max_delta=1e-6)))

    rows = [{"item": "a", "op": "insert", "ts": START + i * 1000} for i in range(300)]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    replay(cfg(1.0), path, state_dir=tmp_path / "s", start_ms=START, until_ms=START + 100_000)
    write_jsonl(path, rows + [{"item": "b", "op": "insert", "ts": START + 300_000 + i * 1000} for i in range(300)])
    with pytest.raises(PlanChangedError, match="plans"):
        replay(cfg(4.0), path, state_dir=tmp_path / "s", start_ms=START, until_ms=START + 700_000)
    # the same plan resumes; the ledger kept one charge, recorded with the plan's fingerprint
    run = replay(cfg(1.0), path, state_dir=tmp_path / "s", start_ms=START, until_ms=START + 700_000)
    assert run.ledger_entries["plans"].charges == 1
    assert run.charges["plans:start"]["plan"] == cfg(1.0).dynamic[0].fingerprint()


def test_a_dynamic_query_charged_under_another_plan_is_refused_by_the_ledger():
    """A shared ledger (the same principal and charge id 'plans:start') refuses to treat a charge
    made under one dynamic plan as paying for another (ChargePlanError)."""
    def cfg(eps):
        return DpstreamConfig(dynamic=[DynamicQueryConfig(name="plans", items=["a"], epsilon=eps, start=START, tick="1s")],
                              budget=BudgetConfig(default=BudgetLimit(max_epsilon=10, max_delta=1e-6)))

    led = BudgetLedger(MemoryStore(), {}, BudgetPolicy(10, 1e-6), "1")
    assert BudgetGate(cfg(1.0), led).start_dynamic(cfg(1.0).dynamic[0])
    assert BudgetGate(cfg(1.0), led).start_dynamic(cfg(1.0).dynamic[0])  # the same plan: already paid
    assert led.get("plans", START).charges == 1
    with pytest.raises(ChargePlanError):
        BudgetGate(cfg(2.0), led).start_dynamic(cfg(2.0).dynamic[0])
