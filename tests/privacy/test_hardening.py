"""Fix 8 (hardening): run labels, secrets, 128-bit tree ids and key-id collisions.

Claims under attack:
* two replays on fresh state directories draw independent noise (a random run label each), so
  publishing both does not reveal the exact difference of their data; the same label (given on
  purpose with --noise-label) does, which is why it is not the default; a resumed run keeps the
  label its state was written with;
* a secret must be >= 128 bits of random key material: short, low-variety, passphrase-like or
  hex-encoded-password secrets are refused, and no message or repr shows it;
* tree identities use all 128 bits (the old 96-bit ids made colliding trees share all noise);
* a key text whose 64-bit id collides with another key's in the same window is dead-lettered as
  ``key_collision``, never merged into the other key's counts.
"""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from dpstream.processor.adapters.replay import ReplayError
from dpstream.processor.config import DpstreamConfig
from dpstream.processor.mechanisms.noise import (
    TREE_ID_BYTES,
    NodeNoise,
    NoiseSecretError,
    Pseudonymizer,
    TreeIdentity,
    decode_secret,
    load_noise_secret,
)
from tests.conftest import TEST_SECRET
from tests.privacy._helpers import DAY, START, events, query, replay, write_jsonl

KEY_BITS = TREE_ID_BYTES * 8


def cfg() -> DpstreamConfig:
    return DpstreamConfig(queries=[query()])


def day(seed=11):
    return events(np.random.default_rng(seed), users=3000, records=12000, keys=8)


def values_by_key(run) -> dict:
    """Each key's latest release."""
    latest = {}
    for (_, trigger, key), value in sorted(run.releases().items(), key=lambda kv: kv[0][1]):
        latest[json.loads(key)] = value
    return latest


def histories_by_key(run) -> dict:
    """Each key's releases in trigger order, as (trigger, value) pairs."""
    history: dict = {}
    for (_, trigger, key), value in sorted(run.releases().items(), key=lambda kv: kv[0][1]):
        history.setdefault(json.loads(key), []).append((trigger, value))
    return history


# ---------------------------------------------------------------------------------------------
def test_fresh_state_directories_draw_independent_noise(tmp_path):
    rows = day()
    extra = {"user_id": "x", "key": "k0", "ts": START + DAY // 2}
    neighbour = rows[: len(rows) // 2] + [extra] + rows[len(rows) // 2:]
    a = replay(cfg(), write_jsonl(tmp_path / "a.jsonl", rows), label=None)
    b = replay(cfg(), write_jsonl(tmp_path / "b.jsonl", neighbour), label=None)
    assert a.label != b.label and len(a.label) == 32
    ha, hb = histories_by_key(a), histories_by_key(b)
    common = sorted(set(ha) & set(hb) - {"k0"})
    assert len(common) >= 3, "the workload must release several keys"
    # keys whose data is identical get different noise: their difference is noise, not data.
    # A key's whole release history is compared (a single latest value of two independent
    # draws coincides with probability about 1 / (2 sqrt(pi) sigma), 10% at this sigma; a
    # history of several releases, or releases at other triggers, hardly ever)
    assert sum(ha[k] != hb[k] for k in common) >= len(common) - 1

    # what the random label prevents: under one label the outputs differ exactly where data does
    c = replay(cfg(), write_jsonl(tmp_path / "c.jsonl", rows), label="same")
    d = replay(cfg(), write_jsonl(tmp_path / "d.jsonl", neighbour), label="same")
    vc, vd = values_by_key(c), values_by_key(d)
    assert all(vc[k] == vd[k] for k in common)


def test_a_resumed_run_keeps_its_label_and_refuses_another(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", day())
    state = tmp_path / "s"
    first = replay(cfg(), path, state_dir=state, label=None, stop_after=1500)
    rest = replay(cfg(), path, state_dir=state, label=None)
    assert rest.label == first.label
    whole = replay(cfg(), path, state_dir=tmp_path / "w", label=first.label)
    assert first.output + rest.output == whole.output
    with pytest.raises(ReplayError, match="--noise-label"):
        replay(cfg(), path, state_dir=state, label="another")


# ---------------------------------------------------------------------------------------------
RANDOM_32 = bytes.fromhex("9b1e64c07a3f52d8e1c94b0f7d26a3e58c0b71f49e2d36a5b8f10c7e4d92a61b")


@pytest.mark.parametrize("text", [
    RANDOM_32.hex(),
    RANDOM_32.hex().upper(),
    base64.b64encode(RANDOM_32).decode(),
    base64.urlsafe_b64encode(RANDOM_32).decode(),
])
def test_random_key_material_is_accepted_in_hex_and_base64(text):
    assert decode_secret(text.encode() + b"\n") == RANDOM_32


@pytest.mark.parametrize("text,why", [
    (RANDOM_32[:15].hex(), "holds 15 bytes"),                       # 120 bits
    ("00" * 32, "variety"),                                          # one byte value
    (b"password1234567890abcdef".hex(), "variety"),                  # a hex-encoded password
    ("correct horse battery staple", "passphrase"),                  # words
    ("correcthorsebatterystaple123", "passphrase"),                  # one case, a multiple of 4 long
    (base64.b64encode(b"hunter2hunter2hunter2!!").decode(), "variety"),  # base64 of printable text
])
def test_weak_secrets_are_refused_without_showing_them(text, why):
    with pytest.raises(NoiseSecretError, match=why) as err:
        load_noise_secret(environ={"DPSTREAM_NOISE_KEY": text})
    assert text not in str(err.value)


def test_no_repr_shows_the_secret():
    noise, pseud = NodeNoise(RANDOM_32, "l"), Pseudonymizer(RANDOM_32)
    for text in (repr(noise), repr(pseud), str(noise), str(pseud)):
        assert RANDOM_32.hex() not in text.lower() and repr(RANDOM_32) not in text
    # the public fingerprint names the secret's epoch (the same under every run label), not its bytes
    assert noise.fingerprint == NodeNoise(RANDOM_32, "other").fingerprint != NodeNoise(TEST_SECRET).fingerprint
    assert noise.fingerprint not in RANDOM_32.hex()


# ---------------------------------------------------------------------------------------------
def test_tree_ids_use_all_128_bits():
    noise = NodeNoise(TEST_SECRET, "t")
    idents = [TreeIdentity("q", START, f"key-{i}", "select", i % 3) for i in range(2000)]
    ids = noise.tree_ids(idents)
    assert ids.dtype.itemsize == 16 and KEY_BITS == 128
    tails = {bytes(i)[12:16] for i in ids.tolist()}
    assert len(tails) > 1990, "bytes 12..15 of the id must carry entropy (the old ids had 12 bytes)"
    same = noise.tree_ids_for("q", START, "select", [i.key for i in idents], [i.round for i in idents])
    assert same.tolist() == ids.tolist()


# ---------------------------------------------------------------------------------------------
def test_a_key_id_collision_dead_letters_the_newcomer_and_changes_no_release(tmp_path, monkeypatch):
    rows = day()
    reference = replay(cfg(), write_jsonl(tmp_path / "a.jsonl", rows))
    assert "k0" in values_by_key(reference)
    # 30 users' records of a key "kz" whose 64-bit id equals k0's (forced: a real collision is a
    # 2^-64 event), after k0's first record in the window
    late_half = START + DAY // 2
    intruders = [{"user_id": f"z{i}", "key": "kz", "ts": late_half + i} for i in range(30)]
    mixed = sorted(rows + intruders, key=lambda r: r["ts"])
    original = Pseudonymizer.group_keys

    def colliding(self, keys):
        keys = list(keys)
        ids = original(self, keys)
        k0 = original(self, ["k0"])[0]
        ids[[i for i, k in enumerate(keys) if k == "kz"]] = k0
        return ids

    monkeypatch.setattr(Pseudonymizer, "group_keys", colliding)
    run = replay(cfg(), write_jsonl(tmp_path / "b.jsonl", mixed))
    assert run.releases() == reference.releases(), "kz's records must not be merged into k0's counts"
    assert len(run.dead) == 30 and all(d["reason"].startswith("key id collision") for d in run.dead)
    assert run.stats[0].dropped["key_collision"] == 30
