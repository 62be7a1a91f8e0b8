"""Compact binary key encoding for the pipeline's tables (one store, tables as key prefixes).

Every key is ``table (1 byte) | query id (4) | window start (8, big-endian) | ...`` so a window's
state of one table is one contiguous range (cheap scans and range deletes), and trigger numbers
are big-endian so scans come back in trigger order. Group-by keys and users appear only as keyed
64-bit pseudonyms.

| table | key suffix | value |
| --- | --- | --- |
| ``v`` user-state log (stage 1) | seq (8) | the states a commit changed: count n (u32), n users (u64), their admitted records (n u16), the byte lengths of their entries (n u32), then the entries back to back: per distinct (key, trigger) of a user's admitted records, key (u64), trigger (u32) |
| ``u`` spilled user state (stage 1) | user | a state the cache could not hold: admitted records (u16), then its entries |
| ``b`` pending micro-batch (stage 2 input) | trigger (4), seq (8) | packed bounded records |
| ``a`` predecessor amendments (stage 2 input) | trigger (4), seq (8) | packed (key u64, user u64, trigger u32) |
| ``t`` key texts seen in a window | key | key text (a different text under the same id is a collision) |
| ``r`` key-state log (stage 2) | seq (8) | the rows a commit changed: count n (u32), n keys (u64), n fixed rows (their ``predicted`` column is the prediction / visit index) |
| ``k`` spilled key state | key | a fixed row the cache could not hold |
| ``j`` release journal | trigger (4), key | release record JSON |
| ``g`` window progress | (none) | last fired trigger (u32), status (u8: 1 open, 2 refused), plan fingerprint (16) |
| ``p`` window pins | (none) | the public settings the window was first used under (canonical JSON; absent in state written before they were recorded) |
| ``h`` published view of a hierarchy (consistency) | root (8), key | level, trigger of the noisy value, noisy value, stddev, published consistent value and remainder; then key text |
| ``m`` runner metadata | name | bytes (a dynamic query's snapshot: ``dyn-snapshot``, state/tables.py) |
| ``e`` dynamic query update log | tick (8), sequence (8) | item index (u32), op (1: insert, 2: delete) |
| ``d`` dynamic query update log before snapshots (0.1 and early 0.2) | sequence (8) | item index (u32), op (1: insert, 2: delete), tick (u64) |
| ``n`` dynamic query privacy units | unit | updates counted (u32) |

(The dynamic tables have no window: ``table | query id | ...``.)
"""
from __future__ import annotations

import hashlib

import numpy as np

USERS = b"u"
USER_LOG = b"v"
KEY_LOG = b"r"
PENDING = b"b"
AMENDS = b"a"
KEY_NAMES = b"t"
KEYS = b"k"
JOURNAL = b"j"
PROGRESS = b"g"
WINDOW_PINS = b"p"
HIERARCHY_VIEW = b"h"
META = b"m"
DYNAMIC_LOG = b"d"  # before snapshots: read, and emptied as its updates are taken in
DYNAMIC_TICK_LOG = b"e"
DYNAMIC_UNITS = b"n"
DYNAMIC_UNIT_LOG = b"w"  # a unit step's updates waiting for their tick to be bounded

WINDOW_TABLES = (USERS, USER_LOG, PENDING, AMENDS, KEY_NAMES, KEYS, KEY_LOG, HIERARCHY_VIEW)


def query_id(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=4, person=b"dpstream-query").digest()


def window_prefix(table: bytes, qid: bytes, window_start: int) -> bytes:
    return table + qid + int(window_start).to_bytes(8, "big")


def window_of(key: bytes) -> int:
    """The window start of a window table's key (after the table byte and the query id)."""
    return int.from_bytes(key[5:13], "big")


def trigger_prefix(table: bytes, qid: bytes, window_start: int, trigger: int) -> bytes:
    return window_prefix(table, qid, window_start) + int(trigger).to_bytes(4, "big")


def fixed_keys(prefix: bytes, *columns: np.ndarray) -> list[bytes]:
    """Vectorized ``prefix + big-endian columns`` for every row (columns: uint32 or uint64)."""
    n = len(columns[0]) if columns else 0
    fields = [("prefix", f"S{len(prefix)}")] + [(f"c{i}", ">u8" if c.dtype.itemsize == 8 else ">u4") for i, c in enumerate(columns)]
    rows = np.empty(n, dtype=np.dtype(fields))
    rows["prefix"] = prefix
    for i, c in enumerate(columns):
        rows[f"c{i}"] = c
    width = rows.dtype.itemsize
    raw = rows.tobytes()
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def suffix_u64(keys: list[bytes], offset: int) -> np.ndarray:
    """The big-endian u64 at ``offset`` of each key, as an array."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    return np.frombuffer(b"".join(k[offset:offset + 8] for k in keys), dtype=">u8").astype(np.uint64)
