"""Packaging (issue 16, item 6): one top-level package, ``dpstream``, with the design card's
folders mapped under it; ``--version``, LICENSE and CHANGELOG agree with it; the notebook API
(``dpstream.replay``) publishes what the CLI publishes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

import dpstream
from tests.conftest import ROOT, TEST_SECRET_HEX


def test_version_is_one_number_everywhere():
    done = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"dpstream {dpstream.__version__}"
    assert f"## {dpstream.__version__}" in (ROOT / "CHANGELOG.md").read_text()
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}


@pytest.mark.slow
def test_the_wheel_holds_only_the_dpstream_package_and_it_imports_on_its_own(tmp_path):
    """Built as CI's pip builds it (isolated, setuptools from PyPI), then imported from the
    unpacked wheel with the checkout out of the way: no bare ``processor``/``state`` modules."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("dpstream-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert {n.split("/")[0] for n in names} == {"dpstream", f"dpstream-{dpstream.__version__}.dist-info"}
    for folder in ("accountant", "processor", "processor/mechanisms", "state", "topics"):
        assert f"dpstream/{folder}/__init__.py" in names
    probe = ("import dpstream, dpstream.processor.cli, importlib.util as u; "
             "print(dpstream.__file__); print(dpstream.processor.cli.__file__); "
             "print([m for m in ('processor', 'state', 'topics', 'accountant') if u.find_spec(m)])")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert run.returncode == 0, run.stderr
    init, cli, bare = run.stdout.splitlines()
    assert init.startswith(str(tmp_path / "site")) and cli.startswith(str(tmp_path / "site"))
    assert bare == "[]"


def test_the_python_api_replays_exactly_what_the_cli_publishes(tmp_path):
    events = [{"user_id": f"u{i % 400}", "key": f"k{i % 7}", "ts": 1795132800000 + i * 500} for i in range(4000)]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    key = tmp_path / "noise.key"
    key.write_text(TEST_SECRET_HEX)
    key.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
    config = ROOT / "examples" / "worker.yaml"
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "dpstream.processor.cli", "replay", "--config", str(config), "--input", str(path),
                           "--output", str(out), "--noise-label", "api-check", "--noise-key-file", str(key),
                           "--start", "2026-11-20", "--until", "2026-11-20T01:00:00Z"],  # the example's ledger's schedule
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cli_releases = [json.loads(line) for line in out.read_text().splitlines()]
    assert cli_releases
    span = {"start": "2026-11-20", "until": 1795136400000}  # ISO-8601 or epoch ms
    assert dpstream.replay(str(config), events, noise_key_file=str(key), noise_label="api-check", **span) == cli_releases
    assert dpstream.replay(str(config), str(path), noise_key_file=str(key), noise_label="api-check", **span) == cli_releases
    other = dpstream.replay(str(config), events, noise_key_file=str(key), **span)  # a fresh random label: other noise
    assert [r["count"] for r in other] != [r["count"] for r in cli_releases]
