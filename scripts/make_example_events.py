#!/usr/bin/env python3
"""Write examples/events.jsonl: synthetic sample events for both example configs.

One line per event, with every field the example queries read:

* ``user_id``, ``key``, ``ts`` (epoch ms): examples/worker.yaml (page_clicks) and the ``key``
  queries of examples/queries.yaml (url_clicks, url_clicks_fine);
* ``category``, ``amount``: basket_value (a sum, clamped to 100 per record);
* ``country``, ``state``, ``city``: visits_by_place (a three-level hierarchy).

1,600 users with 1 to 6 events each over ten minutes from 2026-01-01T00:00:00Z; each user has
one home place and visits a few pages, drawn from Zipf-Mandelbrot laws
(:mod:`dpstream.processor.synthetic`, the DP-SQLP workload's), so the popular pages,
categories and places have the hundreds of distinct users the example configs need before they
release a key (``dpstream plan --config examples/worker.yaml``: tau_1 = 75 users), and the long
tail is never released. Entirely synthetic: no real person is in it.

The same arguments give the same file (``--seed``). With the worker, send it dated from now
(the worker judges events by their arrival: docs/operations.md, "Trying it with a file")::

    .venv/bin/python scripts/make_example_events.py            # rewrites examples/events.jsonl
    dpstream replay --config examples/worker.yaml --input examples/events.jsonl --output releases.jsonl
    dpstream produce --input examples/events.jsonl --rebase-time
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: 2026-01-01T00:00:00Z, the dynamic example's public start too
START_MS = 1_767_225_600_000
PLACES = [  # (country, state, city), most visited first
    ("US", "CA", "San Francisco"), ("US", "NY", "New York"), ("DE", "BE", "Berlin"), ("US", "CA", "Los Angeles"),
    ("FR", "IDF", "Paris"), ("DE", "BY", "Munich"), ("US", "TX", "Austin"), ("FR", "ARA", "Lyon"), ("DE", "HH", "Hamburg"),
    ("US", "WA", "Seattle"), ("FR", "PAC", "Marseille"), ("US", "NY", "Buffalo"),
]
CATEGORIES = ["books", "electronics", "groceries", "garden", "toys", "music"]


def zipf(rng: np.random.Generator, n: int, q: float, s: float, size: int) -> np.ndarray:
    """Draws in 0..n-1 (dpstream.processor.synthetic's Zipf-Mandelbrot law)."""
    from dpstream.processor.synthetic import sample_zipf_mandelbrot

    return sample_zipf_mandelbrot(rng, n, q, s, size) - 1


def events(users: int, pages: int, span_ms: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    home = zipf(rng, len(PLACES), 2.0, 1.2, users)  # one place per user
    counts = rng.integers(1, 7, size=users)  # 1 to 6 events each
    out = []
    for u in range(users):
        n = int(counts[u])
        country, state, city = PLACES[int(home[u])]
        for page, category, amount, ts in zip(zipf(rng, pages, 1.0, 1.3, n), zipf(rng, len(CATEGORIES), 1.0, 1.0, n),
                                              np.round(rng.lognormal(3.0, 0.8, n), 2), rng.integers(0, span_ms, n)):
            out.append({"user_id": f"user-{u}", "key": f"page-{int(page)}", "category": CATEGORIES[int(category)],
                        "amount": float(amount), "country": country, "state": state, "city": city,
                        "ts": START_MS + int(ts)})
    out.sort(key=lambda e: e["ts"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(ROOT / "examples" / "events.jsonl"), help="default examples/events.jsonl")
    parser.add_argument("--users", type=int, default=1_600, help="default 1,600")
    parser.add_argument("--pages", type=int, default=50, help="key space of 'key' (default 50)")
    parser.add_argument("--span-ms", type=int, default=600_000, help="events over this many ms (default ten minutes)")
    parser.add_argument("--seed", type=int, default=16)
    args = parser.parse_args(argv)
    rows = events(args.users, args.pages, args.span_ms, args.seed)
    with open(args.output, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    print(f"{args.output}: {len(rows):,} events of {args.users:,} users", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
