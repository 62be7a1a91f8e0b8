"""Record decoding (dpstream.topics.decoding) and field extraction (dpstream.topics.records): a batch decodes to one
mapping or invalid record per value, in order, exactly as each value alone would; reasons name the
field and never quote the content; the config refuses an unknown input format by name."""
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dpstream.processor.config import DpstreamConfig, DynamicQueryConfig
from dpstream.topics.decoding import DECODERS, JsonRecordDecoder, decoder_for
from dpstream.topics.records import (
    Event,
    EventParser,
    InvalidRecord,
    Update,
    UpdateParser,
)
from tests.conftest import TEST_SECRET_HEX  # noqa: E402 - after the product's imports

SECRET_LOOKING = "user-4711-private"


def test_a_batch_keeps_order_and_names_each_problem():
    raws = [b'{"user_id":"a","key":"k","ts":5}', b"not json", b"[1,2]", None, b'{"user_id":"b","key":"k","ts":6}', b"NaN"]
    out = JsonRecordDecoder().decode(raws)
    assert [o.reason if isinstance(o, InvalidRecord) else o["user_id"] for o in out] == [
        "a", "not valid JSON", "not a JSON object", "no value (a tombstone)", "b", "not valid JSON"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=30), st.none(),
                          st.dictionaries(st.sampled_from(["user_id", "key", "ts", "v"]),
                                          st.one_of(st.integers(), st.text(max_size=5), st.floats(allow_nan=False), st.none()),
                                          max_size=4).map(lambda d: json.dumps(d).encode())), max_size=20))
def test_a_batch_decodes_as_its_records_would_alone(raws):
    decoder = JsonRecordDecoder()
    together = decoder.decode(raws)
    assert len(together) == len(raws)
    assert together == [decoder.decode([r])[0] for r in raws]


def test_field_reasons_name_the_field_never_the_content():
    parser = EventParser("user_id", ["country", "city"], "amount", "ts")
    decode = JsonRecordDecoder().decode
    cases = {
        b'{"country":"x","city":"y","amount":1,"ts":5}': "field 'user_id' is missing or null",
        json.dumps({"user_id": SECRET_LOOKING, "country": "x", "amount": 1, "ts": 5}).encode(): "field 'city' is missing or null",
        json.dumps({"user_id": SECRET_LOOKING, "country": "x", "city": "y", "amount": "1", "ts": 5}).encode():
            "field 'amount' must be a number",
        json.dumps({"user_id": SECRET_LOOKING, "country": "x", "city": "y", "amount": 1, "ts": 5.5}).encode():
            "field 'ts' must be an integer (epoch milliseconds)",
        json.dumps({"user_id": SECRET_LOOKING, "country": "x", "city": "y", "amount": 1, "ts": 1 << 60}).encode():
            "field 'ts' is out of range",
    }
    for raw, reason in cases.items():
        got = parser.from_mapping(decode([raw])[0])
        assert isinstance(got, InvalidRecord) and got.reason == reason
        assert SECRET_LOOKING not in got.reason
    ok = parser.from_mapping(decode([b'{"user_id":7,"country":"x","city":"y","amount":2.5,"ts":9}'])[0])
    assert ok == Event("7", '["x","y"]', 2.5, 9)


def test_update_parser():
    query = DynamicQueryConfig(name="d", items=["a", "b"], start=1_795_132_800_000, tick="1m", epsilon=1.0,
                               unit_field="u")
    parser = UpdateParser(query, query.items)
    start = query.start
    good = parser.from_mapping({"item": "a", "op": "delete", "ts": start + 60_000, "u": "x"})
    assert good == Update("a", "delete", 2, start + 60_000, "x")
    for obj, reason in [({"item": "c", "op": "insert", "ts": start, "u": "x"}, "field 'item' is not in the query's declared items"),
                        ({"item": "a", "op": "upsert", "ts": start, "u": "x"}, "field 'op' must be 'insert' or 'delete'"),
                        ({"item": "a", "op": "insert", "ts": start - 1, "u": "x"}, "field 'ts' is before the query's start"),
                        ({"item": "a", "op": "insert", "ts": start}, "field 'u' is missing or null")]:
        got = parser.from_mapping(obj)
        assert isinstance(got, InvalidRecord) and got.reason == reason


def test_input_format_is_validated_by_name():
    assert isinstance(decoder_for("json"), JsonRecordDecoder) and set(DECODERS) == {"json", "avro", "protobuf", "json_schema"}
    with pytest.raises(ValidationError, match="input_format"):
        DpstreamConfig(queries=[{"name": "q", "epsilon": 1.0, "delta": 1e-6}], input_format="csv")
    with pytest.raises(ValidationError, match="schema_registry: input_format 'avro'"):  # tests/test_schema_registry.py
        DpstreamConfig(queries=[{"name": "q", "epsilon": 1.0, "delta": 1e-6}], input_format="avro")
    with pytest.raises(ValueError, match="input_format"):
        decoder_for("csv")


#: values that parsing must refuse or convert, per field kind (half of all edits), and anything else
_EDGES = ["x" * 4097, "", -1, 1 << 53, 1 << 70, float("inf"), float("nan"), 2.0, 2.5, True, None, 7]
_FIELD = st.one_of(st.sampled_from(_EDGES), st.sampled_from(_EDGES), st.sampled_from(_EDGES), st.one_of(st.text(max_size=6), st.integers(-3, 1 << 54), st.floats(), st.booleans(),
                                                      st.lists(st.integers(), max_size=2)))
_PLAIN = st.fixed_dictionaries({"u": st.text(min_size=1, max_size=6), "k": st.text(min_size=1, max_size=6), "ts": st.integers(0, 1 << 40),
                                "v": st.one_of(st.integers(-100, 100), st.floats(-1e6, 1e6))})
_EDIT = st.tuples(st.integers(0, 11), st.sampled_from(["u", "k", "ts", "v", "k2"]), st.one_of(st.just("drop"), _FIELD, _FIELD, _FIELD))


def _edited(plain: list, edits: list) -> list:
    """The plain records (with a second key field) after the edits: a field dropped or set."""
    objs = [{**o, "k2": o["k"] + "/"} for o in plain]
    for at, name, value in edits:
        if value == "drop":
            objs[at % len(objs)].pop(name, None)
        else:
            objs[at % len(objs)][name] = value
    return objs


@settings(max_examples=400, deadline=None)
@given(st.lists(_PLAIN, min_size=1, max_size=12), st.lists(_EDIT, max_size=2), st.sampled_from([False, False, False, True]), st.sampled_from([("k",), ("k", "k2")]),
       st.sampled_from([None, "v"]))
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "ts", -1)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "ts", 1 << 53)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "ts", 1 << 70)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "ts", 2.0)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "k", "x" * 4097)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "u", "")], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "u", 7)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "v", float("inf"))], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "v", float("nan"))], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "v", True)], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "v", "3")], False, ("k",), "v")
@example([{"u": "a", "k": "b", "ts": 5, "v": 1}, {"u": "c", "k": "d", "ts": 6, "v": 2.5}], [(1, "k", None)], False, ("k",), "v")
def test_batch_parsing_equals_parsing_each_record(plain, edits, undecodable, key_fields, value_field):
    """EventParser.parse_batch (the worker's per-batch path) gives the same events and the same
    reasons as parsing each record alone: plain batches, and batches where one field of a record
    is missing, of another type, empty, too long, non-finite or out of range, or a record did
    not decode."""
    objs = _edited(plain, edits)
    if undecodable:
        objs.insert(len(objs) // 2, InvalidRecord("not valid JSON"))
    parser = EventParser("u", key_fields, value_field, "ts")
    batch = parser.parse_batch(objs)
    one_by_one = [parser.from_mapping(o) for o in objs]
    expect_events = [(i, e) for i, e in enumerate(one_by_one) if not isinstance(e, InvalidRecord)]
    assert batch.index.tolist() == [i for i, _ in expect_events]
    assert batch.users == [e.user for _, e in expect_events] and batch.keys == [e.key for _, e in expect_events]
    assert batch.values.tolist() == [e.value for _, e in expect_events] and batch.ts.tolist() == [e.ts for _, e in expect_events]
    assert batch.invalid == {i: e.reason for i, e in enumerate(one_by_one) if isinstance(e, InvalidRecord)}


@settings(max_examples=300, deadline=None)
@given(st.lists(_PLAIN, min_size=1, max_size=12), st.lists(_EDIT, max_size=2), st.sampled_from([("k",), ("k", "k2")]),
       st.sampled_from([None, "v"]), st.sampled_from(["c", "d"]))
def test_dotted_fields_read_a_debezium_envelope_as_the_flat_record(plain, edits, key_fields, value_field, op):
    """A query naming ``after.u`` (a Debezium change event: ``{"before", "after", "op", ...}``)
    gets from each envelope exactly the event, or the refusal, the flat record gives with ``u``,
    by the batch path and one by one; a delete (``after`` null) is refused as missing its user."""
    objs = _edited(plain, edits)
    envelopes = [{"before": None, "after": o if op == "c" else None, "op": op, "ts_ms": 1} for o in objs]
    flat = EventParser("u", key_fields, value_field, "ts")
    nested = EventParser("after.u", [f"after.{k}" for k in key_fields], value_field and f"after.{value_field}", "after.ts")
    batch = nested.parse_batch(envelopes)
    one_by_one = [nested.from_mapping(o) for o in envelopes]
    assert batch.invalid == {i: e.reason for i, e in enumerate(one_by_one) if isinstance(e, InvalidRecord)}
    assert batch.users == [e.user for e in one_by_one if not isinstance(e, InvalidRecord)]
    if op == "d":
        assert set(batch.invalid.values()) == {"field 'after.u' is missing or null"}
        return
    expected = [flat.from_mapping(o) for o in objs]
    for got, want in zip(one_by_one, expected):
        if isinstance(want, InvalidRecord):
            assert isinstance(got, InvalidRecord) and got.reason == want.reason.replace("field '", "field 'after.")
        else:
            assert got == want


def test_a_field_named_with_a_dot_is_read_before_a_nested_path():
    parser = EventParser("user.id", ["page"], None, "ts")
    assert parser.from_mapping({"user.id": "flat", "user": {"id": "nested"}, "page": "p", "ts": 1}).user == "flat"
    assert parser.from_mapping({"user": {"id": "nested"}, "page": "p", "ts": 1}).user == "nested"
    assert parser.from_mapping({"user": "not-an-object", "page": "p", "ts": 1}) == InvalidRecord("field 'user.id' is missing or null")


def test_debezium_change_events_replay_to_the_flat_events_releases(tmp_path):
    """The same events, flat and wrapped as Debezium change events (with the envelope's own
    ``ts_ms``), under one noise label: the same releases."""
    import dpstream

    rng = __import__("random").Random(5)
    flat = [{"user_id": f"u{rng.randrange(300)}", "page": f"p{min(int(rng.paretovariate(1.2)), 12)}",
             "ts": 1_767_225_600_000 + i * 100} for i in range(6_000)]
    (tmp_path / "key").write_text(TEST_SECRET_HEX)
    (tmp_path / "key").chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    base = ("queries:\n  - name: pages\n    input_topic: cdc\n    output_topic: out\n    window: 10m\n    triggers: 2\n"
            "    contribution_bound: 3\n    epsilon: 4\n    delta: 1.0e-9\n")
    (tmp_path / "flat.yaml").write_text(base + "    user_field: user_id\n    key_fields: [page]\n    time_field: ts\n")
    (tmp_path / "cdc.yaml").write_text(base + "    user_field: after.user_id\n    key_fields: [after.page]\n    time_field: after.ts\n")
    envelopes = [{"before": None, "after": e, "op": "c", "ts_ms": e["ts"] + 7, "source": {"table": "clicks"}} for e in flat]
    run = {"noise_key_file": str(tmp_path / "key"), "noise_label": "debezium-test"}
    released = dpstream.replay(str(tmp_path / "flat.yaml"), flat, **run)
    assert len(released) >= 5
    assert dpstream.replay(str(tmp_path / "cdc.yaml"), envelopes, **run) == released


def test_produce_keys_and_rebases_a_debezium_envelope_by_its_dotted_fields():
    from dpstream.processor.adapters.kafka_tools import rebased, user_key

    envelope = {"before": None, "after": {"user_id": 12.0, "ts": 1000}, "op": "c"}
    assert user_key(envelope, "after.user_id") == b"12"  # the text the worker reads, so the key matches
    assert user_key({"before": {"user_id": "u"}, "after": None, "op": "d"}, "after.user_id") is None
    assert user_key({"after": {"user_id": {"id": 1}}}, "after.user_id") is None  # not a user id the worker takes
    moved = json.loads(next(rebased([json.dumps(envelope).encode()], "after.ts", 500)))
    assert moved["after"]["ts"] == 1500 and moved["op"] == "c"
