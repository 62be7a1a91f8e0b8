"""Fix 3: the budget is charged on a public schedule (docs/privacy.md, "Windows and budget").

Claim under attack: with a ``budget:`` section every window is charged as the clock reaches its
start, data or not (charge id ``query:window_start``, charge time = window start); which windows
are refused, what the ledger has spent and every other key's releases do not depend on any one
user's records. The old code charged a window when its first record arrived, so one record on
an otherwise empty day used up the budget of the next day.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.accountant.plan import plan_fingerprint
from dpstream.processor.adapters.replay import ReplayError, ReplayRunner
from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.config import (
    BudgetConfig,
    BudgetLimit,
    DpstreamConfig,
    level_plans_for,
)
from tests.conftest import TEST_SECRET
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

EPS = 6.0  # each window's epsilon (plan.epsilon_spent of query())
X_KEY = "k-x"  # the key only the added user uses: every other key's releases must not move


def budget_config(max_windows: int = 1, refresh: str | None = None, start=None, shadow: bool = False, **qkw) -> DpstreamConfig:
    limit = BudgetLimit(max_epsilon=EPS * max_windows, max_delta=1e-9 * max_windows, refresh=refresh)
    return DpstreamConfig(queries=[query(**qkw)], budget=BudgetConfig(default=limit, start=start, shadow=shadow))


def honest_days(rng, days, records=200, users=40) -> list[dict]:
    rows = []
    for d in days:
        rows += events(rng, users=users, records=records, start=START + d * DAY, span=DAY, prefix=f"d{d}u")
    return rows


def insert_in_time_order(rows: list[dict], extra: dict) -> list[dict]:
    i = next((j for j, r in enumerate(rows) if r["ts"] > extra["ts"]), len(rows))
    return rows[:i] + [extra] + rows[i:]


def others(releases: dict) -> dict:
    return {k: v for k, v in releases.items() if json.loads(k[2]) != X_KEY}


def assert_same_budget_outcome(a, b):
    assert a.statuses == b.statuses, "which windows were refused depends on one user's record"
    assert a.charges == b.charges, "the ledger's charges depend on one user's record"
    ea, eb = a.ledger_entries, b.ledger_entries
    assert {p: (e.spent_epsilon, e.spent_delta, e.charges, e.refusals, e.last_reset_ms) for p, e in ea.items()} == \
           {p: (e.spent_epsilon, e.spent_delta, e.charges, e.refusals, e.last_reset_ms) for p, e in eb.items()}
    assert others(a.releases()) == others(b.releases()), "another key's releases depend on one user's record"


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("refresh,max_windows", [("1d", 1), (None, 2), (None, 1)])
def test_one_record_on_an_otherwise_empty_day_changes_no_refusal(tmp_path, refresh, max_windows):
    """The brief's scenario: day 0 empty but for one record of user x, days 1 and 2 busy."""
    cfg = budget_config(max_windows, refresh)
    rows = honest_days(np.random.default_rng(3), [1, 2], records=1500, users=300)
    x = {"user_id": "x", "key": X_KEY, "ts": START + 12 * HOUR}
    runs = []
    for i, data in enumerate([rows, [x] + rows]):
        runs.append(replay(cfg, write_jsonl(tmp_path / f"in{i}.jsonl", data), state_dir=tmp_path / f"s{i}", start_ms=START,
                           until_ms=START + 3 * DAY))
    without, with_x = runs
    assert_same_budget_outcome(without, with_x)
    windows = [START + d * DAY for d in range(3)]
    # every window from the start to the end was decided (charged or refused), data or not
    assert sorted(without.statuses[0]) == windows
    expected_open = 3 if refresh else max_windows
    assert sorted(w for w, s in without.statuses[0].items() if s == 1) == windows[:expected_open]
    assert without.ledger_entries["clicks"].charges == expected_open
    # the refused windows' records were dropped (and only those)
    assert (without.stats[0].dropped["budget"] > 0) == (expected_open < 3)
    assert with_x.stats[0].dropped["budget"] == without.stats[0].dropped["budget"]
    if expected_open >= 2:
        assert others(without.releases()), "the workload must release something on the busy days"


def test_charges_are_made_at_each_window_start_with_the_plan_fingerprint(tmp_path):
    cfg = budget_config(10)
    # no data at all: the public schedule still charges every window that starts before --until
    path = write_jsonl(tmp_path / "empty.jsonl", [])
    run = replay(cfg, path, start_ms=START + 5 * HOUR, until_ms=START + 3 * DAY + 1)
    fingerprint = plan_fingerprint(level_plans_for(cfg.queries[0])).hex()
    expected = [START + d * DAY for d in range(4)]  # window of the start .. the window starting 1 ms before --until
    assert sorted(run.charges) == sorted(f"clicks:{w}" for w in expected)
    for w in expected:
        record = run.charges[f"clicks:{w}"]
        assert record["at_ms"] == w, "the charge time must be the window start (public), not the wall clock"
        assert record["plan"] == fingerprint
        assert record["epsilon"] == pytest.approx(EPS)
    assert run.ledger_entries["clicks"].spent_epsilon == pytest.approx(4 * EPS)


def test_a_window_starting_at_until_is_not_opened(tmp_path):
    run = replay(budget_config(10), write_jsonl(tmp_path / "e.jsonl", []), start_ms=START, until_ms=START + 2 * DAY)
    assert sorted(run.charges) == [f"clicks:{START}", f"clicks:{START + DAY}"]


def test_a_ledger_requires_a_public_start_and_end(tmp_path):
    cfg = budget_config(2)
    path = write_jsonl(tmp_path / "e.jsonl", honest_days(np.random.default_rng(1), [0], records=20))
    with pytest.raises(ReplayError, match="--start"):
        ReplayRunner(cfg, TEST_SECRET, str(tmp_path / "a"))
    runner = ReplayRunner(cfg, TEST_SECRET, str(tmp_path / "b"), start_ms=START)
    try:
        with pytest.raises(ReplayError, match="--until"):
            runner.run(str(path), __import__("io").StringIO())
    finally:
        runner.close()
    # budget.start in the config is a public start too
    cfg_start = budget_config(2, start=START)
    run = replay(cfg_start, path, until_ms=START + DAY)
    assert sorted(run.charges) == [f"clicks:{START}"]


def test_records_before_the_public_start_charge_nothing_and_are_dropped(tmp_path):
    cfg = budget_config(1)
    rows = honest_days(np.random.default_rng(2), [1])
    early = [{"user_id": f"e{i}", "key": "k0", "ts": START + 3 * HOUR + i} for i in range(20)]
    a = replay(cfg, write_jsonl(tmp_path / "a.jsonl", rows), start_ms=START + DAY, until_ms=START + 2 * DAY)
    b = replay(cfg, write_jsonl(tmp_path / "b.jsonl", early + rows), start_ms=START + DAY, until_ms=START + 2 * DAY)
    assert a.charges == b.charges and a.statuses == b.statuses
    assert a.releases() == b.releases()
    assert b.stats[0].dropped["late"] == 20


# ---------------------------------------------------------------------------------------------
@st.composite
def scenarios(draw):
    ndays = draw(st.integers(2, 4))
    data_days = draw(st.lists(st.integers(0, ndays - 1), unique=True, max_size=ndays))
    max_windows = draw(st.integers(1, ndays))
    refresh = draw(st.sampled_from([None, "1d", "2d"]))
    x_day = draw(st.integers(-1, ndays))  # -1: before the start; ndays: after --until
    x_offset = draw(st.integers(0, DAY - 1))
    x_records = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    start_offset = draw(st.integers(0, DAY - 1))  # --start need not be a window start
    until_extra = draw(st.integers(0, DAY - 1))
    return ndays, sorted(data_days), max_windows, refresh, x_day, x_offset, x_records, seed, start_offset, until_extra


@settings(deadline=None, derandomize=True, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_property_one_users_records_never_change_refusals_spend_or_other_keys(tmp_path_factory, scenario):
    ndays, data_days, max_windows, refresh, x_day, x_offset, x_records, seed, start_offset, until_extra = scenario
    tmp = tmp_path_factory.mktemp("budget")
    cfg = budget_config(max_windows, refresh)
    rows = honest_days(np.random.default_rng(seed), data_days, records=120, users=30)
    with_x = rows
    for j in range(x_records):  # user x's records, each at its place in event-time order
        with_x = insert_in_time_order(with_x, {"user_id": "x", "key": X_KEY, "ts": START + x_day * DAY + x_offset + j})
    start, until = START + start_offset, START + (ndays - 1) * DAY + until_extra
    a = replay(cfg, write_jsonl(tmp / "a.jsonl", rows), start_ms=start, until_ms=until)
    b = replay(cfg, write_jsonl(tmp / "b.jsonl", with_x), start_ms=start, until_ms=until)
    assert_same_budget_outcome(a, b)
    # the schedule alone decides: every window from the start's to the last starting before --until
    first = START
    expected = list(range(first, until, DAY))
    assert sorted(a.statuses[0]) == expected
    for w in expected:
        assert a.charges.get(f"clicks:{w}", {"at_ms": w})["at_ms"] == w


# ---------------------------------------------------------------------------------------------
def test_worker_charges_windows_on_the_wall_clock_from_its_first_start(tmp_path):
    """No data at all: the worker's timer alone opens and charges windows; a restart continues the
    schedule from the first start kept in the ledger store, never from the restart time."""
    cfg = DpstreamConfig(queries=[query(input_topic="in", window="1h", triggers=4)],
                         budget=BudgetConfig(default=BudgetLimit(max_epsilon=EPS * 3, max_delta=1e-8)))
    first = START + 10 * 60_000  # not a window start: the window holding it is the first
    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {"in": 1}, 2, now_ms=first)
    try:
        w.fire_due(first + 2 * HOUR)
        entry = w.ledger.get("clicks", 0)
        assert entry.charges == 3 and entry.refusals == 0  # 00:00, 01:00, 02:00
        charges = {k[1:].split(b"\0", 1)[1].decode(): json.loads(v) for k, v in w.ledger.store.scan_prefix(b"C")}
        assert {c: r["at_ms"] for c, r in charges.items()} == {f"clicks:{START + h * HOUR}": START + h * HOUR for h in range(3)}
    finally:
        w.close()
    # restart much later: the schedule continues from the first start; the 4th window is refused
    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {"in": 1}, 2, now_ms=START + 30 * DAY)
    try:
        w.fire_due(first + 3 * HOUR)
        entry = w.ledger.get("clicks", 0)
        assert entry.charges == 3 and entry.refusals >= 1
        assert w.gate.refused == {f"clicks:{START + 3 * HOUR}"}
        for source in w.stage2.values():
            assert source.pipelines[0].first_window == START
    finally:
        w.close()


def test_worker_uses_budget_start_from_the_config(tmp_path):
    cfg = DpstreamConfig(queries=[query(input_topic="in", window="1h", triggers=4)],
                         budget=BudgetConfig(start=START - 2 * HOUR, default=BudgetLimit(max_epsilon=EPS * 10, max_delta=1e-8)))
    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {"in": 1}, 2, now_ms=START + 5 * DAY)
    try:
        w.fire_due(START)
        charges = sorted(k[1:].split(b"\0", 1)[1].decode() for k, _ in w.ledger.store.scan_prefix(b"C"))
        assert charges == sorted(f"clicks:{START - h * HOUR}" for h in (0, 1, 2))
    finally:
        w.close()


# ---------------------------------------------------------------------------------------------
BASELINE_CONFIG = """budget:
  default: {max_epsilon: 6, max_delta: 1.0e-9, refresh: 1d}
queries:
  - {name: clicks, window: 1d, triggers: 24, contribution_bound: 4, epsilon: 6, delta: 1.0e-9, allowed_lateness: 1m}
"""


def _cli_scenario(code_root, tmp_path, extra_args):
    cfg = tmp_path / "q.yaml"
    cfg.write_text(BASELINE_CONFIG)
    rows = honest_days(np.random.default_rng(1), [1], records=1500, users=300)
    x = {"user_id": "x", "key": X_KEY, "ts": START + 12 * HOUR}
    outcome = {}
    for name, data in (("without", rows), ("with", [x] + rows)):
        inp = write_jsonl(tmp_path / f"{name}.jsonl", data)
        out = tmp_path / f"{name}.out.jsonl"
        proc = run_cli(code_root, ["replay", "--config", str(cfg), "--input", str(inp), "--output", str(out), "--quiet",
                                   "--state-dir", str(tmp_path / f"{name}.state"), *extra_args], tmp_path)
        assert proc.returncode == 0, proc.stderr
        releases = [json.loads(line) for line in out.read_text().splitlines()]
        outcome[name] = ("budget" in proc.stderr.split("dropped:")[-1], {(r["window_start"], r["trigger"], json.dumps(r["key"])):
                                                                         r["count"] for r in releases if r["key"] != X_KEY})
    return outcome


def test_cli_same_scenario_refusal_does_not_depend_on_the_record(tmp_path):
    outcome = _cli_scenario(ROOT, tmp_path, ["--start", str(START), "--until", str(START + 2 * DAY), "--noise-label", "t"])
    assert outcome["without"] == outcome["with"]
    assert outcome["with"][1], "both days fit the daily budget: day 2 is released either way"
