"""Fix 5: dynamic ticks are decided on the clock, not by the arrival of later updates.

Claim under attack (processor/engine/dynamic_stream.py): every tick whose end + allowed_lateness the
clock has passed is decided, with or without updates (the worker's timer with the wall clock,
replay with its event-time clock and, at the end, --until); so whether a segment's release exists
for ticks <= t never depends on updates after t. Recovery re-feeds the update log and re-decides
the stored decided tick: identical releases. The old code decided a tick only when a newer update
arrived.

Releases are SVT outputs: what must not depend on later data is the set of (segment, tick)
releases at ticks <= t, and their values (the same updates meet the same PRF noise).
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.config import DpstreamConfig, DynamicQueryConfig
from dpstream.processor.engine.dynamic_stream import DynamicQueryState
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import RocksDBStore, WriteBatch
from tests.conftest import TEST_LABEL, TEST_RUN_NONCE, TEST_SECRET, Record, without_run
from tests.privacy._helpers import (
    START,
    replay,
    write_jsonl,
)

ITEMS = ["a", "b", "c"]
TICK = 1000



def log_updates(worker: DpstreamWorker, records) -> list:
    """Log update records as the worker's dynamic agent does: the update log is committed once
    its dead letters were sent; returns those dead letters."""
    result = worker.process_dynamic("upd", 0, records)
    if result is None:
        return []
    result.commit()
    return result.messages

def dyn_query(**kw) -> DynamicQueryConfig:
    fields = dict(name="plans", items=ITEMS, epsilon=1.0, start=START, tick="1s", allowed_lateness="1s")
    fields.update(kw)
    return DynamicQueryConfig(**fields)


def dyn_config(**kw) -> DpstreamConfig:
    return DpstreamConfig(dynamic=[dyn_query(**kw)])


def updates(seed: int, ticks: int, burst_at: Optional[int] = None, burst: int = 0) -> list[dict]:
    """One update per tick (insert, or delete of a present item), plus a burst of inserts at one
    tick so that SVT closes a segment there."""
    rng = np.random.default_rng(seed)
    live, out = [], []
    for t in range(ticks):
        ts = START + t * TICK + 1
        if live and rng.random() < 0.4:
            out.append({"item": live.pop(int(rng.integers(len(live)))), "op": "delete", "ts": ts})
        else:
            item = ITEMS[int(rng.integers(3))]
            live.append(item)
            out.append({"item": item, "op": "insert", "ts": ts})
        if burst_at == t:
            out += [{"item": "b", "op": "insert", "ts": ts}] * burst
    return out


def dyn_releases(run) -> list[dict]:
    return [r for r in run.records if "segment" in r]


def upto(records, t: int) -> list[str]:
    return [json.dumps(r, sort_keys=True) for r in records if r["tick"] <= t]


# ---------------------------------------------------------------------------------------------
# REGRESSION: DynamicNoise built 12-byte tree ids after ids grew to 16 bytes, so every config
# with a dynamic query crashed when its counter was built.
def test_regression_dynamic_noise_uses_full_tree_ids(tmp_path):
    from dpstream.processor.mechanisms.dynamic import DynamicNoise

    noise = NodeNoise(TEST_SECRET, TEST_LABEL)
    draws = DynamicNoise(noise, "plans").laplace(3.0, "probe", 64)
    assert draws.shape == (64,) and len(set(draws.tolist())) > 3
    run = replay(dyn_config(), write_jsonl(tmp_path / "e.jsonl", updates(1, 50)), until_ms=START + 60 * TICK)
    assert dyn_releases(run)


def test_a_burst_release_exists_whether_or_not_a_later_update_exists(tmp_path):
    """The old leak: a segment closing at tick 302 (a burst) was released only once some later
    update arrived."""
    base = updates(1, 301, burst_at=300, burst=1000)
    trail = {"item": "a", "op": "insert", "ts": START + 3000 * TICK}
    until = START + 4000 * TICK
    a = replay(dyn_config(), write_jsonl(tmp_path / "a.jsonl", base), until_ms=until)
    b = replay(dyn_config(), write_jsonl(tmp_path / "b.jsonl", base + [trail]), until_ms=until)
    ra, rb = dyn_releases(a), dyn_releases(b)
    assert any(r["tick"] == 301 for r in ra), "the burst closes a segment at its tick"
    assert upto(ra, 2999) == upto(rb, 2999)
    # and without --until the last update's tick is decided too (documented: data-derived end)
    c = replay(dyn_config(), write_jsonl(tmp_path / "c.jsonl", base))
    assert any(r["tick"] == 301 for r in dyn_releases(c))


def test_ticks_are_decided_with_no_update_at_all(tmp_path):
    """An empty input and a public end: segments still close (SVT horizons, noise) and are
    released - existence of releases follows the clock alone."""
    run = replay(dyn_config(), write_jsonl(tmp_path / "e.jsonl", []), until_ms=START + 70_000 * TICK)
    ticks = [r["tick"] for r in dyn_releases(run)]
    assert ticks and ticks == sorted(ticks) and ticks[-1] <= 70_000
    assert run.dynamic[0][0] == dyn_query().decided_through(START + 70_000 * TICK)


@st.composite
def dynamic_scenarios(draw):
    ticks = draw(st.integers(20, 400))
    burst_at = draw(st.integers(0, ticks - 1))
    burst = draw(st.sampled_from([0, 300, 1200]))
    seed = draw(st.integers(0, 2**16))
    t = draw(st.integers(ticks, ticks + 5000))  # the cut: later updates come after it
    later = draw(st.lists(st.tuples(st.integers(1, 20_000), st.sampled_from(ITEMS)), min_size=1, max_size=6))
    until_extra = draw(st.integers(0, 30_000))
    return ticks, burst_at, burst, seed, t, later, until_extra


@settings(deadline=None, derandomize=True, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dynamic_scenarios())
def test_property_releases_up_to_t_do_not_depend_on_updates_after_t(tmp_path_factory, scenario):
    ticks, burst_at, burst, seed, t, later, until_extra = scenario
    tmp = tmp_path_factory.mktemp("dyn")
    base = updates(seed, ticks, burst_at, burst)
    extra = [{"item": item, "op": "insert", "ts": START + (t + dt) * TICK} for dt, item in later]  # ticks > t
    until = START + (t + until_extra) * TICK
    a = replay(dyn_config(), write_jsonl(tmp / "a.jsonl", base), until_ms=until)
    b = replay(dyn_config(), write_jsonl(tmp / "b.jsonl", base + extra), until_ms=until)
    cut = min(t, dyn_query().decided_through(until))
    assert upto(dyn_releases(a), cut) == upto(dyn_releases(b), cut)
    # everything up to --until is decided, data or not, in both runs
    assert a.dynamic[0][0] == b.dynamic[0][0] == dyn_query().decided_through(until)


# ---------------------------------------------------------------------------------------------
def worker_config() -> DpstreamConfig:
    return DpstreamConfig(dynamic=[dyn_query(input_topic="upd")])


def drain_worker(w: DpstreamWorker, now_ms: int, publish: bool = True) -> list[dict]:
    """The timer: advance until the clock's ticks are all decided; collect (and publish) releases."""
    out = []
    while True:
        due = w.advance_dynamic(now_ms, read_to_end=dict.fromkeys(w.dynamic, now_ms))  # the update topic read to its end
        done = all(st.decided >= st.query.decided_through(now_ms) for sts in w.dynamic_states.values() for st in sts)
        if publish or done:
            # unpublished releases stay pending (and are offered again) until marked published:
            # without publishing, collect them once, when every due tick is decided
            for key in due:
                out += [json.loads(m.value) for m in w.dynamic_releases(key)]
                if publish:
                    w.mark_dynamic_published(key)
        if done:
            return out


def test_worker_timer_decides_ticks_without_updates_and_matches_replay(tmp_path):
    cfg = worker_config()
    now = START + 5000 * TICK
    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {}, 1, app_id="dp", watermark_delay_ms=0)
    try:
        got = drain_worker(w, now)
    finally:
        w.close()
    assert got, "segments close on the clock alone"
    run = replay(cfg, write_jsonl(tmp_path / "e.jsonl", []), label=w.noise.label, until_ms=now)
    expected = dyn_releases(run)
    assert [json.dumps(without_run(r), sort_keys=True) for r in got] == [json.dumps(without_run(r), sort_keys=True) for r in expected]
    # each says which run made it: the worker's application and noise label, replay's label (the same)
    assert {(r["app_id"], r["run"]["noise_label"]) for r in got} == {("dp", w.noise.label)}
    assert {r["run"]["noise_label"] for r in expected} == {w.noise.label}


def test_worker_a_future_dated_update_is_dead_lettered_and_decides_nothing(tmp_path):
    cfg = worker_config()
    base = updates(4, 200, burst_at=150, burst=800)
    recs = [Record(i, None, json.dumps(u).encode(), u["ts"]) for i, u in enumerate(base)]
    far = {"item": "a", "op": "insert", "ts": START + 86_400_000}
    results = []
    for with_far in (False, True):
        w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / f"w{with_far}", Ownership(), {}, 1, watermark_delay_ms=0, run_nonce=TEST_RUN_NONCE)
        try:
            batch = recs[:100] + ([Record(100, None, json.dumps(far).encode(), START + 100 * TICK)] if with_far else [])
            batch += [Record(r.offset + 1, r.key, r.value, r.timestamp) for r in recs[100:]]
            letters = log_updates(w, batch)
            releases = drain_worker(w, START + 1000 * TICK)
            results.append((letters, releases))
        finally:
            w.close()
    (l0, r0), (l1, r1) = results
    assert l0 == []
    assert len(l1) == 1 and json.loads(l1[0].value)["reason"].startswith("future")
    assert r0 == r1


def test_worker_recovery_after_a_crash_republishes_identical_releases(tmp_path):
    cfg = worker_config()
    base = updates(5, 600, burst_at=300, burst=900)
    recs = [Record(i, None, json.dumps(u).encode(), u["ts"]) for i, u in enumerate(base)]
    ref = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "ref", Ownership(), {}, 1, watermark_delay_ms=0, run_nonce=TEST_RUN_NONCE)
    try:
        log_updates(ref, recs)
        expected = drain_worker(ref, START + 2000 * TICK)
    finally:
        ref.close()
    assert len(expected) >= 3

    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {}, 1, watermark_delay_ms=0, run_nonce=TEST_RUN_NONCE)
    log_updates(w, recs[:700])
    first = drain_worker(w, START + 250 * TICK)  # published (recs[700:] are all dated after this clock)
    log_updates(w, recs[700:])
    lost = drain_worker(w, START + 2000 * TICK, publish=False)  # computed, never marked published: crash
    w.close()
    assert lost
    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {}, 1, watermark_delay_ms=0, run_nonce=TEST_RUN_NONCE)
    try:
        resent = [json.loads(m.value) for key in w.dynamic_states for m in w.dynamic_releases(key)]
        for key in w.dynamic_states:
            w.mark_dynamic_published(key)
        rest = drain_worker(w, START + 2000 * TICK)
    finally:
        w.close()
    assert resent == lost, "recovery recomputes the unpublished releases identically"
    assert first + resent + rest == expected


def test_state_recovery_with_interleaved_clock_and_updates(tmp_path):
    """DynamicQueryState directly: updates and clock advances interleaved, a crash (no publish) at
    each step, recovery from the store: the same release sequence."""
    q = dyn_query()
    noise, pseud = NodeNoise(TEST_SECRET, TEST_LABEL), Pseudonymizer(TEST_SECRET)
    base = updates(6, 500, burst_at=200, burst=700)
    steps = [("u", base[i:i + 37]) for i in range(0, len(base), 37)]
    steps = [s for pair in zip(steps, [("c", START + (k + 1) * 60 * TICK) for k in range(len(steps))]) for s in pair]

    def run(store, st, start_step, publish_upto):
        out = []
        for k, (kind, arg) in enumerate(steps[start_step:], start_step):
            batch = WriteBatch()
            if kind == "u":
                for u in arg:
                    st.apply(u, batch)
            else:
                st.advance_clock(arg, batch)
            store.write(batch)
            if k < publish_upto:
                out += st.take_pending()
                mark = WriteBatch()
                st.mark_published(mark)
                store.write(mark)
        return out

    ref_store = RocksDBStore(tmp_path / "ref")
    reference = run(ref_store, DynamicQueryState(q, noise, pseud, ref_store), 0, len(steps))
    ref_store.close()
    assert len(reference) >= 3
    for crash_at in (3, 8, len(steps) - 2):
        store = RocksDBStore(tmp_path / f"s{crash_at}")
        first = run(store, DynamicQueryState(q, noise, pseud, store), 0, crash_at)
        # steps[crash_at:] were written but never published; the process dies
        store.close()
        store = RocksDBStore(tmp_path / f"s{crash_at}")
        again = DynamicQueryState(q, noise, pseud, store)
        resent = again.take_pending()
        store.close()
        assert [json.dumps(r, sort_keys=True) for r in first + resent] == [json.dumps(r, sort_keys=True) for r in reference]


# ---------------------------------------------------------------------------------------------
def test_worker_reads_the_updates_of_overdue_ticks_before_it_decides_them(tmp_path):
    """Issue 15's lost release, for dynamic counts: a worker back from an outage must not decide
    overdue ticks on the wall clock before reading their updates (which would refuse them all as
    late). Ticks are decided up to the update topic's watermark."""
    cfg = worker_config()
    base = updates(6, 600, burst_at=300, burst=900)
    recs = [Record(i, None, json.dumps(u).encode(), u["ts"]) for i, u in enumerate(base)]  # sent at their time
    end = START + 2000 * TICK
    ref = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "ref", Ownership(), {}, 1, watermark_delay_ms=0, run_nonce=TEST_RUN_NONCE)
    try:
        log_updates(ref, recs)
        expected = drain_worker(ref, end)
    finally:
        ref.close()
    w = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {}, 1, watermark_delay_ms=0, run_nonce=TEST_RUN_NONCE)
    try:
        log_updates(w, recs[:200])
        # back after the outage: the wall clock is long past every tick, nothing more read yet
        due = w.advance_dynamic(end)
        got = [json.loads(m.value) for key in due for m in w.dynamic_releases(key)]
        for key in due:
            w.mark_dynamic_published(key)
        assert all(st.decided <= st.query.decided_through(recs[199].timestamp) for sts in w.dynamic_states.values() for st in sts)
        letters = log_updates(w, recs[200:])  # the backlog
        assert letters == [], "no update of the backlog is late"
        got += drain_worker(w, end)
    finally:
        w.close()
    assert len(expected) >= 3 and got == expected
