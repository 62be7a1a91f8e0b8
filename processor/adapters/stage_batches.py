"""Fetched records gathering per stage until they go to the stage's agent as one batch
(docs/operations.md, "Batches").

A batch goes after ``--batch-linger``, or at ``--fetch-records``; while the stage is still busy
with its last batch, records go on gathering (up to ``--fetch-records`` per stage), so under load
batches grow and the fixed cost of each (acknowledgement wait, transaction) is shared by more. Faust's per-event stream path was
measured at 13k events/s against 587k/s for aiokafka's ``getmany``, so one channel message
carries a batch: the records of every owned partition of a stage.
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable, Hashable

#: the worker's stages, each with its own agent (and its role's producer: delivery.py)
STAGES = ("stage1", "stage2", "dynamic")


class StageBatches:
    """Per stage: partition -> (its source, the records gathered), and whether the stage's agent
    is still busy with the last batch it was sent."""

    def __init__(self, send: Callable[[str, list], Awaitable[None]], linger_s: float, max_records: int):
        self._send = send  # (stage, items) -> the stage's agent receives items
        self.linger_s, self.max_records = linger_s, max_records
        self.pending: dict[str, dict] = {st: {} for st in STAGES}
        self.counts = dict.fromkeys(STAGES, 0)
        self.firsts: dict[str, float | None] = dict.fromkeys(STAGES)
        self.in_flight = dict.fromkeys(STAGES, 0)
        #: by partition: the offset after the last record fetched (read_to_end, offsets_read)
        self.fetched: dict[Hashable, int] = {}

    def wait_ms(self) -> int:
        """How long the next fetch may wait for records before a batch is due."""
        now = time.monotonic()
        due = [self.firsts[st] + self.linger_s - now for st in STAGES if self.counts[st] and not self.in_flight[st]]
        wait = 200 if not due else max(0, int(min(due) * 1000))
        if any(self.in_flight[st] for st in STAGES if self.counts[st]):
            wait = min(wait, 20)  # look again soon: a busy stage may have finished
        return wait

    def room(self) -> int:
        """How many records the next fetch may bring: each stage gathers up to ``max_records``
        of its own, so that a stage 1 busy with a backlog does not keep stage 2's records unread
        (its partitions are paused meanwhile: :meth:`full`)."""
        return max(self.max_records - n for n in self.counts.values())

    def full(self) -> set:
        """The stages holding ``max_records`` or more: their partitions are not fetched for now."""
        return {st for st, n in self.counts.items() if n >= self.max_records}

    def add(self, stage: str, key, source, records) -> None:
        self.pending[stage].setdefault(key, (source, []))[1].extend(records)
        self.counts[stage] += len(records)
        if self.firsts[stage] is None:
            self.firsts[stage] = time.monotonic()
        self.fetched[key] = records[-1].offset + 1

    def hand_back(self, stage: str, items: list) -> None:
        """Records a stage's agent could not process yet (a stage-1 partition replaying its last
        batch before a crash: processor/adapters/worker.py): before any fetched since."""
        for topic, partition, records, source in items:
            entry = self.pending[stage].get((topic, partition))
            self.pending[stage][(topic, partition)] = (source, list(records) + (entry[1] if entry else []))
            self.counts[stage] += len(records)
            if self.firsts[stage] is None:
                self.firsts[stage] = time.monotonic()

    def drop(self, key) -> None:
        """A partition given up: its gathered records are its new owner's to read."""
        for st in STAGES:
            entry = self.pending[st].pop(key, None)
            if entry is not None:
                self.counts[st] -= len(entry[1])
        self.fetched.pop(key, None)

    def done(self, stage: str) -> None:
        """The stage's agent finished a batch."""
        self.in_flight[stage] -= 1

    async def dispatch(self) -> None:
        now = time.monotonic()
        for st in STAGES:
            if self.counts[st] and not self.in_flight[st] and (self.counts[st] >= self.max_records or now - self.firsts[st] >= self.linger_s):
                self.in_flight[st] += 1
                items = [(t, p, records, source) for (t, p), (source, records) in self.pending[st].items()]
                self.pending[st], self.counts[st], self.firsts[st] = {}, 0, None
                await self._send(st, items)
