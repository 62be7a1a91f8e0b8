"""What a consumer of the output topic relies on (docs/consuming.md; issue 32, items 1 and 5).

* docs/release.schema.json describes every release record as written: replay's of each kind of
  query (count, sum, mean, hierarchy, dynamic) and a worker's on Kafka, run fields included; the
  schema is strict, so a record with a field too many or too few fails it.
* Kafka's own Java console consumer (``scripts/broker tool kafka-console-consumer``), reading
  ``read_committed`` as docs/consuming.md tells a consumer to, sees exactly the releases
  ``dpstream replay`` computes under the worker's noise label, each once, keyed by
  ``[query, window_start, key]``; docs/consuming.md's two recipes for the latest value per
  (query, window, key) (confluent-kafka, the console consumer and awk), run as written, print
  replay's latest releases; ``kafka-consumer-groups --describe`` shows the workers' group.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from dpstream.topics.records import release_key
from tests.conftest import ROOT, TEST_SECRET_HEX, without_run
from tests.test_kafka_worker import assert_no_conflicting_releases, running

SCHEMA_FILE = ROOT / "docs" / "release.schema.json"
BROKER_SCRIPT = ROOT / "scripts" / "broker"
WINDOW_MS = 3_600_000
START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z

#: one query of every kind a release can come from (docs/consuming.md, "The release record")
ALL_KINDS_CONFIG = f"""
queries:
  - name: clicks
    key_fields: [key]
    contribution_bound: 4
    window: 1h
    triggers: 4
    epsilon: 8
    delta: 1.0e-9
  - name: spend
    key_fields: [category]
    value_field: amount
    aggregate: sum
    clamp: 50.0
    contribution_bound: 4
    window: 1h
    triggers: 4
    epsilon: 8
    delta: 1.0e-9
  - name: spend_mean
    key_fields: [category]
    value_field: amount
    aggregate: mean
    clamp: 50.0
    contribution_bound: 4
    window: 1h
    triggers: 4
    epsilon: 8
    delta: 1.0e-9
  - name: places
    key_fields: [country, city]
    hierarchy: true
    contribution_bound: 4
    window: 1h
    triggers: 4
    epsilon: 8
    delta: 1.0e-9
dynamic:
  - name: plans
    items: ["free", "gold"]
    start: {START_MS}
    tick: 5m
    epsilon: 2.0
"""


def validator() -> Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_errors(v: Draft202012Validator, record: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(record)'}: {e.message}" for e in v.iter_errors(record)]


def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "noise.key"
    path.write_text(TEST_SECRET_HEX)
    path.chmod(0o600)
    return path


def replay_cli(config: Path, events: Path, out: Path, key: Path, label: str) -> list[dict]:
    """``dpstream replay`` as a user runs it, under ``label``."""
    env = {**os.environ, "DPSTREAM_NOISE_KEY_FILE": str(key)}
    env.pop("DPSTREAM_NOISE_KEY", None)
    proc = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "replay", "--config", str(config), "--input", str(events),
                           "--output", str(out), "--noise-label", label], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def all_kinds_events(path: Path, n: int = 4_000, users: int = 600) -> None:
    """Events every query of ALL_KINDS_CONFIG reads (the dynamic one: item and op), over one window."""
    rng = np.random.default_rng(32)
    cities = [("FR", "Paris"), ("FR", "Lyon"), ("US", "Boston"), ("DE", "Berlin")]
    live: list[str] = []
    with open(path, "w") as fh:
        for i, ts in enumerate(np.sort(rng.integers(START_MS, START_MS + WINDOW_MS, n)).tolist()):
            country, city = cities[min(int(rng.zipf(1.8)), len(cities)) - 1]
            if live and rng.random() < 0.3:
                item, op = live.pop(int(rng.integers(len(live)))), "delete"
            else:
                item, op = ("free", "gold")[int(rng.random() < 0.3)], "insert"
                live.append(item)
            fh.write(json.dumps({"user_id": f"u{rng.integers(users)}", "key": f"page-{min(int(rng.zipf(1.6)), 8)}",
                                 "category": ("books", "games", "food")[i % 3], "amount": round(float(rng.uniform(1, 80)), 2),
                                 "country": country, "city": city, "item": item, "op": op, "ts": ts}) + "\n")


def canonical_list(records: list[dict]) -> list[str]:
    """Each release without the fields about its run (a worker's and a replay's differ only
    there), as canonical JSON: a list, so a copy delivered twice is counted twice."""
    return [json.dumps(without_run(r), sort_keys=True) for r in records]


def shape(record: dict) -> str:
    """Which kind of release a record is, by its fields."""
    if "segment" in record:
        return "dynamic" + (" with intervals" if "ci95_low" in record else "")
    if "level" in record:
        return "hierarchy" + (" with consistent_other" if "consistent_other" in record else " finest level")
    if "mean" in record:
        return "mean"
    return "sum" if "sum" in record else "count"


def test_replays_releases_of_every_kind_match_the_schema_and_the_schema_refuses_others(tmp_path):
    config, events = tmp_path / "queries.yaml", tmp_path / "events.jsonl"
    config.write_text(ALL_KINDS_CONFIG)
    all_kinds_events(events)
    released = replay_cli(config, events, tmp_path / "releases.jsonl", key_file(tmp_path), "consuming-schema")
    v = validator()
    for record in released:
        assert not schema_errors(v, record), (record, schema_errors(v, record))
    assert {shape(r) for r in released} == {"count", "sum", "mean", "hierarchy with consistent_other", "hierarchy finest level",
                                            "dynamic with intervals"}

    def first(kind: str) -> dict:
        return copy.deepcopy(next(r for r in released if shape(r) == kind))

    worker_run = {"noise_label": "worker:dpstream:1:" + "7e57" * 8, "budget_epoch": "1", "restarts": 0, "nonce": "7e57" * 8}
    assert not schema_errors(v, {**first("count"), "app_id": "dpstream", "run": worker_run})
    # what the schema must refuse: a field the writer never writes, a missing one, a wrong type,
    # a worker's run without its application, an application with a replay's run
    refused = [
        {**first("count"), "raw_count": 12},
        {k: x for k, x in first("sum").items() if k != "stddev"},
        {**first("mean"), "count_ci95_high": None},
        {**first("hierarchy finest level"), "level": 0},
        {**first("dynamic with intervals"), "counts": {"free": 1.5}},
        {k: x for k, x in first("count").items() if k != "run"},
        {**first("count"), "run": worker_run},
        {**first("count"), "app_id": "dpstream"},
        {**first("count"), "app_id": "dpstream", "run": {**worker_run, "secret": "x"}},
        {**first("count"), "window_start_iso": "2026-01-01 00:00:00"},
    ]
    for record in refused:
        assert schema_errors(v, record), f"the schema accepts {record}"


def test_the_docs_example_releases_match_the_schema():
    """The release records docs/consuming.md and docs/user-guide.md show are ones the schema accepts."""
    v = validator()
    for doc in ("consuming.md", "user-guide.md"):
        examples = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", (ROOT / "docs" / doc).read_text(), re.S)
                    if '"window_start"' in b]
        assert examples, f"docs/{doc} shows a release record"
        for record in examples:
            assert not schema_errors(v, record), (doc, schema_errors(v, record))


def kafka_tool(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One of Kafka's own command-line tools as docs/consuming.md runs it (``scripts/broker tool``)."""
    if shutil.which("java") is None and not os.environ.get("CI"):
        pytest.skip("Kafka's tools need a JDK (scripts/broker tool)")
    return subprocess.run([str(BROKER_SCRIPT), "tool", name, *args], capture_output=True, text=True, timeout=timeout)


def console_consume(broker: str, topic: str) -> list[tuple[str, dict]]:
    """(record key, release) of every record on ``topic``, read by Kafka's Java console consumer
    with ``read_committed``, until it has seen nothing for 10 s."""
    proc = kafka_tool("kafka-console-consumer", "--bootstrap-server", broker, "--topic", topic, "--from-beginning",
                      "--isolation-level", "read_committed", "--group", f"test-consuming-{uuid.uuid4().hex[:8]}",
                      "--formatter-property", "print.key=true", "--formatter-property", "key.separator=\t",
                      "--timeout-ms", "10000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = []
    for line in proc.stdout.splitlines():
        key, value = line.split("\t", 1)
        pairs.append((key, json.loads(value)))
    return pairs


def doc_block(language: str, containing: str) -> str:
    """The fenced ``language`` block of docs/consuming.md that contains ``containing``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "docs" / "consuming.md").read_text(), re.S)
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, f"docs/consuming.md has {len(found)} {language} blocks with {containing!r}"
    return found[0]


def latest_per_key(releases: list[dict]) -> dict[bytes, dict]:
    """The latest release of each (query, window, key): its highest trigger."""
    latest: dict[bytes, dict] = {}
    for r in releases:
        key = release_key(r["query"], r["window_start"], r["key"])
        if key not in latest or r["trigger"] > latest[key]["trigger"]:
            latest[key] = r
    return latest


def assert_the_docs_recipes_give_the_latest_values(sc, expected: list[dict], tmp_path: Path) -> None:
    """docs/consuming.md's two recipes for the latest value per (query, window, key), run as
    written but for the broker and the topic: each prints exactly replay's latest releases."""
    latest = latest_per_key(expected)
    assert len(latest) < len(expected), "some key is released at several triggers, so the latest is not the only one"
    want = sorted(canonical_list(list(latest.values())))
    script = tmp_path / "latest_releases.py"
    script.write_text(doc_block("python", "confluent_kafka"))
    proc = subprocess.run([sys.executable, str(script), sc.broker, sc.output], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(canonical_list([json.loads(line) for line in proc.stdout.splitlines()])) == want
    shell = doc_block("bash", "awk").replace("127.0.0.1:19092", sc.broker).replace("dp-histograms", sc.output)
    proc = subprocess.run(["bash", "-c", "set -o pipefail\n" + shell], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(canonical_list([json.loads(line) for line in proc.stdout.splitlines()])) == want


def group_lag(broker: str, group: str, topic: str) -> dict[int, str]:
    """LAG per partition of ``topic`` in ``kafka-consumer-groups --describe --group``'s table."""
    proc = kafka_tool("kafka-consumer-groups", "--bootstrap-server", broker, "--describe", "--group", group)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()]
    header = next(r for r in rows if r[:2] == ["GROUP", "TOPIC"])
    at = {column: i for i, column in enumerate(header)}
    return {int(r[at["PARTITION"]]): r[at["LAG"]] for r in rows if r is not header and r[at["TOPIC"]] == topic}


def test_kafkas_console_consumer_reading_committed_sees_exactly_replays_releases(tmp_path, broker):
    with running(tmp_path, broker) as sc:
        sc.ready_worker("one")
        sc.write_events(4_000, users=500, keys=30, lead_s=4)
        assert sc.produce_events() == 4_000
        sc.wait_for_window_end()
        label = sc.noise_label()
        expected = replay_cli(sc.config, sc.events, tmp_path / "replay.jsonl", key_file(tmp_path), label)
        assert len(expected) > 10
        sc.published(expected)  # the worker may still be publishing its last trigger on a loaded machine
        consumed = console_consume(sc.broker, sc.output)
        releases = [value for _, value in consumed]
        # each release once (exactly-once delivery, read_committed), and nothing but replay's
        assert_no_conflicting_releases(releases)
        assert sorted(canonical_list(releases)) == sorted(canonical_list(expected))
        for key, value in consumed:
            assert key.encode() == release_key(value["query"], value["window_start"], value["key"])
            assert value["app_id"] == sc.app_id and value["run"]["noise_label"] == label
        v = validator()
        for record in releases + expected:
            assert not schema_errors(v, record), (record, schema_errors(v, record))
        assert_the_docs_recipes_give_the_latest_values(sc, expected, tmp_path)
        # the workers' consumer group, as an operator reads its lag (docs/operations.md, "Consumer
        # offsets": static workers commit every 5 s, so lag 0 once the input is all taken in)
        deadline, lag = time.time() + 60, {}
        while time.time() < deadline:
            lag = group_lag(sc.broker, f"{sc.app_id}-workers", sc.input)
            if len(lag) == 4 and set(lag.values()) == {"0"}:
                break
            time.sleep(2)
        assert len(lag) == 4 and set(lag.values()) == {"0"}, lag
