"""dpstream.state.tables: the layouts round-trip, and the caches of committed values never disagree with
the store: a batch that is not written teaches them nothing, eviction loses nothing, a dropped
window is forgotten (docs/architecture.md, "State")."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.state.store import MemoryStore, RocksDBStore, WriteBatch
from dpstream.state.tables import (
    AMEND_ENTRY,
    STATE_FORMAT,
    WINDOW_OPEN,
    CommittedCache,
    EpochMarks,
    QueryTables,
    UserStates,
    ViewEntry,
    key_row_dtype,
)


def _user_write(table, batch, window, users, counts, entries):
    """entries: per user a list of (key, trigger)."""
    group = np.repeat(np.arange(len(users)), [len(e) for e in entries])
    flat = [x for e in entries for x in e]
    keys = np.array([k for k, _ in flat], dtype=np.uint64)
    triggers = np.array([t for _, t in flat], dtype=np.int64)
    n = len(users)
    table.write(batch, np.full(n, window), np.array(users, dtype=np.uint64), np.array(counts), np.ones(n, dtype=bool),
                np.zeros(n, dtype=bool), group, keys, triggers)


def test_user_states_round_trip_and_absent_users():
    store = MemoryStore()
    users = UserStates(store, b"qqqq")
    batch = WriteBatch()
    _user_write(users, batch, 0, [7, 2**64 - 1], [3, 1], [[(5, 1), (9, 2)], [(1, 4)]])
    store.write(batch)
    state = users.read(np.array([0, 0, 0]), np.array([7, 8, 2**64 - 1], dtype=np.uint64))
    assert state.admitted.tolist() == [3, 0, 1]
    assert state.group.tolist() == [0, 0, 2]
    assert state.key.tolist() == [5, 9, 1]
    assert state.trigger.tolist() == [1, 2, 4]


def test_full_user_keeps_only_its_count():
    store = MemoryStore()
    users = UserStates(store, b"qqqq")
    batch = WriteBatch()
    users.write(batch, np.array([0]), np.array([1], dtype=np.uint64), np.array([32]), np.array([True]), np.array([True]),
                np.array([0, 0]), np.array([5, 6], dtype=np.uint64), np.array([1, 1]))
    store.write(batch)
    state = users.read(np.array([0]), np.array([1], dtype=np.uint64))
    assert state.admitted.tolist() == [32] and len(state.key) == 0


def test_a_batch_never_written_teaches_the_cache_nothing():
    store = MemoryStore()
    users = UserStates(store, b"qqqq")
    abandoned = WriteBatch()
    _user_write(users, abandoned, 0, [1], [4], [[(2, 3)]])
    # the batch is dropped (a crash or an error before the commit point): the cache must not
    # answer with its values
    assert users.read(np.array([0]), np.array([1], dtype=np.uint64)).admitted.tolist() == [0]
    written = WriteBatch()
    _user_write(users, written, 0, [1], [2], [[(2, 3)]])
    store.write(written)
    assert users.read(np.array([0]), np.array([1], dtype=np.uint64)).admitted.tolist() == [2]
    assert users.cache.hits >= 1  # the second read came from the cache


def test_cache_is_bounded_and_evicts_only_what_the_store_holds():
    store = MemoryStore()
    users = UserStates(store, b"qqqq", cache_entries=100)
    for start in range(0, 1000, 50):
        batch = WriteBatch()
        ids = list(range(start, start + 50))
        _user_write(users, batch, 0, ids, [i % 30 + 1 for i in ids], [[(i, 1)] for i in ids])
        store.write(batch)
        assert len(users.cache) <= 100
    state = users.read(np.zeros(1000, dtype=np.int64), np.arange(1000, dtype=np.uint64))
    assert state.admitted.tolist() == [i % 30 + 1 for i in range(1000)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(1, 40)),
                                                      min_size=1, max_size=8)), min_size=1, max_size=25),
       st.integers(1, 12))
def test_reads_through_the_cache_equal_reads_of_the_store(steps, capacity):
    """Any sequence of written and abandoned batches, over several windows, with a tiny cache:
    every read equals what a fresh table (no cache content) reads from the store."""
    store = MemoryStore()
    users = UserStates(store, b"qqqq", cache_entries=capacity)
    for commit, writes in steps:
        batch = WriteBatch()
        for window in sorted({w for w, _, _ in writes}):
            mine = {u: c for w, u, c in writes if w == window}
            ids = sorted(mine)
            _user_write(users, batch, window, ids, [mine[u] for u in ids], [[(u + 100, mine[u])] for u in ids])
        if commit:
            store.write(batch)
        windows = np.repeat(np.arange(3), 31)
        ids = np.tile(np.arange(31, dtype=np.uint64), 3)
        cached = users.read(windows, ids)
        fresh = UserStates(store, b"qqqq").read(windows, ids)
        for field in ("admitted", "group", "key", "trigger"):
            assert getattr(cached, field).tolist() == getattr(fresh, field).tolist()


def _texts(*values):
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def test_committed_cache_finds_ids_in_any_order_and_overwrites_in_place():
    dtype = np.dtype([("n", "<i8")])
    cache = CommittedCache(dtype, 100)
    rows = np.zeros(3, dtype=dtype)
    rows["n"] = [30, 10, 20]
    cache.upsert(5, np.array([30, 10, 20], dtype=np.uint64), rows, _texts("c", "a", "b"))
    rows2 = np.zeros(2, dtype=dtype)
    rows2["n"] = [11, 40]
    cache.upsert(5, np.array([10, 40], dtype=np.uint64), rows2, _texts("a", "d"))  # one known, one new
    hit, found, texts = cache.lookup(5, np.array([40, 99, 20, 10, 30], dtype=np.uint64))
    assert hit.tolist() == [True, False, True, True, True]
    assert found["n"].tolist() == [40, 20, 11, 30] and texts.tolist() == ["d", "b", "a", "c"]
    assert not cache.lookup(6, np.array([10], dtype=np.uint64))[0].any()  # windows are apart
    cache.drop_window(5)
    assert not cache.lookup(5, np.array([10], dtype=np.uint64))[0].any() and len(cache) == 0


def test_committed_cache_evicts_old_windows_first_and_never_exceeds_its_bound():
    cache = CommittedCache(None, 10)
    cache.upsert(1, np.arange(6, dtype=np.uint64), None, _texts(*"abcdef"))
    cache.upsert(2, np.arange(6, dtype=np.uint64), None, _texts(*"ghijkl"))  # window 1 makes room
    assert not cache.lookup(1, np.arange(6, dtype=np.uint64))[0].any()
    assert cache.lookup(2, np.arange(6, dtype=np.uint64))[0].all()
    cache.upsert(2, np.arange(6, 20, dtype=np.uint64), None, _texts(*"mnopqrstuvwxyz"))  # over the bound alone
    assert len(cache) == 10
    hit, _, texts = cache.lookup(2, np.arange(20, dtype=np.uint64))
    assert hit.sum() == 10 and texts.tolist()[:6] == list("ghijkl")


def test_query_tables_layouts_round_trip(tmp_path):
    with RocksDBStore(tmp_path / "db") as store:
        tables = QueryTables(store, "q", tree_levels=3)
        batch = WriteBatch()
        rows = np.zeros(2, dtype=key_row_dtype(3))
        rows["count"], rows["sel_cache"], rows["predicted"] = [4, 9], [[1, 2, 3], [4, 5, 6]], [3, 0]
        tables.keys.write(batch, 0, np.array([10, 11], dtype=np.uint64), rows)
        tables.pending.append(batch, 0, 2, 7, (3).to_bytes(4, "little") + b"rest")
        amend = np.zeros(1, dtype=AMEND_ENTRY)
        amend["key"], amend["user"], amend["trigger"] = 10, 99, 1
        tables.amends.append(batch, 0, 2, 7, amend)
        tables.predictions.move(batch, 0, np.array([10, 11], dtype=np.uint64), np.array([0, 0]), np.array([3, 0]), 1)
        tables.journal.put(batch, 0, 2, 10, b"{}")
        tables.progress.put(batch, 0, 2, WINDOW_OPEN, b"f" * 16)
        tables.schedule.put(batch, -5, 86_400_000)
        tables.published.put(batch, 0, 2)
        tables.view.put(batch, 0, 10, ViewEntry(11, 2, 2, 40, 1.5, 39, 1, "[\"a\",\"b\"]"))
        tables.names.register(batch, 0, [10], ["[\"a\"]"])
        store.write(batch)

        fresh = QueryTables(store, "q", tree_levels=3)  # nothing cached: everything from the store
        blank = np.zeros(1, dtype=key_row_dtype(3))
        loaded, stored = fresh.keys.load(0, np.array([11, 10, 12], dtype=np.uint64), blank)
        assert loaded["count"].tolist() == [9, 4, 0] and stored.tolist() == [True, True, False]
        assert loaded["sel_cache"].tolist()[:2] == [[4, 5, 6], [1, 2, 3]]
        assert fresh.pending.records_in(0) == 3
        assert fresh.predictions.at(0, 3).tolist() == [10]
        assert fresh.journal.read(0, 2) == [b"{}"]
        assert fresh.progress.scan()[0].fired == 2
        assert fresh.schedule.get() == (-5, 86_400_000)
        assert fresh.published.get(0) == 2
        assert fresh.view.read(0, 10) == [ViewEntry(11, 2, 2, 40, 1.5, 39, 1, "[\"a\",\"b\"]")]
        assert fresh.names.owners(0, [10, 11]) == ["[\"a\"]", None]
        batch = WriteBatch()
        assert fresh.amends.take(0, 2, batch).tolist() == amend.tolist()
        assert [b[:4] for b in fresh.pending.take(0, 2, batch)] == [(3).to_bytes(4, "little")]
        store.write(batch)
        assert fresh.pending.records_in(0) == 0

        tables.drop_window(0)
        assert tables.keys.count(0) == 0
        assert tables.keys.load(0, np.array([10], dtype=np.uint64), blank)[1].tolist() == [False]  # the cache forgot it too
        assert tables.predictions.at(0, 3).tolist() == []  # and the prediction mirror
        assert tables.journal.read(0, 2) == [b"{}"]  # the journal outlives the window's working state


def test_epoch_marks():
    store = MemoryStore()
    marks = EpochMarks(store)
    assert marks.get() is None
    marks.put("fp", "label")
    assert marks.get() == ("fp", STATE_FORMAT, "label") and marks.label() == "label"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 15), st.integers(0, 8)), max_size=10)),
                min_size=1, max_size=20), st.integers(1, 40))
def test_key_rows_names_and_prediction_index_in_memory_equal_the_store(steps, capacity):
    """Stage 2's tables kept in memory (key rows, key owners, the prediction index) under any
    sequence of written and abandoned trigger batches, with a tiny cache: every read equals what
    fresh tables read from the store. A step fires the next trigger: (commit?, [(key id, next
    visit)]); an abandoned step's trigger fires again."""
    store = MemoryStore()
    tables = QueryTables(store, "q", tree_levels=2, key_cache_entries=capacity)
    blank = np.zeros(1, dtype=tables.keys.dtype)
    predicted = {}  # committed: key id -> trigger indexed under
    fired = 0
    for commit, moves in steps:
        now = fired + 1
        batch = WriteBatch()
        taken = tables.predictions.take(0, now, batch)
        plan = dict(moves)  # one entry per key id, the last wins
        ids = np.array(sorted(set(plan) | set(taken.tolist())), dtype=np.uint64)
        rows, _ = tables.keys.load(0, ids, blank)
        owners = tables.names.owners(0, ids.tolist())
        new_owner = [j for j, o in enumerate(owners) if o is None]
        tables.names.register(batch, 0, [int(ids[j]) for j in new_owner], [f"k{int(ids[j])}" for j in new_owner])
        old = np.array([predicted.get(int(i), 0) for i in ids], dtype=np.int64)
        new = np.array([max(plan.get(int(i), 0), 0) for i in ids], dtype=np.int64)
        new = np.where(new > now, new, 0)  # the next visit is after this trigger, or none
        rows["count"] += now
        rows["predicted"] = new
        tables.predictions.move(batch, 0, ids, old, new, now)
        tables.keys.write(batch, 0, ids, rows)
        if commit:
            store.write(batch)
            fired = now
            predicted.update({int(i): int(t) for i, t in zip(ids, new)})
            for i in taken.tolist():
                if predicted.get(i) == now:
                    predicted[i] = 0
        fresh = QueryTables(store, "q", tree_levels=2)
        all_ids = np.arange(16, dtype=np.uint64)
        for trigger in range(fired + 1, 9):  # triggers fired already are spent: never asked for again
            assert tables.predictions.at(0, trigger).tolist() == fresh.predictions.at(0, trigger).tolist()
            assert fresh.predictions.at(0, trigger).tolist() == sorted(i for i, t in predicted.items() if t == trigger)
        mine, fresh_rows = tables.keys.load(0, all_ids, blank), fresh.keys.load(0, all_ids, blank)
        assert mine[0].tobytes() == fresh_rows[0].tobytes() and mine[1].tolist() == fresh_rows[1].tolist()
        assert tables.names.owners(0, all_ids.tolist()) == fresh.names.owners(0, all_ids.tolist())


_EDGE_IDS = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**48 - 1, 2**48, 2**63, 2**64 - 2**48, 2**64 - 2, 2**64 - 1]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_EDGE_IDS, max_size=30), min_size=1, max_size=6), st.lists(_EDGE_IDS, max_size=40),
       st.sampled_from([0, 1, 5, 1 << 20]), st.sampled_from(["numba", "numpy"]))
def test_sorted_ids_find_what_was_added_with_or_without_the_bucket_directory(additions, probes, directory_from, kernels):
    """The sorted-id index (the compiled search through the bucket directory, or numpy's: a
    plain binary search, or the directory vectorized) finds every added id at its slot and
    nothing else, in any order, ids at the 64-bit edges and sharing their top bits included,
    with the directory kept up to date through additions."""
    import dpstream.state.tables as tables
    from dpstream.state import kernels as search

    saved = search.NUMPY_DIRECTORY_FROM, search._choice
    search.NUMPY_DIRECTORY_FROM = directory_from
    search.use(kernels)
    try:
        index, reference = tables._SortedIds(), {}
        for ids in additions:
            new = [i for i in dict.fromkeys(ids) if i not in reference]
            slots = list(range(len(reference), len(reference) + len(new)))
            index.add(np.array(new, dtype=np.uint64), np.array(slots, dtype=np.int64))
            reference.update(zip(new, slots))
            asked = probes + list(reference)[::3]
            found = index.find(np.array(asked, dtype=np.uint64)).tolist()
            assert found == [reference.get(i, -1) for i in asked]
    finally:
        search.NUMPY_DIRECTORY_FROM, search._choice = saved


def test_a_window_the_cache_dropped_before_its_batch_committed_is_read_back_whole():
    """A batch writes windows 0 and 1 through a cache too small for them: loading window 1 for
    the batch (a replay of its log) drops window 0, whose part of the batch then commits. The
    cache must not come back holding window 0 with only that batch's users (its other users
    would look new and get a fresh contribution budget): the next read replays window 0's log."""
    store = MemoryStore()
    users = UserStates(store, b"qqqq", cache_entries=4)
    for window in (0, 1, 2):  # each window's commit drops the one before it from the cache
        batch = WriteBatch()
        _user_write(users, batch, window, [1, 2, 3], [5, 6, 7], [[(9, 1)], [(9, 1)], [(9, 1)]])
        store.write(batch)
    batch = WriteBatch()
    _user_write(users, batch, 0, [4], [1], [[(9, 2)]])
    _user_write(users, batch, 1, [1], [8], [[(9, 1), (9, 2)]])  # a user window 1's reloaded cache holds: no room needed
    store.write(batch)
    windows, ids = np.repeat([0, 1, 2], 4), np.tile(np.arange(1, 5, dtype=np.uint64), 3)
    expected = [5, 6, 7, 1, 8, 6, 7, 0, 5, 6, 7, 0]
    assert users.read(windows, ids).admitted.tolist() == expected
    assert UserStates(store, b"qqqq").read(windows, ids).admitted.tolist() == expected


def test_a_start_replays_the_latest_windows_logs_and_leaves_older_ones_for_first_use():
    """A restart replays the changelogs of the latest two windows before any batch (so the first
    batch after a start is not the slow one) and leaves older windows, which only late records
    could reach, to load when first read; either way every read equals the store's content."""
    store = MemoryStore()
    tables = QueryTables(store, "q", tree_levels=4)
    windows = [0, 86_400_000, 2 * 86_400_000, 3 * 86_400_000]
    for w in windows:
        batch = WriteBatch()
        _user_write(tables.users, batch, w, [1, 2], [3, 4], [[(5, 1)], [(6, 2)]])
        store.write(batch)
    assert tables.users.log.windows() == windows
    restarted = QueryTables(store, "q", tree_levels=4)
    restarted.load_logs()
    assert [restarted.users.cache.holds(w) for w in windows] == [False, False, True, True]
    state = restarted.users.read(np.repeat(windows, 2), np.tile(np.array([1, 2], dtype=np.uint64), 4))
    assert state.admitted.tolist() == [3, 4] * 4 and state.key.tolist() == [5, 6] * 4


def test_a_window_over_the_key_cache_bound_still_scans_whole():
    """Key rows of a window larger than the cache: the rows it could not hold are spilled under
    their own keys, and a scan (which rebuilds the prediction index after a restart) sees them
    all, so no key predicted for a trigger is forgotten and no key is counted twice."""
    store = MemoryStore()
    tables = QueryTables(store, "q", tree_levels=2, key_cache_entries=3)
    ids = np.arange(100, 110, dtype=np.uint64)
    rows = np.zeros(len(ids), dtype=tables.keys.dtype)
    rows["count"], rows["predicted"] = np.arange(10), [5, 6] * 5
    for part in (slice(0, 4), slice(4, 10)):
        batch = WriteBatch()
        tables.keys.write(batch, 0, ids[part], rows[part])
        store.write(batch)
    for reader in (tables, QueryTables(store, "q", tree_levels=2, key_cache_entries=3)):
        assert reader.keys.count(0) == 10
        scanned_ids, scanned = reader.keys.scan(0)
        assert scanned_ids.tolist() == ids.tolist() and scanned["count"].tolist() == list(range(10))
        assert reader.predictions.at(0, 5).tolist() == ids[0::2].tolist()
        assert reader.predictions.at(0, 6).tolist() == ids[1::2].tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
                          st.lists(st.integers(0, 6), min_size=12, max_size=12)), min_size=1, max_size=25),
       st.sampled_from([4, 100]))
def test_user_states_through_many_commits_read_as_a_model_does(batches, capacity):
    """User states are kept as spans of one array per window, a rewritten state appended anew
    and the stale spans collected when they outweigh the live ones: through any sequence of
    commits (and a cache too small, whose overflow is spilled) every read, and a restart's
    replay of the log, gives each user's latest state, entries in order."""
    from dpstream.state.tables import USER_ENTRY

    store = MemoryStore()
    users = UserStates(store, b"qqqq", cache_entries=capacity)
    model: dict[int, tuple[int, list]] = {}
    for step, (ids, sizes) in enumerate(batches):
        ids = sorted(ids)
        entries = [[(1000 * u + j, step + j) for j in range(sizes[i])] for i, u in enumerate(ids)]
        batch = WriteBatch()
        _user_write(users, batch, 0, ids, [len(e) for e in entries], entries)
        store.write(batch)
        model.update({u: (len(e), e) for u, e in zip(ids, entries)})
    every = np.arange(0, 41, dtype=np.uint64)
    for reader in (users, UserStates(store, b"qqqq", cache_entries=capacity)):
        state = reader.read(np.zeros(len(every), dtype=np.int64), every)
        assert state.admitted.tolist() == [model.get(u, (0, []))[0] for u in range(41)]
        got = [list(zip(state.key[state.group == g].tolist(), state.trigger[state.group == g].tolist())) for g in range(41)]
        assert got == [model.get(u, (0, []))[1] for u in range(41)]
    assert USER_ENTRY.itemsize == 12  # the blob's lengths are in bytes: 12 per entry, as before


@settings(max_examples=80, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 19), st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=40),
       st.sampled_from(["numba", "numpy"]))
def test_the_part_arena_keeps_each_slots_latest_part_through_growth_and_collection(writes, kernels):
    """The spans behind ragged parts (user states' key histories): a tiny arena must grow and
    collect its garbage often, and every slot still reads back its latest part (spans copied
    compiled or by numpy; every other write picks its parts out of a larger batch in place)."""
    from dpstream.state import kernels as state_kernels

    saved = state_kernels._choice
    state_kernels.use(kernels)
    try:
        _arena_through(writes)
    finally:
        state_kernels.use(saved)


def _arena_through(writes):
    from dpstream.state.tables import USER_ENTRY, Ragged, _Arena

    arena = _Arena(USER_ENTRY, size=4)
    arena.grow(20)
    model = {}
    for step, write in enumerate(writes):
        slots = np.array(sorted(write), dtype=np.int64)
        lengths = np.array([write[s] for s in sorted(write)], dtype=np.int64)
        data = np.zeros(int(lengths.sum()), dtype=USER_ENTRY)
        data["key"] = np.repeat(slots, lengths).astype(np.uint64)
        data["trigger"] = step
        if step % 2:  # the parts picked out of a larger batch, each after a decoy part of another slot's
            decoy = np.zeros(len(lengths), dtype=np.int64) + 1
            both = np.stack([decoy, lengths], axis=1).ravel()
            mixed = np.zeros(int(both.sum()), dtype=USER_ENTRY)
            mixed["key"] = 999
            real = Ragged.of_lengths(both, mixed)
            for j in range(len(lengths)):
                mixed[real.offsets[2 * j + 1]:real.offsets[2 * j + 2]] = data[lengths[:j].sum():lengths[:j + 1].sum()]
            arena.set(slots, real, np.arange(1, 2 * len(lengths), 2))
        else:
            arena.set(slots, Ragged.of_lengths(lengths, data))
        model.update({int(s): (int(n), step) for s, n in zip(slots, lengths)})
        got = arena.get(np.arange(20))
        for s in range(20):
            part = got.data[got.offsets[s]:got.offsets[s + 1]]
            n, at = model.get(s, (0, None))
            assert len(part) == n and (part["key"] == s).all() and (part["trigger"] == at).all()
        assert arena.used <= len(arena.data)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.booleans()), max_size=50))
def test_user_entries_pack_alike_compiled_or_in_numpy(rows):
    """A user state's entries, packed into 12-byte records, are the same bytes either way, and
    read back as the (key, trigger) pairs they were."""
    from dpstream.state import kernels as state_kernels
    from dpstream.state.tables import USER_ENTRY

    keys = np.array([r[0] for r in rows], dtype=np.uint64)
    triggers = np.array([r[1] for r in rows], dtype=np.int64)
    keep = np.array([r[2] for r in rows], dtype=bool)
    saved = state_kernels._choice
    try:
        packed = {}
        for name in ("numba", "numpy"):
            state_kernels.use(name)
            packed[name] = state_kernels.pack_words(keys, triggers, keep)
    finally:
        state_kernels.use(saved)
    assert packed["numba"].tobytes() == packed["numpy"].tobytes()
    entries = packed["numba"].view(USER_ENTRY).reshape(-1)
    assert list(zip(entries["key"].tolist(), entries["trigger"].tolist())) == [(k, t) for k, t, kept in rows if kept]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=30), st.sampled_from([1, 3, 8, 12, 16]),
       st.randoms(use_true_random=False))
def test_span_copies_move_whole_items_of_any_width_alike_compiled_or_in_numpy(spans, width, rnd):
    """Gathering spans out of an array and scattering parts into spans (picked parts, items of 1
    to 16 bytes, copied as machine words where the width allows) give the same bytes either way."""
    from dpstream.state import kernels as state_kernels

    item = np.dtype((np.void, width))
    source = np.frombuffer(bytes(rnd.getrandbits(8) for _ in range(64 * width)), dtype=item).copy()
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    lengths = np.array([min(n, 64 - a) for a, n in spans], dtype=np.int64)
    targets = np.cumsum(lengths) - lengths + 3  # disjoint spans of a second array
    saved, out = state_kernels._choice, {}
    try:
        for name in ("numba", "numpy"):
            state_kernels.use(name)
            gathered = state_kernels.gather_spans(source, starts, lengths)
            into = np.zeros(int(lengths.sum()) + 6, dtype=item)
            state_kernels.scatter_spans(into, targets, source, starts, lengths)
            out[name] = gathered.tobytes(), into.tobytes()
    finally:
        state_kernels.use(saved)
    assert out["numba"] == out["numpy"]
    assert out["numpy"][0] == b"".join(source[a:a + n].tobytes() for a, n in zip(starts, lengths))
    assert out["numpy"][1] == b"\0" * 3 * width + out["numpy"][0] + b"\0" * 3 * width


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 2**64 - 1), max_size=60), st.sets(st.integers(0, 2**64 - 1), max_size=30))
def test_new_ids_merge_into_a_sorted_index_alike_compiled_or_in_numpy(old, new):
    """A cache's index after new ids are added: sorted, each id with its slot, either way."""
    from dpstream.state import kernels as state_kernels

    new = new - old
    ids = np.array(sorted(old), dtype=np.uint64)
    slots = np.arange(len(ids), dtype=np.int64)
    new_ids = np.array(sorted(new), dtype=np.uint64)
    new_slots = np.arange(len(ids), len(ids) + len(new_ids), dtype=np.int64)
    saved, out = state_kernels._choice, {}
    try:
        for name in ("numba", "numpy"):
            state_kernels.use(name)
            merged_ids, merged_slots = state_kernels.merged(ids, slots, new_ids, new_slots)
            out[name] = (merged_ids.tolist(), merged_slots.tolist())
    finally:
        state_kernels.use(saved)
    assert out["numba"] == out["numpy"]
    expected = sorted([(int(i), int(s)) for i, s in zip(ids, slots)] + [(int(i), int(s)) for i, s in zip(new_ids, new_slots)])
    assert out["numpy"] == ([i for i, _ in expected], [s for _, s in expected])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.dictionaries(st.integers(0, 30), st.integers(-1, 4), min_size=1, max_size=10),
                          st.sampled_from(["go on", "restart", "drop", "drop between"])), min_size=1, max_size=25),
       st.sampled_from([3, 12, 100]), st.booleans())
def test_user_states_written_as_appends_read_as_a_model_does_through_restarts(steps, capacity, whole_first):
    """Stage 1 writes a touched user's new entries only (its state keeps its entries, then
    appends): the changelog holds appends, replayed in order onto what the earlier blobs gave
    each user, in the cache or, over its bound, under the user's spilled key (read back and
    written whole). Through any sequence of appends, users reaching the bound (count only),
    restarts (a replay of the whole log) and the cache dropping the window, every read gives
    each user's latest state, entries in order. The commit skips the search of the users the
    read found, unless the cache dropped the window in between (before or after the commit is
    prepared). ``whole_first``: the window starts with a blob of whole states as stages before
    appends wrote them, and appends follow it."""
    store = MemoryStore()
    users = UserStates(store, b"qqqq", cache_entries=capacity)
    model: dict[int, tuple[int, list]] = {}
    if whole_first:
        start = {u: [(10_000 + u, 0)] for u in range(0, 31, 3)}
        batch = WriteBatch()
        _user_write(users, batch, 0, sorted(start), [1] * len(start), [start[u] for u in sorted(start)])
        store.write(batch)
        model.update({u: (1, e) for u, e in start.items()})
    every = np.arange(0, 31, dtype=np.uint64)
    for step, (touched, then) in enumerate(steps):
        ids = np.array(sorted(touched), dtype=np.uint64)
        state = users.read(np.zeros(len(ids), dtype=np.int64), ids)
        counts, entries, full = [], [], []
        for g, u in enumerate(ids.tolist()):
            old = list(zip(state.key[state.group == g].tolist(), state.trigger[state.group == g].tolist()))
            assert (int(state.admitted[g]), old) == model.get(u, (0, []))
            grow = touched[u]  # -1: the user reaches the bound (its entries are never needed again)
            new = old + [(1000 * u + step * 10 + j, step) for j in range(max(grow, 0))]
            counts.append(int(state.admitted[g]) + max(grow, 1))
            full.append(grow < 0)
            entries.append(new[len(old):])  # the entries appended (key_histories(..., appended=True))
            model[u] = (counts[-1], [] if grow < 0 else new)
        group = np.repeat(np.arange(len(ids)), [len(e) for e in entries])
        flat = [x for e in entries for x in e]
        batch = WriteBatch()
        if then == "drop between":
            users.drop_window(0)
        users.write(batch, np.zeros(len(ids), dtype=np.int64), ids, np.array(counts), np.ones(len(ids), dtype=bool), np.array(full),
                    group, np.array([k for k, _ in flat], dtype=np.uint64), np.array([t for _, t in flat], dtype=np.int64),
                    before=state.entries, where=state.where)
        if then == "drop between":  # the cache drops the window between the read and the commit
            users.drop_window(0)
        store.write(batch)
        if then == "restart":
            users = UserStates(store, b"qqqq", cache_entries=capacity)
        elif then == "drop":
            users.drop_window(0)
    for reader in (users, UserStates(store, b"qqqq", cache_entries=capacity)):
        state = reader.read(np.zeros(len(every), dtype=np.int64), every)
        assert state.admitted.tolist() == [model.get(u, (0, []))[0] for u in range(31)]
        got = [list(zip(state.key[state.group == g].tolist(), state.trigger[state.group == g].tolist())) for g in range(31)]
        assert got == [model.get(u, (0, []))[1] for u in range(31)]


def test_an_append_that_does_not_follow_the_stored_state_is_refused():
    """A changelog whose append does not start where the user's stored state ends (a lost or
    reordered blob) is refused on replay, never read as some other state."""
    import pytest

    from dpstream.state import keys as sk

    store = MemoryStore()
    users = UserStates(store, b"qqqq")
    batch = WriteBatch()
    _user_write(users, batch, 0, [5], [2], [[(1, 1), (2, 1)]])
    store.write(batch)
    state = users.read(np.zeros(1, dtype=np.int64), np.array([5], dtype=np.uint64))
    batch = WriteBatch()
    users.write(batch, np.zeros(1, dtype=np.int64), np.array([5], dtype=np.uint64), np.array([3]), np.ones(1, dtype=bool),
                np.zeros(1, dtype=bool), np.zeros(1, dtype=np.int64), np.array([3], dtype=np.uint64), np.array([2]),
                before=state.entries)
    store.write(batch)
    first = next(iter(store.scan_prefix(sk.window_prefix(sk.USER_LOG, b"qqqq", 0))))[0]
    batch = WriteBatch()
    batch.delete(first)  # the whole state's blob is gone: the append has nothing to follow
    store.write(batch)
    with pytest.raises(ValueError, match="inconsistent"):
        UserStates(store, b"qqqq").read(np.zeros(1, dtype=np.int64), np.array([5], dtype=np.uint64))
