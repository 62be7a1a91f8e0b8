"""An output topic belongs to one application id (issue 32, item 1; docs/operations.md, "Output
topics"). Releases are keyed by [query, window_start, key]: a second application writing the
same topic put a second series of values under the same keys (169, 317 and 140 for one trigger),
and no consumer could tell them apart. A second application is now refused at start; of two
starting at once exactly one goes on; `dpstream reset` keeps the claim, `--delete-outputs`
gives it up."""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from dpstream.processor.adapters.output_claims import (
    OutputClaimError,
    claim_key,
    claim_outputs,
    claims_by_topic,
)
from dpstream.processor.config import DpstreamConfig
from dpstream.topics.kafka import KafkaPublisher, read_epoch_marks
from tests.test_kafka_worker import Scenario
from tests.test_start_over import cli


def config_for(*outputs: str) -> DpstreamConfig:
    return DpstreamConfig(queries=[{"name": f"q{i}", "input_topic": f"in-{out}", "output_topic": out, "window": "1h",
                                    "triggers": 1, "contribution_bound": 1, "epsilon": 1, "delta": 1e-9}
                                   for i, out in enumerate(outputs)])


def owner(broker: str, topic: str):
    held = claims_by_topic(read_epoch_marks(broker)).get(topic)
    return held[0][1] if held else None


def test_the_first_claim_in_log_order_owns_the_topic():
    marks = {claim_key("out", "b", "1"): {"topic": "out", "app_id": "b"},
             "b/run/x": {"nonce": "x"},  # an application's own keys are not claims
             claim_key("out", "a", "2"): {"topic": "out", "app_id": "a"},
             claim_key("other", "a", "3"): {"topic": "other", "app_id": "a"}}
    held = claims_by_topic(marks)
    assert [app for _, app in held["out"]] == ["b", "a"] and [app for _, app in held["other"]] == ["a"]


@pytest.mark.broker
def test_an_unclaimed_topic_with_another_applications_releases_is_refused(broker):
    """Releases written before claims existed: their app_id is read from the topic's last records."""
    tag = uuid.uuid4().hex[:8]
    topic = f"claim-legacy-{tag}"
    publisher = KafkaPublisher(broker)
    release = {"query": "q0", "window_start": 0, "key": "k", "count": 3, "app_id": f"old-{tag}", "run": {"noise_label": "x"}}
    publisher.produce(topic, json.dumps(release).encode(), b'["q0",0,"k"]')
    publisher.produce(topic, b"not a release")
    publisher.flush()
    with pytest.raises(OutputClaimError) as refused:
        claim_outputs(broker, f"new-{tag}", config_for(topic), read_epoch_marks(broker))
    said = str(refused.value)
    assert topic in said and f"'old-{tag}'" in said and "--delete-outputs" in said and "output_topic" in said
    assert owner(broker, topic) is None  # the refused application claimed nothing
    claim_outputs(broker, f"old-{tag}", config_for(topic), read_epoch_marks(broker))  # its own releases: its topic
    assert owner(broker, topic) == f"old-{tag}"


@pytest.mark.broker
def test_of_two_applications_claiming_at_the_same_moment_exactly_one_wins(broker):
    """Both read dpstream-epochs before either claimed (the race): each appends its claim and
    reads back; the first in log order wins for both, and the loser leaves no claim behind."""
    tag = uuid.uuid4().hex[:8]
    topics = [f"claim-race-{tag}-{i}" for i in range(3)]
    before = read_epoch_marks(broker)
    outcome: dict[str, object] = {}
    start = threading.Barrier(2)

    def start_app(app: str) -> None:
        start.wait()
        try:
            claim_outputs(broker, app, config_for(*topics), before)
            outcome[app] = "runs"
        except OutputClaimError as exc:
            outcome[app] = str(exc)

    threads = [threading.Thread(target=start_app, args=(f"{side}-{tag}",)) for side in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [app for app, result in outcome.items() if result == "runs"]
    assert len(outcome) == 2 and len(winners) == 1, outcome
    loser = next(app for app in outcome if app not in winners)
    assert f"'{winners[0]}'" in outcome[loser] and "belongs to application" in outcome[loser]
    marks = read_epoch_marks(broker)
    for topic in topics:  # the winner owns every topic, alone: the loser's claims are tombstoned
        assert {app for _, app in claims_by_topic(marks)[topic]} == {winners[0]}
    with pytest.raises(OutputClaimError):  # the loser is refused again, by the claims now on record
        claim_outputs(broker, loser, config_for(*topics), marks)


@pytest.mark.broker
@pytest.mark.slow
def test_two_workers_of_different_applications_started_at_once_exactly_one_runs(tmp_path, broker):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = Scenario(tmp_path / "a", broker), Scenario(tmp_path / "b", broker)
    b.config.write_text(b.config.read_text().replace(f"output_topic: {b.output}", f"output_topic: {a.output}"))
    both = [a.worker("w").start(), b.worker("w").start()]
    try:
        for _ in range(600):
            if any(w.proc.poll() is not None for w in both):
                break
            time.sleep(0.2)
        refused = [w for w in both if w.proc.poll() is not None]
        assert len(refused) == 1, "exactly one of the two applications is refused"
        assert refused[0].proc.wait() == 2
        runner = next(w for w in both if w is not refused[0])
        runner.wait_ready()
        other = runner.sc
        log = refused[0].log.read_text()
        assert "refused" in log and f"output topic {a.output} belongs to application '{other.app_id}'" in log
        assert owner(broker, a.output) == other.app_id
    finally:
        for w in both:
            w.stop()


@pytest.mark.broker
def test_reset_keeps_the_claim_and_reset_with_delete_outputs_gives_it_up(tmp_path, broker):
    tag = uuid.uuid4().hex[:8]
    first, second, topic = f"claim-reset-a-{tag}", f"claim-reset-b-{tag}", f"claim-reset-out-{tag}"
    config = tmp_path / "queries.yaml"
    config.write_text(f"queries:\n  - {{name: q, input_topic: claim-in-{tag}, output_topic: {topic}, window: 1h, triggers: 1, "
                      f"contribution_bound: 1, epsilon: 1, delta: 1.0e-9}}\n")
    from dpstream.processor.config import load_config
    from dpstream.topics.kafka import create_topics, topics_for

    loaded = load_config(config)
    create_topics(broker, [t for t in topics_for(loaded.queries) if t.name == topic])
    claim_outputs(broker, first, loaded, read_epoch_marks(broker))
    reset = ("reset", "--config", str(config), "--broker", broker, "--state-dir", str(tmp_path / "none"))

    dry = cli(*reset, "--app-id", first)
    assert f"would keep output topic(s) {topic}" in dry.stdout
    assert "privacy loss adds up" in dry.stdout and "docs/privacy.md" in dry.stdout
    done = cli(*reset, "--app-id", first, "--yes")
    assert done.returncode == 0, done.stderr
    assert f"keep output topic(s) {topic}" in done.stdout and "privacy loss adds up" in done.stdout
    assert "output topics and their releases are kept" in done.stderr
    assert owner(broker, topic) == first  # kept: its next run releases there again
    with pytest.raises(OutputClaimError, match=first):
        claim_outputs(broker, second, loaded, read_epoch_marks(broker))

    theirs = cli(*reset, "--app-id", second, "--delete-outputs", "--yes")  # not the owner: deletes nothing
    assert theirs.returncode == 2 and f"belongs to application '{first}'" in theirs.stderr
    assert owner(broker, topic) == first

    gone = cli(*reset, "--app-id", first, "--delete-outputs", "--yes")
    assert gone.returncode == 0, gone.stderr
    assert f"delete topic {topic}" in gone.stdout and "release 1 claim(s)" in gone.stdout and "keep output" not in gone.stdout
    assert owner(broker, topic) is None
    claim_outputs(broker, second, loaded, read_epoch_marks(broker))  # another application may now use it
    assert owner(broker, topic) == second


def test_offsets_of_a_topic_just_created_are_asked_again_until_its_leaders_are_elected(monkeypatch):
    """Two workers of a new application started together: one creates the output topic, the
    other's start-up checks ask its offsets before the leaders are elected and librdkafka answers
    NOT_LEADER_FOR_PARTITION; that stopped the second worker (the operator guide's elastic
    block). Asked again, it passes; any other error, or past the wait, is raised."""
    from confluent_kafka import KafkaError, KafkaException

    from dpstream.processor.adapters import output_claims

    answers = [KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, (0, 42)]

    def ask():
        answer = answers.pop(0)
        if isinstance(answer, tuple):
            return answer
        raise KafkaException(KafkaError(answer))

    assert output_claims.once_leaders_are_elected(ask) == (0, 42)
    answers[:] = [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    with pytest.raises(KafkaException):
        output_claims.once_leaders_are_elected(ask)
    monkeypatch.setattr(output_claims, "NEW_TOPIC_LEADER_WAIT_S", 0.0)
    answers[:] = [KafkaError.NOT_LEADER_FOR_PARTITION, (0, 1)]
    with pytest.raises(KafkaException):
        output_claims.once_leaders_are_elected(ask)
