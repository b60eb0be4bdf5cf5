"""Where wrong graphs went wrong: the divergences a probe located, beside the violations they explain.

A ``replay_mismatch`` says which output of a graph's step differs from the same step run eagerly; the
divergence (``capture_core.locate``, written to ``divergences``) says where in the model it began.
Every answer that shows a violation shows the newest divergence located for the same run, mode and
graph key (``None`` for other kinds, or where none was located).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from inspector.storage.models import Divergence

REPLAY_MISMATCH = "replay_mismatch"


def divergence_fields(row: Divergence) -> dict[str, Any]:
    try:
        agreeing = json.loads(row.agreeing or "[]")
    except ValueError:
        agreeing = [row.agreeing]
    return {
        "id": row.id,
        "module": row.module,
        "max_abs_error": row.max_abs_error,
        "max_rel_error": row.max_rel_error,
        "agreeing": agreeing,
        "modules_compared": row.modules_compared,
        "reproduced": bool(row.reproduced),
        "probe": row.probe,
        "message": row.message,
        "injected": bool(row.injected),
        "seen_at": row.seen_at,
    }


def with_divergences(session: Session, items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` (violations as ``fields.violation`` has them), each with its ``divergence``: the newest
    located for a replay mismatch's run, mode and graph key, else None. One query."""
    keys = {(v["run_id"], v["mode"], v["descriptor"]["key"]) for v in items if v["kind"] == REPLAY_MISMATCH}
    newest: dict[tuple[int, str, str], Divergence] = {}
    if keys:
        d = Divergence
        for row in session.scalars(
            select(d).where(tuple_(d.run_id, d.mode, d.descriptor_key).in_(sorted(keys))).order_by(d.id)
        ):
            newest[(row.run_id, row.mode, row.descriptor_key)] = row
    found = []
    for item in items:
        row = newest.get((item["run_id"], item["mode"], item["descriptor"]["key"]))
        located = divergence_fields(row) if row is not None and item["kind"] == REPLAY_MISMATCH else None
        found.append({**item, "divergence": located})
    return found


def newest_divergences(session: Session, run_ids: Sequence[int]) -> dict[tuple[int, str, str], str]:
    """(run, mode, graph key) -> the newest divergence located there, in words (for ``report``)."""
    d = Divergence
    return {(row.run_id, row.mode, row.descriptor_key): row.message
            for row in session.scalars(select(d).where(d.run_id.in_(run_ids)).order_by(d.id))}
