"""The worker's processing without a broker: the failure rules of docs/privacy.md, "Failures" under
at-least-once delivery, exercised deterministically (the Kafka tests do it with a real broker)."""

import json

import numpy as np
import pytest

from dpstream.processor.adapters.worker import (
    DpstreamWorker,
    Ownership,
    StateLayoutError,
)
from dpstream.processor.config import DpstreamConfig
from dpstream.processor.engine.pipeline import BoundedRecords
from dpstream.topics.kafka import DEAD_LETTER_TOPIC, repartition_topic
from tests.conftest import TEST_RUN_NONCE, TEST_SECRET, Record

WINDOW_MS = 40_000
START = 1_800_000_000_000 - 1_800_000_000_000 % WINDOW_MS


def config(**overrides) -> DpstreamConfig:
    q = dict(name="clicks", input_topic="in", output_topic="out", window="40s", triggers=4, allowed_lateness="1s",
             contribution_bound=3, epsilon=6, delta=1e-9, key_threshold=0)
    q.update(overrides)
    return DpstreamConfig(queries=[q])


def events(n: int, seed: int = 3) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        user = f"u{rng.integers(0, n // 8)}"
        key = f"k{min(int(rng.pareto(1.0)), 30)}"
        ts = START + i * WINDOW_MS // n
        # produced at its event time (the record's Kafka timestamp): on time, not in the future
        out.append(Record(i, user.encode(), f'{{"user_id":"{user}","key":"{key}","ts":{ts}}}'.encode(), ts))
    return out


def make_worker(path, cfg=None, ownership=Ownership(), repartitions=2, previous_mark=None,
                run_nonce=TEST_RUN_NONCE) -> DpstreamWorker:
    """A worker of the test application's run (``run_nonce``; None: the state directory's, else a new run's)."""
    return DpstreamWorker(cfg or config(), TEST_SECRET, path, ownership, {"in": 1}, repartitions, previous_mark=previous_mark,
                          run_nonce=run_nonce)


def stage_two(worker: DpstreamWorker, messages, first_offset=None) -> None:
    """Deliver stage-1 output as a broker would: per partition, increasing offsets (after the
    partition's committed one, unless ``first_offset`` says where to start). Stage 2's records to
    stage 2; events sent to another input partition (its by-user topic) to that partition's stage
    1, whose own output is delivered in turn."""
    offsets: dict = {}
    for m in messages:
        if m.topic == DEAD_LETTER_TOPIC:
            continue
        key = (m.topic, m.partition)
        if key in worker.lanes:
            source = worker.lanes[key]
            offset = offsets.get(key, source.lane_offset(m.topic) + 1)
            offsets[key] = offset + 1
            result, _ = worker.process_stage_one(source, {m.topic: [Record(offset, m.key, m.value, 0)]})
            if result is not None:
                result.commit()
                stage_two(worker, result.messages)
            continue
        start = worker.stage2[key].last_offset + 1 if first_offset is None else first_offset
        offset = offsets.get(key, start)
        offsets[key] = offset + 1
        result = worker.process_repartitioned(m.topic, m.partition, [Record(offset, m.key, m.value, 0)])
        if result is not None:
            result.commit()


def announce(worker: DpstreamWorker, now_ms: int) -> None:
    """Every owned input partition has been read to its end at ``now_ms``: its watermark markers
    reach stage 2 (as the worker's timer sends them, tick after tick: the markers on the by-user
    topics first, then those they let stage 1 announce to stage 2)."""
    for _ in range(3):
        stage_two(worker, worker.watermark_messages(now_ms, read_to_end=dict.fromkeys(worker.stage1, now_ms)))


def fire(worker: DpstreamWorker, now_ms: int):
    announce(worker, now_ms)
    return worker.fire_due(now_ms)


def all_releases(worker: DpstreamWorker) -> dict:
    fired = fire(worker, START + 10 * WINDOW_MS)
    return {(r["window_start"], r["trigger"], r["key"]): r["count"] for f in fired for r in f.releases}


def counted_per_user(messages) -> dict:
    """(user, slot) pairs that reach stage 2, by user pseudonym, after its de-duplication."""
    pairs = set()
    for m in messages:
        if m.topic != DEAD_LETTER_TOPIC:
            b = BoundedRecords.decode(m.value)
            pairs.update(zip(b.users.tolist(), b.slots.tolist(), b.trigger.tolist()))
    per_user: dict = {}
    for user, slot, _ in pairs:
        per_user.setdefault(user, set()).add(slot)
    return per_user


def reference_releases(path, records) -> dict:
    """What one worker releases from ``records`` with no crash."""
    ref = make_worker(path)
    out = ref.process_input("in", 0, records)
    out.commit()
    stage_two(ref, out.messages)
    expected = all_releases(ref)
    ref.close()
    assert expected, "the workload must release something"
    return expected


def test_crash_between_send_and_commit_resends_identical_records_and_counts_them_once(tmp_path):
    records = events(4000)
    expected = reference_releases(tmp_path / "ref", records)

    # crash: stage 1 sent its output but died before committing the user counts
    w = make_worker(tmp_path / "crash")
    first = w.process_input("in", 0, records[:2500])
    w.close()  # no commit
    w = make_worker(tmp_path / "crash")
    again = w.process_input("in", 0, records)  # the broker redelivers from the last committed offset
    again.commit()
    # the re-sent copy of every record carries the same (user, slot): the same bytes per record
    assert {m.value for m in first.messages} != set()
    firsts = counted_per_user(first.messages)
    agains = counted_per_user(again.messages)
    assert all(firsts[u] <= agains[u] for u in firsts)
    assert max(len(s) for s in agains.values()) <= 3  # C
    # stage 2 receives both copies; it counts each (user, slot) once
    stage_two(w, first.messages + again.messages, first_offset=0)
    assert all_releases(w) == expected
    assert sum(p.stats.dropped["duplicate"] for p in w.pipelines()) > 0
    w.close()


def test_redelivered_records_at_or_below_the_committed_offset_are_skipped(tmp_path):
    records = events(1000)
    w = make_worker(tmp_path / "s")
    w.process_input("in", 0, records[:600]).commit()
    assert w.stage1[("in", 0)].last_offset == 599
    rest = w.process_input("in", 0, records[:800])  # offsets 0..599 again, then 600..799
    bounded = sum(len(BoundedRecords.decode(m.value)) for m in rest.messages if m.topic != DEAD_LETTER_TOPIC)
    assert bounded <= 200
    assert w.process_input("in", 0, records[:600]) is None
    topic = repartition_topic("clicks")
    assert w.process_repartitioned(topic, 0, []) is None
    w.close()


def test_journaled_releases_are_republished_not_recomputed(tmp_path):
    w = make_worker(tmp_path / "j")
    out = w.process_input("in", 0, events(3000))
    out.commit()
    stage_two(w, out.messages)
    fired = fire(w, START + 10 * WINDOW_MS)
    assert any(f.releases for f in fired)
    w.mark_published(fired[0])  # crash after the first trigger reached the output
    w.close()
    w = make_worker(tmp_path / "j")
    again = w.unpublished()
    assert [(f.window, f.trigger, f.releases) for f in again] == [(f.window, f.trigger, f.releases) for f in fired[1:]]
    assert fire(w, START + 10 * WINDOW_MS) == []  # nothing fires twice
    w.close()


def test_malformed_records_are_dead_lettered_with_reason_and_bytes_and_a_mis_keyed_one_is_counted(tmp_path):
    import base64
    import json

    w = make_worker(tmp_path / "d")
    good = events(10)
    bad = [Record(10, b"u1", b"{not json", 0), Record(11, b"u1", b'{"user_id":"u1","ts":5}', 0),
           Record(12, b"someone-else", good[0].value, good[0].timestamp), Record(13, None, None, 0)]
    out = w.process_input("in", 0, good + bad)
    letters = [json.loads(m.value) for m in out.messages if m.topic == DEAD_LETTER_TOPIC]
    assert [base64.b64decode(d["original_b64"]) for d in letters] == [b"{not json", b'{"user_id":"u1","ts":5}', b""]
    reasons = [d["reason"] for d in letters]
    assert reasons[0] == "not valid JSON" and "'key'" in reasons[1]
    assert all("u1" not in r and "someone-else" not in r for r in reasons)  # reasons never quote content
    assert sum(p.stats.dropped["malformed"] for p in w.pipelines()) == 3
    # issue 31: the message key is not the user's, but the record is on its user's partition: counted
    assert sum(p.stats.events_in for p in w.pipelines()) == 14
    w.close()


def test_dropped_events_are_reported_once_per_period_with_count_and_cause_never_content(tmp_path):
    """Issue 31: a stock producer's records were dead-lettered by the thousand with nothing in
    the worker's log. Every reason gets a line per report period: the count since the last line
    and the likely cause; input problems are warnings, the bounds at work info; no content."""
    import logging

    from dpstream.processor.adapters.drop_report import DropReport

    w = make_worker(tmp_path / "d")
    name = next(iter(w.pipelines())).query.name
    good = events(10)
    bad = [Record(10, b"u1", b"{not json", 0), Record(11, b"u1", b'{"key":"k","ts":5}', 0)]
    w.process_input("in", 0, good + bad).commit()
    report = DropReport("murmur2")
    said = report.lines(w.dropped_counts())
    info = [line for level, line in said if level == logging.INFO]
    assert len(info) == 1 and "dropped as contribution_bound (users over the query's contribution bound" in info[0]
    lines = [(level, line) for level, line in said if level != logging.INFO]
    assert [level for level, _ in lines] == [logging.WARNING]
    assert lines[0][1].startswith(f"query {name}: since the last report, 2 events dropped as malformed (")
    assert "a missing or ill-typed field such as 'user_id'" in lines[0][1]
    assert "u1" not in lines[0][1] and "someone-else" not in lines[0][1]  # counts and causes, never content
    assert report.lines(w.dropped_counts()) == []  # nothing new: nothing said
    w.process_input("in", 0, [Record(12, b"u2", b"[]", 0)]).commit()
    assert [line.split(" (")[0] for _, line in report.lines(w.dropped_counts())] == [
        f"query {name}: since the last report, 1 events dropped as malformed"]
    w.close()


def test_a_state_directory_of_another_layout_or_secret_is_refused(tmp_path):
    make_worker(tmp_path / "l", ownership=Ownership(0, 2)).close()
    with pytest.raises(StateLayoutError, match="worker layout"):
        make_worker(tmp_path / "l", ownership=Ownership(0, 1))
    make_worker(tmp_path / "k").close()
    with pytest.raises(RuntimeError, match="different noise secret"):
        DpstreamWorker(config(), b"another-secret-of-enough-length!", tmp_path / "k", Ownership(), {"in": 1}, 2)


def test_two_workers_own_disjoint_partitions():
    assert Ownership(0, 2).partitions(5) == [0, 2, 4]
    assert Ownership(1, 2).partitions(5) == [1, 3]
    with pytest.raises(ValueError):
        Ownership(2, 2)


def test_an_empty_state_directory_under_an_epoch_already_run_is_a_lost_volume(tmp_path):
    """docs/privacy.md, "Failures": volume loss is a new, explicitly configured epoch, never a silent
    reset of the ledger or of what was released."""
    from dpstream.processor.adapters.worker import LostStateError

    first = make_worker(tmp_path / "a")
    mark = {**first.epoch_mark, "since_ms": 1}
    first.close()
    make_worker(tmp_path / "a", previous_mark=mark).close()  # its own state: an ordinary restart
    with pytest.raises(LostStateError, match="state was lost"):
        make_worker(tmp_path / "lost", previous_mark=mark)
    assert not (tmp_path / "lost" / "worker-layout.json").exists()  # nothing written: it refuses again
    with pytest.raises(LostStateError):
        make_worker(tmp_path / "lost", previous_mark=mark)
    # a new epoch (another budget.epoch or another noise secret) may start on an empty directory
    other = {**mark, "budget_epoch": "2027-01"}
    make_worker(tmp_path / "lost", previous_mark=other).close()


def _by_partition(messages) -> dict:
    """Stage-1 output as the repartition topic holds it: per partition, in send order, with offsets."""
    out: dict = {}
    for m in messages:
        if m.topic != DEAD_LETTER_TOPIC:
            part = out.setdefault(m.partition, [])
            part.append(Record(len(part), None, m.value, 0))
    return out


def test_stage_two_batches_of_many_messages_release_what_one_message_at_a_time_does(tmp_path):
    """Stage 2 takes a fetched batch in one call; the releases, drop counts and committed offsets
    are those of one call per message, and a batch redelivered in part applies only what is new."""
    records = events(6000, seed=11)
    outputs = []
    for name in ("single", "batched"):
        w = make_worker(tmp_path / name)
        messages = []
        for lo in range(0, len(records), 700):  # several stage-1 batches: several messages per partition
            res = w.process_input("in", 0, records[lo:lo + 700])
            res.commit()
            messages += res.messages
        topic = repartition_topic("clicks")
        for p, part in _by_partition(messages).items():
            assert len(part) > 3
            if name == "single":
                for r in part:
                    w.process_repartitioned(topic, p, [r]).commit()
            else:
                half = len(part) // 2
                w.process_repartitioned(topic, p, part[:half]).commit()
                again = w.process_repartitioned(topic, p, part)  # redelivered from offset 0: only the rest applies
                assert again.applied == len(part) - half
                again.commit()
                assert w.process_repartitioned(topic, p, part) is None
            assert w.stage2[(topic, p)].last_offset == len(part) - 1
        accumulated = sum(p.stats.accumulated for p in w.pipelines())
        outputs.append((all_releases(w), accumulated))
        w.close()
    assert outputs[0][0], "the workload must release something"
    assert outputs[0] == outputs[1]


def test_a_key_id_collision_in_a_stage_two_batch_names_the_message_that_carried_it(tmp_path, monkeypatch):
    from dpstream.processor.mechanisms.noise import Pseudonymizer

    original = Pseudonymizer.group_keys

    def colliding(self, keys):  # "kz" gets k0's 64-bit id (a real collision is a 2^-64 event)
        keys = list(keys)
        ids = original(self, keys)
        ids[[i for i, k in enumerate(keys) if k == "kz"]] = original(self, ["k0"])[0]
        return ids

    monkeypatch.setattr(Pseudonymizer, "group_keys", colliding)
    w = make_worker(tmp_path / "w", repartitions=1)
    first = events(800, seed=5)
    assert any(b'"key":"k0"' in r.value for r in first)
    intruders = [Record(400 + i, f"z{i}".encode(), f'{{"user_id":"z{i}","key":"kz","ts":{START + WINDOW_MS // 2 + i}}}'.encode(),
                        START + WINDOW_MS // 2 + i) for i in range(5)]
    messages = []
    rest = [Record(r.offset + 5, r.key, r.value, r.timestamp) for r in first[400:]]
    for batch in (first[:400], intruders, rest):  # kz arrives in the second stage-1 batch
        res = w.process_input("in", 0, batch)
        res.commit()
        messages += res.messages
    part = _by_partition(messages)[0]
    assert len(part) == 3
    result = w.process_repartitioned(repartition_topic("clicks"), 0, part)
    letters = [m for m in result.messages if m.topic == DEAD_LETTER_TOPIC]
    bodies = [json.loads(m.value) for m in letters]
    assert len(bodies) == 5 and all(b["reason"].startswith("key id collision") for b in bodies)
    assert {b["source"] for b in bodies} == {f"{repartition_topic('clicks')}/0@1"}
    w.close()


def test_a_log_that_went_back_is_refused_naming_the_partition(tmp_path):
    """Issue 15: a recreated topic or a broker that lost data counted only the records past the old
    offset, silently. The stored offset and topic id are checked against the log."""
    from dpstream.processor.adapters.worker import InputWentBackError

    w = make_worker(tmp_path / "w")
    w.process_input("in", 0, events(500)).commit()
    src = w.stage1[("in", 0)]
    src.check_log(0, 500, "id-A")  # read to the end of the same topic: fine, and the id is recorded
    src.check_log(100, 900, "id-A")  # more records, older ones deleted by retention: fine
    with pytest.raises(InputWentBackError, match=r"in-0: the log ends at offset 30, but this state has read up to offset 499"):
        src.check_log(0, 30, "id-A")  # the broker lost data
    w.close()
    w = make_worker(tmp_path / "w")  # the topic id is kept with the state
    with pytest.raises(InputWentBackError, match=r"in-0: the topic was recreated \(its id is id-B"):
        w.stage1[("in", 0)].check_log(0, 30_002, "id-B")  # recreated, and already longer than before
    w.stage1[("in", 0)].check_log(0, 600, None)  # a broker without topic ids: offsets alone
    w.close()


def test_a_record_read_while_the_log_end_was_asked_is_no_log_that_went_back(tmp_path):
    """Issue 30: the running check asked for the log end, the worker read on meanwhile (the
    record at the old end arrived), and the check compared the old end with the new offset:
    "the log ends at offset 500, but this state has read up to offset 500" stopped a healthy
    static worker. It compares with what the state had read before it asked."""
    from dpstream.processor.adapters.worker import InputWentBackError

    w = make_worker(tmp_path / "w")
    w.process_input("in", 0, events(501)).commit()
    src = w.stage1[("in", 0)]
    src.check_log(0, 500, "id-A", read_to=499)  # asked when the state had read to 499: fine
    with pytest.raises(InputWentBackError, match="the log ends at offset 500, but this state has read up to offset 500"):
        src.check_log(0, 500, "id-A")  # the same end against the state's offset now: a log that went back
    w.close()


def test_large_stage_one_batches_are_split_below_the_brokers_record_limit_and_release_the_same(tmp_path, monkeypatch):
    """Found live on Apache Kafka: at 128k events/s one stage-1 batch made a repartition message
    over the broker's 1 MB limit, and the worker stopped (MSG_SIZE_TOO_LARGE)."""
    import dpstream.processor.adapters.worker as worker_module

    records = events(6000, seed=5)
    whole = make_worker(tmp_path / "whole")
    out = whole.process_input("in", 0, records)
    assert max(len(m.value) for m in out.messages) > 4096
    bounded = sum(len(BoundedRecords.decode(m.value)) for m in out.messages if m.topic != DEAD_LETTER_TOPIC)
    out.commit()
    stage_two(whole, out.messages)
    expected = all_releases(whole)
    whole.close()

    monkeypatch.setattr(worker_module, "REPARTITION_MESSAGE_BYTES", 4096)
    w = make_worker(tmp_path / "split")
    out = w.process_input("in", 0, records)
    data = [m for m in out.messages if m.topic != DEAD_LETTER_TOPIC]
    assert len(data) > 2 * 2 and all(len(m.value) <= 4096 for m in data)
    assert sum(len(BoundedRecords.decode(m.value)) for m in data) == bounded
    out.commit()
    stage_two(w, out.messages)
    assert expected and all_releases(w) == expected
    w.close()
