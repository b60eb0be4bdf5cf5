"""Query-string parsing for pages and the API: every bad value becomes a 400 with a clear message.

Pages and their JSON twins share these, so that ``/graphs?size=abc`` and ``/api/graphs?size=abc``
fail the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

from flask import request
from werkzeug.exceptions import BadRequest

DEFAULT_PER_PAGE = 50
MAX_PER_PAGE = 500


def int_arg(
    name: str, *, default: int | None = None, minimum: int = 1, maximum: int | None = None
) -> int | None:
    """An integer query argument within bounds, or ``default`` when it is absent or empty."""
    raw = request.args.get(name, "").strip()
    if not raw:
        return default
    return parse_int(name, raw, minimum=minimum, maximum=maximum)


def parse_int(name: str, raw: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise BadRequest(f"{name} must be {bounds}, got {value}")
    return value


def choice_arg(name: str, choices: Iterable[str], *, default: str | None = None) -> str | None:
    """A query argument that must be one of ``choices`` (case-insensitive)."""
    raw = request.args.get(name, "").strip().lower()
    if not raw:
        return default
    allowed = list(choices)
    if raw not in allowed:
        raise BadRequest(f"{name} must be one of {', '.join(allowed)}; got {raw!r}")
    return raw


def pagination() -> tuple[int, int]:
    """``(page, per_page)``: page from 1, per_page capped at MAX_PER_PAGE (larger is a 400)."""
    page = int_arg("page", default=1, maximum=10**9)
    per_page = int_arg("per_page", default=DEFAULT_PER_PAGE, maximum=MAX_PER_PAGE)
    assert page is not None and per_page is not None
    return page, per_page
