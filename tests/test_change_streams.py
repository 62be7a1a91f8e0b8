"""Dynamic queries over a database's change stream (issue 33, item 1): records in Debezium's
envelope, as its PostgreSQL connector writes them through Kafka Connect's JsonConverter, with and
without schemas (topics/records.py, ChangeEventParser; docs/user-guide.md, "Change streams").

What is checked: each op's updates (c and r insert the after row's item, d deletes the before
row's, u deletes one and inserts the other, or nothing when the item stayed), tombstones skipped,
what cannot be read refused naming the field; the releases of a change stream equal those of the
same updates written as {"item", "op", "ts"} records at the same per-update epsilon; and the
neighbour relation: removing one change event from any stream removes exactly its own updates
from what the counter takes in (docs/privacy.md, "Change streams")."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from dpstream.topics.decoding import JsonRecordDecoder
from dpstream.topics.records import TOMBSTONE, ChangeEventParser, InvalidRecord, Update
from tests.conftest import TEST_SECRET

PLANS = ["free", "pro", "team"]
START = 1_795_132_800_000  # 2026-11-21T00:00:00Z

#: the envelope's schema as the JsonConverter writes it with schemas.enable=true (Debezium 2.7,
#: PostgreSQL connector, table public.subscriptions), abridged to the fields a row has here
ROW_SCHEMA = {"type": "struct", "optional": True, "name": "dbserver1.public.subscriptions.Value", "fields": [
    {"type": "int32", "optional": False, "default": 0, "field": "id"},
    {"type": "string", "optional": False, "field": "customer_id"},
    {"type": "string", "optional": False, "field": "plan"},
    {"type": "string", "optional": True, "field": "status"}]}
ENVELOPE_SCHEMA = {"type": "struct", "optional": False, "name": "dbserver1.public.subscriptions.Envelope", "version": 2,
                   "fields": [dict(ROW_SCHEMA, field="before"), dict(ROW_SCHEMA, field="after"),
                              {"type": "struct", "optional": False, "name": "io.debezium.connector.postgresql.Source",
                               "field": "source", "fields": [{"type": "string", "optional": False, "field": "version"},
                                                             {"type": "int64", "optional": False, "field": "ts_ms"}]},
                              {"type": "string", "optional": False, "field": "op"},
                              {"type": "int64", "optional": True, "field": "ts_ms"},
                              {"type": "int64", "optional": True, "field": "ts_us"},
                              {"type": "int64", "optional": True, "field": "ts_ns"},
                              {"type": "struct", "optional": True, "name": "event.block", "version": 1, "field": "transaction",
                               "fields": [{"type": "string", "optional": False, "field": "id"}]}]}


def row(id_: int, plan: str, customer: str = "c-1", status: str = "active") -> dict:
    return {"id": id_, "customer_id": customer, "plan": plan, "status": status}


def event(op: str, before: dict | None, after: dict | None, ts: int, lsn: int = 23_456_789) -> dict:
    """A change event's value as Debezium's PostgreSQL connector writes it (no schema)."""
    return {"before": before, "after": after,
            "source": {"version": "2.7.3.Final", "connector": "postgresql", "name": "dbserver1", "ts_ms": ts - 120,
                       "snapshot": "true" if op == "r" else "false", "db": "shop", "sequence": f'[null,"{lsn}"]',
                       "ts_us": (ts - 120) * 1000, "ts_ns": (ts - 120) * 1_000_000, "schema": "public",
                       "table": "subscriptions", "txId": 780, "lsn": lsn, "xmin": None},
            "transaction": None, "op": op, "ts_ms": ts, "ts_us": ts * 1000, "ts_ns": ts * 1_000_000}


def with_schema(value: dict) -> dict:
    return {"schema": ENVELOPE_SCHEMA, "payload": value}


def query(**kw) -> DynamicQueryConfig:
    settings_ = dict(name="plans", items=PLANS, epsilon=2.0, start=START, tick="1s", envelope="debezium", item_field="plan")
    settings_.update(kw)
    return DynamicQueryConfig(**settings_)


def decoded(value) -> object:
    """The value as the worker decodes it from Kafka (None: a tombstone)."""
    return JsonRecordDecoder().decode([None if value is None else json.dumps(value).encode()])[0]


# ---------------------------------------------------------------- reading one event
def test_each_op_of_an_envelope_is_its_updates_with_and_without_schemas():
    parser = ChangeEventParser(query(unit_field="customer_id"), PLANS)
    t = START + 5_500
    cases = [
        (event("c", None, row(1, "pro", "c-1"), t), [Update("pro", "insert", 6, t, "c-1")]),
        (event("r", None, row(2, "free", "c-2"), t), [Update("free", "insert", 6, t, "c-2")]),
        (event("d", row(1, "pro", "c-1"), None, t), [Update("pro", "delete", 6, t, "c-1")]),
        # a plan change: the old plan loses the row, the new one gains it; both the row's unit (after)
        (event("u", row(1, "free", "c-9"), row(1, "team", "c-1"), t),
         [Update("free", "delete", 6, t, "c-1"), Update("team", "insert", 6, t, "c-1")]),
        (event("u", row(1, "pro", "c-1", "active"), row(1, "pro", "c-1", "paused"), t), []),  # same plan
    ]
    for value, updates in cases:
        assert parser.from_mapping(decoded(value)) == updates, value["op"]
        assert parser.from_mapping(decoded(with_schema(value))) == updates, value["op"]
    assert parser.from_mapping(decoded(None)) == []  # the tombstone after a delete
    assert decoded(None) is TOMBSTONE


def test_what_cannot_be_read_is_refused_naming_the_field_never_the_content():
    parser = ChangeEventParser(query(), PLANS)
    t = START + 1_000
    secret = "enterprise-for-acme-corp"
    cases = [
        # PostgreSQL without REPLICA IDENTITY FULL: deletes and updates carry no old row
        (event("d", None, None, t), "field 'before' is missing or null for op 'd'"),
        (event("u", None, row(1, "pro"), t), "field 'before' is missing or null for op 'u'"),
        (event("c", None, row(1, secret), t), "field after.'plan' is not in the query's declared items"),
        (event("u", row(1, secret), row(1, "pro"), t), "field before.'plan' is not in the query's declared items"),
        (dict(event("c", None, row(1, "pro"), t), op="t"), "field 'op' must be 'c', 'r', 'u' or 'd'"),  # a truncate
        (dict(event("c", None, row(1, "pro"), t), ts_ms=None), "field 'ts_ms' must be an integer"),
        (event("c", None, row(1, "pro"), START - 1), "field 'ts_ms' is before the query's start"),
        ({"schema": ENVELOPE_SCHEMA, "payload": None}, "field 'payload' is not an object"),
    ]
    for value, reason in cases:
        got = parser.from_mapping(decoded(value))
        assert isinstance(got, InvalidRecord) and got.reason.startswith(reason), (value.get("op"), got)
        assert secret not in got.reason


def test_config_reads_columns_of_the_row_and_the_envelopes_time():
    q = query(item_field="after.plan", unit_field="after.customer_id")
    assert (q.item_field, q.unit_field, q.time_field) == ("plan", "customer_id", "ts_ms")
    assert query(time_field="source.ts_ms").time_field == "source.ts_ms"
    parser = ChangeEventParser(query(time_field="source.ts_ms"), PLANS)
    t = START + 3_000
    assert parser.from_mapping(event("c", None, row(1, "pro"), t))[0].ts == t - 120  # the database's commit time
    # a change event is up to two updates: without a unit field, each runs at half the epsilon
    assert query().plan().epsilon == pytest.approx(1.0)
    assert query(unit_field="customer_id", contribution_bound=4).plan().epsilon == pytest.approx(0.5)
    assert DynamicQueryConfig(name="plans", items=PLANS, epsilon=2.0, start=START).plan().epsilon == pytest.approx(2.0)
    # a state begun on one envelope never resumes on the other
    plain = DynamicQueryConfig(name="plans", items=PLANS, epsilon=2.0, start=START, unit_field="customer_id", contribution_bound=4)
    assert plain.fingerprint() != query(unit_field="customer_id", contribution_bound=4).fingerprint()


# ---------------------------------------------------------------- streams
def changes(draw_ops: list[tuple[int, int, int]], rows: int = 6) -> list[dict]:
    """A valid-looking change stream from (row, plan, gap) draws: a row not present is created
    (c, or r for the first few: a snapshot), a present one is deleted when the drawn plan is its
    own and moved to the drawn plan otherwise; times advance by the drawn gap in ms."""
    present: dict[int, str] = {}
    out, t = [], START
    for i, (r, p, gap) in enumerate(draw_ops):
        r, plan = r % rows, PLANS[p % len(PLANS)]
        t += gap
        if r not in present:
            out.append(event("r" if i < 3 else "c", None, row(r, plan, f"c-{r}"), t))
            present[r] = plan
        elif present[r] == plan:
            out.append(event("d", row(r, plan, f"c-{r}"), None, t))
            del present[r]
        else:
            out.append(event("u", row(r, present[r], f"c-{r}"), row(r, plan, f"c-{r}"), t))
            present[r] = plan
    return out


def as_updates(values: list[dict]) -> list[dict]:
    """The same stream written in the plain update format, one record per update."""
    out = []
    for v in values:
        for side, op in (("before", "delete"), ("after", "insert")):
            if v[side] is not None and not (v["op"] == "u" and v["before"]["plan"] == v["after"]["plan"]):
                out.append({"item": v[side]["plan"], "op": op, "ts": v["ts_ms"]})
    return out


def releases(q: DynamicQueryConfig, records: list, until: int) -> tuple[list[dict], list]:
    store = MemoryStore()
    state = DynamicQueryState(q, NodeNoise(TEST_SECRET), Pseudonymizer(TEST_SECRET), store)
    batch = WriteBatch()
    for rec in records:
        assert state.apply(rec, batch) is None
    logged = [(u.item, u.op, u.tick) for u in state.waiting]
    state.advance_clock(until, batch)
    store.write(batch)
    keep = ("segment", "tick", "time", "counts", "total")
    return [{k: r[k] for k in keep} for r in state.take_pending()], logged


draws = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2), st.integers(0, 900)), min_size=1, max_size=120)


@settings(max_examples=40, deadline=None)
@given(draws, st.sampled_from(["baseline", "interval_tree"]))
def test_a_change_stream_releases_what_its_updates_release_at_the_same_epsilon_per_update(ops, mechanism):
    values = changes(ops)
    until = values[-1]["ts_ms"] + 5_000
    got, logged = releases(query(mechanism=mechanism), [decoded(v) for v in values], until)
    plain = DynamicQueryConfig(name="plans", items=PLANS, epsilon=1.0, start=START, tick="1s", mechanism=mechanism)
    assert plain.plan() == query(mechanism=mechanism).plan()
    want, want_logged = releases(plain, as_updates(values), until)
    assert logged == want_logged
    assert got == want


@settings(max_examples=60, deadline=None)
@given(draws, st.data())
def test_removing_one_change_event_removes_exactly_its_own_updates(ops, data):
    """Neighbouring change streams (one event more or less, anywhere, whatever the others hold:
    the stream need not be consistent once an event is removed) differ in what the counter takes
    in by that event's updates only, each at the event's own tick, the others keeping their ticks
    and their order."""
    values = changes(ops)
    gone = data.draw(st.integers(0, len(values) - 1))
    until = values[-1]["ts_ms"] + 5_000
    _, logged = releases(query(), [decoded(v) for v in values], until)
    _, without = releases(query(), [decoded(v) for i, v in enumerate(values) if i != gone], until)
    own = ChangeEventParser(query(), PLANS).from_mapping(values[gone])
    assert len(own) <= 2
    # the updates of the events before it, then its own, then those after it
    before = sum(len(ChangeEventParser(query(), PLANS).from_mapping(v)) for v in values[:gone])
    assert logged[:before] == without[:before]
    assert logged[before:before + len(own)] == [(PLANS.index(u.item), u.op, u.tick) for u in own]
    assert logged[before + len(own):] == without[before:]


def test_a_units_bound_takes_a_change_event_whole_or_not_at_all():
    store = MemoryStore()
    state = DynamicQueryState(query(unit_field="customer_id", contribution_bound=3), NodeNoise(TEST_SECRET),
                              Pseudonymizer(TEST_SECRET), store)
    batch = WriteBatch()
    t = START + 100
    assert state.apply(decoded(event("c", None, row(1, "free", "c-7"), t)), batch) is None  # 1 update
    assert state.apply(decoded(event("u", row(1, "free", "c-7"), row(1, "pro", "c-7"), t)), batch) is None  # 2: 3 in all
    assert len(state.waiting) == 3
    assert state.apply(decoded(event("u", row(1, "pro", "c-7"), row(1, "team", "c-7"), t)), batch) is None  # over: whole
    assert len(state.waiting) == 3 and state.dropped["contribution_bound"] == 1
    assert state.apply(decoded(event("c", None, row(2, "team", "c-8"), t)), batch) is None  # another unit
    assert len(state.waiting) == 4
    # a tombstone and a change within one plan carry nothing, and use nothing of the bound
    assert state.apply(TOMBSTONE, batch) is None
    assert state.apply(decoded(event("u", row(2, "team", "c-8"), row(2, "team", "c-8", "paused"), t)), batch) is None
    assert len(state.waiting) == 4 and sum(state.dropped.values()) == 1


def replay(tmp_path, dynamic: dict, lines: list[dict], until: int) -> list[dict]:
    import io

    from dpstream.processor.adapters.replay import ReplayRunner
    from dpstream.processor.planning import as_config

    path = tmp_path / f"in-{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("".join(json.dumps(v) + "\n" for v in lines))
    runner = ReplayRunner(as_config({"queries": [], "dynamic": [dynamic]}), TEST_SECRET, None, noise_label="change-streams",
                          start_ms=START)
    out = io.StringIO()
    try:
        runner.run(str(path), out, until_ms=until)
    finally:
        runner.close()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_replay_of_a_change_stream_file_releases_what_its_updates_release(tmp_path):
    """`dpstream replay` over a file of change events (Debezium's JSON, with and without schemas,
    one per line) releases what the same updates in the plain format release at the same
    per-update epsilon; the published epsilon is the query's, for a change event."""
    values = changes([(r, r * 7 + i, 150 + 37 * i) for i, r in enumerate([0, 1, 2, 3, 0, 1, 2, 0, 4, 4, 5, 2, 1, 3] * 12)])
    until = values[-1]["ts_ms"] + 5_000
    base = {"name": "plans", "items": PLANS, "start": START, "tick": "1s"}
    got = replay(tmp_path, dict(base, envelope="debezium", item_field="after.plan", epsilon=2.0),
                 [with_schema(v) if i % 2 else v for i, v in enumerate(values)], until)
    want = replay(tmp_path, dict(base, epsilon=1.0), as_updates(values), until)
    assert len(got) >= 3 and {r["epsilon"] for r in got} == {2.0}
    strip = ("epsilon",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in got] == \
        [{k: v for k, v in r.items() if k not in strip} for r in want]


def test_the_worker_skips_tombstones_and_dead_letters_what_it_cannot_read(tmp_path):
    """The worker's dynamic stage on records as they come from the topic Debezium writes: a
    delete event, then its tombstone (a null value, Debezium's default tombstones.on.delete), and
    a delete without its old row: the first is logged, the tombstone skipped (no dead letter), the
    last dead-lettered with its reason and its bytes."""
    import base64

    from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
    from dpstream.processor.config import DpstreamConfig
    from dpstream.topics.kafka import DEAD_LETTER_TOPIC
    from tests.conftest import TEST_RUN_NONCE, Record

    topic = "dbserver1.public.subscriptions"
    cfg = DpstreamConfig(dynamic=[{"name": "plans", "input_topic": topic, "output_topic": "plan-counts", "start": START,
                                   "items": PLANS, "epsilon": 2.0, "envelope": "debezium", "item_field": "plan"}])
    worker = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {"in": 1}, 2, run_nonce=TEST_RUN_NONCE)
    t = START + 2_000
    bad = json.dumps(event("d", None, None, t)).encode()
    records = [Record(0, b'{"id":1}', json.dumps(event("c", None, row(1, "pro"), t)).encode(), t),
               Record(1, b'{"id":1}', json.dumps(event("d", row(1, "pro"), None, t)).encode(), t),
               Record(2, b'{"id":1}', None, t),
               Record(3, b'{"id":2}', bad, t)]
    result = worker.process_dynamic(topic, 0, records)
    letters = [json.loads(m.value) for m in result.messages if m.topic == DEAD_LETTER_TOPIC]
    assert [(d["reason"].split(" (")[0], base64.b64decode(d["original_b64"])) for d in letters] == [
        ("field 'before' is missing or null for op 'd'", bad)]
    assert letters[0]["source"] == f"{topic}/0@3"
    state = worker.dynamic_states[(topic, 0)][0]
    assert [(u.item, u.op) for u in state.waiting] == [(PLANS.index("pro"), "insert"), (PLANS.index("pro"), "delete")]
    worker.close()


def test_the_user_guides_change_stream_config_loads_and_reads_debeziums_events():
    """docs/user-guide.md, "Change streams": its config block as written loads, reads the columns
    it names from a change event, and runs at the epsilon per update the text says."""
    import yaml

    from dpstream.processor.config import DpstreamConfig
    from tests.test_docs_blocks import ROOT, blocks

    block = next(b for b in blocks(ROOT / "docs" / "user-guide.md") if "change-stream-config" in b.marker)
    cfg = DpstreamConfig(**yaml.safe_load(block.text))
    q = cfg.dynamic[0]
    assert (q.envelope, q.item_field, q.time_field, q.unit_field) == ("debezium", "plan", "ts_ms", "customer_id")
    assert q.plan().epsilon == pytest.approx(q.epsilon / q.contribution_bound)
    got = ChangeEventParser(q, q.items).from_mapping(event("u", row(4, "free", "c-4"), row(4, "pro", "c-4"), q.start + 1_500))
    assert [(u.item, u.op, u.unit) for u in got] == [("free", "delete", "c-4"), ("pro", "insert", "c-4")]


def debezium_avro_envelope() -> dict:
    """The value schema Debezium's AvroConverter registers for the table (abridged source block):
    before and after are optional records of the row, ts_ms an optional long."""
    value = {"type": "record", "name": "Value", "namespace": "dbserver1.public.subscriptions", "connect.name":
             "dbserver1.public.subscriptions.Value",
             "fields": [{"name": "id", "type": {"type": "int", "connect.default": 0}, "default": 0},
                        {"name": "customer_id", "type": "string"}, {"name": "plan", "type": "string"},
                        {"name": "status", "type": ["null", "string"], "default": None}]}
    source = {"type": "record", "name": "Source", "namespace": "io.debezium.connector.postgresql",
              "fields": [{"name": "version", "type": "string"}, {"name": "connector", "type": "string"},
                         {"name": "name", "type": "string"}, {"name": "ts_ms", "type": "long"},
                         {"name": "db", "type": "string"}, {"name": "schema", "type": "string"},
                         {"name": "table", "type": "string"}, {"name": "lsn", "type": ["null", "long"], "default": None}]}
    return {"type": "record", "name": "Envelope", "namespace": "dbserver1.public.subscriptions",
            "connect.name": "dbserver1.public.subscriptions.Envelope", "connect.version": 2,
            "fields": [{"name": "before", "type": ["null", value], "default": None},
                       {"name": "after", "type": ["null", "Value"], "default": None},
                       {"name": "source", "type": source}, {"name": "op", "type": "string"},
                       {"name": "ts_ms", "type": ["null", "long"], "default": None}]}


def test_change_events_in_avro_through_a_registry_are_read_as_their_json_twins(tmp_path):
    """`input_format: avro`: events serialized by confluent-kafka's AvroSerializer under the
    envelope schema Debezium's AvroConverter registers are logged exactly as the same events in
    JSON; a tombstone is skipped there too."""
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
    from dpstream.processor.config import DpstreamConfig
    from dpstream.topics.decoding import registry_client
    from tests.conftest import TEST_RUN_NONCE, Record

    topic = "dbserver1.public.subscriptions"
    url = f"mock://change-streams-{tmp_path.name}"
    values = changes([(r, r * 5 + i, 300) for i, r in enumerate([0, 1, 0, 2, 1, 0, 3, 2, 2, 1])])
    keep = ("before", "after", "op", "ts_ms")
    source = {"version": "2.7.3.Final", "connector": "postgresql", "name": "dbserver1", "db": "shop", "schema": "public",
              "table": "subscriptions", "lsn": 1}
    from dpstream.processor.config import SchemaRegistryConfig

    serialize = AvroSerializer(registry_client(SchemaRegistryConfig(url=url)), json.dumps(debezium_avro_envelope()))
    avro = [serialize({**{k: v[k] for k in keep}, "source": {**source, "ts_ms": v["source"]["ts_ms"]}},
                      SerializationContext(topic, MessageField.VALUE)) for v in values]
    logged = {}
    for fmt, raws in (("json", [json.dumps(v).encode() for v in values]), ("avro", avro)):
        cfg = DpstreamConfig(input_format=fmt, schema_registry={"url": url} if fmt == "avro" else None,
                             dynamic=[{"name": "plans", "input_topic": topic, "output_topic": "plan-counts", "start": START,
                                       "items": PLANS, "epsilon": 2.0, "envelope": "debezium", "item_field": "plan"}])
        worker = DpstreamWorker(cfg, TEST_SECRET, tmp_path / fmt, Ownership(), {"in": 1}, 2, run_nonce=TEST_RUN_NONCE)
        records = [Record(i, None, raw, v["ts_ms"]) for i, (raw, v) in enumerate(zip(raws, values))]
        records.append(Record(len(records), None, None, values[-1]["ts_ms"]))  # a tombstone
        result = worker.process_dynamic(topic, 0, records)
        assert not result.messages, [json.loads(m.value)["reason"] for m in result.messages]
        logged[fmt] = [(u.item, u.op, u.tick) for u in worker.dynamic_states[(topic, 0)][0].waiting]
        worker.close()
    assert len(logged["json"]) > len(values) and logged["avro"] == logged["json"]


def produce_as_debezium(broker: str, topic: str, part: list[dict], placed: dict | None = None) -> None:
    """Change events as Debezium's connector writes them: keyed by the row's id, half with the
    JsonConverter's schema, a tombstone after each delete; by a stock producer (default
    partitioner). ``placed``: where each event landed, (partition, offset) by id(event)."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": broker, "linger.ms": 5})
    for i, v in enumerate(part):
        key = json.dumps({"id": (v["after"] or v["before"])["id"]}).encode()

        def landed(err, msg, v=v):
            if placed is not None and err is None:
                placed[id(v)] = (msg.partition(), msg.offset())

        p.produce(topic, json.dumps(with_schema(v) if i % 2 else v).encode(), key, on_delivery=landed)
        if v["op"] == "d":
            p.produce(topic, None, key)  # tombstones.on.delete
    assert p.flush(30) == 0


def two_parts(seed: int, start: int) -> tuple[list[dict], list[dict], list[dict]]:
    """3,000 changes of 40 rows over 3 plans, split in two; the first part dated 1.5 s from
    ``start`` (the rest is dated by the test, when it writes it)."""
    draws = [(int(r), int(p), 1) for r, p in zip(np.random.default_rng(seed).integers(0, 40, 3_000),
                                                  np.random.default_rng(seed + 1).integers(0, 3, 3_000))]
    values = changes(draws, rows=40)
    first, rest = values[:len(values) // 2], values[len(values) // 2:]
    for i, v in enumerate(first):
        v["ts_ms"] = start + i // 2
    return values, first, rest


def kill_write_the_rest_and_restart(w, broker: str, topic: str, rest: list[dict], placed: dict | None = None) -> int:
    """SIGKILL worker ``w``, write the rest of the changes while it is down (dated from 5 s on:
    after every tick decided so far), start it again on its volume; returns the rest's start."""
    w.proc.kill()
    w.proc.wait()
    later = int(time.time() * 1000) + 5_000
    for i, v in enumerate(rest):
        v["ts_ms"] = later + i // 2
    produce_as_debezium(broker, topic, rest, placed)
    w.start().wait_ready()
    return later


def test_a_worker_on_a_debezium_topic_killed_mid_stream_releases_what_replay_does(tmp_path, broker):
    """Through Kafka, records exactly as Debezium's PostgreSQL connector writes them (keyed by the
    row's id, half of them with the JsonConverter's schema, a tombstone after each delete): a
    static worker takes in the first part, decides and releases its ticks, is SIGKILLed; the rest
    is written while it is down, and it restarts on its volume. What it released up to a tick
    equals replay's of the same events (the tombstones, which a file cannot hold, skipped by
    both), with no dead letter. Each part is written before the worker reads it, so how long a
    start takes on a loaded machine does not matter: a worker reads the backlog of an overdue
    tick before it decides it (docs/privacy.md, "Time")."""
    import uuid

    from dpstream.topics.kafka import DEAD_LETTER_TOPIC, INPUT_TOPIC_CONFIG, TopicSpec, create_topics
    from tests.test_kafka_worker import Scenario, canonical, runs, write_dynamic_config

    tag = uuid.uuid4().hex[:8]
    sc = Scenario(tmp_path, broker)
    name, topic, out = f"plans{tag}", f"dbserver1.public.subscriptions-{tag}", f"it-plan-counts-{tag}"
    tick_ms, lateness_ms = 20, 1000
    start = (int(time.time() * 1000) // 1000 + 4) * 1000  # tick 1 begins a few seconds from now
    write_dynamic_config(sc, name=name, input_topic=topic, output_topic=out, envelope="debezium", item_field="after.plan",
                         items="[free, pro, team]", start=start, tick=f"{tick_ms}ms", allowed_lateness=f"{lateness_ms}ms",
                         epsilon=2.0)
    values, first, rest = two_parts(8, start)  # 1.5 s of changes from tick 1, and the rest
    # as Debezium's topic would be set up for the worker: one partition, stamped by the broker
    create_topics(broker, [TopicSpec(topic, 1, INPUT_TOPIC_CONFIG)])
    produce_as_debezium(broker, topic, first)
    w = sc.worker("cdc").start()
    try:
        w.wait_ready()
        time.sleep(max(0.0, (start + 1_500 + lateness_ms) / 1000 + 2 - time.time()))  # the first part's ticks are due
        deadline = time.time() + 120
        while not sc.read(out):  # and the worker has decided some of them (it may have started late)
            assert time.time() < deadline, "no release of the first part within 120 s"
            time.sleep(1)
        later = kill_write_the_rest_and_restart(w, broker, topic, rest)
        horizon = (later + 1_500 - start) // tick_ms + 10
        time.sleep(max(0.0, (start + horizon * tick_ms + lateness_ms) / 1000 + 3 - time.time()))
        released = [r for r in sc.read(out) if r["tick"] <= horizon]
        sc.events.write_text("".join(json.dumps(v) + "\n" for v in values))
        [(_, label)] = runs(released)
        expected = sc.replay(label, until_ms=start + horizon * tick_ms + lateness_ms)
        assert len(expected) >= 5 and max(r["tick"] for r in expected) > (later - start) // tick_ms
        assert canonical(released) == canonical(expected)
        assert [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == name] == []
        assert w.metric("dpstream_events_dropped_total", query=name) == 0
    finally:
        w.stop()


@pytest.mark.parametrize("unit", [False, True], ids=["no-unit", "unit-bound"])
@pytest.mark.parametrize("assignment", ["static", "group"])
def test_workers_on_a_partitioned_debezium_topic_one_killed_mid_stream_release_what_replay_does(tmp_path, broker, assignment,
                                                                                                 unit):
    """Issue 33, item 2, through Kafka: Debezium's topic with 4 partitions, each event keyed by
    its row's id as the connector keys it (a stock producer's default partitioner spreads the
    rows; a row's plan changes, so one plan's updates are in every partition), and a query of 2
    shards. Two workers share the topic's partitions (routers) and the by-item topic's (shards):
    static halves, or an elastic group. One is SIGKILLed after the first part's releases, the
    rest is written while it is down, and it comes back on its volume. What they released up to
    a tick equals replay's of the same events read from one file (the baseline's tick is a set of
    counts: the order of a tick's updates does not matter), with no dead letter.

    With a unit bound (``unit_field: customer_id``, 8 customers whose rows, keyed by row id, are
    in every partition, 450 updates each at most: a fifth of the events are over it), the unit
    steps on the by-unit topic bound each customer across partitions: the releases equal
    replay's of the events in (tick, partition, offset) order, the order the bound takes a
    unit's events in, and the dropped ones are counted as over the bound, not dead-lettered."""
    import uuid

    from dpstream.topics.kafka import DEAD_LETTER_TOPIC, INPUT_TOPIC_CONFIG, TopicSpec, create_topics
    from tests.test_kafka_worker import Scenario, canonical, runs, write_dynamic_config

    tag = uuid.uuid4().hex[:8]
    sc = Scenario(tmp_path, broker)
    name, topic, out = f"plans{tag}", f"dbserver1.public.subscriptions-{tag}", f"it-plan-counts-{tag}"
    tick_ms, lateness_ms = 20, 1000
    start = (int(time.time() * 1000) // 1000 + 4) * 1000
    bound = {"unit_field": "customer_id", "contribution_bound": 450, "epsilon": 900.0} if unit else {"epsilon": 2.0}
    write_dynamic_config(sc, name=name, input_topic=topic, output_topic=out, envelope="debezium", item_field="after.plan",
                         items="[free, pro, team]", start=start, tick=f"{tick_ms}ms", allowed_lateness=f"{lateness_ms}ms",
                         shards=2, **bound)
    values, first, rest = two_parts(18, start)
    placed: dict = {}
    if unit:  # 8 customers, each with rows (so records) in every partition
        for v in values:
            for side in ("before", "after"):
                if v[side] is not None:
                    v[side]["customer_id"] = f"c-{v[side]['id'] % 8}"
    create_topics(broker, [TopicSpec(topic, 4, INPUT_TOPIC_CONFIG)])

    def worker(who: str, index: int):
        if assignment == "group":
            return sc.worker(who, extra=("--assignment", "group", "--instance-id", who))
        return sc.worker(who, index, 2)

    produce_as_debezium(broker, topic, first, placed)
    a, b = worker("a", 0).start(), worker("b", 1).start()
    sc.workers += [a, b]
    try:
        a.wait_ready()
        b.wait_ready()
        time.sleep(max(0.0, (start + 1_500 + lateness_ms) / 1000 + 2 - time.time()))  # the first part's ticks are due
        deadline = time.time() + 120
        while len({r.get("shard") for r in sc.read(out)}) < 2:  # both shards have released (the workers may start late)
            assert time.time() < deadline, "no release of each shard within 120 s"
            time.sleep(1)
        later = kill_write_the_rest_and_restart(b, broker, topic, rest, placed)
        if unit:  # the order a unit step bounds in: (tick, partition, offset)
            values = sorted(values, key=lambda v: ((v["ts_ms"] - start) // tick_ms, *placed[id(v)]))
        horizon = (later + 1_500 - start) // tick_ms + 10
        time.sleep(max(0.0, (start + horizon * tick_ms + lateness_ms) / 1000 + 3 - time.time()))
        deadline = time.time() + 120  # a loaded machine (CI) restarts a worker slowly
        while True:  # a group hands the killed worker's partitions over first (its session timeout)
            released = [r for r in sc.read(out) if r["tick"] <= horizon]
            sc.events.write_text("".join(json.dumps(v) + "\n" for v in values))
            [(_, label)] = runs(released)
            expected = sc.replay(label, until_ms=start + horizon * tick_ms + lateness_ms)
            if canonical(released) == canonical(expected) or time.time() > deadline:
                break
            time.sleep(3)
        assert len(expected) >= 5 and {r["shard"] for r in expected} == {0, 1}
        assert max(r["tick"] for r in expected) > (later - start) // tick_ms
        assert canonical(released) == canonical(expected), (
            f"{sc.drops()}; the workers' logs end: {a.log.read_text()[-1500:]!r} / {b.log.read_text()[-1500:]!r}")
        assert [d for d in sc.read(DEAD_LETTER_TOPIC) if d.get("query") == name] == []
        dropped = [w.metric("dpstream_events_dropped_total", query=name, reason="contribution_bound") for w in (a, b)]
        assert (sum(dropped) > 200) == unit
        assert sum(w.metric("dpstream_events_dropped_total", query=name) for w in (a, b)) == sum(dropped)
    finally:
        a.stop()
        b.stop()
