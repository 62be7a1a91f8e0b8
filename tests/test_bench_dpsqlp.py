"""`dpstream bench dpsqlp`: the counter comparison and repeated runs (small workloads)."""
import json

from dpstream.processor.cli import main


def test_counter_comparison_runs_both_counters_on_the_same_data(tmp_path, capsys):
    """--counter tree,blt runs the workload once per counter and reports them side by side; the
    data (records, baselines) are the same, the releases are the counters' own."""
    out = tmp_path / "cmp.json"
    assert main(["bench", "dpsqlp", "--users", "20000", "--keys", "2000", "--triggers", "12", "--processes", "1",
                 "--state", "memory", "--counter", "tree,blt", "--json", str(out), "--plot", str(tmp_path / "cmp.png")]) == 0
    text = capsys.readouterr().out
    assert "counters compared" in text
    report = json.loads(out.read_text())
    tree, blt = report["runs"]["tree"], report["runs"]["blt"]
    assert tree["counter"] == "tree" and blt["counter"] == "blt" and blt["composition"] == "gdp"
    assert tree["records"] == blt["records"] and tree["results"]["Baseline 1"] == blt["results"]["Baseline 1"]
    assert tree["results"]["DP-SQLP"] != blt["results"]["DP-SQLP"]
    assert (tmp_path / "cmp.png").stat().st_size > 0


def test_repeated_runs_with_two_processes_agree(tmp_path, capsys):
    """--runs 2 with stage 1 in its own process: each run starts in a fresh interpreter (a fork
    after RocksDB was used once deadlocked), and both runs release the same values."""
    out = tmp_path / "runs.json"
    assert main(["bench", "dpsqlp", "--users", "20000", "--keys", "2000", "--triggers", "6", "--runs", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["timing"]["pipeline_seconds"]["runs"]) == 2
    assert "median of 2 runs" in capsys.readouterr().out


def test_per_key_bounds_run_side_by_side_on_the_same_data(tmp_path, capsys):
    """--per-key-bounds none,2,4 runs the workload once per bound and reports them side by side:
    the same records and baselines, the accountant's sensitivity sqrt(C c_k) L per row, and each
    bound's drops."""
    out = tmp_path / "pk.json"
    assert main(["bench", "dpsqlp", "--users", "20000", "--keys", "2000", "--triggers", "12", "--processes", "1",
                 "--state", "memory", "--per-key-bounds", "none,2,4", "--json", str(out)]) == 0
    assert "per-key bounds compared" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["per_key_bounds"] == [None, 2, 4] and list(report["rows"]) == ["none", "2", "4"]
    runs = report["runs"]
    assert runs["none"]["records"] == runs["2"]["records"] == runs["4"]["records"]
    assert runs["none"]["results"]["Baseline 1"] == runs["4"]["results"]["Baseline 1"]
    C = runs["none"]["contribution_bound"]
    for name, ck in (("none", C), ("2", 2), ("4", 4)):
        assert report["rows"][name]["perturbation_l2_sensitivity"] == (C * ck) ** 0.5
    assert report["rows"]["none"]["dropped_per_key_bound"] == 0 < report["rows"]["2"]["dropped_per_key_bound"]
    assert report["rows"]["2"]["dropped_per_key_bound"] >= report["rows"]["4"]["dropped_per_key_bound"]
    for bad in (["--per-key-bounds", "2,x"], ["--per-key-bounds", "2,2"], ["--per-key-bounds", "2", "--per-key-bound", "1"]):
        assert main(["bench", "dpsqlp", "--users", "100", "--keys", "10", "--triggers", "2", *bad]) == 2


def test_kernel_sets_release_the_same_values_and_a_numpy_simulation_is_timed_beside_them(tmp_path, capsys):
    """--kernels numba,numpy runs the workload once per kernel set: identical releases (the run
    refuses to report otherwise), both timed; each run also times the same mechanism in plain
    numpy, whose keys and error (another draw of the same noise) are close to the pipeline's."""
    out = tmp_path / "k.json"
    assert main(["bench", "dpsqlp", "--users", "200000", "--keys", "20000", "--triggers", "24", "--processes", "1",
                 "--state", "memory", "--kernels", "numba,numpy", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kernels compared" in text and "releases identical" in text and "pipeline / numpy =" in text
    report = json.loads(out.read_text())
    numba, numpy = report["runs"]["numba"], report["runs"]["numpy"]
    assert numba["kernels"] == "numba" and numpy["kernels"] == "numpy"
    assert numba["results"] == numpy["results"]
    sim, ours = numba["numpy_simulation"], numba["results"]["DP-SQLP"]
    assert sim["seconds"] > 0
    # the same mechanism, another draw: released keys within 15%, l_2 within 20%
    assert abs(sim["keys"] - ours["keys"]) <= 0.15 * ours["keys"]
    assert abs(sim["l2"] - ours["l2"]) <= 0.2 * ours["l2"]
