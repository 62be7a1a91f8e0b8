"""Public keys (issue 34, item 1): a declared key domain, released at every trigger without key
selection, the whole budget in perturbation (docs/privacy.md, "Public keys").

Attacked as the other levers are: the accountant against dp_accounting (small parameters too),
the worst neighbour (one user removed moves each trigger's released counts by at most C in L1,
and nothing else: the same keys at the same triggers, the same noise), records of undeclared
keys never spending a user's slots, and the released set never depending on data (an empty
window releases every declared key too).
"""
import dataclasses
import io
import json
import math
import tempfile
from collections import defaultdict
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpstream.accountant import pins
from dpstream.accountant.calibration import cks_epsilon
from dpstream.accountant.plan import BudgetError, QueryBudget, plan_levels, plan_query
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import ConfigError, DpstreamConfig, QueryConfig, config_from_mapping, load_config
from dpstream.processor.engine.pipeline import level_key_texts
from dpstream.processor.engine.public_keys import PublicKeyDomain
from dpstream.processor.mechanisms.noise import Pseudonymizer
from tests.conftest import TEST_LABEL, TEST_SECRET

HOUR = 3_600_000
START = 1_795_132_800_000  # a UTC midnight
BUDGET = {"start": START, "default": {"max_epsilon": 10_000, "max_delta": 1e-3}}


# --------------------------------------------------------------------------- the accountant

def budget(**overrides) -> QueryBudget:
    fields = dict(epsilon=1.0, delta=1e-9, triggers=100, contribution_bound=8, public_keys=True)
    fields.update(overrides)
    return QueryBudget(**fields)


@pytest.mark.parametrize("composition", ["zcdp", "gdp", "basic"])
@pytest.mark.parametrize("counter", ["binary_tree", "blt"])
def test_public_keys_spend_the_whole_budget_on_perturbation(composition, counter):
    public = plan_query(budget(composition=composition, counter=counter))
    selected = plan_query(budget(composition=composition, counter=counter, public_keys=False))
    assert public.public_keys is True and selected.public_keys is None
    assert public.rho_key_selection == 0 and public.sigma_key_selection == 0 and public.delta_beta == 0 and public.beta == 0
    assert set(public.thresholds) == {0.0} and public.epsilon_key_selection == 0 and public.delta_key_selection == 0
    assert public.rho_perturbation == pytest.approx(public.rho_total, rel=1e-12)
    assert public.epsilon_spent <= public.epsilon * (1 + 1e-9) and public.delta_spent <= public.delta * (1 + 1e-9)
    # the selection's share (half of rho, or half of epsilon with basic) and its beta term go to
    # perturbation: the noise is about 1/sqrt(2) (zcdp, gdp) or 1/2 (basic) of key selection's
    ratio = public.sigma_perturbation / selected.sigma_perturbation
    assert (0.45 < ratio < 0.52) if composition == "basic" else (0.65 < ratio < 0.71)


@pytest.mark.parametrize("eps,delta,C,T", [(1.0, 1e-9, 8, 100), (6.0, 1e-9, 32, 100), (0.1, 1e-6, 1, 1),
                                           (0.5, 1e-5, 2, 3), (3.0, 1e-10, 4, 1000)])
def test_public_key_plans_meet_the_budget_by_dp_accounting(eps, delta, C, T):
    """Perturbation alone: one Gaussian per read level of the tree with sensitivity C (a count),
    h levels. dp_accounting's PLD of those Gaussians stays within (eps, delta_conversion); and 3%
    less noise would not (the budget is used, not wasted). Small parameters included."""
    for composition in ("zcdp", "gdp"):
        plan = plan_query(budget(epsilon=eps, delta=delta, contribution_bound=C, triggers=T, composition=composition,
                                 counter="binary_tree"))
        h = plan.tree_height
        assert plan.rho_total == pytest.approx(h * C ** 2 / (2 * plan.sigma_perturbation ** 2), rel=1e-9)
        pld = PLDAccountant()
        pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.sigma_perturbation / C), h))
        assert pld.get_epsilon(plan.delta_conversion) <= eps * (1 + 1e-3)
        if composition == "zcdp":
            assert plan.delta_conversion == pytest.approx(delta - plan.delta_sampler, rel=1e-12)  # no beta term
            assert cks_epsilon(plan.rho_total / 0.97 ** 2, plan.delta_conversion) > eps
    basic = plan_query(budget(epsilon=eps, delta=delta, contribution_bound=C, triggers=T, composition="basic", counter="binary_tree"))
    assert basic.epsilon_perturbation == eps and basic.delta_perturbation == delta and basic.epsilon_spent == pytest.approx(eps)


def test_public_keys_refuse_key_selection_settings_naming_them():
    with pytest.raises(BudgetError) as err:
        plan_query(budget(per_key_bound=1, selection_weights=(2, 1)))
    assert err.value.field == "selection_weights"
    with pytest.raises(BudgetError) as err:
        plan_query(budget(key_threshold=5.0))
    assert err.value.field == "key_threshold"


def test_a_public_hierarchy_splits_perturbation_over_its_levels():
    levels = plan_levels(budget(hierarchy_depth=3, counter="binary_tree"))
    assert len(levels) == 3 and all(p.sigma_key_selection == 0 and p.public_keys for p in levels)
    assert sum(p.rho_perturbation for p in levels) == pytest.approx(levels[0].rho_total, rel=1e-12)


# --------------------------------------------------------------------------- the config

def query(**overrides) -> dict:
    """A query of 6 triggers an hour, with an hour of lateness: replay's event-time clock, which
    one user can move from one other user's time to the next (docs/privacy.md, "Time"), never
    makes a record of these time-ordered streams late, so a neighbour differs by its records only."""
    fields = dict(name="clicks", window="1h", triggers=6, contribution_bound=2, epsilon=4.0, delta=1e-9, allowed_lateness="1h",
                  public_keys=["a", "b", "c"])
    fields.update(overrides)
    return fields


def test_a_key_list_in_the_config_or_in_a_file_is_the_same_domain(tmp_path):
    (tmp_path / "keys.txt").write_text("a\nb\n\nc\n")
    (tmp_path / "q.yaml").write_text("queries:\n  - {name: clicks, epsilon: 4.0, delta: 1.0e-9, public_keys_file: keys.txt}\n"
                                     "budget: {default: {max_epsilon: 100, max_delta: 1.0e-6}}\n")
    from_file = load_config(tmp_path / "q.yaml").queries[0]  # relative to the config's folder
    inline = QueryConfig(**query())
    assert from_file.public_key_texts == inline.public_key_texts == ("a", "b", "c")
    assert from_file.window_pins()["public_keys"] == inline.window_pins()["public_keys"]
    # several key fields: lists, and JSON lists in a file; integers read as stage 1 reads them
    two = QueryConfig(**query(key_fields=["country", "city"], public_keys=[["fr", "paris"], ["us", 7]]))
    assert two.public_key_texts == ('["fr","paris"]', '["us","7"]')
    (tmp_path / "two.txt").write_text('["fr", "paris"]\n["us", 7]\n')
    assert QueryConfig(**query(key_fields=["country", "city"], public_keys=None,
                               public_keys_file=str(tmp_path / "two.txt"))).public_key_texts == two.public_key_texts


@pytest.mark.parametrize("fields,named", [
    (dict(public_keys=["a", "a"]), "public_keys[1]: 'a' is declared twice"),
    (dict(public_keys=[]), "public_keys: declares no key"),
    (dict(public_keys=["a", None]), "public_keys"),
    (dict(public_keys=[["a", "b"]]), "public_keys[0]: a key of 1 key fields"),
    (dict(key_fields=["x", "y"], public_keys=["a"]), "public_keys[0]: a key of 2 key fields"),
    (dict(public_keys_file="missing.txt"), "public_keys_file"),
    (dict(public_keys=None, public_keys_file="missing.txt"), "public_keys_file: missing.txt"),
    (dict(selection_weights=[2, 1], per_key_bound=1), "selection_weights"),
])
def test_a_bad_key_domain_fails_at_start_naming_the_field(fields, named):
    with pytest.raises(ConfigError) as err:
        config_from_mapping({"queries": [query(**fields)], "budget": BUDGET})
    assert named in str(err.value)


def test_public_keys_need_the_public_window_schedule_of_a_budget():
    """Every declared key is released in every open window: a window opened by its first record
    would say, by its releases, that someone wrote to it."""
    with pytest.raises(ConfigError) as err:
        config_from_mapping({"queries": [query()]})
    assert "queries[0].public_keys: public keys need a budget section" in str(err.value)


def test_a_window_is_pinned_to_its_key_domain():
    opened = QueryConfig(**query()).window_pins()
    now = QueryConfig(**query(public_keys=["a", "b", "d"])).window_pins()
    [change] = pins.changes(opened, now)
    assert change.setting == "public_keys"
    assert "public_keys" not in pins.changes(opened, QueryConfig(**query(public_keys=["a", "b", "c"])).window_pins())


# --------------------------------------------------------------------------- releases

def run(config: DpstreamConfig, events: list[dict], until: int, start: int | None = None):
    """Replay ``events`` (the product's replay path) from ``start`` (the clock's public start,
    if given) to ``until``; (releases, pipeline stats)."""
    runner = ReplayRunner(config, TEST_SECRET, None, log=io.StringIO(), noise_label=TEST_LABEL, start_ms=start)
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "events.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        try:
            runner.run(str(path), out, until_ms=until)
            stats = runner.pipelines[0].stats
        finally:
            runner.close()
    return [json.loads(line) for line in out.getvalue().splitlines()], stats


def config_of(**overrides) -> DpstreamConfig:
    return config_from_mapping({"queries": [query(**overrides)], "budget": BUDGET})


def released(releases: list[dict]) -> dict:
    """(window, trigger) -> {key: count}."""
    out = defaultdict(dict)
    for r in releases:
        out[(r["window_start"], r["trigger"])][r["key"]] = r["count"]
    return dict(out)


def events_of(rows) -> list[dict]:
    return [{"user_id": f"u{u}", "key": k, "ts": START + t} for u, k, t in sorted(rows, key=lambda r: r[2])]


def test_every_declared_key_is_released_at_every_trigger_and_no_other():
    """Keys with records, a key without any, an undeclared key, and an hour with no records at
    all: the released set is the schedule times the domain, whatever the data."""
    rng = np.random.default_rng(5)
    rows = [(int(rng.integers(200)), str(rng.choice(["a", "b", "x"])), int(rng.integers(HOUR))) for _ in range(2000)]
    releases, stats = run(config_of(), events_of(rows), until=START + 3 * HOUR)
    got = released(releases)
    assert sorted(got) == [(w, t) for w in (START, START + HOUR) for t in range(1, 7)]  # the empty hour too
    assert all(set(counts) == {"a", "b", "c"} for counts in got.values())
    assert stats.dropped["not_public_key"] == sum(1 for r in rows if r[1] == "x")
    assert all(r["stddev"] > 0 and r["ci95_low"] <= r["count"] <= r["ci95_high"] for r in releases)


def test_records_of_undeclared_keys_never_spend_a_users_slots():
    """C = 1: a user's first record is for an undeclared key, the second for a declared one. The
    declared one is the user's one contribution (the filter runs before bounding)."""
    rows = [(u, "x", 10 * u) for u in range(300)] + [(u, "a", 10 * u + 5) for u in range(300)]
    cfg = config_of(contribution_bound=1, epsilon=20.0)
    with_x, stats = run(cfg, events_of(rows), until=START + 2 * HOUR)
    without_x, _ = run(cfg, events_of([r for r in rows if r[1] != "x"]), until=START + 2 * HOUR)
    assert with_x == without_x and stats.dropped["not_public_key"] == 300 and stats.dropped["contribution_bound"] == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_removing_a_user_moves_each_triggers_counts_by_at_most_c_and_nothing_else(data):
    """The worst neighbour, any stream: with the same noise, the two runs release the same keys
    at the same triggers, and at every trigger the released counts differ by at most C in L1
    over the keys (the noise is the same; only the user's bounded records differ)."""
    C = data.draw(st.integers(1, 3), label="C")
    keys = ["a", "b", "c", "d", "x"]
    rows = data.draw(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(keys), st.integers(0, HOUR - 1)), min_size=1, max_size=40))
    victim = data.draw(st.sampled_from(sorted({u for u, _, _ in rows})), label="victim")
    cfg = config_of(contribution_bound=C, public_keys=keys[:4])
    full, _ = run(cfg, events_of(rows), until=START + 2 * HOUR)
    rest, _ = run(cfg, events_of([r for r in rows if r[0] != victim]), until=START + 2 * HOUR)
    a, b = released(full), released(rest)
    assert a.keys() == b.keys() and all(a[t].keys() == b[t].keys() for t in a)
    for t in a:
        moved = sum(abs(a[t][k] - b[t][k]) for k in a[t])
        assert moved <= C
    assert [(r["key"], r["trigger"], r["stddev"], r["ci95_high"] - r["count"]) for r in full] == \
           [(r["key"], r["trigger"], r["stddev"], r["ci95_high"] - r["count"]) for r in rest]


@pytest.mark.statistical
def test_a_key_without_records_carries_noise_of_the_plans_stddev():
    """2,000 declared keys, no record for any: each release at the last trigger is pure noise,
    whose sample standard deviation matches the plan's expected stddev. Tolerance: the relative
    standard error of a sample stddev of n = 2,000 normal-like draws is 1/sqrt(2n) = 1.6%; 5 of
    them is 8%."""
    keys = [f"k{j}" for j in range(2000)]
    cfg = config_of(public_keys=keys, triggers=6)
    releases, _ = run(cfg, [{"user_id": "u0", "key": "k0", "ts": START}], until=START + 2 * HOUR)
    last = np.array([r["count"] for r in releases if r["trigger"] == 6 and r["key"] != "k0"], dtype=float)
    expected = plan_levels(cfg.queries[0].budget())[0].expected_stddev
    assert len(last) == 1999 and abs(last.mean()) < 5 * expected / math.sqrt(len(last))
    assert abs(last.std() / expected - 1) < 0.08


def test_a_public_hierarchy_releases_every_level_of_the_domain_consistently():
    keys = [["fr", "paris"], ["fr", "lyon"], ["us", "nyc"]]
    cfg = config_of(key_fields=["country", "city"], hierarchy=True, public_keys=keys, epsilon=8.0)
    rows = [(u, k, 1000 * u) for u in range(400) for k in [["fr", "paris"], ["us", "nyc"], ["de", "berlin"]][u % 3:u % 3 + 1]]
    events = [{"user_id": f"u{u}", "country": k[0], "city": k[1], "ts": START + t} for u, k, t in rows]
    releases, stats = run(cfg, events, until=START + 2 * HOUR)
    last = {json.dumps(r["key"], separators=(",", ":")): r for r in releases if r["trigger"] == 6}
    assert set(last) == {'["fr"]', '["us"]', '["fr","paris"]', '["fr","lyon"]', '["us","nyc"]'}
    assert stats.dropped["not_public_key"] == sum(1 for _, k, _ in rows if k[0] == "de")
    # a public domain closes every parent: it is the sum of its declared children, no remainder
    value = {k: r["consistent_count"] for k, r in last.items()}
    assert value['["fr"]'] == value['["fr","paris"]'] + value['["fr","lyon"]'] and value['["us"]'] == value['["us","nyc"]']
    assert last['["fr"]']["consistent_other"] == last['["us"]']["consistent_other"] == 0


def test_stage_two_partitions_share_the_domain_without_overlap():
    """A worker's stage 2 on partition p of P releases the declared keys whose root stage 1
    routes to p (root % P): the shares are disjoint and cover every level's keys."""
    pseudo = Pseudonymizer(TEST_SECRET)
    texts = [json.dumps([c, f"{c}{j}"], separators=(",", ":")) for c in ("a", "b", "c", "d") for j in range(5)]
    domain = PublicKeyDomain.build(texts, 2, level_key_texts, pseudo.group_keys)
    assert len(domain) == 4 + 20
    shares = [domain.share(p, 3) for p in range(3)]
    assert sorted(i for s in shares for i in s.ids.tolist()) == sorted(domain.ids.tolist())
    for p, s in enumerate(shares):
        assert all(int(r) % 3 == p for r in s.roots.tolist())
        assert set(s.finest_ids.tolist()) <= set(s.ids.tolist())
    # a record is admitted by its id and its text both
    ids = pseudo.group_keys([texts[0], '["zz","zz0"]'])
    assert domain.admits(ids, np.array([texts[0], '["zz","zz0"]'], dtype=object)).tolist() == [True, False]
    assert domain.admits(ids[:1], np.array(["other text"], dtype=object)).tolist() == [False]


def test_a_plan_with_public_keys_says_so(capsys):
    from dpstream.processor.cli import _human_plan

    cfg = config_of(public_keys=["a", "b"])
    text = _human_plan(cfg.queries[0], plan_levels(cfg.queries[0].budget())[0])
    assert "key selection      none: public keys, 2 declared" in text and "thresholds" not in text


def test_the_budget_reallocation_changes_the_fingerprint_only_with_public_keys():
    plain = plan_query(dataclasses.replace(budget(), public_keys=False))
    assert "public_keys" not in {k for k, v in plain.to_dict().items() if v is not None}


def test_the_user_guides_public_keys_config_loads_and_releases_its_plans():
    """docs/user-guide.md, "Public keys": its config block as written loads, plans no key
    selection, and a replay of it releases exactly the four plans at every trigger."""
    import yaml

    from tests.test_docs_blocks import ROOT, blocks

    block = next(b for b in blocks(ROOT / "docs" / "user-guide.md") if "public-keys-config" in b.marker)
    cfg = config_from_mapping(yaml.safe_load(block.text))
    q = cfg.queries[0]
    assert q.public_key_texts == ("free", "pro", "team", "enterprise") and plan_query(q.budget()).sigma_key_selection == 0
    day = 86_400_000
    start = cfg.budget.start_ms + 300 * day
    events = [{"user_id": f"u{u}", "plan": ["free", "pro", "other"][u % 3], "ts": start + 1000 * u} for u in range(300)]
    releases, _ = run(cfg, events, until=start + day + 120_000, start=start)
    assert {(r["trigger"], r["key"]) for r in releases} == {(t, k) for t in range(1, 101) for k in q.public_key_texts}


def test_plan_sample_previews_a_public_key_query(tmp_path):
    """`plan --sample`: the preview runs the product's replay path on the sample, so it releases
    the declared keys at every trigger and counts the other keys' records as not_public_key."""
    import dpstream

    rng = np.random.default_rng(3)
    rows = sorted((int(rng.integers(300)), str(rng.choice(["a", "b", "x"])), int(rng.integers(HOUR))) for _ in range(1500))
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps(e) + "\n" for e in events_of(sorted(rows, key=lambda r: r[2]))))
    report = dpstream.preview({"queries": [query()], "budget": BUDGET}, sample)
    [q] = report["queries"]
    assert q["public_keys"] and q["keys_released_per_trigger"]["series"] == [3] * 6
    assert q["dropped"]["not_public_key"] == sum(1 for r in rows if r[1] == "x")


def test_a_worker_builds_its_noise_tables_for_a_public_key_query():
    """The worker builds every sampler table a query's triggers use before its first trigger; a
    public-key query has no key selection to build one for (its zero sigma once stopped the
    worker: OverflowError in the lattice scale), and asking for one is a clear error."""
    from dpstream.processor.engine.pipeline import prepare_noise_tables
    from dpstream.processor.mechanisms.key_selection import KeySelector
    from dpstream.processor.mechanisms.noise import NodeNoise

    cfg = config_of()
    prepare_noise_tables(cfg.queries[0], NodeNoise(TEST_SECRET))
    with pytest.raises(ValueError, match="public keys has no key selection"):
        KeySelector(plan_query(cfg.queries[0].budget()), NodeNoise(TEST_SECRET), "clicks", 0)
