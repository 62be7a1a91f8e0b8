"""Config validation names the field; `dpstream plan` reports every term, with no secret."""
import json
import math
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from dpstream.accountant.counters import BLT
from dpstream.processor.cli import main
from dpstream.processor.config import ConfigError, load_config, plan_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "queries.yaml"

PAPER = """
queries:
  - name: url_clicks
    input_topic: events
    output_topic: dp-histograms
    user_field: user_id
    key_fields: [key]
    value_field: null
    aggregate: count
    clamp: 1.0
    contribution_bound: 32
    window: 1d
    triggers: {T}
    key_threshold: 0
    epsilon: 6.0
    delta: 1.0e-9
    beta: null
"""


def write(tmp_path, text, name="q.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_config_loads():
    config = load_config(EXAMPLE, environ={})
    assert [q.name for q in config.queries] == ["url_clicks", "url_clicks_fine", "basket_value", "visits_by_place"]
    assert config.queries[0].window_ms == 86_400_000


@pytest.mark.parametrize(
    "patch, field",
    [
        ("epsilon: -1", "queries[0].epsilon"),
        ("delta: 1.5", "queries[0].delta"),
        ("epsilonn: 1", "queries[0].epsilonn"),
        ("aggregate: median", "queries[0].aggregate"),
        ("aggregate: sum", "queries[0].value_field"),
        ("window: 1 fortnight", "queries[0].window"),
        ("triggers: 7", "queries[0].triggers"),
        ("contribution_bound: 0", "queries[0].contribution_bound"),
        ("beta: 0.5", "queries[0].beta"),
        ("key_threshold: -2", "queries[0].key_threshold"),
        ("epsilon: .nan", "queries[0].epsilon"),
        ("composition: advanced", "queries[0].composition"),
    ],
)
def test_bad_config_fails_naming_the_field(tmp_path, patch, field):
    text = "queries:\n  - name: q\n    epsilon: 1.0\n    delta: 1.0e-6\n    window: 1d\n    triggers: 100\n"
    key = patch.split(":")[0]
    lines = [line for line in text.splitlines() if not line.strip().startswith(key + ":")]
    path = write(tmp_path, "\n".join(lines) + f"\n    {patch}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert field in str(info.value)


def test_duplicate_names_missing_file_and_bad_yaml(tmp_path):
    dup = write(tmp_path, "queries:\n  - {name: a, epsilon: 1, delta: 1.0e-6}\n  - {name: a, epsilon: 1, delta: 1.0e-6}\n")
    with pytest.raises(ConfigError, match="duplicate query name"):
        load_config(dup, environ={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml", environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "queries: [\n"), environ={})
    with pytest.raises(ConfigError, match="queries"):
        load_config(write(tmp_path, "queries: []\n"), environ={})


def test_environment_overrides(tmp_path):
    path = write(tmp_path, PAPER.format(T=100))
    config = load_config(path, environ={"DPSTREAM_QUERY_URL_CLICKS_EPSILON": "3", "DPSTREAM_QUERY_URL_CLICKS_TRIGGERS": "96"})
    assert config.queries[0].epsilon == 3.0 and config.queries[0].triggers == 96
    with pytest.raises(ConfigError, match="DPSTREAM_QUERY_URL_CLICKS_EPSLON"):
        load_config(path, environ={"DPSTREAM_QUERY_URL_CLICKS_EPSLON": "3"})


@pytest.mark.parametrize("T", [100, 1000])
def test_plan_json_has_every_term(tmp_path, capsys, monkeypatch, T):
    monkeypatch.delenv("DPSTREAM_NOISE_KEY", raising=False)
    monkeypatch.delenv("DPSTREAM_NOISE_KEY_FILE", raising=False)
    path = write(tmp_path, PAPER.format(T=T))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (entry,) = out["queries"]
    for field in [
        "name", "epsilon", "delta", "epsilon_key_selection", "delta_key_selection", "epsilon_perturbation",
        "delta_perturbation", "beta", "tree_height", "sigma_key_selection", "sigma_perturbation", "thresholds",
        "expected_stddev",
    ]:
        assert field in entry, field
    assert entry["name"] == "url_clicks"
    assert len(entry["thresholds"]) == T and all(t > 0 for t in entry["thresholds"])
    # the default counter is the BLT: its squared sensitivity replaces the tree's height
    assert entry["counter"] == "blt" and entry["tree_height"] == 0 and entry["composition"] == "gdp"
    assert entry["counter_sensitivity_sq"] == pytest.approx(BLT.sensitivity_sq(T))
    assert entry["epsilon_spent"] <= 6.0 * (1 + 1e-9) and entry["delta_spent"] <= 1e-9 * (1 + 1e-9)
    # and the paper's tree, asked for by name
    path = write(tmp_path, PAPER.format(T=T) + "    counter: tree\n")
    assert main(["plan", "--config", str(path), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["queries"]
    assert entry["tree_height"] == int(math.floor(math.log2(T))) + 1 and entry.get("counter") is None


def test_plan_text_and_bad_config_exit_code(tmp_path, capsys):
    assert main(["plan", "--config", str(EXAMPLE)]) == 0
    text = capsys.readouterr().out
    assert "query url_clicks:" in text and "tau_1" in text and "expected stddev" in text
    bad = write(tmp_path, "queries:\n  - {name: a, epsilon: 0, delta: 1.0e-6}\n")
    assert main(["plan", "--config", str(bad)]) == 2
    assert "queries[0].epsilon" in capsys.readouterr().err


def test_console_script_runs_without_a_secret(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "dpstream.processor.cli", "plan", "--config", str(EXAMPLE), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["queries"]) == 4


@pytest.mark.parametrize("args, env, field", [
    (["--fetch-records", "0"], {}, "--fetch-records"),
    ([], {"DPSTREAM_FETCH_RECORDS": "many"}, "DPSTREAM_FETCH_RECORDS"),
])
def test_worker_refuses_a_bad_fetch_size_at_start_naming_it(tmp_path, capsys, monkeypatch, args, env, field):
    key = tmp_path / "noise.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["worker", "--config", str(EXAMPLE), "--noise-key-file", str(key), "--state-dir", str(tmp_path / "s"), *args])
    assert code == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before anything is opened


@pytest.mark.parametrize("limit, shadow, field", [
    ("{max_epsilon: 24}", "false", "budget.default.max_delta"),  # max_delta left at its default, 0
    ("{max_epsilon: 5, max_delta: 1.0e-6}", "false", "budget.default.max_epsilon"),
    ("{max_epsilon: 5, max_delta: 1.0e-6}", "true", None),  # shadow mode never refuses: allowed
    ("{max_epsilon: 6, max_delta: 1.0e-9}", "false", None),  # exactly one window: allowed
])
def test_a_budget_below_one_window_is_refused_at_load_naming_the_field(tmp_path, limit, shadow, field):
    """A cap smaller than one window's charge would refuse every window forever (issue 16): the
    config is refused at start, naming the cap, instead of a worker that silently releases nothing."""
    path = write(tmp_path, "queries:\n  - name: q\n    epsilon: 6\n    delta: 1.0e-9\n"
                           f"budget:\n  shadow: {shadow}\n  default: {limit}\n")
    if field is None:
        load_config(path)
    else:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(path)


def query_with(tmp_path, extra: str, epsilon="6", delta="1.0e-9"):
    return write(tmp_path, f"queries:\n  - name: q\n    epsilon: {epsilon}\n    delta: {delta}\n{extra}")


@pytest.mark.parametrize("epsilon", ["60", "1000", "1.0e+300"])
def test_a_too_large_epsilon_is_a_config_error_naming_epsilon_with_the_largest_that_works(tmp_path, epsilon):
    """The sampler's delta term grows as e^epsilon (docs/privacy.md, "Sampler"): from about 40 at
    delta 1e-9 it leaves no delta. The error blames epsilon, which the user set, not the beta the
    user never set, and no epsilon overflows into a traceback; the largest epsilon it names works."""
    done = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "plan", "--config",
                           str(query_with(tmp_path, "", epsilon=epsilon))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "queries[0].epsilon:" in done.stderr and "beta" not in done.stderr
    below = float(re.search(r"set epsilon below ([0-9.]+)", done.stderr).group(1))
    assert 38 < below < 41  # delta 1e-9, C 32, T 100, the blt: the ceiling is 39.47
    config = load_config(query_with(tmp_path, "", epsilon=str(below)), environ={})
    assert plan_for(config.queries[0]).delta_spent <= 1e-9


def test_a_declared_beta_too_large_for_its_epsilon_names_beta_and_the_beta_that_works(tmp_path):
    with pytest.raises(ConfigError, match=r"queries\[0\]\.beta: 1e-12 is too large for epsilon 20") as info:
        load_config(query_with(tmp_path, "    beta: 1.0e-12\n", epsilon="20"), environ={})
    below = float(re.search(r"lower beta below ([0-9.e+-]+)", str(info.value)).group(1))
    config = load_config(query_with(tmp_path, f"    beta: {below * 0.99!r}\n", epsilon="20"), environ={})
    assert plan_for(config.queries[0]).delta_spent <= 1e-9
    load_config(query_with(tmp_path, "    beta: null\n", epsilon="20"), environ={})  # the other way out it names


@pytest.mark.parametrize("section, where, suggestion", [
    ("queries:\n  - {name: q, epsilon: 1, delta: 1.0e-6, epsilom: 1}\n", "queries[0].epsilom", "epsilon"),
    ("queries:\n  - {name: q, epsilon: 1, delta: 1.0e-6, key_feilds: [a]}\n", "queries[0].key_feilds", "key_fields"),
    ("dynamic:\n  - {name: d, start: 0, items: [a], epsilon: 1, tik: 1s}\n", "dynamic[0].tik", "tick"),
    ("querys:\n  - {name: q, epsilon: 1, delta: 1.0e-6}\n", "querys", "queries"),
    ("budget: {shadw: true}\n", "budget.shadw", "shadow"),
    ("budget:\n  default: {max_epsilon: 5, max_delt: 1.0e-6}\n", "budget.default.max_delt", "max_delta"),
    ("budget:\n  principals:\n    q: {max_epsilon: 5, refesh: 1d}\n", "budget.principals.q.refesh", "refresh"),
    ("schema_registry: {url: 'http://registry', use_latest: true}\n", "schema_registry.use_latest", "use_latest_version"),
])
def test_an_unknown_field_at_any_level_suggests_the_field_meant(tmp_path, section, where, suggestion):
    queries = "" if section.startswith(("queries", "dynamic", "querys")) else "queries:\n  - {name: q, epsilon: 1, delta: 1.0e-6}\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, queries + section), environ={})
    assert f"{where}: unknown field (did you mean {suggestion!r}?)" in str(info.value)


def test_an_unknown_field_like_none_gets_no_suggestion_and_an_override_gets_one(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(query_with(tmp_path, "    zzzz: 1\n"), environ={})
    assert str(info.value).endswith("queries[0].zzzz: unknown field")
    with pytest.raises(ConfigError, match=r"DPSTREAM_QUERY_Q_EPSILONN: queries\[0\] has no field 'epsilonn' \(did you mean 'epsilon'\?\)"):
        load_config(query_with(tmp_path, ""), environ={"DPSTREAM_QUERY_Q_EPSILONN": "3"})
