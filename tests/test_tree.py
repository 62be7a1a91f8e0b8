"""The vectorized forest equals a literal Algorithm 1 + bottom-up Honaker on a full tree."""
import numpy as np
import pytest

from dpstream.accountant.calibration import (
    honaker_weights,
    prefix_variance_factor,
    read_levels,
    tree_levels,
)
from dpstream.processor.mechanisms.noise import (
    TreeIdentity,
    discrete_gaussian,
    node_ids,
)
from dpstream.processor.mechanisms.tree import HonakerForest


def reference_prefix_estimates(noise, sampler, tree_id, values):
    """Algorithm 1 literally: a full padded tree, x_i added on the path to the root, noisy nodes,
    bottom-up Honaker over complete nodes, prefix read from the dyadic decomposition."""
    T = len(values)
    levels = tree_levels(T)
    true = {}
    noisy = {}
    for level in range(levels):
        width = 1 << level
        for j in range((1 << (levels - 1)) >> level):
            true[level, j] = sum(values[j * width:(j + 1) * width])
            y = noise.sample(sampler, np.array([tree_id], dtype="S16"), node_ids(np.array([level]), np.array([j])))[0]
            noisy[level, j] = true[level, j] + y
    est = {}
    for level in range(levels):
        for j in range((1 << (levels - 1)) >> level):
            if (j + 1) << level > T:
                continue  # incomplete: never read
            if level == 0:
                est[level, j] = float(noisy[level, j])
            else:
                a, b = honaker_weights(level)
                est[level, j] = a * noisy[level, j] + b * (est[level - 1, 2 * j] + est[level - 1, 2 * j + 1])
    out = []
    for i in range(1, T + 1):
        out.append(sum(est[level, (i >> level) - 1] for level in range(levels) if (i >> level) & 1))
    return np.array(out)


@pytest.mark.parametrize("T", [1, 2, 7, 16, 100])
def test_forest_matches_reference_tree_with_random_step_sizes(noise, rng, T):
    sampler = discrete_gaussian(3.0)
    forest = HonakerForest(T, sampler, noise)
    tree_id = noise.tree_id(TreeIdentity("q", 0, "k", "select", 0))
    values = rng.integers(0, 5, size=T).tolist()
    expected = reference_prefix_estimates(noise, sampler, tree_id, values)
    # walk the tree in random jumps, carrying only the frontier cache
    done, cache = 0, forest.empty_cache(1)
    ids = np.array([tree_id], dtype="S16")
    while done < T:
        upto = min(T, done + int(rng.integers(1, 6)))
        walk = forest.walk(ids, np.array([done]), np.array([upto]), cache)
        tree, leaf = walk.future()
        got = walk.prefix_noise(tree, leaf) + np.cumsum(values)[leaf - 1]
        np.testing.assert_allclose(got, expected[leaf - 1], rtol=0, atol=1e-9)
        cache = walk.cache_at(np.array([upto]))
        done = upto


def test_many_trees_in_one_walk_equal_separate_walks(noise, rng):
    T = 64
    forest = HonakerForest(T, discrete_gaussian(5.0), noise)
    ids = noise.tree_ids(TreeIdentity("q", 0, f"key{i}", "select", 0) for i in range(20))
    done = rng.integers(0, T, size=20)
    upto = np.minimum(T, done + rng.integers(1, 20, size=20))
    # caches at `done` from a from-scratch walk
    warm = forest.walk(ids, np.zeros(20, dtype=np.int64), done, forest.empty_cache(20))
    cache = warm.cache_at(done)
    joint = forest.walk(ids, done, upto, cache)
    tree, leaf = joint.future()
    joint_values = joint.prefix_noise(tree, leaf)
    for t in range(20):
        alone = forest.walk(ids[t:t + 1], done[t:t + 1], upto[t:t + 1], cache[t:t + 1])
        _, leaf_t = alone.future()
        np.testing.assert_array_equal(alone.prefix_noise(np.zeros(len(leaf_t), dtype=np.int64), leaf_t), joint_values[tree == t])


def test_read_levels_counts_complete_levels():
    assert read_levels(100) == 7
    assert read_levels(1000) == 10
    assert read_levels(128) == 8  # the full tree's root is complete at leaf 128
    assert read_levels(1) == 1


def test_prefix_variance_factor_closed_form():
    # leaf 1: one leaf (sigma^2); leaf 2: one level-1 node (2/3); leaf 3: 2/3 + 1; leaf 4: 4/7
    assert prefix_variance_factor(1) == pytest.approx(1.0)
    assert prefix_variance_factor(2) == pytest.approx(2 / 3)
    assert prefix_variance_factor(3) == pytest.approx(5 / 3)
    assert prefix_variance_factor(4) == pytest.approx(4 / 7)
