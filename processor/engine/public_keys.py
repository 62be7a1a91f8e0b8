"""A query's public key domain (``public_keys``): which keys it releases at every trigger.

With a declared domain there is no key selection (docs/privacy.md, "Public keys"; PipelineDP's
and Tumult's public partitions): stage 1 keeps only records whose key is declared, before
contribution bounding, so a user's C slots go to declared keys only, and stage 2 releases every
declared key at every trigger of an open window, whether it has records or not. Which keys are
released, and when, is then public configuration, never data.

A hierarchy's domain is its finest keys; their prefixes are the coarser levels' keys, all
released. Stage 2 of a worker owns the keys whose level-1 key (the root) routes to its partition
of the by-key topic (``root % partitions``, as stage 1 sends records): :meth:`PublicKeyDomain.share`.

Ids are the keys' keyed pseudonyms (dpstream.processor.mechanisms.noise.Pseudonymizer.group_keys),
the ids records carry, so a record's key and its declared twin meet in one key row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class PublicKeyDomain:
    """Every level's declared keys, sorted by id, and the finest level's (what records carry)."""

    ids: np.ndarray  # uint64, sorted: every level's keys
    texts: tuple  # key text per id
    levels: np.ndarray  # int64 level per id (1 = coarsest)
    roots: np.ndarray  # uint64 level-1 key id per id (where stage 2 holds the key)
    finest_ids: np.ndarray  # uint64, sorted: the declared (finest) keys
    finest_texts: np.ndarray  # object: their texts, aligned with finest_ids

    @classmethod
    def build(cls, texts: Sequence[str], depth: int, level_texts: Callable[[str, int], list],
              group_keys: Callable[[list], np.ndarray]) -> "PublicKeyDomain":
        """``texts``: the declared keys (finest level); ``level_texts(text, depth)``: a key's text
        at every level, coarse to fine; ``group_keys``: the keys' pseudonyms."""
        per_key = [level_texts(t, depth) if depth > 1 else [t] for t in texts]
        every = {}
        for parts in per_key:
            for level, text in enumerate(parts, 1):
                every.setdefault(text, (level, parts[0]))
        all_texts = list(every)
        ids = group_keys(all_texts)
        roots = group_keys([every[t][1] for t in all_texts])
        order = np.argsort(ids, kind="stable")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("public_keys: two declared keys share a 64-bit key id (a pseudonym collision); drop one")
        finest = group_keys(list(texts))
        forder = np.argsort(finest, kind="stable")
        finest_texts = np.empty(len(texts), dtype=object)
        finest_texts[:] = [texts[j] for j in forder.tolist()]
        return cls(ids[order], tuple(all_texts[j] for j in order.tolist()),
                   np.array([every[all_texts[j]][0] for j in order.tolist()], dtype=np.int64), roots[order],
                   finest[forder], finest_texts)

    def __len__(self) -> int:
        return len(self.ids)

    def admits(self, key_ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Per record: is its key declared (its id and its text both, so that a 64-bit id
        collision never lets another key in)."""
        if not len(key_ids):
            return np.zeros(0, dtype=bool)
        at = np.minimum(np.searchsorted(self.finest_ids, key_ids), len(self.finest_ids) - 1)
        found = self.finest_ids[at] == key_ids
        found[found] = self.finest_texts[at[found]] == np.asarray(keys, dtype=object)[found]
        return found

    def share(self, partition: int, partitions: int) -> "PublicKeyDomain":
        """The keys whose root stage 1 routes to ``partition`` of ``partitions``."""
        mine = (self.roots % np.uint64(partitions)).astype(np.int64) == partition
        picked = np.nonzero(mine)[0]
        finest = np.isin(self.finest_ids, self.ids[picked])
        return PublicKeyDomain(self.ids[picked], tuple(self.texts[j] for j in picked.tolist()), self.levels[picked],
                               self.roots[picked], self.finest_ids[finest], self.finest_texts[finest])

    def level_and_root(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Level and root of declared keys (0 for ids not declared)."""
        at = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))
        found = self.ids[at] == ids if len(self.ids) else np.zeros(len(ids), dtype=bool)
        level = np.where(found, self.levels[at] if len(self.ids) else 0, 0).astype(np.int64)
        root = np.where(found, self.roots[at] if len(self.ids) else 0, 0).astype(np.uint64)
        return level, root

    def text_of(self) -> dict:
        """Key text by id (for keys no record has named yet)."""
        return dict(zip(self.ids.tolist(), self.texts))
