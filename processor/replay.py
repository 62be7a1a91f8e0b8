"""Local replay: a JSONL(.gz) file of events through the same pipeline, with an embedded store.

Clock: the replay's clock is the *watermark*, the largest valid event time read so far (per
query). An event is late if its trigger fired before it was read; a trigger fires once the
watermark passes its time plus the query's ``allowed_lateness``; at the end of the input every
remaining trigger of every started window fires (time would have passed). Everything depends
only on the input's line order, so re-running with the same input, config and secret gives
byte-identical output, and a run stopped part-way (``stop_after_lines``) and resumed on the same
state directory writes exactly what an uninterrupted run writes.

Durability: each chunk of lines is bounded and appended to the pending micro-batches in one
atomic write together with the number of lines consumed and the watermark; each trigger is one
atomic write with its journal; output is written after the journal, and a per-window
"published" marker lets a restarted run republish journaled releases it had not written.
Invalid lines are reported (line number and reason, never content), counted, dead-lettered when
asked, and skipped.
"""
from __future__ import annotations

import gzip
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, TextIO

import numpy as np

from processor.config import DpstreamConfig
from processor.budget import LEDGER_STORE, BudgetGate, open_ledger
from processor.dynamic_stream import DynamicQueryState
from processor.noise import NodeNoise, Pseudonymizer
from processor.pipeline import EventColumns, QueryPipeline, check_noise_epoch
from state import keys as sk
from state.store import PartitionStores, WriteBatch
from topics.records import EventParser, InvalidRecord, dead_letter, encode_json, json_object

CHUNK_LINES = 50_000
MAX_REPORTED_INVALID = 100
PROGRESS_SECONDS = 5.0


@dataclass
class ReplaySummary:
    lines: int = 0
    invalid: Counter = field(default_factory=Counter)  # reason -> lines
    releases: int = 0
    triggers_fired: int = 0
    stopped_early: bool = False
    seconds: float = 0.0


def _open_lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        yield from fh


class ReplayRunner:
    def __init__(self, config: DpstreamConfig, secret: bytes, state_dir: Optional[str], log: TextIO = sys.stderr):
        self.config = config
        self.log = log
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dpstream-state-")
            state_dir = self._tmp.name
        self.stores = PartitionStores(state_dir)
        self.store = self.stores.store(0)
        self.noise = NodeNoise(secret)
        self.pseudonyms = Pseudonymizer(secret)
        self.pipelines = [QueryPipeline(q, self.noise, self.store, self.pseudonyms) for q in config.queries]
        self.parsers = [EventParser.for_query(q) for q in config.queries]
        self._check_epoch()
        self.dynamic = [DynamicQueryState(q, self.noise, self.pseudonyms, self.store) for q in config.dynamic]
        self.ledger = open_ledger(config, self.stores.store(LEDGER_STORE))
        if self.ledger is not None:
            gate = BudgetGate(config, self.ledger)
            for pipe in self.pipelines:
                pipe.window_gate = gate.window_gate(pipe.query)
            for dyn in self.dynamic:
                dyn.refused = not gate.start_dynamic(dyn.query)

    def _check_epoch(self) -> None:
        check_noise_epoch(self.store, self.noise)

    def close(self) -> None:
        self.stores.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -------------------------------------------------------------- meta
    def _meta_int(self, name: bytes, default: int = 0) -> int:
        value = self.store.get(sk.META + name)
        return int.from_bytes(value, "little", signed=True) if value else default

    @staticmethod
    def _put_int(batch: WriteBatch, name: bytes, value: int) -> None:
        batch.put(sk.META + name, int(value).to_bytes(8, "little", signed=True))

    # -------------------------------------------------------------- run
    def run(self, input_path: str, output: TextIO, dead_letters: Optional[TextIO] = None,
            stop_after_lines: Optional[int] = None, on_progress: Optional[Callable[[str], None]] = None) -> ReplaySummary:
        summary = ReplaySummary()
        started = time.perf_counter()
        self._republish(output, summary)
        consumed = self._meta_int(b"lines")
        watermarks = [self._meta_int(b"watermark" + p.qid, -1) for p in self.pipelines]
        reported = 0
        last_progress = time.perf_counter()
        line_no = 0
        chunk: list[tuple[int, bytes]] = []

        def flush():
            nonlocal reported
            if not chunk:
                return
            batch, reported = self._process_chunk(chunk, watermarks, summary, dead_letters, reported)
            # bounded records, user slots, lines consumed and watermarks: one atomic write
            self._put_int(batch, b"lines", chunk[-1][0])
            for pipe, wm in zip(self.pipelines, watermarks):
                self._put_int(batch, b"watermark" + pipe.qid, wm)
            self.store.write(batch)
            chunk.clear()
            self._publish_dynamic(output, summary)
            self._fire_due(watermarks, output, summary)

        for raw in _open_lines(Path(input_path)):
            line_no += 1
            if line_no <= consumed:
                continue
            if stop_after_lines is not None and line_no > stop_after_lines:
                summary.stopped_early = True
                break
            chunk.append((line_no, raw))
            if len(chunk) >= CHUNK_LINES:
                flush()
                if on_progress and time.perf_counter() - last_progress > PROGRESS_SECONDS:
                    last_progress = time.perf_counter()
                    on_progress(self._progress_line(line_no, summary))
        flush()
        summary.lines = max(line_no, consumed) if not summary.stopped_early else stop_after_lines
        if not summary.stopped_early:
            self._fire_all(output, summary)
        summary.seconds = time.perf_counter() - started
        return summary

    def _progress_line(self, line_no: int, summary: ReplaySummary) -> str:
        return (f"replay: {line_no:,} lines read, {sum(summary.invalid.values()):,} invalid, "
                f"{summary.triggers_fired:,} triggers fired, {summary.releases:,} releases")

    def _process_chunk(self, chunk, watermarks, summary, dead_letters, reported) -> tuple[WriteBatch, int]:
        parsed = [json_object(raw) for _, raw in chunk]
        seq = chunk[0][0]
        batch = WriteBatch()
        for q, (pipe, parser) in enumerate(zip(self.pipelines, self.parsers)):
            users, keys, values, ts = [], [], [], []
            for (line_no, raw), obj in zip(chunk, parsed):
                event = obj if isinstance(obj, InvalidRecord) else parser.from_mapping(obj)
                if isinstance(event, InvalidRecord):
                    reported = self._invalid(pipe.query.name, event.reason, line_no, raw, summary, dead_letters, reported)
                    continue
                users.append(event.user)
                keys.append(event.key)
                values.append(event.value)
                ts.append(event.ts)
            if not ts:
                continue
            ts_arr = np.array(ts, dtype=np.int64)
            key_arr = np.array(keys, dtype=object)
            events = EventColumns(self.pseudonyms.users(users), key_arr, self.pseudonyms.group_keys(keys), np.array(values, dtype=np.float64), ts_arr)
            running = np.maximum.accumulate(ts_arr)
            prior = np.empty_like(ts_arr)
            prior[0] = watermarks[q]
            prior[1:] = np.maximum(running[:-1], watermarks[q])
            watermarks[q] = max(watermarks[q], int(running[-1]))
            records = pipe.bound(events, prior, batch)
            pipe.accumulate(records, seq, batch)
        for dyn in self.dynamic:
            for (line_no, raw), obj in zip(chunk, parsed):
                _, reason = dyn.apply(obj, batch)
                if reason is not None:
                    reported = self._invalid(dyn.query.name, reason, line_no, raw, summary, dead_letters, reported)
        return batch, reported

    def _invalid(self, query: str, reason: str, line_no: int, raw: bytes, summary, dead_letters, reported: int) -> int:
        summary.invalid[f"{query}: {reason}"] += 1
        if reported < MAX_REPORTED_INVALID:
            self.log.write(f"line {line_no}: query {query}: {reason}\n")
        elif reported == MAX_REPORTED_INVALID:
            self.log.write("(further invalid lines are counted, not shown)\n")
        if dead_letters is not None:
            dead_letters.write(encode_json({"query": query, **dead_letter(reason, raw.rstrip(b"\n"), f"line {line_no}")}).decode() + "\n")
        return reported + 1

    def _publish_dynamic(self, output: TextIO, summary: ReplaySummary) -> None:
        batch = WriteBatch()
        for dyn in self.dynamic:
            records = dyn.take_pending()
            for record in records:
                output.write(encode_json(record).decode() + "\n")
            summary.releases += len(records)
            dyn.mark_published(batch)
        if len(batch):
            output.flush()
            self.store.write(batch)

    def _publish(self, pipe: QueryPipeline, window: int, trigger: int, releases, output: TextIO, summary: ReplaySummary) -> None:
        for record in releases:
            output.write(encode_json(record).decode() + "\n")
        output.flush()
        summary.releases += len(releases)
        batch = WriteBatch()
        pipe.mark_published(window, trigger, batch)
        self.store.write(batch)

    def _fire(self, pipe, window, trigger, output, summary) -> None:
        releases = pipe.fire(window, trigger)
        summary.triggers_fired += 1
        self._publish(pipe, window, trigger, releases, output, summary)

    def _fire_due(self, watermarks, output, summary) -> None:
        while True:
            due = [(nf, q) for q, pipe in enumerate(self.pipelines) if (nf := pipe.next_fire()) is not None and nf[0] <= watermarks[q]]
            if not due:
                return
            (_, window, trigger), q = min(due)
            self._fire(self.pipelines[q], window, trigger, output, summary)

    def _fire_all(self, output, summary) -> None:
        while True:
            due = [(nf, q) for q, pipe in enumerate(self.pipelines) if (nf := pipe.next_fire()) is not None]
            if not due:
                return
            (_, window, trigger), q = min(due)
            self._fire(self.pipelines[q], window, trigger, output, summary)

    def _republish(self, output: TextIO, summary: ReplaySummary) -> None:
        """Releases journaled by a previous run but not yet written to the output."""
        for pipe in self.pipelines:
            for window, trigger, releases in pipe.unpublished():
                self._publish(pipe, window, trigger, releases, output, summary)
        self._publish_dynamic(output, summary)
