"""The worker's health states and how a failed send is handled (processor/adapters/health.py,
processor/adapters/delivery.py; docs/operations.md, "Health"). The broker trials themselves are
in tests/test_kafka_chaos.py."""
import pytest
from confluent_kafka import KafkaError

from dpstream.processor.adapters.delivery import failure_kind
from dpstream.processor.adapters.health import BROKER_WAIT_S, READY, STARTING, WAITING, WorkerHealth
from dpstream.topics.kafka import OFFSETS_STEP, DeliveryError


def failed(code: int, text: str = "", step: str = "committing a transaction") -> DeliveryError:
    err = KafkaError(code, text or None)
    return DeliveryError(f"{step}: {err}", err)


@pytest.mark.parametrize("error, kind", [
    (failed(KafkaError.UNKNOWN_MEMBER_ID, step=OFFSETS_STEP), "membership"),
    (failed(KafkaError.ILLEGAL_GENERATION, step=OFFSETS_STEP), "generation"),
    (failed(KafkaError.REBALANCE_IN_PROGRESS, step=OFFSETS_STEP), "generation"),
    # librdkafka raises a failed offset commit as an abortable state error quoting the broker's
    (failed(KafkaError._STATE, "Failed to commit offsets to transaction: dpstream-q-by-key[0](Broker: Specified group "
                                "generation id is not valid) (ILLEGAL_GENERATION)"), "generation"),
    (failed(KafkaError._FENCED), "fenced"),
    (failed(KafkaError.INVALID_PRODUCER_EPOCH), "fenced"),
    (failed(KafkaError.TOPIC_AUTHORIZATION_FAILED), "permanent"),
    (failed(KafkaError.MSG_SIZE_TOO_LARGE), "permanent"),
    (failed(KafkaError._TIMED_OUT, "Failed to flush all outstanding messages within the API timeout"), "transient"),
    (failed(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER), "transient"),  # fatal: the producer is created anew, then retried
    (failed(KafkaError.NOT_COORDINATOR), "transient"),
    (DeliveryError("3 messages not acknowledged after 60 s; errors: []"), "transient"),
    # a text naming SASL_SSL is not an SSL failure of the send
    (failed(KafkaError._TRANSPORT, "SASL_SSL broker 127.0.0.1:9093 disconnected"), "transient"),
])
def test_failed_sends_are_classified_by_what_mends_them(error, kind):
    assert failure_kind(error) == kind


def test_fatal_errors_mark_the_producer_for_renewal():
    assert DeliveryError("x", KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True)).fatal
    assert not failed(KafkaError._TIMED_OUT).fatal


def test_waiting_for_the_broker_after_ten_seconds_and_stopping_at_the_timeout():
    health = WorkerHealth()
    assert health.state == STARTING and health.judge_silence(100.0, 60.0) is None  # not before ready
    health.set(READY)
    assert health.judge_silence(BROKER_WAIT_S - 0.5, 60.0) is None and health.state == READY
    assert health.judge_silence(BROKER_WAIT_S + 0.5, 60.0) == "waiting" and health.state == WAITING
    assert health.judge_silence(30.0, 60.0) is None and health.state == WAITING  # said once
    assert health.judge_silence(1.0, 60.0) == "answers" and health.state == READY
    assert health.judge_silence(60.5, 60.0) == "timeout"


def test_a_roles_send_thread_runs_calls_in_turn_and_one_stuck_call_holds_no_other_role():
    """Each role's sends run on a daemon thread of their own (delivery.SendThread): a call stuck in
    librdkafka (send_offsets_to_transaction after a broker restart, librdkafka issue 5456) delays
    neither the event loop's shared executor nor the role's next thread, nor the process's exit."""
    import asyncio
    import threading

    from dpstream.processor.adapters.delivery import SendThread

    stuck = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        first = SendThread("dpstream-send-test")
        assert await loop.run_in_executor(first, lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(first, lambda: 1 / 0)
        order = []
        await asyncio.gather(*(loop.run_in_executor(first, order.append, i) for i in range(20)))
        assert order == list(range(20))  # in turn, as submitted
        loop.run_in_executor(first, stuck.wait)  # never returns in this test
        first.shutdown()
        second = SendThread("dpstream-send-test")  # what the role gets after abandoning the stuck send
        assert await asyncio.wait_for(loop.run_in_executor(second, lambda: "sent"), 5) == "sent"
        assert all(t.daemon for t in threading.enumerate() if t.name == "dpstream-send-test")

    asyncio.run(main())
    stuck.set()


def test_an_abandoned_transaction_can_no_longer_commit(broker):
    """What the worker does with a send stuck sending its offsets (delivery.RolePublishers): it
    abandons it, and a send on that producer is refused from then on (its owner creates another
    with the same transactional id, which fences it); an abandoned publisher is never waited for."""
    import uuid

    from dpstream.topics.kafka import KafkaPublisher

    publisher = KafkaPublisher(broker, transactional_id=f"test-abandon-{uuid.uuid4().hex[:8]}", timeout=20)
    topic = f"abandon-{uuid.uuid4().hex[:8]}"
    publisher.send([(topic, b"before", None, None)], 20)  # a working transactional producer
    # a send that began its commit is never abandoned (the commit is bounded): here the last one did
    assert not publisher.abandon() and not publisher.broken
    publisher = KafkaPublisher(broker, transactional_id=publisher.transactional_id, timeout=20)  # fences the first
    assert publisher.abandon() and publisher.broken and publisher.abandoned
    with pytest.raises(DeliveryError, match="must be created anew"):
        publisher.send([(topic, b"after", None, None)], 20)
    publisher.wait_idle()  # returns at once
    assert not publisher.offsets_overdue(0.0)  # no offsets step under way
