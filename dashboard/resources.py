"""What each page shows, read from the request and the database: one function per resource.

A page and its JSON twin call the same function, so they can never disagree; the page only adds
presentation. Every function raises a werkzeug HTTPException (400/404) for a bad request.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flask import current_app, request
from werkzeug.exceptions import BadRequest, NotFound

from capture_core.events import ViolationKind
from capture_core.modes import CUDAGraphMode
from dashboard.params import choice_arg, int_arg, pagination, parse_int
from inspector.reading.graph_queries import GRAPH_SORTS
from inspector.reading.listing import Page
from inspector.reading.queries import COMPILE_KINDS, Queries

EXTENSION = "graph_inspector"
GRAPH_MODES = tuple(m.label for m in CUDAGraphMode if m.is_runtime_mode() and m is not CUDAGraphMode.NONE)
VIOLATION_KINDS = tuple(k.value for k in ViolationKind)
KIND_RECORDS = {k.value: k.record for k in ViolationKind}
"""What each kind means and its fix, as the pages show it (``capture_core.events.ViolationKind``)."""


@dataclass(frozen=True)
class Resource:
    """The data of one answer, and its page of a listing when it is one."""

    data: Any
    page: dict[str, int] | None = None

    @classmethod
    def from_page(cls, page: Page, **extra: Any) -> Resource:
        return cls({"items": page.items, **extra}, page.meta())


def queries() -> Queries:
    return current_app.extensions[EXTENSION].queries


def _run_filter() -> int | None:
    run_id = int_arg("run")
    if run_id is not None and not queries().run_exists(run_id):
        raise NotFound(f"no run with id {run_id}")
    return run_id


def _one(name: str, raw_id: str, find: Callable[[int], dict[str, Any] | None]) -> Resource:
    """The ``name`` whose id is the path's ``raw_id``: a 400 for a bad id, a 404 for no such one."""
    item_id = parse_int(f"{name} id", raw_id)
    found = find(item_id)
    if found is None:
        raise NotFound(f"no {name} with id {item_id}")
    return Resource(found)


def summary() -> Resource:
    return Resource(queries().summary(_run_filter()))


def graphs() -> Resource:
    run_id = _run_filter()
    mode = choice_arg("mode", GRAPH_MODES)
    size = int_arg("size")
    sort = choice_arg("sort", GRAPH_SORTS, default="id")
    order = choice_arg("order", ("asc", "desc"), default="asc")
    page, per_page = pagination()
    assert sort is not None
    group = choice_arg("group", ("function",))
    listing = queries().graphs(run_id=run_id, mode=mode, size=size, sort=sort, descending=order == "desc",
                               by_function=group == "function", page=page, per_page=per_page)
    filters = {"run": run_id, "mode": mode, "size": size, "sort": sort, "order": order, "group": group}
    functions = None if group is None else queries().graph_functions(run_id=run_id, mode=mode, size=size)
    return Resource.from_page(listing, filters=filters, functions=functions)


def graph(raw_id: str) -> Resource:
    return _one("graph", raw_id, queries().graph)


def _by_run_and_kind(kinds: tuple[str, ...], fetch: Callable[..., Page]) -> Resource:
    """A listing filtered by ``?run=`` and ``?kind=`` (one of ``kinds``), one page of it."""
    run_id = _run_filter()
    kind = choice_arg("kind", kinds)
    page, per_page = pagination()
    listing = fetch(run_id=run_id, kind=kind, page=page, per_page=per_page)
    return Resource.from_page(listing, filters={"run": run_id, "kind": kind})


def violations() -> Resource:
    return _by_run_and_kind(VIOLATION_KINDS, queries().violations)


def violation(raw_id: str) -> Resource:
    return _one("violation", raw_id, queries().violation)


def compile_events() -> Resource:
    return _by_run_and_kind(COMPILE_KINDS, queries().compile_events)


def compile_event(raw_id: str) -> Resource:
    return _one("compile event", raw_id, queries().compile_event)


def runs() -> Resource:
    page, per_page = pagination()
    return Resource.from_page(queries().runs(page=page, per_page=per_page))


def run(raw_id: str) -> Resource:
    return _one("run", raw_id, queries().run)


JOB_LIMIT = 200
"""``runs.job`` is a String(200)."""


def jobs() -> Resource:
    page, per_page = pagination()
    return Resource.from_page(queries().jobs(page=page, per_page=per_page))


def ranks() -> Resource:
    """One job rank by rank: ``?job=``, else the newest job (an empty view when there is none)."""
    job = request.args.get("job", "").strip() or None
    if job is not None and len(job) > JOB_LIMIT:
        raise BadRequest(f"job must be at most {JOB_LIMIT} characters, got {len(job)}")
    found = queries().job_ranks(job)
    if found is None:
        raise NotFound(f"no run of job {job!r} (the jobs: /jobs)")
    return Resource(found)


def compare() -> Resource:
    a, b = int_arg("a"), int_arg("b")
    if a is None or b is None:
        raise BadRequest("compare needs two runs: ?a=RUN_ID&b=RUN_ID")
    found = queries().compare_runs(a, b)
    if found is None:
        missing = [r for r in (a, b) if not queries().run_exists(r)]
        raise NotFound(f"no run with id {missing[0]}")
    return Resource(found)


@functools.lru_cache(maxsize=16)
def _advice(histogram: Any, capture_sizes: tuple[int, ...], source: str, max_graphs: int | None,
            max_size: int | None, costs: Any, weighing: Any, decode: Any) -> Any:
    """The advice is a function of the recorded traffic it is given (all of it hashable): asked
    again while nothing new is recorded, it is answered from here. (Optimising a fleet's histogram
    takes 50 ms and more of a core; the histogram changes with every flush of a live run.)"""
    from inspector.advice.recommend import advise

    return advise(histogram, capture_sizes, source=source, max_graphs=max_graphs, max_size=max_size,
                  costs=costs, weighing=weighing, decode=decode)


def advice() -> Resource:
    """The capture sizes the recorded traffic wants (``?run=`` one run, else every run pooled;
    ``?max_graphs=``, ``?max_size=``). When there is nothing to advise on, ``advice`` is null and
    ``unavailable`` says why: an empty database is not a bad request."""
    from inspector.advice.recorded import read_recorded
    from inspector.advice.render import as_dict
    from inspector.errors import UsageError

    run_id = _run_filter()
    max_graphs = int_arg("max_graphs", maximum=4096)
    max_size = int_arg("max_size", maximum=1_000_000)
    state = current_app.extensions[EXTENSION]
    recorded = read_recorded(queries(), None if run_id is None else [run_id], state.store.display_url)
    if max_size is not None and recorded.engine_max is not None and max_size > recorded.engine_max:
        raise BadRequest(f"max_size {max_size} is above the engine's largest batch ({recorded.engine_max})")
    filters = {"run": run_id, "max_graphs": max_graphs, "max_size": max_size}
    try:
        found = _advice(recorded.histogram, recorded.capture_sizes, recorded.source, max_graphs, max_size,
                        recorded.costs, recorded.weighing, recorded.decode)
    except UsageError as why:
        return Resource({"filters": filters, "advice": None, "unavailable": str(why)})
    # The current sizes as recorded, the Overview's figures for the same runs (they change with
    # every flush, so they are not part of the cached advice).
    found = dataclasses.replace(found, current=recorded.current, current_recorded=True)
    return Resource({"filters": filters, "advice": as_dict(found), "unavailable": None})
