"""Prometheus metrics of the pipeline (docs/operations.md, "Metrics"), named by Prometheus conventions.

The pipeline keeps plain counters (:class:`dpstream.processor.engine.pipeline.PipelineStats`); this module turns
them into a registry the worker serves over HTTP, so the pipeline itself never imports
prometheus-client. Every metric is labelled by query; none carries a user id or a key.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRIGGER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events_in = Counter("dpstream_events_in_total", "Valid input events received", ["query"], registry=r)
        self.dropped = Counter("dpstream_events_dropped_total",
                               "Input events dropped, by reason: malformed, wrong_partition, future, key_collision, late (these dead-lettered; "
                               "late at stage 2 only counted), "
                               "contribution_bound, per_key_bound, budget, duplicate "
                               "(a redelivered copy)", ["query", "reason"], registry=r)
        self.accumulated = Counter("dpstream_records_accumulated_total", "Bounded records stage 2 added to pending micro-batches",
                                   ["query"], registry=r)
        self.releases = Counter("dpstream_releases_total", "Released (key, trigger) histogram updates", ["query"], registry=r)
        self.triggers = Counter("dpstream_triggers_fired_total", "Triggers fired", ["query"], registry=r)
        self.keys_loaded = Gauge("dpstream_keys_loaded", "Keys loaded by the last trigger (micro-batch plus predicted)", ["query"], registry=r)
        self.keys_released = Gauge("dpstream_keys_released", "Distinct keys released so far", ["query"], registry=r)
        self.keys_tracked = Gauge("dpstream_keys_tracked", "Key states held for open windows", ["query"], registry=r)
        self.consistency_updates = Counter("dpstream_consistency_updates_total",
                                           "Records of a hierarchy re-issued because a key's consistent value changed (its noisy "
                                           "count did not)", ["query"], registry=r)
        self.consistency_seconds = Counter("dpstream_consistency_seconds_total",
                                           "Time spent making a hierarchy's published view consistent", ["query"], registry=r)
        self.trigger_seconds = Histogram("dpstream_trigger_duration_seconds", "Time to run one trigger", ["query"],
                                         buckets=TRIGGER_BUCKETS, registry=r)
        self.state_bytes = Gauge("dpstream_state_size_bytes", "Approximate size of the state store", ["partition"], registry=r)
        self.budget_spent = Gauge("dpstream_budget_epsilon_spent", "Epsilon spent per window by the query's plan", ["query"], registry=r)
        self.budget_remaining = Gauge("dpstream_budget_epsilon_remaining", "Epsilon declared minus spent", ["query"], registry=r)
        self.input_watermark = Gauge("dpstream_input_watermark_seconds",
                                     "Unix time up to which every input partition has been read (the least over this worker's "
                                     "stage-2 partitions of the query): triggers fire once it passes their fire time", ["query"],
                                     registry=r)
        self.consumer_lag = Gauge("dpstream_consumer_lag_records", "Records behind the end of the input", ["topic", "partition"], registry=r)
        # elastic workers (docs/operations.md, "Elastic workers"): a gained partition's store is
        # restored from its changelog before the partition is processed
        self.restore_remaining = Gauge("dpstream_restore_remaining_records",
                                       "Changelog records a store still has to restore (0: restored)", ["partition"], registry=r)
        self.restored_records = Counter("dpstream_restored_records_total", "Changelog records restored into a store",
                                        ["partition"], registry=r)
        self.restore_seconds = Histogram("dpstream_restore_duration_seconds", "Time to restore a gained partition's store",
                                         ["partition"], registry=r)
        self.partitions_owned = Gauge("dpstream_partitions_owned", "Source partitions this worker owns", ["topic"], registry=r)
        self.ready = Gauge("dpstream_ready", "1 when the worker has opened its state, republished its journal and is consuming", registry=r)
        self.ledger_spent = Gauge("dpstream_ledger_epsilon_spent", "Epsilon a principal has spent in the current refresh period",
                                  ["principal"], registry=r)
        self.ledger_remaining = Gauge("dpstream_ledger_epsilon_remaining", "Epsilon a principal may still spend in this period",
                                      ["principal"], registry=r)
        self.ledger_delta_remaining = Gauge("dpstream_ledger_delta_remaining", "Delta a principal may still spend in this period",
                                            ["principal"], registry=r)
        self.ledger_refusals = Gauge("dpstream_ledger_refusals", "Charges refused (shadow mode: would have been refused), ever",
                                     ["principal"], registry=r)
        self._seen: dict[tuple, float] = {}

    def _delta(self, name: tuple, total: float) -> float:
        """Counters are fed from cumulative totals: add only what is new."""
        before = self._seen.get(name, 0)
        self._seen[name] = total
        return max(0, total - before)

    def observe_pipeline(self, query: str, stats, plan, keys_released: int | None = None) -> None:
        self.events_in.labels(query).inc(self._delta(("in", query), stats.events_in))
        for reason, count in stats.dropped.items():
            self.dropped.labels(query, reason).inc(self._delta(("drop", query, reason), count))
        self.releases.labels(query).inc(self._delta(("rel", query), stats.releases))
        self.accumulated.labels(query).inc(self._delta(("acc", query), stats.accumulated))
        self.triggers.labels(query).inc(self._delta(("trig", query), stats.triggers_fired))
        self.consistency_updates.labels(query).inc(self._delta(("cons", query), stats.consistency_updates))
        self.consistency_seconds.labels(query).inc(self._delta(("cons_s", query), stats.consistency_seconds))
        self.keys_loaded.labels(query).set(stats.keys_loaded)
        self.keys_released.labels(query).set(len(stats.keys_released) if keys_released is None else keys_released)
        self.keys_tracked.labels(query).set(stats.keys_tracked)
        self.budget_spent.labels(query).set(plan.epsilon_spent)
        self.budget_remaining.labels(query).set(max(0.0, plan.epsilon - plan.epsilon_spent))

    def observe_ledger(self, entries) -> None:
        for e in entries:
            self.ledger_spent.labels(e.principal).set(e.spent_epsilon)
            self.ledger_remaining.labels(e.principal).set(e.remaining[0])
            self.ledger_delta_remaining.labels(e.principal).set(e.remaining[1])
            self.ledger_refusals.labels(e.principal).set(e.refusals)
