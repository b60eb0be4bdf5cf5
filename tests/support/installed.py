"""Which `graph-inspector` the tests run: this checkout's, or one installed from its wheel.

By default the daemon and CLI tests run the checkout (this interpreter, the repository on its path).
With ``GRAPH_INSPECTOR_INSTALL=DIR`` they run the install in ``DIR`` instead: ``DIR/dist`` holds
the sdist and the wheel built from this checkout (the wheel built from the sdist, as ``python -m
build`` does), ``DIR/venv`` a fresh virtual environment with that wheel installed, run from a folder
outside the checkout with no checkout on its path. `.ci/run` makes one and runs the suite against it:

    python3 -m tests.support.installed DIR      # build the sdist and wheel, install into DIR/venv
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_ENV = "GRAPH_INSPECTOR_INSTALL"
TORCH = "torch==2.13.0"
"""Installed before the wheel: the project's own requirement (torch>=2.4) would pull a CUDA build."""


@dataclass(frozen=True)
class Program:
    """How to start `graph-inspector`: its argv prefix, the folder it runs in and its environment."""

    argv: tuple[str, ...]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    """The interpreter a user's script runs on beside it (``python3 engine.py`` in the README)."""

    @classmethod
    def checkout(cls) -> Program:
        """This checkout, on this interpreter; its scripts import the checkout wherever they run."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        return cls((sys.executable, "-m", "dashboard.cli"), REPO_ROOT, env)

    @classmethod
    def under_test(cls) -> Program:
        """The install named by $GRAPH_INSPECTOR_INSTALL, else the checkout."""
        root = os.environ.get(INSTALL_ENV)
        return Installation(Path(root)).program() if root else cls.checkout()

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.argv, *args], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout)


@dataclass(frozen=True)
class Installation:
    """A wheel built from this checkout and installed into a fresh virtual environment."""

    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def dist(self) -> Path:
        return self.root / "dist"

    def built(self, pattern: str) -> Path:
        [found] = sorted(self.dist.glob(pattern))
        return found

    @property
    def wheel(self) -> Path:
        return self.built("graph_inspector-*.whl")

    @property
    def sdist(self) -> Path:
        return self.built("graph_inspector-*.tar.gz")

    def program(self) -> Program:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return Program((str(self.venv / "bin" / "graph-inspector"),), self.root, env,
                       str(self.venv / "bin" / "python"))

    def python(self, code: str) -> str:
        """Run ``code`` in the install's interpreter (outside the checkout); return what it printed."""
        program = self.program()
        done = subprocess.run([str(self.venv / "bin" / "python"), "-c", code], cwd=program.cwd,
                              env=program.env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"the install's python failed ({done.returncode}):\n{code}\n{done.stderr}")
        return done.stdout

    @classmethod
    def create(cls, root: Path) -> Installation:
        """Build the sdist and wheel of this checkout into ``root/dist`` and install the wheel into a
        fresh ``root/venv``, torch first (the CPU build from local disk)."""
        made = cls(root)
        if REPO_ROOT in (root.resolve(), *root.resolve().parents):
            raise ValueError(f"{root} is inside the checkout; the install must not see it")
        if root.exists() and any(root.iterdir()):
            if not made.venv.is_dir():
                raise ValueError(f"{root} is not empty and holds no earlier install; pick another folder")
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        _step([sys.executable, "-m", "build", "--outdir", str(made.dist), str(REPO_ROOT)])
        _step([sys.executable, "-m", "venv", str(made.venv)])
        pip = [str(made.venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _step([*pip, TORCH], cwd=root)
        # With the PostgreSQL driver, as a daemon on PostgreSQL is installed (graph-inspector[postgres]):
        # the fleet benchmark's test serves a PostgreSQL database through this install.
        _step([*pip, f"{made.wheel}[postgres]"], cwd=root)
        return made


def _step(command: list[str], cwd: Path = REPO_ROOT) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder for dist/ and venv/ (replaced; outside the checkout)")
    args = parser.parse_args(argv)
    made = Installation.create(args.root)
    print(f"built {made.sdist.name} and {made.wheel.name}; installed into {made.venv}")
    print(f"run the tests against it: {INSTALL_ENV}={args.root} python3 -m pytest")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
