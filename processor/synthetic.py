"""The DP-SQLP synthetic workload (section 5.1; docs/benchmarks.md), vectorized.

Records per user ~ Zipf-Mandelbrot on [1, 10^5] with q = 26, s = 6.738 (P[x] proportional to
(x + q)^-s); each record's key ~ Zipf-Mandelbrot over the key space with q = 1000, s = 1.4;
records spread uniformly over the window. With these q and s the mean is 6.115 records per user
and 15.9% of users have more than 10 records; 25.8% of records fall on the first 1,000 of 10^6
keys (the paper's prose says "mean 10" and "about a third"; the parameters decide).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RECORDS_MAX = 100_000
RECORDS_Q, RECORDS_S = 26.0, 6.738
KEYS_Q, KEYS_S = 1000.0, 1.4


def zipf_mandelbrot_pmf(n: int, q: float, s: float) -> np.ndarray:
    """P[x] for x = 1..n, proportional to (x + q)^-s."""
    weights = (np.arange(1, n + 1, dtype=np.float64) + q) ** (-s)
    return weights / weights.sum()


def sample_zipf_mandelbrot(rng: np.random.Generator, n: int, q: float, s: float, size: int) -> np.ndarray:
    """Draws in 1..n by inverse transform on the exact cumulative table."""
    cdf = np.cumsum(zipf_mandelbrot_pmf(n, q, s))
    cdf[-1] = 1.0
    return np.searchsorted(cdf, rng.random(size), side="right").astype(np.int64) + 1


@dataclass
class SyntheticStream:
    users: np.ndarray  # int64 user ids, in time order
    keys: np.ndarray  # int64 key ids 0..K-1
    ts: np.ndarray  # int64 event time, ms, ascending
    key_space: int

    def __len__(self) -> int:
        return len(self.ts)


def generate(users: int, keys: int, seed: int, window_ms: int = 86_400_000, start_ms: int = 0,
             key_q: float = KEYS_Q, key_s: float = KEYS_S) -> SyntheticStream:
    rng = np.random.default_rng(seed)
    per_user = sample_zipf_mandelbrot(rng, RECORDS_MAX, RECORDS_Q, RECORDS_S, users)
    user_ids = np.repeat(np.arange(users, dtype=np.int64), per_user)
    key_ids = sample_zipf_mandelbrot(rng, keys, key_q, key_s, len(user_ids)) - 1
    ts = start_ms + rng.integers(0, window_ms, size=len(user_ids), dtype=np.int64)
    order = np.argsort(ts, kind="stable")
    return SyntheticStream(user_ids[order], key_ids[order], ts[order], keys)
