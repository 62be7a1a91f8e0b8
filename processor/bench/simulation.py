"""The paper's mechanism in plain numpy, no state and no persistence: the speed baseline of
``dpstream bench dpsqlp`` (issue 35; docs/benchmarks.md, "Against a plain numpy run").

It runs the same workload through the same mechanism shape as the pipeline, with the same plan
(sigmas, thresholds, BLT parameters), but none of what makes the product a product: no
RocksDB, no crash-consistent writes, no keyed PRF noise (numpy's float Gaussian generator), no
exact lattice arithmetic, no release prediction (every seen key's streams advance at every
trigger, in whole-array operations), no release records. Its releases are a different draw of
the same mechanism, so its error is close to the pipeline's, never equal; it is timed, not
trusted.

Per trigger: contribution bounding (each user's first C records of the day, computed once up
front, as a plain simulation would), users new to each key's round, key selection (one BLT
stream per key and round over the round's counts, compared with ``mu + tau``), and perturbation
(one BLT stream per key over its buffered counts, read at each release).
"""
from __future__ import annotations

import time

import numpy as np

from dpstream.accountant.counters import blt_parameters


def _blt_float(T: int) -> tuple[np.ndarray, np.ndarray]:
    p = blt_parameters(T)
    return np.asarray(p.theta, dtype=np.float64), np.asarray(p.omega, dtype=np.float64)


def simulate(users: np.ndarray, keys: np.ndarray, bounds: np.ndarray, n_keys: int, plan, kept: np.ndarray, seed: int) -> dict:
    """Run the workload (records in arrival order; trigger i's records are
    ``bounds[i-1]:bounds[i]``; ``kept``: each record within its user's first C) through the
    mechanism with ``plan``'s numbers. Returns its time and its final estimates."""
    t0 = time.perf_counter()
    T = len(bounds) - 1
    rng = np.random.default_rng(seed)
    theta, omega = _blt_float(T)
    d = len(theta)
    sigma_k, sigma_m = plan.sigma_key_selection, plan.sigma_perturbation
    release_at = plan.key_threshold + np.asarray(plan.thresholds)
    # (user, key) pairs: a user counts once in a key's round; its last trigger tells whether it is
    # new to the round (the round started after it)
    code = users.astype(np.int64) * n_keys + keys
    # key state, dense over the key space
    count = np.zeros(n_keys)  # the round's users
    participations = np.zeros(n_keys)
    start = np.ones(n_keys, dtype=np.int64)  # the round's first trigger
    sel_buf = np.zeros((n_keys, d))
    sel_W = np.zeros(n_keys)
    pert_buf = np.zeros((n_keys, d))
    pert_W = np.zeros(n_keys)
    buffered = np.zeros(n_keys)
    released_total = np.zeros(n_keys)
    estimate = np.zeros(n_keys)
    released = np.zeros(n_keys, dtype=bool)
    seen = np.zeros(n_keys, dtype=bool)
    prev_trigger = np.zeros(len(users), dtype=np.int64)
    # each (user, key) pair's previous kept record's trigger, up front (a plain simulation's join)
    kept_idx = np.nonzero(kept)[0]
    order = kept_idx[np.argsort(code[kept_idx], kind="stable")]
    trig = np.searchsorted(bounds, np.arange(len(users)), side="right")  # 1-based trigger per record
    same = np.zeros(len(order), dtype=bool)
    same[1:] = code[order[1:]] == code[order[:-1]]
    prev_trigger[order[1:][same[1:]]] = trig[order[:-1][same[1:]]]
    for i in range(1, T + 1):
        sl = slice(bounds[i - 1], bounds[i])
        k, keep, prev = keys[sl], kept[sl], prev_trigger[sl]
        kk = k[keep]
        new = keep & (prev < start[k])  # users new to the key's round (their last record came before it)
        # a user counts once per key and trigger
        pairs = np.unique(code[sl][new])
        add = np.bincount(pairs % n_keys, minlength=n_keys).astype(np.float64)
        count += add
        participations += add
        buffered += np.bincount(kk, minlength=n_keys)
        seen[kk] = True
        active = np.nonzero(seen & (participations > plan.key_threshold))[0]
        # key selection: every active key's round stream steps once
        buf = sel_buf[active]
        w = rng.normal(0.0, sigma_k, len(active)) - buf @ omega
        W = sel_W[active] + w
        sel_W[active] = W
        sel_buf[active] = theta * buf + w[:, None]
        hit = count[active] + W > release_at[i - start[active]]
        # perturbation: every seen key's stream steps once; released keys read it
        buf = pert_buf[active]
        w = rng.normal(0.0, sigma_m, len(active)) - buf @ omega
        pert_W[active] += w
        pert_buf[active] = theta * buf + w[:, None]
        chosen = active[hit]
        released_total[chosen] += buffered[chosen]
        buffered[chosen] = 0.0
        estimate[chosen] = np.rint(released_total[chosen] + pert_W[chosen])
        released[chosen] = True
        # a released key starts a new round
        start[chosen] = i + 1
        count[chosen] = 0.0
        sel_W[chosen] = 0.0
        sel_buf[chosen] = 0.0
    return {"seconds": time.perf_counter() - t0, "estimate": estimate, "released": released}
