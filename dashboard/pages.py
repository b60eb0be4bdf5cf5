"""The HTML pages. Each renders the same data as its JSON twin (see ``dashboard.resources``)."""

from __future__ import annotations

from flask import Blueprint, render_template

from dashboard import resources
from dashboard.links import url_with_query
from dashboard.longtext import clip
from dashboard.resources import GRAPH_MODES, VIOLATION_KINDS, queries
from inspector.reading.graph_queries import GRAPH_SORTS
from inspector.reading.queries import COMPILE_KINDS

bp = Blueprint("pages", __name__)
bp.add_app_template_global(url_with_query)
bp.add_app_template_global(clip)


@bp.get("/")
def overview() -> str:
    summary = resources.summary().data
    return render_template(
        "overview.html", summary=summary, runs=queries().run_options(summary["run"]),
        live=bool(summary["runs"]["live"]),
    )


@bp.get("/graphs")
def graphs() -> str:
    resource = resources.graphs()
    return render_template(
        "graphs.html", listing=resource.data, page=resource.page,
        runs=queries().run_options(resource.data["filters"]["run"]),
        modes=GRAPH_MODES, sorts=list(GRAPH_SORTS), live=_any_live(),
    )


@bp.get("/graphs/<graph_id>")
def graph(graph_id: str) -> str:
    resource = resources.graph(graph_id)
    return render_template("graph.html", graph=resource.data, live=resource.data["run"]["live"])


@bp.get("/violations")
def violations() -> str:
    resource = resources.violations()
    return render_template(
        "violations.html", listing=resource.data, page=resource.page,
        runs=queries().run_options(resource.data["filters"]["run"]),
        kinds=VIOLATION_KINDS, live=_any_live(),
    )


@bp.get("/compile")
def compile_events() -> str:
    resource = resources.compile_events()
    return render_template(
        "compile.html", listing=resource.data, page=resource.page,
        runs=queries().run_options(resource.data["filters"]["run"]),
        kinds=COMPILE_KINDS, live=_any_live(),
    )


@bp.get("/runs")
def runs() -> str:
    resource = resources.runs()
    return render_template("runs.html", listing=resource.data, page=resource.page, live=_any_live())


@bp.get("/runs/compare")
def compare() -> str:
    resource = resources.compare()
    data = resource.data
    return render_template("compare.html", comparison=data, live=data["a"]["live"] or data["b"]["live"])


@bp.get("/advice")
def advice() -> str:
    resource = resources.advice()
    return render_template("advice.html", advice=resource.data,
                           runs=queries().run_options(resource.data["filters"]["run"]), live=False)


@bp.get("/jobs")
def jobs() -> str:
    resource = resources.jobs()
    return render_template("jobs.html", listing=resource.data, page=resource.page, live=_any_live())


@bp.get("/ranks")
def ranks() -> str:
    resource = resources.ranks()
    data = resource.data
    return render_template("ranks.html", job=data, live=any(r["run"]["live"] for r in data["ranks"]))


def _any_live() -> bool:
    return bool(queries().live_run_ids())
