"""``dpstream check-input`` against records written as users write them: a stock confluent-kafka
producer with its default settings (librdkafka's consistent_random partitioner), keyless records,
the schema-registry wire format, and ``dpstream produce`` (issue 31: 7,014 of 8,000 such records
were dead-lettered as wrong_partition with nothing said)."""
import json
import struct
import uuid

from dpstream.processor.adapters.input_check import SampledRecord, analyse, detect_format, sample_shares, user_of
from dpstream.topics.partitioner import partition_for, partition_for_key
from tests.test_cli_traps import run


def event(user: str, i: int = 0) -> bytes:
    return json.dumps({"user_id": user, "key": f"k{i % 7}", "ts": 1_800_000_000_000 + i}).encode()


def test_a_sample_placed_by_librdkafkas_default_partitioner_is_recognised_and_counted_misplaced():
    users = [f"user-{i}".encode() for i in range(400)]
    home = partition_for(users, 8, "consistent")
    records = [SampledRecord(int(p), u, event(u.decode(), i), "CreateTime") for i, (u, p) in enumerate(zip(users, home))]
    records += [SampledRecord(3, None, event("user-keyless"), "CreateTime")]
    r = analyse("t", 8, records, "user_id", "murmur2", "CreateTime")
    keyed_away = sum(int(p != partition_for_key(u, 8, "murmur2")) for u, p in zip(users, home))
    assert r.in_place["consistent"] == 400 and r.in_place["murmur2"] == 400 - keyed_away
    assert r.likely_partitioner() == "consistent"
    keyless_home = partition_for_key(b"user-keyless", 8, "murmur2")
    assert r.misplaced == keyed_away + int(keyless_home != 3)
    assert (r.keyed_by_user, r.keyed_otherwise, r.unkeyed) == (400, 0, 1)
    text = "\n".join(r.lines())
    assert "the producers partition keys with consistent" in text
    assert "user-" not in text  # counts and shares, never a key or a user id
    # all keyed by the user: the hint names the partitioner that places every one
    r = analyse("t", 8, records[:-1], "user_id", "murmur2", "CreateTime")
    assert "hint: start the worker with --partitioner consistent" in "\n".join(r.lines())


def test_the_sample_reads_a_whole_small_topic_however_unevenly_it_is_partitioned():
    # a stock producer's keyless records land at random: one partition may hold far more than
    # sample / partitions (the CI run that read 589 of 600 records)
    assert sample_shares({0: 136, 1: 50, 2: 0, 3: 100}, 1000) == {0: 136, 1: 50, 2: 0, 3: 100}
    shares = sample_shares({0: 500, 1: 500, 2: 10}, 300)
    assert shares[2] == 10 and sum(shares.values()) == 300 and abs(shares[0] - shares[1]) <= 1
    assert sum(sample_shares({p: 1000 for p in range(7)}, 1000).values()) == 1000


def test_formats_and_nested_user_fields_are_recognised():
    assert detect_format(b'{"a": 1}') == ("json", None)
    assert detect_format(b"\x00" + struct.pack(">I", 42) + b"\x02avro") == ("schema-registry", 42)
    assert detect_format(b"[1, 2]") == ("json-not-object", None)
    assert detect_format(b"\xff\xfe") == ("unknown", None)
    assert detect_format(None) == ("empty", None)
    debezium = json.dumps({"before": None, "after": {"user_id": "u7", "n": 1}, "op": "c"}).encode()
    assert user_of(debezium, "after.user_id") == b"u7" and user_of(debezium, "user_id") is None
    assert user_of(b'{"user_id": 12}', "user_id") == b"12"


def test_check_input_reads_what_a_stock_producer_wrote_and_what_dpstream_produce_wrote(broker, tmp_path):
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"check-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_topics([NewTopic(topic, 8, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": broker})  # every setting left at its default
    placed: list = []

    def delivered(err, msg):
        assert err is None
        placed.append((msg.partition(), msg.key(), json.loads(msg.value())["user_id"]))

    for i in range(600):
        user = f"user-{i % 150}"
        producer.produce(topic, event(user, i), key=None if i % 10 == 0 else user.encode(), on_delivery=delivered)
    producer.flush(30)
    out = run("check-input", "--broker", broker, "--topic", topic, "--sample", "1000", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    away = sum(int(p != partition_for_key(u.encode(), 8, "murmur2")) for p, _, u in placed)
    assert report["records"] == 600 and report["keying"] == {"none": 60, "user_field": 540, "other": 0}
    assert report["keyed_in_place"]["consistent"] == 540 and report["likely_partitioner"] == "consistent"
    assert report["not_on_their_users_partition"] == away and away > 400  # about 7/8 of them
    assert report["timestamp_type"] == {"topic": "CreateTime", "records": {"CreateTime": 600}}
    assert report["formats"] == {"json": 600}
    report = json.loads(run("check-input", "--broker", broker, "--topic", topic, "--partitioner", "consistent", "--json").stdout)
    assert report["not_on_their_users_partition"] == sum(int(k is None and p != partition_for_key(u.encode(), 8, "consistent"))
                                                         for p, k, u in placed)  # keyless ones only
    text = run("check-input", "--broker", broker, "--topic", topic, "--partitioner", "consistent")
    assert text.returncode == 0 and "with --partitioner consistent: " in text.stdout and "user-" not in text.stdout

    ours = f"check-ours-{uuid.uuid4().hex[:8]}"
    events = tmp_path / "events.jsonl"
    events.write_bytes(b"\n".join(event(f"user-{i % 90}", i) for i in range(300)) + b"\n")
    assert run("produce", "--broker", broker, "--topic", ours, "--input", str(events)).returncode == 0
    report = json.loads(run("check-input", "--broker", broker, "--topic", ours, "--json").stdout)
    assert report["not_on_their_users_partition"] == 0 and report["likely_partitioner"] == "murmur2"
    assert report["timestamp_type"]["topic"] == "LogAppendTime"
