"""The worker against an Apache Kafka broker that goes away (issue 15, item 3): a restart of the
broker across trigger times, and an outage longer than ``--broker-timeout``. Each test runs its
own broker (scripts/broker on a free port), so the session's broker is never disturbed."""
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT, free_port_block
from tests.test_kafka_worker import LATENESS_S, WINDOW_S, Scenario

SCRIPT = str(ROOT / "scripts" / "broker")


class OwnBroker:
    def __init__(self):
        self.port = free_port_block(2)  # the broker and its controller
        self.address = f"127.0.0.1:{self.port}"

    def run(self, command: str) -> None:
        proc = subprocess.run([SCRIPT, command, str(self.port)], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"scripts/broker {command} {self.port}: {proc.stdout}{proc.stderr}"


@pytest.fixture
def own_broker(broker):
    kind = subprocess.run([SCRIPT, "which"], capture_output=True, text=True).stdout
    if "Apache Kafka" not in kind:
        pytest.skip(f"a broker restart that keeps its data needs Apache Kafka; the test broker is {kind.strip()}")
    b = OwnBroker()
    b.run("start")
    yield b
    b.run("stop")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s")


def started_with_records(sc: Scenario, name: str, extra: tuple = ()):
    """A worker, ready, whose stage 2 has taken in part of 20,000 events produced just before
    their window."""
    w = sc.worker(name, extra=extra).start()
    sc.workers.append(w)
    w.wait_ready()
    sc.write_events(20_000, users=2_000, keys=60, lead_s=2)
    sc.produce_events()
    def took_records() -> bool:
        assert w.proc.poll() is None, f"worker exited: {w.log.read_text()[-3000:]}"
        return w.metric("dpstream_records_accumulated_total", query=sc.query) > 0

    wait_for(took_records, 30, "stage 2 took records")
    return w


def test_a_broker_restart_across_trigger_times_loses_nothing(tmp_path, own_broker):
    sc = Scenario(tmp_path, own_broker.address)
    try:
        w = started_with_records(sc, "r")
        # the broker goes away before the window's first trigger and stays away across two
        own_broker.run("stop")
        wait_for(lambda: w.get("/readyz")[0] == 503, 20, "readiness says the worker waits for the broker")
        assert "waiting-for-broker" in w.get("/readyz")[1]
        assert w.get("/healthz")[0] == 200, "waiting is alive, not dead"
        time.sleep(max(0.0, sc.window_start / 1000 + WINDOW_S / 2 + LATENESS_S - time.time()))
        own_broker.run("restart")
        wait_for(lambda: w.get("/readyz")[0] == 200, 60, "the worker is ready again after the broker came back")
        sc.assert_releases_equal_replay()
        assert w.proc.poll() is None, "the worker waited the outage out"
    finally:
        for x in sc.workers:
            x.stop()


def test_an_outage_past_the_broker_timeout_exits_promptly_and_a_restart_resumes(tmp_path, own_broker):
    sc = Scenario(tmp_path, own_broker.address)
    try:
        # 10 s: short against the outage, and longer than a loaded 2-core machine (the suite runs
        # in parallel processes) can keep a healthy worker from hearing its broker
        w = started_with_records(sc, "t", ("--broker-timeout", "10s"))
        own_broker.run("stop")
        gone = time.time()
        w.proc.wait(60)
        # no answer for 10 s, then at most the 5 s stop grace and a timer tick
        assert w.proc.returncode not in (0, None) and w.proc.returncode != -signal.SIGKILL
        assert time.time() - gone < 10 + 5 + 8, "the worker must exit promptly, not linger"
        time.sleep(max(0.0, sc.window_start / 1000 + WINDOW_S / 2 - time.time()))
        own_broker.run("restart")
        sc.ready_worker("t", ("--broker-timeout", "10s"))  # what Kubernetes does
        sc.assert_releases_equal_replay()
    finally:
        for x in sc.workers:
            x.stop()
