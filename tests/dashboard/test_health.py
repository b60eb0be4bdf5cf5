"""`/healthz` keeps liveness apart from degradation: 200 while the database can be read, with what is
degraded named in the body; 503 only when the database cannot be read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text

from dashboard.app import create_app


@pytest.fixture
def no_charts(db_url: str, seeded: dict[str, int], tmp_path: Path) -> Iterator[Flask]:
    app = create_app(db_url, test_config={"CHART_JS": tmp_path / "absent" / "chart.umd.js"})
    yield app
    app.extensions["graph_inspector"].store.dispose()


def test_a_healthy_daemon_answers_ok_with_nothing_degraded(client: FlaskClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.get_json()
    assert body["ok"] is True
    assert body["data"]["status"] == "ok" and body["data"]["degraded"] == []
    assert body["data"]["database"] == "reachable"
    assert body["data"]["schema"]["revision"] == body["data"]["schema"]["head"]
    assert body["data"]["chart_library"] == "present"


def test_a_missing_chart_library_is_degraded_not_down(no_charts: Flask) -> None:
    response = no_charts.test_client().get("/healthz")
    assert response.status_code == 200
    body = response.get_json()
    assert body["ok"] is True and body["data"]["status"] == "degraded"
    assert body["data"]["chart_library"] == "missing"
    [reason] = body["data"]["degraded"]
    assert "chart library is not installed" in reason and "npm ci" in reason


def test_a_schema_off_head_is_degraded_and_says_how_to_fix_it(app: Flask) -> None:
    with app.extensions["graph_inspector"].store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0001'"))
    body = app.test_client().get("/healthz").get_json()
    assert body["ok"] is True and body["data"]["status"] == "degraded"
    assert body["data"]["schema"]["revision"] == "0001"
    [reason] = body["data"]["degraded"]
    assert "graph-inspector db upgrade" in reason


def test_an_unreadable_database_is_the_one_503(app: Flask, db_url: str) -> None:
    path = Path(db_url.removeprefix("sqlite:///"))
    store = app.extensions["graph_inspector"].store
    store.engine.dispose()
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    response = app.test_client().get("/healthz")
    assert response.status_code == 503
    body = response.get_json()
    assert body["ok"] is False and body["status"] == 503
    assert body["data"] == {"database": "unreachable"}
    assert "not a readable SQLite database" in body["error"]
