"""The ``graph-inspector`` command of this checkout, run as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``graph-inspector ARGS``, without $GRAPH_INSPECTOR_DB, from the repository root."""
    env = dict(os.environ)
    env.pop("GRAPH_INSPECTOR_DB", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dashboard.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
