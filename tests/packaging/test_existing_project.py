"""graph-inspector dropped into an existing project, from its installed wheel: a project with a
package of its own named `migrations` (every Django, Alembic or Flask-Migrate project) records,
reports and gates; one with its own `inspector` package runs its tests, told in one line why the
pytest plugin is off. Each project runs from its own folder, first on its path, as a user runs it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.installed import Installation
from tests.support.readme import python_block, run_line

pytestmark = pytest.mark.slow

THEIR_MIGRATIONS = {
    "migrations/__init__.py": '"""This project\'s own database migrations."""\n',
    "migrations/env.py": "raise SystemExit(\"the project's own Alembic env.py ran\")\n",
    "migrations/versions/0001_users.py": 'revision = "0001_users"\ndown_revision = None\n',
}
THEIR_INSPECTOR = {
    "inspector/__init__.py": 'NAME = "the project\'s own inspector"\n',
    "tests/test_own.py": "from inspector import NAME\n\n\ndef test_own():\n    assert 'project' in NAME\n",
}


def project(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def program(installation: Installation) -> object:
    made = installation.program()
    if subprocess.run([made.python, "-c", "import pytest"], env=made.env).returncode:
        done = subprocess.run([made.python, "-m", "pip", "install", "-q", "pytest"], env=made.env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    return made


def test_a_project_with_its_own_migrations_package_records_reports_and_gates(
    program: object, tmp_path: Path
) -> None:
    engine = python_block('Recorder(label="my-engine")')
    root = project(tmp_path, {**THEIR_MIGRATIONS, "engine.py": engine})
    ran = run_line(program, "GRAPH_INSPECTOR_DB=sqlite:///ci.db python3 engine.py", root)
    assert ran.returncode == 0, ran.stderr
    assert "revision" not in ran.stderr and "own Alembic" not in ran.stderr, ran.stderr
    reported = run_line(program, "graph-inspector report --db sqlite:///ci.db", root)
    assert reported.returncode == 0, reported.stdout + reported.stderr
    assert "run 1 'my-engine'" in reported.stdout and "4 graphs" in reported.stdout
    upgraded = run_line(program, "graph-inspector db current --db sqlite:///ci.db", root)
    assert upgraded.returncode == 0 and "(newest)" in upgraded.stdout, upgraded.stdout + upgraded.stderr
    assert (root / "migrations" / "versions" / "0001_users.py").read_text().startswith("revision = ")


def test_a_project_with_its_own_inspector_package_runs_its_tests_told_the_plugin_is_off(
    program: object, tmp_path: Path
) -> None:
    root = project(tmp_path, THEIR_INSPECTOR)
    ran = run_line(program, "python3 -m pytest -q tests", root)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed" in ran.stdout
    told = [line for line in ran.stdout.splitlines() if line.startswith("graph-inspector: ")]
    assert told == [
        "graph-inspector: its pytest plugin is off in this run: the package 'inspector' found first on the "
        f"path is {root / 'inspector' / '__init__.py'}, not graph-inspector's, so its checks, the "
        "graph_observer fixture and the --graph-* options are unavailable (import "
        "inspector.gating.pytest_plugin: No module named 'inspector.gating')"
    ]
    asked = run_line(program, "python3 -m pytest -q tests --graph-report graph-report.xml", root)
    assert asked.returncode == 4, asked.stdout + asked.stderr
    assert "--graph-report: graph-inspector: its pytest plugin is off in this run" in asked.stderr
    (root / "tests" / "test_fixture.py").write_text("def test_graphs(graph_observer):\n    pass\n")
    fixture = run_line(program, "python3 -m pytest -q tests", root)
    assert fixture.returncode == 1 and "1 passed, 1 error" in fixture.stdout  # the fixture fails its setup
    assert "graph-inspector: its pytest plugin is off in this run" in fixture.stdout


def test_a_project_with_no_such_package_has_the_plugin_from_the_wheel_with_no_warning(
    program: object, tmp_path: Path
) -> None:
    root = project(tmp_path, {"tests/test_graphs.py": python_block("def test_decode_replays_its_graphs")})
    ran = run_line(program, "python3 -m pytest -q --graph-debug --graph-report graph-report.xml", root)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed in" in ran.stdout and "warning" not in ran.stdout, ran.stdout
    assert "no graph violations in 1 test(s)" in (root / "graph-report.xml").read_text()
