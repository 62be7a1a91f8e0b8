"""The changelog of a store rebuilds it exactly, compacted or not (state/changelog.py)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.state.changelog import (
    SEQUENCE_KEY,
    ChangelogStore,
    restore_store,
    sequence_of,
)
from dpstream.state.store import MemoryStore, WriteBatch

KEYS = st.binary(min_size=1, max_size=3)
OPS = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.lists(st.tuples(KEYS, st.one_of(st.none(), st.binary(max_size=4))), max_size=6)),
    st.tuples(st.just("delete_prefix"), st.binary(min_size=1, max_size=1)),
), max_size=40)


def contents(store) -> dict:
    return dict(store.scan(b"", b"\xff" * 8))


def run(ops) -> tuple[ChangelogStore, list]:
    store = ChangelogStore(MemoryStore())
    log = []
    for i, (kind, arg) in enumerate(ops):
        if kind == "batch":
            store.write(WriteBatch().apply(arg))
        else:
            store.delete_prefix(arg)
        if i % 3 == 0:  # sent in several transactions
            log += store.take_changes()[0]
    log += store.take_changes()[0]
    return store, log


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_replaying_the_changelog_rebuilds_the_store(ops):
    store, log = run(ops)
    restored = MemoryStore()
    assert restore_store(restored, log) == store.sequence == len(ops)
    assert contents(restored) == contents(store.inner)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_a_compacted_changelog_rebuilds_the_store(ops):
    """Compaction keeps the last record per key (tombstones too, until they expire)."""
    store, log = run(ops)
    last = {}
    for offset, (key, value) in enumerate(log):
        last[key] = (offset, value)
    compacted = [(key, value) for key, (offset, value) in sorted(last.items(), key=lambda kv: kv[1][0])]
    restored = MemoryStore()
    restore_store(restored, compacted)
    assert contents(restored) == contents(store.inner)
    # expired tombstones change nothing for an empty store
    restored = MemoryStore()
    restore_store(restored, [(k, v) for k, v in compacted if v is not None])
    assert contents(restored) == contents(store.inner)


def test_a_store_ahead_of_its_committed_changelog_is_told_by_its_sequence():
    """Writes made after the last committed transaction: the local store's sequence is ahead."""
    store = ChangelogStore(MemoryStore())
    batch = WriteBatch()
    batch.put(b"a", b"1")
    store.write(batch)
    committed, seq = store.take_changes()  # went out in a transaction that committed
    batch = WriteBatch()
    batch.put(b"a", b"2")
    store.write(batch)  # its transaction never committed: a crash
    restored = MemoryStore()
    assert restore_store(restored, committed) == seq == 1
    assert sequence_of(store.inner) == 2 > seq
    assert restored.get(b"a") == b"1" and restored.get(SEQUENCE_KEY) is not None
