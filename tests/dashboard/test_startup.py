"""The daemon starts without importing torch: it only reads the database."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_dashboard_app_does_not_import_torch() -> None:
    code = "import dashboard.app, json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert "flask" in loaded and "torch" not in loaded
