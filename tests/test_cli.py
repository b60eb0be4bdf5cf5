"""The command line: one module declares every subcommand, each with help text; `--help` is instant
(no torch, Flask or SQLAlchemy); exit codes 0 clean, 1 findings, 2 usage errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard.cli import _load, build_parser, main

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"demo", "serve", "report", "advise", "watch", "db upgrade", "db current", "db prune"}
WORK = ("dashboard.demo.", "inspector.commands.watch", "inspector.advice")
"""Modules that do a command's work: `--help` needs none of them."""
HEAVY = ("torch", "numpy", "flask", "sqlalchemy", "alembic", "waitress", "prometheus_client", "tqdm")


Parsers = dict[str, argparse.ArgumentParser]


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Parsers:
    """Every runnable subcommand's parser, by its words ('db upgrade'), found by walking the parser."""
    found: Parsers = {}
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return {" ".join(path): parser}
    for group in groups:
        for name, child in group.choices.items():
            found.update(subcommands(child, (*path, name)))
    return found


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "dashboard.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_subcommand_is_declared_in_the_one_cli_module_and_runs_a_real_function() -> None:
    found = subcommands(build_parser())
    assert set(found) == COMMANDS
    for words, parser in found.items():
        handler = parser.get_default("handler")
        assert callable(_load(handler)), words


def test_every_subcommand_and_option_says_what_it_does() -> None:
    def described(parser: argparse.ArgumentParser, where: str) -> None:
        assert parser.description, f"{where}: no description"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{where} {choice.dest}: no help"
                    described(action.choices[choice.dest], f"{where} {choice.dest}")
            elif not isinstance(action, argparse._HelpAction):
                what = f"{where} {'/'.join(action.option_strings) or action.dest}"
                assert action.help and action.help != argparse.SUPPRESS, f"{what}: no help"

    described(build_parser(), "graph-inspector")


def test_help_of_every_command_answers_without_loading_torch_flask_or_the_database() -> None:
    code = (
        "import json, sys\n"
        "from dashboard.cli import main\n"
        "codes = {}\n"
        "for words in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        main([*words.split(), '--help'])\n"
        "    except SystemExit as exit:\n"
        "        codes[words] = exit.code\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        f"work = sorted(m for m in sys.modules if m.startswith({WORK!r}))\n"
        "print(json.dumps({'codes': codes, 'heavy': heavy, 'work': work}))\n"
    )
    words = ["", *sorted(COMMANDS), "db"]
    result = subprocess.run([sys.executable, "-c", code, json.dumps(words)], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["codes"] == dict.fromkeys(words, 0)
    assert report["heavy"] == [], "--help imported heavy modules"
    assert report["work"] == ["dashboard.demo.options"], "--help imported a command's implementation"
    for command in COMMANDS:
        assert f"usage: graph-inspector {command}" in result.stdout


def test_no_command_is_a_usage_error_with_the_help_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "usage: graph-inspector" in captured.err and captured.out == ""


@pytest.mark.parametrize("argv", [["frobnicate"], ["db"], ["report", "--run", "three"],
                                  ["serve", "--port", "-1"], ["report", "--format", "pdf"]])
def test_a_bad_command_line_exits_2_with_one_clear_message_and_no_traceback(argv: list[str]) -> None:
    result = cli(*argv)
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "--help)" in result.stderr, "one line, naming the help"
    assert result.stdout == ""


def test_version_exits_0() -> None:
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("graph-inspector ")
