"""Deterministic, secret-keyed integer noise for tree nodes (DESIGN.md section 5).

Every node of every DP tree gets its noise from a keyed pseudo-random function of its identity
``(query, window, key, tree kind, round, node)``. Recomputing a tree after a restart, a
rebalance, a replay, or inside release prediction (DP-SQLP Algorithm 4) therefore sees exactly
the noise of the original run, and no released node's noise is ever drawn twice. State holds no
noise at all.

Construction:

* ``tree_id = BLAKE2b-96(key = K_id, encode(query, window, key, kind, round))`` once per tree;
* one 128-bit uniform per node: ``AES-128_{K_aes}(tree_id || node_id)`` (AES as a PRF on
  distinct inputs), computed for millions of nodes in one ECB call;
* the uniform is mapped to an integer by a 128-bit cumulative distribution table (CDT) of the
  discrete Gaussian N_Z(0, sigma^2) (Canonne, Kamath, Steinke 2020), built once per sigma in
  exact high-precision arithmetic and looked up with integer comparisons only.

No floating point touches a sample, so the Mironov (2012) low-order-bit attack on floating point
Laplace/Gaussian samplers does not apply: outputs are exact integers whose distribution is the
table's. The table covers ``|x| <= 12 sigma + 1`` (outside mass < 2^-103) and quantizes each
probability to 2^-128, so it is within ``SAMPLER_TV_BOUND`` (2^-100) of the exact discrete
Gaussian; the accountant charges that to delta.

``K_aes`` and ``K_id`` are derived from the secret with BLAKE2b. The secret comes from a file or
the ``DPSTREAM_NOISE_KEY`` environment variable, never from code, config or logs.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from decimal import Decimal, localcontext
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from accountant.plan import MAX_SAMPLER_SIGMA, SAMPLER_TV_BOUND

SECRET_ENV = "DPSTREAM_NOISE_KEY"
SECRET_FILE_ENV = "DPSTREAM_NOISE_KEY_FILE"
MIN_SECRET_BYTES = 16
#: Node ids are ``level << LEVEL_SHIFT | index``: up to 2^24 leaves per tree.
LEVEL_SHIFT = 24
TAIL_SIGMAS = 12.0
GUIDE_BITS = 16

_NODE_BLOCK = np.dtype([("tree", "S12"), ("node", "<u4")])


class NoiseSecretError(RuntimeError):
    """The noise secret is missing or unusable. The message never contains the secret."""


def load_noise_secret(path: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> bytes:
    """Read the noise secret: ``path`` if given, else ``$DPSTREAM_NOISE_KEY_FILE``, else
    ``$DPSTREAM_NOISE_KEY``. At least 16 bytes (after stripping surrounding whitespace)."""
    source = path or environ.get(SECRET_FILE_ENV)
    if source:
        try:
            secret = Path(source).read_bytes().strip()
        except OSError as exc:
            raise NoiseSecretError(f"cannot read the noise secret file {source}: {exc.strerror}") from None
        where = f"file {source}"
    elif environ.get(SECRET_ENV):
        secret = environ[SECRET_ENV].strip().encode("utf-8")
        where = f"${SECRET_ENV}"
    else:
        raise NoiseSecretError(
            f"no noise secret: set {SECRET_ENV} or {SECRET_FILE_ENV} (or pass --noise-key-file). "
            "Releasing data needs it; `dpstream plan` does not."
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise NoiseSecretError(f"the noise secret in {where} is shorter than {MIN_SECRET_BYTES} bytes")
    return secret


@dataclass(frozen=True)
class TreeIdentity:
    """The public identity of one DP tree; with a node id it names one noise value."""

    query: str
    window_start: int
    key: str
    kind: str  # "select" or "perturb:<column>"
    round: int = 0

    def encode(self) -> bytes:
        return _tree_prefix(self.query, self.window_start, self.kind) + _tree_suffix(self.key, self.round)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def _tree_prefix(query: str, window_start: int, kind: str) -> bytes:
    return _field(query.encode()) + _field(str(int(window_start)).encode()) + _field(kind.encode())


def _tree_suffix(key: str, round_: int) -> bytes:
    return _field(key.encode()) + _field(str(int(round_)).encode())


class DiscreteGaussian:
    """Table sampler for N_Z(0, sigma^2): integers x with P[x] proportional to exp(-x^2 / 2 sigma^2).

    ``cum[j] = floor(2^128 * P[X <= x_j])`` for the support ``x_0 < ... < x_{m-1}``; a 128-bit
    uniform u maps to ``x_k`` with ``k = #{j : cum[j] <= u}``, so ``P[x_k] = (cum[k] - cum[k-1])
    / 2^128`` exactly. Probabilities are computed with 60-digit decimals through the recursion
    ``p(x+1) = p(x) * exp(-(2x+1) / 2 sigma^2)`` (two multiplications per entry).
    """

    def __init__(self, sigma: float):
        if not (0 < sigma <= MAX_SAMPLER_SIGMA):
            raise ValueError(f"sigma must be in (0, {MAX_SAMPLER_SIGMA}], got {sigma}")
        self.sigma = float(sigma)
        self.bound = int(np.ceil(TAIL_SIGMAS * sigma)) + 1
        with localcontext() as ctx:
            ctx.prec = 60
            s2 = Decimal(repr(self.sigma)) ** 2
            step = (Decimal(-1) / (2 * s2)).exp()  # exp(-1 / 2 sigma^2)
            step2 = step * step
            weights = [Decimal(1)]
            ratio = step
            for _ in range(self.bound):
                weights.append(weights[-1] * ratio)
                ratio *= step2
            total = weights[0] + 2 * sum(weights[1:])
            scale = Decimal(2) ** 128 / total
            # symmetric support -bound..bound; cumulative from the left
            one_sided = weights[::-1] + weights[1:]
            cum, running = [], Decimal(0)
            for w in one_sided[:-1]:
                running += w
                cum.append(int(running * scale))
            # Mass outside the support relative to the untruncated law: bounded by a geometric
            # series of ratio exp(-(2B+1)/2 sigma^2) starting at the first excluded point.
            outside = weights[-1] * ratio / (1 - ratio) * 2 / total if ratio < 1 else Decimal(1)
            self.truncation_mass = float(outside)
            self.variance = float(sum(2 * (x * x) * w for x, w in enumerate(weights)) / total)
        self.tv_bound = self.truncation_mass + len(one_sided) * 2.0 ** -128
        if self.tv_bound > SAMPLER_TV_BOUND:
            raise AssertionError(f"sampler table for sigma={sigma} misses the accountant's TV bound")
        self._hi = np.array([c >> 64 for c in cum], dtype=np.uint64)
        self._lo = np.array([c & ((1 << 64) - 1) for c in cum], dtype=np.uint64)

        # Guide table over the top GUIDE_BITS of the high word: a bucket holding no table
        # entry decides the sample with one lookup; the few others fall back to a search.
        edges = np.arange(1 << GUIDE_BITS, dtype=np.uint64) << np.uint64(64 - GUIDE_BITS)
        first = np.searchsorted(self._hi, edges, side="left")
        self._guide = first.astype(np.int64)
        self._guide_next = np.append(first[1:], len(self._hi)).astype(np.int64)

    def from_uniform(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Map 128-bit uniforms (hi, lo words) to samples, with integer comparisons only."""
        bucket = (hi >> np.uint64(64 - GUIDE_BITS)).astype(np.int64)
        index = self._guide[bucket]
        open_ = np.nonzero(self._guide_next[bucket] != index)[0]
        if len(open_):
            h = hi[open_]
            left = np.searchsorted(self._hi, h, side="left")
            right = np.searchsorted(self._hi, h, side="right")
            index[open_] = left
            # hi equals a table word: resolve with the low word (probability ~ m * 2^-64 per draw)
            for t in np.nonzero(right != left)[0]:
                a, b = int(left[t]), int(right[t])
                index[open_[t]] = a + int(np.searchsorted(self._lo[a:b], lo[open_[t]], side="right"))
        return index - self.bound

    def pmf(self, x: np.ndarray) -> np.ndarray:
        """Exact probabilities of the table (for tests), as floats."""
        hi = self._hi.astype(object)
        lo = self._lo.astype(object)
        cum = [0] + [int(h) << 64 | int(l) for h, l in zip(hi, lo)] + [1 << 128]
        probs = np.array([(cum[k + 1] - cum[k]) / float(1 << 128) for k in range(len(cum) - 1)])
        idx = np.asarray(x) + self.bound
        out = np.zeros(np.shape(x))
        ok = (idx >= 0) & (idx < len(probs))
        out[ok] = probs[idx[ok]]
        return out


@lru_cache(maxsize=32)
def discrete_gaussian(sigma: float) -> DiscreteGaussian:
    """Shared, cached sampler table per sigma (tables are immutable)."""
    return DiscreteGaussian(sigma)


def node_ids(levels: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Encode (level, index) pairs as 32-bit node ids."""
    return (np.asarray(levels, dtype=np.uint32) << np.uint32(LEVEL_SHIFT)) | np.asarray(indices, dtype=np.uint32)


def derive_key(secret: bytes, label: bytes, size: int = 32) -> bytes:
    """Domain-separated subkey of the noise secret (BLAKE2b as a PRF)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise NoiseSecretError(f"the noise secret is shorter than {MIN_SECRET_BYTES} bytes")
    master = hashlib.blake2b(secret, digest_size=64, person=b"dpstream-master").digest()
    return hashlib.blake2b(label, key=master, digest_size=size).digest()


class Pseudonymizer:
    """Keyed 64-bit pseudonyms for user ids and group-by keys, used as state keys.

    State never holds raw user ids. Two users colliding (probability ~ n^2 / 2^65) would share a
    contribution budget: less data, never more privacy loss.
    """

    def __init__(self, secret: bytes):
        self._user_key = derive_key(secret, b"user pseudonym v1")
        self._group_key = derive_key(secret, b"group key pseudonym v1")
        self._int_cipher = Cipher(algorithms.AES(derive_key(secret, b"integer user pseudonym v1", 16)), modes.ECB())

    def users(self, users: Iterable[str]) -> np.ndarray:
        key = self._user_key
        return np.fromiter(
            (int.from_bytes(hashlib.blake2b(u.encode(), key=key, digest_size=8).digest(), "little") for u in users), dtype=np.uint64
        )

    def integer_users(self, ids: np.ndarray) -> np.ndarray:
        """Vectorized pseudonyms for integer user ids (AES on the id)."""
        blocks = np.zeros((len(ids), 2), dtype="<u8")
        blocks[:, 0] = ids
        enc = self._int_cipher.encryptor()
        raw = enc.update(blocks.tobytes()) + enc.finalize()
        return np.frombuffer(raw, dtype="<u8")[0::2].copy()

    def group_keys(self, keys: Iterable[str]) -> np.ndarray:
        key = self._group_key
        return np.fromiter(
            (int.from_bytes(hashlib.blake2b(k.encode(), key=key, digest_size=8).digest(), "little") for k in keys), dtype=np.uint64
        )


class NodeNoise:
    """Keyed PRF from (tree identity, node id) to integer noise; vectorized over nodes."""

    def __init__(self, secret: bytes):
        self._aes_key = derive_key(secret, b"node-noise aes-128 v1", 16)
        self._id_key = derive_key(secret, b"tree identity v1")
        #: A public, non-reversible fingerprint of the secret (names a budget epoch).
        self.fingerprint = derive_key(secret, b"epoch fingerprint v1", 8).hex()
        self._cipher = Cipher(algorithms.AES(self._aes_key), modes.ECB())

    def __repr__(self) -> str:  # never print key material
        return f"NodeNoise(fingerprint={self.fingerprint})"

    def tree_id(self, identity: TreeIdentity) -> bytes:
        return hashlib.blake2b(identity.encode(), key=self._id_key, digest_size=12).digest()

    def tree_ids(self, identities: Iterable[TreeIdentity]) -> np.ndarray:
        return np.array([self.tree_id(i) for i in identities], dtype="S12")

    def tree_ids_for(self, query: str, window_start: int, kind: str, keys: Sequence[str], rounds: Sequence[int]) -> np.ndarray:
        """``tree_ids`` of (query, window, kind, key_j, round_j) for many keys, hashing the shared
        prefix once (same ids as :meth:`tree_id`)."""
        base = hashlib.blake2b(key=self._id_key, digest_size=12)
        base.update(_tree_prefix(query, window_start, kind))
        out = np.empty(len(keys), dtype="S12")
        for j, (key, round_) in enumerate(zip(keys, rounds)):
            h = base.copy()
            h.update(_tree_suffix(key, round_))
            out[j] = h.digest()
        return out

    def uniforms(self, trees: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """128-bit PRF outputs for each (tree id, node id) pair, as (hi, lo) uint64 words."""
        blocks = np.empty(len(nodes), dtype=_NODE_BLOCK)
        blocks["tree"] = trees
        blocks["node"] = nodes
        encryptor = self._cipher.encryptor()
        raw = encryptor.update(blocks.tobytes()) + encryptor.finalize()
        words = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
        return np.ascontiguousarray(words[:, 0]), np.ascontiguousarray(words[:, 1])

    def sample(self, sampler: DiscreteGaussian, trees: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Integer noise for each (tree, node); identical on every call with the same secret."""
        if len(nodes) == 0:
            return np.zeros(0, dtype=np.int64)
        hi, lo = self.uniforms(trees, nodes)
        return sampler.from_uniform(hi, lo)
