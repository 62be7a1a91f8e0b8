"""Local replay: a JSONL(.gz) file of events through the same pipeline, with an embedded store.

Time (docs/privacy.md, "Time"). A file has no wall clock, so replay keeps one *event-time clock*
per stream - each query's events, each dynamic query's updates - moved only by events it
accepts, so that no single privacy unit can move it (:class:`ReplayClock` states the rules):
events dated more than ``max_skew`` after the clock are held back and never move it, the clock is
the second-latest of the units' latest accepted event times, and two units crossing a gap in the
data make it jump. An accepted event whose trigger has fired is late and dropped; a trigger
fires, and a dynamic tick is decided, once the clock passes its end plus ``allowed_lateness``.

End of input: with ``until_ms`` (``--until``) the clock moves to that public time: events still
held and dated up to it are accepted in time order, windows up to it are opened (and charged),
triggers due by then fire, and dynamic queries decide every tick up to it. Without it, events
still held are dead-lettered as ``future``, every trigger of every opened window fires and
dynamic queries stop at their last update's tick; all of that depends on the data's time span,
which is why a budget ledger requires ``--start`` and ``--until``: windows are charged on that
public schedule, data or not.

Everything depends only on the input's line order, the config, the secret and the run's noise
label, so re-running with the same input, config, secret and label gives byte-identical output,
and a run stopped part-way (``stop_after_lines``) and resumed on the same state directory writes
exactly what an uninterrupted run writes. A fresh state directory gets a random noise label
unless one is given (``--noise-label``): two runs over slightly different data with the same
noise would publish their exact difference.

Durability: each chunk of lines is bounded and appended to the pending micro-batches in one
atomic write together with the number of lines consumed, the clocks and the held-back events;
each trigger is one atomic write with its journal; output is written after the journal, and a
per-window "published" marker lets a restarted run republish journaled releases it had not
written. With the lines consumed goes a fingerprint of them (:class:`InputPrefix`): a resumed run
checks that its input starts with exactly those lines before it reads, republishes or charges
anything, and refuses another file, naming the state directory (docs/user-guide.md, "Resuming and
appending"); ``--append`` says that another file continues the stream. Invalid lines are
reported (line number and reason, never content), counted, dead-lettered when asked, and skipped.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, TextIO

import numpy as np

from dpstream.processor.config import ConfigError, DpstreamConfig
from dpstream.processor.engine.budget import (
    LEDGER_STORE,
    BudgetGate,
    ChargeSchedule,
    open_ledger,
)
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.engine.pipeline import (
    EventColumns,
    QueryPipeline,
    check_noise_epoch,
)
from dpstream.processor.engine.runner import Engine, Fired, QueryRunner
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer, keep_tables_in
from dpstream.state.noise_tables import TABLE_DIR_ENV, NoiseTableDirectory
from dpstream.state.store import PartitionStores, WriteBatch
from dpstream.state.tables import ClockState, EpochMarks, IntegerMark, TextMark
from dpstream.topics.decoding import decoder_for
from dpstream.topics.records import (
    EventParser,
    InvalidRecord,
    dead_letter,
    encode_json,
)

CHUNK_LINES = 50_000
MAX_REPORTED_INVALID = 100
#: refusals the log does not list line by line (a file's late or future events are often
#: thousands): the summary counts them once; --dead-letter keeps each (docs/operations.md,
#: "Trying it with a file")
QUIET_REASONS = ("late:", "future:")
PROGRESS_SECONDS = 5.0
#: held-back events kept per privacy unit and stream; beyond it, further ones are dead-lettered at once
MAX_HELD_PER_UNIT = 1_000
#: the clock follows the TOP_UNITS-th latest privacy unit: one unit alone never moves it
TOP_UNITS = 2
#: micro-batch sequence numbers of the end-of-input step (above any line number)
SETTLE_SEQ = 1 << 56


@dataclass
class ReplaySummary:
    lines: int = 0
    invalid: Counter = field(default_factory=Counter)  # reason -> lines
    releases: int = 0
    triggers_fired: int = 0
    stopped_early: bool = False
    seconds: float = 0.0


@dataclass
class _Held:
    """A valid line of one stream (a query's events or a dynamic query's updates)."""

    line_no: int
    raw: bytes
    ts: int  # event time
    unit: int  # the privacy unit (a user pseudonym; for updates without a unit, the line itself)
    payload: object  # the parsed event or update record


class ReplayClock:
    """The event-time clock of one stream of a replay, with its held events (docs/privacy.md, "Time").

    A *privacy unit* is a user for a DP-SQLP query, and for a dynamic query a ``unit_field`` value,
    or else one update (the neighbour relation of each). Rules, chosen so that no single unit can
    move the clock:

    * an event is accepted when it is dated at most ``max_skew`` after the clock; otherwise it is
      held, and never moves the clock;
    * the clock is the **second-latest** of the units' latest accepted event times: one unit's
      records, however many and however dated, cannot move it past every other unit's;
    * held events are accepted, in arrival order, once the clock comes within ``max_skew`` of
      them; when two units have held events within ``max_skew`` of each other (a gap in the data
      that two units cross, not one record), the clock jumps to the earlier of the first such pair;
    * a unit holds at most ``MAX_HELD_PER_UNIT`` events (beyond, they are refused as future at
      once), so one unit's flood cannot crowd out the others;
    * these rules are re-applied after every accepted or held event, so the outcome depends on
      the input's line order only, not on chunking or on where a run stopped and resumed;
    * at the end of input with a public end (``--until``), the clock walks to it and every held
      event dated up to it is accepted in time order (:meth:`settle`): nothing is lost to a
      sparse stream, and no event's fate depends on another unit's;
    * the clock starts at ``start_ms`` if given, else at the second-earliest of the units'
      earliest event times in the first chunk (the earliest if there is one unit).
    """

    def __init__(self, name: bytes, skew_ms: int, store, start_ms: Optional[int], parse: Callable[[bytes, int], Optional[_Held]]):
        self.skew = skew_ms
        self._state = ClockState(store, name)
        raw = self._state.get()
        self.clock: Optional[int] = start_ms
        #: the two units with the latest accepted events: unit -> its latest accepted time
        self.top: dict[int, int] = {}
        if raw:
            state = json.loads(raw)
            self.clock = state["clock"]
            self.top = {int(u): int(t) for u, t in state["top"]}
        self.held: list[_Held] = []
        for line_no, line in self._state.held():
            held = parse(line, line_no)
            if held is not None:
                self.held.append(held)
        #: each unit's earliest held event time (what the jump rule looks at)
        self._earliest: dict[int, int] = {}
        self._recount()

    def _recount(self) -> None:
        self._earliest = {}
        for h in self.held:
            self._earliest[h.unit] = min(self._earliest.get(h.unit, h.ts), h.ts)

    def save(self, batch: WriteBatch) -> None:
        if self.clock is not None:
            self._state.put(batch, json.dumps({"clock": self.clock, "top": sorted(self.top.items())}).encode())

    def _note(self, unit: int, ts: int) -> None:
        """An accepted event: keep the two latest units, and the clock at the second of them."""
        top = self.top
        if unit in top:
            top[unit] = max(top[unit], ts)
        elif len(top) < TOP_UNITS or ts > min(top.values()):
            top[unit] = ts
            if len(top) > TOP_UNITS:
                del top[min(top, key=top.get)]
        if len(top) == TOP_UNITS:
            self.clock = max(self.clock, min(top.values()))

    def accept(self, fresh: list[_Held], batch: WriteBatch) -> tuple[list[_Held], list[int]]:
        """Held events, then ``fresh`` ones in arrival order, through the rules above. Returns the
        accepted events in acceptance order and the clock when each was accepted."""
        skew, held = self.skew, self.held
        if self.clock is None:
            if not fresh:
                return [], []
            firsts: dict[int, int] = {}
            for h in fresh:
                firsts[h.unit] = min(firsts.get(h.unit, h.ts), h.ts)
            times = sorted(firsts.values())
            self.clock = times[1] if len(times) > 1 else times[0]
        accepted: list[_Held] = []
        prior: list[int] = []
        per_unit: Counter = Counter(h.unit for h in held)

        def take(h: _Held) -> None:
            accepted.append(h)
            prior.append(self.clock)
            self._note(h.unit, h.ts)

        def release_held() -> None:
            while held:
                ready = [h for h in held if h.ts <= self.clock + skew]
                if not ready:
                    jump = self._jump_target()
                    if jump is None or jump <= self.clock:
                        return
                    self.clock = jump
                    continue
                for h in ready:  # in arrival order
                    held.remove(h)
                    per_unit[h.unit] -= 1
                    self._state.release(batch, h.line_no)
                    take(h)
                self._recount()

        # Invariant between events: no held event is within max_skew of the clock and no jump is
        # due. It is restored after every change, so the outcome never depends on where chunks
        # end or where a run was stopped and resumed.
        release_held()
        for h in fresh:
            if h.ts <= self.clock + skew:
                before = self.clock
                take(h)
                if held and self.clock > before:
                    release_held()
            elif per_unit[h.unit] >= MAX_HELD_PER_UNIT:
                accepted.append(h)  # refused downstream as future: one unit's flood of far-future events
                prior.append(self.clock)
            else:
                held.append(h)
                per_unit[h.unit] += 1
                self._state.hold(batch, h.line_no, h.raw)
                earliest = self._earliest.get(h.unit)
                if earliest is None or h.ts < earliest:
                    # the unit's earliest held time moved: maybe two units now cross a gap
                    self._earliest[h.unit] = h.ts
                    release_held()
        return accepted, prior

    def _jump_target(self) -> Optional[int]:
        """The earlier time of the first two units whose earliest held events are within max_skew
        of each other, or None."""
        times = sorted(self._earliest.values())
        for a, b in zip(times, times[1:]):
            if b - a <= self.skew:
                return a
        return None

    def settle(self, until_ms: int, batch: WriteBatch) -> tuple[list[_Held], list[int]]:
        """End of input with a public end (``--until``): the clock walks to ``until_ms``. Held
        events dated up to it are accepted in event-time order, each with the clock at
        ``max(clock, ts - max_skew)``, so none is late and each one's clock depends on its own
        time only, not on any other unit's events. Returns them and those clocks; events dated
        after ``until_ms`` stay held (the caller drains them as future)."""
        if self.clock is None:
            self.clock = until_ms
        accepted, prior, later = [], [], []
        clock = self.clock
        for h in sorted(self.held, key=lambda h: (h.ts, h.line_no)):
            if h.ts > until_ms:
                later.append(h)
                continue
            clock = max(clock, h.ts - self.skew)
            accepted.append(h)
            prior.append(clock)
            self._state.release(batch, h.line_no)
        self.held = sorted(later, key=lambda h: h.line_no)
        self._recount()
        self.clock = max(clock, until_ms)
        return accepted, prior

    def drain(self, batch: WriteBatch) -> list[_Held]:
        """End of input: the events still held (dead-lettered as future by the caller)."""
        out, self.held = self.held, []
        self._earliest = {}
        for h in out:
            self._state.release(batch, h.line_no)
        return out


def _open_lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        yield from fh


class _LinesDigest:
    """SHA-256, bytes and count of a file's first lines (about 0.3 us a line: hashing blocks of
    lines instead was no faster). Each line counts with its newline, added to a last line read
    without one: it then matches the same line once the file has grown past it."""

    def __init__(self) -> None:
        self.sha256, self.size, self.lines = hashlib.sha256(), 0, 0

    def add(self, raw: bytes) -> None:
        if not raw.endswith(b"\n"):  # only a file's last line lacks it
            raw += b"\n"
        self.sha256.update(raw)
        self.size += len(raw)
        self.lines += 1

    def prefix(self, earlier: int, path: str) -> "InputPrefix":
        return InputPrefix(earlier, self.lines, self.size, self.sha256.hexdigest(), path)


@dataclass
class InputPrefix:
    """What a state directory covers of its current input file (meta ``input-prefix``, written in
    the same batch as the lines consumed): ``earlier`` lines of the inputs before it (``--append``),
    then its first ``lines`` lines, ``size`` bytes (decompressed, newline-terminated) with SHA-256
    ``sha256``. ``path`` is the file as given, only to name it in a refusal."""

    earlier: int
    lines: int
    size: int
    sha256: str
    path: str

    def encode(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> "InputPrefix":
        return cls(**json.loads(text))


@dataclass
class _ResumePoint:
    """Where a run reads its input from: stream lines of the inputs before this file (a line's
    number is ``earlier`` plus its line in the file) and the file's lines the state already covers."""

    earlier: int
    skip: int
    expected: Optional[InputPrefix]  # the fingerprint of the skipped lines (None: nothing to check)


class ReplayError(ConfigError):
    """A replay cannot run as asked; the message names the option."""


class ReplayRunner:
    def __init__(self, config: DpstreamConfig, secret: bytes, state_dir: Optional[str], log: TextIO = sys.stderr,
                 noise_label: Optional[str] = None, start_ms: Optional[int] = None):
        self.config = config
        self.log = log
        self.state_dir = state_dir
        #: (input, append, where to read from) as checked by check_input, for the next run
        self._resume: Optional[tuple[str, bool, _ResumePoint]] = None
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dpstream-state-")
            state_dir = self._tmp.name
        self.stores = PartitionStores(state_dir)
        # sampler tables kept in the state directory given (or $DPSTREAM_NOISE_TABLE_DIR), as the worker does
        if self.state_dir is not None or os.environ.get(TABLE_DIR_ENV):
            keep_tables_in(NoiseTableDirectory.for_state(state_dir))
        try:
            self._open(config, secret, noise_label, start_ms)
        except BaseException:
            self.close()  # a refusal (another plan, label, secret) leaves the state directory usable
            raise

    def _open(self, config: DpstreamConfig, secret: bytes, noise_label: Optional[str], start_ms: Optional[int]) -> None:
        self.store = self.stores.store(0)
        self.noise = NodeNoise(secret, self._noise_label(noise_label))
        #: what every release says about the run that made it: its noise label (docs/user-guide.md)
        self.run_fields = {"run": {"noise_label": self.noise.label}}
        self.pseudonyms = Pseudonymizer(secret)
        self._check_epoch()
        self.pipelines = [QueryPipeline(q, self.noise, self.store, self.pseudonyms, index=i) for i, q in enumerate(config.queries)]
        self.engine = Engine(self.pipelines)
        # replay reads JSON lines: input_format's schema-registry formats are the worker's Kafka input
        # (the same events as JSON replay to the same releases: tests/test_decoding.py)
        self.decoder = decoder_for("json")
        self.parsers = [EventParser.for_query(q) for q in config.queries]
        self.dynamic = [DynamicQueryState(q, self.noise, self.pseudonyms, self.store, index=i) for i, q in enumerate(config.dynamic)]
        self.start_ms = start_ms
        self.ledger = open_ledger(config, self.stores.store(LEDGER_STORE))
        self.charges: Optional[ChargeSchedule] = None
        if self.ledger is not None:
            start = start_ms if start_ms is not None else config.budget.start_ms
            if start is None:
                raise ReplayError("--start: the config has a budget ledger, which charges every window on a public schedule, "
                                  "data or not: give the replay's start (--start TIME, or budget.start in the config) and its "
                                  "end (--until TIME)")
            gate = BudgetGate(config, self.ledger)
            for pipe in self.pipelines:
                pipe.set_schedule(gate.window_gate(pipe.query), start)
            # the worker's one charge order (window start, then config order): the same ledger
            self.charges = ChargeSchedule(gate, config.queries, start, self.stores.store(LEDGER_STORE))
            for dyn in self.dynamic:
                dyn.refused = not gate.start_dynamic(dyn.query)
        # one event-time clock per stream: each DP-SQLP query's events, each dynamic query's updates
        self.clocks = [ReplayClock(p.tables.qid, p.schedule.max_skew, self.store, start_ms, self._event_parser(q))
                       for q, p in enumerate(self.pipelines)]
        self.dynamic_clocks = [ReplayClock(b"dyn" + d.qid, d.query.max_skew_ms, self.store,
                                           start_ms if start_ms is not None else d.query.start, self._update_parser(d))
                               for d in self.dynamic]

    def _noise_label(self, given: Optional[str]) -> str:
        """The run's noise label: the one this state directory was written with, else ``given``,
        else a fresh random one (stored with the state by the epoch check)."""
        stored = EpochMarks(self.store).label()
        if stored is not None:
            if given is not None and given != stored:
                raise ReplayError("--noise-label: this state directory was written under another noise label; resume it "
                                  "without --noise-label (or with its own), or use a new state directory")
            return stored
        return given if given is not None else os.urandom(16).hex()

    @property
    def noise_label(self) -> str:
        return self.noise.label

    def _check_epoch(self) -> None:
        check_noise_epoch(self.store, self.noise)

    def close(self) -> None:
        self.stores.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -------------------------------------------------------------- parsing into stream events
    def _event_parser(self, q: int) -> Callable[[bytes, int], Optional[_Held]]:
        parser = self.parsers[q]

        def parse(raw: bytes, line_no: int, obj=None) -> Optional[_Held]:
            event = parser.from_mapping(obj if obj is not None else self.decoder.decode([raw])[0])
            if isinstance(event, InvalidRecord):
                return None
            return _Held(line_no, raw, event.ts, int(self.pseudonyms.users([event.user])[0]), event)
        return parse

    def _update_parser(self, dyn: DynamicQueryState) -> Callable[[bytes, int], Optional[_Held]]:
        def parse(raw: bytes, line_no: int, obj=None) -> Optional[_Held]:
            obj = self.decoder.decode([raw])[0] if obj is None else obj
            updates = dyn.parse(obj)
            if isinstance(updates, InvalidRecord) or not updates:
                return None  # taken (or refused) at once by DynamicQueryState.apply: no time to wait for
            # the privacy unit: the unit field's value, or else the record itself (one line)
            first = updates[0]
            who = int(self.pseudonyms.users([first.unit])[0]) if first.unit is not None else -line_no
            return _Held(line_no, raw, first.ts, who, updates)
        return parse

    # -------------------------------------------------------------- meta
    @property
    def _lines(self) -> IntegerMark:
        """Input lines the state covers (replay's input position)."""
        return IntegerMark(self.store, b"lines")

    @property
    def lines_consumed(self) -> int:
        """Input lines a previous run on this state directory already covered (0: a fresh one)."""
        return self._lines.get(0)

    @property
    def _input_prefix(self) -> TextMark:
        """The fingerprint of the input lines the state covers (:class:`InputPrefix`)."""
        return TextMark(self.store, b"input-prefix")

    def check_input(self, input_path: str, append: bool = False) -> None:
        """Refuse an input that is not the one this state directory consumed, before anything is
        read, republished or charged (:meth:`run` calls it; the CLI calls it before opening its
        output). The input must start with the lines consumed, byte for byte; it may have grown.
        ``append``: the file continues the stream after them and is read from its first line."""
        if not Path(input_path).is_file():
            raise ReplayError(f"--input: {input_path}: no such file")
        consumed = self._lines.get(0)
        stored = self._input_prefix.get()
        if consumed == 0 or append:
            self._resume = (input_path, append, _ResumePoint(consumed, 0, None))
            return
        if stored is None:
            # written before inputs were fingerprinted: the count is all there is to go on
            self.log.write(f"replay: state directory {self.state_dir} has no fingerprint of its input (written by an older "
                           f"dpstream): assuming {input_path} is the input whose first {consumed:,} lines it covers\n")
            self._resume = (input_path, append, _ResumePoint(0, consumed, None))
            return
        expected = InputPrefix.decode(stored)
        found = self._fingerprint(Path(input_path), expected.lines)
        if (found.lines, found.size, found.sha256) != (expected.lines, expected.size, expected.sha256):
            how = (f"has only {found.lines:,} lines" if found.lines < expected.lines
                   else f"differs from it in its first {expected.lines:,} lines")
            raise ReplayError(f"--input: state directory {self.state_dir} covers the first {expected.lines:,} lines of "
                              f"{expected.path}, and {input_path} {how}; resume with that input (it may have grown), use a "
                              f"new --state-dir, or give --append if {input_path} continues the stream after those lines")
        self._resume = (input_path, append, _ResumePoint(expected.earlier, expected.lines, expected))

    @staticmethod
    def _fingerprint(path: Path, lines: int) -> InputPrefix:
        """The fingerprint of the first ``lines`` lines of ``path`` (fewer if it is shorter)."""
        digest = _LinesDigest()
        if lines > 0:
            for raw in _open_lines(path):
                digest.add(raw)
                if digest.lines == lines:
                    break
        return digest.prefix(0, str(path))

    # -------------------------------------------------------------- run
    def run(self, input_path: str, output: TextIO, dead_letters: Optional[TextIO] = None,
            stop_after_lines: Optional[int] = None, on_progress: Optional[Callable[[str], None]] = None,
            until_ms: Optional[int] = None, append: bool = False) -> ReplaySummary:
        """Read ``input_path`` on from where the state stands (``append``: the file continues the
        stream; its first line is the stream's next). Line numbers (reports, dead letters,
        ``stop_after_lines``) count along the stream, from the first input's first line."""
        if self.ledger is not None and until_ms is None:
            raise ReplayError("--until: the config has a budget ledger; give the replay's public end (--until TIME) so that "
                              "the windows charged do not depend on the data's time span")
        if self._resume is None or self._resume[:2] != (input_path, append):
            self.check_input(input_path, append)
        at, self._resume = self._resume[2], None
        summary = ReplaySummary()
        started = time.perf_counter()
        self._republish(output, summary)
        consumed = self._lines.get(0)
        self._reported = 0
        last_progress = time.perf_counter()
        file_line = 0
        digest = _LinesDigest()  # of the file's lines read so far (InputPrefix)
        chunk: list[tuple[int, bytes]] = []

        def flush():
            if not chunk:
                return
            batch = self._process_chunk(chunk, summary, dead_letters, until_ms)
            # bounded records, user slots, logged updates, lines consumed, clocks and held
            # events: one atomic write
            self._lines.put(batch, chunk[-1][0])
            self._input_prefix.put(batch, digest.prefix(at.earlier, input_path).encode())
            for clock in self.clocks + self.dynamic_clocks:
                clock.save(batch)
            self.store.write(batch)
            chunk.clear()
            self._advance_dynamic([c.clock for c in self.dynamic_clocks], output, summary)
            clocks = [c.clock for c in self.clocks]
            if self.charges is not None and any(c is not None for c in clocks):
                self.charges.charge_due(max(c for c in clocks if c is not None))
            self.engine.open_due(clocks)
            self._publish(self.engine.fire_due(clocks), output, summary)

        for raw in _open_lines(Path(input_path)):
            file_line += 1
            line_no = at.earlier + file_line
            if file_line > at.skip and stop_after_lines is not None and line_no > stop_after_lines:
                summary.stopped_early = True
                break
            digest.add(raw)
            if file_line <= at.skip:
                if file_line == at.skip and at.expected is not None and digest.sha256.hexdigest() != at.expected.sha256:
                    raise ReplayError(f"--input: {input_path} changed while it was being read; run again")
                continue
            chunk.append((line_no, raw))
            if len(chunk) >= CHUNK_LINES:
                flush()
                if on_progress and time.perf_counter() - last_progress > PROGRESS_SECONDS:
                    last_progress = time.perf_counter()
                    on_progress(self._progress_line(line_no, summary))
        if file_line < at.skip and at.expected is not None:
            raise ReplayError(f"--input: {input_path} changed while it was being read; run again")
        flush()
        summary.lines = max(at.earlier + file_line, consumed) if not summary.stopped_early else stop_after_lines
        if not summary.stopped_early:
            self._finish(output, summary, dead_letters, until_ms)
        summary.seconds = time.perf_counter() - started
        return summary

    def _finish(self, output, summary, dead_letters, until_ms) -> None:
        """End of input. With ``until_ms`` the clocks walk to it, accepting the held events dated up
        to it; without, every held event is future."""
        batch = WriteBatch()
        if until_ms is not None:
            # the clocks walk to the public end: held events dated up to it are accepted
            # (ReplayClock.settle); micro-batch blobs of this step get a sequence number no input
            # line can have, so a later run on this state never overwrites them
            seq = SETTLE_SEQ + self._lines.get(0)
            for runner, clock in zip(self.engine.runners, self.clocks):
                accepted, prior = clock.settle(until_ms, batch)
                self._feed_events(runner, accepted, prior, seq, batch, summary, dead_letters)
            for dyn, clock in zip(self.dynamic, self.dynamic_clocks):
                accepted, prior = clock.settle(until_ms, batch)
                self._feed_updates(dyn, accepted, prior, batch, summary, dead_letters)
        streams = [(pipe.query, pipe.stats, clock) for pipe, clock in zip(self.pipelines, self.clocks)]
        streams += [(dyn.query, dyn, clock) for dyn, clock in zip(self.dynamic, self.dynamic_clocks)]
        for query, stats, clock in streams:
            for held in clock.drain(batch):
                self._invalid(query.name, f"future: field {query.time_field!r} is more than {query.max_skew} after the "
                              f"replay's clock", held.line_no, held.raw, summary, dead_letters)
                stats.dropped["future"] += 1
                if isinstance(stats, DynamicQueryState):
                    stats.updates_in += 1
                else:
                    stats.events_in += 1
        if until_ms is not None:
            for clock in self.clocks + self.dynamic_clocks:
                clock.clock = until_ms if clock.clock is None else max(clock.clock, until_ms)
                clock.save(batch)
        self.store.write(batch)
        if until_ms is not None:
            if self.charges is not None:
                self.charges.charge_due(until_ms - 1)
            self.engine.open_due([until_ms - 1] * len(self.pipelines))  # windows that start before the end
            self._publish(self.engine.fire_due([until_ms] * len(self.pipelines)), output, summary)
            self._advance_dynamic([until_ms] * len(self.dynamic), output, summary)
        else:
            self._publish(self.engine.fire_all(), output, summary)
            # dynamic queries stop at their last update: data-derived, documented (--until is public)
            ends = []
            for dyn in self.dynamic:
                last = dyn.last_waiting_tick()
                ends.append(dyn.query.start + last * dyn.query.tick_ms + dyn.query.lateness_ms)
            self._advance_dynamic(ends, output, summary)

    def _progress_line(self, line_no: int, summary: ReplaySummary) -> str:
        return (f"replay: {line_no:,} lines read, {sum(summary.invalid.values()):,} invalid, "
                f"{summary.triggers_fired:,} triggers fired, {summary.releases:,} releases")

    def _process_chunk(self, chunk, summary, dead_letters, until_ms) -> WriteBatch:
        parsed = self.decoder.decode([raw for _, raw in chunk])  # once for every query
        seq = chunk[0][0]
        batch = WriteBatch()
        for q, (pipe, parser, clock) in enumerate(zip(self.pipelines, self.parsers, self.clocks)):
            fresh: list[_Held] = []
            for (line_no, raw), obj in zip(chunk, parsed):
                event = obj if isinstance(obj, InvalidRecord) else parser.from_mapping(obj)
                if isinstance(event, InvalidRecord):
                    self._invalid(pipe.query.name, event.reason, line_no, raw, summary, dead_letters)
                    continue
                if until_ms is not None and event.ts > until_ms:
                    pipe.stats.events_in += 1
                    pipe.stats.dropped["future"] += 1
                    self._invalid(pipe.query.name, f"future: field {pipe.query.time_field!r} is after the replay's end "
                                  f"(--until)", line_no, raw, summary, dead_letters)
                    continue
                fresh.append(_Held(line_no, raw.rstrip(b"\n"), event.ts, 0, event))
            if fresh:
                users = self.pseudonyms.users([h.payload.user for h in fresh])
                for h, u in zip(fresh, users.tolist()):
                    h.unit = u
            accepted, prior = clock.accept(fresh, batch)
            self._feed_events(self.engine.runners[q], accepted, prior, seq, batch, summary, dead_letters)
        for dyn, clock in zip(self.dynamic, self.dynamic_clocks):
            fresh = []
            for (line_no, raw), obj in zip(chunk, parsed):
                held = self._update_parser(dyn)(raw.rstrip(b"\n"), line_no, obj) if not isinstance(obj, InvalidRecord) else None
                if held is None or (until_ms is not None and held.ts > until_ms):
                    reason = dyn.apply(obj, batch) if held is None else None
                    if held is not None:  # after the public end
                        dyn.updates_in += 1
                        dyn.dropped["future"] += 1
                        reason = f"future: field {dyn.query.time_field!r} is after the replay's end (--until)"
                    if reason is not None:
                        self._invalid(dyn.query.name, reason, line_no, raw, summary, dead_letters)
                    continue
                fresh.append(held)
            accepted, prior = clock.accept(fresh, batch)
            self._feed_updates(dyn, accepted, prior, batch, summary, dead_letters)
        return batch

    def _feed_events(self, runner: QueryRunner, accepted: list[_Held], prior: list[int], seq: int, batch: WriteBatch,
                     summary, dead_letters) -> None:
        """Events a clock accepted (with the clock at each one's acceptance): bounded and appended
        to their micro-batches; refusals dead-lettered."""
        if not accepted:
            return
        events = [h.payload for h in accepted]
        keys = [e.key for e in events]
        columns = EventColumns(np.array([h.unit for h in accepted], dtype=np.uint64), np.array(keys, dtype=object),
                               self.pseudonyms.group_keys(keys), np.array([e.value for e in events], dtype=np.float64),
                               np.array([e.ts for e in events], dtype=np.int64))
        refused_events, refused_keys = runner.ingest(columns, np.array(prior, dtype=np.int64), seq, batch)
        for e, reason in refused_events:
            self._invalid(runner.query.name, reason, accepted[e].line_no, accepted[e].raw, summary, dead_letters)
        for text, reason in refused_keys:
            self._invalid(runner.query.name, reason, seq, text.encode(), summary, dead_letters)

    def _feed_updates(self, dyn: DynamicQueryState, accepted: list[_Held], prior: list[int], batch: WriteBatch,
                      summary, dead_letters) -> None:
        reasons = dyn.apply_parsed([h.payload for h in accepted], batch, prior) if accepted else []
        for h, reason in zip(accepted, reasons):
            if reason is not None:
                self._invalid(dyn.query.name, reason, h.line_no, h.raw, summary, dead_letters)

    def _invalid(self, query: str, reason: str, line_no: int, raw: bytes, summary, dead_letters) -> None:
        summary.invalid[f"{query}: {reason}"] += 1
        if not reason.startswith(QUIET_REASONS):  # those: a matter of time, said once with their count (the summary)
            if self._reported < MAX_REPORTED_INVALID:
                self.log.write(f"line {line_no}: query {query}: {reason}\n")
            elif self._reported == MAX_REPORTED_INVALID:
                self.log.write("(further invalid lines are counted, not shown)\n")
            self._reported += 1
        if dead_letters is not None:
            dead_letters.write(encode_json({"query": query, **dead_letter(reason, raw.rstrip(b"\n"), f"line {line_no}")}).decode() + "\n")

    def _publish_dynamic(self, output: TextIO, summary: ReplaySummary) -> None:
        batch = WriteBatch()
        for dyn in self.dynamic:
            records = dyn.take_pending()
            for record in records:
                output.write(encode_json({**record, **self.run_fields}).decode() + "\n")
            summary.releases += len(records)
            dyn.mark_published(batch)
        if len(batch):
            output.flush()
            self.store.write(batch)

    def _advance_dynamic(self, clocks: list, output: TextIO, summary: ReplaySummary) -> None:
        """Decide every dynamic tick its clock has passed, updates or not; publish."""
        batch = WriteBatch()
        for dyn, clock in zip(self.dynamic, clocks):
            if clock is not None:
                dyn.advance_clock(clock, batch)
        if len(batch):
            self.store.write(batch)
        self._publish_dynamic(output, summary)

    def _publish(self, fired: Iterable[Fired], output: TextIO, summary: ReplaySummary, republished: bool = False) -> None:
        """Each trigger's releases to the output, then marked published (in that order: a crash in
        between republishes them from the journal, identical)."""
        for f in fired:
            for record in f.releases:
                output.write(encode_json({**record, **self.run_fields}).decode() + "\n")
            output.flush()
            summary.releases += len(f.releases)
            summary.triggers_fired += 0 if republished else 1
            f.runner.published(f)

    def _republish(self, output: TextIO, summary: ReplaySummary) -> None:
        """Releases journaled by a previous run but not yet written to the output."""
        self._publish(self.engine.unpublished(), output, summary, republished=True)
        self._publish_dynamic(output, summary)
