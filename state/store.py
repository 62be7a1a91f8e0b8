"""One small key-value interface with two backends: RocksDB (production) and memory (tests).

Modelled on Quix Streams' ``quixstreams/state`` split (a store per partition, a transaction-like
write batch applied atomically). Keys and values are raw bytes; tables are key prefixes (see
:mod:`dpstream.state.keys`). Nothing outside ``state/`` opens RocksDB.

Every write goes through :class:`WriteBatch` and :meth:`Store.write`, which is atomic: a crash
leaves either all of a micro-batch's state changes (with its progress marker) or none.
"""
from __future__ import annotations

import bisect
import os
import shutil
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence


class WriteBatch:
    """Puts and deletes applied together by :meth:`Store.write` (last write to a key wins).

    ``on_commit`` callbacks run after the batch has been written, never if it was not: the
    tables' caches of committed values (:mod:`dpstream.state.tables`) learn a batch's values this way, so
    they never hold a value the store does not (a batch abandoned by a crash or an error leaves
    them as they were)."""

    __slots__ = ("ops", "_on_commit", "has_deletes", "__weakref__")

    def __init__(self) -> None:
        self.ops: dict[bytes, Optional[bytes]] = {}
        self._on_commit: list[Callable[[], None]] = []
        self.has_deletes = False  # lets a backend skip looking for deletes in a batch of puts

    def on_commit(self, callback: Callable[[], None]) -> None:
        self._on_commit.append(callback)

    def committed(self) -> None:
        """Called by :meth:`Store.write` once the batch is durable."""
        callbacks, self._on_commit = self._on_commit, []
        for callback in callbacks:
            callback()

    def put(self, key: bytes, value: bytes) -> None:
        self.ops[key] = value

    def put_many(self, keys: Iterable[bytes], values: Iterable[bytes]) -> None:
        self.ops.update(zip(keys, values))

    def delete(self, key: bytes) -> None:
        self.ops[key] = None
        self.has_deletes = True

    def apply(self, changes: Iterable[tuple[bytes, Optional[bytes]]]) -> "WriteBatch":
        """Add ``(key, value)`` changes in order, value None: a delete (a changelog's records)."""
        for key, value in changes:
            if value is None:
                self.delete(key)
            else:
                self.put(key, value)
        return self

    def __len__(self) -> int:
        return len(self.ops)


class Store(ABC):
    """A sorted bytes -> bytes map for one partition."""

    @abstractmethod
    def get(self, key: bytes) -> Optional[bytes]: ...

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        get = self.get
        return [get(k) for k in keys]

    @abstractmethod
    def write(self, batch: WriteBatch) -> None:
        """Apply the batch atomically."""

    @abstractmethod
    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Items with ``start <= key < stop`` in key order."""

    def scan_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.scan(prefix, _prefix_end(prefix))

    @abstractmethod
    def delete_range(self, start: bytes, stop: bytes) -> None:
        """Delete every key with ``start <= key < stop`` (immediately)."""

    def delete_prefix(self, prefix: bytes) -> None:
        self.delete_range(prefix, _prefix_end(prefix))

    @abstractmethod
    def size_bytes(self) -> int:
        """Approximate size of the stored data."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefix_end(prefix: bytes) -> bytes:
    """Smallest key greater than every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\xff" * (len(prefix) + 1)
    p[-1] += 1
    return bytes(p)


class MemoryStore(Store):
    """Dictionary store for unit tests and small local runs (not persistent)."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._sorted: Optional[list[bytes]] = None

    def get(self, key: bytes) -> Optional[bytes]:
        return self._data.get(key)

    def write(self, batch: WriteBatch) -> None:
        for key, value in batch.ops.items():
            if value is None:
                self._data.pop(key, None)
            else:
                self._data[key] = value
        if batch.ops:
            self._sorted = None
        batch.committed()

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        if self._sorted is None:
            self._sorted = sorted(self._data)
        keys = self._sorted
        i = bisect.bisect_left(keys, start)
        j = bisect.bisect_left(keys, stop)
        for key in keys[i:j]:
            yield key, self._data[key]

    def delete_range(self, start: bytes, stop: bytes) -> None:
        doomed = [k for k, _ in self.scan(start, stop)]
        for key in doomed:
            del self._data[key]
        if doomed:
            self._sorted = None

    def size_bytes(self) -> int:
        return sum(len(k) + len(v) for k, v in self._data.items())


class RocksDBStore(Store):
    """RocksDB through rocksdict in raw-bytes mode; one database directory per partition."""

    def __init__(self, path: str | os.PathLike, block_cache_mb: int = 512, write_buffer_mb: int = 128, read_only: bool = False):
        """``read_only``: open a database another process may hold (RocksDB's read-only mode: a
        consistent view as of opening; writes raise)."""
        from rocksdict import (
            AccessType,
            BlockBasedOptions,
            Cache,
            DBCompactionStyle,
            Options,
            Rdict,
        )

        self.path = Path(path)
        if read_only and not (self.path / "CURRENT").exists():
            raise FileNotFoundError(f"no RocksDB database at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        # The pipeline's reads are point lookups of keys that mostly exist only in recent data
        # (users and keys of this micro-batch): bloom filters make misses cheap, a block cache
        # keeps hot blocks, larger memtables mean fewer flushes and compactions.
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        table.set_block_cache(Cache(block_cache_mb * 1024 * 1024))
        table.set_cache_index_and_filter_blocks(True)
        options.set_block_based_table_factory(table)
        # Universal compaction: the pipeline overwrites the same keys many times a window (key
        # texts, window progress; user states and key rows did so before they became changelogs:
        # state/tables.py); leveled compaction rewrote each byte ~10 times (36 GB written for the
        # 61M-record benchmark), universal compaction trades that for temporary space.
        options.set_compaction_style(DBCompactionStyle.universal())
        # Large values (a micro-batch of stage-1 output, or a commit's changelog blob, can be
        # tens of MB) live in blob files,
        # the tree holding only a reference: otherwise every seek that passes such a value, live
        # or deleted but not yet compacted away, reads and checksums its whole block (30 ms per
        # seek at 10^6 keys, on every trigger). Garbage collection reclaims deleted blobs.
        options.set_enable_blob_files(True)
        options.set_min_blob_size(64 * 1024)
        options.set_enable_blob_gc(True)
        options.set_write_buffer_size(write_buffer_mb * 1024 * 1024)
        options.set_max_write_buffer_number(3)
        options.increase_parallelism(2)
        self._db = Rdict(str(self.path), options, access_type=AccessType.read_only() if read_only else AccessType.read_write())

    def get(self, key: bytes) -> Optional[bytes]:
        return self._db.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        return self._db.get(list(keys)) if len(keys) else []

    def write(self, batch: WriteBatch) -> None:
        from rocksdict import WriteBatch as RocksBatch

        rb = RocksBatch(raw_mode=True)
        ops = batch.ops
        if batch.has_deletes:
            for key in [k for k, v in ops.items() if v is None]:
                rb.delete(key)
            ops = {k: v for k, v in ops.items() if v is not None}
        deque(map(rb.put, ops.keys(), ops.values()), maxlen=0)  # the puts, without a Python loop
        self._db.write(rb)
        batch.committed()

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        from rocksdict import ReadOptions

        # the upper bound stops RocksDB at ``stop``: without it, a seek into an empty range walks
        # on over every deleted key after it until it finds a live one (taken micro-batches and
        # index entries leave many)
        bounds = ReadOptions()
        bounds.set_iterate_upper_bound(stop)
        it = self._db.iter(bounds)
        it.seek(start)
        while it.valid():
            key = it.key()
            if key >= stop:
                break
            yield key, it.value()
            it.next()

    def delete_range(self, start: bytes, stop: bytes) -> None:
        self._db.delete_range(start, stop)

    def size_bytes(self) -> int:
        try:
            return int(self._db.property_int_value("rocksdb.estimate-live-data-size") or 0) + int(
                self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
            )
        except Exception:  # pragma: no cover - property missing in some builds
            return 0

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


class StateDirectoryError(ValueError):
    """A state directory that must not hold state (it holds source code)."""


def check_state_directory(directory: Path) -> None:
    """Refuse a directory holding Python source as a state directory: ``--state-dir ./state`` in
    a checkout is the ``state/`` package itself, and an image built from it would copy the
    state's files (user contribution counts) with the code."""
    if directory.is_dir():
        code = sorted(p.name for p in directory.glob("*.py"))
        if code:
            raise StateDirectoryError(f"--state-dir: {directory} holds Python source ({', '.join(code[:3])}): it is a "
                                      f"source folder, not a state directory; use another (default ./dpstream-state)")


class PartitionStores:
    """One store per partition under ``directory`` (``None``: in memory)."""

    def __init__(self, directory: str | os.PathLike | None, block_cache_mb: int = 512, write_buffer_mb: int = 128):
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            check_state_directory(self.directory)
        self.block_cache_mb = block_cache_mb
        self.write_buffer_mb = write_buffer_mb
        self._open: dict[int | str, Store] = {}
        self._released: dict[int | str, Store] = {}  # in memory: a released store's data stays, as on disk

    def store(self, partition: int | str = 0) -> Store:
        """The store of a partition: an int, or a name such as ``"events-3"`` (topic-partition)."""
        if partition not in self._open:
            if self.directory is None:
                self._open[partition] = self._released.pop(partition, None) or MemoryStore()
            else:
                self._open[partition] = RocksDBStore(self.directory / f"partition-{partition}", self.block_cache_mb, self.write_buffer_mb)
        return self._open[partition]

    def release(self, partition: int | str) -> None:
        """Close a partition's store (a partition that moved to another worker); its data stays."""
        store = self._open.pop(partition, None)
        if store is not None:
            store.close()
            if self.directory is None:
                self._released[partition] = store

    def wipe(self, partition: int | str) -> Store:
        """A partition's store emptied (closed, its data deleted, opened again): before it is
        rebuilt from its changelog (state/changelog.py)."""
        self.release(partition)
        self._released.pop(partition, None)
        if self.directory is not None:
            shutil.rmtree(self.directory / f"partition-{partition}", ignore_errors=True)
        return self.store(partition)

    def close(self) -> None:
        for store in self._open.values():
            store.close()
        self._open.clear()

    def destroy(self) -> None:
        self.close()
        if self.directory is not None and self.directory.exists():
            shutil.rmtree(self.directory)
