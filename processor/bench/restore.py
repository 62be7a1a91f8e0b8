"""``dpstream bench restore``: how long a gained partition's store takes to restore from its
changelog, per GB of state (docs/operations.md, "Elastic workers").

A compacted changelog topic is filled once with ``--mb`` MB of state records shaped like the
worker's: a mix of small rows (200 bytes) and commit blobs (``--blob-kb``, the user-state and
key-row logs of one commit). Then, in alternation, ``--repeats`` times each:

* baseline: the same read of the changelog (read_committed, to its end) that a restore does,
  touching each record and writing nothing;
* restore: :func:`dpstream.state.changelog.restore_from_changelog` into an empty RocksDB store (a new or
  lost volume: the full restore; a volume that kept the store reads only what was written since).

Reported: medians, seconds per GB of changelog bytes, and the restore / read ratio.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import uuid

from dpstream.processor.bench.report import machine
from dpstream.topics.kafka import client_security


def fill_changelog(broker: str, topic: str, mb: int, blob_kb: int, seed: int = 7) -> tuple[int, int]:
    """Write about ``mb`` MB of records; returns (records, bytes)."""
    from dpstream.topics.kafka import (
        CHANGELOG_TOPIC_CONFIG,
        KafkaPublisher,
        TopicSpec,
        create_topics,
    )

    create_topics(broker, [TopicSpec(topic, 1, CHANGELOG_TOPIC_CONFIG, "bench changelog")])
    publisher = KafkaPublisher(broker, {"message.max.bytes": 8 * 1024 * 1024, "linger.ms": 50, "batch.size": 1_000_000})
    rng = os.urandom
    target, written, records, i = mb * 1024 * 1024, 0, 0, 0
    blob = blob_kb * 1024
    while written < target:
        # nine rows for each blob: rows are most records, blobs most bytes
        size = blob if i % 10 == 0 else 200
        key = b"r%012d" % i
        value = rng(size)
        publisher.produce(topic, value, key, 0)
        written += len(key) + size
        records += 1
        i += 1
    publisher.flush()
    return records, written


def read_only(broker: str, topic: str) -> tuple[float, int]:
    from dpstream.topics.kafka import read_changelog

    started = time.perf_counter()
    end, batches = read_changelog(broker, topic, 0, 0)
    n = 0
    for batch in batches:
        for _offset, _key, value in batch:
            n += 1 if value is not None else 0
    return time.perf_counter() - started, n


def restore_once(broker: str, topic: str) -> tuple[float, int]:
    from dpstream.state.changelog import restore_from_changelog
    from dpstream.state.store import PartitionStores
    from dpstream.topics.kafka import read_changelog

    with tempfile.TemporaryDirectory(prefix="dpstream-restore-") as tmp:
        stores = PartitionStores(tmp, block_cache_mb=64, write_buffer_mb=32)
        try:
            started = time.perf_counter()
            done = restore_from_changelog(stores, "bench-0", lambda start: read_changelog(broker, topic, 0, start),
                                          int(time.time() * 1000))
            seconds = time.perf_counter() - started
        finally:
            stores.close()
    return seconds, done.records


def run_restore_bench(broker: str, mb: int, blob_kb: int, repeats: int, json_path: str | None) -> dict:
    topic = f"dpstream-bench-changelog-{uuid.uuid4().hex[:8]}"
    records, size = fill_changelog(broker, topic, mb, blob_kb)
    gb = size / 1024 ** 3
    print(f"changelog {topic}: {records:,} records, {size / 1024 ** 2:,.0f} MB")
    reads, restores = [], []
    for i in range(repeats):
        seconds, n = read_only(broker, topic)
        assert n == records, f"read {n} of {records} records"
        reads.append(seconds)
        seconds, n = restore_once(broker, topic)
        assert n == records, f"restored {n} of {records} records"
        restores.append(seconds)
        print(f"  run {i + 1}: read {reads[-1]:.2f} s, restore {restores[-1]:.2f} s")
    read_s, restore_s = statistics.median(reads), statistics.median(restores)
    result = {
        "bench": "restore", "machine": machine(), "broker": broker, "records": records, "bytes": size, "blob_kb": blob_kb,
        "repeats": repeats, "read_seconds": reads, "restore_seconds": restores,
        "read_seconds_per_gb": read_s / gb, "restore_seconds_per_gb": restore_s / gb, "restore_over_read": restore_s / read_s,
    }
    print(f"median of {repeats}: read {read_s:.2f} s ({read_s / gb:.1f} s/GB), restore {restore_s:.2f} s "
          f"({restore_s / gb:.1f} s/GB); restore / read {restore_s / read_s:.2f}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    from confluent_kafka.admin import AdminClient

    AdminClient({"bootstrap.servers": broker, **client_security()}).delete_topics([topic])
    return result
