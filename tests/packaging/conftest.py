"""The installed wheel the packaging tests run: the one under $GRAPH_INSPECTOR_INSTALL when set
(`.ci/run` makes one), else one built from this checkout once per session."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from tests.support.installed import INSTALL_ENV, Installation


@pytest.fixture(scope="session")
def installation(tmp_path_factory: pytest.TempPathFactory) -> Installation:
    root = os.environ.get(INSTALL_ENV)
    if root:
        return Installation(Path(root))
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is not installed (scripts/setup --dev installs it)")
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: building the wheel fetches the chart library with it")
    return Installation.create(tmp_path_factory.mktemp("wheel"))
