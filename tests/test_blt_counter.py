"""The Buffered Linear Toeplitz counter (dpstream.processor.mechanisms.counters.BLTCounter).

What a user relies on: its noise has the variance the accountant declares (statistical), its
releases are exact functions of privatized integers (exact), the same stream gets the same noise
however it is walked (replay), and one user's data moves the privatized values by no more than
the accountant charges, whatever the noise path and the participation pattern (adversarial).
"""
from fractions import Fraction

import numpy as np
import pytest
from conftest import TEST_SECRET
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.accountant.counters import (
    BLT,
    LATTICE_TARGET_SIGMA,
    blt_parameters,
    lattice_scale,
)
from dpstream.processor.mechanisms.counters import (
    BLTCounter,
    LatticePrefix,
    counter_for,
)
from dpstream.processor.mechanisms.noise import TREE_ID_DTYPE, NodeNoise


def _ids(n, salt=0):
    return np.array([(salt << 64 | i).to_bytes(16, "big") for i in range(n)], dtype=TREE_ID_DTYPE)


def _exact_column(T):
    """The encoder's first column c_0..c_{T-1} as exact fractions of the shipped dyadic parameters."""
    p = blt_parameters(T)
    theta = [Fraction(t, 1 << p.bits) for t in p.theta_int]
    omega = [Fraction(o, 1 << p.bits) for o in p.omega_int]
    return [Fraction(1)] + [sum(o * th ** (m - 1) for o, th in zip(omega, theta)) for m in range(1, T)]


def test_calibration_matches_an_independent_matrix_computation():
    """Sensitivity and per-step variance from the explicit matrices: C from the exact column,
    B = A C^-1 by a linear solve (not the recurrence the accountant uses); variance_t = ||B_t||^2."""
    T = 64
    c = np.array([float(x) for x in _exact_column(T)])
    C = np.zeros((T, T))
    for i in range(T):
        C[i, : i + 1] = c[i::-1]
    A = np.tril(np.ones((T, T)))
    B = np.linalg.solve(C.T, A.T).T  # B C = A
    variances = (B * B).sum(axis=1)
    assert BLT.sensitivity_sq(T) == pytest.approx(float((c * c).sum()), rel=3e-9)
    assert BLT.sensitivity_sq(T) >= float(sum(x * x for x in _exact_column(T)))  # an upper bound
    for t in (1, 2, 10, 40, 64):
        assert BLT.step_variance(t, T) == pytest.approx(variances[t - 1], rel=3e-9)
        assert BLT.step_variance(t, T) >= variances[t - 1] * (1 - 1e-12)


def test_blt_has_a_quarter_of_the_trees_worst_step_variance():
    """The reason the counter exists: sensitivity^2 times the worst step's variance, the tree's
    h * max_t Var_t, is 4.15x smaller at T = 100 and 4.96x at T = 1000."""
    from dpstream.accountant.counters import BINARY_TREE

    for T, lo, hi in ((100, 4.1, 4.2), (1000, 4.9, 5.0)):
        def worst(c):
            return c.sensitivity_sq(T) * max(c.step_variance(t, T) for t in range(1, T + 1))
        assert lo < worst(BINARY_TREE) / worst(BLT) < hi


@pytest.mark.statistical
@pytest.mark.parametrize("T", [30, 100])
def test_declared_step_variance_matches_the_noise(T):
    """20,000 streams' prefix noise W_t / K against sigma^2 * step_variance(t, T), every t.
    The sample variance of n draws has relative standard error sqrt(2 / n) = 1% here (the noise
    is a sum of many discrete Gaussians, so close to normal); over T steps the tolerance is 6
    standard errors. The rounding of the feedback adds at most 1/2 lattice unit per step, far
    below that. One pair of steps checks the covariance, sigma^2 sum_j R_{s-j} R_{t-j}."""
    sigma, n = 3.0, 20_000
    counter = BLTCounter(T, sigma, NodeNoise(TEST_SECRET, "blt-variance"))
    walk = counter.walk(_ids(n), np.zeros(n, dtype=np.int64), np.full(n, T), counter.empty_state(n))
    stream, step = walk.future()
    noise = walk.prefix(stream, step).approx().reshape(n, T)
    declared = np.array([BLT.step_variance(t, T) for t in range(1, T + 1)]) * sigma ** 2
    ratio = noise.var(axis=0) / declared
    assert np.abs(ratio - 1).max() < 6 * np.sqrt(2 / n), ratio
    # covariance of steps s < t: the response R = cumsum(C^-1 e_1)
    r = np.linalg.solve(np.array([[float(_exact_column(T)[i - j]) if i >= j else 0.0 for j in range(T)] for i in range(T)]),
                        np.eye(T)[:, 0])
    R = np.cumsum(r)
    s, t = T // 3, T - 1
    cov = sigma ** 2 * sum(R[s - 1 - j] * R[t - 1 - j] for j in range(s))
    assert np.cov(noise[:, s - 1], noise[:, t - 1])[0, 1] == pytest.approx(cov, rel=6 * np.sqrt(2 / n) * 2)


def test_noise_is_the_same_however_the_stream_is_walked():
    """One walk over all steps, and walks of uneven pieces carrying the state between them, give
    the same integer noise prefix at every step; another secret gives other noise."""
    T, n = 50, 300
    counter = BLTCounter(T, 2.0, NodeNoise(TEST_SECRET, "blt-replay"))
    ids = _ids(n)
    whole = counter.walk(ids, np.zeros(n, dtype=np.int64), np.full(n, T), counter.empty_state(n))
    stream, step = whole.future()
    W = whole.prefix(stream, step).W.reshape(n, T)
    rng = np.random.default_rng(5)
    done, state = np.zeros(n, dtype=np.int64), counter.empty_state(n)
    while (done < T).any():
        upto = np.minimum(done + rng.integers(0, 9, size=n), T)
        walk = counter.walk(ids, done, upto, state)
        moved = upto > done
        got = walk.prefix(np.nonzero(moved)[0], upto[moved]).W
        np.testing.assert_array_equal(got, W[moved, upto[moved] - 1])
        state, done = walk.state_at(upto), upto
    other = BLTCounter(T, 2.0, NodeNoise(TEST_SECRET + b"!", "blt-replay"))
    w2 = other.walk(ids, np.zeros(n, dtype=np.int64), np.full(n, T), other.empty_state(n))
    assert not np.array_equal(w2.prefix(*w2.future()).W.reshape(n, T), W)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(-(1 << 40), 1 << 40), st.integers(-(1 << 30), 1 << 30),
                          st.sampled_from([0.0, 0.5, -0.5, 1e-9, 3.25, 1e15])), min_size=1, max_size=20),
       st.sampled_from([1, 2, 1024, 1 << 16]))
def test_lattice_prefix_decisions_are_exact(rows, scale):
    """exceeds and rounded agree with exact rational arithmetic on base + W / K, including ties
    (threshold exactly on a lattice point) and integers beyond float precision."""
    W = np.array([w for w, _, _ in rows], dtype=np.int64)
    base = np.array([b for _, b, _ in rows], dtype=np.int64)
    prefix = LatticePrefix(W, scale)
    exact = [Fraction(int(b)) + Fraction(int(w), scale) for w, b in zip(W, base)]
    thresholds = np.array([float(e) + off for e, (_, _, off) in zip(exact, rows)])
    got = prefix.exceeds(base, thresholds)
    for g, e, t in zip(got, exact, thresholds):
        assert bool(g) == (e > Fraction(float(t)))
    for r, e in zip(prefix.rounded(base), exact):
        assert int(r) == (e + Fraction(1, 2)).__floor__()  # nearest, halves up


def _z_from_noise_path(counter, u):
    """The z a noise path u (lattice units, one row per stream) implies: z_t = u_t + h_t(u_<t)."""
    buf = np.zeros((u.shape[0], counter.buffers), dtype=np.int64)
    z = np.empty_like(u)
    for t in range(u.shape[1]):
        z[:, t] = u[:, t] + counter.feedback(buf)
        buf = counter.advance(buf, u[:, t])
    return z


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.sampled_from([5, 37, 100, 300]), seed=st.integers(0, 2 ** 32), sigma=st.sampled_from([0.7, 23.0, 130.0, 4000.0]),
       records=st.integers(1, 40), bound=st.sampled_from([1, 5]), magnitude=st.sampled_from([10, 1 << 12, 1 << 21]))
def test_one_users_shift_stays_within_what_the_accountant_charges(T, seed, sigma, records, bound, magnitude):
    """The adversary's view. Fix what is published: a noise path u under data x, so v = x + u.
    Under a neighbour x' = x - Delta the same v implies the noise path u - K Delta, and the
    mechanism's discrete Gaussian centres move by z - z'. For any noise path (small or near the
    proven bound) and any participation pattern (up to 40 records of value up to +-bound at any
    steps, repeats and signs included), each step's shift is within the slack of the exact linear
    K (C Delta)_t, and the squared shift is within the accountant's charge
    (K B)^2 ||c||^2 + 2 s K B ||c||_1 + T s^2 with B = ||Delta||_1."""
    counter = BLTCounter(T, sigma, NodeNoise(TEST_SECRET))
    K = counter.scale
    rng = np.random.default_rng(seed)
    u = rng.integers(-magnitude, magnitude + 1, size=(4, T)).astype(np.int64)
    delta = np.zeros((4, T), dtype=np.int64)
    for row in range(4):
        steps = rng.integers(0, T, size=records)
        np.add.at(delta[row], steps, rng.integers(-bound, bound + 1, size=records))
    shift = _z_from_noise_path(counter, u) - _z_from_noise_path(counter, u - K * delta)
    c = _exact_column(T)
    slack = BLT.slack(T)
    for row in range(4):
        linear = [K * sum(c[t - j] * int(delta[row, j]) for j in range(t + 1)) for t in range(T)]
        off = max(abs(Fraction(int(s)) - lin) for s, lin in zip(shift[row], linear))
        assert off <= Fraction(slack), (float(off), slack)
        B = int(np.abs(delta[row]).sum())
        charged = (K * B) ** 2 * BLT.sensitivity_sq(T) + 2 * slack * K * B * BLT.sensitivity_l1(T) + T * slack ** 2
        assert float((shift[row].astype(float) ** 2).sum()) <= charged


def test_lattice_scale_bounds_the_lattice_step():
    """K keeps the sampler within its target, and the lattice step 1/K below 2 sigma / target
    (what the accountant assumes for the slack without knowing K)."""
    for sigma in (0.3, 1.0, 22.9, 129.5, 4096.0, 40000.0, 100000.0):
        K = lattice_scale(sigma)
        assert K >= 1 and K & (K - 1) == 0
        assert sigma * K <= LATTICE_TARGET_SIGMA or K == 1
        assert 1.0 / K <= 2 * sigma / LATTICE_TARGET_SIGMA


def test_counter_names_from_config():
    counter = counter_for("blt", 10, 5.0, NodeNoise(TEST_SECRET))
    assert isinstance(counter, BLTCounter) and counter.state_width == 4
    with pytest.raises(ValueError, match="horizon"):
        counter.walk(_ids(1), np.zeros(1, dtype=np.int64), np.array([11]), counter.empty_state(1))
