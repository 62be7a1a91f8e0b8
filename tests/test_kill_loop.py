"""SIGKILL of the worker at random points, in a loop, against Apache Kafka (issue 15, item 7):
during start-up, while reading, while firing and publishing. After each kill the worker is
started again on the same state directory, as Kubernetes does. Afterwards: no two different
releases for one (window, key, trigger) on the output, no user over C (stage 2 de-duplicates a
replayed (user, slot) pair, so equal counts mean no user was counted twice), and releases equal
to replay's. CI runs 4 kills; outside CI the ``slow`` variant runs 20."""
import os
import signal
import time

import numpy as np
import pytest

from tests.test_kafka_worker import Scenario, assert_no_conflicting_releases, canonical


def kill_loop(tmp_path, broker, kills: int, window_s: int, seed: int) -> None:
    sc = Scenario(tmp_path, broker, window_s=window_s, triggers=6)
    rng = np.random.default_rng(seed)
    try:
        w = sc.worker("k").start()
        sc.workers.append(w)
        w.wait_ready()
        sc.write_events(200_000, users=20_000, keys=200, lead_s=6)
        sc.produce_events()
        # kills spread from the start of reading to past the window's last trigger
        span = sc.window_start / 1000 + window_s + 4 - time.time()
        gaps = rng.uniform(0.2, 1.0, kills)
        gaps *= span / gaps.sum() if gaps.sum() < span else 1.0
        for gap in gaps:
            time.sleep(gap)  # at a random point: starting, reading, firing or publishing
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
            w = sc.worker("k").start()  # the same state directory
            sc.workers.append(w)
        w.wait_ready()
        sc.workers = [w]  # the triggers counted by the last incarnation alone are not all; wait on the output
        deadline = time.time() + 120
        expected = canonical(sc.replay())
        released = []
        while time.time() < deadline:
            time.sleep(max(0.0, sc.window_start / 1000 + window_s + 4 - time.time()))
            released = sc.read(sc.output)
            if canonical(released) >= expected:
                break
        assert_no_conflicting_releases(released)
        assert expected and canonical(released) == expected
    finally:
        for x in sc.workers:
            x.stop()


def test_four_sigkills_at_random_points_change_nothing(tmp_path, broker):
    kill_loop(tmp_path, broker, kills=4, window_s=12, seed=int(os.environ.get("DPSTREAM_KILL_SEED", "4")))


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CI")), reason="20 kills take about 2 minutes: CI runs the 4-kill test; run this with "
                                                      "scripts/test tests/test_kill_loop.py")
def test_twenty_sigkills_at_random_points_change_nothing(tmp_path, broker):
    kill_loop(tmp_path, broker, kills=20, window_s=30, seed=int(os.environ.get("DPSTREAM_KILL_SEED", "20")))
