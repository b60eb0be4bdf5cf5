"""The JSON API: every page's twin under /api, each answer in the one envelope."""

from __future__ import annotations

from flask import Blueprint, Response
from werkzeug.exceptions import NotFound

from dashboard import envelope, resources
from dashboard.resources import Resource

bp = Blueprint("api", __name__, url_prefix="/api")


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


@bp.get("/runs/<run_id>")
def run(run_id: str) -> Response:
    return _answer(resources.run(run_id))


@bp.get("/<path:unknown>")
def unknown_endpoint(unknown: str) -> Response:
    raise NotFound(
        f"no API endpoint /api/{unknown}; try /api/summary, /api/graphs, /api/violations, /api/compile "
        "or /api/runs"
    )
