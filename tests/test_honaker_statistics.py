"""Statistics of the Honaker forest's prefix noise against DP-SQLP eqs. (1) and (2).

Each tree (a distinct key in its TreeIdentity) is an independent sample of the whole noise
process, so walking n trees to every leaf gives n iid draws of N_i for each leaf i.

Tolerances. N_i is a fixed linear combination of independent discrete Gaussians with
sigma = 3; their moments equal the continuous Gaussian's up to O(e^{-2 pi^2 sigma^2}) ~ 1e-77,
so N_i has kurtosis 3 and the sample variance of n draws has sd V sqrt(2/(n-1)) (chi-square);
the sample mean has sd sqrt(V/n). We allow Z = 5.5 sd (normal approximation, n >= 8000):
two-sided false-failure probability 3.8e-8 per check, < 1e-5 over all checks in this file.
"""
import math

import numpy as np
import pytest

from dpstream.accountant.calibration import (
    honaker_variance_factor,
    prefix_variance_factor,
)
from dpstream.processor.mechanisms.noise import TreeIdentity, discrete_gaussian
from dpstream.processor.mechanisms.tree import HonakerForest

Z = 5.5
SIGMA = 3.0


_CACHE = {}


def _all_prefix_noise(noise, T, n, tag="stats"):
    """(n, T) array: N_i for every leaf i of n independent trees, from one vectorized walk.
    Cached per (secret, T, n): the tests below check different functionals of the same draws."""
    key = (noise.fingerprint, T, n, tag)
    if key not in _CACHE:
        _CACHE[key] = _walk_all(noise, T, n, tag)
    return _CACHE[key]


def _walk_all(noise, T, n, tag):
    sampler = discrete_gaussian(SIGMA)
    forest = HonakerForest(T, sampler, noise)
    ids = noise.tree_ids(TreeIdentity("stats", T, f"{tag}-{k}", "select", 0) for k in range(n))
    walk = forest.walk(ids, np.zeros(n, dtype=np.int64), np.full(n, T, dtype=np.int64), forest.empty_cache(n))
    tree, leaf = walk.future()
    out = np.empty((n, T))
    out[tree, leaf - 1] = walk.prefix_noise(tree, leaf)
    return out, sampler.variance


def _check_mean_var(samples, expected_var, what):
    n = len(samples)
    mean = samples.mean()
    s2 = samples.var(ddof=1)
    assert abs(mean) <= Z * math.sqrt(expected_var / n), f"{what}: mean {mean}"
    assert abs(s2 - expected_var) <= Z * expected_var * math.sqrt(2.0 / (n - 1)), f"{what}: var {s2} vs {expected_var}"


def _leaves(T):
    picks = {1, 2, 3, T // 2, T - 1, T}
    picks |= {1 << l for l in range(T.bit_length()) if 1 << l <= T}
    picks |= {(1 << l) - 1 for l in range(1, T.bit_length() + 1) if (1 << l) - 1 <= T}
    return sorted(i for i in picks if 1 <= i <= T)


@pytest.mark.parametrize("T,n", [(1, 100_000), (7, 100_000), (16, 100_000), (100, 40_000), (1000, 8000)])
def test_prefix_noise_is_unbiased_with_eq2_variance(noise, T, n):
    N, var = _all_prefix_noise(noise, T, n)
    for i in _leaves(T):
        _check_mean_var(N[:, i - 1], var * prefix_variance_factor(i), f"T={T} leaf {i}")


@pytest.mark.parametrize("T,n", [(16, 100_000), (100, 40_000), (1000, 8000)])
def test_honaker_node_estimates_have_eq1_variance(noise, T, n):
    N, var = _all_prefix_noise(noise, T, n)
    for level in range(T.bit_length()):
        width = 1 << level
        if width > T:
            break
        # node (level, 0) is the whole decomposition of leaf 2^level
        _check_mean_var(N[:, width - 1], var * honaker_variance_factor(level), f"T={T} node ({level}, 0)")
        # node (level, j) for even j >= 2: N_{(j+1) 2^l} - N_{j 2^l} is exactly that node's estimate
        j = 2
        if (j + 1) * width <= T:
            est = N[:, (j + 1) * width - 1] - N[:, j * width - 1]
            _check_mean_var(est, var * honaker_variance_factor(level), f"T={T} node ({level}, {j})")


def test_factors_match_paper_closed_forms():
    # eq. (1): kappa = level + 1 levels in the subtree
    for level in range(12):
        kappa = level + 1
        c = [(0.5**j) / sum(0.5**i for i in range(kappa)) for j in range(kappa)]
        assert honaker_variance_factor(level) == pytest.approx(sum(cj**2 * 2**j for j, cj in enumerate(c)), rel=1e-12)
    # eq. (2): one node per set bit of i
    for i in (1, 5, 64, 100, 999, 1000):
        assert prefix_variance_factor(i) == pytest.approx(
            sum(honaker_variance_factor(l) for l in range(i.bit_length()) if (i >> l) & 1), rel=1e-12
        )


def _corr(a, b):
    return float(np.corrcoef(a, b)[0, 1])


@pytest.mark.parametrize("T,n", [(16, 100_000), (1000, 8000)])
def test_disjoint_decomposition_nodes_are_uncorrelated(noise, T, n):
    # The sample correlation of n independent pairs has sd ~ 1/sqrt(n); allow 5/sqrt(n)
    # (false failure ~6e-7 per pair).
    N, var = _all_prefix_noise(noise, T, n)
    leaf = 7 if T < 1000 else 1000  # 7 = 4+2+1; 1000 = 512+256+128+64+32+8
    bits = [l for l in range(leaf.bit_length()) if (leaf >> l) & 1][::-1]  # high to low
    parts, prefix = [], 0
    for l in bits:
        before = N[:, prefix - 1] if prefix else 0.0
        prefix += 1 << l
        parts.append(N[:, prefix - 1] - before)  # the Honaker estimate of one decomposition node
    for a in range(len(parts)):
        assert parts[a].var(ddof=1) == pytest.approx(var * honaker_variance_factor(bits[a]), rel=Z * math.sqrt(2 / (n - 1)))
        for b in range(a + 1, len(parts)):
            assert abs(_corr(parts[a], parts[b])) <= 5 / math.sqrt(n), (bits[a], bits[b])
    # power check: overlapping prefixes ARE correlated, as predicted: corr(N_4, N_6) =
    # sqrt(V_4 / V_6); the sample correlation's sd is ~ (1 - r^2) / sqrt(n).
    r = math.sqrt(prefix_variance_factor(4) / prefix_variance_factor(6))
    assert abs(_corr(N[:, 3], N[:, 5]) - r) <= Z * (1 - r * r) / math.sqrt(n)
    # different trees are independent
    assert abs(_corr(N[: n // 2, leaf - 1], N[n // 2:, leaf - 1])) <= 5 / math.sqrt(n // 2)


def test_incremental_walk_equals_one_shot_walk(noise):
    """The statistics above use one walk 0 -> T; pipelines walk in jumps. Same values."""
    T, n = 100, 500
    sampler = discrete_gaussian(SIGMA)
    forest = HonakerForest(T, sampler, noise)
    ids = noise.tree_ids(TreeIdentity("stats", T, f"stats-{k}", "select", 0) for k in range(n))
    full, _ = _all_prefix_noise(noise, T, n, tag="stats")
    rng = np.random.default_rng(7)
    done = np.zeros(n, dtype=np.int64)
    cache = forest.empty_cache(n)
    while (done < T).any():
        upto = np.minimum(T, done + rng.integers(0, 13, size=n))
        walk = forest.walk(ids, done, upto, cache)
        tree, leaf = walk.future()
        np.testing.assert_array_equal(walk.prefix_noise(tree, leaf), full[tree, leaf - 1])
        cache = walk.cache_at(upto)
        done = upto
