"""The README's examples, as a new user meets them: its Python blocks, and its command lines run the
way a shell would (``VAR=value`` assignments, ``#`` comments), with ``graph-inspector`` and
``python3`` being the program under test and its interpreter (tests.support.installed)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from tests.support.installed import REPO_ROOT, Program

README = (REPO_ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    """Every fenced block of ``language`` in the README, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def python_block(containing: str) -> str:
    """The one Python block of the README that holds ``containing``."""
    [found] = [block for block in blocks("python") if containing in block]
    return found


def command_lines(containing: str) -> list[str]:
    """The lines of the one shell block of the README that holds ``containing``."""
    [found] = [block for block in blocks("bash") if containing in block]
    return found.splitlines()


def run_line(program: Program, line: str, cwd: Path, timeout: float = 600
             ) -> subprocess.CompletedProcess[str]:
    """A README command line, as written, in ``cwd``."""
    words = shlex.split(line, comments=True)
    env = dict(program.env)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "graph-inspector":
        words[:1] = program.argv
    elif words[0] == "python3":
        words[0] = program.python
    return subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
