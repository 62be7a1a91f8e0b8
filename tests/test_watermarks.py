"""Triggers fire on the input watermark (docs/privacy.md, "Time"): the attacks of issue 15's lost
release. A worker that was down, or behind, across trigger times must read its backlog before it
fires; no partition's clock runs ahead of what has been read; nothing a record claims moves it past
the wall clock; late records are dead-lettered."""

import base64
import json

from dpstream.processor.adapters.worker import (
    CREATE_TIME,
    LOG_APPEND_TIME,
    DpstreamWorker,
    Ownership,
)
from dpstream.topics.kafka import DEAD_LETTER_TOPIC
from dpstream.topics.partitioner import partition_for
from tests.conftest import TEST_RUN_NONCE, TEST_SECRET, Record
from tests.test_worker_service import START, WINDOW_MS, config, events, stage_two

END = START + 10 * WINDOW_MS  # a wall clock past every trigger of the workload


def two_partition_worker(path, delay_ms: int = 2000) -> DpstreamWorker:
    return DpstreamWorker(config(), TEST_SECRET, path, Ownership(), {"in": 2}, 2, watermark_delay_ms=delay_ms,
                          run_nonce=TEST_RUN_NONCE)


def split(records: list[Record], stamps: int = LOG_APPEND_TIME) -> dict[int, list[Record]]:
    """The workload as a 2-partition input topic holds it (by user, murmur2), with offsets;
    ``stamps``: who stamped the Kafka timestamps (the broker, by default, as on the topics the
    worker creates)."""
    parts = partition_for([r.key for r in records], 2).tolist()
    out: dict[int, list[Record]] = {0: [], 1: []}
    for r, p in zip(records, parts):
        out[p].append(Record(len(out[p]), r.key, r.value, r.timestamp, stamps))
    return out


def read(worker: DpstreamWorker, partition: int, records: list[Record]) -> None:
    result = worker.process_input("in", partition, records)
    stage_two(worker, result.messages)
    result.commit()


def announce(worker: DpstreamWorker, now_ms: int, ends: dict) -> None:
    for _ in range(3):  # by-user markers, then what they let stage 1 announce to stage 2
        stage_two(worker, worker.watermark_messages(now_ms, read_to_end=ends))


def releases(fired) -> dict:
    return {(r["window_start"], r["trigger"], json.dumps(r["key"])): r["count"] for f in fired for r in f.releases}


def test_a_partition_not_yet_read_holds_back_every_trigger_and_its_backlog_is_then_on_time(tmp_path):
    parts = split(events(4000))
    ref = two_partition_worker(tmp_path / "ref")
    for p in (0, 1):
        read(ref, p, parts[p])
    announce(ref, END, {("in", 0): END, ("in", 1): END})
    expected = releases(ref.fire_due(END))
    ref.close()
    assert expected

    w = two_partition_worker(tmp_path / "w")
    read(w, 0, parts[0])
    announce(w, END, {("in", 0): END})  # partition 1 is down: it announces nothing
    assert w.fire_due(END) == [], "no trigger may fire before every input partition is read past it"
    assert w.fire_due(END + 100 * WINDOW_MS) == [], "however late the wall clock"
    # partition 1's backlog is read long after its triggers' fire times: on time by its own timestamps
    read(w, 1, parts[1])
    announce(w, END, {("in", 0): END, ("in", 1): END})
    got = releases(w.fire_due(END))
    assert sum(p.stats.dropped["late"] for p in w.pipelines()) == 0
    assert got == expected
    w.close()


def test_triggers_fire_in_step_with_the_slowest_partition(tmp_path):
    parts = split(events(4000))
    w = two_partition_worker(tmp_path / "w", delay_ms=0)
    read(w, 0, parts[0])
    announce(w, END, {("in", 0): END})
    # partition 1 read up to the middle of the window: its watermark is its newest Kafka timestamp
    half = [r for r in parts[1] if r.timestamp < START + WINDOW_MS // 2]
    read(w, 1, half)
    announce(w, END, {})
    fired = w.fire_due(END)
    fire_time = {f.trigger: START + f.trigger * WINDOW_MS // 4 + 1000 for f in fired}
    assert fired and all(t <= half[-1].timestamp for t in fire_time.values())
    assert max(f.trigger for f in fired) < 4, "later triggers wait for partition 1"
    w.close()


def test_no_timestamp_moves_the_watermark_past_the_wall_clock(tmp_path):
    """One record stamped a year ahead (even by a broker whose clock is wrong) must not fire
    anything early."""
    parts = split(events(2000))
    w = two_partition_worker(tmp_path / "w")
    now = START + WINDOW_MS // 8  # before the first trigger's fire time
    for p in (0, 1):
        future = Record(len(parts[p]), parts[p][0].key, parts[p][0].value, START + 365 * 86_400_000, LOG_APPEND_TIME)
        read(w, p, [r for r in parts[p] if r.timestamp <= now] + [future])
        announce(w, now, {("in", p): now})
    assert w.fire_due(now) == []
    clock = w.stage_two_clock(next(iter(w.stage2.values())), now)
    assert clock is not None and clock <= now - 2000
    w.close()


def test_a_producers_stamp_never_lifts_a_lagging_partitions_watermark(tmp_path):
    """The attack on a CreateTime topic: partition 1 lags (its backlog is half read) when one
    producer's record, stamped ahead yet on time for its own trigger and not past the wall clock,
    is read there. If that stamp lifted partition 1's watermark, the triggers before it would
    fire, and the other users' unread records would then be late: their counts would depend on
    one user's record. Only the broker's stamps (LogAppendTime) and a partition read to its end
    move a watermark."""
    parts = split(events(4000), stamps=CREATE_TIME)
    half = len(parts[1]) // 2
    first = json.loads(parts[1][0].value)
    last_trigger_fires = START + WINDOW_MS + 1000  # the last trigger's time plus allowed_lateness (1 s)
    ahead = Record(half, parts[1][0].key, json.dumps({**first, "ts": START + WINDOW_MS - 1}).encode(), last_trigger_fires - 1)
    backlog = parts[1][:half] + [ahead] + [Record(r.offset + 1, r.key, r.value, r.timestamp) for r in parts[1][half:]]

    ref = two_partition_worker(tmp_path / "ref")
    read(ref, 0, parts[0])
    read(ref, 1, backlog)
    announce(ref, END, {("in", 0): END, ("in", 1): END})
    expected = releases(ref.fire_due(END))
    ref.close()

    w = two_partition_worker(tmp_path / "w")
    read(w, 0, parts[0])
    read(w, 1, backlog[: half + 1])
    announce(w, END, {("in", 0): END})  # partition 1 has not been read to its end
    assert w.fire_due(END) == [], "a producer's stamp moved partition 1's watermark"
    read(w, 1, backlog[half + 1:])  # the rest of its backlog: on time by its own stamps
    announce(w, END, {("in", 0): END, ("in", 1): END})
    got = releases(w.fire_due(END))
    assert sum(p.stats.dropped["late"] for p in w.pipelines()) == 0
    assert got == expected
    w.close()


def test_a_brokers_stamps_move_the_watermark_with_the_reading(tmp_path):
    """LogAppendTime stamps rise with the offsets, so the newest one read says how far the
    partition has been read: a backlog's triggers fire as it is read, before it is read to its end."""
    parts = split(events(4000), stamps=LOG_APPEND_TIME)
    w = two_partition_worker(tmp_path / "w", delay_ms=0)
    read(w, 0, parts[0])
    read(w, 1, parts[1][: len(parts[1]) // 2])
    announce(w, END, {("in", 0): END})
    assert w.fire_due(END), "the broker's stamps read from partition 1 fire the triggers they pass"
    w.close()


def test_only_committed_progress_is_announced(tmp_path):
    parts = split(events(2000))
    w = two_partition_worker(tmp_path / "w")
    result = w.process_input("in", 0, parts[0])  # processed, sent, not yet acknowledged
    assert w.watermark_messages(END) == [], "an uncommitted batch's timestamps must not be announced"
    result.commit()
    marks = w.watermark_messages(END)
    assert marks and {m.partition for m in marks} == {0, 1}  # to every repartition partition
    assert w.watermark_messages(END) == [], "announced once; again only when it moves"
    w.close()


def test_announced_watermarks_survive_a_restart(tmp_path):
    parts = split(events(2000))
    w = two_partition_worker(tmp_path / "w")
    read(w, 0, parts[0])
    read(w, 1, parts[1])
    announce(w, END, {("in", 0): END, ("in", 1): END})
    before = {k: s.watermarks for k, s in w.stage2.items()}
    w.close()
    w = two_partition_worker(tmp_path / "w")  # a new process: nothing read, nothing announced yet
    assert {k: s.watermarks for k, s in w.stage2.items()} == before
    assert w.fire_due(END), "the stored watermarks fire what is due"
    w.close()


def test_late_records_are_dead_lettered_with_reason_and_bytes(tmp_path):
    parts = split(events(2000))
    w = two_partition_worker(tmp_path / "w")
    # produced (Kafka timestamp) after its window's last trigger fired: late
    late = [Record(r.offset, r.key, r.value, START + 2 * WINDOW_MS) for r in parts[0][:5]]
    result = w.process_input("in", 0, late)
    letters = [json.loads(m.value) for m in result.messages if m.topic == DEAD_LETTER_TOPIC]
    assert len(letters) == 5 and all(d["reason"].startswith("late") for d in letters)
    assert {base64.b64decode(d["original_b64"]) for d in letters} == {r.value for r in late}
    assert {d["source"] for d in letters} == {f"in/0@{r.offset}" for r in late}
    w.close()
