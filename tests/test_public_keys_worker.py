"""Public keys through Kafka (issue 34, item 1): two static workers share the by-key topic's
partitions, each releases the declared keys stage 1 routes to its partitions, and together they
release every declared key once per trigger, the values replay gives, including a key no record
names; records of other keys are dropped as not_public_key."""
import json
import time

import pytest

from tests.test_kafka_worker import Scenario, assert_no_conflicting_releases, canonical


@pytest.mark.broker
@pytest.mark.slow
def test_two_workers_release_every_public_key_once_per_trigger_as_replay_does(tmp_path, broker):
    sc = Scenario(tmp_path, broker, lateness_s=10)
    sc.write_events(3_000, users=300, keys=30, lead_s=25)  # keys k1..k30; the worker's start within the lead
    declared = [f"k{j}" for j in range(1, 11)] + ["k-never"]
    # the budget's public schedule starts at the data's window: windows open on the clock, data or not
    sc.config.write_text(sc.config.read_text() + f"    public_keys: {json.dumps(declared)}\n"
                         f"budget:\n  start: {sc.window_start}\n  default: {{max_epsilon: 1000000, max_delta: 0.5}}\n")
    try:
        for index in (0, 1):
            w = sc.worker(f"w{index}", index=index, workers=2).start()
            sc.workers.append(w)
        for w in sc.workers:
            w.wait_ready()
        sc.produce_events()
        sc.wait_for_window_end()
        end = sc.window_start + sc.window_s * 1000 + sc.lateness_s * 1000
        expected = [r for r in sc.replay(until_ms=end + 1_000) if r["window_start"] == sc.window_start]
        deadline = time.time() + 60
        while True:  # the window's releases (later windows open and release on the public schedule too)
            released = [r for r in sc.read(sc.output) if r["window_start"] == sc.window_start]
            if canonical(released) >= canonical(expected) or time.time() > deadline:
                break
            time.sleep(1)
        assert_no_conflicting_releases(released)
        assert {(r["trigger"], r["key"]) for r in expected} == {(t, k) for t in range(1, sc.triggers + 1) for k in declared}
        assert len(released) == len(expected) and canonical(released) == canonical(expected), sc.drops()
        dropped = sum(w.metric("dpstream_events_dropped_total", query=sc.query, reason="not_public_key") for w in sc.workers)
        keys = [json.loads(line)["key"] for line in sc.events.read_text().splitlines()]
        assert dropped == sum(1 for k in keys if k not in declared) > 0
    finally:
        for w in sc.workers:
            w.stop()
