"""Listings a page at a time: the ``Page`` every listing answers with, and the helpers that cut one.

Shared by the read side's listings (``inspector.reading.run_queries``, ``graph_queries``, ``job_queries``,
``queries``): a filter of equalities, a count and one ``offset``/``limit`` query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from inspector.storage.models import Violation

VIOLATION_ORDER = (Violation.first_seen_at.desc(), Violation.id.desc())
"""Violations are listed newest first."""


@dataclass(frozen=True)
class Page:
    """One page of a listing."""

    items: list[dict[str, Any]]
    page: int
    per_page: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))

    def meta(self) -> dict[str, int]:
        return {"page": self.page, "per_page": self.per_page, "total": self.total, "pages": self.pages}


def equal(*pairs: tuple[Any, Any]) -> list[Any]:
    """``column == value`` for every pair whose value is given (None: no filter on that column)."""
    return [column == value for column, value in pairs if value is not None]


def page_of(
    session: Session, model: Any, filters: Sequence[Any], order: Sequence[Any], page: int, per_page: int
) -> tuple[int, list[Any]]:
    """How many rows of ``model`` match ``filters``, and the ``page``-th ``per_page`` of them in ``order``."""
    total = session.scalar(select(func.count(model.id)).where(*filters)) or 0
    rows = session.scalars(
        select(model).where(*filters).order_by(*order).offset((page - 1) * per_page).limit(per_page)
    ).all()
    return total, list(rows)
