"""Avro, Protobuf and JSON Schema input through a schema registry (issue 31, item 2).

Records are written by confluent-kafka's own serializers. No Confluent-compatible registry
installs here (docs/operator-guide.md, "Formats and schema registries"), so the in-process tests
use confluent-kafka's ``mock://`` registry client, and the tests of a worker process use
:class:`dpstream.processor.bench.registry_server.RegistryServer`, a small in-memory server of the
registry's REST API, over HTTPS with basic auth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.bench.registry_server import RegistryServer
from dpstream.processor.config import DpstreamConfig, SchemaRegistryConfig
from dpstream.topics.decoding import RegistrySettingError, check_registry, decoder_for, registry_client
from dpstream.topics.records import InvalidRecord
from tests.conftest import ROOT, TEST_RUN_NONCE, TEST_SECRET, TEST_SECRET_HEX, Record
from tests.test_worker_service import START, all_releases, config, events, stage_two

EVENT_V1 = {"type": "record", "name": "Event", "namespace": "shop",
            "fields": [{"name": "user_id", "type": "string"}, {"name": "key", "type": "string"},
                       {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}
#: v2 adds a field with a default: schema evolution as registries allow it (backward compatible)
EVENT_V2 = {**EVENT_V1, "fields": [*EVENT_V1["fields"], {"name": "amount", "type": "double", "default": 1.5}]}


def _ctx(topic: str):
    from confluent_kafka.serialization import MessageField, SerializationContext

    return SerializationContext(topic, MessageField.VALUE)


def avro_serializer(registry, schema: dict):
    from confluent_kafka.schema_registry.avro import AvroSerializer

    return AvroSerializer(registry, json.dumps(schema))


def protobuf_event_class():
    """An ``Event`` message class built at run time (the test has no protoc)."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from google.protobuf.message_factory import GetMessageClass

    fd = descriptor_pb2.FileDescriptorProto(name="shop/event.proto", package="shop", syntax="proto3")
    inner = fd.message_type.add(name="Who")
    inner.field.add(name="user_id", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING, label=1)
    m = fd.message_type.add(name="Event")
    m.field.add(name="who", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, label=1, type_name=".shop.Who")
    m.field.add(name="key", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING, label=1)
    m.field.add(name="ts", number=3, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return GetMessageClass(pool.FindMessageTypeByName("shop.Event")), GetMessageClass(pool.FindMessageTypeByName("shop.Who"))


def mock(name: str = "") -> SchemaRegistryConfig:
    return SchemaRegistryConfig(url=f"mock://{name or uuid.uuid4().hex}")


def test_avro_records_of_two_schema_versions_decode_and_a_reader_schema_fills_the_added_field():
    settings_ = mock()
    registry = registry_client(settings_)
    v1, v2 = avro_serializer(registry, EVENT_V1), avro_serializer(registry, EVENT_V2)
    raws = [v1({"user_id": "u1", "key": "a", "ts": 1_800_000_000_000}, _ctx("ev")),
            v2({"user_id": "u2", "key": "b", "ts": 1_800_000_000_001, "amount": 4.0}, _ctx("ev"))] * 3
    assert raws[0][1:5] != raws[1][1:5], "two schema ids"
    decoded = decoder_for("avro", settings_, "ev").decode(raws)
    assert decoded[:2] == [{"user_id": "u1", "key": "a", "ts": 1_800_000_000_000},
                           {"user_id": "u2", "key": "b", "ts": 1_800_000_000_001, "amount": 4.0}]
    assert decoded[2:] == decoded[:2] * 2
    latest = SchemaRegistryConfig(url=settings_.url, use_latest_version=True)
    assert decoder_for("avro", latest, "ev").decode(raws[:2])[0] == {"user_id": "u1", "key": "a", "ts": 1_800_000_000_000,
                                                                      "amount": 1.5}


def test_an_unknown_schema_id_an_undecodable_payload_and_another_format_are_invalid_naming_which():
    settings_ = mock()
    good = avro_serializer(registry_client(settings_), EVENT_V1)({"user_id": "u1", "key": "a", "ts": 5}, _ctx("ev"))
    out = decoder_for("avro", settings_, "ev").decode([b"\x00" + (999).to_bytes(4, "big") + b"\x02x", good[:5] + b"\xff\xff\xff", b'{"user_id": "u1"}', None,
                          good])
    assert out[1].reason.startswith(f"does not decode as avro with schema id {int.from_bytes(good[1:5], 'big')} (")
    out[1] = InvalidRecord("cut")
    assert [o.reason if isinstance(o, InvalidRecord) else o for o in out] == [
        "schema id 999 is unknown to the schema registry",
        "cut",
        "not in the schema-registry wire format (avro: magic byte 0 and a 4-byte schema id)",
        "no value (a tombstone)",
        {"user_id": "u1", "key": "a", "ts": 5}]


@settings(deadline=None, derandomize=True, max_examples=40)
@given(rows=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12), st.integers(-62_135_596_800_000, 253_402_300_799_999), st.booleans()),
                     min_size=1, max_size=30))
def test_the_fast_avro_reader_reads_what_confluent_kafkas_deserializer_reads(rows):
    from confluent_kafka.schema_registry.avro import AvroDeserializer

    settings_ = mock("fast-avro")
    registry = registry_client(settings_)
    v1, v2 = avro_serializer(registry, EVENT_V1), avro_serializer(registry, EVENT_V2)
    raws = [(v2 if new else v1)({"user_id": u, "key": k, "ts": t, **({"amount": 2.5} if new else {})}, _ctx("ev"))
            for u, k, t, new in rows]
    reference = AvroDeserializer(registry)
    expected = []
    for raw in raws:
        obj = reference(raw, _ctx("ev"))
        obj["ts"] = int(obj["ts"].timestamp() * 1000) if hasattr(obj["ts"], "timestamp") else obj["ts"]
        expected.append(obj)
    assert decoder_for("avro", settings_, "ev").decode(raws) == expected
    fresh = decoder_for("avro", settings_, "ev")
    assert [fresh.decode([raw])[0] for raw in reversed(raws)] == expected[::-1], "a record decodes the same in any batch"


def test_protobuf_and_json_schema_records_decode_by_their_writer_schema():
    from confluent_kafka.schema_registry.json_schema import JSONSerializer
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    settings_ = mock()
    registry = registry_client(settings_)
    event, who = protobuf_event_class()
    raw = ProtobufSerializer(event, registry, {"use.deprecated.format": False})(
        event(who=who(user_id="u9"), key="k", ts=1_800_000_000_123), _ctx("pb"))
    good, cut = decoder_for("protobuf", settings_, "pb").decode([raw, raw[:6] + b"\xff"])
    assert good == {"who": {"user_id": "u9"}, "key": "k", "ts": 1_800_000_000_123}
    assert cut.reason.startswith(f"does not decode as protobuf with schema id {int.from_bytes(raw[1:5], 'big')} (")
    schema = {"type": "object", "properties": {"user_id": {"type": "string"}, "ts": {"type": "integer"}}, "required": ["user_id"]}
    raw = JSONSerializer(json.dumps(schema), registry)({"user_id": "u3", "key": "k3", "ts": 5}, _ctx("js"))
    assert decoder_for("json_schema", settings_, "js").decode([raw]) == [{"user_id": "u3", "key": "k3", "ts": 5}]


def test_a_worker_reading_avro_releases_what_it_releases_reading_the_same_events_as_json(tmp_path):
    """The same events, once as JSON and once as Avro records of confluent-kafka's serializer
    (two schema versions, one nested user field by a dotted path in Protobuf's stead): the same
    releases, and the Avro worker dead-letters a record of an unknown schema id, naming it."""
    registry = mock()
    nested = {"type": "record", "name": "Event", "namespace": "shop", "fields": [
        {"name": "who", "type": {"type": "record", "name": "Who", "fields": [{"name": "user_id", "type": "string"}]}},
        {"name": "key", "type": "string"}, {"name": "ts", "type": "long"}]}
    v1 = avro_serializer(registry_client(registry), nested)
    v2 = avro_serializer(registry_client(registry), {**nested, "fields": [*nested["fields"], {"name": "n", "type": "int", "default": 0}]})
    plain = events(3000)
    as_avro = []
    for r in plain:
        obj = json.loads(r.value)
        row = {"who": {"user_id": obj["user_id"]}, "key": obj["key"], "ts": obj["ts"]}
        raw = (v1 if r.offset % 2 else v2)(row if r.offset % 2 else {**row, "n": 7}, _ctx("in"))
        as_avro.append(Record(r.offset, r.key, raw, r.timestamp))
    json_worker = DpstreamWorker(config(user_field="user_id"), TEST_SECRET, tmp_path / "json", Ownership(), {"in": 1}, 2,
                                 run_nonce=TEST_RUN_NONCE)
    cfg = DpstreamConfig(queries=[config(user_field="who.user_id").queries[0]], input_format="avro", schema_registry=registry)
    avro_worker = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "avro", Ownership(), {"in": 1}, 2, run_nonce=TEST_RUN_NONCE)
    try:
        unknown = Record(len(as_avro), b"u1", b"\x00" + (4242).to_bytes(4, "big") + b"\x02", START)
        for worker, records in ((json_worker, plain), (avro_worker, [*as_avro, unknown])):
            out = worker.process_input("in", 0, records)
            stage_two(worker, out.messages)
            out.commit()
        letters = [json.loads(m.value) for m in out.messages if m.topic == "dpstream-dead-letters"]
        assert [(d["reason"], d["source"]) for d in letters] == [("schema id 4242 is unknown to the schema registry",
                                                                  f"in/0@{unknown.offset}")]
        expected = all_releases(json_worker)
        assert expected and all_releases(avro_worker) == expected
    finally:
        json_worker.close()
        avro_worker.close()


def test_a_registry_format_without_a_registry_and_a_registry_that_refuses_the_password_are_named():
    query = {"name": "q", "input_topic": "in", "epsilon": 1, "delta": 1e-9}
    with pytest.raises(ValueError, match="schema_registry: input_format 'protobuf'"):
        DpstreamConfig(queries=[{**query, "input_format": "protobuf"}])
    with pytest.raises(ValueError, match="must share one input_format"):
        DpstreamConfig(queries=[{**query, "input_format": "avro"}, {**query, "name": "other"}], schema_registry={"url": "mock://x"})
    with RegistryServer(user_info="dp:right") as url:
        check_registry(SchemaRegistryConfig(url=url, basic_auth_user_info="dp:right"))
        with pytest.raises(RegistrySettingError, match=r"^schema_registry.basic_auth_user_info .* refused it \(HTTP 401\)"):
            check_registry(SchemaRegistryConfig(url=url, basic_auth_user_info="dp:wrong"))
    with pytest.raises(RegistrySettingError, match="^schema_registry.url: the schema registry at http://127.0.0.1:9 cannot be"):
        check_registry(SchemaRegistryConfig(url="http://127.0.0.1:9"))


def self_signed(tmp_path) -> tuple[str, str]:
    cert, key = tmp_path / "registry.pem", tmp_path / "registry.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.broker
def test_a_worker_reads_avro_from_a_stock_producer_through_a_registry_over_https_with_basic_auth(tmp_path, broker, monkeypatch):
    from confluent_kafka import Producer

    from dpstream.topics.kafka import DEAD_LETTER_TOPIC, INPUT_TOPIC_CONFIG, TopicSpec, create_topics
    from tests.test_any_producer import _events
    from tests.test_kafka_worker import running

    cert, key = self_signed(tmp_path)
    with RegistryServer(user_info="dpstream:s3cret", tls=(cert, key)) as url, running(tmp_path, broker) as sc:
        monkeypatch.setenv("DPSTREAM_SCHEMA_REGISTRY_USER_INFO", "dpstream:s3cret")
        sc.config.write_text(sc.config.read_text() + f"input_format: avro\nschema_registry:\n  url: {url}\n  ssl_ca_location: {cert}\n")
        create_topics(sc.broker, [TopicSpec(sc.input, 4, INPUT_TOPIC_CONFIG)])
        w = sc.ready_worker("avro")
        lines = _events(sc, 3_000, lead_s=4)
        producing = registry_client(SchemaRegistryConfig(url=url, basic_auth_user_info="dpstream:s3cret", ssl_ca_location=cert))
        serialize = avro_serializer(producing, EVENT_V1)
        producer = Producer({"bootstrap.servers": sc.broker})  # every setting at its default
        for line in lines:
            obj = json.loads(line)
            producer.produce(sc.input, serialize(obj, _ctx(sc.input)), key=obj["user_id"].encode())
        producer.produce(sc.input, b"\x00" + (777).to_bytes(4, "big") + b"\x00")
        assert producer.flush(30) == 0
        sc.wait_for_window_end()
        sc.assert_published_equal(sc.replay())  # replay reads the same events as JSON lines
        letters = [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == sc.query]
        assert [d["reason"] for d in letters] == ["schema id 777 is unknown to the schema registry"]
        assert w.metric("dpstream_events_in_total", query=sc.query) == len(lines) + 1


def test_a_wrong_registry_password_stops_the_worker_at_start_with_one_line_and_exit_2(tmp_path):
    with RegistryServer(user_info="dpstream:right") as url:
        cfg = tmp_path / "q.yaml"
        cfg.write_text(f"input_format: avro\nschema_registry:\n  url: {url}\nqueries:\n  - name: q\n    epsilon: 1\n    delta: 1.0e-9\n")
        key = tmp_path / "k"
        key.write_text(TEST_SECRET_HEX)
        key.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
        env = {**os.environ, "DPSTREAM_NOISE_KEY_FILE": str(key), "DPSTREAM_SCHEMA_REGISTRY_USER_INFO": "dpstream:wrong"}
        proc = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "worker", "--config", str(cfg), "--broker",
                               "127.0.0.1:9", "--broker-timeout", "1s", "--state-dir", str(tmp_path / "s"), "--web-port", "0"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[-1].startswith("dpstream worker: refused: schema_registry.basic_auth_user_info"), proc.stderr
        assert "wrong" not in proc.stderr and "right" not in proc.stderr  # never the password
