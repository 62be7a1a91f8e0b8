"""dpstream.topics.partitioner: Kafka's and librdkafka's own test vectors, the vectorized path against the
pure-Python reference, and librdkafka itself as the oracle: keyed messages produced with
confluent-kafka to librdkafka's in-process mock cluster must be delivered to the partitions
``partition_for`` computes. No real broker is needed."""
from __future__ import annotations

import ctypes
import glob
import os
import random

import numpy as np
import pytest

from dpstream.topics.partitioner import (
    PARTITIONERS,
    crc32_hash,
    fnv1a_hash,
    murmur2_hash,
    partition_for,
    partition_for_key,
)

# ------------------------------------------------------------------ published test vectors

#: org.apache.kafka.common.utils.UtilsTest.testMurmur2 (Java's signed Utils.murmur2)
JAVA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    bytes([ord("a"), ord("b"), ord("c")]): 479470107,
}

_UNALIGNED = b"PreAmbleWillBeRemoved,ThePrePartThatIs"
_LIBRDKAFKA_KEYS = [b"kafka", b"giberish123456789", b"1234", b"234", b"34", b"4",
                    _UNALIGNED, _UNALIGNED[1:], _UNALIGNED[2:], _UNALIGNED[3:], b""]
#: librdkafka src/rdmurmur2.c unittest_murmur2 (its "Java murmur2 results", as uint32)
LIBRDKAFKA_MURMUR2 = dict(zip(_LIBRDKAFKA_KEYS, [
    0xD067CF64, 0x8F552B0C, 0x9FC97B14, 0xE7C009CA, 0x873930DA, 0x5A4B5CA1,
    0x78424F1C, 0x4A62B377, 0xE0E4E09E, 0x62B8B43F, 0x106E08D9]))
#: librdkafka src/rdfnv1a.c unittest_fnv1a (rd_fnv1a, i.e. after its absolute value)
LIBRDKAFKA_FNV1A = dict(zip(_LIBRDKAFKA_KEYS, [
    0xD33C4E1, 0x77A58295, 0x23BDD03, 0x2DEA3CD2, 0x740FA83E, 0x310CA263,
    0x65CBD69C, 0x6E49C79A, 0x69EED356, 0x6ABCC023, 0x7EE3623B]))

#: keys whose FNV-1a hash is exactly 0x80000000 (found by meet-in-the-middle): the int32 minimum,
#: whose absolute value wraps to itself in librdkafka (and Sarama): partition 2**31 % n
FNV1A_INT_MIN_KEYS = [b"3\xa9=\xdch", b"\xee\xcf\x03#(", b"\x94/Vn\xa8"]


@pytest.mark.parametrize("key,expected", list(JAVA_MURMUR2.items()))
def test_murmur2_hash_matches_kafka_utils_test(key, expected):
    assert murmur2_hash(key) == expected
    for n in (1, 3, 8, 12, 1000):
        assert partition_for([key], n, "murmur2")[0] == (expected & 0x7FFFFFFF) % n


def test_murmur2_and_fnv1a_match_librdkafka_unit_tests():
    for key, expected in LIBRDKAFKA_MURMUR2.items():
        assert murmur2_hash(key) & 0xFFFFFFFF == expected, key
    for key, expected in LIBRDKAFKA_FNV1A.items():
        assert fnv1a_hash(key) == expected, key
    keys = list(LIBRDKAFKA_MURMUR2)
    assert partition_for(keys, 2**31 - 1, "murmur2").tolist() == \
        [(LIBRDKAFKA_MURMUR2[k] & 0x7FFFFFFF) % (2**31 - 1) for k in keys]
    assert partition_for(keys, 2**31 - 1, "fnv1a").tolist() == [LIBRDKAFKA_FNV1A[k] % (2**31 - 1) for k in keys]


def test_consistent_is_ieee_crc32():
    assert crc32_hash(b"123456789") == 0xCBF43926  # the CRC-32 check value
    assert partition_for([b"123456789", b""], 1000, "consistent").tolist() == [0xCBF43926 % 1000, 0]


def test_fnv1a_takes_the_absolute_value_of_the_signed_hash():
    def raw(key: bytes) -> int:
        h = 0x811C9DC5
        for b in key:
            h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
        return h

    for key in FNV1A_INT_MIN_KEYS:
        assert raw(key) == 0x80000000 and fnv1a_hash(key) == 2**31
    assert partition_for(FNV1A_INT_MIN_KEYS, 12, "fnv1a").tolist() == [2**31 % 12] * 3
    rng = random.Random(5)
    negative = [k for k in (rng.randbytes(rng.randint(1, 20)) for _ in range(200)) if raw(k) >= 2**31]
    assert negative
    for key in negative:
        assert fnv1a_hash(key) == 2**32 - raw(key)
    # neither the unsigned hash nor & 0x7fffffff gives librdkafka's partitions
    got = partition_for(negative, 12, "fnv1a").tolist()
    assert got != [raw(k) % 12 for k in negative]
    assert got != [(raw(k) & 0x7FFFFFFF) % 12 for k in negative]


# ------------------------------------------------------------------ vectorized == reference

@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_vectorized_equals_reference_on_random_keys(partitioner):
    rng = random.Random(20261121)
    keys = [rng.randbytes(rng.randint(0, 64)) for _ in range(3000)] + [b"", b"", b"\x00", b"\x00" * 4]
    rng.shuffle(keys)
    for n in (1, 2, 3, 8, 12, 1000, 2**31 - 1):
        got = partition_for(keys, n, partitioner)
        assert got.dtype == np.int64 and got.shape == (len(keys),)
        assert got.tolist() == [partition_for_key(k, n, partitioner) for k in keys], n


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_vectorized_mixed_lengths_and_inputs(partitioner):
    rng = random.Random(7)
    # a few long keys among short ones (separate bands), every length 0..70, repeated keys
    keys = [rng.randbytes(rng.randint(3, 12)) for _ in range(500)] + [rng.randbytes(5000), rng.randbytes(1021)]
    keys += [bytes(range(i)) for i in range(71)] + keys[:50]
    rng.shuffle(keys)
    expected = [partition_for_key(k, 12, partitioner) for k in keys]
    assert partition_for(keys, 12, partitioner).tolist() == expected
    assert partition_for([bytearray(k) for k in keys], 12, partitioner).tolist() == expected
    assert partition_for([memoryview(k) for k in keys], 12, partitioner).tolist() == expected
    assert partition_for(np.array(keys, dtype=object), np.int64(12), partitioner).tolist() == expected
    # batches of one key, and of empty keys only
    assert [int(partition_for([k], 12, partitioner)[0]) for k in keys[:40]] == expected[:40]
    assert partition_for([b""] * 5, 12, partitioner).tolist() == [partition_for_key(b"", 12, partitioner)] * 5
    assert partition_for([], 12, partitioner).dtype == np.int64


def test_null_keys_bad_types_partitioners_and_counts_are_refused():
    with pytest.raises(ValueError, match=r"keys\[1\] is None"):
        partition_for([b"a", None, b"c"], 8)
    with pytest.raises(ValueError, match="None"):
        partition_for_key(None, 8)
    with pytest.raises(TypeError, match=r"keys\[0\] is str"):
        partition_for(["user-1"], 8)
    with pytest.raises(ValueError, match=r"unknown partitioner 'murmur3'.*murmur2, consistent, fnv1a"):
        partition_for([b"a"], 8, "murmur3")
    with pytest.raises(ValueError, match="unknown partitioner 'murmur2_random'"):
        partition_for_key(b"a", 8, "murmur2_random")
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="partition count"):
            partition_for([b"a"], bad)
    with pytest.raises(TypeError):
        partition_for([b"a"], 8.0)


def test_agrees_with_aiokafka_default_partitioner():
    """aiokafka (the worker's and Faust's client) partitions keyed records like the Java client."""
    partitioner_module = pytest.importorskip("aiokafka.partitioner")
    default = partitioner_module.DefaultPartitioner()
    rng = random.Random(11)
    keys = [rng.randbytes(rng.randint(0, 40)) for _ in range(500)]
    for n in (1, 3, 8, 12):
        parts = list(range(n))
        assert partition_for(keys, n, "murmur2").tolist() == [default(k, parts, parts) for k in keys]


# ------------------------------------------------------------------ librdkafka as the oracle

def _keys_for_librdkafka() -> list[bytes]:
    rng = random.Random(20260401)
    keys = [rng.randbytes(rng.randint(1, 40)) for _ in range(200)]
    keys += [f"user-{rng.randrange(10**9)}".encode() for _ in range(60)]
    keys += [s.encode() for s in ("ü", "日本語のユーザー", "Ωmega-Ünïcødé", "用户🙂" * 7, "ß" * 33, "e\u0301", "\u00e9")]
    keys += [b"\x00", b"\x00" * 7, b"x" * 1000, rng.randbytes(4096), b"a", b"ab", b"abc", b"abcd", b"abcde"]
    keys += list(JAVA_MURMUR2) + _LIBRDKAFKA_KEYS + FNV1A_INT_MIN_KEYS
    return keys  # includes the empty key b""


def _bundled_librdkafka() -> ctypes.CDLL:
    """The librdkafka confluent-kafka itself loaded (the wheel's bundled copy), for the mock
    cluster's C API, which the Python binding does not expose."""
    import confluent_kafka

    site = os.path.dirname(os.path.dirname(confluent_kafka.__file__))
    found = sorted(glob.glob(os.path.join(site, "confluent_kafka.libs", "librdkafka*.so*")))
    if not found:
        pytest.skip("no bundled librdkafka shared library next to confluent_kafka: cannot create "
                    "mock topics with chosen partition counts (test_mock_cluster_default_partitions still runs)")
    lib = ctypes.CDLL(found[0])
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_topic_create.restype = ctypes.c_int
    lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
    return lib


PARTITION_COUNTS = (1, 3, 8, 12)


@pytest.fixture(scope="module")
def mock_cluster():
    """A librdkafka mock cluster (1 broker, in process, listening on localhost) with topics
    ``p1``, ``p3``, ``p8``, ``p12`` of 1, 3, 8 and 12 partitions. Created through the C API
    (``rd_kafka_mock_cluster_new`` / ``rd_kafka_mock_topic_create``): the
    ``test.mock.num.brokers`` producer setting auto-creates topics with 4 partitions only, and
    the mock cluster does not implement CreateTopics for an AdminClient."""
    lib = _bundled_librdkafka()
    err = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    lib.rd_kafka_conf_set(conf, b"log_level", b"3", err, len(err))
    rk = lib.rd_kafka_new(0, conf, err, len(err))  # RD_KAFKA_PRODUCER; takes ownership of conf
    assert rk, err.value
    cluster = lib.rd_kafka_mock_cluster_new(rk, 1)
    assert cluster
    try:
        for n in PARTITION_COUNTS:
            assert lib.rd_kafka_mock_topic_create(cluster, f"p{n}".encode(), n, 1) == 0
        yield lib.rd_kafka_mock_cluster_bootstraps(cluster).decode()
    finally:
        lib.rd_kafka_mock_cluster_destroy(cluster)
        lib.rd_kafka_destroy(rk)


def _deliver(producer, topic: str, keys: list[bytes]) -> list[int]:
    """Produce one message per key (no partition given: the partitioner picks it) and return the
    partitions the delivery reports name."""
    delivered: dict[int, int] = {}
    errors = []

    def report(err, msg, i):
        if err is not None:
            errors.append(err)
        else:
            delivered[i] = msg.partition()

    for i, key in enumerate(keys):
        producer.produce(topic, key=key, value=b"v", on_delivery=lambda err, msg, i=i: report(err, msg, i))
    assert producer.flush(15) == 0
    assert not errors and len(delivered) == len(keys)
    return [delivered[i] for i in range(len(keys))]


@pytest.mark.parametrize("librdkafka_partitioner,ours", [("murmur2_random", "murmur2"),
                                                         ("consistent_random", "consistent"),
                                                         ("fnv1a_random", "fnv1a")])
def test_librdkafka_mock_cluster_delivers_to_partition_for(mock_cluster, librdkafka_partitioner, ours):
    from confluent_kafka import Producer

    keys = _keys_for_librdkafka()
    producer = Producer({"bootstrap.servers": mock_cluster, "partitioner": librdkafka_partitioner,
                         "linger.ms": 1, "log_level": 3})
    try:
        for n in PARTITION_COUNTS:
            metadata = producer.list_topics(f"p{n}", timeout=10)
            assert len(metadata.topics[f"p{n}"].partitions) == n
            delivered = _deliver(producer, f"p{n}", keys)
            expected = partition_for(keys, n, ours).tolist()
            # consistent_random spreads empty keys like null ones (checked below): compare the rest
            compared = [i for i, k in enumerate(keys) if k or librdkafka_partitioner != "consistent_random"]
            assert len(compared) >= len(keys) - 1
            assert [delivered[i] for i in compared] == [expected[i] for i in compared], (librdkafka_partitioner, n)
            if n > 1:
                assert len(set(delivered)) == n  # the keys do spread: a real check, not all on partition 0
    finally:
        producer.close()


def test_librdkafka_empty_key_under_consistent_and_consistent_random(mock_cluster):
    """Plain ``consistent`` maps the empty key to crc32(b"") % n = 0, as partition_for does;
    ``consistent_random`` (librdkafka's default) scatters it like a null key."""
    from confluent_kafka import Producer

    for name in ("consistent", "consistent_random"):
        producer = Producer({"bootstrap.servers": mock_cluster, "partitioner": name, "log_level": 3,
                             "sticky.partitioning.linger.ms": 0})  # a new random partition per message
        try:
            delivered = _deliver(producer, "p12", [b""] * 60)
        finally:
            producer.close()
        if name == "consistent":
            assert delivered == partition_for([b""] * 60, 12, "consistent").tolist() == [0] * 60
        else:
            assert len(set(delivered)) > 1  # all 60 on one of 12 partitions: probability 12**-59


@pytest.mark.parametrize("librdkafka_partitioner,ours", [("murmur2_random", "murmur2"),
                                                         ("consistent_random", "consistent"),
                                                         ("fnv1a_random", "fnv1a")])
def test_mock_cluster_default_partitions(librdkafka_partitioner, ours):
    """The plain-config route: ``test.mock.num.brokers`` starts a mock cluster inside the producer,
    which auto-creates the topic with its default of 4 partitions."""
    from confluent_kafka import Producer

    keys = [k for k in _keys_for_librdkafka() if k]
    producer = Producer({"test.mock.num.brokers": 1, "partitioner": librdkafka_partitioner,
                         "linger.ms": 1, "log_level": 3})
    try:
        first = _deliver(producer, "auto", keys[:1])
        n = len(producer.list_topics("auto", timeout=10).topics["auto"].partitions)
        assert n == 4
        assert first + _deliver(producer, "auto", keys[1:]) == partition_for(keys, n, ours).tolist()
    finally:
        producer.close()


def test_confluent_kafka_partition_functions_agree():
    """Recent confluent-kafka (2.16 here) exposes librdkafka's partitioner functions directly
    (``confluent_kafka.murmur2(key, n)`` etc., the non-random variants): many more keys, no I/O."""
    import confluent_kafka

    functions = {name: getattr(confluent_kafka, name, None) for name in PARTITIONERS}
    if not all(functions.values()):
        pytest.skip("this confluent-kafka does not expose murmur2/consistent/fnv1a")
    rng = random.Random(99)
    keys = [rng.randbytes(rng.randint(0, 64)) for _ in range(3000)] + FNV1A_INT_MIN_KEYS + [b""]
    for name, function in functions.items():
        for n in (1, 3, 8, 12, 1000, 2**31 - 1):
            assert partition_for(keys, n, name).tolist() == [function(k, n) for k in keys], (name, n)
