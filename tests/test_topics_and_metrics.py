"""Topic declarations and the metrics registry (no broker needed)."""
import pytest
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


#: librdkafka 2.x's words, as it said them against scripts/broker start-secure (docs/operations.md,
#: "Kafka security"), and the variable each must name; None: a broker away, waited for
LIBRDKAFKA_SAYS = [
    ("sasl_ssl://127.0.0.1:29092/bootstrap: SASL authentication error: Authentication failed during authentication due "
     "to invalid credentials with SASL mechanism SCRAM-SHA-512 (after 313ms in state AUTH_REQ)", "DPSTREAM_KAFKA_SASL_PASSWORD"),
    ("sasl_ssl://127.0.0.1:29092/bootstrap: SASL SCRAM-SHA-256 mechanism handshake failed: Broker: Unsupported SASL "
     "mechanism: broker's supported mechanisms: SCRAM-SHA-512 (after 301ms in state AUTH_HANDSHAKE)", "DPSTREAM_KAFKA_SASL_MECHANISM"),
    ("sasl_plaintext://127.0.0.1:19092/bootstrap: SASL SCRAM-SHA-512 mechanism handshake failed: Broker: Request not valid "
     "in current SASL state: broker's supported mechanisms:  (after 8ms in state AUTH_HANDSHAKE)", "DPSTREAM_KAFKA_SECURITY_PROTOCOL"),
    ("sasl_ssl://127.0.0.1:29092/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: "
     "broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA "
     "certificates are installed (install ca-certificates package) (after 6ms in state SSL_HANDSHAKE)",
     "DPSTREAM_KAFKA_SSL_CA_LOCATION"),
    ("ssl://127.0.0.1:29093/bootstrap: Receive failed: error:0A000412:SSL routines::ssl/tls alert bad certificate: SSL "
     "alert number 42 (after 0ms in state APIVERSION_QUERY)", "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION"),
    ('Invalid value "SASL_SSLL" for configuration property "security.protocol"', "DPSTREAM_KAFKA_SECURITY_PROTOCOL"),
    ("Failed to create admin client: ssl.ca.location failed: error:05880020:x509 certificate routines::BIO lib",
     "DPSTREAM_KAFKA_SSL_CA_LOCATION"),
    ("Failed to create admin client: ssl.key.location failed: error:0A080009:SSL routines::PEM lib", "DPSTREAM_KAFKA_SSL_KEY_PASSWORD"),
    ("Failed to create producer: sasl.username and sasl.password must be set", "DPSTREAM_KAFKA_SASL_USERNAME"),
    ("Failed to create admin client: Unsupported hash function: SCRAM-SHA-51 (try SCRAM-SHA-512)", "DPSTREAM_KAFKA_SASL_MECHANISM"),
    # the broker away, or going away: waited for, never a setting's failure
    ("127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT)", None),
    ("ssl://127.0.0.1:19092/bootstrap: SSL handshake failed: Disconnected: SSL connection closed by peer: connecting to a "
     "PLAINTEXT broker listener? (after 11ms in state SSL_HANDSHAKE)", None),
    ("sasl_ssl://127.0.0.1:29092/bootstrap: Disconnected: SSL connection closed by peer (after 0ms in state UP)", None),
    ("1/1 brokers are down", None),
]


@pytest.mark.parametrize("text, variable", LIBRDKAFKA_SAYS)
def test_librdkafka_errors_of_the_clients_settings_name_the_variable(text, variable):
    from dpstream.topics.kafka import setting_error

    error = setting_error(text, {"ssl.key.location": __file__} if "ssl.key" in text else {})  # a file that is there
    if variable is None:
        assert error is None
    else:
        assert error is not None and variable in str(error), error


def test_a_settings_error_never_shows_a_password():
    from dpstream.topics.kafka import setting_error

    settings = {"sasl.password": "hunter2-secret", "ssl.key.password": "k3y-secret"}
    for text in ('Invalid value "hunter2-secret" for configuration property "sasl.password"',
                 'Invalid value "k3y-secret" for configuration property "ssl.key.password"',
                 "SASL authentication error: hunter2-secret k3y-secret"):
        said = str(setting_error(text, settings))
        assert "hunter2" not in said and "k3y" not in said, said


def test_aiokafka_and_faust_take_the_client_certificate_and_name_a_missing_file(tmp_path):
    """The worker's aiokafka consumer and Faust's client use the same CA, certificate and
    (encrypted) key as librdkafka; a file they cannot use names its variable."""
    import ssl
    import subprocess

    from dpstream.processor.adapters.faust_app import _faust_credentials
    from dpstream.topics.kafka import KafkaSettingError, aiokafka_security, client_security

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-noenc", "-days", "2", "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-days", "2", "-subj", "/CN=client", "-passout", "pass:pw-123",
            "-keyout", "client.key", "-out", "client.pem")
    env = {"DPSTREAM_KAFKA_SECURITY_PROTOCOL": "SSL", "DPSTREAM_KAFKA_SSL_CA_LOCATION": str(tmp_path / "ca.pem"),
           "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION": str(tmp_path / "client.pem"),
           "DPSTREAM_KAFKA_SSL_KEY_LOCATION": str(tmp_path / "client.key"), "DPSTREAM_KAFKA_SSL_KEY_PASSWORD": "pw-123"}
    conf = client_security(env)
    assert conf["ssl.certificate.location"].endswith("client.pem") and conf["ssl.key.password"] == "pw-123"
    context = aiokafka_security(conf)["ssl_context"]
    assert isinstance(context, ssl.SSLContext) and [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "ca"),),)]
    credentials = _faust_credentials(conf)
    assert type(credentials).__name__ == "SSLCredentials" and credentials.context is not None
    with pytest.raises(KafkaSettingError, match="DPSTREAM_KAFKA_SSL_KEY_PASSWORD") as wrong:
        aiokafka_security({**conf, "ssl.key.password": "not-pw"})
    assert "not-pw" not in str(wrong.value)
    with pytest.raises(KafkaSettingError, match="DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION"):
        aiokafka_security({**conf, "ssl.certificate.location": str(tmp_path / "missing.pem")})


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


def test_the_dead_letter_topic_is_created_with_a_retention():
    """Dead letters are raw input (docs/threat-model.md): deleted after $DPSTREAM_DEAD_LETTER_RETENTION
    (default 7 days), in segments of at most a day, so a record outlives it by at most a day."""
    from dpstream.processor.config import ConfigError
    from dpstream.topics.kafka import DEAD_LETTER_RETENTION_ENV, dead_letter_topic_config

    q = QueryConfig(name="a", epsilon=1, delta=1e-6)
    spec = {s.name: s for s in topics_for([q])}[DEAD_LETTER_TOPIC]
    day = 86_400_000
    assert spec.config == {"cleanup.policy": "delete", "retention.ms": str(7 * day), "segment.ms": str(day)}
    assert dead_letter_topic_config({DEAD_LETTER_RETENTION_ENV: "36h"})["retention.ms"] == str(36 * 3_600_000)
    assert dead_letter_topic_config({DEAD_LETTER_RETENTION_ENV: "2h"}) == {"cleanup.policy": "delete", "retention.ms": "7200000",
                                                                           "segment.ms": "7200000"}
    for bad in ("a week", "0s", "-1"):
        with pytest.raises(ConfigError, match=DEAD_LETTER_RETENTION_ENV):
            dead_letter_topic_config({DEAD_LETTER_RETENTION_ENV: bad})


def test_the_broker_keeps_the_dead_letter_retention(broker, monkeypatch):
    """The worker's dead-letter spec, created on a real broker under a name of this test's own: the
    broker takes the config and reports it as the topic's (not its defaults)."""
    import dataclasses
    import uuid

    from confluent_kafka.admin import AdminClient, ConfigResource

    from dpstream.topics.kafka import DEAD_LETTER_RETENTION_ENV, create_topics

    monkeypatch.setenv(DEAD_LETTER_RETENTION_ENV, "3d")
    spec = {s.name: s for s in topics_for([QueryConfig(name="a", epsilon=1, delta=1e-6)])}[DEAD_LETTER_TOPIC]
    name = f"test-dead-letters-{uuid.uuid4().hex[:10]}"
    assert create_topics(broker, [dataclasses.replace(spec, name=name)]) == [name]
    admin = AdminClient({"bootstrap.servers": broker})
    try:
        (future,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, name)]).values()
        entries = future.result(30)
        assert entries["retention.ms"].value == str(3 * 86_400_000)
        assert entries["segment.ms"].value == "86400000"
        assert entries["cleanup.policy"].value == "delete"
        assert not entries["retention.ms"].is_default
    finally:
        admin.delete_topics([name])
