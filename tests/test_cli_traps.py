"""The newcomer's command-line traps around produce, tail and the worker's start (issue 16, item 4;
docs/operations.md, "Trying it with a file"), each checked as a user meets it: the CLI run as a
subprocess, its exit code and what it prints.

* no broker: ``produce`` and ``tail`` give up after their timeout with one line, no traceback and
  none of librdkafka's reconnect lines; so does the worker (``dpstream worker: refused: ...``
  as its last line, exit 2);
* a missing input file, a missing topic: one line;
* the worker's refusals are the last thing it prints, with Faust's INFO logs and stack dumps gone;
* old events: ``produce`` says how many the worker will drop, ``--rebase-time`` dates the file
  from now and the worker then counts every event; the worker logs its late drops once with counts;
* the example configs come with matching sample events, made by a documented script, from which
  each example query releases keys.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import TEST_SECRET_HEX, free_port_block

from dpstream.processor.adapters.faust_app import DROP_REPORT_S
from dpstream.processor.adapters.kafka_tools import TimeReport, earliest_time, rebased
from dpstream.processor.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DPSTREAM = [sys.executable, "-m", "dpstream.processor.cli"]
EVENTS = ROOT / "examples" / "events.jsonl"


def run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSTREAM_")}
    return subprocess.run([*DPSTREAM, *args], cwd=kw.pop("cwd", ROOT), env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def free_port() -> int:
    """Below the ephemeral range (tests/test_kafka_worker.py, free_port)."""
    return free_port_block(1)


def one_clear_line(proc: subprocess.CompletedProcess) -> str:
    """stderr is exactly one line, with no traceback and no librdkafka log line."""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "%3|" not in proc.stderr and "rdkafka" not in proc.stderr
    return lines[0]


# ---------------------------------------------------------------- no broker, no file, no topic


def test_produce_without_a_broker_gives_up_after_its_timeout_in_one_line():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    proc = run("produce", "--broker", f"127.0.0.1:{port}", "--synthetic-users", "10", "--timeout", "2")
    took = time.monotonic() - started
    assert proc.returncode == 1
    line = one_clear_line(proc)
    assert line.startswith(f"dpstream produce: no Kafka broker answered at 127.0.0.1:{port} within 2 s")
    assert "Connection refused" in line  # librdkafka's reason, said once
    assert took < 30


def test_tail_without_a_broker_or_topic_and_produce_without_its_file_say_so_in_one_line(tmp_path):
    port = free_port()
    proc = run("tail", "--broker", f"127.0.0.1:{port}", "--timeout", "2")
    assert proc.returncode == 1
    assert one_clear_line(proc).startswith(f"dpstream tail: no Kafka broker answered at 127.0.0.1:{port}")
    proc = run("produce", "--broker", f"127.0.0.1:{port}", "--input", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2  # before any broker is asked
    assert one_clear_line(proc) == f"dpstream produce --input: no such file: {tmp_path / 'missing.jsonl'}"


def test_tail_help_has_the_quick_starts_options():
    proc = run("tail", "--help")
    assert "--max-messages N" in proc.stdout and "--timeout SECONDS" in proc.stdout
    proc = run("produce", "--help")
    assert "--rebase-time" in proc.stdout and "--timeout" in proc.stdout


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "noise.key"
    path.write_text(TEST_SECRET_HEX + "\n")
    path.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    return path


def worker_args(tmp_path: Path, config: Path, broker: str, port: int, *extra: str) -> list[str]:
    return ["worker", "--config", str(config), "--broker", broker, "--state-dir", str(tmp_path / "state"), "--noise-key-file",
            str(secret_file(tmp_path)), "--web-port", str(port), "--web-host", "127.0.0.1", *extra]


def assert_refused_last(proc: subprocess.CompletedProcess, reason: str) -> None:
    """The worker's refusal is its last line on stderr, marked, exit code 2, with no stack dump
    and none of Faust's INFO lines ('[^Worker]: Stopping...') after it or anywhere."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[-1].startswith("dpstream worker: refused: ") and reason in lines[-1], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "[INFO] [^" not in proc.stderr and "Stopping..." not in proc.stderr


def test_worker_without_a_broker_refuses_in_its_last_line(tmp_path):
    port = free_port()
    proc = run(*worker_args(tmp_path, ROOT / "examples" / "worker.yaml", f"127.0.0.1:{port}", free_port(), "--broker-timeout", "2s"))
    assert_refused_last(proc, f"no Kafka broker answered at 127.0.0.1:{port} within 2 s (--broker-timeout)")


def test_worker_whose_web_port_is_taken_refuses_in_its_last_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(*worker_args(tmp_path, ROOT / "examples" / "worker.yaml", "127.0.0.1:1", port))
    assert_refused_last(proc, f"--web-port {port}: cannot listen on 127.0.0.1:{port}")


# ---------------------------------------------------------------- events' own times (no broker)


def old_events(path: Path, n: int, start_ms: int, step_ms: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"user_id": f"u{i % 50}", "key": f"k{i % 3}", "ts": start_ms + i * step_ms}) + "\n")
        fh.write('{"user_id": "u1", "key": "k1"}\n')  # no time: dead-lettered as malformed
    return path


def test_the_time_report_counts_what_the_worker_will_drop_exactly():
    q = load_config(ROOT / "examples" / "queries.yaml").queries[0]  # url_clicks: 1d window, 100 triggers, lateness 1m
    now = 1_767_225_600_000 + 86_400_000 // 2  # noon: trigger 50 of the day ends now
    interval = 86_400_000 // 100
    report = TimeReport("ts", [q])
    cases = {  # event time -> late?
        now - interval - 60_001: True,  # its trigger ended before the lateness began
        now - 2 * 60_000: False,  # trigger 50 ends at noon, fires at 12:01
        now - 1: False,
        now + 3_600_000: False,  # at max_skew: on time
        now + 3_600_001: "future",
    }
    for ts in cases:
        report.observe({"ts": ts}, now)
    report.observe({"ts": "yesterday"}, now)
    assert report.late[q.name] == 1 and report.future[q.name] == 1 and report.undated == 1
    line = report.summary()
    assert f"query {q.name} drops 1 as late" in line and "1 as future" in line and "1 have no integer 'ts'" in line
    quiet = TimeReport("ts", [q])
    quiet.observe({"ts": now}, now)
    assert quiet.summary() is None  # nothing to say: no line


def test_rebase_moves_every_time_by_one_amount_and_keeps_other_lines(tmp_path):
    path = old_events(tmp_path / "e.jsonl", 5, 1_000_000, 7)
    lines = path.read_bytes().splitlines()
    assert earliest_time(lines, "ts") == 1_000_000
    out = list(rebased(lines, "ts", 500))
    assert [json.loads(x)["ts"] for x in out[:5]] == [1_000_500 + 7 * i for i in range(5)]
    assert out[5] == lines[5]  # no time: sent as it is
    assert {k: v for k, v in json.loads(out[0]).items() if k != "ts"} == {"user_id": "u0", "key": "k0"}


# ---------------------------------------------------------------- the example configs' sample events


def test_the_sample_events_are_the_documented_scripts_output(tmp_path):
    out = tmp_path / "events.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_example_events.py"), "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == EVENTS.read_bytes()
    assert EVENTS.stat().st_size < 1_000_000


@pytest.mark.parametrize("config", ["worker.yaml", "queries.yaml"])
def test_each_example_config_releases_keys_from_the_sample_events(tmp_path, config):
    path = ROOT / "examples" / config
    # a public start and end around the sample (2026-01-01, ten minutes): a config with a budget
    # section needs both (REPLAY_HELP); by 01:02 every example query has fired a trigger holding it
    proc = run("replay", "--config", str(path), "--input", str(EVENTS), "--output", str(tmp_path / "out.jsonl"),
               "--noise-key-file", str(secret_file(tmp_path)), "--start", "2026-01-01T00:00:00Z", "--until", "2026-01-01T01:02:00Z",
               timeout=600)
    assert proc.returncode == 0, proc.stderr
    releases = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    released = {}
    for r in releases:
        released.setdefault(r["query"], set()).add(r.get("key") if not isinstance(r.get("key"), list) else tuple(r["key"]))
    for q in load_config(path).queries:
        assert len(released.get(q.name, ())) >= 3, (q.name, proc.stderr)


# ---------------------------------------------------------------- with a broker


def unique_config(tmp_path: Path, example: str = "worker.yaml") -> tuple[Path, str, str]:
    """The example worker config on its own topics and query name (repartition topics are named
    by the query): (config path, input topic, query name)."""
    tag = uuid.uuid4().hex[:8]
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc.pop("budget", None)
    q = doc["queries"][0]
    q.update(name=f"clicks_{tag}", input_topic=f"events-{tag}", output_topic=f"out-{tag}")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, q["input_topic"], q["name"]


def test_produce_says_how_many_old_events_the_worker_drops_and_rebase_time_keeps_them(broker, tmp_path):
    config, topic, name = unique_config(tmp_path)
    day_ago = int(time.time() * 1000) - 86_400_000
    path = old_events(tmp_path / "old.jsonl", 300, day_ago, 1000)
    proc = run("produce", "--broker", broker, "--topic", topic, "--input", str(path), "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"produce: 301 records to {topic}")
    assert f"query {name} drops 300 as late" in lines[1] and "--rebase-time" in lines[1] and "1 have no integer 'ts'" in lines[1]
    proc = run("produce", "--broker", broker, "--topic", topic, "--input", str(path), "--rebase-time")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "the earliest event is dated now" in lines[0]
    assert len(lines) == 2 and "0 of 301 events are dated more than 1 min before" in lines[1]  # only the undated line is left


def metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


def test_the_worker_counts_a_rebased_file_and_logs_its_late_drops_once_with_counts(broker, tmp_path):
    config, topic, name = unique_config(tmp_path)
    port = free_port()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([*DPSTREAM, *worker_args(tmp_path, config, broker, port, "--app-id", f"traps-{name}")],
                                  cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 90
        while "ready:" not in log.read_text() and time.time() < deadline:
            assert worker.poll() is None, log.read_text()
            time.sleep(0.5)
        old = old_events(tmp_path / "old.jsonl", 400, int(time.time() * 1000) - 86_400_000, 1000)
        assert run("produce", "--broker", broker, "--topic", topic, "--input", str(old)).returncode == 0
        deadline = time.time() + 60
        while "dropped as late" not in log.read_text() and time.time() < deadline:
            time.sleep(0.5)
        time.sleep(DROP_REPORT_S + 1)  # one more report period: nothing more to say
        reports = [line for line in log.read_text().splitlines() if "dropped as late" in line]
        counts = [int(re.search(rf"query {name}: since the last report, ([\d,]+) events dropped as late", line)[1].replace(",", ""))
                  for line in reports]
        assert sum(counts) == 400 and len(reports) <= 2  # once per period with counts, never once per event
        assert not any("u1" in line for line in reports)  # counts, never content
        assert run("produce", "--broker", broker, "--topic", topic, "--input", str(EVENTS), "--rebase-time").returncode == 0
        deadline = time.time() + 60
        while metric(port, "dpstream_events_in_total", query=name) < 401 + 5647 and time.time() < deadline:
            time.sleep(0.5)
        assert metric(port, "dpstream_events_in_total", query=name) == 401 + 5647
        assert metric(port, "dpstream_events_dropped_total", query=name, reason="late") == 400  # none of the rebased file's
        assert metric(port, "dpstream_events_dropped_total", query=name, reason="future") == 0
    finally:
        worker.terminate()
        worker.wait(60)
    assert worker.returncode == 0  # stopped as asked: no refusal line, the stop line says why
    assert log.read_text().splitlines()[-1] == "dpstream worker: stopped on SIGTERM (exit code 0)"


def test_worker_refusing_a_createtime_topic_says_so_last(broker, tmp_path):
    from confluent_kafka.admin import AdminClient, NewTopic

    config, topic, name = unique_config(tmp_path)
    admin = AdminClient({"bootstrap.servers": broker})  # kept alive until the futures resolve
    futures = admin.create_topics([NewTopic(topic, 2, 1, config={"message.timestamp.type": "CreateTime"})])
    for f in futures.values():
        f.result(30)
    proc = run(*worker_args(tmp_path, config, broker, free_port(), "--app-id", f"traps-{name}"))
    assert_refused_last(proc, f"input topic {topic} has message.timestamp.type=CreateTime")
