"""The consumer group's view of an assignment under way (processor/adapters/consumer_group.py),
against the test broker. An elastic worker gains partitions inside librdkafka's on_assign
callback (it restores their stores there), and librdkafka counts them assigned only after that
callback returns. A batch of a just-gained partition can fail meanwhile; elastic_run.py then
gives it up and takes it up again if the group still assigns it to this worker (``_regain``,
which asks ``assigned`` or ``assigning``). Before ``assigning`` existed, the regain saw such a
partition as not assigned and left it: nothing read it again and its window's triggers never
fired (a chaos trial, tests/test_kafka_chaos.py, at six test processes on 2 cores)."""
import asyncio
import uuid

from dpstream.processor.adapters.consumer_group import GroupConsumer


def test_partitions_being_gained_count_as_assigning_then_assigned(broker):
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"membership-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(timeout=30)
    seen_in_gain: list[tuple[frozenset, frozenset]] = []

    async def scenario() -> tuple[frozenset, frozenset]:
        loop = asyncio.get_running_loop()
        group: GroupConsumer

        async def on_gain(keys):
            await asyncio.sleep(0.5)  # a restore: the callback thread waits on it
            seen_in_gain.append((group.assigning, group.assigned))
            return {k: 0 for k in keys}

        async def on_lose(keys):
            return None

        group = GroupConsumer(broker, f"{topic}-group", [topic], loop, on_gain, on_lose, session_timeout=6.0)
        try:
            for _ in range(60):
                await group.poll(0.5)
                if group.assigned:
                    break
            return group.assigning, group.assigned
        finally:
            await loop.run_in_executor(None, group.close)

    try:
        assigning_after, assigned_after = asyncio.run(scenario())
    finally:
        admin.delete_topics([topic])
    everything = frozenset((topic, p) for p in range(3))
    assert seen_in_gain, "the group never assigned the topic's partitions"
    assigning, assigned = seen_in_gain[0]
    # while the gain runs: being assigned, not yet assigned (what _regain must see as the group's)
    assert assigning == everything and not assigned & everything
    # once the callback returned: assigned, and nothing under way
    assert assigned_after == everything and assigning_after == frozenset()
