"""A store that records every change it makes, so its state can move (docs/operations.md, "Elastic workers").

Kafka Streams keeps each store's state in a compacted changelog topic: every write is also a
record ``key -> value`` (a delete: a tombstone), so replaying the topic from its start, last
write per key winning, rebuilds the store anywhere. :class:`ChangelogStore` wraps any
:class:`dpstream.state.store.Store` and collects those records, in write order, for the caller to send
with the outputs the writes belong to (in one Kafka transaction). Restoring is
:func:`restore_store`.

Each write also bumps a sequence number kept in the store (and so in the changelog). A worker
compares its local store's number with the one its last committed transaction recorded: a local
store that is ahead holds writes whose transaction never committed and must be rebuilt from the
changelog (as Kafka Streams does under exactly-once after an unclean stop); one that is behind
(an older volume) or empty (a lost one) is restored too. Nothing is ever silently reset.

``delete_range`` (window retirement) becomes one tombstone per live key: a compacted topic has
no range deletes.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from dpstream.state.store import PartitionStores, Store, WriteBatch

#: the key holding the store's changelog sequence number (written in every change, changelogged
#: like any key, so a restored store knows how far its changelog went)
SEQUENCE_KEY = b"\x00changelog-seq"

#: local only, never in the changelog: the changelog offset and sequence number up to which this
#: store is known to equal its committed changelog (written after each transaction committed)
CHECKPOINT_KEY = b"\x00changelog-checkpoint"
#: a checkpoint older than this is not trusted for an incremental restore: compaction may have
#: removed the tombstones of deletes made after it (the topic's delete.retention.ms, 24 h by
#: default, is twice this), so the store is rebuilt from the start instead
CHECKPOINT_MAX_AGE_MS = 12 * 3600 * 1000

Change = tuple[bytes, Optional[bytes]]  # (key, value), value None: deleted

#: keys written since a checkpoint whose previous values a ChangelogStore keeps for a rollback
#: (a transaction carries a batch's changes: normally a few blobs and marks)
UNDO_MAX_KEYS = 1_000_000


def _encode_seq(seq: int) -> bytes:
    return struct.pack(">Q", seq)


def sequence_of(store: Store) -> int:
    """How many changes the store (or the changelog it was restored from) holds."""
    raw = store.get(SEQUENCE_KEY)
    return 0 if raw is None else struct.unpack(">Q", raw)[0]


class ChangelogStore(Store):
    """``inner`` with every change also collected as changelog records (:meth:`take_changes`)."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.sequence = sequence_of(inner)
        self._changes: list[Change] = []
        #: every key written since the last checkpoint -> its value then (None: absent), so that
        #: writes whose transaction never committed can be undone (:meth:`rollback`); None once
        #: more than UNDO_MAX_KEYS keys were written (a rollback then forces a full restore)
        self._undo: Optional[dict[bytes, Optional[bytes]]] = {}

    # -- reads go straight through
    def get(self, key: bytes) -> Optional[bytes]:
        return self.inner.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        return self.inner.get_many(keys)

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.scan(start, stop)

    def size_bytes(self) -> int:
        return self.inner.size_bytes()

    def close(self) -> None:
        self.inner.close()

    # -- writes are recorded
    def write(self, batch: WriteBatch) -> None:
        self.sequence += 1
        batch.put(SEQUENCE_KEY, _encode_seq(self.sequence))
        self._remember(batch)
        self.inner.write(batch)
        self._changes.extend(batch.ops.items())

    def _remember(self, batch: WriteBatch) -> None:
        undo = self._undo
        if undo is None:
            return
        fresh = [key for key in batch.ops if key not in undo]
        if len(undo) + len(fresh) > UNDO_MAX_KEYS:
            self._undo = None
            return
        if fresh:
            undo.update(zip(fresh, self.inner.get_many(fresh)))

    def delete_range(self, start: bytes, stop: bytes) -> None:
        doomed = [key for key, _ in self.inner.scan(start, stop)]
        batch = WriteBatch()
        for key in doomed:
            batch.delete(key)
        self.write(batch)  # one atomic change (the inner store deletes them as one batch)

    def take_changes(self) -> tuple[list[Change], int]:
        """The changes since the last call, in write order, and the sequence number they reach."""
        changes, self._changes = self._changes, []
        return changes, self.sequence

    def checkpoint(self, offset: int, sequence: int, now_ms: int) -> None:
        """The changes up to ``sequence`` are committed on the changelog, the last of them at
        ``offset``: a later owner's writes follow it there (local only, not changelogged)."""
        write_checkpoint(self.inner, Checkpoint(offset, sequence, now_ms))
        if sequence == self.sequence:
            self._undo = {}

    def rollback(self) -> bool:
        """Undo every write since the last checkpoint (their transaction never committed: the
        changelog does not hold them), so that the store equals its changelog up to the checkpoint
        again and a later restore reads on from there (docs/operations.md, "Elastic workers").
        Returns False when that is not possible (too many keys written since): the checkpoint is
        then dropped, and the next restore rebuilds the store from the changelog's start."""
        self._changes = []
        if self._undo is None:
            batch = WriteBatch()
            batch.delete(CHECKPOINT_KEY)
            self.inner.write(batch)
            self._undo = {}
            return False
        if self._undo:
            batch = WriteBatch()
            for key, value in self._undo.items():
                if value is None:
                    batch.delete(key)
                else:
                    batch.put(key, value)
            self.inner.write(batch)
            self.sequence = sequence_of(self.inner)
            self._undo = {}
        return True


@dataclass(frozen=True)
class Checkpoint:
    offset: int  # the changelog offset of the last committed change this store holds
    sequence: int  # the store's sequence number then
    written_ms: int


def read_checkpoint(store: Store) -> Optional[Checkpoint]:
    raw = store.get(CHECKPOINT_KEY)
    return None if raw is None else Checkpoint(**json.loads(raw))


def write_checkpoint(store: Store, checkpoint: Checkpoint) -> None:
    batch = WriteBatch()
    batch.put(CHECKPOINT_KEY, json.dumps(checkpoint.__dict__).encode())
    store.write(batch)


def restore_start(store: Store, now_ms: int, max_age_ms: int = CHECKPOINT_MAX_AGE_MS) -> Optional[int]:
    """Where a store's changelog must be read from for the store to equal it, or None when the
    local store must be wiped and rebuilt from the changelog's start.

    Incremental only when the store is exactly what a committed transaction left: its sequence
    equals its checkpoint's (no write since, whose transaction might have aborted: then the local
    store is *ahead* of the changelog, as Kafka Streams finds after an unclean stop under
    exactly-once), and the checkpoint is recent enough that no tombstone after it was compacted
    away. An empty store (a new or lost volume) reads from the start; so does any other."""
    checkpoint = read_checkpoint(store)
    empty = next(iter(store.scan(b"", b"\xff" * 9)), None) is None
    if empty:
        return 0
    if checkpoint is None or checkpoint.sequence != sequence_of(store) or now_ms - checkpoint.written_ms > max_age_ms:
        return None
    return checkpoint.offset + 1


@dataclass
class Restored:
    """What :func:`restore` did."""

    store: "ChangelogStore"
    start: int  # the changelog offset it read from
    full: bool  # the local store was rebuilt from the start (wiped first if it held anything)
    records: int  # changelog records applied


def restore_from_changelog(stores: PartitionStores, name: str, read_changelog, now_ms: int, on_batch=None,
            max_age_ms: int = CHECKPOINT_MAX_AGE_MS) -> Restored:
    """Make the store ``name`` of ``stores`` equal to its committed changelog (docs/operations.md,
    "Elastic workers"). ``read_changelog(start)`` gives the changelog's end offset and batches of
    ``(offset, key, value)`` from ``start`` to there (committed records only).

    From the local checkpoint when :func:`restore_start` allows it (a volume that kept the store:
    only what other owners wrote since is read), else from the start into an emptied store. The
    checkpoint is then written at the last offset read. ``on_batch(applied, last_offset, end)``
    reports progress."""
    store = stores.store(name)
    start = restore_start(store, now_ms, max_age_ms)
    full = not start
    if start is None:
        store = stores.wipe(name)
        start = 0
    end, batches = read_changelog(start)
    applied, last = 0, None
    for records in batches:
        if not records:
            continue
        store.write(WriteBatch().apply((key, value) for _offset, key, value in records))
        applied += len(records)
        last = records[-1][0]
        if on_batch is not None:
            on_batch(applied, last, end)
    if last is not None:
        write_checkpoint(store, Checkpoint(last, sequence_of(store), now_ms))
    return Restored(ChangelogStore(store), start, full, applied)


def restore_store(target: Store, records: Iterable[Change], batch_size: int = 10_000) -> int:
    """Rebuild ``target`` (empty, or at a checkpoint when ``records`` follow it) from changelog
    records read in offset order; returns the sequence number the changelog reached."""
    records = list(records)
    for i in range(0, len(records), batch_size):
        target.write(WriteBatch().apply(records[i:i + batch_size]))
    return sequence_of(target)
