"""One budget ledger per application (issue 15, item 6): every worker charges every query's windows
in the public schedule's order, so each holds the same ledger whatever partitions it owns and
whenever its timer runs. The attack: two queries of one tenant near the end of its budget, a
worker that owns none of a query's partitions, and workers ticking at different moments."""

import json

import pytest

from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.cli import main
from dpstream.processor.config import DpstreamConfig
from tests.conftest import TEST_SECRET, TEST_SECRET_HEX

HOUR = 3_600_000
START = 1_800_000_000_000 - 1_800_000_000_000 % (6 * HOUR)


def config(start=START, max_epsilon=20) -> DpstreamConfig:
    budget = {"principal": "tenant", "principals": {"acme": {"max_epsilon": max_epsilon, "max_delta": 1e-6}}}
    if start is not None:
        budget["start"] = start
    common = dict(input_topic="in", tenant="acme", triggers=2, allowed_lateness="0s", contribution_bound=2, epsilon=3,
                  delta=1e-9, key_threshold=0)
    return DpstreamConfig(budget=budget, queries=[dict(name="hourly", output_topic="o1", window="1h", **common),
                                                  dict(name="sixhourly", output_topic="o2", window="6h", **common)])


def ledger_view(worker: DpstreamWorker, now: int) -> list:
    return [(e.principal, e.spent_epsilon, e.spent_delta, e.charges, e.refusals) for e in worker.ledger.entries(now)]


def charge_records(worker: DpstreamWorker) -> dict:
    return {k: json.loads(v) for k, v in worker.ledger.store.scan_prefix(b"C")}


def test_workers_owning_different_partitions_and_ticking_apart_hold_the_same_ledger(tmp_path):
    end = START + 7 * HOUR
    # worker 0 owns the only repartition partition of both queries and ticks every 10 minutes;
    # worker 1 owns none of them and ticks once, at the end
    a = DpstreamWorker(config(), TEST_SECRET, tmp_path / "a", Ownership(0, 2), {"in": 2}, 1)
    b = DpstreamWorker(config(), TEST_SECRET, tmp_path / "b", Ownership(1, 2), {"in": 2}, 1)
    assert a.stage2 and not b.stage2
    for t in range(START, end + 1, 600_000):
        a.fire_due(t)
    b.fire_due(end)
    view = ledger_view(a, end)
    # 20 epsilon = 6 windows at 3 (and change for the thresholds' delta): some windows refused
    assert view[0][4] > 0 and view[0][3] >= 5
    assert ledger_view(b, end) == view
    assert charge_records(b) == charge_records(a)
    # the refusals are the schedule's last windows, in start order, not whichever query ticked first
    refused = sorted(k.split(b"\0")[1].decode() for k, v in charge_records(a).items() if v.get("refused"))
    charged = sorted(k.split(b"\0")[1].decode() for k, v in charge_records(a).items() if not v.get("refused"))
    assert max(int(c.split(":")[1]) for c in charged) <= min(int(r.split(":")[1]) for r in refused)
    a.close()
    b.close()


def test_a_refused_window_stays_refused_for_every_partition(tmp_path):
    """Before: a refused charge was not recorded, so another partition of the same window could be
    approved later (after a refresh) and half a window would release."""
    from dpstream.accountant.ledger import BudgetExceeded, BudgetLedger, BudgetPolicy
    from dpstream.state.store import MemoryStore

    led = BudgetLedger(MemoryStore(), {"t": BudgetPolicy(5.0, 1e-6, HOUR)}, None, "1")
    led.charge("t", 4.0, 0, "q:0", 0)
    with pytest.raises(BudgetExceeded):
        led.charge("t", 4.0, 0, "q:1", 10)
    led.charge("t", 4.0, 0, "q:2", HOUR + 1)  # a refresh: budget again
    with pytest.raises(BudgetExceeded):  # the second partition asking about q:1 gets the first answer
        led.charge("t", 4.0, 0, "q:1", 10)
    assert led.get("t", HOUR + 1).refusals == 1


def test_several_workers_with_a_budget_need_its_public_start(tmp_path, capsys):
    path = tmp_path / "q.yaml"
    path.write_text("budget:\n  principal: query\n  default: {max_epsilon: 100, max_delta: 1.0e-6}\nqueries:\n"
                    "  - {name: q, input_topic: in, output_topic: out, window: 1h, triggers: 2, contribution_bound: 2, epsilon: 3, "
                    "delta: 1.0e-9}\n")
    key = tmp_path / "k"
    key.write_text(TEST_SECRET_HEX)
    key.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    code = main(["worker", "--config", str(path), "--noise-key-file", str(key), "--workers", "2", "--worker-index", "1"])
    assert code != 0
    err = capsys.readouterr().err
    assert "budget.start" in err and "--workers 2" in err


def test_replay_charges_in_the_workers_order_and_holds_the_same_ledger(tmp_path):
    """Replay's per-query clocks follow the data; its charges still follow the one public order, so
    a replay over the same span refuses the same windows as the worker."""
    import io

    from dpstream.processor.adapters.replay import ReplayRunner

    end = START + 7 * HOUR
    # 4 of the 10 windows fit: the worker's order charges hourly 0, six-hourly 0, hourly 1 and 2;
    # query by query (each query's windows up to the clock, in config order) would differ
    worker = DpstreamWorker(config(max_epsilon=14), TEST_SECRET, tmp_path / "w", Ownership(), {"in": 1}, 1)
    for t in range(START, end + 1, 600_000):
        worker.fire_due(t)
    events = tmp_path / "e.jsonl"  # a few hours of events: the replay's clocks follow them, then --until
    events.write_text("".join(f'{{"user_id":"u{i}","key":"k","ts":{START + i * 60_000}}}\n' for i in range(200)))
    runner = ReplayRunner(config(max_epsilon=14), TEST_SECRET, str(tmp_path / "r"), start_ms=START)
    try:
        runner.run(str(events), io.StringIO(), until_ms=end + 1)
        replayed = [(e.principal, e.spent_epsilon, e.charges, e.refusals) for e in runner.ledger.entries(end)]
        refused = {k for k, v in ((k, json.loads(v)) for k, v in runner.ledger.store.scan_prefix(b"C")) if v.get("refused")}
    finally:
        runner.close()
    assert replayed == [(e.principal, e.spent_epsilon, e.charges, e.refusals) for e in worker.ledger.entries(end)]
    assert refused and refused == {k for k, v in charge_records(worker).items() if v.get("refused")}
    first_six = b"Cacme\0sixhourly:%d" % START  # charged before hourly 3, which starts later
    assert first_six in charge_records(worker) and first_six not in refused
    worker.close()


def test_the_window_holding_a_start_that_is_not_a_window_start_is_charged_first(tmp_path):
    """Found by the budget-schedule property test: with the start 1 ms into a window, the walk
    treated that window as already charged, and the pipeline charged it later, out of order."""
    from dpstream.processor.engine.budget import BudgetGate, ChargeSchedule
    from dpstream.state.store import MemoryStore

    cfg = config(start=START + 1)
    store = MemoryStore()
    from dpstream.processor.engine.budget import open_ledger

    schedule = ChargeSchedule(BudgetGate(cfg, open_ledger(cfg, store)), cfg.queries, START + 1, store)
    assert schedule.due(START + 1) == [(START, 0, "hourly"), (START, 1, "sixhourly")]
    schedule.charge_due(START + HOUR)
    assert schedule.due(START + HOUR) == [] and schedule.due(START + 2 * HOUR) == [(START + 2 * HOUR, 0, "hourly")]
