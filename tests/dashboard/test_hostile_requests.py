"""No request gets a 5xx: ids and numbers past the database's 64 bits are a 400 that names the
parameter, query keys never reach url_for, HEAD is answered everywhere (/metrics too, without
breaking a keep-alive connection), and a property test sends hostile requests to every route with
every method (the strategies of tests/support/fuzz.py; bench/fuzz_requests.py sends thousands)."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import flask
import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from werkzeug.datastructures import ImmutableMultiDict
from werkzeug.exceptions import HTTPException

from dashboard import resources
from dashboard.app import create_app
from dashboard.links import QUERY_PARAMS
from dashboard.params import MAX_INTEGER
from tests.support.daemon import Daemon
from tests.support.fuzz import METHODS, METRICS, FuzzRequest, app_routes, encode, problems, requests
from tests.support.installed import REPO_ROOT

TOO_BIG = MAX_INTEGER + 1
TEMPLATES = Path(resources.__file__).parent / "templates"
FUZZ = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
"""In-process requests take milliseconds: 400 of them stay well under a minute even on a busy CI
machine (the benchmark sends 5,000 to the real server)."""


@pytest.fixture
def guarded(db_url: str, seeded: dict[str, int]) -> Iterator[Flask]:
    app = create_app(db_url, token="fuzz-token")
    yield app
    app.extensions["graph_inspector"].store.dispose()


def send(client: FlaskClient, request: FuzzRequest) -> tuple[int, bytes]:
    """The request as a WSGI server hands it over: the path undecoded bytes (as latin-1), the query
    as sent."""
    path = re.sub(rb"%([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]), request.path.encode())
    response = client.open(request.path, method=request.method, environ_overrides={
        "PATH_INFO": path.decode("latin-1"), "QUERY_STRING": request.query, "REQUEST_URI": request.target,
    })
    return response.status_code, response.get_data()


def error_of(client: FlaskClient, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 400, response.get_data(as_text=True)[:300]
    if url.startswith("/api/"):
        return response.get_json()["error"]
    return response.get_data(as_text=True)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (f"/api/graphs/{TOO_BIG}", f"graph id must be between 1 and {MAX_INTEGER}, got {TOO_BIG}"),
        (f"/graphs/{TOO_BIG}", f"graph id must be between 1 and {MAX_INTEGER}, got {TOO_BIG}"),
        (f"/api/violations/{2**64}", f"violation id must be between 1 and {MAX_INTEGER}, got {2**64}"),
        (f"/api/runs/{-TOO_BIG}", f"run id must be between 1 and {MAX_INTEGER}, got {-TOO_BIG}"),
        (f"/api/summary?run={TOO_BIG}", f"run must be between 1 and {MAX_INTEGER}, got {TOO_BIG}"),
        (f"/api/graphs?size={TOO_BIG}", f"size must be between 1 and {MAX_INTEGER}"),
        (f"/violations?run={TOO_BIG}", "run must be between"),
        (f"/api/compile?run={TOO_BIG}", "run must be between"),
        (f"/api/runs/compare?a={TOO_BIG}&b=1", "a must be between"),
        (f"/runs/compare?a=1&b={TOO_BIG}", "b must be between"),
        (f"/api/graphs?page={10**30}", f"page must be between 1 and 1000000000, got {10**30}"),
        (f"/api/graphs?page={10**50}", "page must be between 1 and 1000000000, got a 51-digit number"),
        ("/api/graphs/" + "9" * 5000, "graph id must be between 1 and 9223372036854775807, got a 5000-digit"),
        ("/api/graphs/1_0", "graph id must be an integer, got '1_0'"),
        ("/api/graphs/%EF%BC%91", "graph id must be an integer, got '\uff11'"),
        ("/api/graphs/%201", "graph id must be an integer, got ' 1'"),
        ("/api/graphs?size=0x10", "size must be an integer, got '0x10'"),
        ("/api/graphs?mode=" + "x" * 1000, "mode must be one of piecewise, full; got 'xxxx"),
    ],
)
def test_numbers_outside_the_database_range_are_a_400_naming_the_parameter(
    client: FlaskClient, url: str, message: str
) -> None:
    assert message in error_of(client, url)


def test_error_messages_repeat_only_the_start_of_a_long_value(client: FlaskClient) -> None:
    message = error_of(client, "/api/graphs?mode=" + "x" * 100_000)
    assert len(message) < 200 and "(100,000 characters)" in message


QUERY_PAGES = ["/", "/graphs", "/violations", "/compile", "/runs", "/runs/compare?a=1&b=2", "/advice"]


@pytest.mark.parametrize("key", ["_method", "endpoint", "_external", "_anchor", "_scheme", "graph_id"])
@pytest.mark.parametrize("path", QUERY_PAGES)
def test_url_for_keywords_in_the_query_are_ignored(client: FlaskClient, path: str, key: str) -> None:
    url = path + ("&" if "?" in path else "?") + f"{key}=POST"
    # A name the host check lets through (a *.localhost one): links never repeat it.
    response = client.get(url, headers={"Host": "attacker.localhost:8050"})
    assert response.status_code == 200, response.get_data(as_text=True)[:300]
    html = response.get_data(as_text=True)
    assert "attacker" not in html and "http://" not in html
    assert f"{key}=" not in html and "POST" not in html


def test_links_carry_the_pages_own_parameters_and_nothing_else(client: FlaskClient, seeded: dict[str, int]
                                                                ) -> None:
    run = seeded["cuda_run"]
    html = client.get(f"/graphs?run={run}&mode=full&per_page=3&junk=1&page=2&page=9").get_data(as_text=True)
    assert f'href="/api/graphs?run={run}&amp;mode=full&amp;page=2&amp;per_page=3"' in html  # the JSON twin
    sort = "sort=pool_bytes&amp;order=asc&amp;page=1"
    assert f'href="/graphs?run={run}&amp;mode=full&amp;{sort}&amp;per_page=3"' in html
    assert f'href="/graphs?run={run}&amp;mode=full&amp;page=3&amp;per_page=3">next' in html
    assert f'href="/graphs?run={run}&amp;mode=full&amp;page=1&amp;per_page=3">' in html  # previous
    assert "junk" not in html and "page=9" not in html
    twin = client.get(f"/runs/compare?a={run}&b={seeded['eager_run']}&x=1").get_data(as_text=True)
    assert f'href="/api/runs/compare?a={run}&amp;b={seeded["eager_run"]}"' in twin


class ReadArgs(ImmutableMultiDict):
    """A request's query that remembers which parameters were asked for."""

    asked: set[str]

    def get(self, key, default=None, type=None):  # type: ignore[no-untyped-def, override]
        self.asked.add(key)
        return super().get(key, default, type)


@pytest.mark.parametrize("resource", sorted(QUERY_PARAMS))
def test_the_links_know_every_parameter_the_resource_reads(app: Flask, resource: str) -> None:
    """A page's links carry exactly what its resource reads: a parameter added to or renamed in
    dashboard.resources without dashboard.links.QUERY_PARAMS would fail here."""
    with app.test_request_context("/"):
        args = ReadArgs()
        args.asked = set()
        flask.request.args = args  # type: ignore[misc]
        with contextlib.suppress(HTTPException):  # compare refuses a query without runs, having read it
            getattr(resources, resource)()
    assert args.asked == set(QUERY_PARAMS[resource])


def test_no_template_hands_the_query_to_url_for() -> None:
    for template in sorted(TEMPLATES.glob("*.html")):
        assert "request.args" not in template.read_text(), f"{template.name}: use url_with_query"


def test_head_is_answered_on_every_route_like_get(app: Flask, client: FlaskClient, seeded: dict[str, int]
                                                  ) -> None:
    for path in concrete_paths(app, seeded):
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code, path
        assert head.get_data() == b"", path
        assert head.headers["Content-Type"] == get.headers["Content-Type"], path
    assert int(client.head(METRICS).headers["Content-Length"]) > 1000  # the scrape's length, which varies


def test_head_of_metrics_without_the_token_is_a_401_without_a_body(guarded: Flask) -> None:
    head = guarded.test_client().head(METRICS)
    assert (head.status_code, head.get_data()) == (401, b"")
    assert head.headers["Content-Length"] == str(len(guarded.test_client().get(METRICS).get_data()))


def concrete_paths(app: Flask, ids: dict[str, int]) -> list[str]:
    """Every route of ``app`` with valid path arguments (and the query a route needs)."""
    rules, known = app_routes(app)
    values = {"graph_id": ids["eager_graph"], "violation_id": ids["drift"], "run_id": ids["eager_run"],
              **{name: options[0] for name, options in known.items()}, "resource": "violations",
              "item_id": ids["drift"]}
    needs = {"/compare": f"?a={ids['cuda_run']}&b={ids['eager_run']}", "<item_id>": "?field=message"}
    return [re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(values[m.group(1)]), rule)
            + "".join(query for end, query in needs.items() if rule.endswith(end)) for rule in rules]


def test_a_doubled_slash_is_no_route_and_the_api_answers_it_in_its_envelope(client: FlaskClient) -> None:
    """Werkzeug merges slashes with a 308 and an HTML body by default: found by the fuzzer below."""
    for path in ("/api//0", "/api/runs//1"):
        answer = client.get(path)
        assert answer.status_code == 404, path
        assert answer.get_json()["ok"] is False and answer.get_json()["status"] == 404


@FUZZ
@given(data=st.data())
def test_no_request_to_any_route_with_any_method_gets_a_5xx(
    app: Flask, client: FlaskClient, data: st.DataObject
) -> None:
    rules, known = app_routes(app)
    request = data.draw(requests(rules, known), label="request")
    status, body = send(client, request)
    assert not problems(request, status, body), (request.target, status, body[:300])


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_no_request_gets_a_5xx_behind_the_token_either(guarded: Flask, data: st.DataObject) -> None:
    rules, known = app_routes(guarded)
    request = data.draw(requests(rules, known), label="request")
    status, body = send(guarded.test_client(), request)
    assert not problems(request, status, body), (request.target, status, body[:300])
    assert status in (401, 404, 405) or request.method == "OPTIONS" or request.path.startswith(
        ("/healthz", "/static/", "/assets/")), (request.target, status)


def test_encode_keeps_surrogates_and_nuls_as_bytes() -> None:
    assert encode("\udcff\x00é/") == "%ED%B3%BF%00%C3%A9%2F"
    assert encode("a/b", safe="/") == "a/b"


@pytest.fixture
def served(seeded_template: tuple[Path, dict[str, int]], tmp_path: Path) -> Iterator[Daemon]:
    shutil.copyfile(seeded_template[0], tmp_path / "served.db")
    with Daemon(f"sqlite:///{tmp_path / 'served.db'}") as daemon:
        yield daemon


@pytest.mark.slow
def test_head_keeps_a_keep_alive_connection_to_waitress_usable(
    served: Daemon, app: Flask, seeded: dict[str, int]
) -> None:
    """HEAD then GET on one connection, for every route, and twenty times for /metrics: each GET
    parses and answers 200. (prometheus_client answered HEAD with 405 and a body, which http.client
    read as the start of the next answer: BadStatusLine, about one time in two.)"""
    parts = urlsplit(served.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        for path in [*concrete_paths(app, seeded), *[METRICS] * 20]:
            conn.request("HEAD", path)
            head = conn.getresponse()
            assert head.read() == b"" and not head.will_close, path
            conn.request("GET", path)
            get = conn.getresponse()
            body = get.read()
            assert (head.status, get.status) == (200, 200), (path, head.status, get.status, body[:200])
            assert head.getheader("Content-Type") == get.getheader("Content-Type"), path
    finally:
        conn.close()


@pytest.mark.slow
def test_fuzz_benchmark_quick_run_finds_nothing(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, "bench/fuzz_requests.py", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert results["requests"] == 300 and results["server_errors"] == 0 and results["failures"] == []
    assert set(results["methods"]) <= set(METHODS) and len(results["methods"]) >= 6
    assert "HEAD" in results["methods"] and results["statuses"]["200"] > 100
    assert [t["met"] for t in payload["targets"]] == [True, True, True]
