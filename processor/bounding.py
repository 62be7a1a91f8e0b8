"""User contribution bounding (DP-SQLP section 3.2 and section 4.1 step 1; DESIGN.md section 12).

Stage 1, partitioned by user: each (user, privacy unit) admits at most C records; every admitted
record gets a *slot* 1..C. The slot list is the per-user state: the fingerprints of the admitted
records in admission order. Admission is idempotent: a replayed record (same record id, e.g. its
Kafka partition and offset or its line in a replayed file) gets its original slot back instead
of a new one, so at-least-once delivery cannot push a user past C. Downstream, stage 2 keeps at
most one contribution per (user, slot); since a slot always names the same record, and so the
same key, that de-duplication can happen per key partition.

Values are clamped to ``|v| <= L`` and put on the accountant's grid (``round(v / resolution)``
grid units, ties to even), the integer data the perturbation tree's discrete noise needs.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

FINGERPRINT_BYTES = 8


def record_fingerprint(record_id: bytes) -> bytes:
    """Short stable digest of a record's identity (never of its content)."""
    return hashlib.blake2b(record_id, digest_size=FINGERPRINT_BYTES, person=b"dpstream-slot").digest()


@dataclass(frozen=True)
class Admission:
    slot: Optional[int]  # 1..C, or None when the record is beyond the bound
    replay: bool  # the record was admitted before (same slot returned)
    slots: bytes  # the user's new slot state (concatenated fingerprints)


class ContributionBounder:
    def __init__(self, contribution_bound: int, clamp: float, resolution: float = 1.0):
        if contribution_bound < 1:
            raise ValueError("contribution_bound must be >= 1")
        self.contribution_bound = int(contribution_bound)
        self.clamp = float(clamp)
        self.resolution = float(resolution)
        self._max_units = int(round(self.clamp / self.resolution))

    def admit(self, slots: bytes, record_id: bytes) -> Admission:
        """Admit one record of a user given the user's slot state ``slots``."""
        fp = record_fingerprint(record_id)
        used = len(slots) // FINGERPRINT_BYTES
        for i in range(used):
            if slots[i * FINGERPRINT_BYTES:(i + 1) * FINGERPRINT_BYTES] == fp:
                return Admission(i + 1, True, slots)
        if used >= self.contribution_bound:
            return Admission(None, False, slots)
        return Admission(used + 1, False, slots + fp)

    def units(self, value: float) -> int:
        """Clamp to [-L, L] and express on the grid (integer units)."""
        if not math.isfinite(value):
            raise ValueError("value must be finite")
        clamped = max(-self.clamp, min(self.clamp, value))
        return round(clamped / self.resolution)
