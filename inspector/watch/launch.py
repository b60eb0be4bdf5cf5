"""Starting a watch inside a process that `graph-inspector watch` launched, without editing it.

The command puts ``bootstrap/`` first on PYTHONPATH and the watch settings in an environment
variable. Python imports ``bootstrap/sitecustomize.py`` at start-up in the script's process and in
every Python process it starts (torchrun's ranks, spawned workers), which calls ``arm()``: the
hooks go in when torch is imported - at once if it already is, else right after ``import torch``
finishes - so processes that never touch torch pay nothing, and nothing is recorded until a graph
is captured.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from dataclasses import asdict, dataclass
from typing import Any

ENV_VAR = "GRAPH_INSPECTOR_WATCH"
"""JSON settings for the watched processes (see ``WatchSettings``)."""
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class WatchSettings:
    db: str
    label: str = "watch"
    ready_after: int | None = None
    storm_threshold: int = 3
    storm_window_s: float = 60.0

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> WatchSettings:
        return cls(**json.loads(text))


def child_environment(settings: WatchSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the watched command: bootstrap first on PYTHONPATH, settings set."""
    env = dict(os.environ if base is None else base)
    paths = [BOOTSTRAP_DIR, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[ENV_VAR] = settings.to_env()
    return env


def arm() -> None:
    """Install the watch when torch is (or gets) imported, per the settings in the environment."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return
    settings = WatchSettings.from_env(text)
    if "torch" in sys.modules:
        _install(settings)
    else:
        sys.meta_path.insert(0, _AfterTorchImport(settings))


def _install(settings: WatchSettings) -> None:
    """Install the watch; on failure say so and let the program run unwatched."""
    try:
        from inspector.watch.api import install, uninstall

        install(
            settings.db,
            ready_after=settings.ready_after,
            storm_threshold=settings.storm_threshold,
            storm_window_s=settings.storm_window_s,
            label=settings.label,
        )
    except Exception as exc:  # runs inside the program's `import torch`: never break it
        print(f"graph-inspector watch: not watching this process: {exc}", file=sys.stderr)
        return
    atexit.register(uninstall)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds torch the normal way, and makes its loader install the watch once torch is loaded."""

    def __init__(self, settings: WatchSettings) -> None:
        self.settings = settings

    def find_spec(self, fullname: str, path: Any = None, target: types.ModuleType | None = None) -> Any:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders, as the import would
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        settings = self.settings

        def exec_then_install(module: types.ModuleType) -> None:
            exec_module(module)
            del loader.exec_module  # back to the loader's own method
            _install(settings)

        loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


def chain_sitecustomize(bootstrap_dir: str) -> None:
    """Run the sitecustomize ours shadows, if the environment has one (Debian's, a venv's...)."""
    here = os.path.abspath(bootstrap_dir)
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return
