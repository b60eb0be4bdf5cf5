"""Fixtures for the dashboard: a real SQLite file, migrated by the store and seeded with two runs.

Migrating and seeding take a few seconds, so they happen once per session into a template file;
each test gets its own copy.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from dashboard.app import create_app
from inspector.storage.store import Store, open_store
from inspector.storage.writer import record_compile_event
from inspector.watch.compile_log import SKIP_LOGGER, compile_event_from_record
from inspector.watch.watcher import CompileEvent, CompileEventKind
from tests.support.browser import CHROMIUM, chromium
from tests.support.sample import seed_sample

COMPILE_SKIPS = [
    # (template, times heard): torch.compile's own skip line, as the watch hears it.
    ("skipping cudagraphs due to mutated inputs (1 instances). Found from : model.py:362", 9),
]
COMPILE_RERECORDS = [
    # (function, reason, message, times): re-records, as the watch reads them off the trees' frames.
    ("forward", "static input data pointer changed",
     "[0/0] torch.compile re-recorded forward: static input data pointer changed; "
     "inputs whose address changed: L_kv_cache_ 2x8x64", 4),
    ("decode_step", "<script>window.__pwned = 3</script> changed", "[1/0] re-recorded decode_step", 1),
]


def add_compile_events(store: Store, run_id: int, now: float) -> int:
    """Write torch.compile skips and re-records for ``run_id`` the way ``graph-inspector watch`` does:
    its log filter and its capture hook make the events, the write module records them."""
    events = [
        compile_event_from_record(logging.LogRecord(SKIP_LOGGER, logging.WARNING, "", 1, text, (), None))
        for text, times in COMPILE_SKIPS
        for _ in range(times)
    ]
    events += [
        CompileEvent(CompileEventKind.RERECORD, reason, message, function)
        for function, reason, message, times in COMPILE_RERECORDS
        for _ in range(times)
    ]
    with store.writer() as conn:
        for i, event in enumerate(events):
            assert event is not None
            record_compile_event(conn, run_id, dataclasses.replace(event, seen_at=now - 60 + i))
    return len(events)


@pytest.fixture(scope="session")
def seeded_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("template") / "inspector.db"
    store = open_store(f"sqlite:///{path}", upgrade=True)
    now = time.time()
    ids = seed_sample(store, now=now)
    add_compile_events(store, ids["cuda_run"], now)
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


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Debian's headless Chromium (one per test module), or a skip where it is not installed."""
    if not CHROMIUM.exists():
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (scripts/setup --dev installs it)")
    with chromium() as launched:
        yield launched


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """When a test that ran the real daemon fails, show what the daemon printed."""
    outcome = yield
    report = outcome.get_result()
    daemon = getattr(item, "funcargs", {}).get("daemon")
    if report.failed and daemon is not None:
        report.sections.append(("graph-inspector serve output", daemon.output or "(nothing)"))
