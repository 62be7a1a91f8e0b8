"""Kafka key partitioners, vectorized: which partition a producer writes a keyed record to.

Why the worker needs this: stage 1 bounds each user's contributions in the state of *one* input
partition. If two partition states each saw one user, each would bound them separately, and the
user would contribute up to twice the bound to the released histograms: a privacy failure (the
noise is calibrated to the bound), not only an accuracy problem. So a user belongs to the
partition ``partition_for(user id, partition count, partitioner)`` gives, and the worker sends an
event read on any other partition there, through the query's by-user topic
(processor/adapters/worker.py, stage 1), whatever the record's message key. Producers that
partition by user id with the worker's partitioner spare that second trip through Kafka.

Which client uses which partitioner for keyed records by default:

* ``murmur2``: the Java client (so Kafka Streams and Kafka Connect too, unless
  ``partitioner.class`` or ``partitioner.ignore.keys`` is set), partition
  ``toPositive(murmur2(key)) % partitions`` with ``toPositive(h) = h & 0x7fffffff``; aiokafka and
  kafka-python (their ``DefaultPartitioner``, hence Faust); librdkafka clients configured with
  ``partitioner=murmur2_random`` (what ``dpstream produce`` uses) or ``murmur2``.
* ``consistent``: librdkafka's ``consistent_random``, the default of every librdkafka-based client
  (confluent-kafka for Python, Go and .NET, node-rdkafka, rust-rdkafka): ``crc32(key) %
  partitions`` with the IEEE CRC-32 zlib computes. Caveat: ``consistent_random`` spreads records
  with an *empty* key (sticky random partition), like keyless ones, so they have no fixed
  partition. This module returns ``crc32(b"") % partitions = 0`` for them (what plain
  ``consistent`` does): the check then accepts them on partition 0 only, and the empty-key "user"
  is still counted on one partition.
* ``fnv1a``: librdkafka's ``fnv1a`` / ``fnv1a_random``, made to match Sarama's (Go) default
  ``NewHashPartitioner``: the 32-bit FNV-1a hash read as a *signed* int32 and its absolute value
  taken (``-2**31`` wraps to itself, ``2**31`` as unsigned), then ``% partitions``. Neither the
  unsigned hash modulo the count nor ``& 0x7fffffff`` (Sarama's ``NewReferenceHashPartitioner``,
  not supported here) gives the same partitions.

Null keys have no partition to check (every client spreads them): :func:`partition_for` raises
``ValueError`` on ``None``; the worker dead-letters keyless records before this check. An empty
key is not null: it has a partition (but see the ``consistent`` caveat above).

:func:`partition_for` is vectorized with numpy: the keys are joined into one byte buffer and sorted
by length (a radix sort); each band of similar lengths is copied into a (keys, width) matrix of
rows read from the buffer, and the 32-bit arithmetic runs word by word (murmur2) or byte by byte
(fnv1a) on uint32 columns, each column only over the keys long enough to have it (numpy's uint32
multiplication wraps modulo 2**32, as Java's int and C's uint32_t do). CRC-32 uses ``zlib.crc32``
per key, already C speed. The pure-Python references (:func:`murmur2_hash`, :func:`fnv1a_hash`,
:func:`partition_for_key`) define the expected values; tests check them against Kafka's and
librdkafka's own test vectors and against librdkafka producing to its mock cluster.

Pure functions, no I/O; imports nothing of this project.
"""
from __future__ import annotations

import operator
import zlib
from typing import Sequence, Union

import numpy as np

__all__ = ["PARTITIONERS", "partition_for", "partition_for_key", "murmur2_hash", "fnv1a_hash", "crc32_hash"]

#: accepted partitioner names (the worker's ``--partitioner``)
PARTITIONERS = ("murmur2", "consistent", "fnv1a")

MAX_PARTITIONS = 2**31 - 1  # Kafka's partition count is a signed int32

_M = 0x5BD1E995  # murmur2 multiplier
_SEED = 0x9747B28C  # Kafka's murmur2 seed
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193
_U32 = 0xFFFFFFFF

Key = Union[bytes, bytearray, memoryview]


# ------------------------------------------------------------------ pure-Python references

def _murmur2_u32(key: Key) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``) as an unsigned 32-bit int."""
    data = bytes(key)
    length = len(data)
    h = (_SEED ^ length) & _U32
    nblocks = length // 4
    for i in range(nblocks):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = (k * _M) & _U32
        k ^= k >> 24
        k = (k * _M) & _U32
        h = ((h * _M) & _U32) ^ k
    rest = length & 3
    if rest:
        tail = data[4 * nblocks:]
        if rest == 3:
            h ^= tail[2] << 16
        if rest >= 2:
            h ^= tail[1] << 8
        h ^= tail[0]
        h = (h * _M) & _U32
    h ^= h >> 13
    h = (h * _M) & _U32
    h ^= h >> 15
    return h


def murmur2_hash(key: Key) -> int:
    """Kafka's ``Utils.murmur2(key)``: the signed 32-bit value Java returns (e.g. ``b"21"`` ->
    -973932308). The murmur2 partitioner takes ``(h & 0x7fffffff) % partitions``."""
    if key is None:
        raise ValueError("murmur2_hash: the key is None (a null key has no hash partition)")
    h = _murmur2_u32(key)
    return h - (1 << 32) if h & 0x80000000 else h


def fnv1a_hash(key: Key) -> int:
    """librdkafka's ``rd_fnv1a(key)`` (Sarama's hash partitioner): FNV-1a 32-bit read as a signed
    int32, negated when negative, returned as an unsigned 32-bit int (``-2**31`` gives ``2**31``,
    C's wrapping negation). The fnv1a partitioner takes ``fnv1a_hash(key) % partitions``."""
    if key is None:
        raise ValueError("fnv1a_hash: the key is None (a null key has no hash partition)")
    h = _FNV_OFFSET
    for b in bytes(key):
        h = ((h ^ b) * _FNV_PRIME) & _U32
    if h & 0x80000000:  # negative as int32: absolute value, modulo 2**32
        h = (-(h - (1 << 32))) & _U32
    return h


def crc32_hash(key: Key) -> int:
    """librdkafka's ``rd_crc32(key)`` (the IEEE CRC-32 zlib computes), unsigned 32-bit."""
    if key is None:
        raise ValueError("crc32_hash: the key is None (a null key has no hash partition)")
    return zlib.crc32(key)


def partition_for_key(key: Key, partitions: int, partitioner: str = "murmur2") -> int:
    """The partition of one key: the scalar, pure-Python reference of :func:`partition_for`."""
    _check_partitioner(partitioner)
    partitions = _check_partitions(partitions)
    if key is None:
        raise ValueError("partition_for_key: the key is None (null keys are spread by every client: no partition to check)")
    if partitioner == "murmur2":
        return (_murmur2_u32(key) & 0x7FFFFFFF) % partitions
    if partitioner == "consistent":
        return zlib.crc32(key) % partitions
    return fnv1a_hash(key) % partitions


# ------------------------------------------------------------------ vectorized

def partition_for(keys: Sequence[Key], partitions: int, partitioner: str = "murmur2") -> np.ndarray:
    """The partition each key hashes to under ``partitioner`` (one of :data:`PARTITIONERS`) for a
    topic of ``partitions`` partitions, as an int64 array aligned with ``keys``.

    Keys are bytes (bytearray and memoryview work too). ``None`` raises ValueError (a null key has
    no partition); an empty key is not null and has one. Raises ValueError for an unknown
    partitioner or a partition count outside 1..2**31-1.
    """
    _check_partitioner(partitioner)
    partitions = _check_partitions(partitions)
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    buf = _join(keys)
    if partitioner == "consistent":
        # zlib.crc32 per key runs at C speed already (~7M short keys/s, measured): no numpy CRC
        h = np.fromiter(map(zlib.crc32, keys), dtype=np.uint32, count=n)
        return (h % np.uint32(partitions)).astype(np.int64)
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    if int(lengths.sum()) != len(buf):
        raise TypeError("partition_for: keys must be bytes-like with one-byte items (bytes, bytearray, memoryview of bytes)")
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    longest = int(lengths.max())
    # stable argsort of small unsigned ints is a radix sort in numpy: ~4x the int64 sort
    order = np.argsort(lengths.astype(np.uint16) if longest < 2**16 else lengths, kind="stable")
    lengths, starts = lengths[order], starts[order]
    # every key's row is read as a window of the joined bytes: the bytes past a key's end (the next
    # keys', or this zero padding) are never hashed (fnv1a) or masked off (murmur2's tail word)
    data = np.frombuffer(buf + bytes(_width(longest)), dtype=np.uint8)
    hashed = np.empty(n, dtype=np.uint32)
    for lo, hi in _bands(lengths):
        width = _width(int(lengths[hi - 1]))
        block = np.lib.stride_tricks.sliding_window_view(data, width)[starts[lo:hi]]  # (keys, width) copy
        if partitioner == "murmur2":
            hashed[lo:hi] = _murmur2_block(block, lengths[lo:hi]) & np.uint32(0x7FFFFFFF)
        else:
            hashed[lo:hi] = _fnv1a_block(block, lengths[lo:hi])
    out = np.empty(n, dtype=np.int64)
    out[order] = hashed % np.uint32(partitions)
    return out


def _check_partitioner(partitioner: str) -> None:
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}: must be one of {', '.join(PARTITIONERS)}")


def _check_partitions(partitions: int) -> int:
    if isinstance(partitions, bool):
        raise TypeError(f"partition count must be an int, got {partitions!r}")
    partitions = operator.index(partitions)
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ValueError(f"partition count must be in 1..{MAX_PARTITIONS}, got {partitions}")
    return partitions


def _join(keys: Sequence[Key]) -> bytes:
    try:
        return b"".join(keys)
    except TypeError:
        for i, key in enumerate(keys):
            if key is None:
                raise ValueError(f"keys[{i}] is None: a null key has no partition to check "
                                 "(dead-letter keyless records before this check)") from None
            if not isinstance(key, (bytes, bytearray, memoryview)):
                raise TypeError(f"keys[{i}] is {type(key).__name__}, not bytes (encode str keys first)") from None
        raise


def _width(length: int) -> int:
    """Row width for keys up to ``length`` bytes: whole 32-bit words, at least one."""
    return max(4, (length + 3) // 4 * 4)


def _bands(lengths: np.ndarray):
    """Ranges of the length-sorted keys whose row widths are within 2x of each other (widths of
    1, 2, 3-4, 5-8, ... words), so that a few long keys do not widen every short key's row."""
    words = np.maximum((lengths + 3) // 4, 1)
    band = np.ceil(np.log2(words)).astype(np.int64)
    edges = [0, *(np.flatnonzero(np.diff(band)) + 1).tolist(), len(lengths)]
    return zip(edges[:-1], edges[1:])


_TAIL_MASK = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF], dtype=np.uint32)


def _murmur2_block(block: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Unsigned murmur2 of keys sorted by length; ``block`` holds their bytes, a row each, padded
    with arbitrary bytes to whole words."""
    m = np.uint32(_M)
    words = block.view("<u4").astype(np.uint32, copy=False)  # (keys, words), little endian
    nwords = words.shape[1]
    h = lengths.astype(np.uint32) ^ np.uint32(_SEED)
    # sorted by length, the keys with a full 4-byte block j (length >= 4j+4) are a suffix, and the
    # keys whose partial tail is in word j (length 4j+1 .. 4j+3) the range just before it
    word_starts = 4 * np.arange(nwords)
    full_from = np.searchsorted(lengths, word_starts + 3, side="right")
    tail_from = np.searchsorted(lengths, word_starts + 1, side="left")
    for j in range(nwords):
        col = words[:, j]
        s = int(full_from[j])
        if s < len(h):
            k = col[s:] * m
            k ^= k >> np.uint32(24)
            k *= m
            hs = h[s:]
            hs *= m
            hs ^= k
        p = int(tail_from[j])
        if p < s:  # the tail bytes as a little-endian word, what murmur2 XORs in, then one multiply
            hp = h[p:s]
            hp ^= col[p:s] & _TAIL_MASK[lengths[p:s] & 3]
            hp *= m
    h ^= h >> np.uint32(13)
    h *= m
    h ^= h >> np.uint32(15)
    return h


def _fnv1a_block(block: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """librdkafka's fnv1a (absolute value of the signed hash, as uint32) of keys sorted by length."""
    prime = np.uint32(_FNV_PRIME)
    columns = np.ascontiguousarray(block.T)  # (width, keys): each byte position contiguous
    h = np.full(len(lengths), _FNV_OFFSET, dtype=np.uint32)
    active_from = np.searchsorted(lengths, np.arange(columns.shape[0]), side="right")  # length > j
    for j in range(columns.shape[0]):
        s = int(active_from[j])
        if s >= len(h):
            break
        hs = h[s:]
        hs ^= columns[j, s:]
        hs *= prime
    negative = h.view(np.int32) < 0
    # |h| of the signed value, modulo 2**32: 0 - h wraps, and -(-2**31) stays 2**31 as in C
    h[negative] = np.uint32(0) - h[negative]
    return h
