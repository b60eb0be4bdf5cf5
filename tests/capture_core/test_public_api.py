"""The package surface: every exported name resolves, and capture_core stays torch + stdlib."""

from __future__ import annotations

import json
import subprocess
import sys

import capture_core


def test_every_exported_name_resolves():
    missing = [name for name in capture_core.__all__ if not hasattr(capture_core, name)]
    assert missing == []
    assert len(set(capture_core.__all__)) == len(capture_core.__all__)


def test_importing_capture_core_pulls_in_no_inspector_database_or_web_code():
    code = "import capture_core, json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    forbidden = {"inspector", "dashboard", "sqlalchemy", "alembic", "flask", "prometheus_client", "waitress"}
    assert loaded & forbidden == set()


def test_the_package_docstring_example_runs(observer):
    """The decode loop shown in ``capture_core.__doc__`` works as printed."""
    doc = capture_core.__doc__
    lines = []
    for line in doc.split("::\n\n", 1)[1].splitlines():
        if line and not line.startswith("    "):
            break  # the prose after the indented block
        lines.append(line[4:])
    code = "\n".join(lines)
    namespace: dict = {}
    exec(compile(code, "capture_core.__doc__", "exec"), namespace)
    runner = namespace["runner"]
    assert runner.runtime.locked and len(runner.graphs) == 4
    assert namespace["tokens"].shape == (3,)
