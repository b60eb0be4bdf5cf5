"""Fixtures for the dashboard: a real SQLite file, migrated by the store and seeded with two runs.

Migrating and seeding take a few seconds, so they happen once per session into a template file;
each test gets its own copy.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from dashboard.app import create_app
from dashboard.sample import seed_sample
from inspector.store import Store, open_store


@pytest.fixture(scope="session")
def seeded_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("template") / "inspector.db"
    store = open_store(f"sqlite:///{path}", upgrade=True)
    ids = seed_sample(store.engine, now=time.time())
    with store.engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    store.dispose()
    return path, ids


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """An empty database's URL (the store creates and migrates it on first open)."""
    return f"sqlite:///{tmp_path / 'inspector.db'}"


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """An empty, migrated database."""
    opened = open_store(db_url, upgrade=True)
    yield opened
    opened.dispose()


@pytest.fixture
def seeded(seeded_template: tuple[Path, dict[str, int]], tmp_path: Path) -> dict[str, int]:
    """A copy of the seeded sample at ``db_url``; returns the ids of its runs, graphs and violations."""
    template, ids = seeded_template
    shutil.copyfile(template, tmp_path / "inspector.db")
    return ids


@pytest.fixture
def app(db_url: str, seeded: dict[str, int]) -> Iterator[Flask]:
    app = create_app(db_url)
    yield app
    app.extensions["graph_inspector"].store.dispose()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """When a test that ran the real daemon fails, show what the daemon printed."""
    outcome = yield
    report = outcome.get_result()
    daemon = getattr(item, "funcargs", {}).get("daemon")
    if report.failed and daemon is not None:
        report.sections.append(("graph-inspector serve output", daemon.output or "(nothing)"))
