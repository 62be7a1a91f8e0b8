"""``dpstream bench dynamic --restart``: what a dynamic query's restart costs after a short and a
long history with the same live items (docs/user-guide.md, "Dynamic queries": state).

Each history is a heavy-churn stream (:func:`dpstream.processor.bench.dynamic.generate_stream`:
the live items revert to ``live`` while the updates go on) fed to the query's state over RocksDB
as the worker feeds it: logged in chunks of 10,000 updates, the clock moved to the chunk's last
update, the releases published. The state is closed and opened again ``repeats`` times; a restart
is the time to open the store and build the query's state from it (the snapshot, then the log it
has not taken in), and the report gives the median, the state's size and how many updates its
log still holds. Without snapshots a restart replayed every update ever logged.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dpstream.processor.bench.dynamic import generate_stream
from dpstream.processor.bench.report import machine
from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import RocksDBStore, WriteBatch

CHUNK = 10_000


def _query(items: int, mechanism: str) -> DynamicQueryConfig:
    # one update per ms, ticks of 10 ms: 10 updates per tick; every tick 100 ms behind the clock decided
    return DynamicQueryConfig(name="restart", items=[f"item{k}" for k in range(items)], epsilon=1.0, start=0, tick="10ms",
                              allowed_lateness="100ms", mechanism=mechanism)


def _open(path: Path, query: DynamicQueryConfig, secret: bytes) -> tuple[RocksDBStore, DynamicQueryState]:
    store = RocksDBStore(path)
    return store, DynamicQueryState(query, NodeNoise(secret, "bench-restart"), Pseudonymizer(secret), store)


def build_history(path: Path, query: DynamicQueryConfig, secret: bytes, updates: int, live: int, seed: int,
                  chunk: int = CHUNK) -> dict:
    """Feed ``updates`` heavy-churn updates as the worker does, ``chunk`` per clock step; returns
    what it took."""
    items, inserts = generate_stream("heavy_churn", updates, len(query.items), seed, target=live)
    ops = ("delete", "insert")
    store, state = _open(path, query, secret)
    started = time.perf_counter()
    for lo in range(0, updates, chunk):
        batch = WriteBatch()
        for t, (x, ins) in enumerate(zip(items[lo:lo + chunk].tolist(), inserts[lo:lo + chunk].tolist()), lo):
            state.apply({"item": query.items[x], "op": ops[ins], "ts": t}, batch)
        state.advance_clock(min(lo + chunk, updates) - 1, batch)
        store.write(batch)
        state.take_pending()
        mark = WriteBatch()
        state.mark_published(mark)
        store.write(mark)
    seconds = time.perf_counter() - started
    fed = {"updates": updates, "feed_seconds": seconds, "updates_per_second": updates / seconds,
           # the items present (the exact counts; the baseline's state holds counts, not instances)
           "live_items": int(np.clip(state.counter.exact, 0, None).sum()), "segments": state.counter.released}
    store.close()
    return fed


def time_restart(path: Path, query: DynamicQueryConfig, secret: bytes, repeats: int) -> dict:
    times, logged = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        store, state = _open(path, query, secret)
        times.append(time.perf_counter() - started)
        logged = sum(1 for _ in state.tables.log())
        store.close()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"restart_seconds": float(np.median(times)), "restart_runs": times, "log_entries": logged, "state_bytes": size}


def run_restart_bench(histories: tuple[int, ...] = (100_000, 10_000_000), live: int = 10_000, items: int = 8,
                      mechanism: str = "baseline", repeats: int = 3, json_path: str | None = None, chunk: int = CHUNK,
                      out=sys.stderr) -> dict:
    p = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    query = _query(items, mechanism)
    secret = os.urandom(32)  # throwaway: synthetic data, nothing is published
    p(f"bench dynamic --restart: {mechanism}, {items} items, about {live:,} live items, histories of "
      f"{', '.join(f'{h:,}' for h in histories)} updates; {repeats} restarts each (median)")
    rows = []
    root = Path(tempfile.mkdtemp(prefix="dpstream-restart-"))
    try:
        for updates in histories:
            path = root / f"h{updates}"
            fed = build_history(path, query, secret, updates, live, seed=7, chunk=chunk)
            timed = time_restart(path, query, secret, repeats)
            rows.append({**fed, **timed})
            p(f"  {updates:>12,} updates fed in {fed['feed_seconds']:.1f} s ({fed['updates_per_second']:,.0f}/s), "
              f"{fed['live_items']:,} live: restart {timed['restart_seconds']:.3f} s, log {timed['log_entries']:,} entries, "
              f"state {timed['state_bytes'] / 1e6:.1f} MB")
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = rows[-1]["restart_seconds"] / rows[0]["restart_seconds"]
    p(f"restart after {histories[-1]:,} updates / after {histories[0]:,}: {ratio:.2f}x")
    report = {"machine": machine(), "mechanism": mechanism, "items": items, "live_target": live, "rows": rows,
              "restart_ratio_longest_over_shortest": ratio}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=1)
    return report
