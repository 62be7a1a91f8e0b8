"""Sampler tables built before the first trigger, and kept between processes
(docs/architecture.md, "Noise tables").

A worker builds every query's discrete Gaussian tables in a thread as it starts
(``prepare_noise_tables``), and its first trigger waits for them off the event loop. That only
helps if the prepared tables are all the tables the triggers use: a table missed here would be
built on the event loop at the first trigger again, holding health probes and hand-overs.

A table built once is kept in the state directory (state/noise_tables.py) and loaded at the next
start: the loaded table must be the built one, word for word, and a damaged file must be built
again, never used.
"""
import io
import json
import logging
import subprocess
import threading

import numpy as np
import pytest

from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import DpstreamConfig, QueryConfig
from dpstream.processor.engine.pipeline import prepare_noise_tables
from dpstream.processor.mechanisms import noise as noise_module
from dpstream.processor.mechanisms.noise import DiscreteGaussian, NodeNoise, discrete_gaussian, keep_tables_in
from dpstream.state.noise_tables import TABLE_DIR_ENV, NoiseTableDirectory
from tests.conftest import ROOT, TEST_LABEL, TEST_SECRET

START = 1_795_132_800_000


def _queries(counter: str) -> list[QueryConfig]:
    common = dict(window="1d", triggers=4, contribution_bound=2, allowed_lateness="0s", counter=counter)
    return [
        QueryConfig(name="places", key_fields=["country", "city"], hierarchy=True, epsilon=8.0, delta=1e-6, **common),
        QueryConfig(name="spend", key_fields=["country"], aggregate="mean", value_field="amount", clamp=100.0,
                    epsilon=8.0, delta=1e-6, **common),
    ]


def _rows() -> list[dict]:
    rng = np.random.default_rng(3)
    times = np.sort(rng.integers(0, 86_400_000, 4000))
    return [{"user_id": f"u{u}", "country": "fr" if u % 3 else "de", "city": f"c{u % 2}", "amount": float(u % 90),
             "ts": START + int(t)} for u, t in zip(range(4000), times)]


@pytest.mark.parametrize("counter", ["blt", "tree"])
def test_the_prepared_tables_are_every_table_the_triggers_use(tmp_path, counter):
    """After prepare_noise_tables, a whole window of a two-level hierarchy and of a mean (two
    columns), released at every level, builds no table: the count of tables built stays put."""
    queries = _queries(counter)
    noise_module._cached_table.cache_clear()
    for query in queries:
        prepare_noise_tables(query, NodeNoise(TEST_SECRET, TEST_LABEL))
    prepared = noise_module._cached_table.cache_info().misses
    assert prepared >= 2

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    runner = ReplayRunner(DpstreamConfig(queries=queries), TEST_SECRET, None, log=io.StringIO(), noise_label=TEST_LABEL)
    out = io.StringIO()
    try:
        runner.run(str(path), out)
    finally:
        runner.close()
    releases = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {r["query"] for r in releases} == {"places", "spend"}
    assert {len(r["key"]) for r in releases if r["query"] == "places"} == {1, 2}  # both levels released
    assert noise_module._cached_table.cache_info().misses == prepared


def test_a_table_two_threads_ask_for_at_once_is_built_once():
    """The worker's start builds tables in a thread; a trigger asking meanwhile waits for that
    build instead of starting a second one."""
    sigma = 4321.25
    noise_module._cached_table.cache_clear()
    barrier = threading.Barrier(3)
    got = []

    def ask():
        barrier.wait()
        got.append(discrete_gaussian(sigma))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and got[0] is got[1] is got[2]
    assert noise_module._cached_table.cache_info().misses == 1


def same_table(a: DiscreteGaussian, b: DiscreteGaussian) -> bool:
    return (a.sigma, a.bound, a.variance, a.truncation_mass, a.tv_bound, a._guide_bits) == \
        (b.sigma, b.bound, b.variance, b.truncation_mass, b.tv_bound, b._guide_bits) and \
        all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("_hi", "_lo", "_bucket_edges"))


@pytest.fixture
def keeper(tmp_path):
    """A table directory of the test's own for this process; the run's keeper back afterwards."""
    previous = noise_module._keeper
    kept = NoiseTableDirectory(tmp_path / "tables")
    keep_tables_in(kept)
    noise_module._cached_table.cache_clear()
    yield kept
    keep_tables_in(previous)
    noise_module._cached_table.cache_clear()


@pytest.mark.parametrize("sigma", [0.7, 129.5, 40_000.0])
def test_a_kept_table_loads_as_the_table_built(keeper, sigma):
    """Saved by the first process that builds it, loaded by the next: the same words, guide
    table, variance and bounds as a table built afresh (40,000: the lattice scale)."""
    built = discrete_gaussian(sigma)
    assert keeper.path(sigma).exists()
    loaded = keeper.load(sigma)
    assert loaded is not None and loaded is not built and same_table(loaded, built)
    assert same_table(loaded, DiscreteGaussian(sigma))
    draws = np.random.default_rng(5).integers(0, 2**64, size=(2, 20_000), dtype=np.uint64)
    assert np.array_equal(loaded.from_uniform(*draws), built.from_uniform(*draws))


def _flip_a_word(path):
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["hi"] = arrays["hi"].copy()
    arrays["hi"][len(arrays["hi"]) // 3] ^= np.uint64(1 << 40)  # a shifted cut between two outcomes
    np.savez(path, **arrays)


def _other_sigma(path):
    other = path.parent / "other.npz"
    NoiseTableDirectory(path.parent).save(DiscreteGaussian(3.5))
    NoiseTableDirectory(path.parent).path(3.5).rename(path)
    other.unlink(missing_ok=True)


@pytest.mark.parametrize("damage", {
    "cut short": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "a flipped word": _flip_a_word,
    "another sigma's table": _other_sigma,
    "not a table": lambda p: p.write_bytes(b"not a table"),
}.items(), ids=lambda d: d[0])
def test_a_damaged_table_file_is_built_again_and_rewritten(keeper, damage, caplog):
    """A kept file that does not check is never used: a warning names the file, the table is
    built again (the exact table) and the file rewritten."""
    sigma = 2.5
    expected = DiscreteGaussian(sigma)
    keeper.save(expected)
    damage[1](keeper.path(sigma))
    with caplog.at_level(logging.WARNING, logger="dpstream.state.noise_tables"):
        got = discrete_gaussian(sigma)
    assert same_table(got, expected)
    assert str(keeper.path(sigma)) in caplog.text
    assert same_table(keeper.load(sigma), expected)  # rewritten whole


def test_an_unwritable_table_directory_leaves_the_table_in_memory(tmp_path, caplog):
    """A directory that cannot be written (here a file stands where it should be) costs the
    saving only: the table is used, a warning says it was not kept."""
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    previous = noise_module._keeper
    keep_tables_in(NoiseTableDirectory(blocked / "tables"))
    noise_module._cached_table.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dpstream.state.noise_tables"):
            table = discrete_gaussian(6.25)
    finally:
        keep_tables_in(previous)
        noise_module._cached_table.cache_clear()
    assert same_table(table, DiscreteGaussian(6.25))
    assert "not kept" in caplog.text


def test_replay_keeps_tables_in_its_state_directory_and_loads_them_to_the_same_releases(tmp_path):
    """Without $DPSTREAM_NOISE_TABLE_DIR a replay with --state-dir keeps its tables in the state
    directory's noise-tables; a second replay (another process, the same label) that loads them
    from there releases byte for byte what the first did, and `dpstream reset`'s check takes the
    directory for state."""
    from dpstream.processor.adapters.start_over import check_state_dir

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    config = tmp_path / "q.yaml"
    config.write_text("queries:\n  - name: places\n    key_fields: [country, city]\n    window: 1d\n    triggers: 4\n"
                      "    epsilon: 8.0\n    delta: 1.0e-6\n    contribution_bound: 2\n    allowed_lateness: 0s\n")
    key = tmp_path / "k"
    key.write_bytes(TEST_SECRET.hex().encode())
    key.chmod(0o600)
    env = {k: v for k, v in __import__("os").environ.items() if k != TABLE_DIR_ENV}
    outputs = []
    for run in ("first", "second"):
        state = tmp_path / f"state-{run}"
        if run == "second":  # the first run's tables, as a restart finds them
            (tmp_path / "state-first" / "noise-tables").rename(state.mkdir() or state / "noise-tables")
        out = tmp_path / f"{run}.jsonl"
        done = subprocess.run([str(ROOT / ".venv/bin/dpstream"), "replay", "--config", str(config), "--input", str(path),
                               "--output", str(out), "--state-dir", str(state), "--noise-key-file", str(key),
                               "--noise-label", "tables-test", "--quiet"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        tables = sorted(p.name for p in (state / "noise-tables").glob("*.npz"))
        assert tables and all(name.startswith("discrete-gaussian-v1-") for name in tables)
        check_state_dir(state)  # reset would take it: no foreign entry
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") > 10
