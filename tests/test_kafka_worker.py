"""The worker against a real broker (Tansu, started by scripts/broker): releases equal replay's,
two workers, SIGKILL and restart, dead letters, the metrics and health endpoints.

Comparable micro-batches: the tests start the worker, then produce events whose event times lie
in a window that starts a few seconds later, so every event reaches stage 2 before its trigger
fires on the wall clock; replay (watermark clock over the same time-ordered file) drops nothing
as late either. Both then assign every event to trigger floor((t - window_start) / (window / T))
+ 1 and, with the same config and secret, must publish the same releases.
"""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpstream.processor.adapters.kafka_tools import produce, tail
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import load_config
from dpstream.topics.kafka import DEAD_LETTER_TOPIC
from dpstream.topics.partitioner import partition_for_key
from tests.conftest import ROOT, TEST_SECRET, TEST_SECRET_HEX, free_port_block, without_run

WINDOW_S, TRIGGERS, LATENESS_S = 12, 4, 1


def free_port() -> int:
    """A worker's web port: below Linux's ephemeral range, in this test process's band
    (conftest.free_port_block). A port the kernel hands out for binding to port 0 is an
    ephemeral one, which a client's outgoing connection may take before the worker binds it (a
    chaos trial's worker failed so: 'address already in use')."""
    return free_port_block(1)


class Scenario:
    def __init__(self, tmp_path: Path, broker: str, contribution_bound: int = 3, window_s: int = WINDOW_S, triggers: int = TRIGGERS,
                 lateness_s: int = LATENESS_S):
        self.tmp, self.broker = tmp_path, broker
        self.window_s, self.triggers, self.lateness_s = window_s, triggers, lateness_s
        tag = uuid.uuid4().hex[:8]
        self.query, self.input, self.output = f"q{tag}", f"it-events-{tag}", f"it-out-{tag}"
        self.app_id = f"dpstream-it-{tag}"
        self.config = tmp_path / "queries.yaml"
        self.config.write_text(
            f"queries:\n  - name: {self.query}\n    input_topic: {self.input}\n    output_topic: {self.output}\n"
            f"    window: {window_s}s\n    triggers: {triggers}\n    allowed_lateness: {lateness_s}s\n"
            f"    contribution_bound: {contribution_bound}\n    epsilon: 6\n    delta: 1.0e-9\n")
        self.key_file = tmp_path / "noise.key"
        self.key_file.write_text(TEST_SECRET_HEX)
        self.key_file.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
        self.events = tmp_path / "events.jsonl"
        self.window_start = None
        self.workers: list = []

    def worker(self, name: str, index: int = 0, workers: int = 1, extra: tuple = ()) -> "Worker":
        return Worker(self, self.tmp / f"state-{name}", index, workers, extra)

    def ready_worker(self, name: str, extra: tuple = ()) -> "Worker":
        """A worker started (stopped at the test's end) and ready."""
        w = self.worker(name, extra=extra).start()
        self.workers.append(w)
        return w.wait_ready()

    def assert_releases_equal_replay(self) -> None:
        """After the window: no two different releases for one trigger, and exactly replay's."""
        self.wait_for_window_end()
        self.assert_published_equal(self.replay())

    def published(self, expected: list[dict], timeout: float = 30) -> list[dict]:
        """The output topic once it holds every release of ``expected`` (or after ``timeout``):
        a worker on a loaded machine may publish a trigger's releases a while after counting it
        fired. Extra or different releases are returned as they are, for the caller to refuse."""
        deadline = time.time() + timeout
        while True:
            released = self.read(self.output)
            if canonical(released) >= canonical(expected) or time.time() > deadline:
                return released
            time.sleep(1)

    def drops(self) -> str:
        """The running workers' dropped events by reason, for a failed comparison: events late
        at the worker (sent after their trigger fired) are counted by replay, which reads a file."""
        counts = {}
        for w in self.workers:
            if w.proc and w.proc.poll() is None:
                try:
                    counts[w.state_dir.name] = {dict(ls).get("reason"): v for (n, ls), v in w.metrics().items()
                                                if n == "dpstream_events_dropped_total" and v}
                except OSError:
                    counts[w.state_dir.name] = "no answer"
        return f"events dropped by the running workers, by reason: {counts}"

    def assert_published_equal(self, expected: list[dict], exactly_once: bool = True) -> list[dict]:
        """No two different releases for one trigger on the output (nor two copies of one, with
        ``exactly_once``), and exactly ``expected``."""
        released = self.published(expected)
        assert_no_conflicting_releases(released, exactly_once)
        assert expected and canonical(released) == canonical(expected), self.drops()
        # each release says which run made it: this application, under the label replay reproduced
        assert runs(released) == {(self.app_id, label) for _, label in runs(expected)}
        return released

    def take_in(self, w: "Worker", n: int, timeout: float = 60) -> float:
        """Until ``w`` has taken in ``n`` events (or the timeout); returns how many it has."""
        deadline = time.time() + timeout
        while time.time() < deadline and w.metric("dpstream_events_in_total", query=self.query) < n:
            time.sleep(0.2)
        return w.metric("dpstream_events_in_total", query=self.query)

    def write_events(self, n: int, users: int, keys: int, lead_s: float, seed: int = 11, span_ms: int | None = None) -> None:
        """n events of a skewed key law, time-ordered over the window starting >= lead_s from now
        (over its first ``span_ms`` only, if given)."""
        window_ms = self.window_s * 1000
        soon = int(time.time() * 1000) + int(lead_s * 1000)
        self.window_start = soon - soon % window_ms + window_ms
        rng = np.random.default_rng(seed)
        user = rng.integers(0, users, n)
        key = np.minimum(rng.zipf(1.6, n), keys)
        ts = self.window_start + np.sort(rng.integers(0, window_ms if span_ms is None else span_ms, n))
        with open(self.events, "w") as fh:
            for u, k, t in zip(user.tolist(), key.tolist(), ts.tolist()):
                fh.write(f'{{"user_id":"u{u}","key":"k{k}","ts":{t}}}\n')

    def produce_events(self) -> int:
        with open(self.events, "rb") as fh:
            return produce(self.broker, self.input, (line.rstrip(b"\n") for line in fh))

    def wait_for_window_end(self, timeout: float = 240) -> None:
        """Until the window's last trigger could fire, then until the running workers have fired
        every trigger on each of the 4 repartition partitions (triggers fire once the input
        watermark passes them: the watermark delay after the fire time, or later when behind;
        ``timeout`` is generous, for a worker beside CI's other test processes on 2 cores)."""
        end = self.window_start / 1000 + self.window_s + self.lateness_s
        time.sleep(max(0.0, end - time.time()))
        deadline = time.time() + timeout
        while time.time() < deadline:
            live = [w for w in self.workers if w.proc.poll() is None]
            try:
                fired = sum(w.metric("dpstream_triggers_fired_total", query=self.query) for w in live)
            except OSError:  # a worker busy firing overdue triggers may answer a scrape late: ask again
                fired = 0
            if live and fired >= self.triggers * 4:
                time.sleep(0.5)  # fired triggers are published in the same timer call
                return
            time.sleep(0.2)
        raise AssertionError(f"the window's triggers did not all fire within {timeout} s of its end")

    def read(self, topic: str) -> list[dict]:
        out = io.StringIO()
        tail(self.broker, topic, out, idle_seconds=3)
        return [json.loads(line) for line in out.getvalue().splitlines()]

    def noise_label(self) -> str:
        """The workers' noise label as their status pages show it (one for every worker of the
        application), or, none running, as the releases on the output say."""
        labels = set()
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(OSError, KeyError, ValueError):
                    labels.add(json.loads(w.get("/status.json")[1])["noise_label"])
        if not labels:
            labels = {label for app, label in runs(self.read(self.output)) if app == self.app_id}
        assert len(labels) == 1, f"the workers of a run share one noise label, not {labels}"
        return labels.pop()

    def replay(self, label: str | None = None, until_ms: int | None = None) -> list[dict]:
        """Replay of the events under the workers' noise label (or ``label``), to the public end
        ``until_ms`` if given."""
        config = load_config(self.config)
        runner = ReplayRunner(config, TEST_SECRET, None, noise_label=label or self.noise_label())
        out = io.StringIO()
        try:
            runner.run(str(self.events), out, until_ms=until_ms)
        finally:
            runner.close()
        return [json.loads(line) for line in out.getvalue().splitlines()]


class Worker:
    def __init__(self, sc: Scenario, state_dir: Path, index: int, workers: int, extra: tuple = ()):
        self.sc, self.state_dir, self.index, self.workers = sc, state_dir, index, workers
        self.port = free_port()
        self.proc = None
        self.log = sc.tmp / f"{state_dir.name}.log"
        self.extra = list(extra)

    def start(self) -> "Worker":
        env = {**os.environ, "DPSTREAM_NOISE_KEY_FILE": str(self.sc.key_file)}
        cmd = [sys.executable, "-m", "dpstream.processor.cli", "worker", "--config", str(self.sc.config), "--broker", self.sc.broker,
               "--state-dir", str(self.state_dir), "--worker-index", str(self.index), "--workers", str(self.workers),
               "--partitions", "4", "--web-port", str(self.port), "--web-host", "127.0.0.1", "--app-id", self.sc.app_id,
               "--log-level", "warn", *self.extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        return self

    def get(self, path: str) -> tuple[int, str]:
        try:
            # 30 s: a worker's first trigger builds its noise samplers on the event loop (several
            # seconds, more on a loaded machine): the page answers after it, which is not what
            # these tests are about
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout: float = 120) -> "Worker":
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"worker exited: {self.log.read_text()[-3000:]}"
            try:
                if self.get("/readyz")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"worker not ready after {timeout} s: {self.log.read_text()[-3000:]}")

    def metrics(self) -> dict:
        samples = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1]):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def metric(self, name: str, **labels) -> float:
        return sum(v for (n, ls), v in self.metrics().items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def write_dynamic_config(sc: Scenario, **fields) -> None:
    """The scenario's config: one dynamic query of these fields (YAML values as written)."""
    sc.config.write_text("dynamic:\n  -" + "".join(f" {k}: {v}\n   " for k, v in fields.items()).rstrip() + "\n")


def canonical(records: list[dict]) -> set[str]:
    """Releases as the mechanism made them: without the fields about the run that made them, in
    which a worker's and a replay's differ (compared by :func:`runs`)."""
    return {json.dumps(without_run(r), sort_keys=True) for r in records}


def runs(records: list[dict]) -> set[tuple]:
    """The (application, noise label) of each run that made ``records`` (a replay has no application)."""
    return {(r.get("app_id"), r["run"]["noise_label"]) for r in records}


def assert_no_conflicting_releases(records: list[dict], exactly_once: bool = True) -> None:
    """No two different releases for one (window, key, trigger); with exactly-once delivery (the
    worker's default) not even two copies of one: a read_committed reader sees each once, across
    crashes (docs/operations.md, "Delivery")."""
    seen = {}
    for r in records:
        key = (r["query"], r["window_start"], json.dumps(r["key"]), r["trigger"])
        assert seen.setdefault(key, r) == r, f"two different releases for {key}"
    if exactly_once:
        assert len(seen) == len(records), f"{len(records) - len(seen)} releases delivered twice"


@contextlib.contextmanager
def running(tmp_path, broker, **options):
    """A scenario whose workers are stopped at the end."""
    sc = Scenario(tmp_path, broker, **options)
    try:
        yield sc
    finally:
        for w in sc.workers:
            w.stop()


@pytest.fixture
def scenario(tmp_path, broker):
    with running(tmp_path, broker) as sc:
        yield sc


def test_worker_releases_equal_replay_dead_letters_and_metrics(scenario):
    sc = scenario
    from confluent_kafka import Producer

    from dpstream.topics.kafka import INPUT_TOPIC_CONFIG, TopicSpec, create_topics

    # an input topic that takes 8 MB records, beside a dead-letter topic at Kafka's 1 MB default
    create_topics(sc.broker, [TopicSpec(sc.input, 4, {**INPUT_TOPIC_CONFIG, "max.message.bytes": str(8 * 1024 * 1024)})])
    w = sc.worker("one").start()
    sc.workers.append(w)
    w.wait_ready()
    assert w.get("/healthz")[0] == 200
    sc.write_events(20_000, users=2_000, keys=60, lead_s=4)
    # a poison pill first: a 3 MB record, too large to dead-letter whole (issue 15)
    pill = f'{{"user_id":"u7","key":"{"x" * 3_000_000}","ts":{sc.window_start}}}'.encode()
    p = Producer({"bootstrap.servers": sc.broker, "message.max.bytes": 8 * 1024 * 1024})
    p.produce(sc.input, pill, b"u7", partition=partition_for_key(b"u7", 4))
    assert p.flush(30) == 0
    assert sc.produce_events() == 20_000
    # two bad records: not JSON, no key field (a valid event under any message key, on any
    # partition, is counted: tests/test_any_producer.py)
    bad = [b"{not json", f'{{"user_id":"u1","ts":{sc.window_start}}}'.encode()]
    p.produce(sc.input, bad[0])
    p.produce(sc.input, bad[1], b"u1")
    assert p.flush(30) == 0
    sc.wait_for_window_end()

    expected = sc.replay()
    assert len(expected) > 20
    sc.assert_published_equal(expected)

    letters = [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == sc.query]
    import base64
    import hashlib

    pills = [d for d in letters if d.get("truncated")]
    assert len(pills) == 1, "the poison pill is dead-lettered once, cut, and the worker went on"
    assert pills[0]["original_bytes"] == len(pill) and pills[0]["original_sha256"] == hashlib.sha256(pill).hexdigest()
    assert base64.b64decode(pills[0]["original_b64"]) == pill[:256 * 1024]
    assert pills[0]["source"] == f"{sc.input}/{partition_for_key(b'u7', 4)}@0"
    letters = [d for d in letters if not d.get("truncated")]
    assert sorted(base64.b64decode(d["original_b64"]) for d in letters) == sorted(bad)
    assert all(d["reason"] and d["source"].startswith(sc.input) for d in letters)

    m = w.metrics()
    names = {n for n, _ in m}
    for name in ("dpstream_events_in_total", "dpstream_events_dropped_total", "dpstream_keys_tracked", "dpstream_keys_released",
                 "dpstream_releases_total", "dpstream_trigger_duration_seconds_bucket", "dpstream_trigger_duration_seconds_count",
                 "dpstream_state_size_bytes", "dpstream_budget_epsilon_spent", "dpstream_consumer_lag_records",
                 "dpstream_triggers_fired_total", "dpstream_ready", "dpstream_last_trigger_timestamp_seconds"):
        assert name in names, name
    # no budget section: no ledger, so no remaining budget to report (never a 0 that reads "exhausted")
    assert "dpstream_budget_epsilon_remaining" not in names and "dpstream_ledger_epsilon_remaining" not in names
    assert w.metric("dpstream_events_in_total", query=sc.query) == 20_003
    assert w.metric("dpstream_events_dropped_total", query=sc.query, reason="malformed") == 3
    assert w.metric("dpstream_releases_total", query=sc.query) == len(expected)
    assert w.metric("dpstream_trigger_duration_seconds_count", query=sc.query) == w.metric("dpstream_triggers_fired_total", query=sc.query) > 0
    assert w.metric("dpstream_events_dropped_total", query=sc.query, reason="contribution_bound") > 0


def test_two_workers_split_the_partitions_and_release_the_same(scenario):
    sc = scenario
    a, b = sc.worker("a", 0, 2).start(), sc.worker("b", 1, 2).start()
    sc.workers += [a, b]
    a.wait_ready()
    b.wait_ready()
    sc.write_events(20_000, users=2_000, keys=60, lead_s=4)
    sc.produce_events()
    sc.wait_for_window_end()
    sc.assert_published_equal(sc.replay())
    # both did part of the work, and together all of it
    ins = [w.metric("dpstream_events_in_total", query=sc.query) for w in (a, b)]
    assert min(ins) > 0 and sum(ins) == 20_000
    assert min(w.metric("dpstream_releases_total", query=sc.query) for w in (a, b)) > 0


@pytest.mark.parametrize("assignment", ["static", "group"])
def test_a_backlog_many_times_the_fetch_limit_is_read_through_both_stages_and_released_as_replay(scenario, assignment):
    """``--fetch-records 300`` against 20,000 events already in the topic: stage 1 holds a full
    batch most of the time (its partitions are then paused, the other stages' fetched on), and
    the worker must go on reading it: an elastic worker once stopped at its first full batch,
    never dispatching it."""
    from dpstream.topics.kafka import INPUT_TOPIC_CONFIG, TopicSpec, create_topics

    sc = scenario
    create_topics(sc.broker, [TopicSpec(sc.input, 4, INPUT_TOPIC_CONFIG)])  # as the worker creates it
    sc.write_events(20_000, users=2_000, keys=60, lead_s=6)
    sc.produce_events()  # the backlog is there before the worker starts
    how = ("--assignment", "group", "--instance-id", "a") if assignment == "group" else ()
    w = sc.worker("a", extra=how + ("--fetch-records", "300")).start()
    sc.workers.append(w)
    w.wait_ready()
    assert sc.take_in(w, 20_000) == 20_000, "the worker stopped reading its backlog"
    sc.wait_for_window_end()
    sc.assert_published_equal(sc.replay())
    assert w.metric("dpstream_records_accumulated_total", query=sc.query) > 0


@pytest.mark.parametrize("delivery", ["exactly-once", "at-least-once"])
def test_sigkill_mid_stream_and_restart_changes_nothing(scenario, delivery):
    sc = scenario
    w = sc.worker("k", extra=("--delivery", delivery)).start()
    sc.workers.append(w)
    w.wait_ready()
    sc.write_events(300_000, users=20_000, keys=200, lead_s=35)
    producing = threading.Thread(target=sc.produce_events)  # the worker reads as fast as the producer sends
    producing.start()
    # kill as soon as the worker has taken in part of the stream
    deadline = time.time() + 60
    while time.time() < deadline and not 0 < w.metric("dpstream_events_in_total", query=sc.query) < 300_000:
        time.sleep(0.02)
    taken = w.metric("dpstream_events_in_total", query=sc.query)
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait()
    producing.join()
    assert 0 < taken < 300_000, "the kill must land mid-stream"
    assert time.time() < sc.window_start / 1000, "restart must happen before the window's first trigger"
    w2 = sc.worker("k", extra=("--delivery", delivery)).start()  # same state directory
    sc.workers.append(w2)
    w2.wait_ready()
    sc.wait_for_window_end()
    # same releases as an uninterrupted run: same counts (so no user counted past C) and same noise
    sc.assert_published_equal(sc.replay(), exactly_once=delivery == "exactly-once")


@pytest.mark.parametrize("assignment", ["static", "group"])
def test_dynamic_agent_publishes_what_replay_publishes_and_takes_in_absent_deletes(tmp_path, broker, assignment):
    """The worker decides dynamic ticks on its wall clock (docs/privacy.md, "Time"): the releases it
    has published for ticks up to H equal replay's with the public end --until at tick H, and a
    delete of an absent item is taken in like any update, neither dead-lettered nor counted as
    malformed (docs/privacy.md, "Dynamic counts"). With --assignment group the update topic's
    partition is the group's to assign, and its store is changelogged."""
    tag = uuid.uuid4().hex[:8]
    sc = Scenario(tmp_path, broker)
    name, topic, out = f"dyn{tag}", f"it-updates-{tag}", f"it-counts-{tag}"
    tick_ms, lateness_ms = 20, 1000
    # tick 1 begins 40 s from now: the worker starts and becomes ready, and the updates are sent,
    # before then (8 s on an idle 2-core machine; more than 15 s beside CI's five other test
    # processes and their brokers)
    start = (int(time.time() * 1000) // 1000 + 40) * 1000
    write_dynamic_config(sc, name=name, input_topic=topic, output_topic=out, items="[a, b, c]", start=start,
                         tick=f"{tick_ms}ms", allowed_lateness=f"{lateness_ms}ms", epsilon=2.0)
    rng = np.random.default_rng(5)
    live, lines = [], [f'{{"item":"b","op":"delete","ts":{start}}}'.encode()]  # nothing present yet: taken in
    for i in range(3_000):  # 3 s of updates: ticks 1..150
        if live and rng.random() < 0.4:
            item = live.pop(int(rng.integers(len(live))))
            lines.append(f'{{"item":"{item}","op":"delete","ts":{start + i}}}'.encode())
        else:
            item = "abc"[int(rng.integers(3))]
            live.append(item)
            lines.append(f'{{"item":"{item}","op":"insert","ts":{start + i + 1}}}'.encode())
    sc.events.write_bytes(b"\n".join(lines) + b"\n")
    horizon = 200  # compare ticks 1..H (the worker keeps deciding empty ticks as time passes)
    w = sc.worker("dyn", extra=("--assignment", "group", "--instance-id", "dyn") if assignment == "group" else ()).start()
    try:
        w.wait_ready()
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": broker, "linger.ms": 5})
        for line in lines:
            p.produce(topic, line)
        assert p.flush(30) == 0
        # tick 1 is decided once the clock passes its end and the allowed lateness
        assert time.time() * 1000 < start + tick_ms + lateness_ms, "the updates must reach the worker before their ticks are decided"
        time.sleep(max(0.0, (start + horizon * tick_ms + lateness_ms) / 1000 + 3 - time.time()))
        released = [r for r in sc.read(out) if r["tick"] <= horizon]
        [(app, label)] = runs(released)  # the worker's noise label, as its releases say
        assert app == sc.app_id
        expected = sc.replay(label, until_ms=start + horizon * tick_ms + lateness_ms)
        assert len(expected) >= 5
        assert canonical(released) == canonical(expected)
        letters = [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == name]
        assert letters == []
        assert w.metric("dpstream_events_dropped_total", query=name, reason="malformed") == 0
    finally:
        w.stop()


def test_a_lost_volume_is_refused_until_a_new_epoch_is_configured(scenario):
    """The worker records its budget epoch and noise fingerprint outside its volume (the
    compacted epochs topic); started again on an empty state directory under the same epoch it
    refuses, naming the epoch, and keeps refusing; a new budget.epoch starts afresh."""
    import shutil

    sc = scenario
    w = sc.worker("vol").start()
    sc.workers.append(w)
    w.wait_ready()
    w.stop()
    assert (w.state_dir / "worker-layout.json").exists()
    shutil.rmtree(w.state_dir)  # the volume is lost
    for attempt in range(2):  # a refusal writes nothing, so a restart refuses again
        w.start()
        assert w.proc.wait(90) != 0
        log = w.log.read_text()
        assert "LostStateError" in log and "state was lost" in log and "budget.epoch" in log and "dpstream reset" in log
        assert not (w.state_dir / "worker-layout.json").exists()
        w.log.write_text("")
    sc.config.write_text(sc.config.read_text() + "budget:\n  epoch: after-volume-loss\n  default: {max_epsilon: 100, max_delta: 1.0e-6}\n")
    w.start().wait_ready()  # explicitly a new epoch: starts on the empty directory
    w.stop()


def test_two_workers_publish_a_consistent_hierarchy_exactly_as_replay(scenario):
    """A hierarchical query on the broker: stage 2 is partitioned by the level-1 key, each worker
    makes its subtrees consistent, and the releases (raw and consistent fields, re-issued keys
    included) equal replay's."""
    sc = scenario
    sc.config.write_text(sc.config.read_text().replace("    window:", "    key_fields: [country, state, city]\n    hierarchy: true\n    window:"))
    a, b = sc.worker("ha", 0, 2).start(), sc.worker("hb", 1, 2).start()
    sc.workers += [a, b]
    a.wait_ready()
    b.wait_ready()
    sc.write_events(20_000, users=2_000, keys=60, lead_s=4)
    lines = []
    for line in sc.events.read_text().splitlines():  # key k<n> -> a three-level place
        e = json.loads(line)
        n = int(e.pop("key")[1:])
        e.update(country=f"c{n % 8}", state=f"c{n % 8}s{n % 3}", city=f"c{n % 8}s{n % 3}t{n}")
        lines.append(json.dumps(e))
    sc.events.write_text("\n".join(lines) + "\n")
    sc.produce_events()
    sc.wait_for_window_end()
    expected = sc.replay()
    assert {r["level"] for r in expected} == {1, 2, 3} and all("consistent_count" in r for r in expected)
    sc.assert_published_equal(expected)
    assert min(w.metric("dpstream_releases_total", query=sc.query) for w in (a, b)) > 0


def test_a_worker_down_across_trigger_times_reads_its_backlog_before_it_fires(scenario):
    """Issue 15's lost release: the worker is killed, its input is produced (on time by its Kafka
    timestamps) while it is down, and it comes back only after every trigger's fire time. It must
    read the backlog first, then fire: nothing late, releases equal replay's."""
    sc = scenario
    w = sc.worker("down").start()
    sc.workers.append(w)
    w.wait_ready()
    time.sleep(1.5)  # it announces its (idle) partitions' watermarks, then dies
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait()
    sc.write_events(30_000, users=3_000, keys=100, lead_s=2)
    sc.produce_events()
    time.sleep(max(0.0, sc.window_start / 1000 + WINDOW_S + LATENESS_S + 2 - time.time()))  # every trigger overdue
    w2 = sc.worker("down").start()
    sc.workers.append(w2)
    w2.wait_ready()
    sc.wait_for_window_end()
    assert w2.metric("dpstream_events_dropped_total", query=sc.query, reason="late") == 0
    sc.assert_published_equal(sc.replay())


def test_a_recreated_input_topic_is_refused_with_its_name_not_silently_miscounted(scenario):
    """Issue 15: 30,002 records on a recreated topic, of which the worker counted 155 (those past its
    old offsets), with no metric, no log line and /readyz answering. Now it is refused."""
    from confluent_kafka.admin import AdminClient

    from dpstream.topics.kafka import INPUT_TOPIC_CONFIG, TopicSpec, create_topics

    sc = scenario
    w = sc.ready_worker("re")
    sc.write_events(5_000, users=500, keys=20, lead_s=30)
    sc.produce_events()
    assert sc.take_in(w, 5_000) == 5_000
    w.stop()
    admin = AdminClient({"bootstrap.servers": sc.broker})
    admin.delete_topics([sc.input])[sc.input].result(30)
    # deletion is asynchronous: create_topics leaves alone a topic the broker still lists, and
    # the producer would then write to a topic the broker creates on its own (CreateTime), which
    # the worker refuses for that reason before it looks at the log
    deadline = time.time() + 30
    while sc.input in admin.list_topics(timeout=10).topics:
        assert time.time() < deadline, f"{sc.input} still listed 30 s after its deletion"
        time.sleep(0.5)
    while True:
        try:
            create_topics(sc.broker, [TopicSpec(sc.input, 4, INPUT_TOPIC_CONFIG)])
            break
        except Exception:  # noqa: BLE001 - still marked for deletion
            assert time.time() < deadline, f"{sc.input} could not be created again within 30 s of its deletion"
            time.sleep(0.5)
    sc.produce_events()  # new records at offsets from 0
    w2 = sc.worker("re").start()
    sc.workers.append(w2)
    assert w2.proc.wait(90) != 0
    log = w2.log.read_text()
    assert "InputWentBackError" in log and f"{sc.input}-" in log and "the topic was recreated" in log
    assert "When the input goes back" in log


def test_live_production_through_a_window_releases_what_replay_does(tmp_path, broker):
    """Issue 15, item 4: produced live (each event dated and Kafka-timestamped as it is sent) at
    10,000 events/s across a whole window: the worker keeps up (nothing late, with 15 s allowed)
    and releases what replay releases from the same events. The highest steady live rate is
    ``bench kafka --live``'s to measure (90,510/s on the 2-core machine, alone); beside five
    other test processes on 2 cores, 20,000/s fell 5 s behind in CI, so the test runs at half,
    and on a slower CI machine 10,000/s fell more than 5 s behind (about 10,400 events late, in
    two runs), so it allows 15 s: what it checks is that a worker under load loses nothing it
    should count, not how far behind a starved one falls."""
    from dpstream.processor.bench.kafka import produce_live_lines

    with running(tmp_path, broker, lateness_s=15) as sc:
        w = sc.worker("live").start()
        sc.workers.append(w)
        w.wait_ready()
        window_ms = sc.window_s * 1000
        now = int(time.time() * 1000)
        sc.window_start = now - now % window_ms + window_ms
        time.sleep(max(0.0, sc.window_start / 1000 - time.time()))
        lines = produce_live_lines(sc.broker, sc.input, rate=10_000, seconds=sc.window_s - 0.5, users=3_000, keys=100, seed=3)
        with open(sc.events, "wb") as fh:
            fh.write(b"\n".join(lines) + b"\n")
        sc.wait_for_window_end()
        assert w.metric("dpstream_events_dropped_total", query=sc.query, reason="late") == 0
        sc.assert_published_equal(sc.replay())


def test_input_from_a_transactional_producer_is_read_to_its_end_and_fired(scenario):
    """An upstream exactly-once pipeline writes the input in transactions: each ends with a commit
    marker, an offset no record holds. A partition whose last offset is such a marker has still
    been read to its end; the triggers must fire, with replay's releases."""
    from confluent_kafka import Producer

    sc = scenario
    w = sc.ready_worker("tx")
    sc.write_events(6_000, users=600, keys=30, lead_s=4)
    from dpstream.processor.adapters.kafka_tools import PRODUCER_DEFAULTS

    producer = Producer({"bootstrap.servers": sc.broker, **PRODUCER_DEFAULTS, "transactional.id": f"upstream-{sc.app_id}"})
    producer.init_transactions(30)
    lines = sc.events.read_bytes().splitlines()
    for start in range(0, len(lines), 2_000):
        producer.begin_transaction()
        for line in lines[start:start + 2_000]:
            producer.produce(sc.input, line, json.loads(line)["user_id"].encode())
        producer.commit_transaction(30)
    assert sc.take_in(w, 6_000) == 6_000
    sc.assert_releases_equal_replay()


def test_an_input_topic_stamped_by_its_producers_is_refused_unless_allowed(scenario):
    """With CreateTime, whether a record delivered late is counted would depend on how far behind
    the worker was, which other users' records influence (docs/privacy.md, "Time"): refused at
    start, naming the topic and both ways out."""
    from dpstream.topics.kafka import TopicSpec, create_topics

    sc = scenario
    create_topics(sc.broker, [TopicSpec(sc.input, 4)])  # Kafka's default: CreateTime
    w = sc.worker("ct").start()
    sc.workers.append(w)
    assert w.proc.wait(90) != 0
    log = w.log.read_text()
    assert f"input topic {sc.input} has message.timestamp.type=CreateTime" in log
    assert "message.timestamp.type=LogAppendTime" in log and "--allow-create-time" in log
    allowed = sc.ready_worker("ct-allowed", ("--allow-create-time",))
    assert allowed.proc.poll() is None


def test_produce_creates_a_missing_input_topic_as_the_worker_would(broker, tmp_path):
    """The README starts the worker and produces at once: if the producer came first, the broker
    would auto-create the topic with CreateTime, which the worker refuses."""
    from dpstream.topics.kafka import timestamp_types

    topic = f"it-produced-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "produce", "--broker", broker, "--topic", topic,
                           "--synthetic-users", "50", "--synthetic-keys", "5", "--span-ms", "60000", "--partitions", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert timestamp_types(broker, [topic]) == {topic: "LogAppendTime"}
