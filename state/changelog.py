"""A store that records every change it makes, so its state can move (issue 15, item 2; work in progress).

Kafka Streams keeps each store's state in a compacted changelog topic: every write is also a
record ``key -> value`` (a delete: a tombstone), so replaying the topic from its start, last
write per key winning, rebuilds the store anywhere. :class:`ChangelogStore` wraps any
:class:`state.store.Store` and collects those records, in write order, for the caller to send
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

import struct
from typing import Iterable, Iterator, Optional, Sequence

from state.store import Store, WriteBatch

#: the key holding the store's changelog sequence number (written in every change, changelogged
#: like any key, so a restored store knows how far its changelog went)
SEQUENCE_KEY = b"\x00changelog-seq"

Change = tuple[bytes, Optional[bytes]]  # (key, value), value None: deleted


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
        self.inner.write(batch)
        self._changes.extend(batch.ops.items())

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


def restore_store(target: Store, records: Iterable[Change], batch_size: int = 10_000) -> int:
    """Rebuild ``target`` (empty) from changelog records read in offset order; returns the
    sequence number the changelog reached."""
    batch = WriteBatch()
    for key, value in records:
        if value is None:
            batch.delete(key)
        else:
            batch.put(key, value)
        if len(batch) >= batch_size:
            target.write(batch)
            batch = WriteBatch()
    if len(batch):
        target.write(batch)
    return sequence_of(target)
