"""Tests of dpstream.processor.mechanisms.consistency: the exact DP of Fioretto, Van Hentenryck and Zhu (sections 6-7)
against brute force, the M-natural local optimality criterion, and the structural guarantees."""

import numpy as np
import pytest

from dpstream.processor.mechanisms.consistency import (
    CostTable,
    Solution,
    clamp_and_round,
    convolve,
    solve,
)

# ------------------------------------------------------------------------------------ helpers


def children_of(parent):
    n = len(parent)
    return [[j for j in range(n) if parent[j] == i] for i in range(n)]


def atoms_of(parent, noisy, open_):
    """The free non-negative variables of the problem: one per leaf (except an unmeasured closed
    leaf, which is the constant 0) and one slack per open internal node. Returns the atom list
    (node index, kind) and the membership matrix A (node x atom): node value = A @ atoms."""
    n = len(parent)
    ch = children_of(parent)
    atoms = []
    for i in range(n):
        if not ch[i]:
            if not np.isnan(noisy[i]) or open_[i]:
                atoms.append((i, "leaf"))
        elif open_[i]:
            atoms.append((i, "slack"))
    A = np.zeros((n, len(atoms)), dtype=np.int64)
    for k, (i, _) in enumerate(atoms):
        j = i
        while j >= 0:  # the atom counts in its node and every ancestor
            A[j, k] = 1
            j = parent[j]
    return atoms, A


def cost(values, noisy, weight):
    values = np.asarray(values, dtype=np.float64)
    m = ~np.isnan(noisy)
    d = values[..., m] - noisy[m]
    return np.sum(weight[m] * d * d, axis=-1)


def check_feasible(parent, open_, fixed, sol):
    v, other = sol.values, sol.other
    assert v.dtype == np.int64 and other.dtype == np.int64
    assert (v >= 0).all()
    ch = children_of(parent)
    for i in range(len(parent)):
        if ch[i]:
            s = int(v[ch[i]].sum())
            assert other[i] == v[i] - s
            if open_[i]:
                assert v[i] >= s
            else:
                assert v[i] == s
        else:
            assert other[i] == 0
        if fixed is not None and fixed[i] >= 0:
            assert v[i] == fixed[i]


def brute_force(parent, noisy, weight, open_, fixed, box):
    """Minimum of the objective over all assignments of the atoms in 0..box-1 (node values are
    sums of atoms, so every candidate satisfies consistency and validity by construction; public
    values are filtered). Returns (min cost, argmin values) or (inf, None) if none is feasible."""
    atoms, A = atoms_of(parent, noisy, open_)
    k = len(atoms)
    if k == 0:
        grid = np.zeros((1, 0), dtype=np.int64)
    else:
        grid = np.stack(np.meshgrid(*([np.arange(box)] * k), indexing="ij"), axis=-1).reshape(-1, k)
    vals = grid @ A.T  # (candidates, nodes)
    ok = np.ones(len(vals), dtype=bool)
    if fixed is not None:
        for i in range(len(parent)):
            if fixed[i] >= 0:
                ok &= vals[:, i] == fixed[i]
    # an unmeasured closed leaf is 0: not an atom, so its value column is 0 already
    if not ok.any():
        return np.inf, None
    vals = vals[ok]
    c = cost(vals, noisy, weight)
    j = int(np.argmin(c))
    return float(c[j]), vals[j]


def random_tree(rng, n):
    parent = np.full(n, -1)
    for i in range(1, n):
        parent[i] = rng.integers(0, i)
    perm = rng.permutation(n)  # any node order must work
    inv = np.argsort(perm)
    parent = np.array([-1 if parent[p] < 0 else inv[parent[p]] for p in perm])
    return parent


# ------------------------------------------------------------------------- brute force on tiny trees


def test_dp_equals_brute_force_on_tiny_trees():
    rng = np.random.default_rng(101)
    checked = infeasible = with_fixed = 0
    for _ in range(250):
        n = int(rng.integers(2, 6))
        parent = random_tree(rng, n)
        noisy = rng.uniform(-3, 12, n)
        noisy[rng.random(n) < 0.25] = np.nan
        weight = rng.uniform(0.2, 3.0, n)
        open_ = rng.random(n) < 0.5
        spread = rng.uniform(0.5, 4.0, n)  # small spreads make the widening run often
        fixed = np.full(n, -1)
        if rng.random() < 0.3:
            fixed[rng.integers(0, n)] = rng.integers(0, 13)
        # Box: with at most 5 atoms and every noisy value and public value <= 12, some optimum has
        # every atom <= 12: if every node containing an atom a > 0 that is under no public node
        # had value > 12 >= noisy, lowering a by 1 would not increase any cost term (strictly
        # lower it if one is measured), so a minimal-sum optimum has a <= (some node's value) <= 12;
        # an atom under a public node f is <= f <= 12. 0..15 is a generous box for 5 atoms.
        best, _ = brute_force(parent, noisy, weight, open_, fixed, 16)
        if best == np.inf:
            with pytest.raises(ValueError):
                solve(parent, noisy, weight, spread, open_, fixed)
            infeasible += 1
            continue
        sol = solve(parent, noisy, weight, spread, open_, fixed)
        check_feasible(parent, open_, fixed, sol)
        assert sol.objective == pytest.approx(best, rel=1e-12, abs=1e-9)
        assert float(cost(sol.values, noisy, weight)) == pytest.approx(best, rel=1e-12, abs=1e-9)
        checked += 1
        with_fixed += int((fixed >= 0).any())
    assert checked > 200 and infeasible > 0 and with_fixed > 30


# ------------------------------------------------------------------------------------ convolution


def random_convex(rng, open_tail=False):
    k = int(rng.integers(0, 7))
    slopes = np.sort(rng.normal(0, 3, k))
    if rng.random() < 0.3:
        slopes = np.round(slopes)  # ties
    if open_tail:
        slopes = slopes[slopes < 0]
    return CostTable(int(rng.integers(0, 5)), float(rng.normal()), slopes, open_tail)


def brute_convolve(tables, slack, horizon):
    """O(n^2) min-plus convolution, table by table; open tails (and the slack) evaluated up to
    ``horizon``. Returns costs at lo .. horizon."""
    lo = 0
    cur = np.array([0.0])  # {0: 0}
    parts = list(tables) + ([CostTable(0, 0.0, np.zeros(0), True)] if slack else [])
    for t in parts:
        hi = horizon if t.open_tail else t.hi
        f = np.array([t.value(v) for v in range(t.lo, hi + 1)])
        out = np.full(cur.size + f.size - 1, np.inf)
        for i, a in enumerate(cur):
            out[i : i + f.size] = np.minimum(out[i : i + f.size], a + f)
        cur, lo = out, lo + t.lo
    return lo, cur


def test_convolve_equals_brute_force_min_plus():
    rng = np.random.default_rng(7)
    for trial in range(400):
        slack = bool(trial % 2)
        tables = [random_convex(rng, open_tail=rng.random() < 0.15) for _ in range(rng.integers(0, 5))]
        res = convolve(tables, slack=slack)
        assert np.all(np.diff(res.slopes) >= 0)
        opened = slack or any(t.open_tail for t in tables)
        assert res.open_tail == opened
        assert res.lo == sum(t.lo for t in tables)
        horizon = res.lo + res.slopes.size + 8
        lo, ref = brute_convolve(tables, slack, horizon)
        assert lo == res.lo
        if opened:
            ref = ref[: horizon - lo + 1]
            mine = np.array([res.value(v) for v in range(lo, horizon + 1)])
            assert (res.slopes < 0).all()
        else:
            assert res.hi == lo + ref.size - 1
            mine = res.values()
            assert res.value(res.hi + 1) == np.inf
        np.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-9)
        assert res.value(res.lo - 1) == np.inf


def test_tables_are_convex():
    rng = np.random.default_rng(11)
    for _ in range(60):
        n = int(rng.integers(5, 60))
        parent = random_tree(rng, n)
        noisy = rng.normal(5, 20, n)
        noisy[rng.random(n) < 0.2] = np.nan
        sol = solve(parent, noisy, rng.uniform(0.5, 2, n), rng.uniform(1, 40, n), rng.random(n) < 0.4,
                    keep_tables=True)
        assert len(sol.tables) == n
        for i, t in enumerate(sol.tables):
            assert isinstance(t, CostTable)
            c = t.values()
            second = np.diff(c, 2)
            scale = max(1.0, float(np.abs(c).max()))
            assert (second >= -1e-9 * scale).all(), i
            assert np.all(np.diff(t.slopes) >= 0)
            # every node's value lies in its final table's domain
            assert sol.values[i] >= t.lo and (t.hi is None or sol.values[i] <= t.hi)
        # the root tables' minima add up to the objective
        roots = np.flatnonzero(parent < 0)
        total = sum(sol.tables[r].value(sol.tables[r].argmin()) for r in roots)
        assert total == pytest.approx(sol.objective, rel=1e-9, abs=1e-6)


# ------------------------------------------------------------------------- consistent inputs


def test_consistent_input_comes_back_unchanged():
    rng = np.random.default_rng(3)
    for trial in range(40):
        n = int(rng.integers(2, 40))
        parent = random_tree(rng, n)
        open_ = rng.random(n) < (0.5 if trial % 2 else 0.0)
        ch = children_of(parent)
        true = np.zeros(n, dtype=np.int64)
        order = np.argsort([-depth(parent, i) for i in range(n)], kind="stable")
        for i in order:  # deepest first
            if ch[i]:
                true[i] = true[ch[i]].sum() + (rng.integers(0, 5) if open_[i] else 0)
            else:
                true[i] = rng.integers(0, 30) if rng.random() < 0.8 else 0
        sol = solve(parent, true.astype(float), weight=rng.uniform(0.5, 2, n), open=open_)
        np.testing.assert_array_equal(sol.values, true)
        assert sol.objective == 0.0
        assert sol.iterations == 1
        check_feasible(parent, open_, None, sol)


def depth(parent, i):
    d = 0
    while parent[i] >= 0:
        i, d = parent[i], d + 1
    return d


# ------------------------------------------------------------------------ the paper's example


def paper_example():
    """Section 6 hierarchy of the running example: a public total of 6 groups (fixed root) whose
    children are US_k (groups of size k = 1..3), each with children GA_k and NY_k."""
    names = ["total"]
    parent = [-1]
    for k in (1, 2, 3):
        us = len(names)
        names += [f"US{k}", f"GA{k}", f"NY{k}"]
        parent += [0, us, us]
    true = {"total": 6, "US1": 3, "US2": 1, "US3": 2, "GA1": 2, "GA2": 0, "GA3": 1, "NY1": 1, "NY2": 1, "NY3": 1}
    return names, np.array(parent), np.array([true[x] for x in names], dtype=np.int64)


def test_paper_running_example():
    names, parent, true = paper_example()
    n = len(names)
    fixed = np.full(n, -1)
    fixed[0] = 6
    noisy_true = true.astype(float)
    noisy_true[0] = np.nan  # the total is public, not measured
    sol = solve(parent, noisy_true, fixed=fixed)
    np.testing.assert_array_equal(sol.values, true)
    assert sol.objective == 0.0

    perturb = np.array([0.0, 0.6, -1.4, 1.7, -0.8, 2.2, -1.1, 0.4, 1.3, -2.6])
    noisy = true + perturb
    noisy[0] = np.nan
    weight = np.ones(n)
    open_ = np.zeros(n, dtype=bool)
    sol = solve(parent, noisy, weight, 1.5, open_, fixed)
    check_feasible(parent, open_, fixed, sol)
    assert sol.values[0] == 6 and sol.values[[1, 4, 7]].sum() == 6
    # every atom (GA_k, NY_k) is <= 6 because they add up to the public 6: box 0..6 is exact
    best, _ = brute_force(parent, noisy, weight, open_, fixed, 7)
    assert sol.objective == pytest.approx(best, rel=1e-12)
    assert float(cost(sol.values, noisy, weight)) == pytest.approx(best, rel=1e-12)
    # the naive baseline is not consistent here, the DP is
    naive = clamp_and_round(noisy)
    assert naive[[1, 4, 7]].sum() != 6 or (naive[[2, 5, 8]] + naive[[3, 6, 9]] != naive[[1, 4, 7]]).any()


# ------------------------------------------------------------------ random larger forests


def random_forest(rng, n, open_p=0.4, unmeasured_p=0.0):
    """Random forest, open flags, measured mask, and true values satisfying the constraints
    (an unmeasured closed leaf is 0)."""
    parent = random_tree(rng, n)
    cut = rng.random(n) < 0.1  # several roots
    parent = np.where(cut, -1, parent)
    open_ = rng.random(n) < open_p
    measured = rng.random(n) >= unmeasured_p
    ch = children_of(parent)
    true = np.zeros(n, dtype=np.int64)
    for i in np.argsort([-depth(parent, i) for i in range(n)], kind="stable"):
        if ch[i]:
            true[i] = true[ch[i]].sum() + (rng.integers(0, 4) if open_[i] else 0)
        elif measured[i] or open_[i]:
            true[i] = rng.integers(0, 6)
    return parent, open_, measured, true


def local_optimality_gap(parent, noisy, weight, open_, fixed, values):
    """Best improvement over the M-natural neighbourhood x + e_j - e_k, x +- e_j of the atoms
    (Murota's optimality criterion for M-natural-convex functions). <= 0 means no neighbour
    is better, hence (the objective being laminar convex) ``values`` is a global optimum."""
    atoms, A = atoms_of(parent, noisy, open_)
    k = len(atoms)
    # atom values from node values: leaf atoms are leaf values, slacks are v - sum(children)
    ch = children_of(parent)
    x = np.array([values[i] if kind == "leaf" else values[i] - values[ch[i]].sum() for i, kind in atoms])
    assert np.array_equal(A @ x, values)
    eye = np.eye(k, dtype=np.int64)
    moves = [eye, -eye] + [eye[j] - eye for j in range(k)]
    D = np.concatenate([np.zeros((1, k), dtype=np.int64)] + moves)
    cand = x + D
    ok = (cand >= 0).all(axis=1)
    vals = cand @ A.T
    for i in np.flatnonzero(fixed >= 0):
        ok &= vals[:, i] == fixed[i]
    c = cost(vals[ok], noisy, weight)
    return float(cost(values, noisy, weight) - c.min())


def test_random_forests_are_consistent_optimal_and_deterministic():
    rng = np.random.default_rng(2024)
    negatives = 0
    for trial in range(200):
        n = int(rng.integers(1, 61))
        parent, open_, measured, true = random_forest(rng, n, unmeasured_p=0.15)
        noisy = true + rng.normal(0, 4.0, n)  # noise large relative to the counts
        negatives += int((noisy < 0).sum())
        noisy[~measured] = np.nan
        weight = rng.uniform(0.3, 3.0, n)
        fixed = np.where((parent < 0) & (rng.random(n) < 0.3), true, -1)  # public totals
        spread = 3 * 4.0
        sol = solve(parent, noisy, weight, spread, open_, fixed)
        check_feasible(parent, open_, fixed, sol)
        again = solve(parent, noisy, weight, spread, open_, fixed)
        assert np.array_equal(sol.values, again.values) and np.array_equal(sol.other, again.other)
        assert sol.objective == again.objective and sol.iterations == again.iterations
        # the true values are feasible, so the optimum can't be worse
        assert sol.objective <= float(cost(true, noisy, weight)) + 1e-9
        assert local_optimality_gap(parent, noisy, weight, open_, fixed, sol.values) <= 1e-9
    assert negatives > 500


def test_node_order_does_not_matter():
    rng = np.random.default_rng(5)
    parent, open_, _, true = random_forest(rng, 50)
    noisy = true + rng.normal(0, 3, 50)
    sol = solve(parent, noisy, open=open_)
    perm = rng.permutation(50)
    inv = np.argsort(perm)
    p2 = np.where(parent[perm] < 0, -1, inv[np.maximum(parent[perm], 0)])
    sol2 = solve(p2, noisy[perm], open=open_[perm])
    assert sol2.objective == pytest.approx(sol.objective, rel=1e-12)


# ----------------------------------------------------------------------------------- widening


@pytest.mark.parametrize("noisy", [[100.0, 10.0, 10.0], [10.0, 100.0, 100.0]])
def test_widening_reaches_the_optimum_far_outside_the_spread(noisy):
    noisy = np.array(noisy)
    parent = np.array([-1, 0, 0])
    sol = solve(parent, noisy, spread=0.5)
    # closed form: min (a + b - p)^2 + (a - c)^2 + (b - c)^2, integers, by enumeration
    grid = np.arange(0, 201)
    a, b = np.meshgrid(grid, grid, indexing="ij")
    best = ((a + b - noisy[0]) ** 2 + (a - noisy[1]) ** 2 + (b - noisy[2]) ** 2).min()
    assert sol.objective == best
    assert sol.values[0] == sol.values[1] + sol.values[2]
    assert sol.iterations > 1


@pytest.mark.parametrize("total", [1000, 3])
def test_public_total_far_outside_the_children_spread(total):
    # the fixed root can't be met inside the children's boxes: their bounds are widened
    sol = solve([-1, 0, 0], [np.nan, 40.0, 40.0], spread=1.0, fixed=[total, -1, -1])
    assert sol.values[0] == total and sol.values[1] + sol.values[2] == total
    assert abs(int(sol.values[1]) - int(sol.values[2])) <= 1
    assert sol.iterations > 1


def test_pass_cap_raises(monkeypatch):
    from dpstream.processor.mechanisms import consistency

    monkeypatch.setattr(consistency, "MAX_PASSES", 2)
    with pytest.raises(RuntimeError):
        solve([-1, 0, 0], [100.0, 10.0, 10.0], spread=0.5)


def test_open_parent_far_above_children():
    # open: the parent keeps its own noisy value, the gap goes to "other"
    sol = solve([-1, 0, 0], [500.0, 3.0, 4.0], spread=1.0, open=[True, False, False])
    np.testing.assert_array_equal(sol.values, [500, 3, 4])
    assert sol.other[0] == 493 and sol.objective == 0.0


# ---------------------------------------------------------------------------- small behaviours


def test_unmeasured_leaves_and_slack():
    # unmeasured closed leaf is 0; unmeasured open leaf absorbs what the parent needs
    # closed: (a-9)^2 + (a-2)^2 is 25 at both 5 and 6; the smallest minimiser is taken
    sol = solve([-1, 0, 0], [9.0, 2.0, np.nan], open=[False, False, False])
    np.testing.assert_array_equal(sol.values, [5, 5, 0])
    assert sol.objective == 25.0
    sol = solve([-1, 0, 0], [9.0, 2.0, np.nan], open=[False, False, True])
    np.testing.assert_array_equal(sol.values, [9, 2, 7])
    assert sol.objective == 0.0
    # open parent: what its children don't need goes to its own "other", not to a free child
    sol = solve([-1, 0, 0], [10.0, 2.0, np.nan], open=[True, False, True])
    np.testing.assert_array_equal(sol.values, [10, 2, 0])
    np.testing.assert_array_equal(sol.other, [8, 0, 0])


def test_ties_take_the_smallest_value():
    assert solve([-1], [5.5]).values[0] == 5
    assert CostTable(2, 1.0, np.array([-1.0, 0.0, 0.0, 2.0])).argmin() == 3
    # an unmeasured open node's table is flat after its negative slopes: smallest minimiser
    sol = solve([-1, 0], [np.nan, 4.5], open=[True, False])
    np.testing.assert_array_equal(sol.values, [4, 4])


def test_infeasible_public_values_raise():
    with pytest.raises(ValueError):
        solve([-1, 0], [np.nan, 3.0], fixed=[2, 5])
    with pytest.raises(ValueError):
        solve([-1, 0], [np.nan, np.nan], fixed=[2, -1])  # closed unmeasured leaf is 0


def test_clamp_and_round_and_empty():
    np.testing.assert_array_equal(clamp_and_round([-1.2, 0.4, 2.6, np.nan]), [0, 0, 3, 0])
    assert clamp_and_round([1.0]).dtype == np.int64
    sol = solve(np.zeros(0, dtype=int), np.zeros(0))
    assert isinstance(sol, Solution) and sol.values.size == 0


def test_large_fan_out_uses_selected_range_correctly():
    # one root over many children with wide domains: the partitioned slope range must agree
    # with a full merge (the root table vs convolve of the children's tables plus eq. 4a)
    rng = np.random.default_rng(9)
    k = 100
    parent = np.concatenate([[-1], np.zeros(k, dtype=int)])
    true = rng.integers(0, 50, k)
    noisy = np.concatenate([[true.sum()], true]) + rng.normal(0, 30, k + 1)
    sol = solve(parent, noisy, spread=90.0, keep_tables=True)
    full = convolve(sol.tables[1:])
    root = sol.tables[0]
    vs = np.arange(root.lo, root.hi + 1)
    expect = full.values()[vs - full.lo] + (vs - noisy[0]) ** 2
    np.testing.assert_allclose(root.values(), expect, rtol=1e-10)
    assert local_optimality_gap(parent, noisy, np.ones(k + 1), np.zeros(k + 1, bool),
                                np.full(k + 1, -1), sol.values) <= 1e-9
