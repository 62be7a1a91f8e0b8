#!/usr/bin/env python3
"""Fit the Buffered Linear Toeplitz (BLT) counter's parameters offline; writes accountant/blt_parameters.py.

The BLT encoder (Dvijotham et al., FOCS 2024; McMahan, Xu and Zhang, "Don't use tree aggregation,
use BLTs", 2024) is the lower-triangular Toeplitz matrix C with ``c_0 = 1`` and
``c_m = sum_k omega_k theta_k^(m-1)`` (m >= 1): d geometric buffers. The counter adds noise
``w = C^-1 z`` to the increments, so the prefix at step t carries noise ``(A C^-1 z)_t``
(docs/privacy.md, "Counters"). For a horizon of T steps we minimize

    ||C e_1||^2 * max_t Var(prefix noise at t) / sigma^2

(the worst step's noise variance at a fixed privacy cost; the tree's figure is the same product).
Parameters are rounded to 16-bit dyadic fractions before they are evaluated and shipped: the
shipped, rounded numbers *are* the mechanism, and the accountant computes its sensitivity and
variances from them (dpstream.accountant.counters), so the fit only affects accuracy, never privacy.

Run: ``python scripts/fit_blt.py`` (about a minute); the result is deterministic.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

BUFFERS = 3
BITS = 16
#: horizons fitted: 2^(k/2) rounded, up to 2^16; longer horizons use the 2^16 fit
HORIZONS = sorted({int(round(2 ** (k / 2))) for k in range(2, 33)})


def quantize(x: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(x) * (1 << BITS)).astype(np.int64)


def product(theta: np.ndarray, omega: np.ndarray, T: int) -> float:
    """||C e_1||^2 * max_t Var_t / sigma^2 for the BLT (theta, omega) over T steps."""
    tt = theta[:, None] * theta[None, :]
    col2 = 1.0 + float((omega[:, None] * omega[None, :] * (1 - tt ** (T - 1)) / (1 - tt)).sum())
    # C(x) = P(x) / Q(x) with Q = prod (1 - theta_k x): C^-1 = Q / P, prefix sums of its response
    q = np.array([1.0])
    for th in theta:
        q = np.convolve(q, [1.0, -th])
    p = q.copy()
    for k, (th, om) in enumerate(zip(theta, omega)):
        rest = np.array([1.0])
        for j, t2 in enumerate(theta):
            if j != k:
                rest = np.convolve(rest, [1.0, -t2])
        p = p + np.concatenate([[0.0], om * rest, np.zeros(len(p) - len(rest) - 1)])
    impulse = np.zeros(T)
    impulse[0] = 1.0
    r = lfilter(q, p, impulse)
    var = np.cumsum(np.cumsum(r) ** 2)
    if not np.isfinite(var).all():
        return math.inf
    return col2 * float(var.max())


def fit(T: int, start: tuple | None) -> tuple[np.ndarray, np.ndarray, float]:
    def objective(x):
        theta = 1.0 / (1.0 + np.exp(-x[:BUFFERS]))
        value = product(theta, x[BUFFERS:], T)
        return math.log(value) if math.isfinite(value) and value > 0 else 1e9

    rng = np.random.default_rng(T)
    starts = [] if start is None else [start]
    for _ in range(4):
        theta0 = np.sort(rng.uniform(0.3, 1.0 - 1.0 / (4 * T + 4), BUFFERS))
        starts.append(np.concatenate([np.log(theta0 / (1 - theta0)), rng.uniform(0.02, 0.3, BUFFERS)]))
    best = None
    for x0 in starts:
        res = minimize(objective, x0, method="Nelder-Mead", options={"maxiter": 3000, "xatol": 1e-7, "fatol": 1e-10})
        if best is None or res.fun < best.fun:
            best = res
    theta = 1.0 / (1.0 + np.exp(-best.x[:BUFFERS]))
    order = np.argsort(theta)
    theta_q, omega_q = quantize(theta[order]), quantize(best.x[BUFFERS:][order])
    theta_q = np.minimum(theta_q, (1 << BITS) - 1)
    value = product(theta_q / (1 << BITS), omega_q / (1 << BITS), T)
    return theta_q, omega_q, value, best.x


def main(out: Path) -> None:
    rows, start = [], None
    for T in HORIZONS:
        theta_q, omega_q, value, start = fit(T, start)
        rows.append((T, tuple(int(v) for v in theta_q), tuple(int(v) for v in omega_q), value))
        print(f"T={T:6d} theta={theta_q.tolist()} omega={omega_q.tolist()} product={value:.4f}", file=sys.stderr, flush=True)
    lines = [
        '"""BLT counter parameters, fitted by scripts/fit_blt.py (do not edit by hand).',
        "",
        f"Per horizon T: (theta_k, omega_k) of {BUFFERS} buffers as integers over 2^{BITS}, and the fitted",
        "product ||C e_1||^2 * max_t Var_t / sigma^2 (for comparison: the binary tree's is about 26.6 at",
        'T = 100 and 53 at T = 1000). A query of T steps uses the fit of the smallest horizon >= T."""',
        "",
        f"BITS = {BITS}",
        "FITS = {",
    ]
    for T, theta_q, omega_q, value in rows:
        lines.append(f"    {T}: ({theta_q}, {omega_q}, {value:.4f}),")
    lines.append("}")
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(__file__).resolve().parent.parent / "accountant" / "blt_parameters.py")
