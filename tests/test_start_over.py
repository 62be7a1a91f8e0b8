"""Starting over on purpose (docs/operator-guide.md, "Start over"), the noise secret's file, and a
state directory that cannot be a source folder (issue 16, item 4).

A lost volume is refused; `dpstream reset` is the one command that starts an application over:
it deletes the state and the internal topics and moves the workers to a new noise label, so the
new run never re-releases a value with the old noise. The broker test checks the new run's
releases are exactly replay's under the new label, and that they differ from the old run's."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

from dpstream.processor.adapters.start_over import StartOverError, check_state_dir
from dpstream.processor.mechanisms.noise import load_noise_secret
from dpstream.state.store import PartitionStores, StateDirectoryError
from tests.conftest import ROOT, TEST_SECRET
from tests.test_kafka_worker import canonical, running, runs


def cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpstream.processor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def test_keygen_writes_a_0600_hex_secret_the_worker_reads_and_never_overwrites(tmp_path):
    path = tmp_path / "noise.key"
    old = os.umask(0o022)  # a permissive umask must not leak into the file's mode
    try:
        done = cli("keygen", "--out", str(path))
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and int(text, 16) >= 0  # 64 hex digits: 256 bits
    assert len(load_noise_secret(str(path), {})) == 32
    assert text not in done.stdout + done.stderr  # the secret is never printed
    again = cli("keygen", "--out", str(path))
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert path.read_text() == text


def test_a_source_folder_is_refused_as_a_state_directory_and_nothing_is_written(tmp_path):
    package = tmp_path / "state"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "store.py").write_text("x = 1\n")
    with pytest.raises(StateDirectoryError, match="holds Python source"):
        PartitionStores(package)
    events = tmp_path / "events.jsonl"
    events.write_text('{"user_id":"u1","key":"a","ts":1795132800000}\n')
    done = cli("replay", "--config", "examples/worker.yaml", "--input", str(events), "--output", str(tmp_path / "out.jsonl"),
               "--state-dir", str(package), env={"DPSTREAM_NOISE_KEY": TEST_SECRET.hex()})
    assert done.returncode == 2 and "--state-dir" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "store.py"]


def test_reset_deletes_only_a_dpstream_state_directory(tmp_path):
    check_state_dir(tmp_path / "missing")  # nothing to delete: fine
    state = tmp_path / "dpstream-state"
    (state / "partition-events-0").mkdir(parents=True)
    (state / "worker-layout.json").write_text("{}")
    check_state_dir(state)
    (state / "notes.txt").write_text("mine")
    with pytest.raises(StartOverError, match="notes.txt"):
        check_state_dir(state)


def first_run(sc, name: str):
    """A worker of ``sc``'s application over one window of events: its releases equal replay's."""
    w = sc.worker(name).start()
    sc.workers.append(w)
    w.wait_ready()
    sc.write_events(6_000, users=600, keys=20, lead_s=3)
    assert sc.produce_events() == 6_000
    sc.wait_for_window_end()
    first = sc.replay()
    sc.assert_published_equal(first)
    return w, first


def fired_all(w, sc, timeout: float = 90) -> None:
    """Until ``w`` has fired every trigger of the window on each of the 4 repartition partitions."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if w.metric("dpstream_triggers_fired_total", query=sc.query) >= sc.triggers * 4:
                return
        except OSError:  # a worker busy firing overdue triggers may answer a scrape late: ask again
            pass
        time.sleep(0.3)


@pytest.mark.broker
@pytest.mark.slow
def test_a_lost_volume_is_refused_then_reset_starts_over_under_a_new_noise_label(tmp_path, broker):
    from confluent_kafka.admin import AdminClient

    from dpstream.topics.kafka import repartition_topic

    with running(tmp_path, broker) as sc:
        w, first = first_run(sc, "one")
        args = ("reset", "--config", str(sc.config), "--app-id", sc.app_id, "--state-dir", str(w.state_dir),
                "--broker", broker)
        busy = cli(*args, "--yes")  # a running worker's application is not started over under it
        assert busy.returncode == 2 and "stop them first" in busy.stderr
        assert (w.state_dir / "worker-layout.json").exists()
        w.stop()

        shutil.rmtree(w.state_dir)  # the volume is lost: refused, and the refusal says how to go on
        w.start()
        assert w.proc.wait(90) != 0
        log = w.log.read_text()
        assert "state was lost" in log and "dpstream reset" in log and f"--app-id {sc.app_id}" in log
        assert "budget.epoch" in log

        dry = cli(*args)
        assert dry.returncode == 0 and "with --yes" in dry.stderr  # a dry run that printed its plan succeeded
        # it says what the operator chooses: outputs kept, and privacy loss that adds up (issue 32)
        assert f"would keep output topic(s) {sc.output}" in dry.stdout and "privacy loss adds up" in dry.stdout
        admin = AdminClient({"bootstrap.servers": broker})
        assert repartition_topic(sc.query, sc.app_id) in admin.list_topics(timeout=10).topics  # nothing was deleted
        done = cli(*args, "--yes")
        assert done.returncode == 0, done.stderr
        assert f"delete topic {repartition_topic(sc.query, sc.app_id)}" in done.stdout
        assert f"keep output topic(s) {sc.output}" in done.stdout and "privacy loss adds up" in done.stdout
        assert "output topics and their releases are kept" in done.stderr
        assert repartition_topic(sc.query, sc.app_id) not in admin.list_topics(timeout=10).topics

        # the same command line starts afresh, reads the input from its start and fires the
        # (past) window's triggers: exactly replay's releases under the new label
        w.log.write_text("")
        w.start()
        w.wait_ready()
        fired_all(w, sc)
        label = sc.noise_label()  # as its status page shows it: a new run of start-over 1
        assert label.startswith(f"worker:{sc.app_id}:1.restart1:") and label != first[0]["run"]["noise_label"]
        second = sc.replay(label)
        published = sc.published(first + second)
        assert canonical(published) == canonical(first) | canonical(second)
        # on the same output topic (the application's claim was kept), each release names its run
        assert runs(published) == {(sc.app_id, first[0]["run"]["noise_label"]), (sc.app_id, label)}
        assert {r["run"]["restarts"] for r in published if r["run"]["noise_label"] == label} == {1}
        # new noise: the same (window, key, trigger) released again carries another value
        slot = lambda r: (r["window_start"], r["key"], r["trigger"])  # noqa: E731
        old = {slot(r): r["count"] for r in first}
        again = [(old[slot(r)], r["count"]) for r in second if slot(r) in old]
        assert again and sum(a != b for a, b in again) > len(again) // 2


@pytest.mark.broker
@pytest.mark.slow
def test_a_new_app_id_on_the_same_broker_reads_only_its_own_stage_one_records(tmp_path, broker):
    """The lost-state refusal names a new --app-id, with output topics of its own, as a way to
    start over. That application's fresh state must take in only its own stage 1's records: with
    one repartition topic per query name it also read the first application's, and released a
    window it never read. On the first application's output topic it is refused (issue 32: the
    two applications' values sat under the same keys)."""
    with running(tmp_path, broker) as sc:
        w, first = first_run(sc, "a")
        w.stop()

        # the second application: same query name, its own input topic and events
        first_app, sc.app_id = sc.app_id, sc.app_id + "-2"
        old_input, sc.input = sc.input, sc.input + "-2"
        sc.config.write_text(sc.config.read_text().replace(f"input_topic: {old_input}", f"input_topic: {sc.input}"))
        refused = sc.worker("b").start()
        assert refused.proc.wait(120) == 2
        said = refused.log.read_text()
        assert f"output topic {sc.output} belongs to application '{first_app}'" in said and "--delete-outputs" in said
        assert canonical(sc.read(sc.output)) == canonical(first)  # it wrote nothing there

        old_output, sc.output = sc.output, sc.output + "-2"
        sc.config.write_text(sc.config.read_text().replace(f"output_topic: {old_output}", f"output_topic: {sc.output}"))
        refused.log.write_text("")
        w2 = sc.worker("b").start()
        sc.workers.append(w2)
        w2.wait_ready()
        sc.write_events(3_000, users=300, keys=10, lead_s=3, seed=12)
        assert sc.produce_events() == 3_000
        sc.wait_for_window_end()
        second = sc.replay()
        assert second and {r["window_start"] for r in second}.isdisjoint({r["window_start"] for r in first})
        # exactly its own releases: none for the first application's window
        assert canonical(sc.published(second)) == canonical(second)
