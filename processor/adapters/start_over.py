"""``dpstream reset``: start an application over on purpose (docs/operator-guide.md, "Start over").

A worker refuses an empty state directory when it already ran under the same epoch and noise
secret (:class:`dpstream.processor.adapters.worker.LostStateError`): starting afresh silently
would forget the budget it spent, and releasing the same (window, key, trigger) again with the
same noise and different data would publish the difference exactly (docs/privacy.md, "Noise").
Starting over is therefore an explicit act, and this module is all of it:

* the workers must be stopped (the consumer group ``<app>-workers`` has no members);
* the state directory is deleted (only one that holds dpstream state: never a source folder);
* the application's internal topics are deleted: the repartition topics of the config's queries
  in the current epoch and the application's changelog topics (the next run's are named anew
  anyway); its consumer group's committed offsets are deleted;
* its epoch marks, its run (``<app>/run/...``) and its delivery progress records
  (``dpstream-epochs``, ``dpstream-progress``, keys ``<app>/...``) get tombstones, and
  ``<app>/restarts`` counts one more start-over. The workers' noise label and changelogs follow
  that count (:func:`dpstream.processor.adapters.worker.worker_epoch`), and the next worker draws
  a new run nonce (:mod:`dpstream.processor.adapters.run_identity`), so no released value's noise
  is reused. A release of an earlier start-over no longer holds a fresh start back.

The input topics are kept: the next worker reads them from the start. That is a second release of
the same users' data under a fresh budget, which the operator chooses here: each user's privacy
loss adds up over the runs (docs/privacy.md, "Failures"), and ``reset`` says so. Output topics are
kept unless ``--delete-outputs``, and so is the application's claim on them
(:mod:`dpstream.processor.adapters.output_claims`): its next run releases to them again, under
the same keys. ``--delete-outputs`` deletes them and tombstones their claims, so that another
application may use them; it refuses a topic another application owns.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dpstream.processor.adapters.output_claims import CLAIM_PREFIX, claims_by_topic, output_topics
from dpstream.processor.adapters.worker import LAYOUT_FILE, RUN_FILE, worker_epoch
from dpstream.processor.config import ConfigError, DpstreamConfig
from dpstream.state.noise_tables import TABLE_DIR_NAME
from dpstream.topics.kafka import (
    EPOCH_TOPIC,
    PROGRESS_TOPIC,
    KafkaPublisher,
    changelog_topic,
    client_security,
    item_topic,
    read_compacted,
    repartition_topic,
    rerouting_topic,
    restarts_key,
    unit_topic,
)

#: what a dpstream state directory holds at its top level: stores (state/store.py), the worker's
#: layout and run (worker.py) and Faust's data directory (faust_app.py)
STATE_ENTRY_PREFIXES = ("partition-",)
STATE_FILES = (LAYOUT_FILE, RUN_FILE, "faust", TABLE_DIR_NAME)


class StartOverError(ConfigError):
    """A start-over refused before anything was deleted (the reason names what to do)."""


@dataclass
class StartOverPlan:
    """What ``dpstream reset`` deletes and writes, worked out (and checked) before any of it is done."""

    app_id: str
    state_dir: Optional[Path]
    topics: list[str] = field(default_factory=list)
    group: str = ""
    epoch_keys: list[str] = field(default_factory=list)
    progress_keys: list[str] = field(default_factory=list)
    restarts: int = 1
    #: output topics left as they are (without --delete-outputs)
    outputs_kept: list[str] = field(default_factory=list)
    #: the claims (dpstream-epochs keys) on the output topics --delete-outputs deletes
    claim_keys: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        lines = []
        if self.state_dir is not None:
            lines.append(f"delete state directory {self.state_dir}")
        lines += [f"delete topic {t}" for t in self.topics]
        if self.claim_keys:
            lines.append(f"release {len(self.claim_keys)} claim(s) on the deleted output topics (another application may use them)")
        if self.outputs_kept:
            lines.append(f"keep output topic(s) {', '.join(self.outputs_kept)} and application {self.app_id!r}'s claim on them: "
                         f"the new run's releases follow the earlier runs' under the same keys [query, window_start, key], each "
                         f"naming its run (run.restarts {self.restarts}); --delete-outputs deletes them")
        if self.group:
            lines.append(f"delete the committed offsets of consumer group {self.group}")
        if self.epoch_keys or self.progress_keys:
            lines.append(f"forget {len(self.epoch_keys)} epoch mark(s) and {len(self.progress_keys)} progress record(s) of "
                         f"application {self.app_id!r}")
        lines.append(f"record start-over {self.restarts} of {self.app_id!r}: the workers' noise label becomes "
                     f"...:restart{self.restarts}:<a new run nonce>")
        return lines

    def privacy_note(self) -> str:
        """What starting over costs the users (docs/privacy.md, "Failures"): said before it is done."""
        return (f"privacy: the next run reads the input topics from their start and releases the same users' data again under "
                f"a fresh budget; each user's privacy loss adds up over the runs of {self.app_id!r} (after this, "
                f"{self.restarts + 1}): the total epsilon and delta are the sums of the runs'. See docs/privacy.md, "
                f"\"Failures\", and docs/threat-model.md, \"Starting over is a privacy decision\"")


def check_state_dir(path: Path) -> None:
    """Refuse to delete a directory that is not a dpstream state directory (for example the
    ``state/`` source package of a checkout, or a home directory)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise StartOverError(f"--state-dir: {path} is not a directory")
    entries = list(path.iterdir())
    foreign = [e.name for e in entries if not (e.name in STATE_FILES or e.name.startswith(STATE_ENTRY_PREFIXES))]
    if foreign:
        shown = ", ".join(sorted(foreign)[:5])
        raise StartOverError(f"--state-dir: {path} holds files that are not dpstream state ({shown}); not deleting it")


def plan_start_over(config: DpstreamConfig, app_id: str, state_dir: Optional[str], broker: str,
                    delete_outputs: bool = False, timeout: float = 15.0) -> StartOverPlan:
    """Work out the start-over, refusing while workers of the application are running."""
    from confluent_kafka.admin import AdminClient

    path = Path(state_dir) if state_dir is not None else None
    if path is not None:
        check_state_dir(path)
    _check_broker(broker, timeout)
    admin = AdminClient({"bootstrap.servers": broker, **client_security()})
    try:
        existing = set(admin.list_topics(timeout=timeout).topics)
    except Exception as exc:  # noqa: BLE001 (librdkafka's KafkaException: one line, not a traceback)
        raise StartOverError(f"--broker: listing the topics at {broker}: {exc}") from None
    group = f"{app_id}-workers"
    # elastic workers are members of <app>-workers; a static worker's Faust consumer joins <app>
    for name, described in admin.describe_consumer_groups([group, app_id]).items():
        try:
            members = described.result(timeout).members
        except Exception:  # noqa: BLE001 (no such group: nothing to wait for)
            members = []
        if members:
            raise StartOverError(f"application {app_id!r} still has {len(members)} worker(s) running (consumer group "
                                 f"{name}): stop them first (kubectl scale statefulset ... --replicas 0, or stop the processes)")
    marks = _read_records(broker, EPOCH_TOPIC, app_id, timeout) if EPOCH_TOPIC in existing else {}
    progress = _read_records(broker, PROGRESS_TOPIC, app_id, timeout) if PROGRESS_TOPIC in existing else {}
    count = int((marks.get(restarts_key(app_id)) or {}).get("count", 0))
    prefix = changelog_topic(app_id, "", "").rstrip("-")  # "<app>-": the changelogs of every epoch of the app
    # this run's repartition topics (the next run's have new names: worker_epoch)
    epoch = worker_epoch(config, count)
    topics = {repartition_topic(q.name, app_id, epoch) for q in config.queries}
    topics |= {rerouting_topic(q.name, app_id, epoch) for q in config.queries}
    # (only those of partitioned update topics exist; by-unit ones only with a unit_field)
    topics |= {t(q.name, app_id, epoch) for q in config.dynamic for t in (item_topic, unit_topic)}
    topics |= {t for t in existing if t.startswith(prefix) and t.endswith("-changelog")}
    outputs = output_topics(config)
    claim_keys = _claims_to_release(broker, app_id, outputs, existing, timeout) if delete_outputs else []
    if delete_outputs:
        topics |= set(outputs)
    return StartOverPlan(app_id, path, sorted(topics & existing), group,
                         sorted(k for k in marks if k != restarts_key(app_id)), sorted(progress), count + 1,
                         [] if delete_outputs else [t for t in outputs if t in existing], claim_keys)


def _claims_to_release(broker: str, app_id: str, outputs: list[str], existing: set[str], timeout: float) -> list[str]:
    """The claims on ``outputs`` that ``--delete-outputs`` tombstones (every one on a topic it
    deletes: the topic is gone), refusing a topic another application owns: its releases are
    not this application's to delete."""
    claims = claims_by_topic(_read_records_under(broker, EPOCH_TOPIC, CLAIM_PREFIX, timeout)) if EPOCH_TOPIC in existing else {}
    for topic in outputs:
        owner = claims.get(topic, [("", app_id)])[0][1]
        if owner != app_id:
            raise StartOverError(f"--delete-outputs: output topic {topic} belongs to application {owner!r}, not {app_id!r}: "
                                 f"its releases are not this application's to delete. Start over without --delete-outputs, "
                                 f"or reset application {owner!r} with --delete-outputs")
    return sorted(key for topic in outputs for key, _ in claims.get(topic, []))


def _check_broker(broker: str, timeout: float) -> None:
    """The broker answers; the client's own settings' failure is said at once, naming the
    setting (docs/operations.md, "Kafka security")."""
    from dpstream.processor.adapters.kafka_tools import last_reason, wait_for_broker
    from dpstream.topics.kafka import KafkaSettingError

    try:
        answered = wait_for_broker(broker, timeout)
    except KafkaSettingError as exc:
        raise StartOverError(f"reset: connecting to {broker}: {exc}") from None
    if not answered:
        raise StartOverError(f"--broker: no Kafka broker answered at {broker} within {timeout:g} s{last_reason()}")


def _read_records(broker: str, topic: str, app_id: str, timeout: float) -> dict[str, dict]:
    """The application's records in one of the small compacted topics; a failure names the topic."""
    return _read_records_under(broker, topic, f"{app_id}/", timeout)


def _read_records_under(broker: str, topic: str, prefix: str, timeout: float) -> dict[str, dict]:
    try:
        return read_compacted(broker, topic, prefix, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 (librdkafka's KafkaException, a read cut short: one line, not a traceback)
        raise StartOverError(f"reset: reading {topic} at {broker}: {exc.args[0] if exc.args else exc}") from None


def start_over(plan: StartOverPlan, broker: str, timeout: float = 30.0) -> None:
    """Do what ``plan`` says. The restart count is written last but one, before the state
    directory goes: a start-over cut short leaves a state that is refused or resumed, never a
    fresh start under the old noise label."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker, **client_security()})
    if plan.topics:
        for name, done in admin.delete_topics(plan.topics, operation_timeout=timeout).items():
            try:
                done.result(timeout)
            except Exception as exc:  # noqa: BLE001
                if "UNKNOWN_TOPIC" not in str(exc):
                    raise StartOverError(f"deleting topic {name}: {exc}") from None
        _wait_deleted(admin, set(plan.topics), timeout)
    if plan.group:
        for _, done in admin.delete_consumer_groups([plan.group], request_timeout=timeout).items():
            try:
                done.result(timeout)
            except Exception as exc:  # noqa: BLE001 (never committed anything: nothing to delete)
                if "GROUP_ID_NOT_FOUND" not in str(exc) and "not found" not in str(exc).lower():
                    raise StartOverError(f"deleting consumer group {plan.group}: {exc}") from None
    publisher = KafkaPublisher(broker)
    for key in plan.epoch_keys:
        publisher.produce(EPOCH_TOPIC, None, key.encode())
    for key in plan.progress_keys:
        publisher.produce(PROGRESS_TOPIC, None, key.encode())
    for key in plan.claim_keys:  # after the topics are gone: until then the claims keep other applications off them
        publisher.produce(EPOCH_TOPIC, None, key.encode())
    publisher.produce(EPOCH_TOPIC, json.dumps({"count": plan.restarts, "since_ms": int(time.time() * 1000)},
                                              sort_keys=True).encode(), restarts_key(plan.app_id).encode())
    publisher.flush()
    if plan.state_dir is not None and plan.state_dir.exists():
        shutil.rmtree(plan.state_dir)


def _wait_deleted(admin, names: set[str], timeout: float) -> None:
    """Topic deletion is asynchronous: wait until the broker no longer lists them, so a worker
    started right after creates them afresh instead of finding the old ones."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not names & set(admin.list_topics(timeout=timeout).topics):
            return
        time.sleep(0.2)
    raise StartOverError(f"topics {sorted(names)} were still listed {timeout:g} s after their deletion")
