"""The one drive loop of DP-SQLP queries: stage 1, stage 2's input, triggers, publication
(docs/architecture.md, "From one event to one release").

Replay, the Kafka worker and every benchmark drive their queries through :class:`QueryRunner`
and :class:`Engine`; they differ only in where events come from (a file, a topic, a generator),
where releases go (a file, a topic, memory) and which clock they use (docs/privacy.md, "Time").
So a benchmark measures the product's path, and a fix to the loop is a fix everywhere.

Every call takes the caller's :class:`dpstream.state.store.WriteBatch` and leaves writing it to the caller:
the batch must be written together with the caller's input position (a commit point), and only
then are releases computed from it (:meth:`QueryRunner.fire` writes its own batch, the trigger's
journal, before returning).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from dpstream.processor.engine.pipeline import (
    BoundedRecords,
    EventColumns,
    QueryPipeline,
)
from dpstream.state.store import WriteBatch


@dataclass
class StageOneOutput:
    """Stage 1's output for a batch of events: the bounded records (the repartition topic's
    content) and the events refused there, by index into the events given, with reasons."""

    records: BoundedRecords
    refused: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Fired:
    """A trigger fired (its releases journaled); publish them, then :meth:`QueryRunner.published`."""

    runner: "QueryRunner"
    window: int
    trigger: int
    releases: list[dict]


class QueryRunner:
    """Drives one query's :class:`QueryPipeline` over its store."""

    def __init__(self, pipeline: QueryPipeline):
        self.pipeline = pipeline

    @property
    def query(self):
        return self.pipeline.query

    # ------------------------------------------------------------------ input
    def stage_one(self, events: EventColumns, clocks: np.ndarray, batch: WriteBatch) -> StageOneOutput:
        """Contribution bounding (by user). ``clocks[e]``: the clock when event e arrived."""
        records = self.pipeline.bound(events, np.asarray(clocks, dtype=np.int64), batch)
        return StageOneOutput(records, list(self.pipeline.last_rejected))

    def stage_two(self, records: BoundedRecords, seq: int, batch: WriteBatch) -> list[tuple[str, str]]:
        """Bounded records into their pending micro-batches (by key); ``seq`` unique per call (the
        input position). Returns (key text, reason) of records refused (key id collisions)."""
        return self.pipeline.accumulate(records, seq, batch)

    def ingest(self, events: EventColumns, clocks: np.ndarray, seq: int, batch: WriteBatch
               ) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
        """Both stages in one process (replay, benchmarks): returns the refusals of each."""
        out = self.stage_one(events, clocks, batch)
        return out.refused, self.stage_two(out.records, seq, batch)

    # ------------------------------------------------------------------ triggers
    def next_due(self, clock_ms: Optional[int]) -> Optional[tuple[int, int, int]]:
        """(fire time, window, trigger) of the next trigger if the clock has passed its fire time."""
        if clock_ms is None:
            return None
        nxt = self.pipeline.next_fire()
        return nxt if nxt is not None and nxt[0] <= clock_ms else None

    def fire(self, window: int, trigger: int) -> Fired:
        return Fired(self, int(window), int(trigger), self.pipeline.fire(window, trigger))

    def fire_due(self, clock_ms: Optional[int], open_clock_ms: Optional[int] = None) -> Iterator[Fired]:
        """Open (charge) the windows the clock has reached, then fire every trigger it has passed,
        in order: the public schedule decides, never the data. ``open_clock_ms``: a separate
        clock for opening windows (the Kafka worker charges on the wall clock and fires on its
        input watermark: docs/privacy.md, "Time")."""
        opening = clock_ms if open_clock_ms is None else open_clock_ms
        if opening is not None:
            self.pipeline.open_due(opening)
        while (nxt := self.next_due(clock_ms)) is not None:
            yield self.fire(nxt[1], nxt[2])

    def unpublished(self) -> Iterator[Fired]:
        """Triggers journaled but not marked published (after a crash): publish them again,
        never recompute them (docs/privacy.md, "Failures")."""
        for window, trigger, releases in self.pipeline.unpublished():
            yield Fired(self, window, trigger, releases)

    def published(self, fired: Fired) -> None:
        """Mark a trigger's releases as having reached the output (after they did)."""
        batch = WriteBatch()
        self.pipeline.mark_published(fired.window, fired.trigger, batch)
        self.pipeline.store.write(batch)


class Engine:
    """The queries of one run, fired together in fire-time order (ties: config order)."""

    def __init__(self, pipelines: Sequence[QueryPipeline]):
        self.runners = [QueryRunner(p) for p in pipelines]

    def open_due(self, clocks: Sequence[Optional[int]]) -> None:
        for runner, clock in zip(self.runners, clocks):
            if clock is not None:
                runner.pipeline.open_due(clock)

    def fire_due(self, clocks: Sequence[Optional[int]]) -> Iterator[Fired]:
        """Every trigger whose query's clock has passed its fire time, earliest first."""
        while True:
            due = [(nxt, q) for q, (runner, clock) in enumerate(zip(self.runners, clocks)) if (nxt := runner.next_due(clock)) is not None]
            if not due:
                return
            (_, window, trigger), q = min(due)
            yield self.runners[q].fire(window, trigger)

    def fire_all(self) -> Iterator[Fired]:
        """Every trigger of every open window, earliest first (the end of a bounded input)."""
        while True:
            due = [(nxt, q) for q, runner in enumerate(self.runners) if (nxt := runner.pipeline.next_fire()) is not None]
            if not due:
                return
            (_, window, trigger), q = min(due)
            yield self.runners[q].fire(window, trigger)

    def unpublished(self) -> Iterator[Fired]:
        for runner in self.runners:
            yield from runner.unpublished()
