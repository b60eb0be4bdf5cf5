"""The access token: required on every page, API call and metrics scrape when one is set.

Clients send ``Authorization: Bearer <token>`` (Prometheus' ``authorization`` scrape setting does).
A person opens a page once with ``?token=<token>``: the token moves into a cookie (HttpOnly,
SameSite=Strict) and the address bar loses it. ``/healthz`` and the static files, which hold no
data, stay open so that load balancers and the browser's asset fetches need nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from urllib.parse import urlencode

from flask import Flask, Response, redirect, request
from werkzeug.exceptions import Unauthorized
from werkzeug.wrappers import Request

COOKIE = "graph_inspector_token"
OPEN_ENDPOINTS = frozenset({"health", "static", "assets.chart"})
UNAUTHORIZED = (
    "this dashboard needs its access token: send 'Authorization: Bearer <token>', "
    "or open a page once with ?token=<token>"
)


def token_matches(expected: str, supplied: str | None) -> bool:
    return supplied is not None and hmac.compare_digest(expected.encode(), supplied.encode())


def bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def init_app(app: Flask, token: str | None) -> None:
    """Check the token before every request that is not open."""
    if not token:
        return

    @app.before_request
    def require_token() -> Response | None:
        if request.endpoint in OPEN_ENDPOINTS:
            return None
        if token_matches(token, bearer(request.headers.get("Authorization"))):
            return None
        if token_matches(token, request.cookies.get(COOKIE)):
            return None
        if token_matches(token, request.args.get("token")):
            if request.method == "GET" and not request.path.startswith("/api/"):
                rest = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
                response = redirect(request.path + ("?" + urlencode(rest) if rest else ""))
            else:
                return None
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
            return response
        raise Unauthorized(UNAUTHORIZED)


def guard_wsgi(wsgi_app: Callable, token: str | None) -> Callable:
    """The same check for a plain WSGI app (the Prometheus exporter mounted at /metrics)."""
    if not token:
        return wsgi_app

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        incoming = Request(environ)
        if token_matches(token, bearer(incoming.headers.get("Authorization"))) or token_matches(
            token, incoming.cookies.get(COOKIE)
        ):
            return wsgi_app(environ, start_response)
        body = (UNAUTHORIZED + "\n").encode()
        start_response("401 UNAUTHORIZED", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body))),
                                            ("WWW-Authenticate", "Bearer")])
        return [body]

    return guarded
