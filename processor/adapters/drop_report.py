"""The worker's log lines about dropped events: per query and reason, at most one line per
report period, with the count since the last line and the likely cause (docs/operations.md,
"Trying it with a file"). Counts only, never a record's content, a key or a user id.

``dpstream_events_dropped_total{reason}`` counts the same events; the log says why, so that an
operator who never looks at the metric still learns that a producer's settings lose data.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

#: reasons that say something is wrong with the input or its producer (a warning); the others
#: are the mechanism's own bounding (``contribution_bound``, ``per_key_bound``, ``duplicate``:
#: expected, logged at info level)
WARNING_REASONS = ("malformed", "late", "future", "key_collision", "budget")


def likely_cause(reason: str, query, partitioner: Optional[str] = None) -> str:
    """What usually makes a worker drop events for ``reason`` and where to look."""
    tf = repr(getattr(query, "time_field", "ts"))
    causes = {
        "malformed": (f"records that are not this query's input: not parsed (bad JSON, a missing or ill-typed field such "
                      f"as {getattr(query, 'user_field', 'user_id')!r}); each is in the dead-letter topic with its reason "
                      f"(docs/operations.md, \"Topics and records\")"),
        "late": (f"their trigger, by their {tf}, had fired when the broker stamped them: the worker goes by the stamp, "
                 f"not by {tf} (docs/operations.md, \"Trying it with a file\")"),
        "future": f"dated more than max_skew {getattr(query, 'max_skew', '')} after the broker's stamp (a producer's clock, or seconds for ms)",
        "key_collision": "another key text holds the key's 64-bit id in the window; the later text is refused",
        "budget": "the ledger refused the window's privacy charge (`dpstream budget` shows what is left): it releases nothing",
        "contribution_bound": "users over the query's contribution bound (C records per window): the bound at work",
        "per_key_bound": "users over the per-key bound: the bound at work",
        "not_public_key": "records of keys outside the query's public_keys: the declared domain at work",
        "duplicate": "a record seen again (a redelivery after a restart): counted once",
    }
    return causes.get(reason, "see dpstream_events_dropped_total")


class DropReport:
    """The totals reported so far; :meth:`lines` returns what is new since the last call."""

    def __init__(self, partitioner: Optional[str] = None):
        self.partitioner = partitioner
        self._seen: dict[tuple[str, str], int] = {}

    def lines(self, totals: Iterable[tuple[object, dict]]) -> list[tuple[int, str]]:
        """``totals``: (query, dropped counts by reason) pairs, several per query allowed (one per
        partition); returns (log level, line) pairs, one per query and reason with new drops."""
        summed: dict[tuple[str, str], int] = {}
        queries = {}
        for query, dropped in totals:
            queries[query.name] = query
            for reason, n in dropped.items():
                summed[(query.name, reason)] = summed.get((query.name, reason), 0) + int(n)
        out = []
        for (name, reason), total in sorted(summed.items()):
            new = total - self._seen.get((name, reason), 0)
            if new <= 0:
                continue  # nothing new (or a partition handed to another worker: its counts left with it)
            level = logging.WARNING if reason in WARNING_REASONS else logging.INFO
            out.append((level, f"query {name}: since the last report, {new:,} events dropped as {reason} "
                               f"({likely_cause(reason, queries[name], self.partitioner)})"))
        self._seen = summed
        return out
