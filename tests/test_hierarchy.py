"""Hierarchical queries end to end (docs/privacy.md, "Post-processing: hierarchical consistency"): per-level histograms and budget split,
and the consistency step on the published view, under replay and the worker alike."""
import io
import json
import math
from collections import Counter, defaultdict

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from dpstream.accountant import QueryBudget, plan_levels, plan_query
from dpstream.accountant.plan import BudgetError
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.adapters.worker import DpstreamWorker, Ownership
from dpstream.processor.config import ConfigError, DpstreamConfig, load_config
from dpstream.processor.engine.pipeline import BoundedRecords, level_key_texts
from dpstream.processor.mechanisms.consistency import solve
from dpstream.topics.kafka import DEAD_LETTER_TOPIC
from tests.conftest import TEST_LABEL, TEST_RUN_NONCE, TEST_SECRET, without_run

HOUR = 3_600_000
START = 1_800_000_000_000 - 1_800_000_000_000 % HOUR
FIELDS = ["country", "state", "city"]

QUERY = """queries:
  - name: geo
    key_fields: [country, state, city]
    hierarchy: true
    window: 1h
    triggers: 4
    allowed_lateness: 0s
    contribution_bound: 4
    epsilon: {epsilon}
    delta: 1.0e-6
"""


def synthetic_events(n_users=3000, seed=5):
    """Skewed three-level hierarchy: 3 countries x 4 states x 5 cities, Zipf-like cities."""
    rng = np.random.default_rng(seed)
    cities = [(f"c{a}", f"c{a}s{b}", f"c{a}s{b}t{c}") for a in range(3) for b in range(4) for c in range(5)]
    weights = 1.0 / np.arange(1, len(cities) + 1) ** 1.1
    weights /= weights.sum()
    events = []
    for u in range(n_users):
        for _ in range(int(rng.integers(1, 7))):  # some users exceed C = 4
            country, state, city = cities[int(rng.choice(len(cities), p=weights))]
            events.append({"user_id": f"u{u}", "country": country, "state": state, "city": city,
                           "ts": START + int(rng.integers(0, HOUR))})
    return sorted(events, key=lambda e: e["ts"])  # in time order: nothing is late


def run_replay(tmp_path, epsilon=6, events=None, stop_after=None, state=None, triggers=4):
    cfg = tmp_path / "q.yaml"
    cfg.write_text(QUERY.format(epsilon=epsilon).replace("triggers: 4", f"triggers: {triggers}"))
    path = tmp_path / "events.jsonl"
    if events is not None:
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
    out = io.StringIO()
    runner = ReplayRunner(load_config(cfg), TEST_SECRET, str(state) if state else None, log=io.StringIO(), noise_label=TEST_LABEL)
    try:
        runner.run(str(path), out, stop_after_lines=stop_after)
        stats = runner.pipelines[0].stats
    finally:
        runner.close()
    return [json.loads(line) for line in out.getvalue().splitlines()], stats


def views_after_each_trigger(records):
    """The latest record per key after each trigger's records, as a compacted topic holds them."""
    latest, views = {}, []
    for trigger, group in _by_trigger(records):
        for r in group:
            latest[tuple(r["key"])] = r
        views.append((trigger, dict(latest)))
    return views


def _by_trigger(records):
    out = []
    for r in records:
        if not out or out[-1][0] != r["trigger"]:
            out.append((r["trigger"], []))
        out[-1][1].append(r)
    return out


# ------------------------------------------------------------------ config and accounting


@pytest.mark.parametrize("patch,field", [
    ({"key_fields": ["city"]}, "key_fields"),
    ({"aggregate": "sum", "value_field": "v", "clamp": 2.0}, "hierarchy"),
    ({"hierarchy": False, "level_shares": [0.5, 0.5]}, "level_shares"),
    ({"level_shares": [0.5, 0.5]}, "level_shares"),
    ({"level_shares": [0.5, 0.4, 0.2]}, "level_shares"),
    ({"key_fields": ["a", "a"]}, "key_fields"),
])
def test_bad_hierarchy_config_names_the_field(tmp_path, patch, field):
    q = {"name": "geo", "key_fields": FIELDS, "hierarchy": True, "epsilon": 6, "delta": 1e-6, **patch}
    cfg = tmp_path / "q.yaml"
    cfg.write_text(json.dumps({"queries": [q]}))
    with pytest.raises(ConfigError, match=rf"queries\[0\]\.{field}"):
        load_config(cfg)


@pytest.mark.parametrize("composition", ["zcdp", "basic"])
@pytest.mark.parametrize("shares", [None, (0.2, 0.3, 0.5)])
def test_levels_compose_to_the_declared_budget(composition, shares):
    """Every level's Gaussian mechanisms together meet (eps, delta), checked by dp_accounting's
    RDP accountant; the thresholding term counts C keys per level."""
    budget = QueryBudget(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32, composition=composition, hierarchy_depth=3,
                         level_shares=shares)
    plans = plan_levels(budget)
    assert [p.level for p in plans] == [1, 2, 3] and plan_query(budget) == plans[0]
    C, h = 32, plans[0].tree_height
    for p, s in zip(plans, shares or (1 / 3,) * 3):
        assert p.level_share == pytest.approx(s)
        # each level's parts are calibrated like a flat query's: sensitivity 1 x C rounds, C*L per tree
        assert p.rho_key_selection == pytest.approx(C * h / (2 * p.sigma_key_selection ** 2), rel=1e-12)
        assert p.rho_perturbation == pytest.approx(h * C ** 2 / (2 * p.sigma_perturbation ** 2), rel=1e-12)
        assert (p.epsilon_spent, p.delta_spent) == (plans[0].epsilon_spent, plans[0].delta_spent)
    assert plans[0].delta_spent <= 1e-9 * (1 + 1e-9)
    if composition == "zcdp":
        assert sum(p.rho_key_selection + p.rho_perturbation for p in plans) == pytest.approx(plans[0].rho_total, rel=1e-12)
        assert plans[0].delta_beta == pytest.approx((math.exp(6) + 1) * 3 * C * plans[0].beta, rel=1e-12)
        acc = RdpAccountant()
        for p in plans:
            acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(p.sigma_key_selection), C * h))
            acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(p.sigma_perturbation / C), h))
        assert acc.get_epsilon(plans[0].delta_conversion) <= 6.0 * 1.001
        # an even split gives every level the same noise; the flat query at the same budget has less
        flat = plan_query(QueryBudget(epsilon=6.0, delta=1e-9, triggers=100, contribution_bound=32))
        if shares is None:
            assert plans[0].sigma_perturbation == pytest.approx(plans[2].sigma_perturbation)
            assert plans[0].sigma_perturbation > flat.sigma_perturbation * math.sqrt(3) * 0.99
    else:
        assert plans[0].epsilon_spent == pytest.approx(6.0, rel=1e-12)
        assert sum(p.epsilon_key_selection + p.epsilon_perturbation for p in plans) == pytest.approx(6.0, rel=1e-12)


def test_level_shares_must_match_the_levels():
    with pytest.raises(BudgetError, match="level_shares"):
        plan_levels(QueryBudget(epsilon=1.0, delta=1e-9, triggers=4, contribution_bound=1, hierarchy_depth=2, level_shares=(1.0,)))


def test_plan_shows_the_split_and_the_free_consistency_step(tmp_path, capsys):
    from dpstream.processor.cli import main

    cfg = tmp_path / "q.yaml"
    cfg.write_text(QUERY.format(epsilon=6))
    assert main(["plan", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert "level 1 (country)" in text and "level 3 (country, state, city)" in text
    assert "epsilon 0, delta 0" in text
    assert main(["plan", "--config", str(cfg), "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["queries"][0]
    assert [lv["key_fields"] for lv in entry["levels"]] == [FIELDS[:1], FIELDS[:2], FIELDS]
    assert [lv["level_share"] for lv in entry["levels"]] == pytest.approx([1 / 3] * 3)
    assert entry["consistency"]["epsilon"] == 0.0 and entry["consistency"]["delta"] == 0.0


# ------------------------------------------------------------------ the pipeline


def test_level_keys_are_the_prefixes():
    text = json.dumps(["us", "ga", "atlanta"], separators=(",", ":"))
    assert level_key_texts(text, 3) == ['["us"]', '["us","ga"]', text]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hier")
    events = synthetic_events()
    records, stats = run_replay(tmp, events=events)
    return tmp, events, records, stats


def test_published_view_is_consistent_after_every_trigger(replayed):
    _, _, records, stats = replayed
    assert {r["level"] for r in records} == {1, 2, 3}
    assert stats.consistency_updates > 0, "some earlier releases must have been re-issued"
    views = views_after_each_trigger(records)
    assert len(views) == 4
    for trigger, view in views:
        children = defaultdict(int)
        for key, r in view.items():
            assert r["level"] == len(key)
            assert isinstance(r["consistent_count"], int) and r["consistent_count"] >= 0
            assert r["released_at"] <= r["trigger"] <= trigger
            if len(key) > 1 and key[:-1] in view:
                children[key[:-1]] += r["consistent_count"]
        for key, r in view.items():
            if r["level"] < 3:
                assert isinstance(r["consistent_other"], int) and r["consistent_other"] >= 0
                assert r["consistent_count"] == children[key] + r["consistent_other"], (trigger, key)
            else:
                assert "consistent_other" not in r


def test_consistent_values_are_the_closest_to_the_published_noisy_view(replayed):
    """Rebuilt from the output alone: the forest of released keys (parent = nearest released
    ancestor), latest noisy counts, inverse-variance weights; the published consistent values
    are the solver's optimum on exactly that view."""
    _, _, records, _ = replayed
    for _, view in views_after_each_trigger(records):
        keys = sorted(view, key=lambda k: (len(k), k))
        index = {k: i for i, k in enumerate(keys)}
        parent = np.array([next((index[k[:u]] for u in range(len(k) - 1, 0, -1) if k[:u] in index), -1) for k in keys])
        noisy = np.array([view[k]["count"] for k in keys])
        sd = np.array([view[k]["stddev"] for k in keys])
        # noisy counts at a key's release trigger are exactly what the release said
        assert all(view[k]["count"] == next(r["count"] for r in records if tuple(r["key"]) == k and r["trigger"] == view[k]["released_at"])
                   for k in keys)
        ours = np.array([view[k]["consistent_count"] for k in keys])
        best = solve(parent, noisy, weight=1 / sd ** 2, spread=3 * sd, open=np.ones(len(keys), dtype=bool))
        objective = lambda v: float(np.sum((v - noisy) ** 2 / sd ** 2))
        assert objective(ours) == pytest.approx(objective(best.values), rel=1e-9, abs=1e-9)


def test_releases_are_deterministic_and_resume_exactly(tmp_path, replayed):
    _, events, records, _ = replayed
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    again, _ = run_replay(tmp_path / "a", events=events)
    assert again == records
    state = tmp_path / "b" / "state"
    first, _ = run_replay(tmp_path / "b", events=events, stop_after=len(events) // 2, state=state)
    rest, _ = run_replay(tmp_path / "b", state=state)
    assert first + rest == records


def test_every_level_counts_each_admitted_record_once(tmp_path):
    """One trigger, so every key's release covers all its data. Each user's first C records go to
    one key of every level: released counts are within 5 standard deviations (the plan's stddev
    of the discrete Gaussian prefix noise; two-sided ~6e-7 per key) of those bounded counts,
    where counting all records, or splitting C across levels, would be off by hundreds."""
    events = synthetic_events(n_users=600, seed=9)
    records, stats = run_replay(tmp_path, epsilon=40, events=events, triggers=1)
    admitted, truth = Counter(), Counter()
    for e in events:  # the file order is the arrival order
        admitted[e["user_id"]] += 1
        if admitted[e["user_id"]] <= 4:
            for level in range(1, 4):
                truth[tuple(e[f] for f in FIELDS[:level])] += 1
    assert stats.dropped["contribution_bound"] == sum(max(0, n - 4) for n in admitted.values()) > 0
    final = views_after_each_trigger(records)[-1][1]
    assert set(final) <= set(truth) and {k for k, n in truth.items() if n >= 30} <= set(final)
    assert max(truth[k] for k in final if len(k) == 1) > 500
    for key, r in final.items():
        assert abs(r["count"] - truth[key]) <= 5 * r["stddev"], key


# ------------------------------------------------------------------ the worker


def test_worker_routes_a_whole_subtree_to_one_partition_and_releases_what_replay_does(tmp_path, replayed):
    _, events, records, _ = replayed
    cfg = load_config_text(tmp_path, QUERY.format(epsilon=6).replace("name: geo", "name: geo\n    input_topic: in"))
    worker = DpstreamWorker(cfg, TEST_SECRET, tmp_path / "w", Ownership(), {"in": 1}, 4, run_nonce=TEST_RUN_NONCE)
    assert worker.noise.label == TEST_LABEL  # the label the replay ran under
    from tests.test_worker_service import Record

    batch = [Record(i, e["user_id"].encode(), json.dumps(e).encode(), e["ts"]) for i, e in enumerate(events)]  # sent on time
    out = worker.process_input("in", 0, batch)
    out.commit()
    partition_of, levels = {}, set()
    offsets = Counter()
    for m in out.messages:
        assert m.topic != DEAD_LETTER_TOPIC
        b = BoundedRecords.decode(m.value)
        levels.update(b.levels.tolist())
        for root in set(b.roots.tolist()):
            assert partition_of.setdefault(root, m.partition) == m.partition  # every level of a root together
        worker.process_repartitioned(m.topic, m.partition, [Record(offsets[m.partition], None, m.value, 0)]).commit()
        offsets[m.partition] += 1
    assert levels == {1, 2, 3} and len(partition_of) == 3
    from tests.test_worker_service import fire

    fired = fire(worker, START + 10 * HOUR)
    got = sorted(json.dumps(r, sort_keys=True) for f in fired for r in f.releases)
    worker.close()
    assert got == sorted(json.dumps(without_run(r), sort_keys=True) for r in records)


def load_config_text(tmp_path, text) -> DpstreamConfig:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return load_config(path)


def test_bench_hierarchy_runs_and_its_consistent_views_never_violate():
    from dpstream.processor.bench.hierarchy import run_hierarchy_bench

    result = run_hierarchy_bench(countries=3, users=3000, triggers=4, epsilons=(6.0,), repeats=1, out=io.StringIO())
    run = result["epsilons"][0]["runs"][0]
    # raw releases are integers now (exact arithmetic), so they violate only where a released
    # parent is below its released children; the consistent view never does
    assert run["violations"]["consistent"] == 0 and run["violations"]["raw"] >= 0
    assert [lv["level"] for lv in run["per_level"]] == [1, 2, 3] and run["per_level"][0]["released"] > 0


def test_state_of_another_layout_version_is_refused(tmp_path):
    """Key rows gained a hierarchy's level and root: state written by the previous layout must
    not be read as this one."""
    from dpstream.processor.engine.pipeline import check_noise_epoch
    from dpstream.processor.mechanisms.noise import NodeNoise
    from dpstream.state import keys as sk
    from dpstream.state.store import MemoryStore, WriteBatch

    noise = NodeNoise(TEST_SECRET)
    fresh = MemoryStore()
    check_noise_epoch(fresh, noise)
    check_noise_epoch(fresh, noise)  # its own state: fine
    old = MemoryStore()
    batch = WriteBatch()
    batch.put(sk.META + b"noise-epoch", noise.fingerprint.encode())  # a store of format 1 had no format key
    old.write(batch)
    with pytest.raises(RuntimeError, match="state format 1"):
        check_noise_epoch(old, noise)
