"""The docs run as pasted (issue 32, item 2). Every shell block of README.md, docs/*.md and
helm/README.md either runs here (or in the test its marker names) or says why it cannot, with
one marker:

* ``<!-- NAME: tests/FILE.py runs this block as it is -->`` on the line before the block: the
  test in FILE runs every block named NAME, verbatim, in document order (one procedure);
* ``# illustrative: REASON`` as the block's first line (a cluster, Docker, placeholders).

Each procedure runs in a fresh temporary directory of links to the checkout (the examples
copied), so what a block writes lands there. The environment stands in for what the docs assume
of the reader's shell and nothing more: ``dpstream`` on PATH (as after ``pip install``), no noise
secret in the environment unless the page says it was set up (then a fresh ``dpstream keygen``
file), and ``$TMPDIR`` inside the test's directory. No block's text is changed."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port_block

PAGES = [ROOT / "README.md", ROOT / "helm/README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
RUN_MARKER = re.compile(r"<!--\s*([\w-]+):\s*(tests/[\w/]+\.py) runs this block")
#: the other recipes for a noise secret, all replaced by `dpstream keygen` (two made world-readable files)
OTHER_KEY_RECIPES = re.compile(r"/dev/urandom|openssl rand|token_hex|token_bytes|secrets\.token")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    marker: str  # the line before the opening fence

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page (fences may be indented, inside a list item)."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, body, j = opening.group(1), [], i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        marker = lines[i - 1].strip() if i else ""
        found.append(Block(page, i + 1, opening.group(2), "\n".join(body) + "\n", marker))
        i = j + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in SHELL]


def named(name: str) -> list[Block]:
    """The blocks marked to run as procedure ``name``, in the order of PAGES and of each page."""
    chosen = [b for b in shell_blocks() if (m := RUN_MARKER.search(b.marker)) and m.group(1) == name]
    assert chosen, f"no block is marked <!-- {name}: tests/test_docs_blocks.py runs this block ... -->"
    return chosen


def test_every_code_block_names_its_language_and_none_is_indented():
    """A shell block without a language, or an indented one, would escape the next test."""
    for page in PAGES:
        for b in blocks(page):
            assert b.lang, f"{b.where()}: a fenced block names its language (bash, text, json, ...)"
        previous = ""
        fenced = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            fenced ^= line.strip().startswith("```")
            if not fenced and not previous.strip() and re.match(r"^ {4}[^ *\-\d]", line):
                pytest.fail(f"{page.relative_to(ROOT)}:{n}: an indented code block; fence it with its language")
            previous = line


def test_every_shell_block_runs_in_a_test_or_says_why_not():
    for b in shell_blocks():
        first = b.text.splitlines()[0] if b.text.strip() else ""
        if re.match(r"# illustrative: \S", first):
            continue
        marker = RUN_MARKER.search(b.marker)
        assert marker, (f"{b.where()}: a shell block either runs in CI (a line before it: <!-- NAME: tests/FILE.py runs "
                        f"this block as it is -->) or starts with '# illustrative: <why it cannot run>'")
        name, test_file = marker.groups()
        assert name in (ROOT / test_file).read_text(), f"{b.where()}: {test_file} does not run the blocks named {name}"


def test_one_noise_key_recipe_everywhere():
    """`dpstream keygen` (mode 0600) is the one recipe: in the docs, the chart's notes and values,
    the examples and every --help text."""
    from dpstream.processor.cli import build_parser

    texts = {str(p.relative_to(ROOT)): p.read_text() for p in PAGES}
    for path in ["helm/dpstream/templates/NOTES.txt", "helm/dpstream/values.yaml", *sorted(
            str(p.relative_to(ROOT)) for p in (ROOT / "examples").iterdir() if p.suffix in {".yaml", ".md", ".txt"})]:
        texts[path] = (ROOT / path).read_text()
    parser = build_parser()
    texts["dpstream --help"] = parser.format_help()
    for action in parser._subparsers._group_actions:
        for sub, subparser in action.choices.items():
            texts[f"dpstream {sub} --help"] = subparser.format_help()
    for where, text in texts.items():
        assert not OTHER_KEY_RECIPES.search(text), f"{where}: make noise secrets with `dpstream keygen`, the one recipe"
    assert "dpstream keygen --out noise.key" in texts["helm/dpstream/templates/NOTES.txt"]


# ---------------------------------------------------------------- the procedures


def workdir(tmp_path: Path) -> Path:
    """A directory of links to the checkout, the examples copied: the blocks' files land here."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name == "examples":
            shutil.copytree(entry, work / "examples")
        elif entry.name not in {".git", ".broker", ".pytest-noise-tables", "noise.key", "releases.jsonl", "preview.png", "worker.log"} \
                and not entry.name.startswith("dpstream-state"):
            (work / entry.name).symlink_to(entry)
    (tmp_path / "tmp").mkdir()
    return work


def environment(tmp_path: Path, **extra: str) -> dict:
    # no noise secret, and no shared sampler-table directory (tests/conftest.py): what a reader has
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPSTREAM_NOISE_KEY", "DPSTREAM_NOISE_TABLE"))}
    env.update(PATH=f"{ROOT / '.venv/bin'}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(tmp_path / "tmp"), **extra)
    return env


def own_network_namespace() -> bool:
    """Whether blocks can run in a network namespace of their own (``unshare -rn``: a user
    namespace, no privilege needed, its loopback brought up): there the docs' fixed ports
    (``--web-port`` 9400, a broker's) are free whatever other tests hold, so procedures run
    beside each other and beside the rest of the suite."""
    try:
        return subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def fixed_ports(isolated: bool):
    """Without a namespace of their own, procedures that serve the documented ports hold a lock
    (one file for the checkout, ``flock``), so that two of them in two test processes run one
    after the other instead of failing on a taken port."""
    if isolated:
        yield
        return
    with open(ROOT / ".pytest-docs-ports.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_blocks(chosen: list[Block], work: Path, env: dict, timeout: float, isolated: bool = False) -> subprocess.CompletedProcess:
    """The blocks in one bash (set -euo pipefail), in their own process group: whatever they
    leave running is stopped after them. ``isolated``: in a network namespace of their own
    (:func:`own_network_namespace`)."""
    script = "set -euo pipefail\n" + "".join(f"# {b.where()}\n{b.text}" for b in chosen)
    command = ["unshare", "-rn", "bash", "-c", "ip link set lo up\n" + script] if isolated else ["bash", "-c", script]
    proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def keygen(work: Path) -> str:
    """The noise secret "set up as the README says" (its quick start: dpstream keygen)."""
    subprocess.run([str(ROOT / ".venv/bin/dpstream"), "keygen", "--out", str(work / "readme-noise.key")], check=True,
                   capture_output=True)
    return str(work / "readme-noise.key")


@pytest.mark.slow
def test_plan_and_replay_run_as_pasted(tmp_path):
    """README "Choose the parameters", docs/plan.md and operations.md's replay of the sample file:
    plan, plan --sample --plot, keygen, replay; docs/consuming.md's schema check of a replay's
    releases; then the README's Python block in the same directory, which reads the key the
    README's block made."""
    work = workdir(tmp_path)
    chosen = named("plan-and-replay")
    assert {b.page.name for b in chosen} >= {"README.md", "plan.md", "operations.md"}
    chosen += named("release-schema")  # docs/consuming.md: a replay's releases against docs/release.schema.json
    # operations.md's replay assumes the secret of the README's quick start (its text says so)
    done = run_blocks(chosen, work, environment(tmp_path, DPSTREAM_NOISE_KEY_FILE=keygen(work)), timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert (work / "preview.png").stat().st_size > 0
    assert (work / "noise.key").stat().st_mode & 0o777 == 0o600
    assert (work / "releases.jsonl").read_text().count('"query":"page_clicks"') > 0
    assert re.search(r"^[1-9]\d* releases match docs/release.schema.json$", done.stdout, re.M), done.stdout[-2000:]
    python = next(b for b in blocks(ROOT / "README.md") if b.lang == "python")
    done = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", python.text],
                          cwd=work, env=environment(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((ROOT / "state").glob("partition-*"))  # nothing landed in the source package


@pytest.mark.slow
def test_the_helm_chart_renders_and_lints_by_hand_as_pasted(tmp_path):
    """helm/README.md, "By hand": the render to $TMPDIR and yamllint on it."""
    pytest.importorskip("helm_python", reason="HELM CHART NOT CHECKED: helm_python cannot be imported")
    work = workdir(tmp_path)
    done = run_blocks(named("helm-by-hand"), work, environment(tmp_path), timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    rendered = (tmp_path / "tmp" / "dpstream.yaml").read_text()
    assert "kind: StatefulSet" in rendered and "kind: PrometheusRule" in rendered


@pytest.mark.broker
def test_kafkas_own_tools_run_as_pasted(tmp_path, broker):
    """docs/operations.md, "Kafka's own tools": `kafka-topics --list` on the test broker, which
    the block names (127.0.0.1:19092)."""
    if broker != "127.0.0.1:19092":
        pytest.skip(f"the block names the test broker's default address; this run's broker is {broker}")
    work = workdir(tmp_path)
    jars = tmp_path / "broker"
    jars.mkdir()
    for entry in (ROOT / ".broker").glob("kafka-*"):  # the resolved Kafka jars, not resolved again
        if entry.is_dir() and (entry / "libs").is_dir():
            (jars / entry.name).symlink_to(entry)
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"docs-tools-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    try:
        done = run_blocks(named("kafka-tools"), work, environment(tmp_path, DPSTREAM_BROKER_DIR=str(jars)), timeout=300)
    finally:
        admin.delete_topics([topic])
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert topic in done.stdout.split()


def own_broker_environment(tmp_path: Path) -> tuple[dict, int]:
    """The environment of blocks that start and stop a broker (`scripts/broker start`) and use
    the docs' fixed topic names: a broker of their own, on free ports, its run directory in
    tmp_path with links to the resolved Kafka jars (not resolved again)."""
    port = free_port_block(2)  # the broker's and its controller's
    # scripts/broker runs scripts/bootstrap.sh: with the install stamp current it installs nothing
    # (otherwise it would reinstall the shared .venv from the link directory)
    subprocess.run([str(ROOT / "scripts/bootstrap.sh")], check=True, capture_output=True)
    broker_dir = tmp_path / "broker"
    broker_dir.mkdir()
    for entry in (ROOT / ".broker").glob("kafka-*"):
        if entry.is_dir() and (entry / "libs").is_dir():
            (broker_dir / entry.name).symlink_to(entry)
    return environment(tmp_path, DPSTREAM_TEST_BROKER_PORT=str(port), DPSTREAM_BROKER=f"127.0.0.1:{port}",
                       DPSTREAM_BROKER_DIR=str(broker_dir)), port


def run_with_own_broker(chosen: list[Block], tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    tmp_path.mkdir()
    work = workdir(tmp_path)
    env, port = own_broker_environment(tmp_path)
    isolated = own_network_namespace()
    with fixed_ports(isolated):
        try:
            done = run_blocks(chosen, work, env, timeout=600, isolated=isolated)
        finally:
            subprocess.run([str(ROOT / "scripts/broker"), "stop", str(port)], env=env, capture_output=True)
    logs = "".join(f"\n{p.name}:\n{p.read_text()[-1500:]}" for p in work.glob("worker*.log"))
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}{logs}"
    return done, work


# Each procedure starts and stops its own broker and uses fixed topic names, so each runs on a
# broker of its own (the shared one would keep the topics and output claims of earlier runs).
# Both serve a worker's web port on 9400: each runs in a network namespace of its own where the
# machine allows it, else one after the other (:func:`fixed_ports`).


@pytest.mark.broker
@pytest.mark.slow
def test_the_readmes_kafka_quick_start_runs_as_pasted(tmp_path):
    """The README's quick start: a broker, a worker, the sample file produced, five releases
    tailed, the status page, the teardown with `dpstream reset`."""
    done, work = run_with_own_broker(named("kafka-quickstart"), tmp_path / "readme")
    releases = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"app_id"')]
    assert len(releases) == 5, done.stdout[-3000:]
    assert all(r["query"] == "page_clicks" and isinstance(r["count"], int) for r in releases)
    # each names its run: the label `dpstream replay --noise-label` takes to reproduce it
    assert len({r["run"]["noise_label"] for r in releases}) == 1
    assert releases[0]["app_id"] == "dpstream" and releases[0]["run"]["noise_label"].startswith("worker:dpstream:1:")
    assert '"ready"' in done.stdout  # /readyz answered while the worker ran
    assert "starts over" in done.stderr  # the teardown's reset
    assert not (work / "noise.key").exists() and not (work / "worker.log").exists()
    assert not (work / "dpstream-state").exists()  # reset removed the state


@pytest.mark.broker
@pytest.mark.slow
def test_the_operator_guides_kafka_procedure_runs_as_pasted(tmp_path):
    """docs/operator-guide.md, "Running on Kafka": a static worker, two elastic workers of
    another application on examples/elastic.yaml, `check-input`, the teardown."""
    done, work = run_with_own_broker(named("kafka-on-one-machine") + named("check-input") + named("kafka-teardown"),
                                     tmp_path / "guide")
    assert done.stdout.count('"query":"page_clicks"') >= 1  # tail's first release
    assert '"ready"' in done.stdout
    owned = re.findall(r'^dpstream_partitions_owned\{topic="([^"]+)"\} (\S+)', done.stdout, re.M)
    assert len(owned) == 4, done.stdout[-2000:]  # two topics, two workers (the first two lines are w1's)
    assert sum(float(n) for t, n in owned if t == "events") == 8, done.stdout[-2000:]  # the 8 partitions, shared
    assert sum(float(n) for t, n in owned if t == "elastic-page_clicks-by-key") == 8, done.stdout[-2000:]
    assert float(owned[0][1]) + float(owned[1][1]) > 0 and float(owned[2][1]) + float(owned[3][1]) > 0  # each its share
    assert not (work / "noise.key").exists() and not list(work.glob("dpstream-state*"))  # the teardown
    assert not list((ROOT / "state").glob("partition-*"))  # nothing landed in the source package
