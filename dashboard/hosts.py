"""Which names the daemon answers to: a defence against DNS rebinding.

A daemon on loopback with no token trusts whoever can connect to it, which a browser's page can do
by pointing a name of its own at 127.0.0.1: the page's script then reads the dashboard as if it were
its own site. The browser still sends the page's name in ``Host``, so without a token the daemon
answers only to loopback names (``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``[::1]``) and the
names given with ``serve --allow-host`` (those a reverse proxy forwards); any other ``Host`` gets a
403 that says so. With a token the token protects it (a rebound page has no token, and the cookie
belongs to the name it was set for), so any name is answered unless ``--allow-host`` lists them.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable

LOOPBACK_NAME = "localhost"


def is_loopback(host: str) -> bool:
    """A loopback address (``127.0.0.0/8``, ``::1``, bracketed or not) or ``localhost`` and its
    subdomains, which browsers resolve to loopback without asking DNS (RFC 6761)."""
    name = host.strip().lower().rstrip(".")
    if name == LOOPBACK_NAME or name.endswith("." + LOOPBACK_NAME):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header: its port and a trailing dot dropped, lower case; an IPv6
    address keeps its brackets."""
    name = header.strip().lower()
    if name.startswith("["):
        return name[: name.find("]") + 1] if "]" in name else name
    return name.rpartition(":")[0].rstrip(".") if ":" in name else name.rstrip(".")


class HostCheck:
    """WSGI middleware: answer only requests whose ``Host`` is loopback or in ``allowed``.

    ``allowed`` names are read as a header is (``Dash.Example.org:443`` is ``dash.example.org``). A
    request without a ``Host`` header (HTTP/1.0 tools) passes: browsers always send one."""

    def __init__(self, wsgi_app: Callable, allowed: Iterable[str] = ()) -> None:
        self.wsgi_app = wsgi_app
        self.allowed = frozenset(host_name(name) for name in allowed if name.strip())

    def accepts(self, header: str | None) -> bool:
        if not header:
            return True
        name = host_name(header)
        return name in self.allowed or is_loopback(name)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        header = environ.get("HTTP_HOST")
        if self.accepts(header):
            return self.wsgi_app(environ, start_response)
        return refuse(environ, start_response, host_name(header or ""))


def refusal(name: str) -> str:
    return (
        f"this dashboard has no access token, so it answers only to loopback names, not to "
        f"Host {name!r} (a web page can point a name of its own at this machine to read it: DNS "
        f"rebinding). Behind a reverse proxy, serve it with --allow-host {name or 'NAME'}"
    )


def refuse(environ: dict, start_response: Callable, name: str) -> Iterable[bytes]:
    """403, in the API's envelope under /api/ and at /healthz, as text elsewhere."""
    message = refusal(name)
    path = environ.get("PATH_INFO", "")
    if path.startswith("/api/") or path == "/healthz":
        body = json.dumps({"ok": False, "error": message, "status": 403}).encode()
        kind = "application/json"
    else:
        body = (message + "\n").encode()
        kind = "text/plain; charset=utf-8"
    start_response("403 FORBIDDEN", [("Content-Type", kind), ("Content-Length", str(len(body)))])
    return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]
