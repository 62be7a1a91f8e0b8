"""The dynamic agent's discrete Laplace noise is exact (processor/mechanisms/discrete_laplace.py).

Claim under attack: every integer is a possible output with exactly the discrete Laplace
probability ``(1 - q)/(1 + q) q^|x|``, ``q = exp(-s/t)`` for the rounded-up scale t/s >= scale.
The old float inverse transform could not output anything beyond ~37 scales, which breaks pure DP
(an output possible under one input and impossible under its neighbour).
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import chi2

from dpstream.processor.mechanisms import discrete_laplace as dl
from dpstream.processor.mechanisms.dynamic import DynamicNoise
from dpstream.processor.mechanisms.noise import NodeNoise, TreeIdentity
from tests.conftest import TEST_SECRET


def _noise(query="exact-laplace") -> DynamicNoise:
    return DynamicNoise(NodeNoise(TEST_SECRET), query)


@pytest.mark.parametrize("scale", [0.5, 3.0, 50.0])
def test_distribution_matches_the_exact_pmf(scale):
    """Chi-square goodness of fit over buckets of |x| with expected count >= 50 (the tail lumped),
    200k draws. Significance 1e-6 per scale: the chi-square quantile is the tolerance, so a
    correct sampler fails with probability 1e-6 and the fixed secret makes the run repeatable."""
    n = 200_000
    x = _noise().laplace(scale, f"gof-{scale}", n)
    # buckets of single integers while the expected count is large, then the tail
    probs, cells = [], []
    k = 0
    while True:
        p = float(dl.pmf(scale, np.array([k]))[0]) * (1 if k == 0 else 2)
        if p * n < 50:
            break
        probs.append(p)
        cells.append(int(np.sum(np.abs(x) == k)))
        k += 1
    probs.append(1.0 - sum(probs))
    cells.append(int(np.sum(np.abs(x) >= k)))
    probs = np.array(probs)
    cells = np.array(cells)
    stat = float(np.sum((cells - n * probs) ** 2 / (n * probs)))
    assert stat < chi2.isf(1e-6, len(probs) - 1), (scale, stat)
    # symmetric: the count of negatives is Binomial(#nonzero, 1/2); 5.5 sd
    nonzero = int(np.sum(x != 0))
    assert abs(int(np.sum(x < 0)) - nonzero / 2) <= 5.5 * math.sqrt(nonzero / 4)


def test_rational_scale_is_never_below_the_declared_scale():
    for scale in (1e-6, 0.3, 1.0, 2 / 3, 40.0, 12345.678, 2.0 ** 40):
        t, s = dl.rational_scale(scale)
        assert Fraction(t, s) >= Fraction(scale)
        assert Fraction(t, s) - Fraction(scale) <= Fraction(1, s)  # within one step of 1/s
        assert s & (s - 1) == 0 and t < dl.MAX_T


def test_uniform_integers_are_exact_by_rejection():
    """u = w mod m is used only for w < 2^64 - (2^64 mod m), a multiple of m: every residue is hit
    by the same number of words. Checked on the boundary words themselves."""
    for m in (1, 2, 3, 7, 10 ** 9 + 7, (1 << 52) - 3, 1 << 40):
        limit = (1 << 64) - ((1 << 64) % m)
        assert limit % m == 0 and (1 << 64) - limit < m
        script = [limit - 1] if limit == 1 << 64 else [limit, (1 << 64) - 1, limit - 1]
        words = dl._Words(_scripted(script), np.array([0]))
        value = dl._uniform(words, np.array([0]), m)
        assert int(value[0]) == (limit - 1) % m == m - 1
        assert int(words.cursor[0]) == len(script)  # the words at or above the limit were rejected


def _scripted(script: list[int]):
    """A word source for index 0 that returns ``script`` first, then zeros."""
    def source(page, high, nodes):
        hi, lo = [], []
        for node in nodes.tolist():
            j = page * dl.WORDS_PER_PAGE + 2 * (node % (dl.WORDS_PER_PAGE // 2))
            hi.append(script[j] if j < len(script) else 0)
            lo.append(script[j + 1] if j + 1 < len(script) else 0)
        return np.array(hi, dtype=np.uint64), np.array(lo, dtype=np.uint64)
    return source


def test_any_integer_is_a_possible_output():
    """Full support, shown constructively: a word sequence of positive probability on which the
    sampler outputs 300 at scale 0.25, where the old float sampler's largest output was 9.
    U = 0 is accepted (Bernoulli(exp(0)) = 1); each Bernoulli(exp(-1)) success is K = 3 (A_1
    always succeeds, A_2 needs an even word, A_3 fails on a word = 1 mod 3); the geometric stops
    at K = 2 (an odd word); the sign word is even (positive)."""
    scale = 0.25
    t, s = dl.rational_scale(scale)
    assert t == s // 4  # 0.25 exactly
    old_max = math.floor(math.log(2.0 ** -53) * -scale)  # the float sampler's largest geometric
    target = 300
    assert target > old_max
    v = target * s // t  # Y = floor(t V / s) = target
    script = [0, 0]  # U = 0 (uniform over t), then A_1 of Bernoulli(exp(-0)): 0 < 0 fails, K = 1 odd
    for _ in range(v):
        script += [0, 0, 1]  # A_1 (m=1), A_2 even, A_3 = 1 mod 3: stop at K = 3, odd: success
    script += [0, 1]  # A_1 succeeds, A_2 odd: stop at K = 2, even: failure -> V done
    script += [0]  # sign: positive
    single = dl.sample(_scripted(script), scale, np.array([0]))
    assert int(single[0]) == target
    batch = dl.sample(_scripted(script), scale, np.zeros(dl.SCALAR_DRAWS + 1, dtype=np.int64))
    assert (batch == target).all()  # the vectorized path reads the same words


@pytest.mark.parametrize("gamma", [Fraction(0), Fraction(3, 10), Fraction(1)])
def test_bernoulli_exp_frequencies(gamma):
    """CKS Algorithm 1: P[1] = exp(-gamma); 200k draws, 5.5 sd of a binomial."""
    n = 200_000
    noise = NodeNoise(TEST_SECRET)
    tree = noise.tree_id(TreeIdentity("q", 0, f"bern{gamma}", "x"))
    words = dl._Words(lambda page, high, nodes: noise.uniforms_indexed(np.array([tree]), np.zeros(len(nodes), dtype=np.int64),
                                                                         nodes), np.arange(n))
    got = dl._bernoulli_exp(words, np.arange(n), np.full(n, gamma.numerator, dtype=np.uint64), gamma.denominator)
    p = math.exp(-float(gamma))
    assert abs(got.mean() - p) <= 5.5 * math.sqrt(p * (1 - p) / n + 1e-12)


def test_values_do_not_depend_on_batching_and_differ_by_label():
    d = _noise()
    whole = d.laplace(3.0, "batching", 5000)
    parts = np.concatenate([d.laplace(3.0, "batching", 7, start=i) for i in range(0, 5000, 7)])[:5000]
    assert np.array_equal(whole, parts)
    assert np.array_equal(d.laplace(3.0, "batching", 1, start=4321), whole[4321:4322])
    other = d.laplace(3.0, "batching-2", 5000)
    # independent draws: correlation within 5.5 / sqrt(n)
    assert abs(np.corrcoef(whole, other)[0, 1]) < 5.5 / math.sqrt(5000)
    assert not np.array_equal(_noise("another-query").laplace(3.0, "batching", 5000), whole)
