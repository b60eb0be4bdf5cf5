"""The README's promises: its library example runs, and its two commands are the ones CI uses."""

from __future__ import annotations

import json
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.support.installed import Program
from tests.support.readme import command_lines, python_block, run_line

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


RECORDING_EXAMPLES = {"the decode runner": 'Recorder(label="my-engine")',
                      "a callable of your own": "wrapped = CUDAGraphWrapper(step, runtime)"}
"""The README's examples that record a run, by a line each holds."""


@pytest.mark.slow
@pytest.mark.parametrize("example", RECORDING_EXAMPLES)
def test_each_recording_example_runs_as_written_and_captures_its_graphs(tmp_path: Path, example: str) -> None:
    # Saved as a user would save it, run with the interpreter beside graph-inspector, then reported.
    (tmp_path / "example.py").write_text(python_block(RECORDING_EXAMPLES[example]))
    program = Program.under_test()
    ran = run_line(program, "python3 example.py", tmp_path)
    assert ran.returncode == 0, ran.stderr
    reported = run_line(program, "graph-inspector report --format json", tmp_path)
    assert reported.returncode == 0, reported.stderr
    [run] = json.loads(reported.stdout)["runs"]
    assert run["graphs"] == 4 and run["traffic"]["replays"] >= 1 and run["traffic"]["eager_batches"] == 0
    assert run["warnings"] == [], "a run that captured nothing is warned about"


def _with_pytest(program: Program) -> None:
    """The README's pytest commands need pytest beside graph-inspector (a wheel's venv has none)."""
    if subprocess.run([program.python, "-c", "import pytest"], env=program.env).returncode:
        done = subprocess.run([program.python, "-m", "pip", "install", "-q", "pytest"], env=program.env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def _failed_cases(report: Path) -> dict[str, str]:
    """JUnit case name -> its failure's text."""
    cases = ET.parse(report).getroot().iter("testcase")
    return {case.get("name", ""): case.findtext("failure") or "" for case in cases
            if case.find("failure") is not None}


def _green(report: Path) -> None:
    """A run of the same code passes every comparison; capture time, which on the eager backend (no
    GPU) is the CPU's time under whatever else the machine runs (seconds a graph here), is judged on
    CUDA graphs only."""
    import torch

    assert _failed_cases(report) == {}, _failed_cases(report)
    [capture_time] = [case for case in ET.parse(report).getroot().iter("testcase")
                      if case.get("name") == "Capture time"]
    skipped = capture_time.find("skipped")
    if torch.cuda.is_available():
        assert skipped is None, skipped.get("message")
    else:
        assert skipped is not None and "ran on the eager backend" in (skipped.get("message") or "")


@pytest.mark.slow
def test_the_pytest_example_passes_under_the_plugin_and_gates_its_session(tmp_path: Path) -> None:
    program = Program.under_test()
    _with_pytest(program)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_graphs.py").write_text(python_block("def test_decode_replays_its_graphs"))
    [checked] = [line for line in command_lines("--graph-debug") if "pytest" in line]
    ran = run_line(program, checked, tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed" in ran.stdout and "graph report written to" in ran.stdout
    assert "no graph violations in 1 test(s)" in (tmp_path / "graph-report.xml").read_text()

    saved = run_line(program, "python3 -m pytest --graph-save-baseline ci/tests-baseline.json", tmp_path)
    assert saved.returncode == 0 and (tmp_path / "ci" / "tests-baseline.json").is_file(), saved.stdout
    [gated] = [line for line in command_lines("--save-baseline") if "pytest" in line]
    judged = run_line(program, gated, tmp_path)
    assert judged.returncode == 0, judged.stdout + judged.stderr
    _green(tmp_path / "graph-report.xml")
    assert len(ET.parse(tmp_path / "graph-report.xml").getroot().findall(".//testcase")) == 9


@pytest.mark.slow
def test_the_ci_gate_as_written_judges_each_ci_runs_fresh_database(tmp_path: Path) -> None:
    program = Program.under_test()
    record, save, gate, _ = command_lines("--save-baseline")
    engine = python_block('Recorder(label="my-engine")')
    (tmp_path / "engine.py").write_text(engine)

    def ci_run(*lines: str) -> subprocess.CompletedProcess[str]:
        """A CI job on a fresh checkout: no ci.db from an earlier run; the committed baseline stays."""
        for leftover in tmp_path.glob("ci.db*"):
            leftover.unlink()
        for line in lines:
            done = run_line(program, line, tmp_path)
        return done

    first = ci_run(record, save)
    assert first.returncode == 0, first.stderr
    assert "written to ci/graph-baseline.json" in first.stderr
    judged = ci_run(record, gate)
    assert judged.returncode == 0, judged.stderr  # not 2: the new ci.db's run 1 is judged, and passes
    _green(tmp_path / "graph-report.xml")

    (tmp_path / "engine.py").write_text(engine.replace("sizes=[1, 2, 4, 8]", "sizes=[1, 2, 4]"))
    regressed = ci_run(record, gate)
    assert regressed.returncode == 1, regressed.stderr
    assert "missing: full tokens=8,reqs=any,uniform=0" in _failed_cases(tmp_path / "graph-report.xml")[
        "Captured graphs"]


@pytest.mark.cuda
def test_the_transformers_example_is_watched_as_written(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    program = Program.under_test()
    (tmp_path / "gen.py").write_text(python_block("# gen.py"))
    watch, _ = command_lines("python gen.py")
    watched = run_line(program, watch.replace("python gen.py", "python3 gen.py"), tmp_path, timeout=1800)
    assert watched.returncode == 0, watched.stderr
    reported = run_line(program, "graph-inspector report --db sqlite:///gen.db --format json", tmp_path)
    assert json.loads(reported.stdout)["runs"][0]["graphs"] > 0


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.*?)```", README, re.S)[0].splitlines()
    assert commands[0].startswith("scripts/setup && graph-inspector demo")
    test_command = commands[1].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    setup, _, pytest_command = test_command.partition(" && ")
    assert f"bash {setup}" in ci and pytest_command in ci


def test_the_quick_subset_leaves_out_every_marker_of_a_long_test_but_cuda() -> None:
    # cuda tests skip themselves without a GPU; every other marker pyproject.toml registers is one of a
    # long test.
    [expression] = re.findall(r'`python3 -m pytest -m "([^"]+)"`', README)
    left_out = re.findall(r"not (\w+)", expression)
    assert expression == " and ".join(f"not {name}" for name in left_out)
    [markers] = re.findall(r"^markers = \[\n(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    registered = set(re.findall(r'^\s*"(\w+):', markers, re.M))
    assert "slow" in registered and set(left_out) == registered - {"cuda"}


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
