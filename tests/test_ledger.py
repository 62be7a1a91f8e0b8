"""The budget ledger: refuses overspend, survives restarts, never resets silently, concurrent
charges never overspend, shadow mode; wired to replay (windows) and the CLI."""
import io
import json
import subprocess
import sys
import threading

import pytest

from dpstream.accountant.ledger import (
    BudgetExceeded,
    BudgetLedger,
    BudgetPolicy,
    LedgerEpochError,
)
from dpstream.processor.adapters.replay import ReplayRunner
from dpstream.processor.config import load_config
from dpstream.state.store import MemoryStore, RocksDBStore
from tests.conftest import ROOT, TEST_SECRET

DAY = 86_400_000


def ledger(store, shadow=False, epoch="1", refresh=None, max_eps=10.0):
    return BudgetLedger(store, {"team-a": BudgetPolicy(max_eps, 1e-6, refresh)}, BudgetPolicy(1.0, 0.0), epoch, shadow=shadow)


def test_refuses_overspend_naming_requested_and_remaining():
    led = ledger(MemoryStore())
    for w in range(3):
        assert led.charge("team-a", 3.0, 1e-7, f"q:{w}", 0).charged
    with pytest.raises(BudgetExceeded) as err:
        led.charge("team-a", 3.0, 1e-7, "q:3", 0)
    assert "requested epsilon 3" in str(err.value) and "remaining epsilon 1" in str(err.value)
    e = led.get("team-a", 0)
    assert (e.spent_epsilon, e.charges, e.refusals) == (9.0, 3, 1)
    assert led.charge("team-a", 1.0, 0, "q:4", 0).charged  # exactly the rest is allowed
    assert not led.check("team-a", 1e-9, 0, 0)
    with pytest.raises(BudgetExceeded):  # delta is a budget too
        led.charge("team-a", 0.0, 2e-6, "q:5", 0)


def test_charges_are_idempotent_per_id():
    led = ledger(MemoryStore())
    assert led.charge("team-a", 4.0, 0, "q:1", 0).charged
    again = led.charge("team-a", 4.0, 0, "q:1", 0)
    assert again.duplicate and not again.charged
    assert led.get("team-a", 0).spent_epsilon == 4.0


def test_survives_restart_and_never_resets_silently(tmp_path):
    store = RocksDBStore(tmp_path / "ledger")
    led = ledger(store, refresh=30 * DAY)
    led.charge("team-a", 7.0, 0, "q:1", 1000)
    store.close()
    store = RocksDBStore(tmp_path / "ledger")
    led = ledger(store, refresh=30 * DAY)
    assert led.get("team-a", 2000).spent_epsilon == 7.0  # recovered
    with pytest.raises(BudgetExceeded):
        led.charge("team-a", 7.0, 0, "q:2", 2000)
    # only the configured refresh resets, on its schedule
    assert led.get("team-a", 1000 + 30 * DAY - 1).spent_epsilon == 7.0
    fresh = led.get("team-a", 1000 + 30 * DAY)
    assert fresh.spent_epsilon == 0.0 and fresh.last_reset_ms == 1000 + 30 * DAY
    store.close()
    # another epoch (new secret, lost state) is never mixed with this one
    store = RocksDBStore(tmp_path / "ledger")
    with pytest.raises(LedgerEpochError, match="epoch"):
        ledger(store, epoch="2")
    store.close()


def test_concurrent_charges_never_overspend(tmp_path):
    store = RocksDBStore(tmp_path / "ledger")
    led = ledger(store, max_eps=10.0)
    results = []

    def worker(k):
        for i in range(50):
            try:
                results.append(led.charge("team-a", 0.3, 0, f"t{k}:{i}", 0).charged)
            except BudgetExceeded:
                results.append(False)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = led.get("team-a", 0).spent_epsilon
    assert sum(results) == 33 and spent == pytest.approx(9.9) and spent <= 10.0  # floor(10 / 0.3) charges
    store.close()


def test_shadow_mode_tracks_but_never_refuses():
    led = ledger(MemoryStore(), shadow=True)
    for w in range(5):
        assert led.charge("team-a", 3.0, 0, f"q:{w}", 0).charged
    e = led.get("team-a", 0)
    assert e.spent_epsilon == 15.0 and e.refusals == 2 and e.remaining == (0.0, 1e-6)


CONFIG = """budget:
  principal: tenant
  shadow: {shadow}
  principals:
    acme: {{max_epsilon: 13, max_delta: 1.0e-8}}
queries:
  - name: clicks
    tenant: acme
    window: 1h
    triggers: 4
    allowed_lateness: 0s
    contribution_bound: 4
    epsilon: 6
    delta: 1.0e-9
"""


@pytest.mark.parametrize("shadow", [False, True])
def test_replay_charges_each_window_once_and_drops_refused_windows(tmp_path, shadow):
    cfg = tmp_path / "q.yaml"
    cfg.write_text(CONFIG.format(shadow=str(shadow).lower()))
    events = tmp_path / "e.jsonl"
    events.write_text("".join(json.dumps({"user_id": f"u{i}", "key": "k", "ts": h * 3_600_000 + i * 1000}) + "\n"
                              for h in range(4) for i in range(300)))
    state = tmp_path / "state"
    drops = []
    for _ in range(2):  # a second run over the same state charges nothing again
        # a ledger charges windows on a public schedule: the replay's start and end are given
        runner = ReplayRunner(load_config(cfg), TEST_SECRET, str(state), log=io.StringIO(), start_ms=0)
        try:
            runner.run(str(events), io.StringIO(), until_ms=4 * 3_600_000)
            drops.append(runner.pipelines[0].stats.dropped["budget"])
            entry = runner.ledger.get("acme", 0)
        finally:
            runner.close()
        assert entry.spent_epsilon == pytest.approx(24.0 if shadow else 12.0)
        assert entry.charges == (4 if shadow else 2)
    assert drops == [0 if shadow else 600, 0]  # windows 3 and 4 refused; the resumed run read nothing new
    out = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "budget", "--config", str(cfg), "--state-dir", str(state), "--json"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    shown = json.loads(out.stdout)["principals"][0]
    assert shown["principal"] == "acme" and shown["spent_epsilon"] == pytest.approx(entry.spent_epsilon)
    assert shown["refusals"] == 2


def test_budget_config_names_the_missing_field(tmp_path):
    from dpstream.processor.config import ConfigError

    cfg = tmp_path / "q.yaml"
    cfg.write_text(CONFIG.format(shadow="false").replace("    tenant: acme\n", ""))
    with pytest.raises(ConfigError, match=r"queries\[0\]\.tenant"):
        load_config(cfg)


def _budget_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "budget", *args], cwd=ROOT, capture_output=True,
                          text=True, check=True)


def test_budget_cli_reports_what_the_ledger_recorded_never_what_the_config_claims(tmp_path):
    cfg = tmp_path / "q.yaml"
    cfg.write_text(CONFIG.format(shadow="false"))
    events = tmp_path / "e.jsonl"
    events.write_text("".join(json.dumps({"user_id": f"u{i}", "key": "k", "ts": h * 3_600_000 + i * 1000}) + "\n"
                              for h in range(4) for i in range(300)))
    state = tmp_path / "state"
    runner = ReplayRunner(load_config(cfg), TEST_SECRET, str(state), log=io.StringIO(), start_ms=0)
    try:
        runner.run(str(events), io.StringIO(), until_ms=4 * 3_600_000)
    finally:
        runner.close()
    # the config changes after the run: larger limits and a principal that was never charged
    cfg.write_text(CONFIG.format(shadow="false").replace("max_epsilon: 13", "max_epsilon: 100")
                   .replace("  principals:\n", "  principals:\n    other: {max_epsilon: 50, max_delta: 1.0e-8}\n"))
    for args in (("--state-dir", str(state)), ("--config", str(cfg), "--state-dir", str(state))):
        shown = json.loads(_budget_cli(*args, "--json").stdout)
        assert shown["ledger"] is True and shown["epoch"] == "1"
        assert [p["principal"] for p in shown["principals"]] == ["acme"]  # "other" was never charged
        acme = shown["principals"][0]
        assert acme["max_epsilon"] == 13 and acme["spent_epsilon"] == pytest.approx(12)  # recorded, not the config's 100
        assert acme["remaining_epsilon"] == pytest.approx(1)
        assert (acme["charges"], acme["refusals"]) == (2, 2)
    assert any("now sets max_epsilon 100" in n for n in shown["notes"])
    text = _budget_cli("--config", str(cfg), "--state-dir", str(state)).stdout
    assert "acme" in text and "other" not in text.split("note:")[0] and " 100 " not in text.split("note:")[0]

    # a replay without a budget section leaves no ledger in its state directory: said plainly
    plain = tmp_path / "plain.yaml"
    plain.write_text(CONFIG.format(shadow="false").split("queries:\n")[1].join(["queries:\n", ""]).replace("    tenant: acme\n", ""))
    bare = tmp_path / "bare"
    runner = ReplayRunner(load_config(plain), TEST_SECRET, str(bare), log=io.StringIO())
    try:
        runner.run(str(events), io.StringIO())
    finally:
        runner.close()
    out = _budget_cli("--config", str(plain), "--state-dir", str(bare))
    assert out.stdout.startswith(f"note: no budget ledger in {bare}") and "principal" not in out.stdout
    assert json.loads(_budget_cli("--state-dir", str(bare), "--json").stdout)["ledger"] is False
