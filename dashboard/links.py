"""Links that keep a page's query (its JSON twin, its pager, its sort headers), built from the
parameters the page knows, never from the raw query string.

Handing ``request.args`` to ``url_for`` as keywords lets a visitor's query keys reach it: ``?endpoint=x``
and ``?_method=POST`` make it raise, ``?_external=1`` makes every such link absolute, pointing at
whatever host the request's Host header named. Here the known parameters are urlencoded onto the
endpoint's relative URL, and any other key is left behind.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from flask import request, url_for

QUERY_PARAMS: dict[str, tuple[str, ...]] = {
    "summary": ("run",),
    "graphs": ("run", "mode", "size", "sort", "order", "group", "page", "per_page"),
    "violations": ("run", "kind", "page", "per_page"),
    "compile_events": ("run", "kind", "page", "per_page"),
    "runs": ("page", "per_page"),
    "compare": ("a", "b"),
    "advice": ("run", "max_graphs", "max_size"),
    "jobs": ("page", "per_page"),
    "ranks": ("job",),
}
"""The query parameters of each resource (``dashboard.resources``), for its page and its JSON twin
alike; keep it in step with what the resource reads."""


def url_with_query(endpoint: str, **changes: Any) -> str:
    """``endpoint``'s URL (``pages.graphs``, ``api.graphs``...) carrying this request's values of the
    resource's parameters, with ``changes`` applied (a value of None drops that parameter)."""
    known = QUERY_PARAMS[endpoint.partition(".")[2]]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ValueError(f"{endpoint} has no query parameter {', '.join(unknown)}")
    values = {name: changes[name] if name in changes else request.args.get(name) or None for name in known}
    encoded = urlencode({name: value for name, value in values.items() if value is not None})
    return url_for(endpoint) + ("?" + encoded if encoded else "")
