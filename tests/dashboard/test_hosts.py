"""DNS rebinding: without a token the daemon answers only to loopback names and `--allow-host` ones;
a page that pointed its own name at 127.0.0.1 gets a 403 that says why, on every route."""

from __future__ import annotations

import http.client
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask

from dashboard.app import create_app
from dashboard.hosts import host_name, is_loopback
from tests.support.daemon import Daemon

TOKEN = "t0ken"
ROUTES = ["/", "/graphs", "/api/summary", "/api/runs", "/metrics", "/healthz", "/api/openapi.json"]
LOOPBACK_HOSTS = ["127.0.0.1:8050", "localhost:8050", "LOCALHOST", "[::1]:8050", "127.3.4.5",
                  "dash.localhost:8050", "localhost."]
FOREIGN_HOSTS = ["attacker.example:8050", "attacker.example", "127.0.0.1.attacker.example",
                 "localhost.attacker.example", "10.0.0.8:8050", "[2001:db8::1]:8050"]


def make_app(db_url: str, **options) -> Iterator[Flask]:
    app = create_app(db_url, **options)
    yield app
    app.extensions["graph_inspector"].store.dispose()


@pytest.fixture
def open_app(db_url: str, seeded: dict[str, int]) -> Iterator[Flask]:
    yield from make_app(db_url)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("app.localhost", True), ("0.0.0.0", False), ("10.0.0.8", False), ("::", False), ("gpu-node-07", False),
    ("localhost.example.org", False),
])
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("header", "name"), [
    ("Dash.Example.org:443", "dash.example.org"), ("[::1]:8050", "[::1]"), ("localhost.", "localhost"),
    ("example.org", "example.org"),
])
def test_a_host_header_is_read_as_its_name(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize("route", ROUTES)
def test_loopback_names_are_answered_and_any_other_is_refused_without_a_token(open_app: Flask, route: str
                                                                              ) -> None:
    client = open_app.test_client()
    for host in LOOPBACK_HOSTS:
        assert client.get(route, headers={"Host": host}).status_code == 200, host
    for host in FOREIGN_HOSTS:
        response = client.get(route, headers={"Host": host})
        assert response.status_code == 403, host
        text = response.get_data(as_text=True)
        assert "DNS rebinding" in text and "--allow-host" in text
        assert "gpu-node-07" not in text and "# TYPE" not in text
        if route.startswith("/api/") or route == "/healthz":
            body = response.get_json()
            assert body["ok"] is False and body["status"] == 403


def test_allow_host_adds_the_names_a_proxy_forwards(db_url: str, seeded: dict[str, int]) -> None:
    for app in make_app(db_url, allowed_hosts=["Dash.Example.org", "gpu-node-07:443"]):
        client = app.test_client()
        assert client.get("/api/summary", headers={"Host": "dash.example.org"}).status_code == 200
        assert client.get("/metrics", headers={"Host": "gpu-node-07:8050"}).status_code == 200
        assert client.get("/", headers={"Host": "localhost:8050"}).status_code == 200
        assert client.get("/", headers={"Host": "attacker.example"}).status_code == 403


def test_with_a_token_any_name_is_answered_unless_names_are_allowed(db_url: str, seeded: dict[str, int]
                                                                    ) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for app in make_app(db_url, token=TOKEN):
        client = app.test_client()
        assert client.get("/api/summary", headers={"Host": "gpu-node-07", **bearer}).status_code == 200
        assert client.get("/api/summary", headers={"Host": "gpu-node-07"}).status_code == 401
    for app in make_app(db_url, token=TOKEN, allowed_hosts=["dash.example.org"]):
        client = app.test_client()
        assert client.get("/api/summary", headers={"Host": "dash.example.org", **bearer}).status_code == 200
        assert client.get("/api/summary", headers={"Host": "gpu-node-07", **bearer}).status_code == 403


def test_head_of_a_refused_name_has_no_body(open_app: Flask) -> None:
    response = open_app.test_client().head("/", headers={"Host": "attacker.example"})
    assert response.status_code == 403 and response.data == b""


# ------------------------------------------------------------------------------ the real daemon


@pytest.fixture(scope="module")
def served(seeded_template: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Daemon]:
    path = tmp_path_factory.mktemp("hosts") / "inspector.db"
    shutil.copyfile(seeded_template[0], path)
    with Daemon(f"sqlite:///{path}", extra_args=["--allow-host", "dash.example.org"]) as daemon:
        yield daemon


def _get(daemon: Daemon, path: str, host: str) -> tuple[int, bytes]:
    """A request as a browser sends it after DNS rebinding: to 127.0.0.1, with the page's Host."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": host})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("route", ["/", "/api/violations", "/metrics"])
def test_the_daemon_refuses_a_rebound_name_and_serves_loopback_and_allowed_ones(served: Daemon, route: str
                                                                                ) -> None:
    status, body = _get(served, route, f"attacker.example:{served.port}")
    assert status == 403 and b"DNS rebinding" in body
    assert _get(served, route, f"127.0.0.1:{served.port}")[0] == 200
    assert _get(served, route, f"localhost:{served.port}")[0] == 200
    assert _get(served, route, "dash.example.org")[0] == 200
