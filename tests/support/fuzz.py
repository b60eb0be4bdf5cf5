"""Hostile HTTP requests for the dashboard (hypothesis strategies), and the check every answer must
pass: no 5xx, the JSON envelope under /api, no body on HEAD.

The property test (tests/dashboard/test_fuzz.py: in-process, bounded, in CI) and the fuzz benchmark
(bench/fuzz_requests.py: thousands of requests over one keep-alive connection to the real daemon)
draw from the same strategies and judge answers with the same ``problems``.

A request is built from one of the app's routes (``app.url_map``, plus ``/metrics``, which is
mounted beside Flask): its path arguments and query values are mostly valid, so that most requests
get as far as rendering a page, with hostile values mixed in: integers beyond SQLite's signed
64 bits, Unicode digits, surrogates, NULs, repeated keys, the keywords of Flask's ``url_for``
(``_method``, ``endpoint``, ``_external``...), malformed percent escapes, and every method.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from flask import Flask
from hypothesis import strategies as st

from dashboard.assets import STATIC_DIR
from dashboard.downloads import RESOURCES

METRICS = "/metrics"
OPENAPI = "/api/openapi.json"
METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH", "TRACE", "PROPFIND")
INT64 = 2**63
HUGE_INTEGERS = (INT64, INT64 - 1, -INT64, -INT64 - 1, 2**64, 10**30, 10**100)
ODD_NUMBERS = ("\udcff", "\ud800", "\x00", "1\x00", " 1", "1 ", "1_0", "+1", "-0", "0x10", "1e3", "1.0",
               "\uff11", "\u0661\u0662", "9" * 5000)
"""Integers in disguise and text a decoder chokes on: surrogates (Python puts them in tracebacks
and argv), NULs, Python's own int() extras (underscores, Unicode digits, padding), a 5,000-digit
number (beyond Python's int() limit)."""
URL_FOR_KEYS = ("_method", "endpoint", "_external", "_anchor", "_scheme", "values", "graph_id",
                "violation_id", "run_id", "filename", "digest", "unknown", "token", "v")
"""Keys that mean something to Flask's url_for, to a route or to the auth check."""
KNOWN_VALUES: dict[str, tuple[str, ...]] = {
    "run": ("1", "2"),
    "mode": ("full", "piecewise", "FULL"),
    "size": ("1", "8", "256"),
    "sort": ("id", "run", "mode", "size", "capture_seconds", "pool_bytes", "captured_at"),
    "order": ("asc", "desc"),
    "group": ("function",),
    "page": ("1", "2", "3"),
    "per_page": ("1", "10", "500"),
    "kind": ("address_drift", "unexpected_capture", "compile_skip", "compile_rerecord"),
    "a": ("1", "2"),
    "b": ("1", "2"),
    "field": ("message", "stack", "inputs.0.name", "config", "run.config.sizes", "reason"),
}
"""The dashboard's query parameters with values that are valid on some page."""
BROKEN_QUERY_PARTS = ("%", "%zz", "%0", "=", "&", "==", "a=%", ";", "+", "%%", "&=&")
PLACEHOLDER = re.compile(r"<(?:(\w+):)?(\w+)>")


@dataclass(frozen=True)
class FuzzRequest:
    """One request: ``path`` and ``query`` are as sent on the wire (percent-encoded, or broken on
    purpose)."""

    method: str
    path: str
    query: str

    @property
    def target(self) -> str:
        return self.path + ("?" + self.query if self.query else "")

    @property
    def under_api(self) -> bool:
        return self.path.startswith("/api/")


def encode(text: str, safe: str = "") -> str:
    """Percent-encoding of any Python text, lone surrogates included (as their UTF-8-style bytes,
    which no decoder accepts: what a client with a broken encoder sends)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe=safe)


def hostile_text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.sampled_from(HUGE_INTEGERS).map(str),
        st.sampled_from(ODD_NUMBERS),
        st.text(st.characters(exclude_categories=()), max_size=12),
        st.text(st.characters(categories=["Nd"]), min_size=1, max_size=4),
    )


def _segment(name: str, converter: str | None, known: Mapping[str, Sequence[str]]) -> st.SearchStrategy[str]:
    """A path argument: a valid one (``known``, else a small id) or a hostile one."""
    valid = st.sampled_from(list(known[name])) if name in known else st.integers(1, 60).map(str)
    safe = "/" if converter == "path" else ""
    return st.one_of(valid, valid, hostile_text()).map(lambda text: encode(text, safe) or "x")


@st.composite
def paths(draw: st.DrawFn, rules: Sequence[str], known: Mapping[str, Sequence[str]]) -> str:
    rule = draw(st.sampled_from(list(rules)))
    return PLACEHOLDER.sub(lambda m: draw(_segment(m.group(2), m.group(1), known)), rule)


def _pair() -> st.SearchStrategy[str]:
    known_key = st.sampled_from(list(KNOWN_VALUES)).flatmap(
        lambda key: st.tuples(st.just(key), st.one_of(st.sampled_from(KNOWN_VALUES[key]), hostile_text()))
    )
    odd_value = st.one_of(st.sampled_from(("1", "POST", "x")), hostile_text())
    odd_key = st.tuples(st.sampled_from(URL_FOR_KEYS), odd_value)
    any_key = st.tuples(hostile_text(), hostile_text())
    pair = st.one_of(known_key, known_key, odd_key, any_key).map(
        lambda kv: f"{encode(kv[0])}={encode(kv[1])}"
    )
    return st.one_of(pair, pair, pair, st.sampled_from(BROKEN_QUERY_PARTS))


def queries() -> st.SearchStrategy[str]:
    """A query string of 0-6 parts; keys may repeat; some parts are malformed."""
    return st.lists(_pair(), max_size=6).map("&".join)


def app_routes(app: Flask) -> tuple[list[str], dict[str, list[str]]]:
    """Every route of ``app`` (its URL map and ``/metrics``) and the valid values of its path
    arguments that are not ids."""
    rules = sorted({rule.rule for rule in app.url_map.iter_rules()} | {METRICS})
    digest = app.extensions["graph_inspector"].chart.digest
    known = {"filename": sorted(p.name for p in STATIC_DIR.iterdir()), "digest": [digest or "0" * 16],
             "unknown": ["summary", "nothing-here"], "resource": list(RESOURCES)}
    return rules, known


def requests(rules: Sequence[str], known: Mapping[str, Sequence[str]]) -> st.SearchStrategy[FuzzRequest]:
    """Requests to ``rules`` (Werkzeug rule strings such as ``/graphs/<graph_id>``); ``known`` gives
    valid values of path arguments that are not ids (``filename``, ``digest``)."""
    method = st.one_of(st.just("GET"), st.just("GET"), st.sampled_from(METHODS))
    return st.builds(FuzzRequest, method, paths(rules, known), queries())


def problems(request: FuzzRequest, status: int, body: bytes) -> list[str]:
    """What is wrong with an answer: a 5xx, a body on HEAD, an /api answer outside the envelope."""
    found = []
    if status >= 500:
        found.append(f"answered {status}")
    if request.method == "HEAD":
        if status == 405:
            found.append("HEAD refused (405)")
        if body:
            found.append(f"HEAD answered with a {len(body)}-byte body")
        return found
    document = request.path == OPENAPI and status < 400  # the API's own description, not an answer
    if request.under_api and (request.method != "OPTIONS" or status >= 400) and not document:
        found.extend(_envelope_problems(status, body))
    return found


def _envelope_problems(status: int, body: bytes) -> list[str]:
    try:
        answer = json.loads(body)
    except ValueError:
        return [f"/api answered {status} with a body that is not JSON: {body[:80]!r}"]
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        return [f"/api answered {status} outside the envelope: {body[:80]!r}"]
    if answer["ok"] != (status < 400):
        return [f"/api answered {status} with ok={answer['ok']}"]
    if not answer["ok"] and (answer.get("status") != status or not isinstance(answer.get("error"), str)):
        return [f"/api error {status} without its status and message: {body[:80]!r}"]
    if answer["ok"] and "data" not in answer:
        return [f"/api answered {status} without data"]
    return []
