"""The run of an application's workers: the random nonce in their noise label (docs/privacy.md,
"Noise"; docs/operator-guide.md, "Start over").

A worker's noise label is ``worker:<app id>:<epoch>:<run nonce>``
(:func:`dpstream.processor.adapters.worker.worker_noise_label`). The epoch and the start-over
count live in the configuration and in ``dpstream-epochs``; without the nonce, a start that lost
both the state directory and ``dpstream-epochs`` (a new cluster, a mirror without the internal
topics) under the same app id and secret took the old label again, and released new data with
the noise of released values: their difference is the exact data difference.

Where the nonce lives: the state directory (:data:`dpstream.processor.adapters.worker.RUN_FILE`,
written with the layout) and ``dpstream-epochs`` under the key ``<app id>/run/<nonce>``. Every
worker of an application must draw the same noise (elastic workers move partitions, and their
trees, between each other), and they may start at the same moment on a new application (the
chart starts pods in parallel). So a worker that finds no run in the topic proposes one: it
appends its proposal (each under its own key, so compaction keeps them all, in log order) and
reads the one-partition topic back; the first proposal in log order is the run, for every worker
alike. No worker can see a proposal before the first one, and every worker reads up to its own.

:func:`agree_run` decides, in this order:

* the topic names a run: this worker joins it. A state directory of another run is refused (its
  trees carry other noise). An empty state directory under a run that was *restored* (below) is
  refused for a static worker: the epoch marks that told a lost volume from a new one are gone;
* the state directory names a run and the topic none (its record was lost): the run is
  recorded again, ``restored``. Elastic workers keep their state in the changelog topics: a
  missing or empty one means the state is lost, refused;
* this application's epoch marks of this epoch exist without a run: a run begun before run
  nonces (dpstream 0.1.0), which keeps its label;
* neither: a fresh start. If an output topic holds releases of this application for a window
  still open (:func:`find_live_release`), it is refused: the state that knew the budget spent on
  that window is gone, and a fresh start would release it again. Otherwise a new nonce is proposed.

Kafka only, no Faust: :func:`dpstream.processor.adapters.faust_app.build_app` calls
:func:`agree_run` before it opens the state.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dpstream.processor.adapters.worker import (
    LostStateError,
    StateLayoutError,
    epoch_mark,
    lost_state_message,
    new_run_nonce,
    run_mismatch_message,
    stored_run_nonce,
    worker_epoch,
)
from dpstream.processor.config import DpstreamConfig
from dpstream.processor.mechanisms.noise import NodeNoise
from dpstream.topics.kafka import (
    EPOCH_TOPIC,
    changelog_topic,
    client_security,
    read_compacted,
    read_up_to,
    repartition_topic,
    restarts_key,
    write_epoch_mark,
)
from dpstream.topics.records import iso_utc

if TYPE_CHECKING:
    from dpstream.processor.adapters.faust_app import WorkerSettings

log = logging.getLogger("dpstream.worker")

#: ms the clock of the worker that stamped a release and this one's may differ: the output
#: topic is read from this much before the earliest time a release of an open window can have
RELEASE_CLOCK_MARGIN_MS = 60_000
#: s to read the recent part of the output topics
OUTPUT_READ_TIMEOUT_S = 60.0


class LiveOutputError(StateLayoutError):
    """A fresh start (no run in the state directory nor in ``dpstream-epochs``) while an output
    topic holds this application's releases for a window still open."""


@dataclass(frozen=True)
class RunChoice:
    """The run a worker starts under: its nonce and how it was found (for the start's log line)."""

    nonce: str
    #: fresh (a new run), joined (the application's, from dpstream-epochs), kept (this state
    #: directory's, as the topic says), restored (this state directory's, recorded again), legacy
    how: str

    def log_line(self, label: str) -> str:
        said = {"fresh": "a new run", "joined": "the application's run in dpstream-epochs",
                "kept": "this state directory's run", "restored": "this state directory's run, recorded again in "
                "dpstream-epochs (its record there was gone)", "legacy": "a run begun before run nonces"}[self.how]
        return (f"noise label {label} ({said}); `dpstream replay --noise-label {label}` reproduces this worker's releases "
                f"(docs/privacy.md, \"Noise\")")


def run_key(app_id: str, nonce: str) -> str:
    """The ``dpstream-epochs`` key of a run's proposal (each its own key: compaction keeps them all)."""
    return f"{app_id}/run/{nonce or 'legacy'}"


def runs_of(marks: dict[str, dict], app_id: str) -> list[dict]:
    """The run proposals of an application in ``marks`` (:func:`dpstream.topics.kafka.read_compacted`:
    keys in the order of their first record), in log order: the first is the run."""
    prefix = f"{app_id}/run/"
    return [value for key, value in marks.items() if key.startswith(prefix) and isinstance(value, dict) and "nonce" in value]


def legacy_run(marks: dict[str, dict], app_id: str, mark: dict) -> bool:
    """Whether this application's workers ran under this epoch before run nonces: an epoch mark
    (``<app id>/<index>`` or ``<app id>/group``) of the same budget epoch, secret and start-over
    count, without a run."""
    for key, value in marks.items():
        if not key.startswith(f"{app_id}/") or key == restarts_key(app_id) or key.startswith(f"{app_id}/run/"):
            continue
        if isinstance(value, dict) and "run" not in value and all(value.get(k) == v for k, v in mark.items()):
            return True
    return False


def agree_run(broker: str, s: "WorkerSettings", marks: dict[str, dict], restarts: int,
              now_ms: Optional[int] = None) -> RunChoice:
    """Blocking: the run nonce this worker starts under (the module's rules), agreed with the
    application's other workers through ``dpstream-epochs`` (``marks``: as read at start).
    Raises :class:`LiveOutputError`, :class:`LostStateError` or :class:`StateLayoutError`
    (refusals: the operator must act)."""
    stored = stored_run_nonce(s.state_dir)
    runs = runs_of(marks, s.app_id)
    if runs:
        return _join(runs, stored, s, "kept" if stored is not None else "joined")
    # the epoch mark this worker writes, without its run (the secret's fingerprint: public)
    legacy = legacy_run(marks, s.app_id, epoch_mark(s.config, NodeNoise(s.secret), restarts))
    if stored is not None and not (stored == "" and legacy):
        if s.assignment == "group":
            _check_changelogs_kept(broker, s, restarts, stored)
        return _propose(broker, s, stored, stored, {"restored": True}, "restored")
    if legacy:
        return _propose(broker, s, stored, "", {"legacy": True}, "legacy")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    live = find_live_release(broker, s.app_id, s.config, restarts, now_ms)
    if live is not None:
        raise LiveOutputError(live_output_message(*live, s.app_id))
    return _propose(broker, s, None, new_run_nonce(), {}, "fresh")


def _join(runs: list[dict], stored: Optional[str], s: "WorkerSettings", how: str) -> RunChoice:
    run = runs[0]
    nonce = str(run["nonce"])
    if stored is not None and stored != nonce:
        raise StateLayoutError(run_mismatch_message(Path(s.state_dir), stored, nonce, s.app_id, s.config))
    if stored is None and run.get("restored") and s.assignment != "group":
        raise LostStateError(lost_state_message(
            f"state directory {s.state_dir} is empty, and the run of application {s.app_id!r} (nonce {nonce}) was recorded "
            f"again in {EPOCH_TOPIC} from another worker's state directory after its epoch marks were lost: whether worker "
            f"{s.ownership.index} already ran under it can no longer be told, so its state is taken as lost", s.app_id, s.config))
    return RunChoice(nonce, how)


def _propose(broker: str, s: "WorkerSettings", stored: Optional[str], nonce: str, extra: dict, how: str) -> RunChoice:
    """Append a proposal, read the application's proposals back: the first in log order is the run."""
    write_epoch_mark(broker, run_key(s.app_id, nonce), {"nonce": nonce, "since_ms": int(time.time() * 1000), **extra})
    runs = runs_of(read_compacted(broker, EPOCH_TOPIC, f"{s.app_id}/run/"), s.app_id)
    if not runs:  # our own proposal is below the end the read went to
        raise RuntimeError(f"{EPOCH_TOPIC}: the run proposed for application {s.app_id!r} was not read back")
    if str(runs[0]["nonce"]) == nonce:
        return RunChoice(nonce, how)
    return _join(runs, stored, s, "kept" if stored is not None else "joined")  # another worker's came first


def _check_changelogs_kept(broker: str, s: "WorkerSettings", restarts: int, stored: str) -> None:
    """Elastic workers keep their state in the changelog topics (the state directory is a cache):
    a run recorded again from a state directory must still have them, each holding records."""
    from confluent_kafka import Consumer, TopicPartition

    epoch = worker_epoch(s.config, restarts)
    sources = dict.fromkeys([*(q.input_topic for q in s.config.queries),
                             *(repartition_topic(q.name, s.app_id, epoch) for q in s.config.queries),
                             *(q.input_topic for q in s.config.dynamic)])
    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-run-check", "enable.auto.commit": False,
                         **client_security()})
    try:
        topics = consumer.list_topics(timeout=15).topics
        for source in sources:
            name = changelog_topic(s.app_id, epoch, source)
            meta = topics.get(name)
            held = 0
            if meta is not None and meta.error is None:
                for p in meta.partitions:
                    low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=15)
                    held += high - low
            if not held:
                raise LostStateError(lost_state_message(
                    f"the run of application {s.app_id!r} in state directory {s.state_dir} (nonce {stored or 'none'}) has no "
                    f"record in {EPOCH_TOPIC} any more, and its changelog topic {name}, which holds the elastic workers' state, "
                    f"is {'empty' if meta is not None else 'gone'}: the application's internal topics were lost, and its state "
                    f"with them", s.app_id, s.config))
    finally:
        consumer.close()


# ---------------------------------------------------------------------- a fresh start over live output
def _lookbacks(config: DpstreamConfig) -> dict[str, int]:
    """Per output topic, how far back (ms) a release of a window still open can have been
    published: a window's releases come from its first trigger on, and it is open until its end
    plus the allowed lateness; a dynamic query's releases come at least once per tick after
    its lateness. Plus :data:`RELEASE_CLOCK_MARGIN_MS`."""
    out: dict[str, int] = {}
    for q in config.queries:
        out[q.output_topic] = max(out.get(q.output_topic, 0), q.window_ms + _lateness_ms(q))
    for q in config.dynamic:
        out[q.output_topic] = max(out.get(q.output_topic, 0), q.tick_ms + q.lateness_ms)
    return {topic: ms + RELEASE_CLOCK_MARGIN_MS for topic, ms in out.items()}


def _lateness_ms(query) -> int:
    from dpstream.processor.config import parse_duration_ms

    return parse_duration_ms(query.allowed_lateness, allow_zero=True)


def live_release(record: object, topic: str, app_id: str, config: DpstreamConfig, restarts: int,
                 now_ms: int) -> Optional[tuple[str, Optional[int]]]:
    """Whether ``record``, read from output ``topic``, is a release of this application's run
    for a window still open at ``now_ms``: (what it is, when its window closes; None for a
    dynamic query's continual counts), else None. Releases of another application, of another
    budget epoch, of a run started over since (``dpstream reset`` counts start-overs: they
    chose a second release) and records that do not say which run made them are not."""
    if not isinstance(record, dict) or record.get("app_id") != app_id or not isinstance(record.get("run"), dict):
        return None
    run = record["run"]
    budget_epoch = config.budget.epoch if config.budget is not None else "1"
    if run.get("budget_epoch") != budget_epoch or not isinstance(run.get("restarts"), int) or run["restarts"] < restarts:
        return None
    name = record.get("query")
    for q in config.queries:
        if q.name == name and q.output_topic == topic and isinstance(record.get("window_end"), int):
            closes = record["window_end"] + _lateness_ms(q)
            if closes > now_ms:
                return (f"window {iso_utc(record['window_start'])} to {iso_utc(record['window_end'])} of query {name} "
                        f"(open until {iso_utc(closes)})", closes)
    for q in config.dynamic:
        if q.name == name and q.output_topic == topic:
            return f"dynamic query {name} (its counts are continual: a fresh start would release every tick again)", None
    return None


def find_live_release(broker: str, app_id: str, config: DpstreamConfig, restarts: int,
                      now_ms: int) -> Optional[tuple[str, str, Optional[int]]]:
    """The first release of this application for a window still open (:func:`live_release`) in
    the recent part of the output topics, as (topic, what, closes), or None. Each partition is
    read from the offset of the time :func:`_lookbacks` gives (``offsets_for_times``), never the
    whole topic, up to its end when the read began; ``read_uncommitted``: a release in an aborted
    transaction was computed with the run's noise all the same."""
    from confluent_kafka import Consumer, TopicPartition

    from dpstream.processor.adapters.output_claims import once_leaders_are_elected

    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-live-releases", "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted", "enable.partition.eof": True, **client_security()})
    try:
        existing = consumer.list_topics(timeout=15).topics
        for topic, lookback in sorted(_lookbacks(config).items()):
            if topic not in existing or existing[topic].error is not None:
                continue  # a new output topic: nothing released yet
            asked = [TopicPartition(topic, p, now_ms - lookback) for p in sorted(existing[topic].partitions)]
            # the topic may be one another worker of a new application has just created
            starts = [tp for tp in once_leaders_are_elected(lambda: consumer.offsets_for_times(asked, timeout=15)) if tp.offset >= 0]
            ends = {tp.partition: once_leaders_are_elected(
                lambda tp=tp: consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=15))[1] for tp in starts}
            todo = {tp.partition for tp in starts if tp.offset < ends[tp.partition]}
            if not todo:
                continue
            consumer.assign([tp for tp in starts if tp.partition in todo])
            for msg in read_up_to(consumer, topic, {p: ends[p] for p in todo}, OUTPUT_READ_TIMEOUT_S,
                                  f"output topic {topic} back {lookback} ms"):
                try:
                    record = json.loads(msg.value())
                except (TypeError, ValueError):
                    continue  # not a release (another producer's record)
                live = live_release(record, topic, app_id, config, restarts, now_ms)
                if live is not None:
                    return topic, *live
            consumer.unassign()
        return None
    finally:
        consumer.close()


def live_output_message(topic: str, what: str, closes: Optional[int], app_id: str) -> str:
    """The refusal of a fresh start over live output: what is open, and the ways on."""
    wait = f"wait until the window closes ({iso_utc(closes)}) and start again, or " if closes is not None else ""
    return (f"output topic {topic} holds releases of application {app_id!r} for {what}, but this worker found the "
            f"application's run neither in its state directory nor in {EPOCH_TOPIC}: the state and the epoch marks were "
            f"lost (a new cluster? a mirror without the internal topics?). Starting afresh would release that window again "
            f"under a budget it forgot, so it is refused. To go on, {wait}start over on purpose: `dpstream reset --config "
            f"CONFIG --app-id {app_id} --state-dir DIR --broker BROKER --yes` (counts a start-over: the earlier run's releases "
            f"no longer hold a start back), or use a new application id (--app-id {app_id}-2) with output topics of its own "
            f"(docs/operations.md, \"Output topics\"). See docs/operator-guide.md, "
            f"\"Start over\"")
