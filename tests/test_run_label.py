"""The run nonce in the worker's noise label (issue 30, item 4; docs/privacy.md, "Noise").

The label was ``worker:<app id>:<epoch>``: a start that lost both its state directory and
``dpstream-epochs`` (a new cluster, a mirror without the internal topics) under the same app id
and secret took it again and released new data with the noise of released values. Now each run
draws a random nonce, kept in the state directory and in ``dpstream-epochs``, agreed by the
application's workers (processor/adapters/run_identity.py); a fresh start while the output holds
the application's releases of a window still open is refused; every release says which run
made it."""
from __future__ import annotations

import io
import json
import shutil
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.adapters.run_identity import (
    LiveOutputError,
    RunChoice,
    agree_run,
    find_live_release,
    legacy_run,
    live_release,
    run_key,
    runs_of,
)
from dpstream.processor.adapters.worker import (
    LAYOUT_FILE,
    RUN_FILE,
    LostStateError,
    Ownership,
    StateLayoutError,
    epoch_mark,
    run_fields,
)
from dpstream.processor.config import DpstreamConfig
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.topics.kafka import EPOCH_TOPIC, KafkaPublisher, TopicSpec, create_topics, read_compacted, write_epoch_mark
from dpstream.topics.records import RUN_FIELDS, encode_json, release_record
from tests.conftest import TEST_SECRET
from tests.test_broker_outages import SCRIPT, OwnBroker
from tests.test_kafka_worker import Scenario, canonical, runs
from tests.test_worker_service import START, WINDOW_MS, config, events, fire, make_worker, stage_two


def releases_of(worker) -> tuple[dict, list[dict]]:
    """Every release of ``events(8000)`` through ``worker`` (about 20): (window, trigger, key) ->
    count, and the records as published (with the run fields)."""
    out = worker.process_input("in", 0, events(8000))
    out.commit()
    stage_two(worker, out.messages)
    fired = fire(worker, START + 10 * WINDOW_MS)
    counts = {(r["window_start"], r["trigger"], r["key"]): r["count"] for f in fired for r in f.releases}
    return counts, [json.loads(m.value) for f in fired for m in worker.release_messages(f)]


# ---------------------------------------------------------------------- the label and the state directory
def test_a_fresh_state_directory_draws_a_new_run_and_a_kept_one_keeps_its_own(tmp_path):
    """Two starts of one application, app id and secret with nothing in common (both state
    directories new, no run agreed): different labels, so no (window, key, trigger) gets the
    same noise; a restart on a kept state directory keeps its label, so its noise is the same."""
    first = make_worker(tmp_path / "a", run_nonce=None)
    label = first.noise.label
    assert label.startswith("worker:dpstream:1:") and len(label.rsplit(":", 1)[1]) == 32
    assert json.loads((tmp_path / "a" / RUN_FILE).read_text()) == {"app_id": "dpstream", "nonce": first.run_nonce,
                                                                     "noise_label": label}
    counts_a, _ = releases_of(first)
    first.close()

    again = make_worker(tmp_path / "a", run_nonce=None)  # its state directory's run
    assert again.noise.label == label
    again.close()

    fresh = make_worker(tmp_path / "b", run_nonce=None)  # state and epoch marks both lost
    assert fresh.noise.label != label and fresh.noise.label.startswith("worker:dpstream:1:")
    counts_b, published_b = releases_of(fresh)
    fresh.close()
    common = sorted(set(counts_a) & set(counts_b))
    assert len(common) >= 10
    # the same counts under independent noise: two draws of a discrete Gaussian of stddev > 5
    # agree with probability < 1 / (2 * 5 * sqrt(pi)) < 0.06, so that half of 10 or more slots
    # agree has probability < C(10, 5) 0.06^5 < 2e-4 (the nonce is random: the bound is the test's)
    assert all(r["stddev"] > 5 for r in published_b)
    assert sum(counts_a[s] != counts_b[s] for s in common) > len(common) // 2


def test_a_state_directory_of_another_run_is_refused_naming_the_way_out(tmp_path):
    make_worker(tmp_path / "a", run_nonce="1" * 32).close()
    with pytest.raises(StateLayoutError, match="dpstream reset") as refused:
        make_worker(tmp_path / "a", run_nonce="2" * 32)
    assert "1" * 32 in str(refused.value) and "2" * 32 in str(refused.value)


def test_a_state_directory_from_before_run_nonces_keeps_its_label(tmp_path):
    """A 0.1.0 state directory (a layout file, no run file) keeps the label it was written
    under (its stores say so: check_noise_epoch)."""
    old = make_worker(tmp_path / "a", run_nonce="")
    assert old.noise.label == "worker:dpstream:1"
    old.close()
    (tmp_path / "a" / RUN_FILE).unlink()  # as 0.1.0 left it
    assert make_worker(tmp_path / "a", run_nonce=None).noise.label == "worker:dpstream:1"


def test_releases_and_the_status_say_which_run_made_them_and_replay_reproduces_it(tmp_path):
    w = make_worker(tmp_path / "w", run_nonce=None)
    counts, published = releases_of(w)
    label, nonce = w.noise.label, w.run_nonce
    status = w.status(START)
    fingerprint = w.noise.fingerprint
    w.close()
    assert published and all(r["app_id"] == "dpstream" and r["run"] == {"noise_label": label, "budget_epoch": "1",
                                                                        "restarts": 0, "nonce": nonce} for r in published)
    assert status["noise_label"] == label and status["run"]["nonce"] == nonce
    text = json.dumps(published) + json.dumps(status)
    assert fingerprint not in text and TEST_SECRET.hex() not in text  # public values only

    path = tmp_path / "events.jsonl"  # the same events through replay under the worker's label
    path.write_text("".join(r.value.decode() + "\n" for r in events(8000)))
    runner = ReplayRunner(config(), TEST_SECRET, None, noise_label=label, start_ms=START)
    out = io.StringIO()
    try:
        runner.run(str(path), out, until_ms=START + 10 * WINDOW_MS)
    finally:
        runner.close()
    replayed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {json.dumps(r["run"]) for r in replayed} == {json.dumps({"noise_label": label})}
    assert {(r["window_start"], r["trigger"], r["key"]): r["count"] for r in replayed} == counts
    assert canonical(replayed) == canonical(published) and set(RUN_FIELDS) == {"app_id", "run"}


# ---------------------------------------------------------------------- what a fresh start looks for
def release(app_id="app", query="clicks", window_start=START, restarts=0, budget_epoch="1", nonce="ab" * 16) -> dict:
    """A worker's release of query ``clicks`` (window 40 s, lateness 1 s), as published."""
    record = release_record(query=query, window_start=window_start, window_end=window_start + WINDOW_MS, trigger=1,
                            trigger_time=window_start + WINDOW_MS // 4, key="k1", fields={"count": 3}, epsilon=6, delta=1e-9)
    fields = run_fields(app_id, config(), restarts, nonce)
    fields["run"]["budget_epoch"] = budget_epoch
    return {**record, **fields}


def test_a_release_holds_a_fresh_start_back_only_while_its_window_is_open_and_its_run_is_the_applications():
    cfg = config()
    end = START + WINDOW_MS + 1000  # the window's end plus its allowed lateness (1 s)
    what, closes = live_release(release(), "out", "app", cfg, 0, end - 1)
    assert closes == end and "query clicks" in what and "open until" in what
    assert live_release(release(), "out", "app", cfg, 0, end) is None  # closed
    assert live_release(release(app_id="other"), "out", "app", cfg, 0, START) is None  # another application's
    assert live_release(release(), "elsewhere", "app", cfg, 0, START) is None  # not the query's output topic
    assert live_release(release(query="renamed"), "out", "app", cfg, 0, START) is None  # no query of this config
    assert live_release(release(), "out", "app", cfg, 1, START) is None  # started over (dpstream reset) since
    assert live_release(release(restarts=2), "out", "app", cfg, 1, START) is not None  # the reset count was lost too
    assert live_release(release(budget_epoch="2027"), "out", "app", cfg, 0, START) is None  # another budget epoch
    old = {k: v for k, v in release().items() if k not in RUN_FIELDS}
    assert live_release(old, "out", "app", cfg, 0, START) is None  # it does not say which run made it
    assert live_release(["not", "a", "release"], "out", "app", cfg, 0, START) is None
    dynamic = DpstreamConfig(dynamic=[{"name": "d", "output_topic": "dyn", "start": START, "items": ["a"], "epsilon": 1}])
    record = {"query": "d", "segment": 1, "tick": 3, "time": START, "counts": {"a": 1}, **run_fields("app", dynamic, 0, "cd" * 16)}
    what, closes = live_release(record, "dyn", "app", dynamic, 0, START + 10 ** 9)
    assert closes is None and "continual" in what


def test_the_first_proposal_in_log_order_is_the_run_and_old_marks_mean_a_run_before_nonces():
    marks = {"app/0": {"budget_epoch": None, "noise": "f"}, run_key("app", "aa"): {"nonce": "aa"},
             run_key("other", "bb"): {"nonce": "bb"}, run_key("app", "cc"): {"nonce": "cc"}}
    assert [r["nonce"] for r in runs_of(marks, "app")] == ["aa", "cc"]
    assert legacy_run(marks, "app", {"budget_epoch": None, "noise": "f"})
    assert not legacy_run(marks, "app", {"budget_epoch": None, "noise": "another secret"})
    assert not legacy_run({"app/0": {"budget_epoch": None, "noise": "f", "run": "aa"}}, "app", {"budget_epoch": None, "noise": "f"})


# ---------------------------------------------------------------------- agreement through dpstream-epochs
def settings(tmp_path, app_id: str, name: str, index: int = 0, workers: int = 1, assignment: str = "static", cfg=None):
    """What agree_run reads of a worker's settings (faust_app.WorkerSettings)."""
    return SimpleNamespace(config=cfg or config(), secret=TEST_SECRET, state_dir=str(tmp_path / name), app_id=app_id,
                           assignment=assignment, ownership=Ownership(index, workers))


@pytest.mark.broker
def test_workers_starting_at_once_agree_on_one_run_and_a_kept_state_restores_it(tmp_path, broker):
    """Four static workers of a new application start at the same moment: each proposes a run,
    and all take the first in log order. Then the application's record in dpstream-epochs is
    lost: a worker whose state directory kept the run records it again, a state directory of
    another run is refused, and a worker whose state is empty is refused (it cannot be told
    whether it ran)."""
    app = f"run-{uuid.uuid4().hex[:8]}"
    create_topics(broker, [TopicSpec(EPOCH_TOPIC, 1, {"cleanup.policy": "compact"})])
    chosen: dict = {}

    def start(i: int) -> None:
        chosen[i] = agree_run(broker, settings(tmp_path, app, f"s{i}", i, 4), {}, 0)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    nonces = {c.nonce for c in chosen.values()}
    assert len(chosen) == 4 and len(nonces) == 1 and all(len(n) == 32 for n in nonces)
    assert sum(c.how == "fresh" for c in chosen.values()) == 1  # one proposal won; the others joined it
    nonce = nonces.pop()
    marks = read_compacted(broker, EPOCH_TOPIC, f"{app}/")
    assert runs_of(marks, app)[0]["nonce"] == nonce and len(runs_of(marks, app)) == 4
    assert agree_run(broker, settings(tmp_path, app, "late", 1, 4), marks, 0).nonce == nonce  # a later start joins

    # the record is lost (tombstones, as a new cluster would have none); worker 0 kept its state
    publisher = KafkaPublisher(broker)
    for key in marks:
        publisher.produce(EPOCH_TOPIC, None, key.encode())
    publisher.flush()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / RUN_FILE).write_text(json.dumps({"app_id": app, "nonce": nonce}))
    restored = agree_run(broker, settings(tmp_path, app, "kept", 0, 4), {}, 0)
    assert (restored.nonce, restored.how) == (nonce, "restored")
    marks = read_compacted(broker, EPOCH_TOPIC, f"{app}/run/")
    assert runs_of(marks, app)[0] == {**runs_of(marks, app)[0], "nonce": nonce, "restored": True}
    other = tmp_path / "other"
    other.mkdir()
    (other / RUN_FILE).write_text(json.dumps({"app_id": app, "nonce": "0" * 32}))
    with pytest.raises(StateLayoutError, match="another worker started a new run"):
        agree_run(broker, settings(tmp_path, app, "other", 1, 4), marks, 0)
    with pytest.raises(LostStateError, match="can no longer be told"):
        agree_run(broker, settings(tmp_path, app, "empty", 2, 4), marks, 0)


@pytest.mark.broker
def test_an_application_begun_before_run_nonces_keeps_its_label(tmp_path, broker):
    """dpstream 0.1.0 wrote epoch marks without a run, and state directories without a run file:
    the application goes on under its label (worker:<app id>:<epoch>), the same for every worker."""
    app = f"run-{uuid.uuid4().hex[:8]}"
    write_epoch_mark(broker, f"{app}/0", {**epoch_mark(config(), NodeNoise(TEST_SECRET), 0), "since_ms": 1})  # as 0.1.0 did
    marks = read_compacted(broker, EPOCH_TOPIC, f"{app}/")
    assert agree_run(broker, settings(tmp_path, app, "s0", 0, 2), marks, 0) == RunChoice("", "legacy")
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / LAYOUT_FILE).write_text("{}")  # a state directory 0.1.0 wrote
    marks = read_compacted(broker, EPOCH_TOPIC, f"{app}/")
    assert agree_run(broker, settings(tmp_path, app, "s1", 1, 2), marks, 0) == RunChoice("", "kept")
    other_secret = {f"{app}/0": {**marks[f"{app}/0"], "noise": "another secret's fingerprint"}}
    assert not legacy_run(other_secret, app, epoch_mark(config(), NodeNoise(TEST_SECRET), 0))


@pytest.mark.broker
def test_elastic_workers_restore_a_run_only_while_their_changelogs_hold_the_state(tmp_path, broker):
    app = f"run-{uuid.uuid4().hex[:8]}"
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / RUN_FILE).write_text(json.dumps({"app_id": app, "nonce": "9" * 32}))
    with pytest.raises(LostStateError, match="changelog topic .* is gone"):
        agree_run(broker, settings(tmp_path, app, "kept", assignment="group"), {}, 0)
    assert runs_of(read_compacted(broker, EPOCH_TOPIC, f"{app}/run/"), app) == []  # refused: nothing recorded


@pytest.mark.broker
def test_a_fresh_start_is_refused_while_the_output_holds_the_applications_releases_of_an_open_window(tmp_path, broker):
    app, topic = f"run-{uuid.uuid4().hex[:8]}", f"run-out-{uuid.uuid4().hex[:8]}"
    cfg = config(output_topic=topic)
    now = int(time.time() * 1000)
    window = now - now % WINDOW_MS
    create_topics(broker, [TopicSpec(topic, 2)])
    publisher = KafkaPublisher(broker)
    for r in (release(app_id="another-app", window_start=window), release(app_id=app, window_start=window - 3 * WINDOW_MS)):
        publisher.produce(topic, encode_json(r), b"k")  # another application's, and a closed window's
    publisher.produce(topic, b"not json", b"k")
    publisher.flush()
    assert find_live_release(broker, app, cfg, 0, now) is None
    assert agree_run(broker, settings(tmp_path, f"{app}-other", "x", cfg=cfg), {}, 0).how == "fresh"

    publisher.produce(topic, encode_json(release(app_id=app, window_start=window)), b"k", partition=1)
    publisher.flush()
    found = find_live_release(broker, app, cfg, 0, now)
    assert found is not None and found[0] == topic and found[2] == window + WINDOW_MS + 1000
    with pytest.raises(LiveOutputError) as refused:
        agree_run(broker, settings(tmp_path, app, "fresh", cfg=cfg), {}, 0, now_ms=now)
    line = str(refused.value)
    for part in (f"output topic {topic}", repr(app), "open until", "wait until the window closes",
                 "dpstream reset", f"--app-id {app}-2"):
        assert part in line, part
    assert runs_of(read_compacted(broker, EPOCH_TOPIC, f"{app}/run/"), app) == []  # refused: nothing proposed
    assert find_live_release(broker, app, cfg, 0, window + WINDOW_MS + 1000) is None  # once the window has closed
    assert agree_run(broker, settings(tmp_path, app, "fresh", cfg=cfg), {}, 1, now_ms=now).how == "fresh"  # after a reset


# ---------------------------------------------------------------------- the worker on Kafka
@pytest.fixture
def lone_broker(broker):
    """An Apache Kafka broker of the test's own (scripts/broker on a free port): the test deletes
    dpstream-epochs, which every application on the session's broker shares."""
    import subprocess

    b = OwnBroker()
    b.run("start")
    kind = subprocess.run([SCRIPT, "which", str(b.port)], capture_output=True, text=True).stdout
    if "Apache Kafka" not in kind:
        b.run("stop")
        pytest.skip(f"deleting a topic under a worker needs Apache Kafka; scripts/broker started {kind.strip()}")
    yield b
    b.run("stop")


def delete_epochs_topic(address: str) -> None:
    """The epochs topic is lost (a new cluster, a mirror without the internal topics)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": address})
    for done in admin.delete_topics([EPOCH_TOPIC], operation_timeout=30).values():
        done.result(30)
    deadline = time.time() + 30
    while EPOCH_TOPIC in admin.list_topics(timeout=10).topics:
        assert time.time() < deadline, f"{EPOCH_TOPIC} still listed"
        time.sleep(0.2)


def fired(w, sc, triggers: int, failure: str, timeout: float = 180) -> None:
    """Until ``w`` has fired ``triggers`` triggers (over its repartition partitions)."""
    deadline = time.time() + timeout
    while True:
        try:
            if w.metric("dpstream_triggers_fired_total", query=sc.query) >= triggers:
                return
        except OSError:  # a worker busy firing overdue triggers may answer a scrape late: ask again
            pass
        assert time.time() < deadline, failure
        time.sleep(0.3)


def label_of(w) -> str:
    return json.loads(w.get("/status.json")[1])["noise_label"]


@pytest.mark.broker
@pytest.mark.slow
def test_losing_the_state_and_the_epochs_topic_never_reuses_a_runs_noise(tmp_path, lone_broker):
    """A worker's run survives the loss of dpstream-epochs when its state directory is kept (its
    label, so its releases stay replay's). With both lost, a start while the output holds the
    run's releases of a window still open is refused with a line that says what to do; once the
    window has closed, the fresh start draws a new run: every release of it is replay's under its
    new label, none carries the first run's noise."""
    # 90 s: the first trigger at 30 s, then the stop, the losses and the refusal with the window
    # still open: a 30 s window left too little of it on a loaded 2-core machine (6 test
    # processes), and a refused start took more than 60 s on a slower one
    sc = Scenario(tmp_path, lone_broker.address, window_s=90, triggers=3)
    try:
        w = sc.worker("a").start()
        sc.workers.append(w)
        w.wait_ready()
        first = label_of(w)
        assert first.startswith(f"worker:{sc.app_id}:1:")
        w.stop()
        delete_epochs_topic(lone_broker.address)  # the state directory is kept
        w.start()
        w.wait_ready()
        assert label_of(w) == first
        assert [r["nonce"] for r in runs_of(read_compacted(lone_broker.address, EPOCH_TOPIC, f"{sc.app_id}/"), sc.app_id)] == \
            [first.rsplit(":", 1)[1]]

        sc.write_events(6_000, users=600, keys=20, lead_s=3)
        assert sc.produce_events() == 6_000
        fired(w, sc, 4, "the window's first trigger did not fire")  # on each repartition partition
        w.stop()
        closes = sc.window_start / 1000 + sc.window_s + 1  # its end plus the allowed lateness
        shutil.rmtree(w.state_dir)
        delete_epochs_topic(lone_broker.address)
        assert time.time() < closes - 5, "the window must still be open for the refusal"
        w.log.write_text("")
        w.start()
        assert w.proc.wait(180) == 2
        last = w.log.read_text().strip().splitlines()[-1]
        assert last.startswith(f"dpstream worker: refused: output topic {sc.output} holds releases of application "
                               f"{sc.app_id!r}"), last
        for part in ("open until", "wait until the window closes", "dpstream reset", "--app-id"):
            assert part in last, part
        assert not (w.state_dir / RUN_FILE).exists()

        time.sleep(max(0.0, closes + 1 - time.time()))
        w.log.write_text("")
        w.start()
        w.wait_ready()
        second = label_of(w)
        assert second != first and second.startswith(f"worker:{sc.app_id}:1:")
        fired(w, sc, 3 * 4, "the fresh run did not fire the window's triggers")  # it read the input again
        again = sc.replay(second)
        released = sc.published(again)
        assert runs(released) == {(sc.app_id, first), (sc.app_id, second)}
        by_run = {label: [r for r in released if r["run"]["noise_label"] == label] for label in (first, second)}
        assert canonical(by_run[second]) == canonical(again)
        assert by_run[first] and canonical(by_run[first]) <= canonical(sc.replay(first))
        slot = lambda r: (r["window_start"], r["key"], r["trigger"])  # noqa: E731
        old = {slot(r): r["count"] for r in by_run[first]}
        both = [(old[slot(r)], r["count"]) for r in again if slot(r) in old]
        assert both and sum(a != b for a, b in both) > len(both) // 2  # other noise on the same slots
    finally:
        for x in sc.workers:
            x.stop()
