"""The worker's status page in a real headless browser (Debian's chromium, driven by Selenium), its
trigger log line and the consumer offsets it commits to Kafka, against a real worker on the test
broker (docs/operations.md, "Status page", "The trigger log line", "Consumer offsets")."""
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from dpstream.processor.adapters.status_page import render_status
from tests.test_kafka_worker import TRIGGERS, running

#: user ids of the input, none of which may reach the page
USER = "user-qz7-{}"
BUDGET = "budget:\n  principal: query\n  default: {max_epsilon: 100, max_delta: 1.0e-6}\n"


def test_the_page_escapes_what_it_shows_and_says_when_there_is_no_ledger():
    data = {"app_id": "a<b>", "state": "ready", "reason": "", "worker": "worker 0 of 1", "assignment": "static",
            "delivery": "exactly-once", "now": "2024-01-01T00:00:00Z", "budget": None, "partitions_owned": {"t": [0, 2]},
            "queries": [{"name": "q<script>", "kind": "windowed", "aggregate": "count", "window": "1h", "triggers": 4,
                         "allowed_lateness": "1m", "epsilon": 1.0, "delta": 1e-9, "events_in": 3, "triggers_fired": 0,
                         "releases": 0, "open_windows": [], "last_trigger": None, "next_trigger": None,
                         "dead_letters": {"malformed": 2}}]}
    page = render_status(data)
    assert "<script>" not in page and "q&lt;script&gt;" in page and "a&lt;b&gt;" in page
    assert "No ledger configured" in page and "no open window" in page and "0, 2" in page
    assert re.search(r"<td>malformed</td><td class=\"n\">2</td>", page)
    assert "<script" not in page.lower()  # no script at all: plain HTML
    assert "Nothing charged yet" in render_status({**data, "budget": {"epoch": "1", "principals": []}})
    assert "has not opened its state" in render_status({"state": "starting", "reason": "opening state"})


def test_trigger_log_lines_and_the_status_after_a_restart(tmp_path, caplog):
    """Without a broker: one log line per trigger fired (public values only), the status's dead
    letters by reason and last trigger, and after a restart the last trigger its state records."""
    from tests.conftest import Record
    from tests.test_worker_service import (
        START,
        events,
        fire,
        make_worker,
        stage_two,
    )

    w = make_worker(tmp_path / "s")
    records = events(400)
    result = w.process_input("in", 0, [*records, Record(400, b"u1", b"{not json", START)])
    result.commit()
    stage_two(w, result.messages)
    now = START + 25_000  # triggers 1 and 2 (fire times 11 s and 21 s; watermark delay 2 s)
    fired = fire(w, now)
    with caplog.at_level(logging.INFO, logger="dpstream.worker"):
        for f in fired:
            w.mark_published(f)
            w.trigger_fired(f)
        w.log_triggers()
    # two triggers fired on each of the worker's partitions: one line per trigger, not one per partition
    assert re.findall(rf"trigger fired: query=clicks window={iso(START)} trigger=(\d)/4 keys_released=(\d+) duration_ms=\d+ "
                      rf"partitions={len(w.stage2)}$", caplog.text, re.M) == \
        [(str(t), str(sum(len(f.releases) for f in fired if f.trigger == t))) for t in (1, 2)]
    assert {f.trigger for f in fired} == {1, 2} and sum(len(f.releases) for f in fired) > 0
    assert not re.search(r"\bu\d+\b", caplog.text)  # no user id
    q = w.status(now)["queries"][0]
    assert q["dead_letters"] == {"malformed": 1}
    assert (q["last_trigger"]["window_start_ms"], q["last_trigger"]["trigger"]) == (START, 2) and "at" in q["last_trigger"]
    assert q["last_trigger"]["keys_released"] == sum(len(f.releases) for f in fired if f.trigger == 2)
    assert q["next_trigger"]["trigger"] == 3 and q["next_trigger"]["due"] == iso(START + 31_000)
    assert q["open_windows"] == [{"start": iso(START), "start_ms": START, "triggers_fired": 2, "triggers_fired_max": 2}]
    w.close()
    again = make_worker(tmp_path / "s").status(now)["queries"][0]  # restarted: nothing fired since
    assert again["last_trigger"] == {"window_start_ms": START, "trigger": 2, "window_start": iso(START),
                                     "due": iso(START + 21_000)}
    assert again["dead_letters"] == {} and again["releases"] == 0


def iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def _browser():
    """Headless Debian chromium through its chromedriver (never a driver downloaded at run time)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver; .ci/run does this when they are missing)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1500"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def _write_events(sc, n: int, users: int, lead_s: float) -> None:
    """Like Scenario.write_events, with user ids that cannot occur in the page by chance."""
    window_ms = sc.window_s * 1000
    soon = int(time.time() * 1000) + int(lead_s * 1000)
    sc.window_start = soon - soon % window_ms + window_ms
    with open(sc.events, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"user_id": USER.format(i % users), "key": f"k{i % 7}",
                                 "ts": sc.window_start + i * window_ms // n}) + "\n")


def _group_offsets(broker: str, group: str) -> dict:
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker})
    future = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group]
    return {(tp.topic, tp.partition): tp.offset for tp in future.result(15).topic_partitions}


def _log_ends(broker: str, topic: str, partitions: int) -> dict:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-test-ends"})
    try:
        return {(topic, p): c.get_watermark_offsets(TopicPartition(topic, p), timeout=15)[1] for p in range(partitions)}
    finally:
        c.close()


def test_status_page_in_a_browser_trigger_log_lines_and_committed_offsets(tmp_path, broker):
    from confluent_kafka import Producer

    from dpstream.topics.partitioner import partition_for_key

    with running(tmp_path, broker) as sc:
        sc.config.write_text(BUDGET + sc.config.read_text())
        w = sc.ready_worker("page", extra=("--log-level", "info"))
        _write_events(sc, 3_000, users=300, lead_s=4)
        assert sc.produce_events() == 3_000
        bad = USER.format(1)  # one record that is not JSON, keyed by a user of the input
        p = Producer({"bootstrap.servers": sc.broker})
        p.produce(sc.input, b"{not json", bad.encode(), partition=partition_for_key(bad.encode(), 4))
        assert p.flush(30) == 0
        # one log line per trigger over the worker's 4 partitions: query, window, trigger, keys released, duration
        start = iso(sc.window_start)
        pattern = re.compile(rf"trigger fired: query={sc.query} window={re.escape(start)} trigger=(\d+)/{TRIGGERS} "
                             rf"keys_released=(\d+) duration_ms=(\d+) partitions=(4)")
        deadline = sc.window_start / 1000 + sc.window_s + 60
        while len(lines := pattern.findall(w.log.read_text())) < TRIGGERS and time.time() < deadline:
            time.sleep(0.5)
        assert sorted(int(t) for t, _, _, _ in lines) == list(range(1, TRIGGERS + 1))
        released = sc.read(sc.output)
        for t in range(1, TRIGGERS + 1):
            keys = sum(int(k) for i, k, _, _ in lines if int(i) == t)
            assert keys == sum(1 for r in released if r["window_start"] == sc.window_start and r["trigger"] == t)
        assert sum(1 for r in released if r["window_start"] == sc.window_start) > 0
        assert "user-qz7-" not in w.log.read_text()

        # the status page, in a real browser
        browser = _browser()
        try:
            for _ in range(5):  # a page read while a trigger's partitions fire one by one: read it again
                browser.get(f"http://127.0.0.1:{w.port}/")
                title, text, source = browser.title, browser.find_element("tag name", "body").text, browser.page_source
                last = re.search(r"window (\S+), trigger (\d+)/4\s+due \S+, fired \S+\s+(\d+) keys released from (\d) partitions",
                                 text)
                if last and last.group(4) == "4":
                    break
                time.sleep(0.3)
            shot = Path(os.environ.get("DPSTREAM_STATUS_SCREENSHOT") or tmp_path / "status-page.png")
            assert browser.save_screenshot(str(shot))
        finally:
            browser.quit()
        released = sc.read(sc.output)
        assert title == f"dpstream worker: {sc.app_id}" and sc.query in text and "ready" in text
        assert last, text  # a trigger has fired: its window, number, keys released from the 4 partitions
        window, trigger, keys = last.group(1), int(last.group(2)), int(last.group(3))
        assert keys == sum(1 for r in released if iso(r["window_start"]) == window and r["trigger"] == trigger)
        assert window >= start  # the events' window or a later one
        assert re.search(rf"{sc.query} malformed 1\b", text), text  # the bad record, by reason
        assert re.search(rf"{sc.query} [\d.]+ 100 ", text), text  # the ledger: spent, max (budget per principal)
        assert f"{sc.input} 0, 1, 2, 3" in text  # partitions owned
        assert "user-qz7-" not in source and "user_id" not in source  # no user id, no record
        assert "not json" not in source
        data = json.loads(w.get("/status.json")[1])
        q = data["queries"][0]
        assert q["releases"] == len(released) and q["dead_letters"] == {"malformed": 1}
        assert "user-qz7-" not in json.dumps(data)

        # the offsets the worker committed to Kafka: the input read to its end, lag 0
        ends = _log_ends(sc.broker, sc.input, 4)
        deadline = time.time() + 30
        while time.time() < deadline:
            committed = _group_offsets(sc.broker, f"{sc.app_id}-workers")
            if all(committed.get(k) == end for k, end in ends.items()):
                break
            time.sleep(1)
        assert {k: committed.get(k) for k in ends} == ends and sum(ends.values()) == 3_001
        repartition = {k: o for k, o in committed.items() if k[0].endswith("-by-key")}
        assert len(repartition) == 4 and all(o > 0 for o in repartition.values())
