"""Deterministic, secret-keyed integer noise for tree nodes (docs/privacy.md, "Noise").

Every node of every DP tree gets its noise from a keyed pseudo-random function of its identity
``(run label, query, window, key, tree kind, round, node)``. Recomputing a tree after a restart,
a rebalance, or inside release prediction (DP-SQLP Algorithm 4) therefore sees exactly the noise
of the original run, and no released node's noise is ever drawn twice. State holds no noise.

Construction:

* keys ``K_aes`` and ``K_id`` are derived from the secret *and the run label* with BLAKE2b: a
  replay on a fresh state directory gets a fresh random label (so re-running on slightly
  different data does not publish the exact difference of two runs under the same noise), the
  worker's label names its application and budget epoch;
* ``tree_id = BLAKE2b-128(key = K_id, encode(query, window, key, kind, round))`` once per tree:
  128 bits, so two trees sharing all their noise would take ~2^64 trees;
* one 128-bit uniform per node: ``AES_{K_aes}(AES_{K_aes}(tree_id) XOR node_block)``, the CBC-MAC
  of the fixed-length two-block message (tree_id, node_block), a PRF on such messages; the first
  block is encrypted once per tree, and millions of nodes go through one ECB call;
* the uniform is mapped to an integer by a 128-bit cumulative distribution table (CDT) of the
  discrete Gaussian N_Z(0, sigma^2) (Canonne, Kamath, Steinke 2020), built once per sigma in
  exact high-precision arithmetic and looked up with integer comparisons only.

No floating point touches a sample, so the Mironov (2012) low-order-bit attack on floating point
Laplace/Gaussian samplers does not apply: outputs are exact integers whose distribution is the
table's. The table covers ``|x| <= 12 sigma + 1`` (outside mass < 2^-103) and quantizes each
probability to 2^-128, so it is within ``SAMPLER_TV_BOUND`` (2^-100) of the exact discrete
Gaussian; the accountant charges that to delta.

The secret comes from a file or the ``DPSTREAM_NOISE_KEY`` environment variable, never from code,
config or logs, as hex or base64 text (or raw bytes) of at least 128 bits
(:func:`load_noise_secret`). Nothing prints it; the public *fingerprint* that names a budget
epoch is derived through scrypt, so it does not help anyone guess the secret.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from decimal import Decimal, localcontext
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Optional, Protocol, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpstream.accountant.plan import MAX_SAMPLER_SIGMA, SAMPLER_TV_BOUND

SECRET_ENV = "DPSTREAM_NOISE_KEY"
SECRET_FILE_ENV = "DPSTREAM_NOISE_KEY_FILE"
MIN_SECRET_BYTES = 16
#: Bytes of a tree id (a BLAKE2b-128 digest).
TREE_ID_BYTES = 16
TREE_ID_DTYPE = f"S{TREE_ID_BYTES}"
#: Node ids are ``level << LEVEL_SHIFT | index``: up to 2^24 leaves per tree.
LEVEL_SHIFT = 24
TAIL_SIGMAS = 12.0
GUIDE_BITS = 16
#: Fraction bits of the sampler tables' fixed-point weights (DiscreteGaussian).
FRACTION_BITS = 256
#: scrypt cost of the public fingerprint (about 30 ms; 16 MiB of memory)
FINGERPRINT_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}

_HEX = re.compile(rb"[0-9A-Fa-f]+")
_BASE64 = re.compile(rb"[A-Za-z0-9+/_-]+={0,2}")


class NoiseSecretError(RuntimeError):
    """The noise secret is missing or unusable. The message never contains the secret."""


def load_noise_secret(path: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> bytes:
    """Read the noise secret: ``path`` if given, else ``$DPSTREAM_NOISE_KEY_FILE``, else
    ``$DPSTREAM_NOISE_KEY``, and decode it (:func:`decode_secret`)."""
    source = path or environ.get(SECRET_FILE_ENV)
    if source:
        try:
            raw = Path(source).read_bytes()
            check_secret_file_mode(source)
        except OSError as exc:
            raise NoiseSecretError(f"cannot read the noise secret file {source}: {exc.strerror}") from None
        where = f"file {source}"
    elif environ.get(SECRET_ENV):
        raw = environ[SECRET_ENV].encode("utf-8")
        where = f"${SECRET_ENV}"
    else:
        raise NoiseSecretError(
            f"no noise secret: set {SECRET_ENV} or {SECRET_FILE_ENV} (or pass --noise-key-file). "
            "Releasing data needs it; `dpstream plan` does not. Make one with: dpstream keygen --out noise.key"
        )
    return decode_secret(raw, where)


def check_secret_file_mode(path: str) -> None:
    """Refuse a noise secret file that other accounts may read: whoever reads it can remove the
    noise from every release (docs/threat-model.md). The rule is PostgreSQL's for its TLS key
    (``ssl_key_file``): owned by the reader, no access for group or others (0600, 0400); owned by
    root, group read is allowed (0640, 0440), which is how Kubernetes mounts a Secret volume with
    an fsGroup (the chart's defaultMode 0440: root-owned, the pod's group). ``os.stat`` follows
    symlinks, so a Secret's ``..data/`` link is judged by its target. Others never."""
    st = os.stat(path)
    loose = st.st_mode & (0o077 if st.st_uid != 0 else 0o037)
    if loose:
        raise NoiseSecretError(f"the noise secret file {path} is readable or writable by "
                               f"{'others' if loose & 0o007 else 'its group'} (mode {st.st_mode & 0o777:04o}): "
                               f"chmod 600 {path}")


def decode_secret(raw: bytes, where: str = "the secret") -> bytes:
    """Key material from the text of a secret file or variable.

    Accepted: hex (what ``dpstream keygen`` writes, the documented format), padded base64
    (standard or URL-safe), or raw binary bytes, decoding to at least 16 bytes (128 bits). Refused: anything shorter, text that is neither hex nor base64 (a
    passphrase is not key material), and keys of low variety (few distinct bytes, or bytes that
    are all printable text, as when a password is hex-encoded). Messages name ``where`` and never
    the content."""
    text = raw.strip()
    if text and all(32 <= b < 127 for b in text):
        if _HEX.fullmatch(text) and len(text) % 2 == 0:
            key, form = bytes.fromhex(text.decode()), "hex"
        elif _BASE64.fullmatch(text) and len(text) % 4 == 0 and _mixed_case(text):
            standard = text.replace(b"-", b"+").replace(b"_", b"/")
            try:
                key = base64.b64decode(standard, validate=True)
            except (binascii.Error, ValueError):
                raise NoiseSecretError(f"the noise secret in {where} is not valid base64") from None
            if base64.b64encode(key) != standard:
                raise NoiseSecretError(f"the noise secret in {where} is not canonical base64")
            form = "base64"
        else:
            # padded base64 of random bytes has both cases (a 16-byte key misses one w.p. ~1e-5);
            # words typed by a person usually do not, or are not a multiple of 4 long
            raise NoiseSecretError(f"the noise secret in {where} is neither hex nor padded base64 of random bytes: a "
                                   f"passphrase is not key material; make one with dpstream keygen --out noise.key")
    else:
        key, form = raw, "raw bytes"
    if len(key) < MIN_SECRET_BYTES:
        raise NoiseSecretError(f"the noise secret in {where} ({form}) holds {len(key)} bytes; at least {MIN_SECRET_BYTES} "
                               f"(128 bits) are required")
    if len(set(key)) < min(len(key), 16) // 2 or (len(key) <= 32 and all(32 <= b < 127 for b in key)):
        raise NoiseSecretError(f"the noise secret in {where} ({form}) has too little variety to be random key material")
    return key


def _mixed_case(text: bytes) -> bool:
    return any(65 <= b <= 90 for b in text) and any(97 <= b <= 122 for b in text)


@lru_cache(maxsize=8)
def secret_fingerprint(secret: bytes) -> str:
    """A public name for a secret (it names a budget epoch): scrypt, so that it is useless for
    testing guesses of the secret, and 8 bytes long."""
    return hashlib.scrypt(secret, salt=b"dpstream epoch fingerprint v2", dklen=8, maxmem=64 * 1024 * 1024,
                          **FINGERPRINT_SCRYPT).hex()


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
    / 2^128`` exactly.

    The weights ``w_x = exp(-x^2 / 2 sigma^2)`` come from the recursion ``w_{x+1} = w_x * r_x``,
    ``r_{x+1} = r_x * exp(-1 / sigma^2)`` in binary fixed point with ``FRACTION_BITS`` fraction
    bits (Python integers, truncating). ``r_x`` is off by at most ``x`` units of the last place
    and ``w_x`` by at most ``x^2``, so a cumulative sum by less than ``m^3`` units (m < 2^21
    entries on a side for the largest sigma) and ``2^128 S / total`` by less than 2^-64: its
    floor is the exact one unless the exact value lies that close to an integer. It is never an
    integer itself (the weights are exponentials of distinct rationals: Lindemann-Weierstrass),
    so the right half mirrors the left with no remainder to check: ``cum`` at ``x`` is
    ``2^128 - floor(2^128 S(-x-1) / total) - 1``, one integer division per entry of the left
    half. (Earlier versions built the same table from 60-digit decimals, up to 5x slower:
    tests/test_noise.py checks the two agree entry by entry.)
    """

    def __init__(self, sigma: float):
        if not (0 < sigma <= MAX_SAMPLER_SIGMA):
            raise ValueError(f"sigma must be in (0, {MAX_SAMPLER_SIGMA}], got {sigma}")
        self.sigma = float(sigma)
        self.bound = bound = int(np.ceil(TAIL_SIGMAS * sigma)) + 1
        one = 1 << FRACTION_BITS
        with localcontext() as ctx:
            ctx.prec = 100  # decimal digits: more than FRACTION_BITS bits
            s2 = Decimal(repr(self.sigma)) ** 2
            step = (Decimal(-1) / (2 * s2)).exp()  # exp(-1 / 2 sigma^2)
            step_fixed, step2_fixed = int(step * one), int(step * step * one)
        # weights[x] for x = 0..bound, and the sum of x^2 w_x (for the table's variance)
        weights = [one]
        append = weights.append
        w, ratio, second_moment = one, step_fixed, 0
        for x in range(1, bound + 1):
            w = (w * ratio) >> FRACTION_BITS
            append(w)
            second_moment += x * x * w
            ratio = (ratio * step2_fixed) >> FRACTION_BITS
        total = 2 * sum(weights) - one
        # the left half, x = -bound..0, then the right one, x = 1..bound-1, by symmetry
        cum, running = [], 0
        for w in reversed(weights):
            running += w
            cum.append((running << 128) // total)
        top = (1 << 128) - 1
        if cum[-1] > top:  # weights below 2^-256 truncated to 0 (sigma < 0.05): S(0) < total still
            cum = [min(q, top) for q in cum]
        cum += [top - q for q in cum[bound - 2::-1]]
        self.variance = 2 * second_moment / total
        with localcontext() as ctx:
            # Mass outside the support relative to the untruncated law: bounded by a geometric
            # series of ratio exp(-(2B+1)/2 sigma^2) starting at the first excluded point.
            ctx.prec = 60
            first_out = (-Decimal((bound + 1) ** 2) / (2 * s2)).exp()
            ratio_out = (-Decimal(2 * bound + 1) / (2 * s2)).exp()
            self.truncation_mass = float(first_out / (1 - ratio_out) * 2 / (Decimal(total) / one))
        words = np.frombuffer(b"".join([c.to_bytes(16, "little") for c in cum]), dtype="<u8").reshape(-1, 2)
        self._index(words[:, 1].astype(np.uint64), words[:, 0].astype(np.uint64))

    @classmethod
    def from_words(cls, sigma: float, hi: np.ndarray, lo: np.ndarray, variance: float, truncation_mass: float
                   ) -> "DiscreteGaussian":
        """The table of ``sigma`` as :meth:`words` gave it (kept between processes:
        dpstream.state.noise_tables), without building it again. Its shape is checked here, its
        contents by the store that kept them."""
        table = cls.__new__(cls)
        table.sigma = float(sigma)
        table.bound = int(np.ceil(TAIL_SIGMAS * table.sigma)) + 1
        if not (0 < table.sigma <= MAX_SAMPLER_SIGMA) or len(hi) != 2 * table.bound or len(lo) != len(hi):
            raise ValueError(f"a sampler table for sigma={sigma} has {len(hi)} entries, not {2 * table.bound}")
        table.variance, table.truncation_mass = float(variance), float(truncation_mass)
        table._index(np.asarray(hi, dtype=np.uint64), np.asarray(lo, dtype=np.uint64))
        return table

    def words(self) -> dict:
        """What :meth:`from_words` takes: the cumulative table's high and low 64-bit words, its
        variance and its truncated mass."""
        return {"sigma": self.sigma, "hi": self._hi, "lo": self._lo, "variance": self.variance,
                "truncation_mass": self.truncation_mass}

    def _index(self, hi: np.ndarray, lo: np.ndarray) -> None:
        """Take the cumulative table (its words) and build the guide table to search it."""
        self.tv_bound = self.truncation_mass + (2 * self.bound + 1) * 2.0 ** -128  # each point quantized to 2^-128
        if self.tv_bound > SAMPLER_TV_BOUND:
            raise AssertionError(f"sampler table for sigma={self.sigma} misses the accountant's TV bound")
        self._hi, self._lo = hi, lo

        # Guide table over the top bits of the high word: a bucket holding no table entry
        # decides the sample with one lookup; the few others fall back to a search. At least
        # GUIDE_BITS, and about twice as many buckets as entries for large tables (the lattice
        # counters' scales), so that most draws still take the lookup (at most 2^22 buckets).
        self._guide_bits = min(22, max(GUIDE_BITS, len(self._hi).bit_length() + 1))
        # edges[b] = #{j : hi_j < b 2^(64 - bits)} = #{j : bucket of hi_j < b}: counts, summed.
        # Bucket b's entries are edges[b]:edges[b+1], read side by side (one cache line, where
        # two tables of starts and ends cost two misses per draw)
        buckets = (self._hi >> np.uint64(64 - self._guide_bits)).astype(np.int64)
        through = np.cumsum(np.bincount(buckets, minlength=1 << self._guide_bits))
        dtype = np.int64 if len(self._hi) >= 1 << 31 else np.int32
        self._bucket_edges = np.concatenate(([0], through)).astype(dtype)

    def from_uniform(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Map 128-bit uniforms (hi, lo words) to samples, with integer comparisons only. The
        sample is ``x_k`` with ``k = #{j : cum[j] <= u}``, however the guide table is sized
        (compiled: dpstream.processor.mechanisms.kernels.table_lookup, the same count)."""
        from dpstream.processor.mechanisms import kernels

        compiled = kernels.table_lookup(hi, lo, self._hi, self._lo, self._bucket_edges, self._guide_bits)
        if compiled is not None:
            return compiled - self.bound
        bucket = (hi >> np.uint64(64 - self._guide_bits)).astype(np.int64)
        index = self._bucket_edges[bucket].astype(np.int64)
        open_ = np.nonzero(self._bucket_edges[bucket + 1] != index)[0]
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


class TableKeeper(Protocol):
    """Where built sampler tables are kept between processes (dpstream.state.noise_tables)."""

    def load(self, sigma: float) -> Optional[DiscreteGaussian]: ...

    def save(self, table: DiscreteGaussian) -> None: ...


#: the keeper of this process's tables, if any (:func:`keep_tables_in`)
_keeper: Optional[TableKeeper] = None


def keep_tables_in(keeper: Optional[TableKeeper]) -> None:
    """Load each sampler table from ``keeper`` before building it, and give it every table
    built (the worker: its state directory; None: build every table in this process)."""
    global _keeper
    _keeper = keeper


@lru_cache(maxsize=32)
def _cached_table(sigma: float) -> DiscreteGaussian:
    keeper = _keeper
    table = keeper.load(sigma) if keeper is not None else None
    if table is None:
        table = DiscreteGaussian(sigma)
        if keeper is not None:
            keeper.save(table)
    return table


_TABLE_LOCKS: dict[float, threading.Lock] = {}
_TABLE_LOCKS_LOCK = threading.Lock()


def discrete_gaussian(sigma: float) -> DiscreteGaussian:
    """Shared, cached sampler table per sigma (tables are immutable). Built once even when two
    threads ask at the same time: a worker's first trigger waits for the table its start began
    building off the event loop (ContinualCounter.prepare) rather than build a second one."""
    sigma = float(sigma)
    with _TABLE_LOCKS_LOCK:
        lock = _TABLE_LOCKS.setdefault(sigma, threading.Lock())
    with lock:
        return _cached_table(sigma)


def node_ids(levels: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Encode (level, index) pairs as 32-bit node ids."""
    return (np.asarray(levels, dtype=np.uint32) << np.uint32(LEVEL_SHIFT)) | np.asarray(indices, dtype=np.uint32)


def derive_key(secret: bytes, label: bytes, size: int = 32) -> bytes:
    """Domain-separated subkey of the noise secret (BLAKE2b as a PRF)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise NoiseSecretError(f"the noise secret is shorter than {MIN_SECRET_BYTES} bytes")
    master = hashlib.blake2b(secret, digest_size=64, person=b"dpstream-master").digest()
    return hashlib.blake2b(label, key=master, digest_size=size).digest()


#: distinct key texts whose pseudonyms a Pseudonymizer remembers (about 150 bytes each)
KEY_PSEUDONYM_MEMO = 1_000_000


class Pseudonymizer:
    """Keyed 64-bit pseudonyms for user ids and group-by keys, used as state keys.

    State never holds raw user ids. Two users colliding (probability ~ n^2 / 2^65) would share a
    contribution budget: less data, never more privacy loss.
    """

    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_BYTES:
            raise NoiseSecretError(f"the noise secret is shorter than {MIN_SECRET_BYTES} bytes")
        # keyed BLAKE2b states, copied per id: a copy skips the key block's compression, about
        # a third of a keyed hash of a short id (the same digests)
        self._user_hash = hashlib.blake2b(key=derive_key(secret, b"user pseudonym v1"), digest_size=8)
        self._group_hash = hashlib.blake2b(key=derive_key(secret, b"group key pseudonym v1"), digest_size=8)
        self._int_cipher = Cipher(algorithms.AES(derive_key(secret, b"integer user pseudonym v1", 16)), modes.ECB())
        self._key_memo: dict[str, int] = {}

    def __repr__(self) -> str:  # never print key material
        return "Pseudonymizer()"

    def users(self, users: Iterable[str]) -> np.ndarray:
        """Keyed pseudonyms of user ids (BLAKE2b keyed, 64 bits); a user's records usually come
        together, so each distinct id of the batch is hashed once."""
        return self.encoded_users(list(map(str.encode, users)))

    def encoded_users(self, users: Sequence[bytes]) -> np.ndarray:
        """:meth:`users` of ids given UTF-8 encoded (Kafka message keys are)."""
        distinct = list(dict.fromkeys(users))
        digests = np.frombuffer(b"".join(map(self._keyed_digest(self._user_hash), distinct)), dtype="<u8")
        if len(distinct) == len(users):
            return digests.astype(np.uint64)
        position = dict(zip(distinct, range(len(distinct))))
        return digests[np.fromiter(map(position.__getitem__, users), dtype=np.int64, count=len(users))].astype(np.uint64)

    @staticmethod
    def _keyed_digest(keyed):
        copy = keyed.copy

        def digest(raw: bytes) -> bytes:
            h = copy()
            h.update(raw)
            return h.digest()
        return digest

    def integer_users(self, ids: np.ndarray) -> np.ndarray:
        """Vectorized pseudonyms for integer user ids (AES on the id)."""
        blocks = np.zeros((len(ids), 2), dtype="<u8")
        blocks[:, 0] = ids
        enc = self._int_cipher.encryptor()
        raw = enc.update(blocks.tobytes()) + enc.finalize()
        return np.frombuffer(raw, dtype="<u8")[0::2].copy()

    def group_keys(self, keys: Iterable[str]) -> np.ndarray:
        """Keyed pseudonyms of key texts. Group-by keys repeat across records and batches, so the
        pseudonyms of the last :data:`KEY_PSEUDONYM_MEMO` distinct texts are remembered (a key's
        pseudonym is a pure function of the secret and the text)."""
        keys = keys if isinstance(keys, list) else list(keys)
        memo, digest = self._key_memo, self._keyed_digest(self._group_hash)
        distinct = dict.fromkeys(keys)
        missing = [k for k in distinct if k not in memo]
        if len(memo) + len(missing) > KEY_PSEUDONYM_MEMO:
            memo.clear()  # forget the others, never this batch's own keys
            missing = list(distinct)
        for k in missing:
            memo[k] = int.from_bytes(digest(k.encode()), "little")
        return np.fromiter(map(memo.__getitem__, keys), dtype=np.uint64, count=len(keys))


class NodeNoise:
    """Keyed PRF from (tree identity, node id) to integer noise; vectorized over nodes.

    ``label`` names the run (docs/privacy.md): the same secret under two labels gives
    independent noise."""

    def __init__(self, secret: bytes, label: str = ""):
        if len(secret) < MIN_SECRET_BYTES:
            raise NoiseSecretError(f"the noise secret is shorter than {MIN_SECRET_BYTES} bytes")
        tag = b"|label=" + label.encode()
        self.label = label
        self._aes_key = derive_key(secret, b"node-noise aes-128 v2" + tag, 16)
        self._id_key = derive_key(secret, b"tree identity v2" + tag)
        self._fingerprint_of = secret  # only for the lazily computed public fingerprint
        self._cipher = Cipher(algorithms.AES(self._aes_key), modes.ECB())

    @property
    def fingerprint(self) -> str:
        """A public, non-reversible fingerprint of the secret (names a budget epoch)."""
        return secret_fingerprint(self._fingerprint_of)

    def __repr__(self) -> str:  # never print key material
        return f"NodeNoise(label={self.label!r})"

    def tree_id(self, identity: TreeIdentity) -> bytes:
        return hashlib.blake2b(identity.encode(), key=self._id_key, digest_size=TREE_ID_BYTES).digest()

    def tree_ids(self, identities: Iterable[TreeIdentity]) -> np.ndarray:
        return np.array([self.tree_id(i) for i in identities], dtype=TREE_ID_DTYPE)

    def tree_ids_for(self, query: str, window_start: int, kind: str, keys: Sequence[str], rounds: Sequence[int]) -> np.ndarray:
        """``tree_ids`` of (query, window, kind, key_j, round_j) for many keys, hashing the shared
        prefix once (same ids as :meth:`tree_id`)."""
        base = hashlib.blake2b(key=self._id_key, digest_size=TREE_ID_BYTES)
        base.update(_tree_prefix(query, window_start, kind))
        out = np.empty(len(keys), dtype=TREE_ID_DTYPE)
        for j, (key, round_) in enumerate(zip(keys, rounds)):
            h = base.copy()
            h.update(_tree_suffix(key, round_))
            out[j] = h.digest()
        return out

    def _encrypt(self, blocks: bytes) -> np.ndarray:
        encryptor = self._cipher.encryptor()
        raw = encryptor.update(blocks) + encryptor.finalize()
        return np.frombuffer(raw, dtype="<u8").reshape(-1, 2)

    def uniforms_indexed(self, trees: np.ndarray, tree_of: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """128-bit PRF outputs for each (``trees[tree_of[i]]``, ``nodes[i]``), as (hi, lo) uint64
        words: the CBC-MAC ``AES(AES(tree_id) XOR node_block)``, first block once per tree."""
        words = self._node_words(trees, tree_of, nodes)
        return np.ascontiguousarray(words[:, 0]), np.ascontiguousarray(words[:, 1])

    def _node_words(self, trees: np.ndarray, tree_of: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """:meth:`uniforms_indexed` as one (n, 2) array of (hi, lo) words. The second blocks are
        laid out by a kernel (dpstream.processor.mechanisms.kernels.node_blocks): AES itself is
        a twentieth of a draw's cost, numpy's gather and copies around it were most of the rest."""
        from dpstream.processor.mechanisms import kernels

        trees = np.ascontiguousarray(np.asarray(trees, dtype=TREE_ID_DTYPE))
        first = self._encrypt(trees.tobytes())
        second = kernels.node_blocks(first, np.asarray(tree_of, dtype=np.int64), np.asarray(nodes, dtype=np.uint32))
        return self._encrypt(second.tobytes())

    def uniforms(self, trees: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """128-bit PRF outputs for each (tree id, node id) pair, as (hi, lo) uint64 words."""
        trees = np.asarray(trees)
        if len(trees) == 0:
            return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
        if trees.dtype.itemsize != TREE_ID_BYTES:
            raise ValueError(f"tree ids are {TREE_ID_BYTES} bytes")
        distinct, tree_of = np.unique(trees, return_inverse=True)
        return self.uniforms_indexed(distinct, tree_of.ravel(), nodes)

    def sample(self, sampler: DiscreteGaussian, trees: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Integer noise for each (tree, node); identical on every call with the same secret."""
        if len(nodes) == 0:
            return np.zeros(0, dtype=np.int64)
        hi, lo = self.uniforms(trees, nodes)
        return sampler.from_uniform(hi, lo)

    def sample_indexed(self, sampler: DiscreteGaussian, trees: np.ndarray, tree_of: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """:meth:`sample` for nodes of ``trees[tree_of[i]]`` (no de-duplication of tree ids)."""
        if len(nodes) == 0:
            return np.zeros(0, dtype=np.int64)
        words = self._node_words(trees, tree_of, nodes)
        return sampler.from_uniform(words[:, 0], words[:, 1])
