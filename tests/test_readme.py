"""The README's Quickstart is what CI runs: exactly two commands, the second one verbatim in .ci/run."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Quickstart' section"
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section.group(1), re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_quickstart_has_exactly_two_commands():
    commands = _quickstart_commands()
    assert len(commands) == 2, commands
    assert "specjax generate" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci_lines = [line.strip() for line in f]
    assert _quickstart_commands()[1] in ci_lines
