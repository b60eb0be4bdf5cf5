"""Static files under content-hashed URLs, and the chart library from npm.

Chart.js comes from npm (pinned by ``dashboard/assets/package-lock.json``) and is served from this
process: no CDN, since GPU clusters are often offline. A wheel carries it as
``dashboard/vendor/chart.umd.js`` (put there by setup.py's build step); a checkout installed for
development serves the ``npm ci`` of ``dashboard/assets`` (scripts/setup). Its URL carries a hash
of its content, and so do our own files' URLs, so that browsers may cache them forever and still
see every upgrade.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from flask import Blueprint, abort, current_app, send_file, url_for

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED_CHART_JS = PACKAGE_DIR / "vendor" / "chart.umd.js"
NPM_CHART_JS = PACKAGE_DIR / "assets" / "node_modules" / "chart.js" / "dist" / "chart.umd.js"
CHART_JS = BUNDLED_CHART_JS if BUNDLED_CHART_JS.is_file() else NPM_CHART_JS
"""The chart library this install serves: the wheel's copy, else a development checkout's npm folder."""
STATIC_DIR = PACKAGE_DIR / "static"
ONE_YEAR = 365 * 24 * 3600

bp = Blueprint("assets", __name__)


@dataclass(frozen=True)
class ChartLibrary:
    """Where the chart library is, and the hash its URL carries (None when it is not installed)."""

    path: Path
    digest: str | None

    @classmethod
    def find(cls, path: Path = CHART_JS) -> ChartLibrary:
        return cls(path, _digest(path) if path.is_file() else None)

    @property
    def present(self) -> bool:
        return self.digest is not None

    @property
    def missing_message(self) -> str:
        return (
            f"the chart library is not installed ({self.path} is missing): in a checkout run "
            "scripts/setup (or `npm ci` in dashboard/assets); a wheel built with npm carries it"
        )


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


_static_digests: dict[str, str] = {}


def static_url(filename: str) -> str:
    """``/static/<filename>?v=<content hash>``: our own CSS and JS, cache-busted by content."""
    digest = _static_digests.get(filename)
    if digest is None:
        digest = _static_digests[filename] = _digest(STATIC_DIR / filename)
    return url_for("static", filename=filename, v=digest)


def chart_url() -> str | None:
    chart: ChartLibrary = current_app.extensions["graph_inspector"].chart
    return url_for("assets.chart", digest=chart.digest) if chart.present else None


@bp.get("/assets/chart.<digest>.umd.js")
def chart(digest: str):
    library: ChartLibrary = current_app.extensions["graph_inspector"].chart
    if not library.present or digest != library.digest:
        abort(404, description="no such asset: the chart library is missing or was upgraded")
    response = send_file(library.path, mimetype="text/javascript", max_age=ONE_YEAR)
    response.cache_control.immutable = True
    return response
