"""The dashboard's Flask application: pages, their JSON twins, /metrics and /healthz.

``create_app`` builds a fresh app around one database, so tests (and several daemons in one
process) never share state: each app has its own store, its own read-side ``Queries`` (with its
in-memory time series) and its own Prometheus registry holding the inspector's collector.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, current_app, render_template, request
from prometheus_client import CollectorRegistry, make_wsgi_app
from sqlalchemy.exc import SQLAlchemyError
from werkzeug.exceptions import HTTPException, InternalServerError, ServiceUnavailable
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from dashboard import api, assets, auth, downloads, envelope, pages, units, wsgi
from dashboard.assets import ChartLibrary
from dashboard.headers import security_headers
from dashboard.hosts import HostCheck
from dashboard.resources import EXTENSION, KIND_RECORDS
from inspector.errors import DatabaseError
from inspector.reading.metrics import InspectorCollector
from inspector.reading.queries import Queries
from inspector.storage import schema
from inspector.storage.store import Store, open_store

log = logging.getLogger(__name__)


@dataclass
class DashboardState:
    """What every request of one app shares (``app.extensions["graph_inspector"]``)."""

    store: Store
    queries: Queries
    chart: ChartLibrary
    registry: CollectorRegistry
    token: str | None


def create_app(
    db_url: str | None = None, *, token: str | None = None, allowed_hosts: Sequence[str] = (),
    test_config: dict[str, Any] | None = None,
) -> Flask:
    """The dashboard for the database at ``db_url`` (default: $GRAPH_INSPECTOR_DB, else the SQLite
    file ``graph-inspector.db``), created or upgraded to the newest schema.

    With ``token``, every page, API call and scrape needs it. Without one, only requests to a
    loopback name or one of ``allowed_hosts`` are answered (``dashboard.hosts``); with one, any name
    unless ``allowed_hosts`` lists them. ``test_config`` overrides Flask settings and ``CHART_JS``
    (the path of the chart library, to test its absence).
    """
    app = Flask(__name__)
    app.config.from_mapping(CHART_JS=assets.CHART_JS)
    if test_config:
        app.config.update(test_config)
    app.json.sort_keys = False
    app.url_map.merge_slashes = False  # ``/api//0`` is no route: a 404 in the envelope, not an HTML redirect
    store = open_store(db_url, upgrade=True)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(InspectorCollector(store))
    state = DashboardState(
        store=store,
        queries=Queries(store.engine),
        chart=ChartLibrary.find(app.config["CHART_JS"]),
        registry=registry,
        token=token or None,
    )
    app.extensions[EXTENSION] = state

    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(assets.bp)
    app.register_blueprint(downloads.bp)
    app.add_url_rule("/healthz", "health", health)
    auth.init_app(app, state.token)
    _register_errors(app)
    app.jinja_env.filters.update(units.FILTERS)
    app.context_processor(_template_globals)
    app.jinja_env.globals["kind_records"] = KIND_RECORDS  # the macros read it too

    served: Callable = DispatcherMiddleware(
        app.wsgi_app, {"/metrics": wsgi.answer_head(auth.guard_wsgi(make_wsgi_app(registry), state.token))}
    )
    if not state.token or allowed_hosts:
        served = HostCheck(served, allowed_hosts)
    app.wsgi_app = security_headers(served)  # type: ignore[method-assign]
    return app


def health() -> Response:
    """Open to all (no data). Liveness: 200 while the process can read its database, with whatever
    is degraded (a schema other than this version's head, a missing chart library) named in
    ``data.degraded``; 503 only when the database cannot be read, so a probe restarts or pages for
    that alone."""
    state: DashboardState = current_app.extensions[EXTENSION]
    checks: dict[str, Any] = {}
    degraded = []
    try:
        revision, head = state.store.current_revision(), schema.head_revision()
    except DatabaseError as error:
        checks["database"] = "unreachable"
        return envelope.error(503, str(error), data=checks)
    checks["database"] = "reachable"
    checks["schema"] = {"revision": revision, "head": head}
    if revision != head:
        degraded.append(f"the schema is at {revision}, not {head}: run `graph-inspector db upgrade`")
    checks["chart_library"] = "present" if state.chart.present else "missing"
    if not state.chart.present:
        degraded.append(state.chart.missing_message)
    return envelope.ok({"status": "degraded" if degraded else "ok", **checks, "degraded": degraded})


def _template_globals() -> dict[str, Any]:
    state: DashboardState = current_app.extensions[EXTENSION]
    return {
        "static_url": assets.static_url,
        "chart_url": assets.chart_url(),
        "chart_missing": None if state.chart.present else state.chart.missing_message,
        "now": time.time(),
        "ago": units.ago,
    }


def _wants_json() -> bool:
    return request.path.startswith("/api/") or request.path == "/healthz"


def _register_errors(app: Flask) -> None:
    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> Response | tuple[str, int]:
        status = error.code or 500
        message = error.description or error.name
        if _wants_json():
            response = envelope.error(status, message)
        else:
            response = app.make_response(
                (render_template("error.html", status=status, title=error.name, message=message), status)
            )
        if status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.errorhandler(SQLAlchemyError)
    def database_error(error: SQLAlchemyError) -> Response | tuple[str, int]:
        log.warning("database error while serving %s: %s", request.path, error)
        message = f"the database could not answer ({type(error).__name__}); see the daemon's log"
        return http_error(ServiceUnavailable(message))

    @app.errorhandler(DatabaseError)
    def store_error(error: DatabaseError) -> Response | tuple[str, int]:
        return http_error(ServiceUnavailable(str(error)))

    @app.errorhandler(Exception)
    def unexpected(error: Exception) -> Response | tuple[str, int]:
        log.exception("unexpected error while serving %s", request.path)
        return http_error(InternalServerError("internal error; see the daemon's log"))
