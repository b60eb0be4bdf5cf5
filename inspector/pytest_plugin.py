"""pytest plugin (entry point ``pytest11``): graph-inspector options for test sessions."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graph-inspector", "CUDA-graph inspection")
    group.addoption(
        "--graph-debug",
        action="store_true",
        default=False,
        help="Check graph input addresses on every replay (sets GRAPH_INSPECTOR_DEBUG=1).",
    )
    group.addoption(
        "--graph-report",
        metavar="PATH",
        default=None,
        help="Write graph findings to PATH (JUnit XML, or JSON when PATH ends in .json).",
    )
