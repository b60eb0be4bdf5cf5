"""Every answer carries the security headers: pages, API, files, /metrics (200 and 401, GET and
HEAD), /healthz, errors and the host check's refusals, in-process and from the real daemon."""

from __future__ import annotations

import http.client
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask

from dashboard.app import create_app
from tests.support.daemon import Daemon

TOKEN = "t0ken"
EXPECTED = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
}


def assert_secured(headers: object, what: str) -> None:
    for name, value in EXPECTED.items():
        assert headers.get(name) == value, f"{what}: {name} is {headers.get(name)!r}"  # type: ignore[attr-defined]


@pytest.fixture
def guarded(db_url: str, seeded: dict[str, int]) -> Iterator[Flask]:
    app = create_app(db_url, token=TOKEN)
    yield app
    app.extensions["graph_inspector"].store.dispose()


@pytest.mark.parametrize(("method", "url", "status"), [
    ("GET", "/", 200), ("GET", "/api/summary", 200), ("GET", "/metrics", 200), ("HEAD", "/metrics", 200),
    ("GET", "/healthz", 200), ("GET", "/nowhere", 404), ("GET", "/api/graphs/999999", 404),
    ("GET", "/api/openapi.json", 200),
])
def test_every_answer_of_an_open_daemon_is_secured(app: Flask, method: str, url: str, status: int) -> None:
    response = app.test_client().open(url, method=method)
    assert response.status_code == status
    assert_secured(response.headers, f"{method} {url}")


def test_a_refused_host_is_secured(app: Flask) -> None:
    response = app.test_client().get("/metrics", headers={"Host": "attacker.example"})
    assert response.status_code == 403
    assert_secured(response.headers, "403 for another Host")


@pytest.mark.parametrize(("method", "url", "status", "authorised"), [
    ("GET", "/metrics", 401, False), ("HEAD", "/metrics", 401, False), ("GET", "/metrics", 200, True),
    ("GET", "/api/runs", 401, False), ("GET", "/", 401, False), ("GET", "/healthz", 200, False),
])
def test_every_answer_of_a_guarded_daemon_is_secured(guarded: Flask, method: str, url: str, status: int,
                                                     authorised: bool) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"} if authorised else {}
    response = guarded.test_client().open(url, method=method, headers=headers)
    assert response.status_code == status
    assert_secured(response.headers, f"{method} {url} ({status})")


def test_the_static_files_and_the_chart_library_are_secured(client) -> None:
    html = client.get("/").get_data(as_text=True)
    for asset in ("/static/", "/assets/"):
        start = html.index(f'"{asset}') + 1
        url = html[start:html.index('"', start)]
        response = client.get(url)
        assert response.status_code == 200, url
        assert_secured(response.headers, url)


@pytest.fixture(scope="module")
def served(seeded_template: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Daemon]:
    path = tmp_path_factory.mktemp("headers") / "inspector.db"
    shutil.copyfile(seeded_template[0], path)
    with Daemon(f"sqlite:///{path}", extra_args=["--token", TOKEN]) as daemon:
        yield daemon


@pytest.mark.parametrize("authorised", [True, False], ids=["200", "401"])
def test_the_daemon_s_metrics_answers_say_nosniff(served: Daemon, authorised: bool) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"} if authorised else {})
        response = conn.getresponse()
        response.read()
    finally:
        conn.close()
    assert response.status == (200 if authorised else 401)
    assert_secured(response.headers, f"/metrics {response.status}")
