"""Exactly-once delivery (docs/operations.md, "Delivery"): each batch's messages go out in one Kafka
transaction with a progress record of what they complete, and the state is committed after. The
attacks: a crash after the transaction committed but before the state did, at every batch split;
a trigger published but not marked so; an aborted transaction; a worker's zombie incarnation."""

import json

import pytest

from dpstream.processor.adapters.worker import DpstreamWorker
from dpstream.topics.kafka import PROGRESS_TOPIC
from tests.test_worker_service import (
    START,
    WINDOW_MS,
    all_releases,
    events,
    make_worker,
    reference_releases,
    stage_two,
)


def progress_of(worker: DpstreamWorker, messages) -> dict:
    """The progress records among ``messages`` as :func:`dpstream.topics.kafka.read_progress` returns them."""
    prefix = f"{worker.app_id}/"
    return {m.key.decode()[len(prefix):]: json.loads(m.value) for m in messages if m.topic == PROGRESS_TOPIC}


@pytest.mark.parametrize("crash_after,resume_split", [(2500, 1000), (2500, 2500), (2500, 4000), (1, 3999)])
def test_a_crash_after_the_transaction_sends_nothing_twice_and_counts_everything_once(tmp_path, crash_after, resume_split):
    records = events(4000)
    expected = reference_releases(tmp_path / "ref", records)

    w = make_worker(tmp_path / "w")
    first = w.process_input("in", 0, records[:crash_after])
    delivered = first.messages + [w.progress_message(first)]  # the transaction committed ...
    w.close()  # ... and the worker died before committing its state
    w = make_worker(tmp_path / "w")
    w.resume(progress_of(w, delivered))
    # the broker redelivers from the state's offset, in batches that fall anywhere
    after = []
    for part in (records[:resume_split], records[resume_split:]):
        if part and (r := w.process_input("in", 0, part)) is not None:
            after += r.messages
            r.commit()
    assert w.stage1[("in", 0)].last_offset == len(records) - 1
    # no bounded record, no dead letter is sent twice: stage 2 gets each (user, slot) once
    stage_two(w, first.messages + after, first_offset=0)
    assert all_releases(w) == expected
    assert sum(p.stats.dropped["duplicate"] for p in w.pipelines()) == 0  # counted as triggers fire
    w.close()


def test_without_the_progress_record_the_same_crash_sends_twice(tmp_path):
    """The control (at least once, or resume ignored): the same crash sends the first records'
    bounded output again; stage 2 then drops the repeated (user, slot) pairs."""
    records = events(4000)
    w = make_worker(tmp_path / "w")
    first = w.process_input("in", 0, records[:2500])
    w.close()
    w = make_worker(tmp_path / "w")
    w.resume({})
    again = w.process_input("in", 0, records)
    again.commit()
    stage_two(w, first.messages + again.messages, first_offset=0)
    all_releases(w)
    assert sum(p.stats.dropped["duplicate"] for p in w.pipelines()) > 0
    w.close()


def test_a_published_trigger_is_marked_not_sent_again(tmp_path):
    records = events(4000)
    w = make_worker(tmp_path / "w")
    out = w.process_input("in", 0, records)
    out.commit()
    stage_two(w, out.messages)
    from tests.test_worker_service import fire

    fired = fire(w, START + 10 * WINDOW_MS)
    assert len(fired) >= 2
    # the first triggers' releases went out with their progress records; the worker died before
    # marking them published (and before sending the rest)
    done = fired[: len(fired) // 2]
    delivered = [m for f in done for m in [*w.release_messages(f), w.published_message(f)]]
    w.close()
    w = make_worker(tmp_path / "w")
    assert {(f.window, f.trigger) for f in w.unpublished()} == {(f.window, f.trigger) for f in fired}
    w.resume(progress_of(w, delivered))
    left = w.unpublished()
    assert {(f.window, f.trigger, f.source.name) for f in left} == {(f.window, f.trigger, f.source.name) for f in fired} - {
        (f.window, f.trigger, f.source.name) for f in done}
    # what is still to send is the journal's, byte for byte
    assert sorted(m.value for f in left for m in w.release_messages(f)) == sorted(
        m.value for f in fired[len(done):] for m in w.release_messages(f))
    w.close()


# ---------------------------------------------------------------- against the broker


def test_an_aborted_or_fenced_transaction_is_never_read(broker):
    import uuid

    from dpstream.topics.kafka import (
        DeliveryError,
        KafkaPublisher,
        TopicSpec,
        create_topics,
        read_compacted,
    )

    topic = f"it-progress-{uuid.uuid4().hex[:8]}"
    create_topics(broker, [TopicSpec(topic, 1, {"cleanup.policy": "compact"})])
    tid = f"it-{uuid.uuid4().hex[:8]}"
    old = KafkaPublisher(broker, transactional_id=tid)
    old.send([(topic, b'{"offset": 1}', b"app/in-0", None)])
    # a transaction that fails midway (a message the broker refuses: over the topic's 1 MB limit) aborts whole
    with pytest.raises(DeliveryError):
        old.send([(topic, b'{"offset": 2}', b"app/in-0", None), (topic, b"x" * (2 * 1024 * 1024), b"app/big", None)], timeout=20)
    assert read_compacted(broker, topic, "app/") == {"app/in-0": {"offset": 1}}
    # a new incarnation fences the old one: the zombie can no longer commit anything
    new = KafkaPublisher(broker, transactional_id=tid)
    with pytest.raises(DeliveryError):
        old.send([(topic, b'{"offset": 3}', b"app/in-0", None)], timeout=20)
    new.send([(topic, b'{"offset": 4}', b"app/in-0", None)])
    assert read_compacted(broker, topic, "app/") == {"app/in-0": {"offset": 4}}


def test_a_read_waits_for_a_transaction_open_below_the_end_and_counts_it_once_committed(broker):
    """A worker reads the progress topic up to the end it had when the read began: a transaction
    still open there (another worker's, about to commit) is waited for, then read."""
    import threading
    import uuid

    from dpstream.topics.kafka import (
        KafkaPublisher,
        TopicSpec,
        create_topics,
        read_compacted,
    )

    topic = f"it-progress-{uuid.uuid4().hex[:8]}"
    create_topics(broker, [TopicSpec(topic, 1, {"cleanup.policy": "compact"})])
    p = KafkaPublisher(broker, transactional_id=f"it-{uuid.uuid4().hex[:8]}")
    p.send([(topic, b'{"offset": 3}', b"app/in-1", None)])  # the last record is a commit marker
    assert read_compacted(broker, topic, "app/") == {"app/in-1": {"offset": 3}}
    p.producer.begin_transaction()
    p.produce(topic, b'{"offset": 7}', b"app/in-0")
    p.producer.flush(10)  # on the broker, not committed
    threading.Timer(2.0, lambda: p.producer.commit_transaction(10)).start()
    assert read_compacted(broker, topic, "app/") == {"app/in-0": {"offset": 7}, "app/in-1": {"offset": 3}}


def test_dynamic_releases_published_before_a_crash_are_not_sent_again(tmp_path):
    """The dynamic agent's part: releases of segments up to the one its progress record names
    went out in a committed transaction; after the crash only the later ones are pending."""
    from dpstream.state.store import RocksDBStore, WriteBatch
    from tests.test_dynamic_stream import make, run, stream

    records = stream(20_000)
    store = RocksDBStore(tmp_path / "s")
    first = make(store)
    run(first, records[:10_000], store)
    batch = WriteBatch()
    for rec in records[10_000:14_000]:
        first.apply(rec, batch)
    first.advance_clock(records[13_999]["ts"], batch)
    store.write(batch)
    pending = first.take_pending()
    assert len(first.pending) >= 2
    through = first.pending[len(first.pending) // 2].segment  # the transaction that carried these committed
    store.close()  # ... and the worker died before marking them published

    store = RocksDBStore(tmp_path / "s")
    again = make(store)
    mark = WriteBatch()
    again.mark_published(mark, through)
    store.write(mark)
    left = again.take_pending()
    assert left and all(r.segment > through for r in again.pending)
    assert [json.dumps(r, sort_keys=True) for r in left] == [json.dumps(r, sort_keys=True) for r in pending[-len(left):]]
    assert len(left) < len(pending)
    store.close()
