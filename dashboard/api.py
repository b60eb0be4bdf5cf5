"""The JSON API: every page's twin under /api, each answer in the one envelope.

``dashboard/openapi.json`` describes every route and field (served at /api/openapi.json, with the
violation kinds filled in from their records); tests/dashboard/test_openapi.py checks the real
answers against it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from flask import Blueprint, Response
from werkzeug.exceptions import NotFound

from dashboard import envelope, resources
from dashboard.resources import Resource

bp = Blueprint("api", __name__, url_prefix="/api")
OPENAPI = Path(__file__).resolve().parent / "openapi.json"


@cache
def openapi_document() -> dict[str, Any]:
    """``openapi.json`` with the names it leaves to the code filled in: the ``ViolationKind`` enum,
    one name per kind's record, so a new kind is in the contract without editing the document."""
    document = json.loads(OPENAPI.read_text())
    document["components"]["schemas"]["ViolationKind"]["enum"] = list(resources.VIOLATION_KINDS)
    return document


def _answer(resource: Resource) -> Response:
    return envelope.ok(resource.data, resource.page)


@bp.get("/summary")
def summary() -> Response:
    return _answer(resources.summary())


@bp.get("/graphs")
def graphs() -> Response:
    return _answer(resources.graphs())


@bp.get("/graphs/<graph_id>")
def graph(graph_id: str) -> Response:
    return _answer(resources.graph(graph_id))


@bp.get("/violations")
def violations() -> Response:
    return _answer(resources.violations())


@bp.get("/violations/<violation_id>")
def violation(violation_id: str) -> Response:
    return _answer(resources.violation(violation_id))


@bp.get("/compile")
def compile_events() -> Response:
    return _answer(resources.compile_events())


@bp.get("/runs")
def runs() -> Response:
    return _answer(resources.runs())


@bp.get("/runs/compare")
def compare() -> Response:
    return _answer(resources.compare())


@bp.get("/jobs")
def jobs() -> Response:
    return _answer(resources.jobs())


@bp.get("/ranks")
def ranks() -> Response:
    return _answer(resources.ranks())


@bp.get("/runs/<run_id>")
def run(run_id: str) -> Response:
    return _answer(resources.run(run_id))


@bp.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3.1 document of this API, as it is (a document, not an answer in the envelope)."""
    return Response(json.dumps(openapi_document(), indent=1), mimetype="application/json")


@bp.get("/advice")
def advice() -> Response:
    return _answer(resources.advice())


@bp.get("/<path:unknown>")
def unknown_endpoint(unknown: str) -> Response:
    raise NotFound(
        f"no API endpoint /api/{unknown}; try /api/summary, /api/graphs, /api/violations, /api/compile, "
        "/api/runs or /api/advice (every route: /api/openapi.json)"
    )
