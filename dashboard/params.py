"""Query-string parsing for pages and the API: every bad value becomes a 400 with a clear message.

Pages and their JSON twins share these, so that ``/graphs?size=abc`` and ``/api/graphs?size=abc``
fail the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from flask import request
from werkzeug.exceptions import BadRequest

DEFAULT_PER_PAGE = 50
MAX_PER_PAGE = 500
MAX_INTEGER = 2**63 - 1
"""The largest integer the database holds (SQLite's INTEGER and PostgreSQL's BIGINT are signed 64-bit):
a larger id or filter could match nothing, and the driver would refuse to send it."""
INTEGER = re.compile(r"-?[0-9]+")
"""ASCII digits only: Python's int() would also take '1_0', ' 1' and Unicode digits."""
SHOWN_CHARS = 40
"""How much of a rejected value an error message repeats."""


def int_arg(name: str, *, default: int | None = None, minimum: int = 1, maximum: int = MAX_INTEGER
            ) -> int | None:
    """An integer query argument within bounds, or ``default`` when it is absent or empty."""
    raw = request.args.get(name, "").strip()
    if not raw:
        return default
    return parse_int(name, raw, minimum=minimum, maximum=maximum)


def parse_int(name: str, raw: str, *, minimum: int = 1, maximum: int = MAX_INTEGER) -> int:
    """``raw`` as an integer in ``[minimum, maximum]``, else a 400 that names ``name``."""
    if not INTEGER.fullmatch(raw):
        raise BadRequest(f"{name} must be an integer, got {shown(raw)}")
    digits = len(raw.lstrip("-"))
    value = int(raw) if digits <= SHOWN_CHARS else None  # longer is out of range: not worth converting
    if value is None or not minimum <= value <= maximum:
        got = value if value is not None else f"a {digits}-digit number"
        raise BadRequest(f"{name} must be between {minimum} and {maximum}, got {got}")
    return value


def choice_arg(name: str, choices: Iterable[str], *, default: str | None = None) -> str | None:
    """A query argument that must be one of ``choices`` (case-insensitive)."""
    raw = request.args.get(name, "").strip().lower()
    if not raw:
        return default
    allowed = list(choices)
    if raw not in allowed:
        raise BadRequest(f"{name} must be one of {', '.join(allowed)}; got {shown(raw)}")
    return raw


def shown(raw: str) -> str:
    """A rejected value as an error message repeats it: quoted, cut to SHOWN_CHARS characters."""
    if len(raw) <= SHOWN_CHARS:
        return repr(raw)
    return f"{raw[:SHOWN_CHARS]!r}... ({len(raw):,} characters)"


def pagination() -> tuple[int, int]:
    """``(page, per_page)``: page from 1, per_page capped at MAX_PER_PAGE (larger is a 400)."""
    page = int_arg("page", default=1, maximum=10**9)
    per_page = int_arg("per_page", default=DEFAULT_PER_PAGE, maximum=MAX_PER_PAGE)
    assert page is not None and per_page is not None
    return page, per_page
