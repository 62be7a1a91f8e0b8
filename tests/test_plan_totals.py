"""`dpstream plan`: total privacy loss per input topic, budget caps and warnings (docs/plan.md).

The totals are checked against hand computations that do not use the accountant's composition
code: declared epsilons times windows counted by hand, and window counts against a brute-force
enumeration of UTC days.
"""
import json
from pathlib import Path

import pytest

import dpstream
from dpstream.accountant.plan import DAY_MS, windows_in
from dpstream.processor.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "queries.yaml"
H = 3_600_000

TWO_ON_ONE_TOPIC = """
queries:
  - {name: hourly, input_topic: events, epsilon: 0.5, delta: 1.0e-10, window: 1h, triggers: 12, counter: tree}
  - {name: daily, input_topic: events, epsilon: 1.0, delta: 2.0e-10, window: 1d, triggers: 24, counter: tree}
  - {name: elsewhere, input_topic: other, epsilon: 2.0, delta: 1.0e-9, window: 1d, triggers: 24, counter: tree}
"""

#: the worker's example query at epsilon 0.01 under the paper's tree and zCDP (the issue's numbers)
TINY_EPSILON = """
queries:
  - name: page_clicks
    contribution_bound: 16
    window: 1h
    triggers: 60
    epsilon: {eps}
    delta: 1.0e-9
    counter: tree
    composition: zcdp
"""


def run_plan(capsys, path, *extra):
    code = main(["plan", "--config", str(path), "--json", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def topic(doc, name):
    (t,) = [t for t in doc["totals"]["topics"] if t["topic"] == name]
    return t


def test_two_queries_on_one_topic_add_up_exactly_per_day_and_30_days(tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text(TWO_ON_ONE_TOPIC)
    code, doc, _ = run_plan(capsys, path)
    assert code == 0
    events = topic(doc, "events")
    # by hand: 24 hourly windows and 1 daily window in a UTC day; 720 and 30 in 30 days
    assert events["epsilon"]["1d"] == pytest.approx(24 * 0.5 + 1 * 1.0, rel=1e-9)
    assert events["epsilon"]["30d"] == pytest.approx(720 * 0.5 + 30 * 1.0, rel=1e-9)
    # each window is charged its plan's delta_spent: under gdp with the tree the exact discrete
    # curve's delta, at most the declared one (docs/privacy.md, "Accounting")
    spent = {q["name"]: q["delta_spent"] for q in doc["queries"]}
    assert spent["hourly"] <= 1e-10 and spent["daily"] <= 2e-10
    assert events["delta"]["1d"] == pytest.approx(24 * spent["hourly"] + spent["daily"], rel=1e-12)
    assert events["delta"]["1d"] == pytest.approx(24 * 1e-10 + 2e-10, rel=1e-3)
    # 24 hours from any time: 25 hourly windows, 2 daily ones
    assert events["epsilon_any_span"]["1d"] == pytest.approx(25 * 0.5 + 2 * 1.0, rel=1e-9)
    assert events["per_window"]["epsilon"] == pytest.approx(1.5, rel=1e-9)
    assert [q["name"] for q in events["queries"]] == ["hourly", "daily"]
    # another topic reads other users: not added to events
    assert topic(doc, "other")["epsilon"]["1d"] == pytest.approx(2.0, rel=1e-9)
    assert doc["totals"]["composition"].startswith("basic")
    # 13 per day is above the default advice level of 10 for events, not for other
    assert [w for w in doc["warnings"] if w.startswith("topic ")] == [next(w for w in doc["warnings"] if "topic events" in w)]


@pytest.mark.parametrize("window_h", [1, 5, 7, 24, 36, 24 * 7])
@pytest.mark.parametrize("days", [1, 30])
def test_windows_in_a_utc_span_against_brute_force(window_h, days):
    """Epoch-aligned windows reached by a span starting at a UTC midnight (and at any hour),
    counted by enumerating day starts over a full cycle of the window."""
    window, horizon = window_h * H, days * DAY_MS
    most_utc = most_any = 0
    for day in range(0, 2 * window_h + 2):  # day starts cover every offset modulo the window
        start = day * DAY_MS
        first, last = start // window, (start + horizon - 1) // window
        most_utc = max(most_utc, last - first + 1)
        for hour in range(window_h + 1):
            s = start + hour * H + 1  # one ms past the hour: the worst offset of any span
            most_any = max(most_any, (s + horizon - 1) // window - s // window + 1)
    assert windows_in(horizon, window) == most_utc
    assert windows_in(horizon, window, 1) == most_any


def test_example_config_is_about_63_per_day_and_says_so(capsys):
    code, doc, err = run_plan(capsys, EXAMPLE)
    assert code == 0
    events = topic(doc, "events")
    # url_clicks 6 + url_clicks_fine 6 + basket_value 2 x 24 + visits_by_place 3
    assert events["epsilon"]["1d"] == pytest.approx(63.0, rel=1e-6)
    assert events["epsilon"]["30d"] == pytest.approx(1890.0, rel=1e-6)
    # the dynamic query is in its own topic's total, charged once
    assert topic(doc, "dpstream-dynamic-updates")["epsilon"]["30d"] == pytest.approx(1.0)
    lines = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert any("topic events" in line and "63" in line and "advice" in line for line in lines), err
    assert any("topic events" in w for w in doc["warnings"])
    # the text form prints the same totals
    assert main(["plan", "--config", str(EXAMPLE)]) == 0
    text = capsys.readouterr().out
    assert "per 1d (UTC)           eps 63," in text and "basic (sequential) composition" in text


def test_a_dynamic_query_counts_once_in_its_topics_total(tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text(TWO_ON_ONE_TOPIC + """
dynamic:
  - {name: plans, input_topic: events, items: [a, b], start: 0, epsilon: 0.75}
""")
    code, doc, _ = run_plan(capsys, path)
    assert code == 0
    events = topic(doc, "events")
    assert events["epsilon"]["1d"] == pytest.approx(13.0 + 0.75, rel=1e-9)
    assert events["epsilon"]["30d"] == pytest.approx(390.0 + 0.75, rel=1e-9)
    (dyn,) = [q for q in events["queries"] if q["name"] == "plans"]
    assert dyn["unit"] == "one update" and dyn["window_ms"] is None


def test_epsilon_001_warns_that_nothing_useful_is_released(tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text(TINY_EPSILON.format(eps=0.01))
    code, doc, err = run_plan(capsys, path)
    assert code == 0
    use = doc["usefulness"]["page_clicks"]
    assert use["tau_1"] == pytest.approx(52_700, rel=1e-3)
    assert use["expected_stddev"] == pytest.approx(40_119, rel=1e-3)
    assert use["releases_nothing"] and use["noise_dominates"]
    warned = [line for line in err.splitlines() if line.startswith("warning: query page_clicks: releases nothing useful")]
    assert len(warned) == 2 and len([w for w in doc["warnings"] if "releases nothing useful" in w]) == 2
    # a stated scale above the threshold and the noise: no usefulness warning
    code, doc, err = run_plan(capsys, path, "--key-users", "100000")
    assert code == 0 and not any("releases nothing useful" in w for w in doc["warnings"]), doc["warnings"]
    # epsilon 6 at the default scale: releases something (and spends 144 a day: that warning stays)
    path.write_text(TINY_EPSILON.format(eps=6.0))
    code, doc, err = run_plan(capsys, path)
    assert code == 0 and "releases nothing" not in err and not any("releases nothing" in w for w in doc["warnings"])
    assert [w.split(":")[0] for w in doc["warnings"]] == ["topic events"]


def test_an_epsilon_too_small_for_the_blt_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text("queries:\n  - {name: q, epsilon: 0.01, delta: 1.0e-9, window: 1d, triggers: 100, contribution_bound: 32}\n")
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "queries[0].epsilon" in err and "counter: tree" in err and "Traceback" not in err


def test_budget_caps_are_shown_beside_the_planned_spend(tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text(TWO_ON_ONE_TOPIC + """
budget:
  principal: input_topic
  default: {max_epsilon: 100, max_delta: 1.0e-6, refresh: 30d}
  principals:
    other: {max_epsilon: 1000, max_delta: 1.0e-6}
""")
    code, doc, err = run_plan(capsys, path)
    assert code == 0
    caps = {b["principal"]: b for b in doc["budget"]}
    # the ledger charges each window at its start: 720 hourly and 30 daily starts in 30 days
    assert caps["events"]["planned_epsilon_per_period"] == pytest.approx(720 * 0.5 + 30 * 1.0, rel=1e-9)
    assert caps["events"]["exceeds"] is True
    assert any(line.startswith("warning: budget 'events'") and "will be refused" in line for line in err.splitlines())
    # never refreshed: 2 per day against 1000
    assert caps["other"]["days_until_exhausted"] == pytest.approx(500.0, rel=1e-6)
    assert main(["plan", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert "budget cap             cap eps 100, delta 1e-06 per 30d; planned eps 390" in text


def test_python_api_returns_the_cli_json(tmp_path, capsys):
    import yaml

    code, doc, _ = run_plan(capsys, EXAMPLE)
    assert code == 0
    assert json.loads(json.dumps(dpstream.plan(str(EXAMPLE)))) == doc
    assert json.loads(json.dumps(dpstream.plan(yaml.safe_load(EXAMPLE.read_text())))) == doc
    with pytest.raises(ValueError, match=r"queries\[0\]\.epsilon"):
        dpstream.plan({"queries": [{"name": "a", "epsilon": -1, "delta": 1e-6}]})
