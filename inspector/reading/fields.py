"""How each kind of row reads in an answer: JSON-ready dictionaries, built in one place so that a
listing, a detail page and their JSON twins show a row the same way.

Times stay UNIX epoch seconds, memory bytes; addresses come as integers and as hex text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select

from capture_core.events import ViolationKind
from inspector.storage.models import CompileRecord, Graph, Run, Violation
from inspector.storage.store import Reader


def address_hex(address: int | None) -> str | None:
    return None if address is None else f"0x{address:x}"


def descriptor_fields(row: Graph | Violation) -> dict[str, Any]:
    return {
        "captured_size": row.captured_size,
        "num_reqs": row.num_reqs,
        "uniform": bool(row.uniform),
        "has_lora": bool(row.has_lora),
        "num_active_loras": row.num_active_loras,
        "key": row.descriptor_key,
    }


def run_label(run: Run) -> str:
    return run.label or f"run {run.id} ({run.host}, rank {run.rank})"


def run(row: Run) -> dict[str, Any]:
    try:
        config = json.loads(row.config or "{}")
    except ValueError:
        config = {"unparsed": row.config}
    return {
        "id": row.id,
        "label": run_label(row),
        **_columns(row, "host", "pid", "process", "rank", "world_size", "job", "device", "backend"),
        "config": config,
        **_columns(row, "started_at", "last_seen_at", "ended_at", "dropped_events"),
    }


def graph(row: Graph) -> dict[str, Any]:
    return {
        **_columns(row, "id", "run_id", "mode"),
        "descriptor": descriptor_fields(row),
        **_columns(row, "backend", "wrapper", "capture_seconds", "pool_bytes"),
        **_columns(row, "num_segments", "num_ubatches"),
        "unexpected": bool(row.unexpected),
        "captured_at": row.captured_at,
        "engine_key": row.engine_key or None,
        "discarded": bool(row.discarded),
    }


def violation(row: Violation) -> dict[str, Any]:
    return {
        **_columns(row, "id", "run_id", "kind", "mode"),
        "descriptor": descriptor_fields(row),
        **_columns(row, "wrapper", "input_name", "expected_address"),
        "expected_address_hex": address_hex(row.expected_address),
        "actual_address": row.actual_address,
        "actual_address_hex": address_hex(row.actual_address),
        **_columns(row, "message", "stack"),
        "injected": bool(row.injected),
        **_columns(row, "count", "first_seen_at", "last_seen_at"),
    }


def linked_violations(db: Reader, rows: Sequence[Violation]) -> list[dict[str, Any]]:
    """``violation`` for each row, with what a page links it to: the graph it was found in
    (``graph_id``: its run's newest serving graph of that mode and key; None when the run holds none,
    as for a rank that never captured the graph it diverged on) and its run's ``job``."""
    run_ids = sorted({v.run_id for v in rows})
    if not run_ids:
        return []
    g = Graph
    graphs = {
        (run_id, mode, key): graph_id
        for run_id, mode, key, graph_id in db.execute(
            select(g.run_id, g.mode, g.descriptor_key, func.max(g.id))
            .where(g.run_id.in_(run_ids), g.discarded.is_(False))
            .group_by(g.run_id, g.mode, g.descriptor_key)
        )
    }
    jobs = dict(db.execute(select(Run.id, Run.job).where(Run.id.in_(run_ids))).all())
    return [violation(v) | {"graph_id": graphs.get((v.run_id, v.mode, v.descriptor_key)),
                            "job": jobs.get(v.run_id)} for v in rows]


def injected_captures(db: Reader, graph_ids: Sequence[int] | None = None, run_ids: Sequence[int] | None = None
                      ) -> set[int]:
    """The graphs (of ``graph_ids``, or of ``run_ids``, or every one) captured by an unexpected capture
    planted on purpose: its ``unexpected_capture`` violation is marked injected (the demo plants one)."""
    g, v = Graph, Violation
    query = (
        select(g.id).distinct()
        .join(v, (v.run_id == g.run_id) & (v.mode == g.mode) & (v.descriptor_key == g.descriptor_key))
        .where(g.unexpected.is_(True), v.kind == ViolationKind.UNEXPECTED_CAPTURE.value, v.injected.is_(True))
    )
    if graph_ids is not None:
        query = query.where(g.id.in_(graph_ids))
    if run_ids is not None:
        query = query.where(g.run_id.in_(run_ids))
    return set(db.scalars(query))


def compile_event(row: CompileRecord) -> dict[str, Any]:
    return _columns(row, "id", "run_id", "kind", "function", "reason", "message", "count", "first_seen_at",
                    "last_seen_at")


def _columns(row: Any, *names: str) -> dict[str, Any]:
    """The columns ``names`` of ``row`` as they are stored."""
    return {name: getattr(row, name) for name in names}
