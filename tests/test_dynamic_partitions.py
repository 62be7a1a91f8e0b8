"""A dynamic query on an update topic of several partitions (issue 33, item 2; docs/user-guide.md,
"Partitions"; docs/privacy.md, "Partitions").

Each input partition's records are judged where they are read (:class:`UpdateRouter`: valid, on
time by their own Kafka timestamp, not future) and each update goes to the shard of its item,
which runs on one partition of the query's by-item topic (:class:`DynamicQueryState` with a
``shard``). A shard decides a tick once every input partition's watermark has passed it, and
takes a tick's updates in (input partition, offset) order, whatever order they reached it in.

What a user relies on, checked here without a broker (the broker tests run the same code in
workers): the releases do not depend on how the records are spread over partitions (by any
key: Debezium keys by the row's primary key), on the interleaving in which the shards receive
them, on copies sent again, or on a shard's restart; they are the releases of the query read
from one partition in that order, and with the baseline mechanism (whose tick is a set of
counts) in any order. One record more changes the shards' inputs by exactly its updates.
"""
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.processor.config import DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import (
    DynamicQueryState,
    RoutedUpdates,
    UpdateRouter,
    routed_seq,
)
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from tests.conftest import TEST_SECRET

ITEMS = [f"plan-{i}" for i in range(7)]
NOISE = NodeNoise(TEST_SECRET, "partitions")
PSEUDONYMS = Pseudonymizer(TEST_SECRET)
TICK_MS, LATENESS_MS, DELAY_MS = 5, 20, 10


def query(mechanism: str = "baseline", shards: int = 3, envelope: str = "none", epsilon: float = 2.0) -> DynamicQueryConfig:
    return DynamicQueryConfig(name="plans", items=ITEMS, epsilon=epsilon, start=0, tick=f"{TICK_MS}ms",
                              allowed_lateness=f"{LATENESS_MS}ms", mechanism=mechanism, shards=shards, envelope=envelope)


def records(n: int, seed: int, envelope: str = "none") -> list[tuple[dict, int]]:
    """(record, Kafka timestamp) in the order the broker stamped them: event times up to half the
    allowed lateness before their stamp (none late), deletes of absent items included; with
    ``envelope="debezium"``, change events of rows that move between plans."""
    rng = np.random.default_rng(seed)
    out, stamp, rows = [], 1, {}
    for i in range(n):
        stamp += int(rng.integers(0, 3))
        ts = max(0, stamp - int(rng.integers(0, LATENESS_MS // 2)))
        if envelope == "debezium":
            row = int(rng.integers(0, 12))
            new = ITEMS[int(rng.integers(len(ITEMS)))]
            if row in rows and rng.random() < 0.3:
                rec = {"op": "d", "before": {"plan": rows.pop(row)}, "after": None, "ts_ms": ts}
            elif row in rows:
                rec = {"op": "u", "before": {"plan": rows[row]}, "after": {"plan": new}, "ts_ms": ts}
                rows[row] = new
            else:
                rec = {"op": "c", "before": None, "after": {"plan": new}, "ts_ms": ts}
                rows[row] = new
        else:
            rec = {"item": ITEMS[int(rng.integers(len(ITEMS)))], "op": "delete" if rng.random() < 0.4 else "insert", "ts": ts}
        out.append((rec, stamp))
    return out


def debezium_query(mechanism: str = "baseline", shards: int = 3) -> DynamicQueryConfig:
    return query(mechanism, shards, "debezium").model_copy(update={"item_field": "plan", "time_field": "ts_ms"})


def one_partition(q: DynamicQueryConfig, recs: list[tuple[dict, int]], until_ms: int, noise: NodeNoise = NOISE) -> list[dict]:
    """The query read from one partition, in the order given: every shard in one state."""
    store = MemoryStore()
    state = DynamicQueryState(q, noise, PSEUDONYMS, store)
    batch = WriteBatch()
    assert state.apply_records([r for r, _ in recs], batch, [s for _, s in recs]) == [None] * len(recs)
    state.advance_clock(until_ms, batch)
    store.write(batch)
    return state.take_pending()


class Shard:
    """One partition of the by-item topic and the state reading it (restarted from its store on
    demand: the log and snapshot, as a worker restarts)."""

    def __init__(self, q: DynamicQueryConfig, k: int, partitions: int):
        self.q, self.k, self.partitions = q, k, partitions
        self.store = MemoryStore()
        self.state = DynamicQueryState(q, NOISE, PSEUDONYMS, self.store, shard=k)
        self.queue: list = []  # what the topic holds, not yet read: RoutedUpdates or (partition, watermark)
        self.marks: dict[int, int] = {}
        self.released: list[dict] = []

    def read(self, n: int) -> None:
        batch = WriteBatch()
        for msg in self.queue[:n]:
            if isinstance(msg, RoutedUpdates):
                self.state.take_routed(msg, batch)
            else:
                p, mark = msg
                self.marks[p] = max(mark, self.marks.get(p, mark))
        self.queue = self.queue[n:]
        self.store.write(batch)

    def decide(self) -> None:
        """The timer: every input partition's watermark known, the ticks before their minimum."""
        if len(self.marks) < self.partitions:
            return
        batch = WriteBatch()
        self.state.advance_clock(min(self.marks.values()), batch)
        self.store.write(batch)
        self.released += self.state.take_pending()
        batch = WriteBatch()
        self.state.mark_published(batch)
        self.store.write(batch)

    def restart(self) -> None:
        self.state = DynamicQueryState(self.q, NOISE, PSEUDONYMS, self.store, shard=self.k)
        self.released += self.state.take_pending()

    def step(self, rng: np.random.Generator, restarts: float) -> None:
        """One random move of a harness: read a few messages (then, perhaps, restart), and
        perhaps decide."""
        if self.queue:
            self.read(int(rng.integers(1, 4)))
            if rng.random() < restarts:
                self.restart()
        if rng.random() < 0.3:
            self.decide()

    def finish(self, partitions: int, until_ms: int) -> None:
        """Every input partition read to its end: its watermark is the public end."""
        self.queue += [(p, until_ms) for p in range(partitions)]
        self.read(len(self.queue))
        self.decide()


def partitioned(q: DynamicQueryConfig, recs: list[tuple[dict, int]], home: list[int], partitions: int, until_ms: int,
                rng: np.random.Generator, resend: float = 0.0, restarts: float = 0.0) -> tuple[list[dict], Counter]:
    """The query on ``partitions`` input partitions (record i on ``home[i]``, in order there),
    each read in random chunks at random times; each routed batch, then the partition's
    watermark (its newest stamp read, less the delay), reaches its shard's topic when sent, and
    each shard reads its topic in random chunks, deciding at random times. ``resend``: the chance
    that a batch is sent twice (at least once: the router's write was lost after its send);
    ``restarts``: the chance that a shard restarts from its store after a read. Returns the
    releases, and the multiset of (shard, tick, item, op) the shards were sent (each once)."""
    shards = [Shard(q, k, partitions) for k in range(q.shards)]
    routers = [UpdateRouter(q, p, DELAY_MS) for p in range(partitions)]
    todo = {p: [(r, s, off) for off, (r, s) in enumerate(rs for rs, h in zip(recs, home) if h == p)] for p in range(partitions)}
    sent: Counter = Counter()

    def send(p: int, n: int) -> None:
        chunk, todo[p] = todo[p][:n], todo[p][n:]
        routed, reasons = routers[p].route([r for r, _, _ in chunk], [s for _, s, _ in chunk], [o for _, _, o in chunk])
        assert reasons == [None] * len(chunk)
        for k, updates in routed.items():
            copies = 2 if rng.random() < resend else 1
            shards[k].queue += [RoutedUpdates.decode(updates.encode()) for _ in range(copies)]  # through the wire form
            sent.update(zip([k] * len(updates), updates.ticks.tolist(), updates.items.tolist(), updates.ops.tolist()))
        mark = chunk[-1][1] - DELAY_MS
        for sh in shards:
            sh.queue.append((p, mark))

    while any(todo.values()):
        p = int(rng.integers(partitions))
        if todo[p]:
            send(p, int(rng.integers(1, 6)))
        shards[int(rng.integers(len(shards)))].step(rng, restarts)
    for sh in shards:
        sh.finish(partitions, until_ms)
    return [r for sh in shards for r in sh.released], sent


def canonical(recs: list, home: list[int]) -> list:
    """The records in the order the shards take a tick's updates: by (input partition, offset)."""
    offsets, order = Counter(), []
    for i, h in enumerate(home):
        order.append((h, offsets[h], i))
        offsets[h] += 1
    return [recs[i] for _, _, i in sorted(order)]


def view(releases: list[dict]) -> list[dict]:
    return sorted(releases, key=lambda r: (r.get("shard", 0), r["segment"]))


@pytest.mark.parametrize("mechanism", ["baseline", "interval_tree"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), partitions=st.integers(1, 5), shards=st.integers(1, 4), n=st.integers(1, 250),
       envelope=st.sampled_from(["none", "debezium"]))
def test_releases_under_any_partitioning_and_interleaving_are_one_partitions(mechanism, seed, partitions, shards, n, envelope):
    """Records spread over 1 to 5 input partitions at random (as a producer keying by anything
    would), read and delivered in random interleavings, some routed batches sent twice, shards
    restarting: the releases are exactly those of the query read from one partition in
    (partition, offset) order. With the baseline mechanism, the same as in the records' own
    order; and the same for another spread of the records over more partitions."""
    rng = np.random.default_rng(seed)
    q = debezium_query(mechanism, shards) if envelope == "debezium" else query(mechanism, shards)
    recs = records(n, seed, envelope)
    until = recs[-1][1] + 200
    home = rng.integers(0, partitions, n).tolist()
    got, _ = partitioned(q, recs, home, partitions, until, rng, resend=0.2, restarts=0.1)
    assert got, "the public end decides ticks: at least the last segment is released"
    assert view(got) == view(one_partition(q, canonical(recs, home), until))
    if mechanism == "baseline":  # a tick's updates are counts: their order never matters
        assert view(got) == view(one_partition(q, recs, until))
        other = rng.integers(0, partitions + 1, n).tolist()
        again, _ = partitioned(q, recs, other, partitions + 1, until, rng)
        assert view(again) == view(got)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), partitions=st.integers(1, 4), n=st.integers(1, 120), envelope=st.sampled_from(["none", "debezium"]))
def test_one_record_more_changes_the_shards_inputs_by_exactly_its_updates(seed, partitions, n, envelope):
    """Issue 33, item 6, kept under partitions: a neighbouring stream (one record more, anywhere,
    on any partition) sends the shards exactly that record's updates more - one for an update
    record, up to two (a delete and an insert, perhaps in two shards) for a change event - and
    the same updates otherwise, whatever the other records are."""
    rng = np.random.default_rng(seed)
    q = debezium_query("baseline", 3) if envelope == "debezium" else query("baseline", 3)
    recs = records(n + 1, seed, envelope)
    at = int(rng.integers(0, n + 1))
    home = rng.integers(0, partitions, n + 1).tolist()
    without = [rs for i, rs in enumerate(recs) if i != at]
    home_without = [h for i, h in enumerate(home) if i != at]
    until = recs[-1][1] + 200
    _, sent = partitioned(q, recs, home, partitions, until, np.random.default_rng(seed + 1))
    _, sent_without = partitioned(q, without, home_without, partitions, until, np.random.default_rng(seed + 2))
    extra = sent - sent_without
    assert not sent_without - sent, "no update of the other records is lost or changed"
    routed, _ = UpdateRouter(q, 0, DELAY_MS).route([recs[at][0]], [recs[at][1]], [0])
    mine = Counter((k, t, i, o) for k, u in routed.items() for t, i, o in zip(u.ticks.tolist(), u.items.tolist(), u.ops.tolist()))
    assert extra == mine
    assert sum(extra.values()) <= (2 if envelope == "debezium" else 1)


def test_a_router_judges_each_record_by_its_own_stamp():
    """Late: the watermark its own Kafka timestamp makes (less the watermark delay) has passed
    its tick's decision time (the tick's end plus the allowed lateness); future: its time is more
    than max_skew after its stamp; invalid: named. Each refusal is the record's own, the others
    are routed, and each update goes to its item's shard (item index % shards) with a sequence
    number of where it was read."""
    q = query("baseline", 3).model_copy(update={"max_skew": "100ms"})
    router = UpdateRouter(q, 2, DELAY_MS)
    tick_end = 5  # tick 1 is [0, 5): decided once a watermark reaches 5 + 20
    recs = [{"item": "plan-4", "op": "insert", "ts": 0},  # stamp 34: watermark 24, on time
            {"item": "plan-4", "op": "insert", "ts": 0},  # stamp 35: watermark 25 = decision time: late
            {"item": "plan-9", "op": "insert", "ts": 50},  # not a declared item
            {"item": "plan-1", "op": "delete", "ts": 200},  # 200 > stamp 35 + 100: future
            {"item": "plan-1", "op": "delete", "ts": 135}]  # 135 = 35 + 100: not future
    stamps = [tick_end + LATENESS_MS + DELAY_MS - 1, tick_end + LATENESS_MS + DELAY_MS, 35, 35, 35]
    routed, reasons = router.route(recs, stamps, [10, 11, 12, 13, 14])
    assert reasons[0] is None and reasons[4] is None
    assert reasons[1].startswith("late:") and reasons[3].startswith("future:") and "'item'" in reasons[2]
    assert router.dropped == Counter(late=1, future=1, malformed=1)
    assert sorted(routed) == [1]  # plan-4 and plan-1: items 4 and 1, both in shard 1 of 3
    assert routed[1].items.tolist() == [4, 1] and routed[1].ops.tolist() == [1, 2] and routed[1].ticks.tolist() == [1, 28]
    assert routed[1].seqs.tolist() == [routed_seq(2, 10, 0), routed_seq(2, 14, 0)]
    assert routed_seq(2, 10, 0) < routed_seq(2, 10, 1) < routed_seq(2, 11, 0) < routed_seq(3, 0, 0)


def test_a_router_with_a_unit_bound_needs_the_pseudonymizer():
    """With a unit_field, a router sends each update with its unit's pseudonym to the unit's unit
    step (docs/privacy.md, "A unit across partitions"): it cannot be built without the keyed
    pseudonymizer, and never sends the unit id itself."""
    q = query().model_copy(update={"unit_field": "user", "contribution_bound": 2})
    with pytest.raises(ValueError, match="unit_field"):
        UpdateRouter(q, 0, DELAY_MS)
    router = UpdateRouter(q, 0, DELAY_MS, pseudonyms=PSEUDONYMS)
    routed, _ = router.route([{"item": ITEMS[0], "op": "insert", "ts": 1, "user": "alice-7"}], [2], [0])
    (j, updates), = routed.items()
    assert updates.units.tolist() == PSEUDONYMS.users(["alice-7"]).tolist() and j == updates.units[0] % q.shards
    assert b"alice-7" not in updates.encode()


def test_a_shard_takes_a_late_arrival_as_late_and_a_copy_once():
    """A routed update whose tick the shard decided already is dropped and counted late (its
    router's and the shard's clocks disagreed by more than the watermark delay); a copy of one
    waiting is taken once."""
    q = query("baseline", 1)
    store = MemoryStore()
    state = DynamicQueryState(q, NOISE, PSEUDONYMS, store, shard=0)
    early = RoutedUpdates(*(np.array([v], dtype=np.int64) for v in (3, 2, 1, routed_seq(0, 5, 0))))
    batch = WriteBatch()
    assert state.take_routed(early, batch) == 0
    assert state.take_routed(RoutedUpdates.decode(early.encode()), batch) == 0
    assert len(state.waiting) == 1
    state.advance_clock(10 * TICK_MS + LATENESS_MS, batch)
    store.write(batch)
    assert state.counter.exact.tolist() == [0, 0, 1, 0, 0, 0, 0]
    assert state.take_routed(early, WriteBatch()) == 1 and state.dropped["late"] == 1
    assert state.counter.exact.tolist() == [0, 0, 1, 0, 0, 0, 0]


class Log:
    """Topics as the worker core sees them (no broker): each partition a list of records, stamped
    by the "broker" (LogAppendTime) when appended."""

    def __init__(self):
        self.partitions: dict[tuple[str, int], list] = {}

    def append(self, topic: str, partition: int, key, value, stamp: int) -> None:
        from tests.conftest import Record

        records = self.partitions.setdefault((topic, partition), [])
        records.append(Record(len(records), key, value, stamp, 1))


def tick_order(recs: list, home: list[int]) -> list:
    """The records in the order a unit step bounds them: by (tick, input partition, offset)."""
    offsets, order = Counter(), []
    for i, h in enumerate(home):
        order.append(((recs[i][0]["ts"] - 0) // TICK_MS + 1, h, offsets[h], i))
        offsets[h] += 1
    return [recs[i] for *_, i in sorted(order)]


@pytest.mark.parametrize("unit", [False, True], ids=["no-unit", "unit-bound"])
def test_static_workers_on_a_partitioned_update_topic_release_what_one_partition_does(tmp_path, unit):
    """The worker core (processor/adapters/worker.py) on an update topic of 4 partitions, keyed by
    a row id as Debezium keys them: two static workers share its partitions (routers) and the
    by-item topic's 3 (shards), each reading in chunks, sending the routed updates and watermarks
    it returns to the topics and deciding ticks on its clock; one is restarted from its state
    directory midway. Their releases are the query's read from one partition in (partition,
    offset) order, each published once. With a unit bound (40 users, 6 updates each at most: the
    bound drops most of them), the unit steps on the by-unit topic's 3 partitions sit between:
    the releases are one partition's in (tick, partition, offset) order, the order the bound
    takes a unit's records in."""
    import json

    from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
    from dpstream.processor.config import DpstreamConfig
    from dpstream.topics.kafka import item_topic, unit_topic
    from dpstream.topics.partitioner import partition_for
    from tests.conftest import TEST_RUN_NONCE

    topic, partitions = "db.public.subscriptions", 4
    spec = {"name": "plans", "input_topic": topic, "output_topic": "plan-counts", "start": 0, "items": ITEMS, "epsilon": 2.0,
            "tick": f"{TICK_MS}ms", "allowed_lateness": f"{LATENESS_MS}ms", "shards": 3, "mechanism": "interval_tree"}
    if unit:
        spec.update(unit_field="user", contribution_bound=6, epsilon=12.0)
    cfg = DpstreamConfig(dynamic=[spec])

    def open_worker(i: int) -> DpstreamWorker:
        return DpstreamWorker(cfg, TEST_SECRET, tmp_path / f"w{i}", Ownership(i, 2), {}, 2, run_nonce=TEST_RUN_NONCE,
                              watermark_delay_ms=DELAY_MS, dynamic_partitions={topic: partitions})

    workers = [open_worker(0), open_worker(1)]
    assert sorted(k for w in workers for k in w.dynamic) == [(topic, p) for p in range(partitions)]
    by_item = item_topic("plans")
    assert sorted(k for w in workers for k in w.dynamic_shards) == [(by_item, k) for k in range(3)]
    if unit:
        assert sorted(k for w in workers for k in w.dynamic_units) == [(unit_topic("plans"), j) for j in range(3)]
    recs = records(600, 5)
    log, rng = Log(), np.random.default_rng(3)
    if unit:
        recs = [({**rec, "user": f"user-{int(rng.integers(40))}"}, stamp) for rec, stamp in recs]
    rows = rng.integers(0, 50, len(recs))
    home = partition_for([f"row-{r}".encode() for r in rows.tolist()], partitions, "murmur2").tolist()
    for (rec, stamp), p in zip(recs, home):
        log.append(topic, p, None, json.dumps(rec).encode(), stamp)
    until = recs[-1][1] + 200
    released, now = [], 0

    def step(w: DpstreamWorker, now: int, ends=None) -> None:
        for key, source in [*w.dynamic.items(), *w.dynamic_units.items(), *w.dynamic_shards.items()]:
            todo = [r for r in log.partitions.get(key, []) if r.offset > source.last_offset][:int(rng.integers(1, 40))]
            if not todo:
                continue
            result = w.process_dynamic(*key, todo)
            for m in result.messages:
                log.append(m.topic, m.partition, m.key, m.value, now)
            result.commit()
        for m in w.watermark_messages(now, ends):
            log.append(m.topic, m.partition, m.key, m.value, now)
        for key in w.advance_dynamic(now):
            released.extend(json.loads(m.value) for m in w.dynamic_releases(key))
            w.mark_dynamic_published(key)

    restarted = False
    for t in range(0, recs[-1][1] + 1, 3):  # the clock: the records stamped so far are readable
        now = t
        for w in workers:
            step(w, now)
        if not restarted and t >= recs[-1][1] // 2:  # worker 1 stops and starts again on its state
            restarted = bool(released)
            workers[1].close()
            workers[1] = open_worker(1)
    assert restarted, "a restart after some releases"
    ends = {(topic, p): until + DELAY_MS for p in range(partitions)}  # every partition read to its end
    for _ in range(60):
        for w in workers:
            step(w, until + DELAY_MS, ends)
    label = workers[0].noise.label
    bounded = sum(b.dropped["contribution_bound"] for w in workers for b in w.unit_bounders.values())
    assert (bounded > 100) == unit  # the bound bit (counted since the restart on worker 1)
    for w in workers:
        w.close()
    q = query("interval_tree", 3, epsilon=spec["epsilon"])
    if unit:
        q = q.model_copy(update={"unit_field": "user", "contribution_bound": 6})
    expected = one_partition(q, tick_order(recs, home) if unit else canonical(recs, home), until, NodeNoise(TEST_SECRET, label))
    assert all(r.pop("run")["noise_label"] == label and r.pop("app_id") for r in released)
    assert len(expected) > (5 if unit else 10) and view(released) == view(expected)


def test_a_query_that_ran_on_one_partition_is_refused_when_its_topic_has_more(tmp_path):
    """A topic's partitions can be added while a query runs on it (kafka-topics --alter). Its
    counters then live in partition 0's state: shards started afresh would release its positions
    again with the same noise on other data. A state that held the query is refused, naming the
    query and the way out (static workers' layout check refuses it earlier; this is the
    elastic worker whose partition 0 comes back from its changelog)."""
    from dpstream.processor.adapters.worker import DpstreamWorker, StateLayoutError
    from dpstream.processor.config import DpstreamConfig
    from tests.conftest import TEST_RUN_NONCE

    spec = {"name": "plans", "input_topic": "updates", "start": 0, "items": ITEMS, "epsilon": 2.0}
    cfg = DpstreamConfig(dynamic=[spec])
    store = MemoryStore()
    DynamicQueryState(cfg.dynamic[0], NOISE, PSEUDONYMS, store)  # it ran here, on one partition
    worker = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", None, {}, 2, run_nonce=TEST_RUN_NONCE,
                            dynamic_partitions={"updates": 3})
    with pytest.raises(StateLayoutError, match="'plans' ran on this update topic when it had one partition; now it has 3"):
        worker.add_source("updates", 0, store)
    worker.add_source("updates", 1, MemoryStore())  # a partition it never ran on: a router
    assert ("updates", 1) in worker.dynamic_routers
    worker.close()


def test_a_backlog_routes_in_messages_the_broker_takes(tmp_path):
    """A batch of a backlog holds many updates per shard: 60,000 update records (1.26 MB of routed
    updates for one shard) go out in parts under the repartition message limit, half of Kafka's
    default record size (one message of them stopped a worker with MSG_SIZE_TOO_LARGE in the
    throughput bench), and the shard takes in every update once."""
    import json

    from dpstream.processor.adapters.worker import REPARTITION_MESSAGE_BYTES, DpstreamWorker, Ownership
    from dpstream.processor.config import DpstreamConfig
    from tests.conftest import TEST_RUN_NONCE, Record

    spec = {"name": "plans", "input_topic": "updates", "start": 0, "items": ITEMS, "epsilon": 2.0, "shards": 1}
    worker = DpstreamWorker(DpstreamConfig(dynamic=[spec]), TEST_SECRET, tmp_path / "w", Ownership(), {}, 2,
                            run_nonce=TEST_RUN_NONCE, dynamic_partitions={"updates": 2})
    n = 60_000
    records = [Record(i, None, json.dumps({"item": ITEMS[i % 7], "op": "insert", "ts": 1_000 + i // 100}).encode(), 2_000, 1)
               for i in range(n)]
    result = worker.process_dynamic("updates", 0, records)
    parts = [m for m in result.messages if m.topic.endswith("-by-item")]
    assert len(parts) > 1 and all(len(m.value) <= REPARTITION_MESSAGE_BYTES for m in parts)
    result.commit()
    shard = [Record(j, m.key, m.value, 2_000, 1) for j, m in enumerate(parts)]
    worker.process_dynamic(parts[0].topic, 0, shard).commit()
    state = worker.dynamic_states[(parts[0].topic, 0)][0]
    assert len(state.waiting) == n
    worker.close()
