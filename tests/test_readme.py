"""The README works as pasted (issue 16, item 4 and acceptance): it is a front page under 200
lines that opens with the two commands, its links resolve, and the options of its Kafka quick
start are real. The quick start itself runs, verbatim, in tests/test_docs_blocks.py."""
from __future__ import annotations

import re
import subprocess

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
    first_block = [line for line in re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
                   if not line.startswith("# illustrative:")]
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
