"""A moved or crashed store is restored to exactly its committed state (state/changelog.py).

The adversary's schedule: writes whose transaction commits or aborts (the worker then crashes),
partitions moving between workers and back, volumes lost, the changelog compacted, in any
order. Whatever happened, the store a worker processes with after :func:`restore_from_changelog`
must hold exactly what the committed changelog says: a store ahead of it (writes of an aborted
transaction) would count records twice or publish a journal the output never got; one behind
it would count records again or recompute a release.
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.state.changelog import CHECKPOINT_KEY, restore_from_changelog
from dpstream.state.store import MemoryStore, PartitionStores, WriteBatch

NAME = "events-0"
KEYS = st.sampled_from([b"a", b"b", b"c", b"d1", b"d2"])
BATCH = st.lists(st.tuples(KEYS, st.one_of(st.none(), st.binary(min_size=1, max_size=3))), min_size=1, max_size=4)
STEP = st.one_of(
    st.tuples(st.just("write"), BATCH, st.booleans()),  # committed or aborted (then the owner crashes)
    st.tuples(st.just("delete_prefix"), st.just(b"d"), st.booleans()),
    st.tuples(st.just("move"), st.integers(0, 2)),  # to worker j
    st.tuples(st.just("lose_volume"), st.integers(0, 2)),
    st.tuples(st.just("compact"),),
)


class Changelog:
    """One changelog partition: offsets for every record produced (aborted ones too), and what a
    read_committed reader sees from an offset on."""

    def __init__(self):
        self.records: list[tuple[int, bytes, bytes | None]] = []  # committed, in offset order
        self.next_offset = 0

    def append(self, changes, committed: bool) -> int:
        out = []
        for key, value in changes:
            out.append((self.next_offset, key, value))
            self.next_offset += 1
        self.next_offset += 1  # the transaction marker
        if committed:
            self.records += out
        return out[-1][0]

    def compact(self) -> None:
        last = {key: i for i, (_, key, _) in enumerate(self.records)}
        self.records = [r for i, r in enumerate(self.records) if last[r[1]] == i]

    def reader(self, start: int):
        return self.next_offset, iter([[r for r in self.records if r[0] >= start]])

    def state(self) -> dict:
        store = MemoryStore()
        store.write(WriteBatch().apply((key, value) for _, key, value in self.records))
        return dict(store.scan(b"", b"\xff" * 8))


def contents(store) -> dict:
    return {k: v for k, v in store.scan(b"", b"\xff" * 8) if k != CHECKPOINT_KEY}


@settings(max_examples=400, deadline=None)
@given(st.lists(STEP, max_size=30))
def test_a_restored_store_is_exactly_its_committed_changelog(steps):
    log = Changelog()
    volumes = [PartitionStores(None) for _ in range(3)]
    owner, now = 0, 1_000
    store = restore_from_changelog(volumes[owner], NAME, log.reader, now).store
    for step in steps:
        now += 1
        kind = step[0]
        if kind in ("write", "delete_prefix"):
            if kind == "write":
                store.write(WriteBatch().apply(step[1]))
            else:
                store.delete_prefix(step[1])
            changes, seq = store.take_changes()
            last = log.append(changes, committed=step[2])
            if step[2]:
                store.checkpoint(last, seq, now)
            else:  # the transaction aborted: the worker stops and restarts, its volume kept
                store = restore_from_changelog(volumes[owner], NAME, log.reader, now).store
        elif kind == "move":
            volumes[owner].release(NAME)
            owner = step[1]
            store = restore_from_changelog(volumes[owner], NAME, log.reader, now).store
        elif kind == "lose_volume":
            if step[1] == owner:
                volumes[owner].release(NAME)
            volumes[step[1]] = PartitionStores(None)
            if step[1] == owner:
                store = restore_from_changelog(volumes[owner], NAME, log.reader, now).store
        else:
            log.compact()
        assert contents(store) == log.state()


def test_a_store_ahead_of_its_changelog_is_rebuilt_not_read_on():
    """The attack in one schedule: a write whose transaction aborted stays in the local store;
    reading on from the checkpoint would keep it."""
    log, volume = Changelog(), PartitionStores(None)
    store = restore_from_changelog(volume, NAME, log.reader, 0).store
    batch = WriteBatch()
    batch.put(b"a", b"1")
    store.write(batch)
    changes, seq = store.take_changes()
    store.checkpoint(log.append(changes, committed=True), seq, 0)
    batch = WriteBatch()
    batch.put(b"a", b"2")
    store.write(batch)
    log.append(store.take_changes()[0], committed=False)
    done = restore_from_changelog(volume, NAME, log.reader, 1)
    assert done.full and done.store.get(b"a") == b"1"


def test_a_kept_volume_reads_only_what_was_written_since():
    """A worker regaining its partition (its volume kept) reads on from its checkpoint."""
    log, mine, other = Changelog(), PartitionStores(None), PartitionStores(None)
    store = restore_from_changelog(mine, NAME, log.reader, 0).store
    for i in range(5):
        batch = WriteBatch()
        batch.put(b"k%d" % i, b"v")
        store.write(batch)
        changes, seq = store.take_changes()
        store.checkpoint(log.append(changes, committed=True), seq, 0)
    mine.release(NAME)
    theirs = restore_from_changelog(other, NAME, log.reader, 0)
    assert theirs.full and theirs.records == 10  # each write: its key and the sequence number
    batch = WriteBatch()
    batch.put(b"x", b"y")
    theirs.store.write(batch)
    changes, seq = theirs.store.take_changes()
    theirs.store.checkpoint(log.append(changes, committed=True), seq, 0)
    back = restore_from_changelog(mine, NAME, log.reader, 0)
    assert not back.full and back.records == 2 and contents(back.store) == log.state()
