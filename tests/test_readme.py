"""The README works as pasted (issue 16, item 4 and acceptance): it is a front page under 200
lines that opens with the two commands, its links resolve, and its Kafka quick-start block runs
top to bottom in one shell against a fresh broker, teardown included."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"


def kafka_block() -> str:
    text = README.read_text()
    found = re.search(r"<!-- kafka-quickstart[^>]*-->\s*```bash\n(.*?)```\s*<!-- /kafka-quickstart -->", text, re.S)
    assert found, "the README's Kafka block is marked <!-- kafka-quickstart --> ... <!-- /kafka-quickstart -->"
    return found.group(1)


def test_the_readme_is_a_front_page_with_the_two_commands_first_and_links_that_resolve():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert [line.split()[:2] for line in first_block] == [["scripts/dpstream", "demo"], ["scripts/test", "#"]]
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_every_command_of_the_quick_start_is_a_real_option():
    """Each `dpstream SUB --option` of the block is in that command's --help (so a renamed
    option fails here, without a broker)."""
    for line in kafka_block().splitlines():
        found = re.search(r"\.venv/bin/dpstream (\w+)(.*?)(?:[>&#]|$)", line)
        if not found:
            continue
        sub, rest = found.groups()
        helptext = subprocess.run([str(ROOT / ".venv/bin/dpstream"), sub, "--help"], capture_output=True, text=True).stdout
        for option in re.findall(r"(--[\w-]+)", rest):
            assert option in helptext, f"dpstream {sub} has no {option}"


@pytest.mark.broker
@pytest.mark.slow
def test_the_kafka_quick_start_runs_as_pasted_in_one_shell(tmp_path):
    """The block, verbatim, in a fresh directory of links to the checkout's files (so the
    block's own files land there), on its own broker port."""
    port = 29700 + os.getpid() % 200
    # the block's scripts/broker runs scripts/bootstrap.sh: with the install stamp current it
    # installs nothing (otherwise it would reinstall the shared .venv from the link directory)
    subprocess.run([str(ROOT / "scripts/bootstrap.sh")], check=True, capture_output=True)
    for entry in ROOT.iterdir():  # the checkout, less what the block writes
        if entry.name not in {".git", ".broker", "noise.key", "worker.log", "dpstream-state", "releases.jsonl"}:
            (tmp_path / entry.name).symlink_to(entry)
    env = {**os.environ, "DPSTREAM_TEST_BROKER_PORT": str(port), "DPSTREAM_BROKER": f"127.0.0.1:{port}",
           "DPSTREAM_BROKER_DIR": str(tmp_path / ".broker-run")}
    env.pop("DPSTREAM_NOISE_KEY_FILE", None)
    env.pop("DPSTREAM_NOISE_KEY", None)
    jars = ROOT / ".broker"
    if jars.is_dir():  # reuse the resolved Kafka jars instead of resolving them again
        (tmp_path / ".broker-run").mkdir()
        for entry in jars.glob("kafka-*"):
            if entry.is_dir() and (entry / "libs").is_dir():
                (tmp_path / ".broker-run" / entry.name).symlink_to(entry)
    script = "set -euo pipefail\n" + kafka_block()
    try:
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run([str(ROOT / "scripts/broker"), "stop", str(port)], env=env, capture_output=True)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    releases = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"app_id"')]
    assert len(releases) == 5, done.stdout[-3000:]
    assert all(r["query"] == "page_clicks" and isinstance(r["count"], int) for r in releases)
    # each names its run: the label `dpstream replay --noise-label` takes to reproduce it
    assert len({r["run"]["noise_label"] for r in releases}) == 1
    assert releases[0]["app_id"] == "dpstream" and releases[0]["run"]["noise_label"].startswith("worker:dpstream:1:")
    assert '"ready"' in done.stdout  # /readyz answered while the worker ran
    assert "starts over" in done.stderr  # the teardown's reset
    assert not (tmp_path / "noise.key").exists() and not (tmp_path / "worker.log").exists()
    assert not (tmp_path / "dpstream-state").exists()  # reset removed the state
    assert not list((ROOT / "state").glob("partition-*"))  # nothing landed in the source package
