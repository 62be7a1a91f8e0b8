"""Input from any producer (issue 31): a user's records on any partition, under any message key
or none, are each counted once, and the user at most C times.

Stage 1 bounds a user's contributions in the state of one input partition, the one its user id
maps to under the worker's partitioner (default murmur2, Kafka's). A producer that puts one
user's records on two partitions made the first worker count that user up to 2C; the next one
dead-lettered such records as ``wrong_partition`` (a stock librdkafka producer lost 88% of its
records that way). Now an event read on another partition goes to its user's partition through
the query's by-user topic and is bounded there, in the same state as the user's other events.

The cluster here is simulated (logs per topic-partition, the worker reading each from its
committed offsets, as :mod:`dpstream.processor.adapters.static_run` does); the broker tests are
tests/test_any_producer.py.
"""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.processor.adapters.worker import LOG_APPEND_TIME, DpstreamWorker, Ownership
from dpstream.processor.config import DpstreamConfig
from dpstream.processor.engine.pipeline import BoundedRecords
from dpstream.topics import partitioner
from dpstream.topics.kafka import DEAD_LETTER_TOPIC
from tests.conftest import TEST_RUN_NONCE, TEST_SECRET, Record
from tests.privacy._helpers import START, query

C = 3


def murmur2(data: bytes) -> int:
    """Kafka's Utils.murmur2, written here from the Java source independently of the product."""
    m, r = 0x5BD1E995, 24
    length = len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[length - length % 4:]
    if len(tail) >= 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if len(tail) >= 1:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def kafka_partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def test_reference_murmur2_matches_kafkas_own_test_vectors():
    # org.apache.kafka.common.utils.UtilsTest#testMurmur2
    vectors = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536,
               b"a-little-bit-longer-string": -1486304829, b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
               b"abc": 479470107}
    for key, expected in vectors.items():
        assert murmur2(key) == expected


@settings(deadline=None, derandomize=True, max_examples=60)
@given(keys=st.lists(st.binary(max_size=40), min_size=1, max_size=50), partitions=st.integers(1, 64))
def test_worker_partitioner_agrees_with_kafka_murmur2(keys, partitions):
    got = partitioner.partition_for(keys, partitions, "murmur2").tolist()
    assert got == [kafka_partition(k, partitions) for k in keys]


def config(**overrides) -> DpstreamConfig:
    return DpstreamConfig(queries=[query(input_topic="in", output_topic="out", window="40s", triggers=4, allowed_lateness="1s",
                                         contribution_bound=C, **overrides)])


def make_worker(path, partitions: int, **overrides) -> DpstreamWorker:
    return DpstreamWorker(config(**overrides), TEST_SECRET, path, Ownership(), {"in": partitions}, 2, run_nonce=TEST_RUN_NONCE)


def body(user: str, key: str, ts: int) -> bytes:
    return json.dumps({"user_id": user, "key": key, "ts": ts}).encode()


class Cluster:
    """Topic-partition logs as a broker keeps them, read by one worker from its committed offsets."""

    def __init__(self, worker: DpstreamWorker):
        self.w = worker
        self.logs: dict = defaultdict(list)
        self.dead: list = []

    def produce(self, partition: int, key, value: bytes, stamp: int) -> None:
        log = self.logs[("in", partition)]
        log.append(Record(len(log), key, value, stamp, LOG_APPEND_TIME))

    def send(self, messages) -> None:
        for m in messages:
            if m.topic == DEAD_LETTER_TOPIC:
                self.dead.append(json.loads(m.value))
                continue
            log = self.logs[(m.topic, m.partition)]
            log.append(Record(len(log), m.key, m.value, 0))

    def unread(self, key, offset: int, limit=None) -> list:
        records = self.logs[key][offset + 1:]
        return records[:limit] if limit is not None else records

    def stage_one_items(self, limit=None) -> list:
        items = []
        for key, src in [*self.w.stage1.items(), *self.w.lanes.items()]:
            records = self.unread(key, src.lane_offset(key[0]), limit)
            if records:
                items.append((key[0], key[1], records, src))
        return items

    def step(self, limit=None) -> bool:
        """One stage-1 and one stage-2 batch of every partition (``limit``: records per
        partition); whether anything was read."""
        items = self.stage_one_items(limit)
        results, _ = self.w.process_batch("stage1", items)
        for r in results:
            self.send(r.messages)
            r.commit()
        moved = bool(items)
        for key, src in self.w.stage2.items():
            records = self.unread(key, src.last_offset, limit)
            if records:
                moved = True
                r = self.w.process_repartitioned(key[0], key[1], records)
                if r is not None:
                    self.send(r.messages)
                    r.commit()
        return moved

    def drain(self, now_ms: int, rng=None) -> None:
        """Read everything, with the timer's watermarks, until nothing moves."""
        for _ in range(1000):
            limit = None if rng is None else int(rng.integers(1, 5))
            moved = self.step(limit)
            marks = self.w.watermark_messages(now_ms, read_to_end=dict.fromkeys(self.w.stage1, now_ms))
            self.send(marks)
            if not moved and not marks:
                return
        raise AssertionError("the cluster did not settle")

    def kept_per_user(self) -> dict:
        """What stage 2 counts per user: one record per (user, slot) of a micro-batch
        (docs/privacy.md, "Failures"), summed over the micro-batches."""
        seen = set()
        for (topic, _), log in self.logs.items():
            if topic.endswith("-by-key"):
                for r in log:
                    if r.key is None:
                        b = BoundedRecords.decode(r.value)
                        seen |= set(zip(b.users.tolist(), b.slots.tolist(), b.window.tolist(), b.trigger.tolist()))
        per_user: dict = defaultdict(int)
        for user, *_ in seen:
            per_user[user] += 1
        return dict(per_user)


def releases(worker: DpstreamWorker, now_ms: int) -> dict:
    return {(r["window_start"], r["trigger"], json.dumps(r["key"])): r["count"] for f in worker.fire_due(now_ms) for r in f.releases}


END = START + 10 * 40_000


@pytest.mark.parametrize("partitions", [2, 3, 8])
def test_a_user_spread_over_every_partition_is_counted_exactly_c_times_with_nothing_dead_lettered(tmp_path, partitions):
    cluster = Cluster(make_worker(tmp_path / "w", partitions))
    try:
        users = [f"user-{i}" for i in range(6)]
        for user in users:
            right = kafka_partition(user.encode(), partitions)
            for n, p in enumerate([(right + 1) % partitions, right, (right + 1) % partitions] * C):
                cluster.produce(p, user.encode(), body(user, "k0", START + 1000 + n), START + 1000 + n)
        cluster.drain(END)
        kept = cluster.kept_per_user()
        assert len(kept) == len(users)
        assert set(kept.values()) == {C}, "every user at the bound, none beyond: one state bounds each user"
        assert cluster.dead == []
        stats = [p.stats for p in cluster.w.pipelines()]
        assert sum(s.events_in for s in stats) == len(users) * 3 * C, "every event counted once"
        assert sum(s.dropped["contribution_bound"] for s in stats) == len(users) * 2 * C
        assert cluster.w.metrics.rerouted.labels("clicks")._value.get() == (len(users) * 2 * C if partitions > 1 else 0)
    finally:
        cluster.w.close()


KINDS = ("good", "not_json", "no_key_field", "mis_keyed", "null_key", "wrong_partition")


@settings(deadline=None, derandomize=True, max_examples=30)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=40))
def test_each_record_of_a_mixed_batch_meets_its_own_fate_in_any_order(tmp_path_factory, kinds):
    """A batch mixing good, malformed, mis-keyed, keyless and misplaced records, in any order:
    only the records that do not parse are dead-lettered; every other one is counted once,
    wherever its partition and whatever its message key."""
    partitions, here = 2, 0
    users = [f"user-{i}" for i in range(200)]
    mine = [u for u in users if kafka_partition(u.encode(), partitions) == here]
    theirs = [u for u in users if kafka_partition(u.encode(), partitions) != here]
    cluster = Cluster(make_worker(tmp_path_factory.mktemp("w"), partitions))
    expected = []
    for i, kind in enumerate(kinds):
        user = (theirs if kind == "wrong_partition" else mine)[i]
        ts = START + 1000 + i
        value, key = body(user, f"k{i % 3}", ts), user.encode()
        if kind == "not_json":
            value = b"{not json"
        elif kind == "no_key_field":
            value = json.dumps({"user_id": user, "ts": ts}).encode()
        elif kind == "mis_keyed":
            key = mine[i + 1].encode()
        elif kind == "null_key":
            key = None
        cluster.produce(here, key, value, ts)
        expected.append("malformed" if kind in ("not_json", "no_key_field") else "counted")
    try:
        cluster.drain(END)
        fates = ["malformed" if f"in/{here}@{r.offset}" in {d["source"] for d in cluster.dead} else "counted"
                 for r in cluster.logs[("in", here)]]
        assert fates == expected
        assert sum(cluster.kept_per_user().values()) == expected.count("counted")
        stats = [p.stats for p in cluster.w.pipelines()]
        assert sum(s.dropped["malformed"] for s in stats) == expected.count("malformed")
        assert sum(s.events_in for s in stats) == len(kinds)
    finally:
        cluster.w.close()


@settings(deadline=None, derandomize=True, max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), partitions=st.integers(2, 4), users=st.integers(80, 200))
def test_releases_equal_those_of_the_same_records_each_on_its_users_partition(tmp_path_factory, seed, partitions, users):
    """Records on random partitions under random message keys (a user id, another's, none), read
    in random batch sizes with the by-user topics in between: the same releases, to the last
    noisy count, as the same records written by a murmur2 producer keyed by user. Each user has
    at most C records, on distinct keys, so every one is admitted whatever the order."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(users):
        user = f"user-{u}"
        for j in range(int(rng.integers(1, C + 1))):
            ts = START + int(rng.integers(0, 40_000))
            rows.append((user, f"k{(u + j) % 5}", ts))
    rows.sort(key=lambda r: r[2])
    scattered = Cluster(make_worker(tmp_path_factory.mktemp("s"), partitions, epsilon=20.0, delta=1e-3))
    placed = Cluster(make_worker(tmp_path_factory.mktemp("p"), partitions, epsilon=20.0, delta=1e-3))
    try:
        for user, key, ts in rows:
            message_key = [user.encode(), f"user-{int(rng.integers(0, users))}".encode(), None][int(rng.integers(0, 3))]
            scattered.produce(int(rng.integers(0, partitions)), message_key, body(user, key, ts), ts)
            placed.produce(kafka_partition(user.encode(), partitions), user.encode(), body(user, key, ts), ts)
        scattered.drain(END, rng)
        placed.drain(END)
        expected = releases(placed.w, END)
        assert expected
        assert releases(scattered.w, END) == expected
    finally:
        scattered.w.close()
        placed.w.close()


def test_records_on_the_right_partition_take_todays_path(tmp_path):
    cluster = Cluster(make_worker(tmp_path / "w", 4))
    try:
        for i in range(40):
            user = f"u{i}"
            cluster.produce(kafka_partition(user.encode(), 4), user.encode(), body(user, "k0", START + 1000 + i), START + 1000 + i)
        cluster.step()
        assert not any(log for (topic, _), log in cluster.logs.items() if topic.endswith("-by-user")), "no by-user topic"
        assert sum(cluster.kept_per_user().values()) == 40
    finally:
        cluster.w.close()


def crash_scenario(tmp_path, exactly_once: bool):
    """User u's home is partition 0. Its record L (trigger 2) was read on partition 1 and sent to
    partition 0's by-user topic; then one batch of partition 0 bounds its records in1 (trigger
    1), in2 (trigger 3) and L together, sends the bounded records, and the worker crashes before
    it commits. The restarted worker's consumer fetches in1 and L first, in2 later."""
    user = next(f"u{i}" for i in range(100) if kafka_partition(f"u{i}".encode(), 2) == 0)
    first = make_worker(tmp_path / "w", 2)
    cluster = Cluster(first)
    cluster.produce(1, user.encode(), body(user, "kL", START + 15_000), START + 15_000)
    cluster.step()  # partition 1 sends L to partition 0's by-user topic (committed)
    lane = first.rerouting_topic("clicks")
    assert len(cluster.logs[(lane, 0)]) == 1
    cluster.produce(0, user.encode(), body(user, "k1", START + 5_000), START + 5_000)
    cluster.produce(0, user.encode(), body(user, "k3", START + 25_000), START + 25_000)
    source = first.stage1[("in", 0)]
    items = cluster.stage_one_items()
    results, _ = first.process_batch("stage1", [it for it in items if it[3] is source])
    (result,) = results
    progress = first.progress_message(result)
    if not exactly_once:
        source.write_plan(result.offsets())
    cluster.send(result.messages)  # delivered; the worker dies before result.commit()
    first.close()
    second = make_worker(tmp_path / "w", 2)
    cluster.w = second
    if exactly_once:
        second.resume({progress.key.decode().split("/", 1)[1]: json.loads(progress.value)})
    return cluster, second, lane, user


def test_at_least_once_a_crash_replays_the_last_batch_in_its_lane_order_so_no_user_passes_c(tmp_path):
    """Without the replay order, in1 and L take slots 1 and 2 on the second try (3 and 2 the
    first time), in2 slot 3 (2 the first time): stage 2 sees (u, 2) and (u, 3) in both L's and
    in2's micro-batches and counts the user 5 times."""
    cluster, second, lane, user = crash_scenario(tmp_path, exactly_once=False)
    try:
        source = second.stage1[("in", 0)]
        assert source.replay and source.replay_sends
        # the consumer's first fetch: in1 and L (in2 not yet)
        items = [("in", 0, cluster.unread(("in", 0), -1, 1), source), (lane, 0, cluster.unread((lane, 0), -1), source)]
        results, again = second.process_batch("stage1", items)
        assert [(t, len(r)) for t, _, r, _ in again] == [(lane, 1)], "L waits for in2, as it came after it"
        for r in results:
            cluster.send(r.messages)
            r.commit()
        cluster.drain(END)
        assert cluster.kept_per_user() == {second.pseudonyms.encoded_users([user.encode()])[0]: C}
        assert not source.replay
    finally:
        second.close()


def test_exactly_once_a_delivered_batch_goes_into_the_state_in_its_lane_order_with_nothing_sent_again(tmp_path):
    cluster, second, lane, user = crash_scenario(tmp_path, exactly_once=True)
    try:
        source = second.stage1[("in", 0)]
        assert source.replay and not source.replay_sends
        before = {k: len(v) for k, v in cluster.logs.items()}
        items = [("in", 0, cluster.unread(("in", 0), -1, 1), source), (lane, 0, cluster.unread((lane, 0), -1), source)]
        results, again = second.process_batch("stage1", items)
        assert results == [] and again, "in1 into the state, L handed back until in2 is read"
        results, again = second.process_batch("stage1", [("in", 0, cluster.unread(("in", 0), source.last_offset), source),
                                                         *[(lane, 0, recs, source) for _, _, recs, _ in again]])
        assert results == [] and again == []
        assert {k: len(v) for k, v in cluster.logs.items()} == before, "nothing delivered is sent again"
        assert not source.replay and source.lane_offset(lane) == 0 and source.last_offset == 1
        # the user is at its bound in the state: a fourth record is refused as over it
        cluster.produce(0, user.encode(), body(user, "k4", START + 35_000), START + 35_000)
        cluster.drain(END)
        assert cluster.kept_per_user() == {second.pseudonyms.encoded_users([user.encode()])[0]: C}
    finally:
        second.close()


def test_a_replay_plan_naming_a_lane_of_a_removed_query_does_not_hold_the_partition_back(tmp_path):
    w = make_worker(tmp_path / "w", 2)
    source = w.stage1[("in", 0)]
    source.write_plan({"in": 0, "dpstream-gone-by-user": 5})  # the query of that lane was removed since
    w.close()
    cluster = Cluster(make_worker(tmp_path / "w", 2))
    try:
        user = next(f"u{i}" for i in range(100) if kafka_partition(f"u{i}".encode(), 2) == 0)
        for n in range(3):
            cluster.produce(0, user.encode(), body(user, f"k{n}", START + 1000 + n), START + 1000 + n)
        cluster.drain(END)
        assert not cluster.w.stage1[("in", 0)].replay and cluster.w.stage1[("in", 0)].last_offset == 2
        assert sum(cluster.kept_per_user().values()) == 3
    finally:
        cluster.w.close()


def test_a_far_future_or_late_event_that_takes_the_by_user_topic_is_refused_there_and_moves_nothing(tmp_path):
    """Lateness and the future check go by each event's own Kafka timestamp wherever it is
    bounded: an event dated hours after its stamp, and one stamped after its trigger fired, both
    read on another partition than their user's, are dead-lettered by that partition as future
    and late, naming where they were read, and the releases are those of the stream without them."""
    user = next(f"u{i}" for i in range(100) if kafka_partition(f"u{i}".encode(), 2) == 0)
    plain, attacked = Cluster(make_worker(tmp_path / "a", 2)), Cluster(make_worker(tmp_path / "b", 2))
    try:
        for cluster in (plain, attacked):
            for i in range(300):
                u = f"user-{i}"
                ts = START + 100 * i
                cluster.produce(kafka_partition(u.encode(), 2), u.encode(), body(u, f"k{i % 4}", ts), ts)
        first = len(attacked.logs[("in", 1)])
        attacked.produce(1, user.encode(), body(user, "k0", START + 5_000 + 7_200_000), START + 5_000)  # 2 h ahead
        attacked.produce(1, None, body(user, "k1", START + 1_000), START + 12_000)  # stamped after trigger 1 fired
        for cluster in (plain, attacked):
            cluster.drain(END)
        reasons = sorted((d["reason"].split(":")[0], d["source"]) for d in attacked.dead)
        assert reasons == [("future", f"in/1@{first} (by way of partition 0)"), ("late", f"in/1@{first + 1} (by way of partition 0)")]
        assert releases(attacked.w, END) == releases(plain.w, END)
    finally:
        plain.w.close()
        attacked.w.close()
