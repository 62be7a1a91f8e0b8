"""SIGKILL of the worker at random points, in a loop, against Apache Kafka (issue 15, item 7):
during start-up, while reading, while firing and publishing. After each kill the worker is
started again on the same state directory, as Kubernetes does. Afterwards: no two different
releases for one (window, key, trigger) on the output, no user over C (stage 2 de-duplicates a
replayed (user, slot) pair, so equal counts mean no user was counted twice), and releases equal
to replay's. CI runs 4 kills; outside CI the ``slow`` variants run 20, of one static worker and of
three elastic workers (``--assignment group``)."""
import os
import signal
import time

import numpy as np
import pytest

from tests.test_kafka_worker import Scenario, assert_no_conflicting_releases, canonical


def produce_and_draw_kill_gaps(sc: Scenario, rng, kills: int, window_s: int):
    """The window's events produced; the gaps between kills, spread from the start of reading
    to past the window's last trigger."""
    sc.write_events(200_000, users=20_000, keys=200, lead_s=6)
    sc.produce_events()
    span = sc.window_start / 1000 + window_s + 4 - time.time()
    gaps = rng.uniform(0.2, 1.0, kills)
    gaps *= span / gaps.sum() if gaps.sum() < span else 1.0
    return gaps


def kill_loop(tmp_path, broker, kills: int, window_s: int, seed: int) -> None:
    sc = Scenario(tmp_path, broker, window_s=window_s, triggers=6)
    rng = np.random.default_rng(seed)
    try:
        w = sc.worker("k").start()
        sc.workers.append(w)
        w.wait_ready()
        for gap in produce_and_draw_kill_gaps(sc, rng, kills, window_s):
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


def group_kill_loop(tmp_path, broker, kills: int, window_s: int, seed: int) -> None:
    """Three elastic workers (``--assignment group``); at random points one of them, chosen at
    random, is SIGKILLed and started again at once on its volume under its instance id (which
    fences its earlier incarnation), as Kubernetes restarts a pod. The others must never exit
    (issue 30: no healthy worker exits), and the releases are replay's, each once."""
    sc = Scenario(tmp_path, broker, window_s=window_s, triggers=6)
    rng = np.random.default_rng(seed)
    names = ("a", "b", "c")

    def start(name: str):
        w = sc.worker(name, extra=("--assignment", "group", "--instance-id", name, "--log-level", "info")).start()
        sc.workers.append(w)
        return w

    def exited_by_itself(current: dict) -> list[str]:
        return [f"worker {n} exited by itself with code {w.proc.returncode}: "
                f"{[line for line in w.log.read_text(errors='replace').splitlines() if 'dpstream worker' in line][-2:]}"
                for n, w in current.items() if w.proc.poll() is not None]

    try:
        current = {n: start(n) for n in names[:1]}
        current["a"].wait_ready()  # it creates the topics (a start race is test_kafka_chaos's)
        current.update({n: start(n) for n in names[1:]})
        for w in current.values():
            w.wait_ready()
        for gap in produce_and_draw_kill_gaps(sc, rng, kills, window_s):
            time.sleep(gap)
            exits = exited_by_itself(current)
            assert not exits, "\n".join(exits)
            name = names[int(rng.integers(3))]
            current[name].proc.send_signal(signal.SIGKILL)
            current[name].proc.wait()
            current[name] = start(name)  # the same state directory and instance id
        for w in current.values():
            w.wait_ready()
        deadline = time.time() + 180
        expected = canonical(sc.replay())
        released = []
        while time.time() < deadline and not exited_by_itself(current):
            time.sleep(max(0.0, sc.window_start / 1000 + window_s + 4 - time.time()))
            released = sc.read(sc.output)
            if canonical(released) >= expected:
                break
        exits = exited_by_itself(current)
        assert not exits, "\n".join(exits)
        assert_no_conflicting_releases(released)
        assert expected and canonical(released) == expected
    finally:
        for x in sc.workers:
            x.stop()


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CI")), reason="20 kills of elastic workers take about 3 minutes: run this with scripts/test "
                                                      "tests/test_kill_loop.py")
def test_twenty_sigkills_of_elastic_workers_change_nothing(tmp_path, broker):
    group_kill_loop(tmp_path, broker, kills=20, window_s=30, seed=int(os.environ.get("DPSTREAM_KILL_SEED", "20")))
