"""The access token: every page, API call and scrape needs it when set; /healthz stays open."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from dashboard.app import create_app
from dashboard.auth import COOKIE

TOKEN = "s3cret-token"


@pytest.fixture
def guarded(db_url: str, seeded: dict[str, int]) -> Iterator[Flask]:
    app = create_app(db_url, token=TOKEN)
    yield app
    app.extensions["graph_inspector"].store.dispose()


API_URLS = ["/api/summary", "/api/graphs", "/api/violations", "/api/runs", "/api/graphs/1"]
PAGE_URLS = ["/", "/graphs", "/graphs/1", "/violations", "/runs", "/runs/compare?a=1&b=2"]


@pytest.mark.parametrize("url", API_URLS)
def test_api_without_token_is_401_in_the_envelope(guarded: Flask, url: str) -> None:
    response = guarded.test_client().get(url)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    body = response.get_json()
    assert body["ok"] is False and body["status"] == 401 and "token" in body["error"]


@pytest.mark.parametrize("url", PAGE_URLS)
def test_pages_without_token_are_401_and_show_no_data(guarded: Flask, url: str) -> None:
    response = guarded.test_client().get(url)
    assert response.status_code == 401
    text = response.get_data(as_text=True)
    assert "access token" in text and "gpu-node-07" not in text


def test_wrong_token_is_refused_everywhere(guarded: Flask) -> None:
    client = guarded.test_client()
    wrong = {"Authorization": "Bearer not-the-token"}
    assert client.get("/api/summary", headers=wrong).status_code == 401
    assert client.get("/api/summary?token=nope").status_code == 401
    client.set_cookie(COOKIE, "nope")
    assert client.get("/").status_code == 401


def test_bearer_header_opens_the_api(guarded: Flask) -> None:
    response = guarded.test_client().get("/api/summary", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and response.get_json()["ok"] is True


def test_token_in_the_url_once_becomes_a_cookie_and_leaves_the_address_bar(guarded: Flask) -> None:
    client = guarded.test_client()
    first = client.get(f"/violations?kind=address_drift&token={TOKEN}")
    assert first.status_code == 302
    assert first.headers["Location"] == "/violations?kind=address_drift"
    cookie = client.get_cookie(COOKIE)
    assert cookie is not None and cookie.value == TOKEN and cookie.http_only
    assert client.get("/violations?kind=address_drift").status_code == 200
    assert client.get("/api/runs").status_code == 200


def test_metrics_need_the_token_but_healthz_does_not(guarded: Flask) -> None:
    client = guarded.test_client()
    assert client.get("/metrics").status_code == 401
    scraped = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert scraped.status_code == 200 and b"# TYPE" in scraped.data
    health = client.get("/healthz")
    assert health.status_code == 200 and health.get_json()["ok"] is True


def test_without_a_token_everything_is_open(client: FlaskClient) -> None:
    assert client.get("/api/summary").status_code == 200
    assert client.get("/metrics").status_code == 200
