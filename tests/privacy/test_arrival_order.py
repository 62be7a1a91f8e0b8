"""Adversarial tests of user-level sensitivity under any arrival order (docs/privacy.md,
"Distinct users per round" and "Threat model").

The accountant charges key selection for a user adding at most 1 to any (key, round) tree and
taking part in at most C rounds, and perturbation for at most C * L per user. Records arrive out
of event-time order (allowed lateness, producer-set timestamps), stage-1 output is delivered at
least once, and workers crash. The attack the first test reproduces: the OLD code took a
record's predecessor to be the user's last-ARRIVED record for the key, so a user whose records
arrive H, L, H, L, ... (H in trigger s, L in trigger s - 1, the key released at s - 1) was new to
the round starting at s once per H: up to C / 2 in one tree.

All scenarios drive the product's own stage 1 and stage 2 (``QueryPipeline.bound`` /
``accumulate`` / ``fire``) on a ``MemoryStore``; ``prior_clock`` is each record's arrival time,
always before its trigger fires (nothing is late), and far enough from the event time that
``max_skew`` never refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.processor.config import QueryConfig
from dpstream.processor.engine.pipeline import EventColumns, QueryPipeline
from dpstream.processor.mechanisms.noise import NodeNoise, Pseudonymizer
from dpstream.state.store import MemoryStore, WriteBatch
from dpstream.topics.records import key_text
from tests.conftest import TEST_SECRET

DAY = 86_400_000
START = 1_795_132_800_000  # a UTC midnight
T, C = 8, 4
INTERVAL = DAY // T
NOISE = NodeNoise(TEST_SECRET, "x")
PSEUDO = Pseudonymizer(TEST_SECRET)
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def make_query(**overrides) -> QueryConfig:
    fields = dict(name="arrive", window="1d", triggers=T, contribution_bound=C, epsilon=20.0, delta=1e-9,
                  allowed_lateness="0s", max_skew="2d", key_threshold=0.0)
    fields.update(overrides)
    return QueryConfig(**fields)


@dataclass(frozen=True)
class Rec:
    user: str
    key: object  # str, or a tuple of fields for a hierarchy
    ts: int
    value: float = 1.0

    @property
    def text(self) -> str:
        return self.key if isinstance(self.key, str) else key_text(list(self.key))

    @property
    def window(self) -> int:
        return self.ts - self.ts % DAY

    @property
    def trigger(self) -> int:
        return (self.ts - self.window) // INTERVAL + 1


def columns(recs: list[Rec]) -> EventColumns:
    texts = [r.text for r in recs]
    return EventColumns(PSEUDO.users([r.user for r in recs]), np.array(texts, dtype=object), PSEUDO.group_keys(texts),
                        np.array([r.value for r in recs], dtype=np.float64), np.array([r.ts for r in recs], dtype=np.int64))


@dataclass
class Delivery:
    """One stage-1 batch: records in arrival order, their arrival clock, and what goes wrong."""

    records: list[Rec]
    clock: int
    crash_before: bool = False  # a fresh QueryPipeline (a restarted worker) on the same store
    duplicate: str = "none"  # "now": stage-1 output accumulated twice; "later": again in a later slot
    duplicate_slot: int = 0


@dataclass
class Run:
    releases: list = field(default_factory=list)  # per trigger: fire()'s records
    admitted: list = field(default_factory=list)  # BoundedRecords of every stage-1 batch
    snapshots: list = field(default_factory=list)  # per trigger: {key id: (round, start, count, released+buffer, level)}


class KeepWindow(QueryPipeline):
    """The product drops a window's key rows when its last trigger fires; the tests read them
    after every trigger, the last one included (nothing fires after it)."""

    def collect_window(self, window: int) -> None:
        pass


def drive(query: QueryConfig, schedule: list[list[Delivery]], key_texts: dict[int, str], window: int = START) -> Run:
    """Deliver slot d's batches after trigger d fired and before trigger d + 1 fires, then fire;
    snapshot every key's selection and perturbation state after each trigger."""
    store = MemoryStore()
    pipe = KeepWindow(query, NOISE, store, PSEUDO)
    run, later, seq = Run(), {}, 0
    ids = np.array(sorted(key_texts), dtype=np.uint64)
    for slot in range(T):
        for d in schedule[slot]:
            if d.crash_before:
                pipe = KeepWindow(query, NOISE, store, PSEUDO)
            batch = WriteBatch()
            recs = pipe.bound(columns(d.records), np.full(len(d.records), d.clock, dtype=np.int64), batch)
            assert not pipe.last_rejected
            seq += 1
            pipe.accumulate(recs, seq, batch)
            if d.duplicate == "now":
                seq += 1
                pipe.accumulate(recs, seq, batch)
            elif d.duplicate == "later":
                later.setdefault(d.duplicate_slot, []).append(recs)
            store.write(batch)
            run.admitted.append(recs)
        for recs in later.pop(slot, []):  # at-least-once: the same stage-1 output again
            batch = WriteBatch()
            seq += 1
            pipe.accumulate(recs, seq, batch)
            store.write(batch)
        # without a ledger the window opens with its first record; then, as the runner does, the
        # triggers due fire in order (those before the first record have empty micro-batches)
        out: list = []
        if window in pipe.open_windows():
            for trigger in range(pipe.progress(window) + 1, slot + 2):
                out = pipe.fire(window, trigger)
                if trigger <= slot:
                    assert out == []
        run.releases.append(out)
        rows, _ = pipe._load_keys(window, ids, key_texts)
        run.snapshots.append({int(k): (int(r["round"]), int(r["start"]), int(r["count"]), int(r["released"] + r["buffer"]),
                                       int(r["level"])) for k, r in zip(ids.tolist(), rows)})
    assert len(run.releases) == T
    return run


def admitted_table(run: Run) -> dict[str, np.ndarray]:
    cols = {name: np.concatenate([getattr(r, name) for r in run.admitted]) if run.admitted else np.zeros(0)
            for name in ("key_ids", "users", "trigger", "units", "slots", "levels")}
    return cols


def check_exact_round_counts(run: Run) -> None:
    """(a) After every trigger t, each key's round count is the number of distinct users with an
    admitted record for it in [round start, t]: 1 per user per (key, round) tree, whatever the
    order; and its released + buffered units are exactly its admitted units up to t."""
    adm = admitted_table(run)
    # every (user, slot, level) admitted once: stage 1 never re-issues a slot
    triples = set(zip(adm["users"].tolist(), adm["slots"].tolist(), adm["levels"].tolist()))
    assert len(triples) == len(adm["users"])
    for t, snap in enumerate(run.snapshots, start=1):
        for key, (round_, start, count, units, _) in snap.items():
            mine = adm["key_ids"] == np.uint64(key)
            in_round = mine & (adm["trigger"] >= start) & (adm["trigger"] <= t)
            assert count == len(np.unique(adm["users"][in_round])), (t, key, round_, start)
            assert units == int(adm["units"][mine & (adm["trigger"] <= t)].sum()), (t, key)


# ------------------------------------------------------------------------ the H/L attack
S = 3  # the attacked round starts at trigger S (the key is released at S - 1)
SHAPES = {
    # the attack: every H in trigger S (OLD code: one count per H that follows an L)
    "H in one trigger": lambda j: S,
    # H spread over the round's micro-batches S, S+1, ...: one count per micro-batch under the
    # last-arrived rule even where a micro-batch counts each user once
    "H across the round": lambda j: S + j,
    # no release between L and H: both in round 0, so the L arriving after an H must amend it
    "same round, no release": lambda j: S,
}


def hl_schedule(mode: str, shape: str) -> tuple[list[list[Delivery]], dict[int, str]]:
    """300 crowd users at trigger S - 1 release key "page" there (its round 1 starts at S),
    except in the "same round" shape; the attacker's 2C records alternate H, L (L in trigger
    S - 1) in arrival order, all arriving before trigger S - 1 fires."""
    crowd = [] if shape == "same round, no release" else [
        Rec(f"crowd{i}", "page", START + (S - 2) * INTERVAL + 10 + i) for i in range(300)]
    h_trigger = SHAPES[shape]
    attack = []
    for j in range(C):
        attack.append(Rec("mallory", "page", START + (h_trigger(j) - 1) * INTERVAL + 1000 + j))  # H
        attack.append(Rec("mallory", "page", START + (S - 2) * INTERVAL + 2000 + j))  # L
    clock = START + (S - 2) * INTERVAL + 1  # during trigger S - 1: every record is on time
    schedule: list[list[Delivery]] = [[] for _ in range(T)]
    if mode == "one batch":
        schedule[S - 2] = [Delivery(crowd + attack, clock)]
    elif mode == "one record per batch":
        schedule[S - 2] = [Delivery(crowd, clock)] + [Delivery([r], clock) for r in attack]
    elif mode == "crash and duplicate between records":
        schedule[S - 2] = [Delivery(crowd, clock)] + [Delivery([r], clock, crash_before=True, duplicate="now") for r in attack]
    elif mode == "H early, L in a later slot":
        # the H records arrive during trigger S - 2, the L records during S - 1: still on time
        early = START + (S - 3) * INTERVAL + 1
        schedule[S - 3] = [Delivery([r], early, duplicate="later", duplicate_slot=S - 2) for r in attack[0::2]]
        schedule[S - 2] = [Delivery(crowd, clock)] + [Delivery([r], clock, crash_before=True) for r in attack[1::2]]
    schedule = [[d for d in slot if d.records] for slot in schedule]
    return schedule, {int(PSEUDO.group_keys(["page"])[0]): "page"}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["one batch", "one record per batch", "crash and duplicate between records",
                                  "H early, L in a later slot"])
def test_hl_attack_counts_the_user_once_per_round(mode, shape):
    """H/L attack: records alternating between later triggers (H) and trigger S - 1 (L) must not
    make the attacker new to one round more than once. OLD code (before fb16e4b, C = 4, 8
    records): "H in one trigger": round count 4 at S for this one user (predecessors 0, 3, 2, 3,
    2, 3, 2, 3: every H after an L looked new); "H across the round": 4 after trigger 6; both in
    every mode but "H early, L in a later slot" (no interleaving: 1). "Same round": the old code
    counts the user only at S, 0 after S - 1 although its L records are there (not the round's
    distinct users). Fixed: exactly 1 in every case."""
    query = make_query(contribution_bound=2 * C)
    schedule, texts = hl_schedule(mode, shape)
    run = drive(query, schedule, texts)
    key = next(iter(texts))
    last_h = max(SHAPES[shape](j) for j in range(C))
    if shape == "same round, no release":
        assert all(snap[key][:2] == (0, 1) for snap in run.snapshots[:last_h]), "no release expected"
    else:
        assert run.snapshots[S - 2][key][:2] == (1, S), "the scenario needs the key released at S - 1"
        assert [r["key"] for r in run.releases[S - 2]] == ["page"]
        assert run.snapshots[last_h - 1][key][:2] == (1, S)
    assert run.snapshots[last_h - 1][key][2] == 1  # the attacker is the only user in the round since S (or at all)
    check_exact_round_counts(run)


# ------------------------------------------------------- random streams, orders and failures
@dataclass(frozen=True)
class Stream:
    records: tuple  # Rec, the focus users' records (adversarial order applies to all records)
    keys: tuple


def key_names(n_keys: int, hierarchy: bool) -> list:
    if hierarchy:
        return [(f"a{k % 2}", f"b{k}") for k in range(n_keys)]
    return [f"key{k}" for k in range(n_keys)]


def texts_of(keys: list, hierarchy: bool) -> dict[int, str]:
    texts = set()
    for k in keys:
        if hierarchy:
            texts.update({key_text([k[0]]), key_text(list(k))})
        else:
            texts.add(k)
    texts = sorted(texts)
    return dict(zip(PSEUDO.group_keys(texts).tolist(), texts))


@st.composite
def streams(draw, max_per_user: int, hierarchy: bool = False, aggregate: str = "count"):
    """A few focus users (up to 5, each with up to max_per_user records on up to 3 keys at random
    triggers) plus a crowd of one-record users on some (key, trigger) pairs so that keys are
    released and later rounds start. Values (sums) beyond +-L and off the grid."""
    n_keys = draw(st.integers(1, 3))
    keys = key_names(n_keys, hierarchy)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32)))
    out = []
    for u in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, max_per_user))
        if draw(st.booleans()):  # concentrate the user on one key and two adjacent triggers (H/L-like)
            k = int(rng.integers(0, n_keys))
            base = int(rng.integers(1, T))
            trig = [base + int(rng.integers(0, 2)) for _ in range(n)]
            ks = [k] * n
        else:
            trig = rng.integers(1, T + 1, n).tolist()
            ks = rng.integers(0, n_keys, n).tolist()
        for j in range(n):
            value = float(rng.choice([1.0, -0.3, 1.7, 5.0, -9.0, 0.123456789])) if aggregate == "sum" else 1.0
            out.append(Rec(f"f{u}", keys[ks[j]], START + (trig[j] - 1) * INTERVAL + int(rng.integers(0, INTERVAL)), value))
    for k in range(n_keys):
        for trig in rng.choice(np.arange(1, T + 1), size=int(rng.integers(0, 3)), replace=False).tolist():
            for i in range(int(rng.integers(20, 45))):
                out.append(Rec(f"crowd{k}-{trig}-{i}", keys[k], START + (trig - 1) * INTERVAL + int(rng.integers(0, INTERVAL)), 1.0))
    return Stream(tuple(out), tuple(keys))


def random_schedule(records, seed: int, faults: bool = True) -> list[list[Delivery]]:
    """Each record arrives in a random slot before its trigger fires, in a random order, in
    random stage-1 batches; with faults, random crashes and duplicated stage-1 output (now, or
    again in a later slot, when it may be late)."""
    rng = np.random.default_rng(seed)
    slots: list[list[Rec]] = [[] for _ in range(T)]
    for r in records:
        slots[int(rng.integers(0, r.trigger))].append(r)
    schedule = []
    for slot, recs in enumerate(slots):
        order = rng.permutation(len(recs))
        recs = [recs[i] for i in order]
        cuts = sorted(rng.choice(np.arange(1, len(recs)), size=min(len(recs) - 1, int(rng.integers(0, 4))), replace=False).tolist()) \
            if len(recs) > 1 else []
        deliveries = []
        for part in np.split(np.arange(len(recs)), cuts):
            if not len(part):
                continue
            d = Delivery([recs[i] for i in part.tolist()], START + slot * INTERVAL + int(rng.integers(0, INTERVAL)))
            if faults:
                d.crash_before = bool(rng.random() < 0.3)
                roll = rng.random()
                if roll < 0.25:
                    d.duplicate = "now"
                elif roll < 0.5:
                    d.duplicate, d.duplicate_slot = "later", int(rng.integers(slot, T))
            deliveries.append(d)
        schedule.append(deliveries)
    return schedule


def in_order_schedule(records) -> list[list[Delivery]]:
    """The reference order: event-time order, each record arriving during its own trigger."""
    slots: list[list[Rec]] = [[] for _ in range(T)]
    for r in sorted(records, key=lambda r: r.ts):
        slots[r.trigger - 1].append(r)
    return [[Delivery(recs, START + slot * INTERVAL + INTERVAL - 1)] if recs else [] for slot, recs in enumerate(slots)]


@PROPERTY
@given(streams(max_per_user=2 * C), st.integers(0, 2 ** 32))
def test_round_counts_are_exact_distinct_users_under_any_arrival(stream, seed):
    """(a) Random arrival permutations (every record on time), random stage-1 batches, crashes
    and duplicated stage-1 output, users beyond C: every (key, round) tree counts each user at
    most once, exactly the distinct users with admitted records in the round so far; a user's
    admitted records never exceed C. OLD code: fails (a user counted once per H after an L)."""
    query = make_query()
    run = drive(query, random_schedule(stream.records, seed), texts_of(list(stream.keys), False))
    check_exact_round_counts(run)
    adm = admitted_table(run)
    _, per_user = np.unique(adm["users"], return_counts=True)
    assert per_user.max(initial=0) <= C


@PROPERTY
@given(streams(max_per_user=C), st.integers(0, 2 ** 32), st.integers(0, 2 ** 32))
def test_releases_do_not_depend_on_arrival_order(stream, seed_a, seed_b):
    """(b) With no user beyond C (so the admitted set is the same) and nothing late, the releases
    are identical for any arrival order, batching, crash points and duplication: an observer of
    the output learns nothing from the order (and the order cannot be used to inflate counts).
    Compared with the in-order delivery too."""
    query = make_query()
    texts = texts_of(list(stream.keys), False)
    reference = drive(query, in_order_schedule(stream.records), texts)
    a = drive(query, random_schedule(stream.records, seed_a), texts)
    b = drive(query, random_schedule(stream.records, seed_b, faults=seed_b % 2 == 0), texts)
    assert a.releases == reference.releases
    assert b.releases == reference.releases
    assert a.snapshots == reference.snapshots and b.snapshots == reference.snapshots
    check_exact_round_counts(a)


def worst_neighbour(stream: Stream, data, L: float) -> list[Rec]:
    kind = data.draw(st.sampled_from(["one key one trigger +L", "one key one trigger +L", "2C spread", "2C one key -L"]))
    key = stream.keys[data.draw(st.integers(0, len(stream.keys) - 1))]
    trig = data.draw(st.integers(1, T))
    if kind == "one key one trigger +L":
        return [Rec("neighbour", key, START + (trig - 1) * INTERVAL + 7 * j, 10 * L) for j in range(C)]
    if kind == "2C one key -L":
        return [Rec("neighbour", key, START + (trig - 1) * INTERVAL + 7 * j, -10 * L) for j in range(2 * C)]
    return [Rec("neighbour", stream.keys[j % len(stream.keys)], START + (j % T) * INTERVAL + 11 * j, 10 * L * (-1) ** j)
            for j in range(2 * C)]


@PROPERTY
@given(streams(max_per_user=2 * C, aggregate="sum"), st.integers(0, 2 ** 32), st.data())
def test_one_user_moves_perturbation_trees_by_at_most_c_times_l(stream, seed, data):
    """(c) Worst neighbour (C records on one key and one trigger at +L, or 2C records clamped):
    with and without the user, under the same random arrival order and faults for everyone else,
    the sum over keys of |released + buffered units| differs by at most C * M grid units (M =
    plan.clamp_units) after every trigger, and exactly by the user's admitted units; each round
    tree that has the same round in both runs differs by 0 or 1."""
    L = 2.0
    query = make_query(aggregate="sum", value_field="v", clamp=L)
    pipe = QueryPipeline(query, NOISE, MemoryStore(), PSEUDO)
    M = int(pipe.plan.clamp // pipe.plan.resolution)  # floor(L / step): the grid steps of +-L
    assert M == pipe.plan.clamp_units
    assert M * pipe.plan.resolution <= L and M >= 1
    neighbour = worst_neighbour(stream, data, L)
    texts = texts_of(list(stream.keys), False)
    schedule = random_schedule(stream.records, seed)
    without = drive(query, schedule, texts)
    rng = np.random.default_rng(seed + 1)
    with_sched = [[Delivery(list(d.records), d.clock, d.crash_before, d.duplicate, d.duplicate_slot) for d in slot]
                  for slot in schedule]
    for r in neighbour:  # the neighbour's records join random batches of their allowed slots
        slot = int(rng.integers(0, r.trigger))
        if with_sched[slot]:
            d = with_sched[slot][int(rng.integers(0, len(with_sched[slot])))]
            d.records.insert(int(rng.integers(0, len(d.records) + 1)), r)
        else:
            with_sched[slot].append(Delivery([r], START + slot * INTERVAL))
    with_user = drive(query, with_sched, texts)
    check_exact_round_counts(with_user)
    adm = admitted_table(with_user)
    neighbour_id = PSEUDO.users(["neighbour"])[0]
    theirs = adm["users"] == neighbour_id
    assert theirs.sum() <= C
    for t in range(T):
        before, after = without.snapshots[t], with_user.snapshots[t]
        diff = {k: after[k][3] - before[k][3] for k in before}
        assert sum(abs(v) for v in diff.values()) <= C * M, t
        for k, v in diff.items():
            assert v == int(adm["units"][theirs & (adm["key_ids"] == np.uint64(k)) & (adm["trigger"] <= t + 1)].sum())
            if after[k][:2] == before[k][:2]:
                assert after[k][2] - before[k][2] in (0, 1), (t, k)


@PROPERTY
@given(streams(max_per_user=2 * C, hierarchy=True), st.integers(0, 2 ** 32))
def test_hierarchy_levels_get_each_admitted_record_once(stream, seed):
    """(d) A two-level hierarchy (a > (a, b)): every admitted record adds exactly one to one key
    of each level, even when its stage-1 output is duplicated or the worker restarts; so per
    level a user contributes at most C, and each level's round trees count users once."""
    query = make_query(key_fields=["a", "b"], hierarchy=True, name="geo")
    texts = texts_of(list(stream.keys), True)
    run = drive(query, random_schedule(stream.records, seed), texts)
    check_exact_round_counts(run)
    adm = admitted_table(run)
    admitted_events = adm["levels"] == 2
    assert (adm["levels"] == 1).sum() == admitted_events.sum()
    for user in np.unique(adm["users"]).tolist():
        for level in (1, 2):
            assert ((adm["users"] == user) & (adm["levels"] == level)).sum() <= C
    for t, snap in enumerate(run.snapshots, start=1):
        events_so_far = int((admitted_events & (adm["trigger"] <= t)).sum())
        for level in (1, 2):
            total = sum(units for key, (_, _, _, units, lv) in snap.items() if lv == level)
            assert total == events_so_far, (t, level)


# ------------------------------------------------------------------------- window boundaries
def test_window_and_trigger_boundaries():
    """A user's records straddling two windows get one C per window (the privacy unit is (user,
    window)); a record exactly at a window's start belongs to the new window's trigger 1, one a
    millisecond earlier to the old window's trigger T; a record exactly at a trigger time belongs
    to the next trigger; a record arriving when its trigger's fire time has come is late."""
    query = make_query()
    store = MemoryStore()
    pipe = QueryPipeline(query, NOISE, store, PSEUDO)
    W2 = START + DAY
    old = [Rec("w", "k", W2 - 1 - j) for j in range(C + 1)]  # window 1, trigger T: C admitted, 1 dropped
    new = [Rec("w", "k", W2 + j) for j in range(C + 1)]  # window 2, trigger 1 (W2 itself first)
    at_trigger = Rec("x", "k", START + 3 * INTERVAL)  # exactly trigger time 3: trigger 4
    recs = old + new + [at_trigger]
    clock = np.full(len(recs), START + 3 * INTERVAL - 5)
    batch = WriteBatch()
    out = pipe.bound(columns(recs), clock, batch)
    pipe.accumulate(out, 1, batch)
    store.write(batch)
    user_w = PSEUDO.users(["w"])[0]
    w = out.users == user_w
    assert sorted(out.window[w].tolist()) == [START] * C + [W2] * C
    assert set(out.trigger[w & (out.window == START)].tolist()) == {T}
    assert set(out.trigger[w & (out.window == W2)].tolist()) == {1}
    assert sorted(out.slots[w & (out.window == START)].tolist()) == list(range(1, C + 1))
    assert sorted(out.slots[w & (out.window == W2)].tolist()) == list(range(1, C + 1))
    first_new = [i for i, r in enumerate(recs) if r.ts == W2][0]
    assert recs[first_new].window == W2 and recs[first_new].trigger == 1
    assert int(out.trigger[out.users == PSEUDO.users(["x"])[0]][0]) == 4
    assert pipe.stats.dropped["contribution_bound"] == 2
    # late: arriving exactly at the fire time of its trigger (lateness 0) is dropped, 1 ms before is not
    late, ok = Rec("y", "k", START + 10), Rec("z", "k", START + 20)
    batch = WriteBatch()
    res = pipe.bound(columns([late, ok]), np.array([START + INTERVAL, START + INTERVAL - 1]), batch)
    assert res.users.tolist() == PSEUDO.users(["z"]).tolist()
    assert pipe.stats.dropped["late"] == 1
    pipe.accumulate(res, 2, batch)
    store.write(batch)
    # what stage 2 merges (reading a bucket changes nothing): one C per window for user w
    old_batch = pipe._take_pending(START, T, WriteBatch())
    new_batch = pipe._take_pending(W2, 1, WriteBatch())
    assert (old_batch.users == user_w).sum() == C and (new_batch.users == user_w).sum() == C
    kid = PSEUDO.group_keys(["k"])
    pipe.fire(W2, 1)
    rows, _ = pipe._load_keys(W2, kid, {int(kid[0]): "k"})
    assert int(rows["count"][0]) == 1 and int(rows["released"][0] + rows["buffer"][0]) == C
    for t in range(1, T):
        pipe.fire(START, t)
    rows, _ = pipe._load_keys(START, kid, {int(kid[0]): "k"})
    assert int(rows["count"][0]) == 2 and int(rows["released"][0] + rows["buffer"][0]) == 2  # z (trigger 1), x (trigger 4)
