"""The one JSON envelope every API answer uses, success or error.

``{"ok": true, "data": ..., "page": {...} | null}`` and ``{"ok": false, "error": "...", "status": 4xx}``:
clients check ``ok`` and never have to parse an HTML error page.
"""

from __future__ import annotations

from typing import Any

from flask import Response, jsonify


def ok(data: Any, page: dict[str, int] | None = None) -> Response:
    return jsonify({"ok": True, "data": data, "page": page})


def error(status: int, message: str, **extra: Any) -> Response:
    """An error answer; ``extra`` adds fields (``/healthz`` adds the checks it ran as ``data``)."""
    response = jsonify({"ok": False, "error": message, "status": status, **extra})
    response.status_code = status
    return response
