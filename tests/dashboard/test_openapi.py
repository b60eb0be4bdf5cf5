"""The OpenAPI contract: dashboard/openapi.json is a valid OpenAPI 3.1 document, it names every route
the app has, and the real daemon's answers (`graph-inspector serve` over HTTP: the checkout's, or the
wheel's install under $GRAPH_INSPECTOR_INSTALL) match it, every documented status of every route
included, for chosen requests and for query strings drawn at random. Every object in the document
is closed (``additionalProperties``/``unevaluatedProperties`` false, every field required), so a
field renamed, added or dropped in an answer fails here instead of drifting from the document."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from dashboard.api import openapi_document
from tests.support.daemon import Daemon
from tests.support.sample import seed_job

DOCUMENT = openapi_document()
BASE = "urn:graph-inspector:openapi"
REGISTRY = Registry().with_resource(BASE, Resource.from_contents(DOCUMENT, default_specification=DRAFT202012))
TOKEN = "openapi-t0k"
JOB = "torchrun:openapi-job"


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def pointer(*parts: str) -> str:
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in parts)


def resolve(reference: str) -> Any:
    """What a ``#/components/...`` reference of the document points at."""
    return REGISTRY.resolver(BASE).lookup(BASE + reference).contents


def documented_statuses(route: str) -> set[int]:
    return {int(status) for status in DOCUMENT["paths"][route]["get"]["responses"]}


def check(route: str, answer: Answer) -> None:
    """``answer`` has a status the document gives ``route``, and its body matches that response."""
    responses = DOCUMENT["paths"][route]["get"]["responses"]
    assert str(answer.status) in responses, f"GET {route} answered {answer.status}, not documented"
    response = responses[str(answer.status)]
    location = pointer("paths", route, "get", "responses", str(answer.status))
    if "$ref" in response:
        location = response["$ref"].removeprefix("#")
        response = resolve(response["$ref"])
    media = answer.content_type.split(";")[0]
    assert media in response["content"], f"GET {route} {answer.status}: {media} not documented"
    if media == "application/json":
        schema = {"$ref": f"{BASE}#{location}{pointer('content', media, 'schema')}"}
        errors = sorted(Draft202012Validator(schema, registry=REGISTRY).iter_errors(answer.json()),
                        key=lambda e: list(e.absolute_path))
        assert not errors, f"GET {route} {answer.status}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path)) or '(body)'}: {e.message}" for e in errors[:5]
        )


def fetch(daemon: Daemon, url: str, token: str | None = None, host: str | None = None) -> Answer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if host is not None:
        headers["Host"] = host
    request = urllib.request.Request(daemon.url + url.lstrip("/"), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(response.status, response.headers["Content-Type"], response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.headers["Content-Type"], error.read())


def in_process(app: Flask, url: str) -> Answer:
    response = app.test_client().get(url)
    return Answer(response.status_code, response.content_type, response.data)


@pytest.fixture(scope="module")
def database(seeded_template: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("openapi") / "inspector.db"
    shutil.copyfile(seeded_template[0], path)
    seed_job(f"sqlite:///{path}", JOB)
    return f"sqlite:///{path}"


@pytest.fixture(scope="module")
def daemon(database: str) -> Iterator[Daemon]:
    with Daemon(database) as running:
        yield running


@pytest.fixture(scope="module")
def guarded(database: str) -> Iterator[Daemon]:
    with Daemon(database, extra_args=["--token", TOKEN]) as running:
        yield running


@pytest.fixture(scope="module")
def ids(seeded_template: tuple[Path, dict[str, int]]) -> dict[str, int]:
    return seeded_template[1]


def requests(ids: dict[str, int]) -> list[tuple[str, str]]:
    """(route, URL) pairs that between them draw every documented answer but 401, 403, 500 and 503."""
    run, graph, replayed, drift = ids["cuda_run"], ids["cuda_graph"], ids["eager_graph"], ids["drift"]
    cases = {
        "/api/summary": ["", f"?run={run}", "?run=999999", "?run=first"],
        "/api/graphs": ["", f"?run={run}&mode=piecewise&size=64", "?sort=pool_bytes&order=desc&page=2",
                        "?mode=eager", "?per_page=501", "?run=999999"],
        "/api/graphs/{graph_id}": [f"/{graph}", f"/{replayed}", "/999999", "/first"],
        "/api/violations": ["", f"?run={run}&kind=address_drift", "?kind=typo", "?run=999999"],
        "/api/violations/{violation_id}": [f"/{drift}", "/999999", "/0"],
        "/api/compile": ["", f"?run={run}&kind=compile_rerecord", "?kind=typo", "?run=999999"],
        "/api/runs": ["", "?per_page=1&page=2", "?page=0"],
        "/api/runs/{run_id}": [f"/{run}", "/999999", "/-1"],
        "/api/runs/compare": [f"?a={run}&b={ids['eager_run']}", f"?a={run}", f"?a={run}&b=999999"],
        "/api/advice": ["", f"?run={run}&max_graphs=3", "?max_size=9999", "?max_graphs=0", "?run=999999"],
        "/api/jobs": ["", "?per_page=0"],
        "/api/ranks": [f"?job={urllib.parse.quote(JOB)}", "", f"?job={'x' * 201}", "?job=nobody"],
    }
    return [(route, route.split("/{")[0] + tail) for route, tails in cases.items() for tail in tails] + [
        ("/api/openapi.json", "/api/openapi.json"), ("/healthz", "/healthz"), ("/metrics", "/metrics"),
    ]


def test_the_document_is_valid_openapi_3_1() -> None:
    validate_openapi(DOCUMENT)
    assert DOCUMENT["openapi"].startswith("3.1")


def test_the_document_names_every_route_of_the_app_and_no_other(app: Flask) -> None:
    routes = set()
    for rule in app.url_map.iter_rules():
        path = rule.rule.replace("<", "{").replace(">", "}")
        if (path.startswith("/api/") and "{path:" not in path) or path == "/healthz":
            routes.add(path)
    routes.add("/metrics")  # mounted beside Flask (DispatcherMiddleware), not in its url_map
    assert routes == set(DOCUMENT["paths"])


def test_every_object_in_the_document_is_closed_and_every_field_described() -> None:
    def walk(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                yield where, node
            for key, value in node.items():
                yield from walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{where}/{i}")

    open_bases = {"/components/schemas/RunFields", "/components/schemas/GraphFields"}  # closed by their users
    for where, schema in walk(DOCUMENT, ""):
        closed = schema.get("additionalProperties") is False or schema.get("unevaluatedProperties") is False
        assert closed or where in open_bases, f"{where} accepts fields it does not name"
        assert set(schema.get("required", [])) == set(schema["properties"]), f"{where}: a field is optional"
        for name, field in schema["properties"].items():
            assert field.get("description") or "$ref" in field, f"{where}/{name} is not described"


def test_the_daemon_serves_the_document(daemon: Daemon) -> None:
    answer = fetch(daemon, "/api/openapi.json")
    assert answer.status == 200 and answer.json() == DOCUMENT


def test_real_answers_match_the_document(daemon: Daemon, guarded: Daemon, ids: dict[str, int],
                                         app: Flask) -> None:
    seen: dict[str, set[int]] = {route: set() for route in DOCUMENT["paths"]}
    for route, url in requests(ids):
        answer = fetch(daemon, url)
        check(route, answer)
        seen[route].add(answer.status)
    for route, url in requests(ids):
        if 401 in documented_statuses(route):
            answer = fetch(guarded, url)
            assert answer.status == 401, (url, answer)
            check(route, answer)
            seen[route].add(401)
            assert fetch(guarded, url, TOKEN).status != 401
    for route, url in requests(ids):  # as a page that pointed its own name at the daemon asks
        answer = fetch(daemon, url, host="rebound.example")
        assert answer.status == 403, (url, answer)
        check(route, answer)
        seen[route].add(403)
    for route, answer in broken_answers(app, ids):
        check(route, answer)
        seen[route].add(answer.status)
    unseen = {route: documented_statuses(route) - statuses for route, statuses in seen.items()}
    assert not any(unseen.values()), f"documented but never answered: {unseen}"


def broken_answers(app: Flask, ids: dict[str, int]) -> Iterator[tuple[str, Answer]]:
    """The 500 and 503 answers of every route that documents them, from an in-process app whose
    reads fail: first with a bug (every read raises), then with a database that cannot be read."""
    state = app.extensions["graph_inspector"]
    first_url: dict[str, str] = {}
    for route, url in requests(ids):  # the first request of each route is a good one
        first_url.setdefault(route, url)

    def bug(*args: Any) -> Any:
        raise RuntimeError("a planted bug")

    class Broken:
        def __getattr__(self, name: str) -> Any:
            return bug

    queries, state.queries, state.store.current_revision = state.queries, Broken(), bug
    try:
        for route, url in first_url.items():
            if 500 in documented_statuses(route):
                answer = in_process(app, url)
                assert answer.status == 500, (url, answer)
                yield route, answer
    finally:
        state.queries = queries
        del state.store.current_revision
    path = Path(state.store.engine.url.database)
    state.store.engine.dispose()
    path.write_bytes(b"not a database\n" * 200)
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    for route, url in first_url.items():
        if 503 in documented_statuses(route):
            answer = in_process(app, url)
            assert answer.status == 503, (url, answer)
            yield route, answer


def test_unknown_api_paths_answer_the_error_envelope(daemon: Daemon) -> None:
    answer = fetch(daemon, "/api/graph/1")
    assert answer.status == 404
    schema = {"$ref": f"{BASE}#/components/schemas/Error"}
    Draft202012Validator(schema, registry=REGISTRY).validate(answer.json())
    assert "/api/openapi.json" in answer.json()["error"]


def query_values(parameter: dict[str, Any]) -> st.SearchStrategy[str | None]:
    """Values for one documented query argument: absent, valid, at and past its bounds, or junk."""
    schema = parameter["schema"]
    if "$ref" in schema:
        schema = resolve(schema["$ref"])
    choices: list[st.SearchStrategy[Any]] = [st.none(), st.text(max_size=8)]
    if "enum" in schema:
        choices.append(st.sampled_from(schema["enum"]))
    if schema.get("type") == "integer":
        low, high = schema.get("minimum", 0) - 2, schema.get("maximum", 10**6) + 2
        choices.append(st.integers(low, high).map(str))
    return st.one_of(choices)


def parameters_of(route: str) -> list[dict[str, Any]]:
    found = []
    for parameter in DOCUMENT["paths"][route]["get"].get("parameters", []):
        if "$ref" in parameter:
            parameter = resolve(parameter["$ref"])
        if parameter["in"] == "query":
            found.append(parameter)
    return found


LISTED = [route for route in DOCUMENT["paths"] if "{" not in route and parameters_of(route)]


@pytest.mark.parametrize("route", LISTED)
def test_random_query_strings_get_documented_answers(route: str, daemon: Daemon) -> None:
    arguments = st.fixed_dictionaries({p["name"]: query_values(p) for p in parameters_of(route)})

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(arguments)
    def answers(drawn: dict[str, str | None]) -> None:
        query = urllib.parse.urlencode({k: v for k, v in drawn.items() if v is not None})
        answer = fetch(daemon, f"{route}?{query}")
        assert answer.status in (200, 400, 404), (query, answer)
        check(route, answer)

    answers()
