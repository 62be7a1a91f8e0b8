"""Totals over time (docs/privacy.md, "Totals over time"): windows and queries composed in zCDP
and by privacy-loss distributions, checked against dp-accounting's own composition of the same
events; the failure and sampler terms; the ledger refusing exactly where the composed total would
pass its cap; `dpstream plan` reporting the totals beside the basic sum."""
import json
import math
import subprocess
import sys

import dp_accounting
import pytest
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.rdp import RdpAccountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.accountant.calibration import cks_epsilon
from dpstream.accountant.composition import (
    GOOD_RADIUS,
    TABLE_QUANTUM,
    TABLE_RELATIVE_ERROR,
    Total,
    WindowLoss,
    compose,
    dynamic_loss,
    query_loss,
    sampler_terms,
    selection_failure,
    total_delta,
    total_epsilon,
)
from dpstream.accountant.ledger import BudgetEntry, BudgetExceeded, BudgetLedger, BudgetPolicy
from dpstream.accountant.plan import MAX_SAMPLER_SIGMA, QueryBudget, plan_levels
from dpstream.processor.config import ConfigError, config_from_mapping, load_config
from dpstream.processor.planning import plan_document
from dpstream.state.store import MemoryStore
from tests.conftest import ROOT
from tests.test_ledger import CONFIG as LEDGER_CONFIG

PAPER = dict(epsilon=6.0, delta=1e-9, contribution_bound=32, clamp=1.0, triggers=100)


def _tree_plans(**kw):
    return plan_levels(QueryBudget(**{**PAPER, "counter": "binary_tree", **kw}))


def _blt_plans(**kw):
    return plan_levels(QueryBudget(**{**PAPER, "counter": "blt", "composition": "gdp", **kw}))


def _ideal_delta(total: Total, delta: float) -> float:
    """The delta left for the noise's ideal curve, from the terms added once (module docstring of
    dpstream.accountant.composition), recomputed here from its definition."""
    n = total.draws
    gamma = TABLE_RELATIVE_ERROR + 2.0 ** -100
    margin = GOOD_RADIUS - math.sqrt(2.0 * total.max_rho)
    bad = n * (2.0 * math.exp(-margin ** 2 / 2.0) + 2.0 * 2.0 ** -100)
    return (delta - bad - total.failure) / (1.0 + gamma) ** n


def _shift(total: Total) -> float:
    gamma = TABLE_RELATIVE_ERROR + 2.0 ** -100
    return total.draws * math.log((1.0 + gamma) / (1.0 - gamma))


# --------------------------------------------------------------------------- zcdp against dp-accounting

@pytest.mark.parametrize("windows", [1, 7, 30, 720])
@pytest.mark.parametrize("plans", [_tree_plans, _blt_plans], ids=["tree", "blt"])
def test_zcdp_total_is_dp_accountings_rdp_composition_of_the_same_gaussians(plans, windows):
    ps = plans()
    loss = query_loss(ps)
    total = compose([(loss, windows)])
    delta = 1e-6
    ours = total_epsilon(total, "zcdp", delta)
    # the same windows as dp-accounting events: Gaussians of rho each (noise multiplier
    # 1 / sqrt(2 rho)), composed by its RDP accountant at the delta the ideal curve gets
    rdp = RdpAccountant()
    rdp.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(2.0 * loss.rho)), windows))
    theirs = rdp.get_epsilon(_ideal_delta(total, delta)) + _shift(total)
    # RDP converts on a grid of orders: never below the continuous optimum, close to it
    assert theirs >= ours * (1 - 1e-9)
    assert theirs <= ours * 1.02
    assert loss.rho == pytest.approx(ps[0].rho_total, rel=1e-15)


def test_zcdp_adds_rho_over_windows_and_queries_exactly():
    a, b = query_loss(_tree_plans()), query_loss(_blt_plans(epsilon=2.0, delta=1e-8, contribution_bound=8, triggers=60))
    total = compose([(a, 30), (b, 720)])
    assert total.rho == pytest.approx(30 * a.rho + 720 * b.rho, rel=1e-12)
    assert total.failure == pytest.approx(30 * a.failure + 720 * b.failure, rel=1e-12)
    assert total.draws == 30 * a.draws + 720 * b.draws
    assert total.epsilon == pytest.approx(30 * 6.0 + 720 * 2.0)
    delta = 1e-5
    assert total_epsilon(total, "zcdp", delta) == pytest.approx(cks_epsilon(total.rho, _ideal_delta(total, delta)) + _shift(total),
                                                                 rel=1e-12)


# --------------------------------------------------------------------------- pld against dp-accounting

def _dp_accounting_pld(parts_times, pure_times=()):
    """dp-accounting's own PLDs of the same discrete Gaussians (connect the dots) and pure parts,
    composed."""
    out = None
    for (sigma, shift, copies), times in parts_times:
        one = pld.from_discrete_gaussian_mechanism(sigma, int(shift), use_connect_dots=True, value_discretization_interval=1e-4)
        one = one.self_compose(copies * times)
        out = one if out is None else out.compose(one)
    for eps0, times in pure_times:
        one = pld.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(eps0, 0.0),
                                          value_discretization_interval=1e-4).self_compose(times)
        out = one if out is None else out.compose(one)
    return out


@pytest.mark.parametrize("windows", [1, 30])
def test_pld_total_is_dp_accountings_pld_composition_of_the_same_discrete_gaussians(windows):
    loss = query_loss(_tree_plans())
    assert loss.parts is not None and len(loss.parts) == 2
    total = compose([(loss, windows)])
    delta = 1e-6
    ours = total_epsilon(total, "pld", delta)
    theirs = _dp_accounting_pld([(p, windows) for p in loss.parts]).get_epsilon_for_delta(_ideal_delta(total, delta)) + _shift(total)
    # both are pessimistic discretizations of the same exact curve, ours the finer one
    assert ours == pytest.approx(theirs, rel=2e-3)
    assert ours <= theirs * (1 + 1e-6)
    # and the exact curve is below the zCDP bound of the same noise
    assert ours < total_epsilon(total, "zcdp", delta)


def test_pld_composes_pure_parts_as_randomized_response():
    gauss = query_loss(_tree_plans(epsilon=1.0, delta=1e-9, contribution_bound=4, triggers=24))
    total = compose([(gauss, 5), (dynamic_loss(0.5), 1), (dynamic_loss(0.25), 3)])
    delta = 1e-6
    ours = total_epsilon(total, "pld", delta)
    theirs = _dp_accounting_pld([(p, 5) for p in gauss.parts], [(0.5, 1), (0.25, 3)]).get_epsilon_for_delta(
        _ideal_delta(total, delta)) + _shift(total)
    assert ours == pytest.approx(theirs, rel=2e-3)
    # a pure total alone, at delta 1e-6, is just below the sum of its epsilons
    pure = compose([(dynamic_loss(0.5), 4)])
    assert 1.9 < total_epsilon(pure, "pld", 1e-6) <= 2.0


def test_pld_has_no_total_for_the_blt():
    total = compose([(query_loss(_blt_plans()), 3)])
    assert not total.exact
    assert total_epsilon(total, "pld", 1e-6) == math.inf
    assert math.isfinite(total_epsilon(total, "zcdp", 1e-6))


@settings(max_examples=40, deadline=None)
@given(windows=st.integers(1, 60), more=st.integers(1, 30), exp=st.integers(5, 8))
def test_totals_grow_with_windows_and_pld_is_below_zcdp(windows, more, exp):
    loss = query_loss(_tree_plans(epsilon=2.0, contribution_bound=8, triggers=24))
    delta = 10.0 ** -exp
    a, b = compose([(loss, windows)]), compose([(loss, windows + more)])
    for accounting in ("zcdp", "pld"):
        assert total_epsilon(a, accounting, delta) < total_epsilon(b, accounting, delta)
    assert total_epsilon(a, "pld", delta) <= total_epsilon(a, "zcdp", delta) * (1 + 1e-9)
    # total_delta is the inverse of total_epsilon
    eps = total_epsilon(a, "zcdp", delta)
    assert total_delta(a, "zcdp", eps) == pytest.approx(delta, rel=1e-6)


# --------------------------------------------------------------------------- the terms added once

def test_failure_is_the_tail_at_tau_minus_the_users_weight_whatever_the_threshold():
    # with a key threshold mu, the others may have given up to mu while the gate is closed
    # without the user: the count is at most mu + w, so the tail is at tau - w still
    for mu in (0.0, 1.0, 5.0):
        ps = plan_levels(QueryBudget(**{**PAPER, "key_threshold": mu}))
        p = ps[0]
        lam = [tau / p.tail_multiplier for tau in p.thresholds]
        expected = p.contribution_bound * sum(math.exp(-max(0.0, p.tail_multiplier - 1.0 / l) ** 2 / 2) for l in lam)
        assert selection_failure(ps) == pytest.approx(expected, rel=1e-9)
        assert selection_failure(ps) > p.contribution_bound * p.beta  # never the per-window C beta
    h = plan_levels(QueryBudget(**{**PAPER, "key_threshold": 2.0, "hierarchy_depth": 3}))
    assert selection_failure(h) == pytest.approx(sum(selection_failure([p]) for p in h), rel=1e-12)


def test_failure_at_threshold_zero_counts_the_users_own_count_against_the_noise():
    ps = _tree_plans()  # mu = 0: the user's own 1 may cross; the tail is taken at tau - 1
    p = ps[0]
    z = p.tail_multiplier
    # the binary tree's variance at leaf i: recomputed from the released thresholds (tau_i = z lambda_i)
    lam = [tau / z for tau in p.thresholds]
    expected = p.contribution_bound * sum(math.exp(-max(0.0, z - 1.0 / l) ** 2 / 2) for l in lam)
    assert selection_failure(ps) == pytest.approx(expected, rel=1e-9)
    assert p.contribution_bound * p.beta < selection_failure(ps) < 3 * p.contribution_bound * p.beta
    # weights: the largest weight is what the user alone can add
    w = plan_levels(QueryBudget(**{**PAPER, "per_key_bound": 1, "selection_weights": (3, 1)}))
    assert selection_failure(w) > selection_failure(plan_levels(QueryBudget(**{**PAPER, "per_key_bound": 1})))
    assert selection_failure(plan_levels(QueryBudget(**{**PAPER, "public_keys": True}))) == 0.0


def test_the_good_radius_keeps_the_table_within_its_relative_error():
    # at r sigma the exact discrete Gaussian still has probability >= 2^-128 / gamma, for the
    # largest sigma the sampler takes (the normalizer is below sigma sqrt(2 pi) + 1)
    sigma = MAX_SAMPLER_SIGMA
    log_p = -(GOOD_RADIUS ** 2) / 2 - math.log(sigma * math.sqrt(2 * math.pi) + 1)
    assert log_p >= math.log(TABLE_QUANTUM / TABLE_RELATIVE_ERROR) - 1e-9
    assert 9.5 < GOOD_RADIUS < 12.0  # inside the table (12 sigma + 1)


def test_sampler_terms_stay_small_where_the_per_window_term_would_pass_any_delta():
    # 90 days of the paper's query at T = 1000: the per-window sampler term (e^eps + 1) n 2^-100
    # at the 90-day epsilon (~80) would be far above 1; the good-set argument's terms are not
    loss = query_loss(_blt_plans(triggers=1000))
    total = compose([(loss, 90)])
    multiplier, shift, bad = sampler_terms(total)
    eps90 = total_epsilon(total, "zcdp", 1e-6)
    assert (math.exp(eps90) + 1) * total.draws * 2.0 ** -100 > 1.0
    assert bad < 1e-9 and shift < 1e-4 and multiplier < 1 + 1e-4


# --------------------------------------------------------------------------- the ledger

def _refusal_index(accounting, loss, max_eps, max_delta, limit=200):
    led = BudgetLedger(MemoryStore(), {"p": BudgetPolicy(max_eps, max_delta, None, accounting)}, None, "e")
    for n in range(limit):
        try:
            led.charge("p", loss.epsilon, loss.delta, f"q:{n}", 0, loss=loss)
        except BudgetExceeded:
            return n, led
    return limit, led


@pytest.mark.parametrize("accounting", ["zcdp", "pld"])
def test_the_ledger_refuses_exactly_where_the_composed_total_passes_the_cap(accounting):
    loss = query_loss(_tree_plans())
    max_delta = 1e-6
    # the composed totals of n windows, computed independently by dp-accounting (RDP for zcdp
    # is a hair above the exact conversion, so the cap sits between two window counts with room)
    totals = []
    for n in range(1, 12):
        t = compose([(loss, n)])
        totals.append(total_epsilon(t, accounting, max_delta))
    for n in (3, 7):
        cap = 0.5 * (totals[n - 1] + totals[n])  # n windows fit, n + 1 do not
        admitted, led = _refusal_index(accounting, loss, cap, max_delta)
        assert admitted == n
        entry = led.get("p", 0)
        assert entry.charges == n and entry.refusals == 1
        assert entry.spent_composed_epsilon == pytest.approx(totals[n - 1], rel=1e-9)
        assert entry.spent_epsilon == pytest.approx(6.0 * n)  # the basic sum is still recorded
        # exactly at the cap: allowed
        admitted, _ = _refusal_index(accounting, loss, totals[n - 1], max_delta)
        assert admitted == n
    # and by dp-accounting's own composition (zcdp: RDP), the (n+1)-th would pass the cap
    if accounting == "zcdp":
        rdp = RdpAccountant()
        rdp.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(2.0 * loss.rho)), 8))
        t8 = compose([(loss, 8)])
        assert rdp.get_epsilon(_ideal_delta(t8, max_delta)) + _shift(t8) > 0.5 * (totals[6] + totals[7])


def test_the_schedule_is_the_same_in_every_accounting_only_the_cap_moves():
    loss = query_loss(_tree_plans())
    basic, _ = _refusal_index("basic", loss, 40.0, 1e-6)
    zcdp, _ = _refusal_index("zcdp", loss, 40.0, 1e-6)
    assert basic == 6  # 6 x 6 <= 40 < 7 x 6
    assert zcdp > 3 * basic
    # a generous cap: every accounting charges the same ids
    ids = []
    for accounting in ("basic", "zcdp", "pld"):
        led = BudgetLedger(MemoryStore(), {"p": BudgetPolicy(1e6, 0.5, None, accounting)}, None, "e")
        for n in range(5):
            led.charge("p", loss.epsilon, loss.delta, f"q:{n}", 0, loss=loss)
        ids.append(sorted(k for k, _ in led.store.scan_prefix(b"C")))
    assert ids[0] == ids[1] == ids[2]


def test_entries_written_before_loss_terms_count_by_basic_composition():
    # an entry as an earlier version wrote it: no composed terms, 12 epsilon spent
    old = {"principal": "p", "max_epsilon": 30.0, "max_delta": 1e-6, "refresh_ms": None, "spent_epsilon": 12.0,
           "spent_delta": 2e-9, "last_reset_ms": 0, "charges": 2, "refusals": 0}
    store = MemoryStore()
    from dpstream.state.store import WriteBatch
    batch = WriteBatch()
    batch.put(b"E", b"e")
    batch.put(b"Lp", json.dumps(old).encode())
    store.write(batch)
    led = BudgetLedger(store, {"p": BudgetPolicy(30.0, 1e-6, None, "zcdp")}, None, "e")
    entry = led.get("p", 0)
    assert isinstance(entry, BudgetEntry) and entry.total().legacy_epsilon == 12.0
    loss = query_loss(_tree_plans())
    led.charge("p", loss.epsilon, loss.delta, "q:new", 0, loss=loss)
    entry = led.get("p", 0)
    t = compose([(loss, 1)])
    expected = 12.0 + total_epsilon(Total(**{**t.__dict__, "legacy_delta": 0.0}), "zcdp", 1e-6 - 2e-9)
    assert entry.spent_composed_epsilon == pytest.approx(expected, rel=1e-9)


def test_a_refresh_empties_the_composed_total():
    loss = query_loss(_tree_plans())
    day = 86_400_000
    led = BudgetLedger(MemoryStore(), {"p": BudgetPolicy(20.0, 1e-6, day, "zcdp")}, None, "e")
    led.charge("p", loss.epsilon, loss.delta, "q:0", 0, loss=loss)
    assert led.get("p", 0).total().rho == pytest.approx(loss.rho)
    assert led.get("p", day).total().rho == 0.0


# --------------------------------------------------------------------------- config and plan

def _config(accounting, counter="blt", max_epsilon=30.0, max_delta=1e-6):
    return {"queries": [{"name": "q", "input_topic": "events", "key_fields": ["key"], "window": "1d", "triggers": 100,
                         "contribution_bound": 32, "epsilon": 6.0, "delta": 1e-9, "counter": counter}],
            "budget": {"accounting": accounting, "start": 0, "default": {"max_epsilon": max_epsilon, "max_delta": max_delta}}}


def test_config_refuses_pld_without_an_exact_curve_naming_the_field():
    with pytest.raises(ConfigError, match=r"budget\.accounting: 'pld'.*counter 'blt'"):
        config_from_mapping(_config("pld"), source="<t>", environ={})
    config_from_mapping(_config("pld", counter="tree"), source="<t>", environ={})
    config_from_mapping(_config("zcdp"), source="<t>", environ={})


def test_config_refuses_a_cap_below_one_composed_window():
    with pytest.raises(ConfigError, match=r"budget\.default\.max_epsilon: one window .* composed by zcdp"):
        config_from_mapping(_config("zcdp", max_epsilon=3.0), source="<t>", environ={})


def test_plan_reports_composed_totals_beside_the_basic_sum():
    doc = plan_document(ROOT / "examples" / "queries.yaml")
    events = next(t for t in doc["totals"]["topics"] if t["topic"] == "events")
    day, month = events["composed"]["1d"], events["composed"]["30d"]
    assert events["epsilon"]["1d"] == pytest.approx(63.0) and events["epsilon"]["30d"] == pytest.approx(1890.0)
    # at the basic total's own delta, zCDP composition is far tighter
    assert day["delta"] == pytest.approx(events["delta"]["1d"])
    assert 10 < day["zcdp"] < 20 and 100 < month["zcdp"] < 200
    assert day["pld"] is None and not day["terms"]["exact_curve"]  # the examples use the BLT
    stated = plan_document(ROOT / "examples" / "queries.yaml", total_delta=1e-6)
    assert next(t for t in stated["totals"]["topics"] if t["topic"] == "events")["composed"]["30d"]["delta"] == 1e-6


def test_plan_cli_prints_the_composed_totals_and_the_composed_cap(tmp_path):
    cfg = tmp_path / "q.yaml"
    import yaml
    c = _config("pld", counter="tree", max_epsilon=40.0)
    c["budget"]["default"]["refresh"] = "7d"
    cfg.write_text(yaml.safe_dump(c))
    out = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "plan", "--config", str(cfg)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert "composed             at delta" in out.stdout and "pld eps" in out.stdout
    assert "composed by pld at its delta" in out.stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "plan", "--config", str(cfg), "--json"],
                                    cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    b = doc["budget"][0]
    # 7 windows of eps 6 add to 42 > 40, but composed they fit
    assert b["accounting"] == "pld" and b["basic"]["exceeds"] and not b["exceeds"]
    t = compose([(query_loss(plan_levels_for_test(cfg)), 7)])
    assert b["planned_composed_epsilon_per_period"] == pytest.approx(total_epsilon(t, "pld", 1e-6), rel=1e-9)


def plan_levels_for_test(cfg):
    from dpstream.processor.config import level_plans_for
    return level_plans_for(load_config(cfg).queries[0])


def test_window_loss_round_trips_through_json():
    loss = query_loss(_tree_plans())
    assert WindowLoss.from_dict(json.loads(json.dumps(loss.to_dict()))) == loss
    blt = query_loss(_blt_plans())
    assert WindowLoss.from_dict(json.loads(json.dumps(blt.to_dict()))) == blt


#: test_ledger's replay config (a tenant's cap of epsilon 13, four-trigger hourly windows at epsilon 6),
#: composed by an accounting instead of added
REPLAY_CONFIG = LEDGER_CONFIG.replace("  shadow: {shadow}\n", "  accounting: {accounting}\n")


def test_a_replay_charges_the_same_windows_and_refuses_where_the_composed_total_passes_the_cap(tmp_path):
    import io

    from dpstream.processor.adapters.replay import ReplayRunner
    from dpstream.processor.config import level_plans_for
    from tests.conftest import TEST_SECRET

    events = tmp_path / "e.jsonl"
    hours = 8
    events.write_text("".join(json.dumps({"user_id": f"u{i}", "key": "k", "ts": h * 3_600_000 + i * 1000}) + "\n"
                              for h in range(hours) for i in range(300)))
    admitted = {}
    for accounting in ("basic", "zcdp"):
        cfg = tmp_path / f"{accounting}.yaml"
        cfg.write_text(REPLAY_CONFIG.format(accounting=accounting))
        config = load_config(cfg)
        runner = ReplayRunner(config, TEST_SECRET, str(tmp_path / accounting), log=io.StringIO(), start_ms=0)
        try:
            runner.run(str(events), io.StringIO(), until_ms=hours * 3_600_000)
            entry = runner.ledger.get("acme", 0)
            dropped = runner.pipelines[0].stats.dropped["budget"]
        finally:
            runner.close()
        admitted[accounting] = entry.charges
        assert entry.charges + entry.refusals == hours  # the same schedule: every window asked for, once
        assert dropped == 300 * entry.refusals
        assert entry.accounting == accounting
        if accounting == "zcdp":
            loss = query_loss(level_plans_for(config.queries[0]))
            # exactly as many windows as fit when composed; one more would not
            n = entry.charges
            assert total_epsilon(compose([(loss, n)]), "zcdp", 1e-8) <= 13.0
            assert n == hours or total_epsilon(compose([(loss, n + 1)]), "zcdp", 1e-8) > 13.0
            assert entry.spent_composed_epsilon == pytest.approx(total_epsilon(compose([(loss, n)]), "zcdp", 1e-8), rel=1e-9)
            shown = json.loads(subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "budget", "--config", str(cfg),
                                               "--state-dir", str(tmp_path / accounting), "--json"], cwd=ROOT,
                                              capture_output=True, text=True, check=True).stdout)["principals"][0]
            assert shown["accounting"] == "zcdp"
            assert shown["spent_composed_epsilon"] == pytest.approx(entry.spent_composed_epsilon)
    assert admitted["basic"] == 2  # 6 + 6 <= 13 < 18
    assert admitted["zcdp"] > admitted["basic"]
