"""The README's promises: its library example runs, and its two commands are the ones CI uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_library_example_runs_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPH_INSPECTOR_DB", f"sqlite:///{tmp_path / 'readme.db'}")
    code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert tuple(namespace["logits"].shape) == (3, namespace["model"].config.vocab_size)

    from inspector.reading.queries import Queries
    from inspector.storage.store import open_store

    runs = Queries(open_store(f"sqlite:///{tmp_path / 'readme.db'}").engine).runs()
    assert [run["label"] for run in runs.items] == ["my-engine"]
    assert runs.items[0]["graphs"] == 4


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.*?)```", README, re.S)[0].splitlines()
    assert commands[0].startswith("scripts/setup && graph-inspector demo")
    test_command = commands[1].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    setup, _, pytest_command = test_command.partition(" && ")
    assert f"bash {setup}" in ci and pytest_command in ci


def test_the_virtual_environment_the_readme_creates_is_ignored_by_git() -> None:
    import subprocess

    [venv] = re.findall(r"python3 -m venv (\S+)", README)
    for path in (venv, f"{venv}/bin/python", f"{venv}/lib/python3.11/site-packages/torch/__init__.py"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert ignored.returncode == 0, f"{path} would show as untracked in git status"


def test_the_wheel_commands_install_the_build_tool_they_run() -> None:
    # `python3 -m build` needs the `build` package, which only `scripts/setup --dev` installs.
    [line] = [line for line in README.splitlines() if "python3 -m build" in line]
    assert line.index("pip install build") < line.index("python3 -m build")


def test_the_metrics_table_is_the_exported_one() -> None:
    from inspector.reading.metrics import metrics_table_markdown

    assert metrics_table_markdown() in README


def test_the_advise_run_shown_is_what_the_command_prints() -> None:
    import os
    import subprocess
    import sys

    shown_run = r"```bash\n(graph-inspector advise [^\n]*)\n```\n\n```text\n(.*?)```"
    command, shown = re.findall(shown_run, README, re.S)[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "dashboard.cli", *command.split()[1:]], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown
