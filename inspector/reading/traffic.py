"""How traffic met the cache, as one value type with one formula per figure, and its readers.

``TrafficTotals`` is what every reader reports: the overview and its JSON twin, the Prometheus
collector, the CI report and the time series of the rollup. Hit ratio and padding waste are
computed here, by the one formula of each (``capture_core.sizes``, which the reference workload's
figures use too), so the page, ``/metrics`` and ``graph-inspector report`` cannot
disagree on the same database. The totals come from the running-totals tables the writer keeps
(``replay_totals``, ``eager_totals``): a few rows per run, never a scan of the windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, cast, func, select

from capture_core.sizes import EagerReason, hit_ratio, padding_waste
from inspector.storage.models import EagerTotal, Graph, ReplayTotal
from inspector.storage.store import Reader


@dataclass(slots=True)
class TrafficTotals:
    """Replays and tokens of some slice of the traffic, plus the batches that ran eagerly."""

    replays: int = 0
    num_real_tokens: int = 0
    padding_tokens: int = 0
    eager_batches: int = 0

    def add(self, other: TrafficTotals) -> None:
        self.replays += other.replays
        self.num_real_tokens += other.num_real_tokens
        self.padding_tokens += other.padding_tokens
        self.eager_batches += other.eager_batches

    @property
    def batches(self) -> int:
        """Every batch: replayed or eager."""
        return self.replays + self.eager_batches

    @property
    def hit_ratio(self) -> float | None:
        """Batches replayed over all batches (None before any batch)."""
        return hit_ratio(self.replays, self.eager_batches)

    @property
    def padding_waste(self) -> float | None:
        """Padding tokens over the tokens the graphs computed (None before any replay)."""
        return padding_waste(self.num_real_tokens, self.padding_tokens)

    def as_dict(self) -> dict[str, Any]:
        """The JSON fields every answer that carries traffic uses."""
        return {
            "replays": self.replays,
            "eager_batches": self.eager_batches,
            "num_real_tokens": self.num_real_tokens,
            "padding_tokens": self.padding_tokens,
            "hit_ratio": self.hit_ratio,
            "padding_waste": self.padding_waste,
        }


def integer_sum(column: ColumnElement[Any]) -> ColumnElement[int]:
    """SUM that stays an integer: PostgreSQL sums bigints as numeric (a Decimal in Python)."""
    return cast(func.sum(column), BigInteger)


def replay_totals(
    db: Reader, *keys: Any, run_ids: Sequence[int] | None = None, graph_ids: Sequence[int] | None = None
) -> dict[tuple, TrafficTotals]:
    """Replay totals grouped by ``keys`` (columns of ``replay_totals``): key tuple -> totals, the
    empty tuple without keys. Eager batches are not in these (they belong to no graph)."""
    t = ReplayTotal
    query = select(*keys, *(integer_sum(c) for c in (t.replays, t.num_real_tokens, t.padding_tokens)))
    if run_ids is not None:
        query = query.where(t.run_id.in_(run_ids))
    if graph_ids is not None:
        query = query.where(t.graph_id.in_(graph_ids))
    if keys:
        query = query.group_by(*keys)
    found = {}
    for *key, replays, real, padding in db.execute(query):
        if replays is not None:
            found[tuple(key)] = TrafficTotals(replays, real, padding)
    return found


def eager_totals(
    db: Reader, *keys: Any, run_ids: Sequence[int] | None = None
) -> dict[tuple, tuple[int, int]]:
    """Eager batches and their real tokens grouped by ``keys`` (columns of ``eager_totals``)."""
    t = EagerTotal
    query = select(*keys, integer_sum(t.batches), integer_sum(t.num_real_tokens)).group_by(*keys)
    if run_ids is not None:
        query = query.where(t.run_id.in_(run_ids))
    rows = db.execute(query)
    return {tuple(key): (batches, tokens) for *key, batches, tokens in rows if batches is not None}


def run_traffic(db: Reader, run_ids: Sequence[int] | None = None) -> TrafficTotals:
    """All the traffic of ``run_ids`` (every run when None), eager batches included."""
    traffic = replay_totals(db, run_ids=run_ids).get((), TrafficTotals())
    traffic.eager_batches = sum(batches for batches, _ in eager_totals(db, run_ids=run_ids).values())
    return traffic


def traffic_per_run(db: Reader, run_ids: Sequence[int]) -> dict[int, TrafficTotals]:
    """Each of ``run_ids``'s traffic, eager batches included (runs with none: zero totals)."""
    replays = replay_totals(db, ReplayTotal.run_id, run_ids=run_ids)
    eager = eager_totals(db, EagerTotal.run_id, run_ids=run_ids)
    found = {}
    for run_id in run_ids:
        traffic = replays.get((run_id,), TrafficTotals())
        traffic.eager_batches = eager.get((run_id,), (0, 0))[0]
        found[run_id] = traffic
    return found


def never_captured(db: Reader, run_ids: Sequence[int] | None = None) -> dict[int, int]:
    """The runs (of ``run_ids``, every run when None) that captured no graph while their batches asked
    for one: run id -> the batches that ran eagerly because no capture phase had begun. A runtime
    configured to capture whose engine never opened ``runtime.capture_phase()`` runs everything
    eagerly, and no other figure says so."""
    waiting = eager_totals(db, EagerTotal.run_id, EagerTotal.reason, run_ids=run_ids)
    found = {run_id: batches for (run_id, reason), (batches, _) in waiting.items()
             if reason == EagerReason.BEFORE_CAPTURE_PHASE.value and batches}
    if not found:
        return {}
    captured = set(db.scalars(select(Graph.run_id).distinct()
                              .where(Graph.run_id.in_(list(found)), Graph.discarded.is_(False))))
    return {run_id: batches for run_id, batches in found.items() if run_id not in captured}


def never_captured_line(batches: int) -> str:
    """What a run that captured no graph is told, wherever it is shown."""
    return (f"captured no graph: its {batches:,} batch(es) ran eagerly, before any capture phase. Graphs "
            "are captured only inside `with runtime.capture_phase():` (a runner's capture() opens one)")
