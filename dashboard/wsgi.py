"""HEAD for a plain WSGI app (the Prometheus exporter at /metrics), as Flask answers it for its own
routes: the GET answer's status and headers, Content-Length included, and no body.

prometheus_client's exporter answers HEAD with 405 and a body. A body after a HEAD answer is read
by the client as the start of its next answer on a keep-alive connection, so one HEAD from a
load balancer or a monitoring probe would corrupt the next scrape. (Without a Content-Length,
waitress would close the connection after the HEAD instead.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def answer_head(wsgi_app: Callable) -> Callable:
    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return wsgi_app(environ, start_response)
        answer: dict[str, Any] = {}

        def hold(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            answer.update(status=status, headers=list(headers))
            return lambda data: None

        body = wsgi_app({**environ, "REQUEST_METHOD": "GET"}, hold)
        try:
            length = sum(len(chunk) for chunk in body)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        headers = answer["headers"]
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers.append(("Content-Length", str(length)))
        start_response(answer["status"], headers)
        return []

    return app
