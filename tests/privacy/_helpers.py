"""Shared drivers for the adversarial privacy tests (tests/privacy).

Everything here drives the product through its public entry points (ReplayRunner, QueryPipeline,
DpstreamWorker, the CLI); nothing re-implements a mechanism.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import DpstreamConfig, QueryConfig
from tests.conftest import TEST_LABEL, TEST_SECRET, TEST_SECRET_HEX

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3_600_000
DAY = 86_400_000
START = 1_795_132_800_000  # a UTC midnight
YEAR = 365 * DAY


def query(**overrides) -> QueryConfig:
    fields = dict(name="clicks", window="1d", triggers=24, contribution_bound=4, epsilon=6.0, delta=1e-9,
                  allowed_lateness="1m")
    fields.update(overrides)
    return QueryConfig(**fields)


def events(rng: np.random.Generator, users: int = 300, keys: int = 12, records: int = 3000, start: int = START,
           span: int = DAY, prefix: str = "u") -> list[dict]:
    """Popular keys plus a tail, in event-time order."""
    user = rng.integers(0, users, records)
    key = np.minimum(rng.geometric(0.25, records) - 1, keys - 1)
    ts = np.sort(start + rng.integers(0, span, records))
    return [{"user_id": f"{prefix}{u}", "key": f"k{k}", "ts": int(t)} for u, k, t in zip(user, key, ts)]


def write_jsonl(path, rows: Iterable[dict]) -> Path:
    path = Path(path)
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


class Run:
    """The outcome of one replay."""

    def __init__(self, output: str, dead: str, summary, stats, ledger_entries=None, label=None, dynamic=None,
                 statuses=None, charges=None):
        self.output = output
        #: per query: {window start: status} (1 open, 2 refused: dpstream.processor.engine.pipeline)
        self.statuses = statuses
        #: the ledger's charge records: {charge id: record}
        self.charges = charges
        self.records = [json.loads(line) for line in output.splitlines()]
        self.dead = [json.loads(line) for line in dead.splitlines()]
        self.summary = summary
        self.stats = stats
        self.ledger_entries = ledger_entries
        self.label = label
        self.dynamic = dynamic

    def releases(self, query_name: Optional[str] = None) -> dict:
        """{(window_start, trigger, key): (count or sum)} of the histogram releases."""
        out = {}
        for r in self.records:
            if "window_start" not in r or (query_name and r["query"] != query_name):
                continue
            value = r.get("count", r.get("sum"))
            out[(r["window_start"], r["trigger"], json.dumps(r["key"]))] = value
        return out

    def dead_reasons(self) -> list[str]:
        return [d["reason"] for d in self.dead]


def replay(config: DpstreamConfig, input_path, state_dir=None, label: Optional[str] = TEST_LABEL, start_ms=None,
           until_ms=None, stop_after=None, principal: Optional[str] = None) -> Run:
    runner = ReplayRunner(config, TEST_SECRET, None if state_dir is None else str(state_dir), log=io.StringIO(),
                          noise_label=label, start_ms=start_ms)
    out, dead = io.StringIO(), io.StringIO()
    try:
        summary = runner.run(str(input_path), out, dead_letters=dead, stop_after_lines=stop_after, until_ms=until_ms)
        stats = [p.stats for p in runner.pipelines]
        entries = charges = None
        if runner.ledger is not None:
            entries = {e.principal: e for e in runner.ledger.entries(0)}
            charges = {}
            for key, value in runner.ledger.store.scan_prefix(b"C"):
                charges[key[1:].split(b"\0", 1)[1].decode()] = json.loads(value)
        statuses = [dict(p._status) for p in runner.pipelines]
        used_label = runner.noise_label
        dynamic = [(d.counter.decided, d.counter.released) for d in runner.dynamic]
    finally:
        runner.close()
    return Run(out.getvalue(), dead.getvalue(), summary, stats, entries, used_label, dynamic, statuses, charges)


def secret_file(tmp_path) -> Path:
    path = Path(tmp_path) / "noise.key"
    path.write_text(TEST_SECRET_HEX)
    path.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    return path


def run_cli(code_root: Path, args: list[str], tmp_path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m dpstream.processor.cli ARGS`` with the given code on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSTREAM_")}
    env["PYTHONPATH"] = str(code_root)
    env["DPSTREAM_NOISE_KEY_FILE"] = str(secret_file(tmp_path))
    return subprocess.run([sys.executable, "-m", "dpstream.processor.cli", *args], cwd=str(code_root), env=env,
                          capture_output=True, text=True, timeout=timeout)

