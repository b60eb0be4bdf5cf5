"""Long text on pages: cut for display, with a link that downloads all of it.

Engines write text of any length into messages, stacks, input names, labels and configurations.
A million characters that the browser must shape and cannot break into lines (Arabic, say) kept
a tab blank for minutes; cut to a few thousand characters, any text lays out in milliseconds. A
page shows the start of each field and says how much more there is, with a link to
``/download/<resource>/<id>?field=...``; the JSON twins keep every character.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

LIMITS = {
    "short": 200,
    "text": 2_000,
    "block": 10_000,
}
"""Characters shown, by kind of field: ``short`` for input names, wrappers, labels, functions,
hosts and table cells; ``text`` for messages and reasons; ``block`` for stacks, log lines and
configurations (a deep Python traceback of a hundred frames still fits)."""


@dataclass(frozen=True)
class Clip:
    """What a page shows of a text, and how many characters it leaves out."""

    shown: str
    hidden: int


def as_text(value: Any) -> str:
    """A field as a reader sees it, on a page or downloaded: text as it is, anything else (a
    configuration) as indented JSON."""
    return value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)


def clip(value: Any, kind: str) -> Clip:
    """The first ``LIMITS[kind]`` characters of ``value`` (None shows as nothing)."""
    text = "" if value is None else as_text(value)
    limit = LIMITS[kind]
    if len(text) <= limit:
        return Clip(text, 0)
    return Clip(text[:limit], len(text) - limit)
