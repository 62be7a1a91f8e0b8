"""Nothing changes but time (issue 35): replays of every kind of query and every lever release
the same bytes with the compiled kernels as with the numpy versions they replace, and as the
commit before the kernels (checked out here from the repository's history)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, TEST_SECRET_HEX

#: the last commit before dpstream.processor.mechanisms.kernels: its releases are the gold
BEFORE_KERNELS = "e3d8a0a"

CONFIG = """budget:
  start: 0
  default: {max_epsilon: 1000, max_delta: 0.5}
queries:
  - {name: count_blt, key_fields: [key], window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8}
  - {name: count_tree, key_fields: [key], window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8, counter: tree}
  - {name: count_zcdp, key_fields: [key], window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8, composition: zcdp}
  - {name: sum, key_fields: [key], value_field: amount, aggregate: sum, clamp: 10.0, window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8}
  - {name: mean, key_fields: [key], value_field: amount, aggregate: mean, clamp: 10.0, window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8}
  - {name: places, key_fields: [country, city], hierarchy: true, window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8}
  - {name: per_key_2, key_fields: [key], window: 1h, triggers: 12, contribution_bound: 4, per_key_bound: 2, epsilon: 2.0, delta: 1.0e-8}
  - {name: weights, key_fields: [key], window: 1h, triggers: 12, contribution_bound: 4, per_key_bound: 1, selection_weights: [3, 2, 1, 1], epsilon: 2.0, delta: 1.0e-8}
  - {name: release_steps, key_fields: [key], window: 1h, triggers: 12, contribution_bound: 4, perturbation_steps: release, epsilon: 2.0, delta: 1.0e-8}
  - {name: public, key_fields: [key], public_keys: [k0, k1, k2, k3, k7, k40], window: 1h, triggers: 12, contribution_bound: 4, epsilon: 2.0, delta: 1.0e-8}
"""


def _events(path: Path, n: int = 30_000, users: int = 3_000) -> None:
    rng = np.random.default_rng(35)
    places = [("FR", "Paris"), ("FR", "Lyon"), ("US", "Boston"), ("US", "Austin"), ("DE", "Berlin")]
    keys = np.minimum(rng.zipf(1.3, n), 200) - 1
    with open(path, "w") as fh:
        for i in range(n):
            country, city = places[int(rng.integers(len(places)))]
            fh.write(json.dumps({"user_id": f"u{int(rng.integers(users))}", "key": f"k{int(keys[i])}", "country": country,
                                 "city": city, "amount": round(float(rng.exponential(4.0)), 3),
                                 "ts": int(i * 2 * 3_600_000 / n)}) + "\n")


def _replay(root: Path, tmp: Path, name: str, kernels: str) -> bytes:
    config, events, out = tmp / "gold.yaml", tmp / "events.jsonl", tmp / f"{name}.jsonl"
    env = {**os.environ, "DPSTREAM_NOISE_KEY": TEST_SECRET_HEX, "DPSTREAM_KERNELS": kernels, "PYTHONPATH": str(root)}
    env.pop("DPSTREAM_NOISE_KEY_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "replay", "--config", str(config), "--input", str(events),
                           "--output", str(out), "--start", "0", "--until", str(2 * 3_600_000), "--noise-label", "gold"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_bytes()


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gold")
    (tmp / "gold.yaml").write_text(CONFIG)
    _events(tmp / "events.jsonl")
    return tmp


def _by_query(blob: bytes) -> dict:
    out: dict = {}
    for line in blob.decode().splitlines():
        out.setdefault(json.loads(line)["query"], []).append(line)
    return out


def test_every_query_kind_releases_the_same_bytes_with_either_kernels(workload):
    numba = _replay(ROOT, workload, "numba", "numba")
    numpy = _replay(ROOT, workload, "numpy", "numpy")
    assert numba == numpy
    released = _by_query(numba)
    # every query released something: the comparison covers each kind and lever
    assert set(released) == {"count_blt", "count_tree", "count_zcdp", "sum", "mean", "places", "per_key_2", "weights",
                             "release_steps", "public"}
    assert all(len(lines) >= 10 for lines in released.values())


def test_the_releases_are_those_of_the_commit_before_the_kernels(workload, tmp_path):
    if subprocess.run(["git", "cat-file", "-e", f"{BEFORE_KERNELS}^{{commit}}"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip(f"this checkout has no history back to {BEFORE_KERNELS} (a shallow clone)")
    old = tmp_path / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), BEFORE_KERNELS], cwd=ROOT, check=True, capture_output=True)
    try:
        gold = _replay(old, workload, "gold", "numpy")
        now = _replay(ROOT, workload, "now", "numba")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    assert now == gold
