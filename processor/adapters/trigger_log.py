"""The trigger log line: one line per trigger for the whole worker (docs/operations.md, "The
trigger log line").

A trigger fires on each of the worker's repartition partitions of its query (each its own share
of the keys), one after the other and sometimes a timer tick apart. :class:`TriggerLog` gathers
them and logs one line per (query, window, trigger) once every owned partition of the query has
fired it (or after :data:`HOLD_S`, saying how many did), and one summary line per query when a
worker catches up on more than :data:`CATCH_UP_OVER` triggers at once (after a restart, or a
start mid-window). Public values only: the schedule and what is on the output
topic; no key, no user.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("dpstream.worker")

#: s a trigger's line waits for the worker's other partitions of its query to fire it
HOLD_S = 10.0
#: more triggers of one query completing at once than this are a catch-up (a restart, a start
#: mid-window): one summary line. Up to it, each its own line, as in steady running: a loaded
#: machine may complete two or three triggers in one timer tick, and they are not a catch-up
CATCH_UP_OVER = 10


def iso_utc(ms: int) -> str:
    """ISO-8601 UTC; milliseconds only when not a whole second."""
    ms = int(ms)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000))
    return f"{text}.{ms % 1000:03d}Z" if ms % 1000 else f"{text}Z"


@dataclass
class _Trigger:
    """One (query, window, trigger) as fired so far on this worker's partitions."""
    triggers: int  # the query's T
    first_ms: float  # monotonic time of the first partition's firing
    keys_released: int = 0
    duration_ms: float = 0.0  # the slowest partition's, from computation to acknowledged releases
    partitions: set = field(default_factory=set)
    republished: bool = False


class TriggerLog:
    """Gathers fired triggers by (query, window, trigger); :meth:`flush` logs the complete ones."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.pending: dict[tuple[str, int, int], _Trigger] = {}

    def add(self, query: str, triggers: int, window: int, trigger: int, keys_released: int, partition: int,
            duration_ms: Optional[float] = None) -> None:
        """One partition fired (or, ``duration_ms`` None, republished from its journal) a trigger."""
        entry = self.pending.setdefault((query, window, trigger), _Trigger(triggers, self.clock()))
        entry.keys_released += keys_released
        entry.partitions.add(partition)
        if duration_ms is None:
            entry.republished = True
        else:
            entry.duration_ms = max(entry.duration_ms, duration_ms)

    def flush(self, owned: dict[str, int], force: bool = False) -> list[str]:
        """Log (and return) the lines of the triggers every one of the ``owned`` partitions of
        their query (query -> count) has fired, those held :data:`HOLD_S`, or all (``force``)."""
        now = self.clock()
        done: dict[str, list] = {}
        for key, entry in sorted(self.pending.items()):
            query = key[0]
            if force or len(entry.partitions) >= owned.get(query, 0) or now - entry.first_ms >= HOLD_S:
                done.setdefault(query, []).append((key, entry))
        lines = []
        for query, entries in done.items():
            for key, _ in entries:
                del self.pending[key]
            fresh = [e for e in entries if not e[1].republished]
            again = [e for e in entries if e[1].republished]
            lines += self._lines(query, fresh, owned.get(query, 0), "trigger fired", "caught up")
            lines += self._lines(query, again, owned.get(query, 0), "trigger republished from the journal",
                                 "republished from the journal")
        for line in lines:
            log.info("%s", line)
        return lines

    @staticmethod
    def _line(query: str, key: tuple, entry: _Trigger, one: str, share: str) -> str:
        _, window, trigger = key
        duration = "" if entry.republished else f" duration_ms={entry.duration_ms:.0f}"
        return (f"{one}: query={query} window={iso_utc(window)} trigger={trigger}/{entry.triggers} "
                f"keys_released={entry.keys_released}{duration} partitions={share}")

    @staticmethod
    def _lines(query: str, entries: list, owned: int, one: str, many: str) -> list[str]:
        if not entries:
            return []
        partitions = max(len(e.partitions) for _, e in entries)
        # fewer than the worker owns: the others had not fired it within HOLD_S (their input
        # watermark behind), or the partitions moved meanwhile
        share = f"{partitions}/{owned}" if partitions < owned else str(partitions)
        if len(entries) <= CATCH_UP_OVER:
            return [TriggerLog._line(query, k, e, one, share) for k, e in entries]
        (_, w0, t0), first = entries[0]
        (_, w1, t1), last = entries[-1]
        keys = sum(e.keys_released for _, e in entries)
        return [f"{many} {len(entries)} triggers: query={query} from window={iso_utc(w0)} trigger={t0}/{first.triggers} "
                f"to window={iso_utc(w1)} trigger={t1}/{last.triggers} keys_released={keys} partitions={share}"]
