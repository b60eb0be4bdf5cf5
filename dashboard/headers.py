"""The security headers of every answer the daemon gives: its pages, its API, its files, /metrics
(200 and 401) and the host check's refusals alike, since they wrap the whole WSGI application and
not Flask's routes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
"""Only this origin's files run: even if some engine-written text slipped past escaping, it could
neither run script nor load anything from elsewhere."""

SECURITY_HEADERS = (
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)
"""Added to an answer that does not set them itself."""


def security_headers(wsgi_app: Callable) -> Callable:
    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            present = {name.lower() for name, _ in headers}
            missing = [(name, value) for name, value in SECURITY_HEADERS if name.lower() not in present]
            return start_response(status, [*headers, *missing], exc_info)

        return wsgi_app(environ, start)

    return app
