"""Topic declarations and the metrics registry (no broker needed)."""
from prometheus_client import generate_latest

from dpstream.processor.adapters.metrics import PipelineMetrics
from dpstream.processor.config import DpstreamConfig, QueryConfig, plan_for
from dpstream.processor.engine.pipeline import PipelineStats
from dpstream.topics.kafka import (
    DEAD_LETTER_TOPIC,
    EPOCH_TOPIC,
    PROGRESS_TOPIC,
    repartition_topic,
    topics_for,
)


def test_every_topic_is_declared_once_with_its_config():
    a = QueryConfig(name="a", epsilon=1, delta=1e-6)
    b = QueryConfig(name="b", epsilon=1, delta=1e-6, output_topic="other-out")
    specs = {s.name: s for s in topics_for(DpstreamConfig(queries=[a, b]).queries, partitions=4)}
    assert set(specs) == {"events", repartition_topic("a"), repartition_topic("b"), "dp-histograms", "other-out",
                          DEAD_LETTER_TOPIC, "dpstream-dynamic-updates", EPOCH_TOPIC, PROGRESS_TOPIC}
    assert specs["dp-histograms"].config["cleanup.policy"] == "compact"
    # the lost-volume record: one partition, the latest mark per worker kept
    assert specs[EPOCH_TOPIC].partitions == 1 and specs[EPOCH_TOPIC].config["cleanup.policy"] == "compact"
    # what each source partition delivered (exactly once): the latest record per key kept
    assert specs[PROGRESS_TOPIC].partitions == 1 and specs[PROGRESS_TOPIC].config["cleanup.policy"] == "compact"
    assert specs["events"].partitions == 4
    # input timestamps are the broker's, never a producer's choice (docs/privacy.md, "Time")
    assert specs["events"].config["message.timestamp.type"] == "LogAppendTime"


def test_metrics_follow_prometheus_names_and_count_deltas():
    query = QueryConfig(name="clicks", epsilon=6, delta=1e-9)
    metrics = PipelineMetrics()
    stats = PipelineStats(events_in=10, releases=3, triggers_fired=2, keys_loaded=5)
    stats.dropped["late"] += 2
    metrics.observe_pipeline("clicks", stats, plan_for(query))
    stats.events_in += 5
    metrics.observe_pipeline("clicks", stats, plan_for(query))
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_events_in_total{query="clicks"} 15.0' in text
    assert 'dpstream_events_dropped_total{query="clicks",reason="late"} 2.0' in text
    assert 'dpstream_releases_total{query="clicks"} 3.0' in text
    metrics.trigger_seconds.labels("clicks").observe(0.3)
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_trigger_duration_seconds_bucket{le="0.5",query="clicks"} 1.0' in text
    assert 'dpstream_budget_epsilon_spent{query="clicks"}' in text


def test_kafka_security_settings_come_from_the_environment_for_every_client():
    from dpstream.processor.adapters.faust_app import _faust_credentials
    from dpstream.topics.kafka import aiokafka_security, client_security

    env = {"DPSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "DPSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
           "DPSTREAM_KAFKA_SASL_USERNAME": "svc", "DPSTREAM_KAFKA_SASL_PASSWORD": "s3cret", "UNRELATED": "x"}
    conf = client_security(env)
    assert conf == {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": "svc", "sasl.password": "s3cret"}
    aio = aiokafka_security(conf)
    assert (aio["security_protocol"], aio["sasl_mechanism"], aio["sasl_plain_username"]) == ("SASL_PLAINTEXT", "SCRAM-SHA-512", "svc")
    assert type(_faust_credentials(conf)).__name__ == "SASLCredentials"
    assert client_security({}) == {} and aiokafka_security({}) == {} and _faust_credentials({}) is None


def test_budget_remaining_comes_from_the_ledger_only():
    """Without a budget section there is no ledger, and no remaining budget to report: no sample,
    never a 0 that reads as "exhausted" (issue 16). With one, each query's principal's remaining."""
    from dpstream.accountant.ledger import BudgetEntry

    query = QueryConfig(name="clicks", epsilon=6, delta=1e-9)
    metrics = PipelineMetrics()
    metrics.observe_pipeline("clicks", PipelineStats(events_in=1), plan_for(query))
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_budget_epsilon_spent{query="clicks"}' in text
    assert "dpstream_budget_epsilon_remaining{" not in text
    entry = BudgetEntry("tenant-a", max_epsilon=60, max_delta=1e-6, refresh_ms=None, spent_epsilon=18, refusals=2)
    metrics.observe_ledger([entry], {"clicks": entry.remaining[0]})
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_budget_epsilon_remaining{query="clicks"} 42.0' in text
    assert 'dpstream_ledger_epsilon_remaining{principal="tenant-a"} 42.0' in text
    assert 'dpstream_ledger_refusals{principal="tenant-a"} 2.0' in text


def test_trigger_and_lag_gauges_drop_what_the_worker_no_longer_owns():
    metrics = PipelineMetrics()
    metrics.observe_trigger("a", 0.2, now=1_700_000_000.0)
    metrics.observe_next_triggers({"a": 1_700_000_060_000, "b": 1_700_000_030_500})
    metrics.observe_lag({("events", 0): 5, ("events", 1): 0})
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_last_trigger_timestamp_seconds{query="a"} 1.7e+09' in text
    assert 'dpstream_trigger_duration_seconds_count{query="a"} 1.0' in text
    assert 'dpstream_next_trigger_timestamp_seconds{query="b"} 1.7000000305e+09' in text
    assert 'dpstream_consumer_lag_records{partition="1",topic="events"} 0.0' in text
    # partitions moved away (elastic workers), a query's windows closed: their samples go
    metrics.observe_next_triggers({"a": 1_700_000_063_000})
    metrics.observe_lag({("events", 0): 7})
    text = generate_latest(metrics.registry).decode()
    assert 'dpstream_next_trigger_timestamp_seconds{query="a"} 1.700000063e+09' in text
    assert 'query="b"' not in text.split("dpstream_next_trigger_timestamp_seconds gauge")[1].split("# HELP")[0]
    assert 'partition="1"' not in text and 'dpstream_consumer_lag_records{partition="0",topic="events"} 7.0' in text
