"""Small things a new user meets (issue 32, item 9), each checked as the user meets it:

* every subcommand's ``--help`` has a description paragraph, not only a usage line;
* ``dpstream reset`` without ``--yes`` prints what it would do, changes nothing and exits 0;
* what the docs' commands write into the checkout (state directories, the plan's preview, logs,
  releases, keys, dead letters) is ignored by git, and no doc points a command at a source folder.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dpstream.processor.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DPSTREAM = [sys.executable, "-m", "dpstream.processor.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*DPSTREAM, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "100"})


def test_every_subcommand_has_a_description():
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.choices and "worker" in a.choices).choices
    missing = sorted(name for name, sub in subcommands.items() if not (sub.description or "").strip())
    assert missing == []


@pytest.mark.parametrize("command, opening", [("produce", "Send events to an input topic"),
                                              ("tail", "Print the releases of an output topic"),
                                              ("demo", "Generate a synthetic click stream")])
def test_help_shows_a_description_paragraph_between_usage_and_options(command, opening):
    done = cli(command, "--help")
    assert done.returncode == 0, done.stderr
    between = done.stdout.split("\n\n")[1]  # usage, then the description, then the options
    assert " ".join(between.split()).startswith(opening), done.stdout


@pytest.mark.broker
def test_reset_dry_run_prints_its_plan_changes_nothing_and_exits_0(tmp_path, broker):
    app_id = f"dry-reset-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "q.yaml"
    config.write_text(f"queries:\n  - {{name: q, input_topic: {app_id}-in, output_topic: {app_id}-out, epsilon: 1, delta: 1.0e-6}}\n")
    state = tmp_path / "state"
    state.mkdir()
    done = cli("reset", "--config", str(config), "--app-id", app_id, "--state-dir", str(state), "--broker", broker)
    assert done.returncode == 0, done.stderr
    assert f"would delete state directory {state}" in done.stdout
    assert "nothing done; run again with --yes" in done.stderr and "Traceback" not in done.stderr
    assert state.is_dir()  # nothing was deleted
    again = cli("reset", "--config", str(config), "--app-id", app_id, "--state-dir", str(state), "--broker", broker)
    assert "start-over 1 of" in again.stdout  # no start-over was recorded either


#: options of the docs' commands that name a file or directory the command writes
WRITES = re.compile(r"(?:--state-dir|--plot|--out|--output|--output-dir|--dead-letter|--json)[ =](\S+)"
                    r"|(?<![0-9&>])>\s*([^\s&|;)]+)")
DPSTREAM_COMMAND = re.compile(r"^\s*(\w+=\S+\s+)*(\.venv/bin/)?dpstream [a-z]")


def shell_lines(text: str):
    """Lines of fenced shell (or unlabelled) blocks, and indented ``dpstream`` command lines."""
    fence = None
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:].strip()
        elif fence in ("bash", "sh", "shell", "console", "") or DPSTREAM_COMMAND.match(line):
            yield re.sub(r"(^|\s)#.*", "", line)  # not the comments


def paths_the_docs_write() -> dict[str, str]:
    """Checkout-relative paths the docs' commands write, each with the line it comes from."""
    found = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in shell_lines(doc.read_text()):
            for match in WRITES.finditer(line):
                path = (match.group(1) or match.group(2)).strip("[]'\"").removeprefix("$PWD/").removeprefix("./").rstrip("/")
                if path.startswith("$"):
                    continue  # under a directory a variable names ("$scratch/...": mktemp -d), not the checkout
                path = re.sub(r"\$\{?\w+\}?", "1", path)  # ./dpstream-state-w$w: the first worker's
                if path and not path.startswith(("/", "~", "&")) and not re.fullmatch(r"[A-Z_.]+", path):
                    is_dir = "--state-dir" in match.group(0) or "--output-dir" in match.group(0)
                    found[path + ("/CURRENT" if is_dir else "")] = f"{doc.name}: {line.strip()}"
    return found


def test_what_the_docs_write_into_the_checkout_is_ignored_by_git():
    written = paths_the_docs_write()
    # the docs' own commands: the worker's state, the plan's preview, the quick start's files
    assert {"dpstream-state/CURRENT", "dpstream-state-w1/CURRENT", "preview.png", "noise.key", "worker.log",
            "releases.jsonl"} <= set(written)
    for path, origin in written.items():
        folder = path.split("/")[0]
        tracked = subprocess.run(["git", "ls-files", "--", folder], cwd=ROOT, capture_output=True, text=True).stdout
        assert not tracked, f"{origin}: writes into {folder}, which holds the project's own files"
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "--", path], cwd=ROOT)
        assert ignored.returncode == 0, f"{origin}: {path} is not in .gitignore"
