"""Sampler tables built before the first trigger (docs/architecture.md, "Noise tables").

A worker builds every query's discrete Gaussian tables in a thread as it starts
(``prepare_noise_tables``), and its first trigger waits for them off the event loop. That only
helps if the prepared tables are all the tables the triggers use: a table missed here would be
built on the event loop at the first trigger again, holding health probes and hand-overs.
"""
import io
import json
import threading

import numpy as np
import pytest

from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import DpstreamConfig, QueryConfig
from dpstream.processor.engine.pipeline import prepare_noise_tables
from dpstream.processor.mechanisms import noise as noise_module
from dpstream.processor.mechanisms.noise import NodeNoise, discrete_gaussian
from tests.conftest import TEST_LABEL, TEST_SECRET

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
