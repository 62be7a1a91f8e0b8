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
