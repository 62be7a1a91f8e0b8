"""Keyed PRF integer noise (dpstream.processor.mechanisms.noise): determinism, distribution, secret handling.

Statistical checks run on noise derived from the fixed test secret, so each test is
deterministic; the quoted false-failure probabilities are over the choice of secret.
"""
import math

import mpmath
import numpy as np
import pytest
from conftest import TEST_SECRET
from scipy import stats

from dpstream.processor.mechanisms.noise import (
    MIN_SECRET_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    DiscreteGaussian,
    NodeNoise,
    NoiseSecretError,
    Pseudonymizer,
    TreeIdentity,
    discrete_gaussian,
    load_noise_secret,
    node_ids,
)

#: z for two-sided normal-approximation checks: P(|Z| > 5.5) = 3.8e-8 per check.
Z = 5.5


def _ids(noise, identity, n):
    return np.full(n, noise.tree_id(identity), dtype="S16")


def _collision_probability(sampler):
    x = np.arange(-sampler.bound, sampler.bound + 1)
    return float(np.sum(sampler.pmf(x) ** 2))


def _check_collision_fraction(a, b, q):
    """a, b: samples that should be independent draws. #equal ~ Binomial(n, q): allow Z sd."""
    n = len(a)
    equal = int(np.sum(a == b))
    assert equal < n, "two noise streams that must differ are identical"
    sd = math.sqrt(n * q * (1 - q))
    assert abs(equal - n * q) <= Z * sd, (equal, n * q, sd)


BASE = TreeIdentity("query-a", 1_700_000_000_000, "key-1", "select", 0)


# --------------------------------------------------------------------------- determinism


def test_same_secret_same_noise(noise):
    sampler = discrete_gaussian(2.5)
    n = 5000
    trees = noise.tree_ids(TreeIdentity("q", 0, f"k{i % 50}", "select", i % 3) for i in range(n))
    nodes = node_ids(np.arange(n) % 7, np.arange(n) // 7)
    first = noise.sample(sampler, trees, nodes)
    second = noise.sample(sampler, trees, nodes)
    other = NodeNoise(TEST_SECRET)
    third = other.sample(sampler, other.tree_ids(TreeIdentity("q", 0, f"k{i % 50}", "select", i % 3) for i in range(n)), nodes)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, third)
    assert other.fingerprint == noise.fingerprint
    # a sub-batch (different vector length, different order) sees the same per-node values
    perm = np.random.default_rng(5).permutation(n)[:777]
    np.testing.assert_array_equal(noise.sample(sampler, trees[perm], nodes[perm]), first[perm])


@pytest.mark.parametrize(
    "changed",
    [
        TreeIdentity("query-b", BASE.window_start, BASE.key, BASE.kind, BASE.round),
        TreeIdentity(BASE.query, BASE.window_start + 1, BASE.key, BASE.kind, BASE.round),
        TreeIdentity(BASE.query, BASE.window_start, "key-2", BASE.kind, BASE.round),
        TreeIdentity(BASE.query, BASE.window_start, BASE.key, "perturb:count", BASE.round),
        TreeIdentity(BASE.query, BASE.window_start, BASE.key, BASE.kind, 1),
    ],
    ids=["query", "window_start", "key", "kind", "round"],
)
def test_each_identity_field_changes_the_noise(noise, changed):
    sampler = discrete_gaussian(2.5)
    n = 20000
    nodes = np.arange(n, dtype=np.uint32)
    assert noise.tree_id(BASE) != noise.tree_id(changed)
    a = noise.sample(sampler, _ids(noise, BASE, n), nodes)
    b = noise.sample(sampler, _ids(noise, changed, n), nodes)
    # independent draws coincide with probability q = sum_x p(x)^2 (~0.113 for sigma 2.5)
    _check_collision_fraction(a, b, _collision_probability(sampler))


def test_identity_encoding_is_unambiguous(noise):
    # length-prefixed fields: moving a character between fields is a different tree
    a = TreeIdentity("ab", 0, "c", "select", 0)
    b = TreeIdentity("a", 0, "bc", "select", 0)
    assert a.encode() != b.encode()
    assert noise.tree_id(a) != noise.tree_id(b)


def test_node_ids_change_the_noise(noise):
    sampler = discrete_gaussian(2.5)
    n = 20000
    trees = _ids(noise, BASE, n)
    a = noise.sample(sampler, trees, np.arange(n, dtype=np.uint32))
    b = noise.sample(sampler, trees, np.arange(n, 2 * n, dtype=np.uint32))
    _check_collision_fraction(a, b, _collision_probability(sampler))
    # same index, different level
    c = noise.sample(sampler, trees, node_ids(np.ones(n), np.arange(n)))
    _check_collision_fraction(a, c, _collision_probability(sampler))


def test_secrets_change_the_noise(noise):
    sampler = discrete_gaussian(2.5)
    n = 20000
    other = NodeNoise(TEST_SECRET + b"x")
    assert other.fingerprint != noise.fingerprint
    nodes = np.arange(n, dtype=np.uint32)
    a = noise.sample(sampler, _ids(noise, BASE, n), nodes)
    b = other.sample(sampler, _ids(other, BASE, n), nodes)
    _check_collision_fraction(a, b, _collision_probability(sampler))


# --------------------------------------------------------------------------- distribution


def _independent_pmf(sigma, x):
    """exp(-x^2 / 2 sigma^2) / Z with mpmath at 50 digits, Z summed over |y| <= 14 sigma (the rest is < e^-98 relative)."""
    with mpmath.workdps(50):
        s2 = mpmath.mpf(sigma) ** 2
        bound = int(math.ceil(14 * sigma))
        total = mpmath.fsum(mpmath.exp(-mpmath.mpf(y) ** 2 / (2 * s2)) for y in range(-bound, bound + 1))
        return np.array([float(mpmath.exp(-mpmath.mpf(int(v)) ** 2 / (2 * s2)) / total) for v in x])


@pytest.mark.parametrize("sigma", [0.8, 2.5, 40.0, 1000.5])
def test_pmf_matches_independent_formula(sigma):
    sampler = DiscreteGaussian(sigma)
    x = np.arange(-int(6 * sigma), int(6 * sigma) + 1)
    if len(x) > 4001:
        x = np.unique(np.concatenate([x[:500], x[-500:], x[:: len(x) // 1000]]))
    np.testing.assert_allclose(sampler.pmf(x), _independent_pmf(sigma, x), rtol=1e-12, atol=0)
    whole = sampler.pmf(np.arange(-sampler.bound, sampler.bound + 1))
    assert whole.sum() == pytest.approx(1.0, abs=1e-12)
    assert sampler.pmf(np.array([-sampler.bound - 1, sampler.bound + 1])).tolist() == [0.0, 0.0]
    assert sampler.tv_bound <= 2.0 ** -100


def _binned(samples, sampler, n):
    """Observed and expected counts per support point, tails merged until expected >= 5."""
    support = np.arange(-sampler.bound, sampler.bound + 1)
    expected = n * sampler.pmf(support)
    observed = np.bincount(samples + sampler.bound, minlength=len(support)).astype(float)
    inner = np.nonzero(expected >= 5)[0]
    lo, hi = inner[0], inner[-1]
    # merge everything left of lo into bin lo, right of hi into bin hi
    exp_b = expected[lo:hi + 1].copy()
    obs_b = observed[lo:hi + 1].copy()
    exp_b[0] += expected[:lo].sum()
    obs_b[0] += observed[:lo].sum()
    exp_b[-1] += expected[hi + 1:].sum()
    obs_b[-1] += observed[hi + 1:].sum()
    return obs_b, exp_b


@pytest.mark.parametrize("sigma", [2.5, 40.0])
def test_samples_follow_the_pmf_chi_square(noise, sigma):
    # ~1e6 draws at distinct node ids of one tree (distinct PRF inputs). Under H0 the p-value is
    # uniform: requiring p > 1e-4 fails a correct sampler with probability 1e-4 per sigma.
    sampler = discrete_gaussian(sigma)
    n = 1 << 20
    samples = noise.sample(sampler, _ids(noise, TreeIdentity("chi2", 0, str(sigma), "select"), n), np.arange(n, dtype=np.uint32))
    assert samples.dtype == np.int64
    assert np.abs(samples).max() <= sampler.bound
    obs, exp = _binned(samples, sampler, n)
    assert len(obs) >= 15
    result = stats.chisquare(obs, exp)
    assert result.pvalue > 1e-4, result


@pytest.mark.parametrize("sigma", [2.0, 2.5, 7.3, 40.0, 4096.0])
def test_variance_is_sigma_squared(sigma):
    # Poisson summation: Var N_Z(0, sigma^2) = sigma^2 (1 - O(sigma^-2 pi^2 e^{-2 pi^2 sigma^2}))
    # which is < 1e-30 relative at sigma >= 2.
    sampler = DiscreteGaussian(sigma)
    assert sampler.variance == pytest.approx(sigma**2, rel=1e-9)
    # and .variance is the variance of the table itself
    x = np.arange(-sampler.bound, sampler.bound + 1)
    p = sampler.pmf(x)
    assert float(np.sum(p * x.astype(float) ** 2)) == pytest.approx(sampler.variance, rel=1e-9)
    assert float(np.sum(p * x)) == pytest.approx(0.0, abs=1e-9 * sigma)


@pytest.mark.parametrize("sigma", [2.5, 40.0])
def test_empirical_variance_matches(noise, sigma):
    # s^2 of n iid draws: Var(s^2) = (m4 - V^2 (n-3)/(n-1)) / n with m4 the 4th central moment
    # (taken from the exact pmf). We allow Z = 5.5 sd (normal approximation, n = 2^20):
    # false failure < 4e-8. Mean: sd sqrt(V/n), same Z.
    sampler = discrete_gaussian(sigma)
    n = 1 << 20
    samples = noise.sample(sampler, _ids(noise, TreeIdentity("var", 1, str(sigma), "perturb:count"), n), np.arange(n, dtype=np.uint32))
    x = np.arange(-sampler.bound, sampler.bound + 1).astype(float)
    p = sampler.pmf(x.astype(np.int64))
    V = sampler.variance
    m4 = float(np.sum(p * x**4))
    assert m4 == pytest.approx(3 * V**2, rel=1e-6)  # Gaussian kurtosis
    sd_s2 = math.sqrt((m4 - V**2 * (n - 3) / (n - 1)) / n)
    s2 = float(np.var(samples.astype(float), ddof=1))
    assert abs(s2 - V) <= Z * sd_s2, (s2, V, sd_s2)
    assert abs(samples.mean()) <= Z * math.sqrt(V / n)


def test_samples_are_bounded_integers(noise):
    for sigma in (0.5, 1.0, 3.0, 4096.0):
        sampler = discrete_gaussian(sigma)
        n = 200_000
        s = noise.sample(sampler, _ids(noise, TreeIdentity("b", 0, str(sigma), "select"), n), np.arange(n, dtype=np.uint32))
        assert s.dtype == np.int64
        assert s.min() >= -sampler.bound and s.max() <= sampler.bound
    assert noise.sample(discrete_gaussian(3.0), np.zeros(0, dtype="S16"), np.zeros(0, dtype=np.uint32)).dtype == np.int64


def test_from_uniform_resolves_ties_on_the_high_word():
    """Uniforms equal to a table entry in the high word are decided by the low word, so that
    P[x_k] = (cum[k] - cum[k-1]) / 2^128 exactly: check at every table boundary."""
    sampler = DiscreteGaussian(2.5)
    hi, lo = sampler._hi, sampler._lo
    m = len(hi)
    one = np.uint64(1)
    # u = cum[j] exactly maps to index j+1 (cum[j] <= u); u = cum[j] - 1 maps to index j
    at = sampler.from_uniform(hi.copy(), lo.copy())
    np.testing.assert_array_equal(at, np.arange(1, m + 1) - sampler.bound)
    below_hi = np.where(lo == 0, hi - one, hi)
    below_lo = lo - one  # wraps to 2^64-1 when lo == 0, with the borrow taken from hi
    below = sampler.from_uniform(below_hi, below_lo)
    np.testing.assert_array_equal(below, np.arange(m) - sampler.bound)
    extremes = sampler.from_uniform(np.array([0, 2**64 - 1], dtype=np.uint64), np.array([0, 2**64 - 1], dtype=np.uint64))
    assert extremes.tolist() == [-sampler.bound, sampler.bound]


def test_sampler_rejects_bad_sigma():
    for bad in (0.0, -1.0, 131072.5, float("nan")):
        with pytest.raises(ValueError):
            DiscreteGaussian(bad)


# --------------------------------------------------------------------------- secret handling

SECRET = "a3f09c1d7e5b2846c0d9e1f7a2b4c6d8e0f1a3b5c7d9e2f4a6b8c0d2e4f6a8b1"  # 256 bits, hex
KEY = bytes.fromhex(SECRET)


def test_secret_from_explicit_file(tmp_path):
    f = tmp_path / "key"
    f.write_bytes(b"  " + SECRET.encode() + b"\n")
    f.chmod(0o600)
    env = {SECRET_FILE_ENV: str(tmp_path / "other"), SECRET_ENV: "00" * 32}
    assert load_noise_secret(str(f), environ=env) == KEY


def test_secret_from_file_env(tmp_path):
    f = tmp_path / "key"
    f.write_bytes(SECRET.encode())
    f.chmod(0o600)
    env = {SECRET_FILE_ENV: str(f), SECRET_ENV: "00" * 32}
    assert load_noise_secret(environ=env) == KEY


def test_secret_from_env():
    assert load_noise_secret(environ={SECRET_ENV: f" {SECRET}\n"}) == KEY


def test_no_secret():
    with pytest.raises(NoiseSecretError) as err:
        load_noise_secret(environ={})
    assert SECRET_ENV in str(err.value)
    with pytest.raises(NoiseSecretError):
        load_noise_secret(environ={SECRET_ENV: "", SECRET_FILE_ENV: ""})


def test_short_secret_message_does_not_leak(tmp_path):
    short = "s3cr3tKEYx"  # 10 bytes < 16
    assert len(short) < MIN_SECRET_BYTES
    with pytest.raises(NoiseSecretError) as err:
        load_noise_secret(environ={SECRET_ENV: short})
    assert short not in str(err.value) and short not in repr(err.value)
    f = tmp_path / "key"
    f.write_text(short + "\n")
    f.chmod(0o600)
    with pytest.raises(NoiseSecretError) as err:
        load_noise_secret(str(f), environ={})
    assert short not in str(err.value)
    # whitespace does not count towards the length
    with pytest.raises(NoiseSecretError):
        load_noise_secret(environ={SECRET_ENV: "     short-ish      "})
    with pytest.raises(NoiseSecretError) as err:
        NodeNoise(short.encode())
    assert short not in str(err.value)


def test_unreadable_secret_file(tmp_path):
    with pytest.raises(NoiseSecretError) as err:
        load_noise_secret(str(tmp_path / "missing"), environ={SECRET_ENV: SECRET})
    assert SECRET not in str(err.value)  # an explicit file does not fall back to the env var
    with pytest.raises(NoiseSecretError) as err:
        load_noise_secret(environ={SECRET_FILE_ENV: str(tmp_path), SECRET_ENV: SECRET})  # a directory
    assert SECRET not in str(err.value)


def _owned_by(monkeypatch, uid: int) -> None:
    """Make the secret file look owned by ``uid`` (root: 0, as the kubelet mounts a Secret; the
    worker's user: 10001, as the Dockerfile runs it), which a test cannot chown to."""
    import os

    real_stat = os.stat

    def stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        return os.stat_result((st.st_mode, *st[1:4], uid, *st[5:]))

    monkeypatch.setattr(os, "stat", stat)


@pytest.mark.parametrize("uid", [10001, 0])
@pytest.mark.parametrize("mode, who", [(0o644, "others"), (0o604, "others"), (0o640, "its group"), (0o620, "its group")])
def test_a_secret_file_other_accounts_may_read_is_refused_naming_it(tmp_path, monkeypatch, uid, mode, who):
    """Whoever reads the secret can remove the noise from every release (docs/threat-model.md):
    a file group or others may read is refused with the fix, and nothing of the secret; a
    root-owned file may be group-read (a Kubernetes Secret mount: next test)."""
    f = tmp_path / "noise.key"
    f.write_text(SECRET + "\n")
    f.chmod(mode)
    _owned_by(monkeypatch, uid)
    if uid == 0 and mode == 0o640:
        assert load_noise_secret(environ={SECRET_FILE_ENV: str(f)}) == KEY
        return
    with pytest.raises(NoiseSecretError) as err:
        load_noise_secret(environ={SECRET_FILE_ENV: str(f)})
    assert str(err.value) == (f"the noise secret file {f} is readable or writable by {who} (mode {mode:04o}): chmod 600 {f}")
    f.chmod(0o400)
    assert load_noise_secret(str(f), environ={}) == KEY


def test_a_kubernetes_secret_mount_is_judged_by_its_target(tmp_path, monkeypatch):
    """A Secret volume is a symlink (noise.key -> ..data/noise.key) to a file the kubelet owns as
    root with the chart's defaultMode 0440 and the pod's fsGroup: group read of a root-owned file
    is accepted (PostgreSQL's rule for its key file), others never; a loose target behind a
    symlink (mode 0777 itself) is refused."""
    data = tmp_path / "..2026_11_27_12_00_00.1" / "noise.key"
    data.parent.mkdir()
    data.write_text(SECRET + "\n")
    (tmp_path / "..data").symlink_to(data.parent.name)
    (tmp_path / "noise.key").symlink_to("..data/noise.key")
    mounted = str(tmp_path / "noise.key")
    _owned_by(monkeypatch, 0)
    data.chmod(0o440)
    assert load_noise_secret(mounted, environ={}) == KEY
    data.chmod(0o444)
    with pytest.raises(NoiseSecretError, match=f"by others \\(mode 0444\\): chmod 600 {mounted}"):
        load_noise_secret(mounted, environ={})


def test_repr_does_not_contain_the_secret():
    nn = NodeNoise(KEY, label="run-7")
    text = repr(nn) + str(nn)
    assert SECRET not in text and KEY.hex() not in text
    for attr in ("_aes_key", "_id_key"):
        assert getattr(nn, attr).hex() not in text
    assert "run-7" in text


def test_pseudonyms_are_keyed_pure_functions_whatever_the_memo_holds(monkeypatch):
    """Key and user pseudonyms depend on the secret and the text only: the same under another
    batching, when the key memo overflows in the middle of a batch that repeats known keys, and
    different under another secret."""
    import dpstream.processor.mechanisms.noise as noise

    monkeypatch.setattr(noise, "KEY_PSEUDONYM_MEMO", 5)
    texts = [f"k{i}" for i in range(12)]
    alone = [int(Pseudonymizer(TEST_SECRET).group_keys([t])[0]) for t in texts]
    pseudo = Pseudonymizer(TEST_SECRET)
    assert pseudo.group_keys(texts[:4]).tolist() == alone[:4]
    # known keys k0..k3 again with enough new ones to overflow the memo
    assert pseudo.group_keys(texts[:4] + texts[4:9] + texts[:2]).tolist() == alone[:9] + alone[:2]
    assert pseudo.group_keys(texts).tolist() == alone
    assert Pseudonymizer(b"another secret, 32 bytes long..!").group_keys(texts).tolist() != alone
    users = ["u1", "u2", "u1", "u3", "u2"]
    one_by_one = [int(Pseudonymizer(TEST_SECRET).users([u])[0]) for u in users]
    assert Pseudonymizer(TEST_SECRET).users(users).tolist() == one_by_one and one_by_one[0] == one_by_one[2]


def test_pseudonyms_are_pinned_to_the_state_format():
    """Stored user states and key ids are keyed by these pseudonyms: a change to how they are
    derived would give every user a fresh contribution budget in an open window of an existing
    state directory. Such a change needs a new STATE_FORMAT (which refuses old state); this
    known-answer test fails first. Values from the BLAKE2b-keyed derivation of 5b3a36f."""
    from dpstream.state.tables import STATE_FORMAT

    pseudo = Pseudonymizer(TEST_SECRET)
    assert STATE_FORMAT == b"5", "a new state format: re-pin the values below"
    assert pseudo.users(["alice", "bob", "ünï"]).tolist() == [12139158927704999413, 1299637599159585057, 7319962425422372639]
    assert pseudo.encoded_users(["alice".encode(), "ünï".encode()]).tolist() == [12139158927704999413, 7319962425422372639]
    assert pseudo.group_keys(["page-1", "ключ"]).tolist() == [14790089320644102342, 5338007936951201107]


def _table(sampler) -> list[int]:
    return [int(h) << 64 | int(lo) for h, lo in zip(sampler._hi.tolist(), sampler._lo.tolist())]


@pytest.mark.parametrize("sigma", [0.3, 0.8, 2.5, 7.3, 129.5, 1000.5])
def test_sampler_table_is_the_floor_of_the_exact_cumulative_law(sigma):
    """Every entry is floor(2^128 P[X <= x]) computed independently: each point's exp(-x^2/2s^2)
    on its own with mpmath at 80 digits (no recursion, no fixed point), so an entry off by one
    unit anywhere in the table fails. The truncation mass and variance agree to float rounding."""
    sampler = DiscreteGaussian(sigma)
    with mpmath.workdps(80):
        s2 = mpmath.mpf(repr(sigma)) ** 2  # sigma as its shortest decimal, as the sampler reads it
        weights = [mpmath.exp(-mpmath.mpf(x) ** 2 / (2 * s2)) for x in range(-sampler.bound, sampler.bound + 1)]
        total = mpmath.fsum(weights)
        expected, running = [], mpmath.mpf(0)
        for w in weights[:-1]:
            running += w
            expected.append(int(mpmath.floor(running * mpmath.mpf(2) ** 128 / total)))
        first_out = mpmath.exp(-mpmath.mpf(sampler.bound + 1) ** 2 / (2 * s2))
        ratio = mpmath.exp(-mpmath.mpf(2 * sampler.bound + 1) / (2 * s2))
        mass = float(2 * first_out / (1 - ratio) / total)
        variance = float(mpmath.fsum(w * x * x for x, w in zip(range(-sampler.bound, sampler.bound + 1), weights)) / total)
    assert _table(sampler) == expected
    assert sampler.truncation_mass == pytest.approx(mass, rel=1e-14)
    assert sampler.variance == pytest.approx(variance, rel=1e-14)


def _decimal_table(sigma: float) -> list[int]:
    """The table as earlier versions built it: the same recursion in 60-digit decimals."""
    from decimal import Decimal, localcontext

    bound = int(np.ceil(12 * sigma)) + 1
    with localcontext() as ctx:
        ctx.prec = 60
        step = (Decimal(-1) / (2 * Decimal(repr(sigma)) ** 2)).exp()
        weights, ratio = [Decimal(1)], step
        for _ in range(bound):
            weights.append(weights[-1] * ratio)
            ratio *= step * step
        scale = Decimal(2) ** 128 / (weights[0] + 2 * sum(weights[1:]))
        cum, running = [], Decimal(0)
        for w in (weights[::-1] + weights[1:])[:-1]:
            running += w
            cum.append(int(running * scale))
    return cum


def test_a_lattice_scale_table_is_the_one_earlier_versions_built():
    """At the BLT's scale (near 2^16; about a million entries) the fixed-point recursion gives
    the 60-digit decimal one's table entry for entry: the noise of a replay is the same before
    and after the faster build."""
    sigma = 40000.0
    assert _table(DiscreteGaussian(sigma)) == _decimal_table(sigma)


@pytest.mark.parametrize("sigma", [3.0, 129.5, 40000.0])
def test_sampler_lookup_equals_a_plain_search_at_any_table_size(sigma):
    """The guide table grows with the table (lattice counters sample at scales near 65,536);
    whatever its size a uniform u maps to x_k with k = #{j : cum[j] <= u}, the plain 128-bit
    search, including u equal to a table entry in its high word."""
    sampler = DiscreteGaussian(sigma)
    rng = np.random.default_rng(7)
    hi = rng.integers(0, 1 << 63, size=200_000, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, size=200_000, dtype=np.uint64)
    lo = rng.integers(0, 1 << 63, size=200_000, dtype=np.uint64)
    hi[:50], lo[:50] = sampler._hi[::max(1, len(sampler._hi) // 50)][:50], sampler._lo[::max(1, len(sampler._hi) // 50)][:50]
    cum = [int(h) << 64 | int(l) for h, l in zip(sampler._hi.tolist(), sampler._lo.tolist())]
    import bisect
    got = sampler.from_uniform(hi, lo)
    for i in list(range(50)) + rng.integers(50, 200_000, size=2000).tolist():
        u = int(hi[i]) << 64 | int(lo[i])
        assert got[i] == bisect.bisect_right(cum, u) - sampler.bound


@pytest.mark.parametrize("command", [
    ["replay", "--config", "examples/worker.yaml", "--input", "examples/events.jsonl", "--output", "{tmp}/out.jsonl",
     "--start", "2026-01-01", "--until", "2026-01-01T01:00:00Z"],
    ["worker", "--config", "examples/worker.yaml", "--state-dir", "{tmp}/state", "--broker", "127.0.0.1:9"],
    ["demo", "--output-dir", "{tmp}/demo"],
])
def test_replay_worker_and_demo_refuse_a_world_readable_key_file_in_one_line(tmp_path, command):
    """`chmod 600` is the fix the line names; nothing is written (no output, no state, no broker
    asked: the worker's broker address here answers nothing)."""
    import subprocess

    from tests.conftest import ROOT

    key = tmp_path / "noise.key"
    key.write_text(SECRET + "\n")
    key.chmod(0o644)
    argv = [str(ROOT / ".venv/bin/dpstream"), *[a.format(tmp=tmp_path) for a in command], "--noise-key-file", str(key)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"dpstream: the noise secret file {key} is readable or writable by others (mode 0644): "
                                        f"chmod 600 {key}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noise.key"]
