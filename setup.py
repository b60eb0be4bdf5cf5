"""The build step that puts the dashboard's chart library and the database migrations into the wheel
(metadata: pyproject.toml).

The chart library (Chart.js) comes from npm, pinned by ``dashboard/assets/package-lock.json``, and
is never committed. Building a wheel runs ``npm ci`` on a copy of that lock file in a scratch folder
and copies ``chart.umd.js`` (with its licence) to ``dashboard/vendor/`` inside the wheel, where the
installed daemon finds it. The checkout is never written to. An editable install (``pip install
-e``, scripts/setup) skips this: it serves the checkout's own ``dashboard/assets/node_modules``.

The Alembic migrations live in the checkout's top-level ``migrations`` folder; the wheel carries
them as ``inspector/migrations`` (files, found by path), never as a package named ``migrations``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import SetupError

MIGRATIONS = Path("migrations")
MIGRATION_FILES = ("env.py", "script.py.mako", "versions/*.py")
INSTALLED_MIGRATIONS = Path("inspector") / "migrations"
"""Where the wheel carries them: found by path from the inspector package (``inspector.storage.schema``),
so the wheel installs nothing under the bare name ``migrations`` for a project's own to meet."""
ASSETS = Path("dashboard") / "assets"
VENDOR = Path("dashboard") / "vendor"
CHART_FILES = {"dist/chart.umd.js": "chart.umd.js", "LICENSE.md": "chart.js-LICENSE.md"}
NPM_CI = ["npm", "ci", "--omit=dev", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline"]


def bundle_chart_library(target: Path) -> list[str]:
    """Install the locked chart library in a scratch folder and copy its browser build to ``target``."""
    npm = shutil.which("npm")
    if npm is None:
        raise SetupError(
            "building graph-inspector's wheel needs npm (Node.js) to fetch the dashboard's chart library "
            f"pinned in {ASSETS / 'package-lock.json'}; install it (`apt-get install npm`) and build again"
        )
    with tempfile.TemporaryDirectory(prefix="graph-inspector-npm-") as scratch:
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(ASSETS / name, Path(scratch) / name)
        done = subprocess.run([npm, *NPM_CI[1:]], cwd=scratch, capture_output=True, text=True)
        if done.returncode != 0:
            raise SetupError(f"`{' '.join(NPM_CI)}` for the dashboard's chart library failed:\n{done.stderr}")
        target.mkdir(parents=True, exist_ok=True)
        package = Path(scratch) / "node_modules" / "chart.js"
        copied = []
        for source, name in CHART_FILES.items():
            shutil.copyfile(package / source, target / name)
            copied.append(str(target / name))
        return copied


def copy_migrations(target: Path) -> list[str]:
    """The checkout's top-level ``migrations`` folder (Alembic's env.py, its template, the revisions)
    into ``target``: files read by path, not a package."""
    copied = []
    for pattern in MIGRATION_FILES:
        for source in sorted(MIGRATIONS.glob(pattern)):
            destination = target / source.relative_to(MIGRATIONS)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
            copied.append(str(destination))
    return copied


class BuildPyWithChartLibrary(build_py):
    """``build_py``, then the chart library and the migrations into the build folder (not for
    editable installs: they read the checkout's)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            built = Path(self.build_lib)
            self._bundled = bundle_chart_library(built / VENDOR)
            self._bundled += copy_migrations(built / INSTALLED_MIGRATIONS)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *getattr(self, "_bundled", [])]


setup(cmdclass={"build_py": BuildPyWithChartLibrary})
