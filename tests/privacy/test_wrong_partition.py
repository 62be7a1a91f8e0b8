"""Fix 8 (hardening): a user's records on a partition their key does not hash to are dead-lettered.

Stage 1 bounds a user's contributions in the state of one input partition. A producer that puts
one user's records on two partitions made the old worker count that user up to 2C. The worker now recomputes the partition of every keyed record with its
partitioner (default murmur2, Kafka's) and dead-letters misplaced ones as ``wrong_partition``.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.config import DpstreamConfig
from dpstream.processor.engine.pipeline import BoundedRecords
from dpstream.topics import partitioner
from dpstream.topics.kafka import DEAD_LETTER_TOPIC
from tests.conftest import TEST_SECRET, Record
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


def config() -> DpstreamConfig:
    return DpstreamConfig(queries=[query(input_topic="in", output_topic="out", window="40s", triggers=4, allowed_lateness="1s",
                                         contribution_bound=C)])


def user_records(user: str, n: int, first_offset: int, key: str = "k0") -> list[Record]:
    out = []
    for i in range(n):
        ts = START + 1000 + i
        body = json.dumps({"user_id": user, "key": key, "ts": ts}).encode()
        out.append(Record(first_offset + i, user.encode(), body, ts))
    return out


def admitted_per_user(messages) -> dict:
    per_user: dict = {}
    for m in messages:
        if m.topic != DEAD_LETTER_TOPIC:
            b = BoundedRecords.decode(m.value)
            for u in b.users.tolist():
                per_user[u] = per_user.get(u, 0) + 1
    return per_user


@pytest.mark.parametrize("partitions", [2, 3, 8])
def test_a_user_split_over_two_partitions_is_admitted_at_most_c_times(tmp_path, partitions):
    w = DpstreamWorker(config(), TEST_SECRET, tmp_path / "w", Ownership(), {"in": partitions}, 2)
    try:
        users = [f"user-{i}" for i in range(6)]
        total: dict = {}
        dead = []
        for user in users:
            right = kafka_partition(user.encode(), partitions)
            wrong = (right + 1) % partitions
            for p in (wrong, right, wrong):  # the misplaced copies before and after the right ones
                result = w.process_input("in", p, user_records(user, 2 * C, w.stage1[("in", p)].last_offset + 1))
                if result is None:
                    continue
                result.commit()
                for u, n in admitted_per_user(result.messages).items():
                    total[u] = total.get(u, 0) + n
                dead += [json.loads(m.value) for m in result.messages if m.topic == DEAD_LETTER_TOPIC]
        assert len(total) == len(users)
        assert max(total.values()) <= C, "a user spread over two partitions must not be counted more than C times"
        assert all(v == C for v in total.values())
        assert len(dead) == len(users) * 4 * C
        assert all(d["reason"].startswith("wrong_partition") for d in dead)
        dropped = sum(p.stats.dropped["wrong_partition"] for p in w.pipelines())
        assert dropped == len(users) * 4 * C
    finally:
        w.close()


def test_records_on_the_right_partition_are_untouched(tmp_path):
    w = DpstreamWorker(config(), TEST_SECRET, tmp_path / "w", Ownership(), {"in": 4}, 2)
    try:
        for i in range(40):
            user = f"u{i}"
            p = kafka_partition(user.encode(), 4)
            result = w.process_input("in", p, user_records(user, 1, w.stage1[("in", p)].last_offset + 1))
            assert not [m for m in result.messages if m.topic == DEAD_LETTER_TOPIC]
        assert sum(p.stats.dropped["wrong_partition"] for p in w.pipelines()) == 0
    finally:
        w.close()


KINDS = ("good", "not_json", "no_key_field", "mis_keyed", "null_key", "wrong_partition")


@settings(deadline=None, derandomize=True, max_examples=40)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=40))
def test_each_record_of_a_mixed_batch_meets_its_own_fate_in_any_order(tmp_path_factory, kinds):
    """A batch mixing good, malformed, mis-keyed, keyless and misplaced records, in any order: each
    record is admitted or dead-lettered exactly as a per-record reference says, whatever precedes
    it in the batch. Every user has fewer than C records, so a good record is always admitted; a
    record admitted in place of a refused one would let a user be counted on a second partition."""
    partitions, here = 2, 0
    users = [f"user-{i}" for i in range(200)]
    mine = [u for u in users if kafka_partition(u.encode(), partitions) == here]
    theirs = [u for u in users if kafka_partition(u.encode(), partitions) != here]
    records, expected = [], []
    for i, kind in enumerate(kinds):
        user = (theirs if kind == "wrong_partition" else mine)[i]
        ts = START + 1000 + i
        body = json.dumps({"user_id": user, "key": f"k{i % 3}", "ts": ts}).encode()
        key = user.encode()
        if kind == "not_json":
            body = b"{not json"
        elif kind == "no_key_field":
            body = json.dumps({"user_id": user, "ts": ts}).encode()
        elif kind == "mis_keyed":
            key = mine[i + 1].encode()  # another user of this partition: only the user check refuses it
        elif kind == "null_key":
            key = None
        records.append(Record(i, key, body, ts))
        expected.append("admitted" if kind == "good" else "wrong_partition" if kind == "wrong_partition" else "malformed")
    w = DpstreamWorker(config(), TEST_SECRET, tmp_path_factory.mktemp("w"), Ownership(), {"in": partitions}, 2)
    try:
        result = w.process_input("in", here, records)
        dead = {json.loads(m.value)["source"]: json.loads(m.value)["reason"] for m in result.messages if m.topic == DEAD_LETTER_TOPIC}
        fates = []
        for r in records:
            reason = dead.get(f"in/{here}@{r.offset}")
            fates.append("admitted" if reason is None else "wrong_partition" if reason.startswith("wrong_partition") else "malformed")
        assert fates == expected
        assert sum(admitted_per_user(result.messages).values()) == expected.count("admitted")
        stats = [p.stats for p in w.pipelines() if p.stats.events_in]
        assert sum(s.dropped["malformed"] for s in stats) == expected.count("malformed")
        assert sum(s.dropped["wrong_partition"] for s in stats) == expected.count("wrong_partition")
    finally:
        w.close()
