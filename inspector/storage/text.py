"""Text made storable: every string an engine hands the inspector, ready for any database column.

The recorder takes strings it does not control: tracebacks (Python itself puts lone surrogates in
them, and in ``sys.argv``, for file names that are not UTF-8), messages, input and wrapper names,
labels, configurations, the command line, the host name, torch.compile's reasons. A database takes
none of these blindly: UTF-8 has no encoding for a lone surrogate (the driver raises, and the whole
transaction fails with it), PostgreSQL refuses NUL in text, and a column has a length. The write
module (``inspector.storage.writer``) passes every string of every row through ``storable`` once, as the
row is built, with the column's own length (``column_limits``):

- a lone surrogate becomes a visible escape: ``\\xe9`` for a byte that Python's surrogateescape
  smuggled in (the byte itself, as Python shows undecodable bytes), ``\\ud800`` for any other;
- NUL becomes ``\\x00``;
- text longer than the column keeps its start and says where it was cut, and from how long:
  ``... [cut to 200 of 1,048,576 characters]``.

Text that needs none of this comes back unchanged. JSON columns are built from storable parts
(``storable_json``), so they stay valid JSON whatever the engine put in them.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from typing import Any

from sqlalchemy import String

TEXT_LIMIT = 1 << 20
"""Characters kept of one free-text value (a message, a stack, an input name, a configuration
value) where the column has no length of its own: 1,048,576."""

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_SHORT_MARKER_BELOW = 64
"""Columns narrower than this get the short cut marker (``…[32/1048576]``), so text remains."""


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code == 0:
        return "\\x00"
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the undecodable byte itself
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with lone surrogates and NUL replaced by visible escapes (see the module's doc)."""
    return _UNSTORABLE.sub(_escape, text)


def storable(value: object, limit: int = TEXT_LIMIT, *, digest: bool = False) -> str:
    """``value`` as text that any database stores in a column of ``limit`` characters.

    With ``digest``, a cut keeps a short digest of the whole text in its marker, so that two long
    keys that share their start stay two keys.
    """
    text = value if isinstance(value, str) else str(value)
    if _UNSTORABLE.search(text):
        text = escape(text)
    if len(text) <= limit:
        return text
    return cut(text, limit, digest=digest)


def cut(text: str, limit: int, *, digest: bool = False) -> str:
    """The start of ``text`` and a marker saying the cut, ``limit`` characters in all."""
    tag = f", #{hashlib.sha1(text.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}" if digest else ""
    if limit >= _SHORT_MARKER_BELOW:
        marker = f"… [cut to {limit:,} of {len(text):,} characters{tag}]"
    else:
        marker = f"…[{limit}/{len(text)}{tag.replace(', ', ' ')}]"
    if len(marker) >= limit:
        return text[:limit]
    return text[: limit - len(marker)] + marker


def plain(value: Any, limit: int = TEXT_LIMIT) -> Any:
    """``value`` as JSON-ready data whose every string (keys too) is storable: dicts, lists and
    tuples kept as such, numbers, booleans and None as they are, anything else as its ``str``."""
    if isinstance(value, str):
        return storable(value, limit)
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, dict):
        return {storable(key, limit): plain(item, limit) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, limit) for item in value]
    return storable(value, limit)


def storable_json(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``value`` as JSON text, every string in it storable (and cut at ``limit``), keys sorted.

    Non-ASCII text is kept as it is rather than as ``\\u`` escapes: a megabyte of Arabic stays a
    megabyte, not six."""
    return json.dumps(plain(value, limit), sort_keys=True, ensure_ascii=False)


@cache
def column_limits(model: Any) -> dict[str, int]:
    """The text columns of ``model``'s table and how many characters each holds (a ``Text``
    column: ``TEXT_LIMIT``)."""
    return {
        column.name: column.type.length or TEXT_LIMIT
        for column in model.__table__.columns
        if isinstance(column.type, String)
    }


def storable_row(model: Any, values: dict[str, Any], *, json_columns: frozenset[str] = frozenset()
                 ) -> dict[str, Any]:
    """``values`` with every string made storable in its column of ``model``. ``json_columns`` are
    already built from storable parts (``storable_json``): cutting them would break the JSON."""
    limits = column_limits(model)
    row = dict(values)
    for name, value in values.items():
        if isinstance(value, str) and name in limits and name not in json_columns:
            row[name] = storable(value, limits[name])
    return row
