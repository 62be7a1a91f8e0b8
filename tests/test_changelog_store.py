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


def committed_then(ops_before, ops_after):
    """A store whose ``ops_before`` went out in a committed transaction (checkpointed), then
    ``ops_after`` written locally, their transaction never committed."""
    from dpstream.state.changelog import restore_start

    store = ChangelogStore(MemoryStore())
    for kind, arg in ops_before:
        store.write(WriteBatch().apply(arg)) if kind == "batch" else store.delete_prefix(arg)
    log, seq = store.take_changes()
    store.checkpoint(len(log) - 1, seq, now_ms=1_000)
    at_checkpoint = contents(store.inner)
    assert restore_start(store.inner, now_ms=2_000) in (0, len(log))  # empty, or incremental from the checkpoint
    for kind, arg in ops_after:
        store.write(WriteBatch().apply(arg)) if kind == "batch" else store.delete_prefix(arg)
    return store, log, at_checkpoint


@settings(max_examples=300, deadline=None)
@given(OPS, OPS)
def test_a_rollback_brings_the_store_back_to_its_checkpoint(before, after):
    """Elastic workers give up a batch whose transaction's offsets the group refused
    (processor/adapters/elastic_run.py, give_up_batch): the writes since the last committed
    transaction are undone, so the store equals its changelog up to the checkpoint again, its
    sequence too, and a restore goes on from the checkpoint (incremental), not from the start."""
    from dpstream.state.changelog import restore_start

    store, log, at_checkpoint = committed_then(before, after)
    assert store.rollback()
    assert contents(store.inner) == at_checkpoint
    rebuilt = MemoryStore()
    restore_store(rebuilt, log)
    assert contents(rebuilt) == {k: v for k, v in at_checkpoint.items() if not k.startswith(b"\x00changelog-checkpoint")}
    assert store.take_changes() == ([], sequence_of(store.inner))  # nothing of the undone writes is sent later
    if at_checkpoint:
        assert restore_start(store.inner, now_ms=2_000) == len(log)  # incremental: from after the checkpoint
    # and it goes on as usual: a new write, a commit
    store.write(WriteBatch().apply([(b"z", b"9")]))
    changes, seq = store.take_changes()
    assert changes[0] == (b"z", b"9") and seq == sequence_of(store.inner)


def test_a_rollback_after_too_many_keys_forces_a_full_restore(monkeypatch):
    """Past UNDO_MAX_KEYS written keys the store stops keeping their old values; a rollback then
    drops the checkpoint, and the next restore rebuilds the store from the changelog's start."""
    import dpstream.state.changelog as changelog

    monkeypatch.setattr(changelog, "UNDO_MAX_KEYS", 5)
    store, log, _ = committed_then([("batch", [(b"a", b"1")])], [("batch", [(bytes([i]), b"x") for i in range(10)])])
    assert not store.rollback()
    assert changelog.restore_start(store.inner, now_ms=2_000) is None  # wiped and rebuilt in full
