"""The wheel works anywhere: built with `python -m build` (the wheel from the sdist), installed into a
fresh virtual environment outside the checkout, it runs the demo and serves a dashboard whose
charts draw and whose /healthz answers 200, with no warning on the way.

Uses the install under $GRAPH_INSPECTOR_INSTALL when set (`.ci/run` makes one), else builds one
(tests/packaging/conftest.py).
"""

from __future__ import annotations

import json
import re
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.support.browser import CHARTS_DRAWN, CHROMIUM, chromium
from tests.support.daemon import Daemon
from tests.support.installed import REPO_ROOT, Installation

pytestmark = pytest.mark.slow

SERVED_FOLDERS = {
    "dashboard/templates": "dashboard/templates", "dashboard/static": "dashboard/static",
    "dashboard/grafana": "dashboard/grafana", "migrations/versions": "inspector/migrations/versions",
}
"""The checkout's folders the installed daemon reads, and where the wheel carries each."""


@pytest.fixture(scope="session")
def demo_db(installation: Installation) -> str:
    """A database the installed `graph-inspector demo --no-serve` recorded."""
    url = f"sqlite:///{installation.root / 'demo.db'}"
    if not (installation.root / "demo.db").exists():
        done = installation.program().run("demo", "--no-serve", "--steps", "120", "--db", url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Failed to initialize NumPy" not in done.stdout + done.stderr
    return url


def tracked(folder: str) -> set[str]:
    """The checkout's files under ``folder`` (relative names), less bytecode and ``__init__.py``."""
    found = (path.relative_to(REPO_ROOT) for path in (REPO_ROOT / folder).rglob("*") if path.is_file())
    return {str(path) for path in found
            if "__pycache__" not in path.parts and path.name != "__init__.py"}


def test_the_wheel_carries_what_the_daemon_serves(installation: Installation) -> None:
    names = set(zipfile.ZipFile(installation.wheel).namelist())
    for folder, carried in SERVED_FOLDERS.items():
        wanted = {name.replace(folder, carried, 1) for name in tracked(folder)}
        assert wanted and wanted <= names, f"{folder}: {sorted(wanted - names)}"
    assert {"dashboard/vendor/chart.umd.js", "dashboard/vendor/chart.js-LICENSE.md", "dashboard/openapi.json",
            "capture_core/reference/data/azure_conv_2023.csv", "inspector/migrations/env.py",
            "inspector/migrations/script.py.mako", "graph_inspector_pytest.py"} <= names
    assert not [n for n in names if "node_modules" in n or n.startswith(("tests/", "bench/", "scripts/"))]
    # Nothing under a name a project of its own may hold: its own `migrations` package would meet it.
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"capture_core", "dashboard", "inspector", "graph_inspector_pytest.py"}


def test_the_sdist_holds_what_building_the_wheel_needs(installation: Installation) -> None:
    with tarfile.open(installation.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "dashboard/assets/package.json",
            "dashboard/assets/package-lock.json"} <= names
    assert not [n for n in names if "node_modules" in n or "vendor/" in n]


def test_the_install_imports_from_its_venv_not_the_checkout(installation: Installation) -> None:
    printed = installation.python(
        "import capture_core, dashboard, inspector, dashboard.assets as a\n"
        "from inspector.storage.schema import migrations_dir\n"
        "for m in (capture_core, dashboard, inspector): print(m.__file__)\n"
        "print(migrations_dir() / 'env.py'); print(a.CHART_JS)"
    )
    paths = [Path(line) for line in printed.split()]
    assert len(paths) == 5
    for path in paths:
        assert installation.venv in path.parents and REPO_ROOT not in path.parents, path
    assert paths[-1].name == "chart.umd.js" and paths[-1].is_file()


def test_commands_start_without_warnings(installation: Installation) -> None:
    done = installation.program().run("--version")
    assert done.returncode == 0 and done.stdout.startswith("graph-inspector 0.")
    assert "Failed to initialize NumPy" not in done.stderr
    printed = installation.python(
        "import warnings; warnings.simplefilter('error')\n"  # any warning on import fails the run
        "import torch, capture_core, inspector, dashboard.app; print(torch.zeros(2).numpy().sum())"
    )
    assert printed == "0.0\n"


def test_the_installed_demo_records_and_serve_is_healthy(installation: Installation, demo_db: str) -> None:
    with Daemon(demo_db, program=installation.program()) as daemon:
        with urllib.request.urlopen(daemon.url + "healthz", timeout=30) as response:
            assert response.status == 200
            health = json.load(response)
        with urllib.request.urlopen(daemon.url + "api/summary", timeout=30) as response:
            summary = json.load(response)["data"]
        with urllib.request.urlopen(daemon.url, timeout=30) as response:
            html = response.read().decode()
        chart = re.search(r'<script src="(/assets/chart\.[0-9a-f]{16}\.umd\.js)"', html)
        assert chart, "the overview links no chart library"
        with urllib.request.urlopen(daemon.url + chart.group(1).lstrip("/"), timeout=30) as response:
            assert response.status == 200 and b"Chart" in response.read()
    assert health["data"]["status"] == "ok" and health["data"]["chart_library"] == "present", health
    assert summary["graphs"]["count"] > 0 and summary["violations"]["findings"] > 0


@pytest.mark.browser
def test_the_installed_dashboard_draws_its_charts(installation: Installation, demo_db: str) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (scripts/setup --dev installs it)")
    with Daemon(demo_db, program=installation.program()) as daemon, chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(daemon.url, wait_until="networkidle")
        assert "Chart unavailable" not in page.locator("main").inner_text()
        assert page.evaluate(CHARTS_DRAWN) == {
            "chart-series": True, "chart-waste": True, "chart-batches": True, "chart-memory": True,
        }
