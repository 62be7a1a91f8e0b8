"""Issue 30, item 3: a window is pinned to every public setting it was opened under, not only its
calibration (docs/privacy.md, "Windows and budget").

Claims under attack:

* resuming a state directory whose window is still open with another ``user_field``,
  ``key_fields``, ``value_field``, ``time_field``, ``window``, ``input_topic`` or ``hierarchy``
  (or any calibration setting) is refused, and the refusal names the setting
  (``queries[0].user_field: ...``) with its value then and now; a state so refused resumes with
  its settings unchanged as if never interrupted; once the window has closed the new setting is
  accepted for the windows opened after it;
* the same holds where stage 1 runs alone (a worker's stage-1 store keeps no window progress),
  for the worker as a whole (``dpstream worker: refused: ...``, exit code 2), for the ledger's
  charge of a window (a re-charge under other settings names the setting), for the CLI (one
  line, exit code 2) and for a dynamic query's fields (``item_field``, ``op_field``,
  ``time_field``, ``input_topic``);
* one definition (``QueryConfig.window_pins``) is what the window's state and its charge record;
* state written before the settings were recorded (the plan fingerprint only) is read: checked
  against its plan, then pinned to the settings of its next use.

The motivating run: a half-day replay resumed with ``user_field: device_id`` continued the
window, and most of the rest of the day's records were dropped by the bound of the new unit.
"""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from dpstream.accountant import pins
from dpstream.accountant.ledger import BudgetLedger, BudgetPolicy, ChargePlanError
from dpstream.accountant.plan import plan_fingerprint
from dpstream.processor.adapters.faust_app import stop_line
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.config import (
    UNPINNED_FIELDS,
    BudgetConfig,
    BudgetLimit,
    DpstreamConfig,
    DynamicQueryConfig,
    QueryConfig,
    level_plans_for,
)
from dpstream.processor.engine.budget import BudgetGate
from dpstream.processor.engine.pipeline import PlanChangedError, QueryPipeline
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.state import keys as sk
from dpstream.state.store import MemoryStore, WriteBatch
from dpstream.state.tables import WINDOW_OPEN, Progress
from dpstream.topics.kafka import DEAD_LETTER_TOPIC
from dpstream.topics.partitioner import partition_for_key
from tests.conftest import TEST_LABEL, TEST_SECRET, Record
from tests.privacy._helpers import DAY, HOUR, ROOT, START, query, replay, run_cli, write_jsonl

ISO_START = "2026-11-20T00:00:00Z"  # START


def rows(seed: int = 1, records: int = 1500, start: int = START, prefix: str = "u") -> list[dict]:
    """A day of events carrying every field a query below may read: two user fields (a user has
    three devices), two key fields, two value fields and two time fields (the same time)."""
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 200, records)
    key = np.minimum(rng.geometric(0.25, records) - 1, 11)
    ts = np.sort(start + rng.integers(0, DAY, records))
    return [{"user_id": f"{prefix}{u}", "device_id": f"{prefix}{u}-d{i % 3}", "key": f"k{k}", "region": f"r{k % 3}",
             "value": float(k % 4), "value2": float((k + 1) % 4), "ts": int(t), "ts2": int(t)}
            for i, (u, k, t) in enumerate(zip(user, key, ts))]


def two_days() -> list[dict]:
    return rows(1) + rows(2, start=START + DAY, prefix="v")


SUM = dict(aggregate="sum", value_field="value", clamp=4.0)
LEVELS = dict(key_fields=["region", "key"])
#: setting -> (the query the window opens under, the query a resume brings, what the refusal shows then and now)
CHANGES = {
    "user_field": ({}, dict(user_field="device_id"), ("'user_id'", "'device_id'")),
    "key_fields": ({}, dict(key_fields=["region"]), ("['key']", "['region']")),
    "value_field": (SUM, dict(SUM, value_field="value2"), ("'value'", "'value2'")),
    "time_field": ({}, dict(time_field="ts2"), ("'ts'", "'ts2'")),
    "window": ({}, dict(window="12h"), ("'1d'", "'12h'")),
    "input_topic": ({}, dict(input_topic="other-events"), ("'events'", "'other-events'")),
    "hierarchy": (LEVELS, dict(LEVELS, hierarchy=True), ("False", "True")),
    # calibration settings were refused before, naming none of them
    "epsilon": ({}, dict(epsilon=3.0), ("6.0", "3.0")),
    "contribution_bound": ({}, dict(contribution_bound=8), ("4", "8")),
    "per_key_bound": ({}, dict(per_key_bound=1), ("None", "1")),
    "counter": ({}, dict(counter="tree"), ("'blt'", "'tree'")),
}


def cfg(**fields) -> DpstreamConfig:
    return DpstreamConfig(queries=[query(**fields)])


@pytest.mark.parametrize("setting", sorted(CHANGES))
def test_a_window_keeps_every_setting_it_was_opened_with_until_it_closes(tmp_path, setting):
    """Half a day, then a resume with the setting changed: refused, naming it, with its value then
    and now. The unchanged settings resume as if never interrupted, to the end of the day (the
    window closes: allowed_lateness 0, every trigger fires). Then the changed setting is accepted
    and applies from the next window on."""
    opened, changed, (then, now) = CHANGES[setting]
    data = two_days()
    path = write_jsonl(tmp_path / "e.jsonl", [r for r in data if r["ts"] < START + DAY])
    state = tmp_path / "s"
    half = replay(cfg(**opened, allowed_lateness="0s"), path, state_dir=state, stop_after=700)  # mid day 1
    assert half.statuses[0] == {START: WINDOW_OPEN}
    with pytest.raises(PlanChangedError) as info:
        ReplayRunner(cfg(**changed, allowed_lateness="0s"), TEST_SECRET, str(state), log=io.StringIO(), noise_label=TEST_LABEL)
    message = str(info.value)
    assert message.startswith(f"queries[0].{setting}: window {ISO_START} ({START} ms) of query clicks is still open"), message
    assert f"{setting} {then} (this run: {now})" in message, message
    assert [c.setting for c in info.value.changes] == [setting]
    # refused before anything was written: the same settings resume, as if never interrupted
    rest = replay(cfg(**opened, allowed_lateness="0s"), path, state_dir=state, until_ms=START + DAY)
    whole = replay(cfg(**opened, allowed_lateness="0s"), path, state_dir=tmp_path / "whole", until_ms=START + DAY)
    assert rest.records and half.output + rest.output == whole.output
    # the window has closed: day 2 opens under the new setting
    write_jsonl(path, data)
    second = replay(cfg(**changed, allowed_lateness="0s"), path, state_dir=state, until_ms=START + 2 * DAY)
    assert second.records, "day 2 is released under the new setting"
    assert min(r["window_start"] for r in second.records) == START + DAY


# ---------------------------------------------------------------------------------------------
# The worker: stage 1 on its own store, and the worker as a whole (no broker: its core)

WINDOW_MS = 40_000
W0 = 1_800_000_000_000 - 1_800_000_000_000 % WINDOW_MS


def worker_config(**overrides) -> DpstreamConfig:
    q = dict(name="clicks", input_topic="in", output_topic="out", window="40s", triggers=4, allowed_lateness="1s",
             contribution_bound=3, epsilon=6, delta=1e-9)
    q.update(overrides)
    return DpstreamConfig(queries=[q])


def worker_records(n: int, partitions: int, partition: int, start: int, first_offset: int = 0) -> list[Record]:
    """Records of users keyed to ``partition`` (murmur2, as produced), dated ``start`` on,
    stamped at their event time (on time)."""
    users = [u for u in (f"u{i}" for i in range(400)) if partition_for_key(u.encode(), partitions) == partition][:40]
    out = []
    for i in range(n):
        user, ts = users[i % len(users)], start + i * (WINDOW_MS // 4) // n
        value = json.dumps({"user_id": user, "key": f"k{i % 7}", "region": f"r{i % 2}", "ts": ts}).encode()
        out.append(Record(first_offset + i, user.encode(), value, ts))
    return out


def test_a_stage_one_store_refuses_records_of_a_window_bounded_under_other_settings(tmp_path):
    """Worker 1 of 2 owns input partition 1 of 2 and no partition of the one repartition topic:
    its store is stage 1's alone and holds no window progress. Its bound still refuses a window
    first bounded under other settings, naming the setting; the next window takes the new ones."""
    def worker(**overrides):
        return DpstreamWorker(worker_config(**overrides), TEST_SECRET, tmp_path / "s", Ownership(1, 2), {"in": 2}, 1)

    w = worker()
    assert list(w.stage1) == [("in", 1)] and not w.stage2
    w.process_input("in", 1, worker_records(200, 2, 1, W0)).commit()
    w.close()
    w = worker(key_fields=["region"])  # nothing to check at start: stage 1 has no window progress
    with pytest.raises(PlanChangedError) as info:
        w.process_input("in", 1, worker_records(100, 2, 1, W0 + WINDOW_MS // 4, first_offset=200))
    assert str(info.value).startswith("queries[0].key_fields: window ") and "of query clicks is still open" in str(info.value)
    assert stop_line(info.value)[0] == 2 and stop_line(info.value)[1].startswith("dpstream worker: refused: queries[0].key_fields:")
    w.close()
    # the old settings go on; records of the next window (the first closed for stage 1) take the new ones
    w = worker()
    w.process_input("in", 1, worker_records(100, 2, 1, W0 + WINDOW_MS // 4, first_offset=200)).commit()
    w.close()
    w = worker(key_fields=["region"])
    out = w.process_input("in", 1, worker_records(100, 2, 1, W0 + WINDOW_MS, first_offset=300))
    assert out is not None and sum(next(iter(w.pipelines())).stats.dropped.values()) == 0
    w.close()


def test_the_worker_refuses_at_start_naming_the_setting_of_a_window_still_open(tmp_path):
    def worker(state="s", **overrides):
        return DpstreamWorker(worker_config(**overrides), TEST_SECRET, tmp_path / state, Ownership(), {"in": 1}, 1)

    w = worker()
    result = w.process_input("in", 0, worker_records(200, 1, 0, W0))
    result.commit()
    bounded = [m for m in result.messages if m.topic != DEAD_LETTER_TOPIC]
    assert bounded
    for offset, m in enumerate(bounded):  # stage 2 takes stage 1's output: the window opens with its first records
        w.process_repartitioned(m.topic, m.partition, [Record(offset, m.key, m.value, 0)]).commit()
    w.close()
    shutil.copytree(tmp_path / "s", tmp_path / "copy")  # a refused worker exits with its stores open: refuse on a copy
    with pytest.raises(PlanChangedError) as info:
        worker("copy", user_field="device_id")
    code, line = stop_line(info.value)
    assert code == 2 and line.startswith("dpstream worker: refused: queries[0].user_field: window ")
    assert "'user_id' (this run: 'device_id')" in line
    worker().close()  # the settings it was opened under: fine


# ---------------------------------------------------------------------------------------------
# The ledger's charge of a window


def budgeted(**fields) -> DpstreamConfig:
    return DpstreamConfig(queries=[query(**fields)], budget=BudgetConfig(default=BudgetLimit(max_epsilon=100, max_delta=1e-6)))


@pytest.mark.parametrize("setting", ["user_field", "key_fields", "time_field", "window", "input_topic"])
def test_a_window_charged_under_other_settings_is_refused_by_the_ledger_naming_the_setting(setting):
    """The charge of a window records its settings: a second charge of the same id (a crash
    between the charge and the window's progress, another worker) under other settings is
    refused, naming the setting; the same settings are a duplicate, charged once."""
    opened, changed, (then, now) = CHANGES[setting]
    led = BudgetLedger(MemoryStore(), {}, BudgetPolicy(100, 1e-6), "1")
    old, new = budgeted(**opened), budgeted(**changed)
    assert BudgetGate(old, led).window_gate(old.queries[0])(START)
    with pytest.raises(ChargePlanError) as info:
        BudgetGate(new, led).window_gate(new.queries[0])(START)
    message = str(info.value)
    assert message.startswith(f"queries[0].{setting}: charge clicks:{START} of 'clicks' was made with {setting} {then} "
                              f"(this run: {now})"), message
    assert BudgetGate(old, led).window_gate(old.queries[0])(START)  # the same settings: already paid
    assert led.get("clicks", START).charges == 1


def test_the_ledger_reads_a_charge_recorded_with_its_plan_only():
    """Charges written before the settings were recorded hold the plan fingerprint: the same
    plan is the same charge, another plan is refused naming the calibration."""
    led = BudgetLedger(MemoryStore(), {}, BudgetPolicy(100, 1e-6), "1")
    q = query()
    mine = q.window_pins()
    assert led.charge("clicks", 1.0, 1e-9, "clicks:0", 0, plan=mine[pins.PLAN]).charged  # as before: no pins
    assert led.charge("clicks", 1.0, 1e-9, "clicks:0", 0, plan=mine[pins.PLAN], pins=mine).duplicate
    other = query(epsilon=3.0).window_pins()
    with pytest.raises(ChargePlanError, match=r"^plan: charge clicks:0 of 'clicks' was made with another calibration"):
        led.charge("clicks", 1.0, 1e-9, "clicks:0", 0, plan=other[pins.PLAN], pins=other)


def test_the_window_state_and_its_charge_record_the_one_definition_of_its_settings(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", rows(1))
    config = budgeted(allowed_lateness="0s")
    run = replay(config, path, state_dir=tmp_path / "s", start_ms=START, until_ms=START + 6 * HOUR)
    expected = config.queries[0].window_pins()
    assert run.charges[f"clicks:{START}"]["pins"] == json.loads(pins.encode(expected))
    assert run.charges[f"clicks:{START}"]["plan"] == expected[pins.PLAN]
    runner = ReplayRunner(config, TEST_SECRET, str(tmp_path / "s"), log=io.StringIO(), start_ms=START)
    try:
        stored = runner.pipelines[0].tables.pins.get(START)
    finally:
        runner.close()
    assert pins.decode(stored) == json.loads(pins.encode(expected))
    # every field of a query is pinned, unless declared unpinned with its reason
    assert set(expected) == set(QueryConfig.model_fields) - set(UNPINNED_FIELDS) | {pins.PLAN}


# ---------------------------------------------------------------------------------------------
# State written before the settings were recorded


def test_a_window_opened_before_its_settings_were_recorded_is_checked_on_its_plan_then_pinned():
    noise = NodeNoise(TEST_SECRET, TEST_LABEL)
    store = MemoryStore()
    q = query()
    # what an earlier dpstream left: a progress row with the plan fingerprint, no settings
    batch = WriteBatch()
    Progress(store, sk.query_id(q.name)).put(batch, START, 3, WINDOW_OPEN, plan_fingerprint(level_plans_for(q)))
    store.write(batch)
    with pytest.raises(PlanChangedError, match=r"^queries\[0\]: .*another calibration"):
        QueryPipeline(query(epsilon=3.0), noise, store, index=0)
    QueryPipeline(query(user_field="device_id"), noise, store)  # not recorded: cannot be told apart yet
    pipe = QueryPipeline(q, noise, store)
    pipe.fire(START, 4)  # its next use records this run's settings
    with pytest.raises(PlanChangedError, match=r"^user_field: window .* 'user_id' \(this run: 'device_id'\)"):
        QueryPipeline(query(user_field="device_id"), noise, store)


# ---------------------------------------------------------------------------------------------
# The CLI


def test_cli_refuses_a_changed_user_field_in_one_line_naming_it(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", two_days())
    config = tmp_path / "q.yaml"
    base = "queries:\n  - {{name: clicks, window: 1d, triggers: 24, contribution_bound: 4, epsilon: 6.0, delta: 1.0e-9, user_field: {who}}}\n"
    config.write_text(base.format(who="user_id"))
    args = ["replay", "--config", str(config), "--input", str(path), "--output", str(tmp_path / "o.jsonl"), "--quiet",
            "--state-dir", str(tmp_path / "s"), "--noise-label", "t"]
    proc = run_cli(ROOT, args + ["--stop-after-lines", "700"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    config.write_text(base.format(who="device_id"))
    proc = run_cli(ROOT, args, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dpstream: queries[0].user_field: window {ISO_START}"), proc.stderr


# ---------------------------------------------------------------------------------------------
# Dynamic queries: pinned for their whole life

DYNAMIC_CHANGES = {
    "item_field": dict(item_field="sku"),
    "op_field": dict(op_field="action"),
    "time_field": dict(time_field="t2"),
    "input_topic": dict(input_topic="other-updates"),
}


def dynamic(**fields) -> DpstreamConfig:
    q = dict(name="plans", items=["a", "b"], epsilon=1.0, start=START, tick="1s")
    q.update(fields)
    return DpstreamConfig(dynamic=[DynamicQueryConfig(**q)], budget=BudgetConfig(default=BudgetLimit(max_epsilon=10, max_delta=1e-6)))


@pytest.mark.parametrize("setting", sorted(DYNAMIC_CHANGES))
def test_a_dynamic_query_resumed_with_another_field_is_refused_naming_it(tmp_path, setting):
    updates = [{"item": "ab"[i % 2], "sku": "ab"[i % 2], "op": "insert", "action": "insert", "ts": START + i * 1000,
                "t2": START + i * 1000} for i in range(600)]
    path = write_jsonl(tmp_path / "e.jsonl", updates)
    state = tmp_path / "s"
    replay(dynamic(), path, state_dir=state, start_ms=START, until_ms=START + 100_000, stop_after=300)
    with pytest.raises(PlanChangedError) as info:
        replay(dynamic(**DYNAMIC_CHANGES[setting]), path, state_dir=state, start_ms=START, until_ms=START + 700_000)
    assert str(info.value).startswith(f"dynamic[0].{setting}: dynamic query 'plans' was started with {setting} "), str(info.value)
    run = replay(dynamic(), path, state_dir=state, start_ms=START, until_ms=START + 700_000)
    assert run.ledger_entries["plans"].charges == 1 and run.records
    assert run.charges["plans:start"]["pins"] == json.loads(pins.encode(dynamic().dynamic[0].pins()))


def test_a_dynamic_query_started_before_its_settings_were_recorded_is_checked_on_its_plan_then_pinned(tmp_path):
    from dpstream.processor.engine.dynamic_stream import DynamicQueryState
    from dpstream.processor.mechanisms.noise import Pseudonymizer
    from dpstream.state.tables import DynamicTables

    store = MemoryStore()
    q = dynamic().dynamic[0]
    DynamicTables(store, q.name).pin_plan(q.fingerprint().encode())  # as an earlier dpstream pinned it
    noise, pseudonyms = NodeNoise(TEST_SECRET, TEST_LABEL), Pseudonymizer(TEST_SECRET)
    with pytest.raises(PlanChangedError, match=r"another calibration"):
        DynamicQueryState(dynamic(epsilon=2.0).dynamic[0], noise, pseudonyms, store)
    DynamicQueryState(q, noise, pseudonyms, store)  # the same plan: read, and its settings recorded
    with pytest.raises(PlanChangedError, match=r"^dynamic\[0\]\.item_field: "):
        DynamicQueryState(dynamic(item_field="sku").dynamic[0], noise, pseudonyms, store, index=0)
