"""Human units for pages: MiB, ms, %, readable times. The JSON API keeps base units instead."""

from __future__ import annotations

import datetime as dt

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
NONE = "\N{EN DASH}"
"""Shown where there is no value yet (no replay, no end time)."""


def human_bytes(value: float | None) -> str:
    if value is None:
        return NONE
    size, unit = float(value), _BINARY_UNITS[0]
    for unit in _BINARY_UNITS:
        if abs(size) < 1024 or unit == _BINARY_UNITS[-1]:
            break
        size /= 1024
    return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"


def human_seconds(value: float | None) -> str:
    """Capture times are milliseconds to seconds: show ms below one second."""
    if value is None:
        return NONE
    if abs(value) < 1:
        return f"{value * 1000:.1f} ms"
    if abs(value) < 120:
        return f"{value:.2f} s"
    return f"{value / 60:.1f} min"


def step_seconds(value: float | None) -> str:
    """Step times are microseconds to milliseconds: show us below one millisecond."""
    if value is None:
        return NONE
    if abs(value) < 1e-3:
        return f"{value * 1e6:.1f} us"
    return human_seconds(value)


def speedup(value: float | None) -> str:
    """A ratio of times, as 'x2.41'."""
    return NONE if value is None else f"x{value:.2f}"


def percent(value: float | None, digits: int = 1) -> str:
    return NONE if value is None else f"{value * 100:.{digits}f} %"


def count(value: int | None) -> str:
    return NONE if value is None else f"{value:,}"


def timestamp(value: float | None) -> str:
    if value is None:
        return NONE
    return dt.datetime.fromtimestamp(value, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(value: float | None, now: float) -> str:
    """How long before ``now``: '42 s ago', '3 min ago', '5 h ago', '2 d ago'."""
    if value is None:
        return NONE
    seconds = max(0.0, now - value)
    for limit, divisor, unit in ((120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds / divisor)} {unit} ago"
    return f"{int(seconds / 86400)} d ago"


FILTERS = {
    "bytes": human_bytes,
    "seconds": human_seconds,
    "step_seconds": step_seconds,
    "speedup": speedup,
    "percent": percent,
    "count": count,
    "timestamp": timestamp,
}
