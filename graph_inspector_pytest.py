"""graph-inspector's pytest plugin entry point (``pytest11``), under a name no project has.

The plugin is ``inspector.gating.pytest_plugin``. A project with a package of its own named
``inspector`` (or ``capture_core``) first on the path shadows graph-inspector's, and an entry point
naming the plugin there would stop every test run of that project at start-up (pytest exits 3).
This module loads the plugin when it can be imported; when it cannot, the run goes on without it
and its summary says in one line what shadows it. A run that asks for the plugin (a ``--graph-*``
option, the ``graph_observer`` fixture) is told the same line instead of being silently unchecked.

It imports pytest and the standard library only, whatever is installed beside it.
"""

from __future__ import annotations

import importlib
import sys

import pytest

PLUGIN = "inspector.gating.pytest_plugin"
OPTIONS = {"--graph-debug": True, "--graph-report": False, "--graph-baseline": False,
           "--graph-save-baseline": False, "--graph-thresholds": False}
"""The plugin's options (True: a flag, False: takes a PATH), known here to refuse them when it is off."""


def what_shadows(error: ImportError) -> str:
    """The one line a run without the plugin is told: which package of the project took the name."""
    top = (error.name or PLUGIN).partition(".")[0]
    found = getattr(sys.modules.get(top), "__file__", None) or "a module without a file"
    return (f"graph-inspector: its pytest plugin is off in this run: the package {top!r} found first on the "
            f"path is {found}, not graph-inspector's, so its checks, the graph_observer fixture and the "
            f"--graph-* options are unavailable (import {PLUGIN}: {error})")


try:
    # The plugin's package, not the plugin: pytest imports that itself (to rewrite its asserts), and
    # warns of a plugin module imported before it.
    importlib.import_module(PLUGIN.rpartition(".")[0])
except ImportError as error:
    WHY_OFF = what_shadows(error)

    def pytest_addoption(parser: pytest.Parser) -> None:
        group = parser.getgroup("terminal reporting")
        for name, flag in OPTIONS.items():
            group.addoption(name, action="store_true" if flag else "store", default=None,
                            help="graph-inspector: unavailable in this run (see the header's line)")

    def pytest_configure(config: pytest.Config) -> None:
        asked = [name for name in OPTIONS if config.getoption(name.lstrip("-").replace("-", "_"))]
        if asked:
            raise pytest.UsageError(f"{', '.join(asked)}: {WHY_OFF}")

    def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.write_line(WHY_OFF, yellow=True)

    @pytest.fixture
    def graph_observer() -> None:
        pytest.fail(WHY_OFF, pytrace=False)
else:
    WHY_OFF = None
    pytest_plugins = [PLUGIN]
