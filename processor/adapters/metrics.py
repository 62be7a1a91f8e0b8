"""Prometheus metrics of the pipeline (docs/operations.md, "Metrics"), named by Prometheus conventions.

The pipeline keeps plain counters (:class:`dpstream.processor.engine.pipeline.PipelineStats`); this module turns
them into a registry the worker serves over HTTP, so the pipeline itself never imports
prometheus-client. Metrics are labelled by query, principal, topic or partition; none carries a
user id or a key. Each HELP text says what the worker sets, per worker: the Helm chart's
dashboard and alerts (docs/operations.md, "Dashboards and alerts") read exactly these names.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRIGGER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events_in = Counter("dpstream_events_in_total",
                                 "Input records read for the query, valid or not (the refused ones are in "
                                 "dpstream_events_dropped_total too); dynamic queries: updates read", ["query"], registry=r)
        self.dropped = Counter("dpstream_events_dropped_total",
                               "Input events dropped, by reason: malformed, future, key_collision, late (these dead-lettered; "
                               "late at stage 2 only counted), "
                               "contribution_bound, per_key_bound, budget, duplicate "
                               "(a redelivered copy)", ["query", "reason"], registry=r)
        self.rerouted = Counter("dpstream_events_rerouted_total",
                                "Input events read on a partition that does not own their user (by --partitioner), sent to the "
                                "one that does through the query's by-user topic (docs/operator-guide.md, \"Writing to the "
                                "input topic\")", ["query"], registry=r)
        self.accumulated = Counter("dpstream_records_accumulated_total", "Bounded records stage 2 added to pending micro-batches",
                                   ["query"], registry=r)
        self.releases = Counter("dpstream_releases_total",
                                "Release records computed (one per key a trigger released; dynamic queries: per count published)",
                                ["query"], registry=r)
        self.triggers = Counter("dpstream_triggers_fired_total", "Triggers fired, one per trigger and owned stage-2 partition",
                                ["query"], registry=r)
        self.keys_loaded = Gauge("dpstream_keys_loaded",
                                 "Keys the last trigger of each owned stage-2 partition loaded (micro-batch plus predicted), summed",
                                 ["query"], registry=r)
        self.keys_released = Gauge("dpstream_keys_released",
                                   "Distinct (window, key) pairs this worker released since it started (dynamic queries: 0)",
                                   ["query"], registry=r)
        self.keys_tracked = Gauge("dpstream_keys_tracked", "Key states held for open windows on this worker's stage-2 partitions",
                                  ["query"], registry=r)
        self.consistency_updates = Counter("dpstream_consistency_updates_total",
                                           "Records of a hierarchy re-issued because a key's consistent value changed (its noisy "
                                           "count did not)", ["query"], registry=r)
        self.consistency_seconds = Counter("dpstream_consistency_seconds_total",
                                           "Time spent making a hierarchy's published view consistent", ["query"], registry=r)
        self.trigger_seconds = Histogram("dpstream_trigger_duration_seconds", "Time to run one trigger of one stage-2 partition",
                                         ["query"], buckets=TRIGGER_BUCKETS, registry=r)
        self.state_bytes = Gauge("dpstream_state_size_bytes",
                                 "Approximate size of each owned source partition's state store (RocksDB); label: the store's "
                                 "topic-partition", ["partition"], registry=r)
        self.budget_spent = Gauge("dpstream_budget_epsilon_spent",
                                  "Epsilon the query's plan spends on one window (a dynamic query: once, on its whole stream); "
                                  "the budget ledger charges it when a budget is configured", ["query"], registry=r)
        # from the ledger, never from the config: without a budget section it has no sample
        # (issue 16: it read 0, the declared minus the calibrated epsilon of one window)
        self.budget_remaining = Gauge("dpstream_budget_epsilon_remaining",
                                      "Epsilon the budget ledger still allows the principal this query is charged to, in the "
                                      "current refresh period (only with a budget section)", ["query"], registry=r)
        self.input_watermark = Gauge("dpstream_input_watermark_seconds",
                                     "Unix time up to which every input partition has been read (the least over this worker's "
                                     "stage-2 partitions of the query): triggers fire once it passes their fire time", ["query"],
                                     registry=r)
        self.consumer_lag = Gauge("dpstream_consumer_lag_records",
                                  "Records of an owned source partition (input, repartition or update topic) not yet read: "
                                  "the log end minus the offset after the last one read", ["topic", "partition"], registry=r)
        # elastic workers (docs/operations.md, "Elastic workers"): a gained partition's store is
        # restored from its changelog before the partition is processed
        self.restore_remaining = Gauge("dpstream_restore_remaining_records",
                                       "Changelog records a store still has to restore (0: restored)", ["partition"], registry=r)
        self.restored_records = Counter("dpstream_restored_records_total", "Changelog records restored into a store",
                                        ["partition"], registry=r)
        self.restore_seconds = Histogram("dpstream_restore_duration_seconds", "Time to restore a gained partition's store",
                                         ["partition"], registry=r)
        self.partitions_owned = Gauge("dpstream_partitions_owned", "Source partitions this worker owns, by topic", ["topic"],
                                      registry=r)
        self.ready = Gauge("dpstream_ready", "1 while /readyz answers 200 (state open, journal republished, partitions assigned "
                           "and restored, broker answering), else 0", registry=r)
        self.ledger_spent = Gauge("dpstream_ledger_epsilon_spent", "Epsilon a principal has spent in the current refresh period",
                                  ["principal"], registry=r)
        self.ledger_remaining = Gauge("dpstream_ledger_epsilon_remaining", "Epsilon a principal may still spend in this period",
                                      ["principal"], registry=r)
        self.ledger_delta_remaining = Gauge("dpstream_ledger_delta_remaining", "Delta a principal may still spend in this period",
                                            ["principal"], registry=r)
        self.ledger_refusals = Gauge("dpstream_ledger_refusals",
                                     "Charges the ledger refused (shadow mode: would have refused) since it was created; every "
                                     "worker keeps the same ledger", ["principal"], registry=r)
        # triggers (docs/operations.md, "Dashboards and alerts"): the next one due, the last one fired
        self.next_trigger = Gauge("dpstream_next_trigger_timestamp_seconds",
                                  "Fire time (Unix s: trigger time plus allowed lateness) of the earliest trigger of an open "
                                  "window this worker has still to fire; it fires once the input watermark passes it. No "
                                  "sample while no window is open on an owned stage-2 partition", ["query"], registry=r)
        self.last_trigger = Gauge("dpstream_last_trigger_timestamp_seconds",
                                  "Unix time (wall clock) at which this worker last fired a trigger of the query", ["query"],
                                  registry=r)
        self._seen: dict[tuple, float] = {}
        self._next_queries: set[str] = set()
        self._lag_partitions: set[tuple[str, int]] = set()

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

    def observe_trigger(self, query: str, seconds: float, now: float | None = None) -> None:
        """One trigger fired, taking ``seconds``."""
        self.trigger_seconds.labels(query).observe(seconds)
        self.last_trigger.labels(query).set(time.time() if now is None else now)

    def observe_next_triggers(self, fire_ms: dict[str, int]) -> None:
        """The earliest fire time (epoch ms) per query of the triggers still to fire; a query left
        out (no open window on an owned partition, or its partitions moved away) loses its sample."""
        for query in self._next_queries - fire_ms.keys():
            self.next_trigger.remove(query)
        for query, ms in fire_ms.items():
            self.next_trigger.labels(query).set(ms / 1000.0)
        self._next_queries = set(fire_ms)

    def observe_lag(self, lags: dict[tuple[str, int], int]) -> None:
        """Records not yet read per owned source partition; one no longer owned loses its sample
        (elastic workers: it moved to another worker, which reports it)."""
        for topic, partition in self._lag_partitions - lags.keys():
            self.consumer_lag.remove(topic, str(partition))
        for (topic, partition), lag in lags.items():
            self.consumer_lag.labels(topic, str(partition)).set(lag)
        self._lag_partitions = set(lags)

    def observe_ledger(self, entries, remaining_by_query: dict[str, float] | None = None) -> None:
        """The ledger's entries, and each query's principal's remaining epsilon."""
        for query, remaining in (remaining_by_query or {}).items():
            self.budget_remaining.labels(query).set(remaining)
        for e in entries:
            self.ledger_spent.labels(e.principal).set(e.spent_epsilon)
            self.ledger_remaining.labels(e.principal).set(e.remaining[0])
            self.ledger_delta_remaining.labels(e.principal).set(e.remaining[1])
            self.ledger_refusals.labels(e.principal).set(e.refusals)
