"""Record decoders: the one place an input format is read (docs/architecture.md, "Where to add").

A :class:`RecordDecoder` turns a batch of raw record values (Kafka message values, replay input
lines) into one mapping per record, or an :class:`dpstream.topics.records.InvalidRecord` naming what is
wrong (never quoting the content). Query-level field extraction then works on mappings whatever
the format (:class:`dpstream.topics.records.EventParser`, :class:`dpstream.topics.records.UpdateParser`), so one
batch is decoded once however many queries read it. Another format is a class with a ``name``
and ``decode`` registered in :data:`DECODERS`.

Formats: ``json`` (one JSON object per record), and, through a Confluent-compatible schema
registry, ``avro``, ``protobuf`` and ``json_schema``: the Confluent wire format (magic byte 0, a
4-byte schema id, for Protobuf the message indexes, then the payload) read by confluent-kafka's
own ``schema_registry`` deserializers against the writer's schema, fetched from the registry once
per schema id (docs/operator-guide.md, "Formats and schema registries"). A record that is not in
the wire format, names a schema id the registry does not know, or does not decode is invalid,
its reason naming which; a registry that cannot be reached is not the record's fault and stops
the batch (the worker restarts and reads it again).
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import threading
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

import orjson

from dpstream.topics.records import TOMBSTONE, InvalidRecord


class RecordDecoder(Protocol):
    name: str

    def decode(self, raws: Sequence[Optional[bytes]]) -> list[Union[Mapping, InvalidRecord]]:
        """One mapping (field name -> value) or InvalidRecord per raw value, in order."""


class JsonRecordDecoder:
    """One JSON object per record. orjson: about 3x the standard parser on small records, which
    is most of stage 1's per-event cost; it also rejects NaN/Infinity literals (invalid)."""

    name = "json"

    def decode(self, raws: Sequence[Optional[bytes]]) -> list[Union[Mapping, InvalidRecord]]:
        loads, bad_json, not_object = orjson.loads, InvalidRecord("not valid JSON"), InvalidRecord("not a JSON object")
        out: list[Union[Mapping, InvalidRecord]] = []
        append = out.append
        for raw in raws:
            if raw is None:
                append(TOMBSTONE)
                continue
            try:
                obj = loads(raw)
            except orjson.JSONDecodeError:
                append(bad_json)
                continue
            append(obj if isinstance(obj, dict) else not_object)
        return out


#: the environment variable with the registry's basic-auth ``user:password`` (it wins over the
#: config's ``schema_registry.basic_auth_user_info``: a Kubernetes Secret sets it)
REGISTRY_USER_INFO_ENV = "DPSTREAM_SCHEMA_REGISTRY_USER_INFO"

_MOCK_REGISTRIES: dict[str, Any] = {}
_MOCK_LOCK = threading.Lock()


def registry_client(settings) -> Any:
    """A confluent-kafka ``SchemaRegistryClient`` for ``settings`` (the config's
    ``schema_registry``: url, basic auth, TLS). ``mock://NAME``: confluent-kafka's in-process
    mock registry, one per name in this process (what the tests' producers and workers share)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    conf = {"url": settings.url}
    if settings.url.startswith("mock://"):
        with _MOCK_LOCK:
            if settings.url not in _MOCK_REGISTRIES:
                _MOCK_REGISTRIES[settings.url] = SchemaRegistryClient.new_client(conf)
            return _MOCK_REGISTRIES[settings.url]
    user_info = os.environ.get(REGISTRY_USER_INFO_ENV) or settings.basic_auth_user_info
    if user_info:
        conf["basic.auth.user.info"] = user_info
    for name, key in (("ssl_ca_location", "ssl.ca.location"), ("ssl_certificate_location", "ssl.certificate.location"),
                      ("ssl_key_location", "ssl.key.location"), ("ssl_key_password", "ssl.key.password")):
        value = getattr(settings, name)
        if value:
            conf[key] = value
    return SchemaRegistryClient(conf)


class RegistrySettingError(ValueError):
    """The schema registry's settings do not work (a refusal at start, naming the setting)."""


def check_registry(settings) -> None:
    """Ask the registry for its subjects once: a wrong url, password or CA stops a command at
    start with one line naming the setting, not at the first record."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        registry_client(settings).get_subjects()
    except SchemaRegistryError as exc:
        if exc.http_status_code in (401, 403):
            raise RegistrySettingError(f"schema_registry.basic_auth_user_info (or ${REGISTRY_USER_INFO_ENV}): the registry at "
                                       f"{settings.url} refused it (HTTP {exc.http_status_code})") from None
        raise RegistrySettingError(f"schema_registry.url: {settings.url} answered HTTP {exc.http_status_code} "
                                   f"({exc.error_message})") from None
    except Exception as exc:  # noqa: BLE001 - the HTTP client's own errors: connection, TLS, a bad file
        text = str(exc)
        which = "schema_registry.ssl_ca_location" if "CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower() \
            else "schema_registry.url"
        raise RegistrySettingError(f"{which}: the schema registry at {settings.url} cannot be reached ({type(exc).__name__}: "
                                   f"{text[:200]})") from None


def _plain(value):
    """A decoded value as the field readers expect: Avro's logical timestamps (datetimes) as
    epoch milliseconds, Protobuf messages as dicts."""
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return int(value.timestamp() * 1000) if value.microsecond % 1000 == 0 else value.timestamp() * 1000
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class SchemaRegistryDecoder:
    """Records in the Confluent wire format, decoded by confluent-kafka's deserializer of the
    format (:meth:`deserializer`) with the writer's schema from the registry (a reader schema:
    the subject's latest version, with ``use_latest_version``)."""

    name = "schema-registry"
    #: what the registry calls the format (Schema.schema_type)
    schema_type = ""

    def __init__(self, settings, topic: str):
        from confluent_kafka.serialization import MessageField, SerializationContext

        self.registry = registry_client(settings)
        self.settings = settings
        self.ctx = SerializationContext(topic, MessageField.VALUE)
        self._deserialize = self.deserializer({"use.latest.version": bool(settings.use_latest_version)})

    def deserializer(self, conf: dict):
        raise NotImplementedError

    def decode(self, raws: Sequence[Optional[bytes]]) -> list[Union[Mapping, InvalidRecord]]:
        return [self.decode_one(raw) for raw in raws]

    def decode_one(self, raw: Optional[bytes]) -> Union[Mapping, InvalidRecord]:
        if raw is None:
            return TOMBSTONE
        if not raw or len(raw) < 5 or raw[0] != 0:
            return InvalidRecord(f"not in the schema-registry wire format ({self.name}: magic byte 0 and a 4-byte schema id)")
        schema_id = int.from_bytes(raw[1:5], "big")
        try:
            obj = self.read(raw, schema_id)
        except Exception as exc:  # noqa: BLE001 - sorted below: the record's fault or the registry's
            if _registry_failure(exc):
                raise
            if getattr(exc, "http_status_code", None) == 404:
                return InvalidRecord(f"schema id {schema_id} is unknown to the schema registry")
            return InvalidRecord(f"does not decode as {self.name} with schema id {schema_id} ({type(exc).__name__})")
        obj = _plain(obj)
        return obj if isinstance(obj, dict) else InvalidRecord(f"{self.name} schema id {schema_id} is not a record")

    def read(self, raw: bytes, schema_id: int):
        """One record's value (raises what its decoding raises)."""
        return self._deserialize(raw, self.ctx)


def _registry_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the registry's failure (unreachable, refusing, erring: not a record's
    fault, so the batch stops and is read again) rather than a record's."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    if isinstance(exc, SchemaRegistryError):
        return exc.http_status_code != 404
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2")


class AvroRecordDecoder(SchemaRegistryDecoder):
    """Avro. confluent-kafka's ``AvroDeserializer`` costs about 13 us a record here (its subject,
    cache and rule steps per record), 20x orjson's JSON. So when a schema has no data-contract
    rules and no reader schema is asked for (``use_latest_version``), its records are read by
    fastavro's ``schemaless_reader`` with the writer schema fetched and parsed as the deserializer
    does (3 us a record), which is what the deserializer itself calls after those steps;
    otherwise every record takes the deserializer. A schema id always takes the same path, so a
    record decodes the same in any batch. ``timestamp-millis`` fields stay epoch milliseconds
    (no datetime made and undone per record, none out of datetime's range)."""

    name, schema_type = "avro", "AVRO"

    def deserializer(self, conf: dict):
        from confluent_kafka.schema_registry.avro import AvroDeserializer

        self._fast: dict[int, Any] = {}  # schema id -> _fast_schema's answer
        return AvroDeserializer(self.registry, conf=conf)

    def decode(self, raws: Sequence[Optional[bytes]]) -> list[Union[Mapping, InvalidRecord]]:
        """The records of fast-read schema ids in one stream per schema id (no object per
        record but its value); the others one by one (:meth:`decode_one`)."""
        import io

        from fastavro import schemaless_reader

        out: list = [None] * len(raws)
        by_schema: dict[int, list[int]] = {}
        for i, raw in enumerate(raws):
            if raw and len(raw) > 5 and raw[0] == 0:
                by_schema.setdefault(int.from_bytes(raw[1:5], "big"), []).append(i)
            else:
                out[i] = self.decode_one(raw)
        for schema_id, index in by_schema.items():
            try:
                fast = self._fast.get(schema_id, False)
                if fast is False:
                    fast = self._fast[schema_id] = self._fast_schema(schema_id)
            except Exception as exc:  # noqa: BLE001 - an unknown id is each record's; the registry's failure is raised
                if _registry_failure(exc):
                    raise
                fast = None
            if fast is None:
                for i in index:
                    out[i] = self.decode_one(raws[i])
                continue
            parsed, plain = fast
            payloads = [raws[i][5:] for i in index]
            stream = io.BytesIO(b"".join(payloads))
            tell = stream.tell
            for i, end in zip(index, itertools.accumulate(map(len, payloads))):
                try:
                    obj = schemaless_reader(stream, parsed, None)
                    if tell() != end:  # each payload read to its end, no further
                        raise ValueError("trailing or missing bytes")
                except Exception as exc:  # noqa: BLE001 - any failure of a payload is that record's
                    stream.seek(end)
                    out[i] = InvalidRecord(f"does not decode as avro with schema id {schema_id} ({type(exc).__name__})")
                    continue
                if plain:
                    obj = _plain(obj)
                out[i] = obj if type(obj) is dict else InvalidRecord(f"avro schema id {schema_id} is not a record")
        return out

    def _fast_schema(self, schema_id: int):
        """(fastavro's parsed writer schema, whether values need :func:`_plain`) of a schema id
        fastavro may read directly, or None where the deserializer must read its records
        (data-contract rules, a reader schema). Raises the registry's 404 for an unknown id."""
        import fastavro
        from confluent_kafka.schema_registry.avro import _resolve_named_schema, _schema_loads

        schema = self.registry.get_schema(schema_id)
        if schema.rule_set is not None or self.settings.use_latest_version:
            return None
        # the deserializer's own steps (confluent-kafka's _get_parsed_schema), timestamps kept as longs
        named = {name: _millis(parsed) for name, parsed in _resolve_named_schema(schema, self.registry).items()}
        plain = _millis(json.loads(_schema_loads(schema.schema_str).schema_str))
        return fastavro.parse_schema(plain, named_schemas=named), "logicalType" in json.dumps([plain, named])


def _millis(schema):
    """An Avro schema (parsed JSON) with ``timestamp-millis`` types as their plain longs."""
    if isinstance(schema, dict):
        if schema.get("logicalType") in ("timestamp-millis", "local-timestamp-millis"):
            return "long"
        return {k: _millis(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_millis(v) for v in schema]
    return schema


class JsonSchemaRecordDecoder(SchemaRegistryDecoder):
    name, schema_type = "json_schema", "JSON"

    def deserializer(self, conf: dict):
        from confluent_kafka.schema_registry.json_schema import JSONDeserializer

        return JSONDeserializer(None, schema_registry_client=self.registry, conf=conf)


class ProtobufRecordDecoder(SchemaRegistryDecoder):
    """Protobuf needs a message class to decode into; a worker has none generated. So the
    writer's schema (its .proto from the registry) is compiled into a class once per schema id
    and message, by confluent-kafka's own schema parsing, and confluent-kafka's
    ``ProtobufDeserializer`` of that class decodes the records."""

    name, schema_type = "protobuf", "PROTOBUF"

    def deserializer(self, conf: dict):
        self._conf = conf
        self._by_message: dict[tuple, Any] = {}
        return self._decode

    def _decode(self, raw: bytes, ctx):
        from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
        from confluent_kafka.schema_registry.serde import SchemaId

        schema_id = SchemaId("PROTOBUF")
        schema_id.from_bytes(__import__("io").BytesIO(raw))
        key = (schema_id.id, tuple(schema_id.message_indexes or ()))
        deserializer = self._by_message.get(key)
        if deserializer is None:
            deserializer = self._by_message[key] = ProtobufDeserializer(self._message_class(*key), self._conf, self.registry)
        return _message_dict(deserializer(raw, ctx))

    def _message_class(self, schema_id: int, indexes: tuple):
        from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
        from google.protobuf.message_factory import GetMessageClass

        # confluent-kafka's parsing of a registered .proto (with its references) into a pool
        parser = ProtobufDeserializer.__new__(ProtobufDeserializer)
        from confluent_kafka.schema_registry.serde import ParsedSchemaCache

        parser._registry, parser._parsed_schemas = self.registry, ParsedSchemaCache()
        fd_proto, pool = parser._get_parsed_schema(self.registry.get_schema(schema_id))
        file = pool.FindFileByName(fd_proto.name)
        return GetMessageClass(parser._get_message_desc(pool, file, list(indexes) or [0]))


def _message_dict(message) -> dict:
    """A Protobuf message as a dict of its set fields, by their proto names, with native values
    (json_format's would turn 64-bit integers into strings)."""
    out = {}
    for field, value in message.ListFields():
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            value = [_message_dict(v) for v in value] if field.is_repeated else _message_dict(value)
        elif field.message_type is not None:  # a map
            value = dict(value)
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


DECODERS: dict[str, type] = {d.name: d for d in (JsonRecordDecoder, AvroRecordDecoder, ProtobufRecordDecoder, JsonSchemaRecordDecoder)}
#: the formats read through a schema registry (they need the config's ``schema_registry``)
REGISTRY_FORMATS = ("avro", "protobuf", "json_schema")


def decoder_for(name: str, registry=None, topic: str = "") -> RecordDecoder:
    """The decoder of an input format (``input_format`` in the config); ``registry``: the
    config's ``schema_registry`` settings, for the formats that need one; ``topic``: the input
    topic (its subject, for a reader schema)."""
    if name not in DECODERS:
        raise ValueError(f"input_format: must be one of {', '.join(DECODERS)}, got {name!r}")
    if name in REGISTRY_FORMATS:
        if registry is None:
            raise ValueError(f"input_format {name!r} needs a schema_registry section (its url)")
        return DECODERS[name](registry, topic)
    return DECODERS[name]()
