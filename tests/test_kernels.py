"""The compiled kernels compute exactly what their numpy twins compute
(dpstream.processor.mechanisms.kernels; docs/architecture.md, "Kernels")."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.processor.mechanisms import kernels
from dpstream.processor.mechanisms.counters import BLTCounter
from dpstream.processor.mechanisms.noise import NodeNoise, discrete_gaussian
from tests.conftest import TEST_SECRET

pytestmark = pytest.mark.skipif(kernels._numba() is None, reason="numba is not installed")


@pytest.fixture
def numpy_kernels():
    before = kernels._choice
    yield lambda name: kernels.use(name)
    kernels.use(before)


def _with_each(compute):
    """``compute()`` with the numpy kernels, then with the compiled ones (the choice restored
    after): [numpy's result, numba's]."""
    before = kernels._choice
    try:
        out = []
        for name in ("numpy", "numba"):
            kernels.use(name)
            out.append(compute())
        return out
    finally:
        kernels.use(before)


def _walk(counter, streams, done, upto, state, name):
    kernels.use(name)
    w = counter.walk(streams, done, upto, state)
    stream, step = w.future()
    return w.prefix(stream, step).W, w.state_at(np.asarray(upto))


@settings(max_examples=30, deadline=None)
@given(steps=st.sampled_from([24, 100, 1000]), n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       sigma=st.sampled_from([0.7, 13.2, 74.7, 4096.0]))
def test_the_blt_walk_kernel_equals_numpy(steps, n, seed, sigma):
    rng = np.random.default_rng(seed)
    counter = BLTCounter(steps, sigma, NodeNoise(TEST_SECRET, "kernels"))
    streams = np.array([rng.bytes(16) for _ in range(n)], dtype="S16")
    done = rng.integers(0, steps, n)
    upto = np.minimum(steps, done + rng.integers(0, steps, n))
    # states reached by walking from the start (a real state, not random buffers)
    start = counter.walk(streams, np.zeros(n, dtype=np.int64), done, counter.empty_state(n))
    state = start.state_at(done)
    before = kernels._choice
    try:
        a = _walk(counter, streams, done, upto, state, "numpy")
        b = _walk(counter, streams, done, upto, state, "numba")
    finally:
        kernels.use(before)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@settings(max_examples=20, deadline=None)
@given(sigma=st.sampled_from([0.3, 5.0, 22.9, 1000.0, 131072.0]), seed=st.integers(0, 2**32 - 1))
def test_the_table_lookup_kernel_equals_numpy(sigma, seed):
    table = discrete_gaussian(sigma)
    rng = np.random.default_rng(seed)
    hi = rng.integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, 5000, dtype=np.uint64)
    lo = rng.integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2)
    # uniforms on table words and one below: the low word decides there
    pick = rng.integers(0, len(table._hi), 200)
    hi[:200], lo[:200] = table._hi[pick], table._lo[pick]
    hi[200:400], lo[200:400] = table._hi[pick], table._lo[pick] - np.uint64(1)
    hi[400], lo[400] = np.uint64(2**64 - 1), np.uint64(2**64 - 1)
    hi[401], lo[401] = np.uint64(0), np.uint64(0)
    before = kernels._choice
    try:
        kernels.use("numpy")
        a = table.from_uniform(hi, lo)
        kernels.use("numba")
        b = table.from_uniform(hi, lo)
    finally:
        kernels.use(before)
    assert np.array_equal(a, b)


def test_a_buffer_beyond_its_bound_is_refused_by_both(numpy_kernels):
    counter = BLTCounter(100, 74.7, NodeNoise(TEST_SECRET, "kernels"))
    state = counter.empty_state(1)
    state[0, :counter.buffers] = 1 << 58  # far past the proven bound
    for name in ("numpy", "numba"):
        numpy_kernels(name)
        with pytest.raises(AssertionError, match="beyond its proven bound"):
            counter.walk(np.array([b"x" * 16], dtype="S16"), np.array([0]), np.array([3]), state)


def test_the_choice_is_named_and_checked():
    with pytest.raises(ValueError, match="kernels: must be one of numba, numpy"):
        kernels.use("cython")


@settings(max_examples=20, deadline=None)
@given(trees=st.integers(1, 50), draws=st.integers(0, 400), seed=st.integers(0, 2**32 - 1))
def test_the_noise_prfs_blocks_are_the_same_with_either_kernels(trees, draws, seed):
    """The second AES blocks laid out by the kernel give the same uniforms, hence the same noise,
    as numpy's gather and XOR, for node ids across all 32 bits (the level in the high ones)."""
    rng = np.random.default_rng(seed)
    noise = NodeNoise(TEST_SECRET, "kernels")
    ids = np.array([rng.bytes(16) for _ in range(trees)], dtype="S16")
    tree_of = rng.integers(0, trees, draws)
    nodes = rng.integers(0, 2**32, draws, dtype=np.uint64).astype(np.uint32)
    table = discrete_gaussian(13.2)
    out = dict(zip(("numpy", "numba"), _with_each(
        lambda: (*noise.uniforms_indexed(ids, tree_of, nodes), noise.sample_indexed(table, ids, tree_of, nodes)))))
    assert all(np.array_equal(a, b) for a, b in zip(out["numpy"], out["numba"]))
    # and the same as the PRF's definition, draw by draw: AES(AES(tree id) XOR node block)
    for i in range(min(draws, 20)):
        hi, lo = noise.uniforms(ids[tree_of[i]:tree_of[i] + 1], nodes[i:i + 1])
        assert (hi[0], lo[0]) == (out["numba"][0][i], out["numba"][1][i])


@settings(max_examples=30, deadline=None)
@given(steps=st.sampled_from([24, 100, 1000]), n=st.integers(1, 30), seed=st.integers(0, 2**32 - 1),
       sigma=st.sampled_from([0.7, 13.2, 4096.0]), huge=st.booleans())
def test_the_prediction_scan_kernel_equals_numpy(steps, n, seed, sigma, huge):
    """Release prediction's pass over the future (first step above the threshold, largest
    margin) is the same compiled as in numpy, including streams whose integers outgrow floats
    (``huge``: counts near 2^53 / K, decided exactly) and thresholds the noise straddles."""
    from dpstream.processor.mechanisms.counters import scan_future

    rng = np.random.default_rng(seed)
    counter = BLTCounter(steps, sigma, NodeNoise(TEST_SECRET, "kernels"))
    streams = np.array([rng.bytes(16) for _ in range(n)], dtype="S16")
    done = rng.integers(0, steps, n)
    upto = np.full(n, steps)
    state = counter.walk(streams, np.zeros(n, dtype=np.int64), done, counter.empty_state(n)).state_at(done)
    if huge:
        base = (np.int64(1) << 53) // counter.scale + rng.integers(-3, 3, n)
        release_at = (base.max() + rng.normal(0, 3 * sigma, steps)).astype(np.float64)
    else:
        base = rng.integers(0, 50, n)
        release_at = 25 + rng.normal(0, 2 * sigma, steps)
    before = kernels._choice
    try:
        kernels.use("numba")
        walk = counter.walk(streams, done, upto, state)
        compiled = walk.scan(base, release_at)
        kernels.use("numpy")
        reference = scan_future(counter.walk(streams, done, upto, state), base, release_at)
    finally:
        kernels.use(before)
    assert np.array_equal(compiled[0], reference[0]) and np.array_equal(compiled[1], reference[1])


_U64 = st.sampled_from([0, 1, 2, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1])  # few keys (collide often), at the u64 edges


@settings(max_examples=200, deadline=None)
@given(data=st.data(), distinct=st.booleans())
def test_the_key_histories_kernel_equals_numpy(data, distinct):
    """Stage 1's predecessors, amendments and new user states (sets, or multisets under a
    per-key bound) are the same, entry order included, compiled and in numpy, for users with
    prior state or none, repeated records and any event-time order."""
    from dpstream.processor.mechanisms.bounding import key_histories

    groups = data.draw(st.integers(1, 6))
    triples = st.tuples(st.integers(0, groups - 1), _U64, st.integers(1, 20))
    state = sorted(data.draw(st.lists(triples, max_size=30, unique=True)), key=lambda x: x[0])
    batch = data.draw(st.lists(triples, max_size=40))
    g = np.array([x[0] for x in batch], dtype=np.int64)
    k = np.array([x[1] for x in batch], dtype=np.uint64)
    t = np.array([x[2] for x in batch], dtype=np.int64)
    sg = np.array([x[0] for x in state], dtype=np.int64)
    sk = np.array([x[1] for x in state], dtype=np.uint64)
    st_ = np.array([x[2] for x in state], dtype=np.int64)
    def histories():
        out = []
        for appended in (False, True):  # the whole new state, or its new entries only
            h = key_histories(g, k, t, sg, sk, st_, distinct=distinct, appended=appended)
            out += [np.asarray(a).tolist() for a in (h.previous, h.amend, h.group, h.key, h.trigger)]
        return out
    in_numpy, compiled = _with_each(histories)
    assert in_numpy == compiled


@settings(max_examples=100, deadline=None)
@given(groups=st.lists(st.integers(0, 9), max_size=60), prior=st.lists(st.integers(0, 40), min_size=10, max_size=10))
def test_contribution_slots_are_the_same_with_either_kernels(groups, prior):
    """Each record's slot (its user's prior count plus its rank among the user's records of the
    batch, in arrival order) and what is admitted under C, compiled and in numpy."""
    from dpstream.processor.mechanisms.bounding import ContributionBounder

    bounder = ContributionBounder(32, 1.0)
    g = np.array(groups, dtype=np.int64)
    def slots():
        a = bounder.assign_slots(np.array(prior), g)
        return a.slots.tolist(), a.admitted.tolist(), a.counts.tolist()
    in_numpy, compiled = _with_each(slots)
    assert in_numpy == compiled


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(_U64, max_size=80))
def test_the_first_record_of_each_key_id_is_the_same_with_either_kernels(ids):
    """Key id collisions are judged against each id's first record in the batch: the hash
    table finds the same first records as numpy's sort, ids at the 64-bit edges included."""
    arr = np.array(ids, dtype=np.uint64)
    in_numpy, compiled = _with_each(lambda: kernels.first_occurrences(arr).tolist())
    assert in_numpy == compiled == [ids.index(i) for i in ids]


def test_a_workers_start_compiles_every_kernel_stage_one_calls():
    """A worker compiles the kernels at start (``prepare``, off its event loop): it must succeed
    with the kernels' current arguments, and stage 1's calls afterwards must find them compiled
    (a signature prepare misses is compiled on the event loop, mid-batch, or not at all)."""
    from dpstream.processor.mechanisms.bounding import key_histories
    from dpstream.state import kernels as state_kernels
    from dpstream.state.tables import USER_ENTRY, Ragged, _Arena

    before = kernels._choice
    try:
        kernels.use("numba")
        compiled = kernels._numba()
        if compiled is None:
            pytest.skip("numba is not installed")
        kernels.prepare()
        signatures = {name: len(k.signatures) for name, k in {**compiled, **state_kernels._kernel()}.items()}
        g = np.array([0, 1, 1], dtype=np.int64)
        for appended in (False, True):
            key_histories(g, np.array([5, 6, 7], dtype=np.uint64), np.array([1, 2, 2]), np.array([1]), np.array([9], dtype=np.uint64),
                          np.array([1]), appended=appended)
        arena = _Arena(USER_ENTRY, size=4)
        arena.grow(3)
        data = np.zeros(4, dtype=USER_ENTRY)
        arena.set(np.array([0, 2]), Ragged.of_lengths(np.array([1, 3]), data))
        arena.set(np.array([2]), Ragged.of_lengths(np.array([2]), data[:2]), at=np.array([3]))
        assert arena.get(np.array([0, 1, 2])).lengths.tolist() == [1, 0, 5]
        state_kernels.merged(np.array([1, 5], dtype=np.uint64), np.array([0, 1]), np.array([3], dtype=np.uint64), np.array([2]))
        after = {name: len(k.signatures) for name, k in {**compiled, **state_kernels._kernel()}.items()}
        assert after == signatures
    finally:
        kernels.use(before)
