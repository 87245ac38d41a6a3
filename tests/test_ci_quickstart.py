"""CI runs the README's quick start as written (issue 54).

`.ci/run` installs into a virtual environment of its own and runs the README's two quick-start
commands there. It may put guards between the install and pytest, so each command's parts (split at
`&&`) must appear in `.ci/run` in the README's order, each on a line of its own or as the whole line.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_readme_has_two_quickstart_commands():
    cmds = quickstart_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].startswith("pip install -e . "), cmds[0]
    assert cmds[1].startswith("pip install -e '.[test]'") and cmds[1].endswith("pytest"), cmds[1]


def test_ci_runs_the_quickstart_in_order():
    lines = ci_lines()
    pos = 0
    for cmd in quickstart_commands():
        if cmd in lines:                           # run whole
            pos = lines.index(cmd, pos) + 1
            continue
        for part in (p.strip() for p in cmd.split("&&")):
            assert part in lines[pos:], f".ci/run does not run {part!r} (from the README's {cmd!r}) after line {pos}"
            pos = lines.index(part, pos) + 1


def test_ci_installs_into_its_own_venv():
    lines = ci_lines()
    venv = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv"))
    activate = next(i for i, line in enumerate(lines) if line.startswith("source ") and "bin/activate" in line)
    first_pip = next(i for i, line in enumerate(lines) if line.startswith("pip install"))
    assert venv < activate < first_pip
    assert "--system-site-packages" not in lines[venv]
    assert "pip check" in lines[first_pip:]
