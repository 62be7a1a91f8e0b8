"""Declarations of every Kafka topic the service uses (DESIGN.md sections 3 and 9).

Per query: the input events topic (partitioned by user by the producer or repartitioned by stage
1), the stage-1 -> stage-2 repartition topic keyed by the group-by key, the output releases topic
(compacted, keyed by (query, window, key) so the latest release per key is kept), and one
dead-letter topic. The dynamic-updates topic is declared for the fully dynamic agent.

Creation goes through confluent-kafka's AdminClient; existing topics are left as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

DEAD_LETTER_TOPIC = "dpstream-dead-letters"
DYNAMIC_UPDATES_TOPIC = "dpstream-dynamic-updates"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict = field(default_factory=dict)
    role: str = ""


def repartition_topic(query_name: str) -> str:
    return f"dpstream-{query_name}-by-key"


def topics_for(queries: Iterable, partitions: int = 8) -> list[TopicSpec]:
    """Every topic the queries need, deduplicated by name (queries may share input/output)."""
    specs: dict[str, TopicSpec] = {}

    def add(spec: TopicSpec) -> None:
        specs.setdefault(spec.name, spec)

    for q in queries:
        add(TopicSpec(q.input_topic, partitions, {}, "input events"))
        add(TopicSpec(repartition_topic(q.name), partitions, {"cleanup.policy": "delete"}, "stage 1 -> stage 2, keyed by group-by key"))
        add(TopicSpec(q.output_topic, partitions, {"cleanup.policy": "compact"}, "releases, keyed by (query, window, key)"))
    add(TopicSpec(DEAD_LETTER_TOPIC, 1, {"cleanup.policy": "delete"}, "invalid records with reason and original bytes"))
    add(TopicSpec(DYNAMIC_UPDATES_TOPIC, partitions, {}, "insert/delete updates for the dynamic agent"))
    return list(specs.values())


def create_topics(bootstrap: str, specs: list[TopicSpec], replication: int = 1, timeout: float = 15.0, client_config: dict | None = None) -> list[str]:
    """Create the topics that do not exist yet; returns the names created."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, **(client_config or {})})
    existing = set(admin.list_topics(timeout=timeout).topics)
    missing = [s for s in specs if s.name not in existing]
    if not missing:
        return []
    futures = admin.create_topics([NewTopic(s.name, num_partitions=s.partitions, replication_factor=replication, config=s.config) for s in missing],
                                  request_timeout=timeout)
    created = []
    for name, future in futures.items():
        try:
            future.result(timeout)
            created.append(name)
        except Exception as exc:  # a concurrent creator is fine
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    return created
