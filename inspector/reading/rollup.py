"""In-memory time series of the append-only traffic tables, folded in incrementally by row id.

Totals per graph key come from the recorder's running-totals tables, but the overview's charts need
traffic *over time* and the batch-size histogram: sums over every replay window (a million rows is
an ordinary week of a busy engine), and a full scan costs far more than a page may take. The
recorder only ever *appends* replay windows, eager-fallback windows, batch-size counts and new
violation findings (a repeat bumps a finding's count, never the number of rows), so the
daemon reads each row once: every refresh sums, in the database, the rows whose id is above the
last one folded (grouped by run and time bucket, by run and batch size, by run and violation kind)
and adds those few sums to small dictionaries. A refresh that finds nothing new costs four indexed
``max(id)`` look-ups. When rows disappear (a run was deleted, the database was replaced) everything
is rebuilt.

Retention (``inspector.storage.retention``) replaces old rows by folded ones, which sum them: a folded row
(``windows`` > 1) adds nothing the rollup does not hold already, as long as it had read every row
the fold removed. Each fold says the newest row of the slice it folded (``window_folds``); folds
within what was read are taken as they are (their rows skipped), any other means a rebuild, which
reads the folded rows whole. One snapshot per refresh (SQLite's read transaction, PostgreSQL's
REPEATABLE READ) makes a fold's log row and its rows visible together.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, and_, case, func, or_, select

from inspector.reading.traffic import TrafficTotals, integer_sum
from inspector.storage.models import BatchSizeCount, EagerFallback, ReplayWindow, Run, Violation, WindowFold
from inspector.storage.retention import time_bucket


@dataclass
class TimeBuckets:
    """Traffic per time bucket of one run. The bucket width doubles whenever there are too many
    buckets, so a run of any length keeps a bounded, evenly spaced history."""

    max_buckets: int
    width: float = 1.0
    buckets: dict[int, TrafficTotals] = field(default_factory=dict)

    def bucket(self, at: float) -> TrafficTotals:
        index = int(at // self.width)
        found = self.buckets.get(index)
        if found is None:
            found = self.buckets[index] = TrafficTotals()
            if len(self.buckets) > self.max_buckets:
                self.coarsen()
                return self.bucket(at)
        return found

    def coarsen(self) -> None:
        """Halve the number of buckets by doubling their width."""
        merged: dict[int, TrafficTotals] = {}
        for index, traffic in self.buckets.items():
            merged.setdefault(index // 2, TrafficTotals()).add(traffic)
        self.width *= 2
        self.buckets = merged


@dataclass
class RunTraffic:
    """What the rollup knows about one run's traffic."""

    series: TimeBuckets
    batch_sizes: dict[int, int]
    """real token count -> batches."""
    findings: dict[str, int]
    """violation kind -> distinct findings (rows: a repeat bumps a row's count, not the rows)."""
    decode_sizes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """real token count -> the batches that replayed a uniform-decode graph."""
    untold: int = 0
    """Batches whose rows do not say whether they were decode steps (written before it was told)."""


SETTLE_SECONDS = 2.0
"""How long an id must have been visible before rows up to it are folded, where writers are
concurrent (PostgreSQL): a sequence hands out ids before commit, so id 11 can be visible while id 10
is still being written. Recorder transactions last milliseconds; waiting this long means no row is
skipped. SQLite serialises writers, so ids commit in order there and nothing waits."""


class Rollup:
    """Traffic over time (replay and eager windows), batch-size counts and violation findings, per run.

    Thread-safe: the daemon's request threads share one instance; ``refresh`` folds under a lock.
    Readers' answers are memoised until the next refresh that folds anything, and are shared: treat
    them as read-only.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_buckets: int = 1024,
        total_buckets: int = 200_000,
        settle_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.max_buckets = max_buckets
        self.total_buckets = total_buckets
        """Bound on buckets over all runs (a database of thousands of CI runs must not fill memory):
        past it, the longest series are coarsened first."""
        if settle_seconds is None:
            settle_seconds = 0.0 if engine.dialect.name == "sqlite" else SETTLE_SECONDS
        self.settle_seconds = settle_seconds
        self._clock = clock
        self._sightings: deque[tuple[float, dict[str, int]]] = deque()
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._last_ids = {"replay": 0, "eager": 0, "sizes": 0, "violations": 0}
        self._runs: dict[int, RunTraffic] = {}
        self._known_run_ids: set[int] = set()
        self._memo: dict[tuple, Any] = {}
        self._fold_mark = 0
        """The newest ``window_folds`` row taken into account."""
        self._rebuilding = True
        """The next fold reads every folded row, not only the recorders' rows."""

    def _run(self, run_id: int) -> RunTraffic:
        found = self._runs.get(run_id)
        if found is None:
            found = self._runs[run_id] = RunTraffic(
                TimeBuckets(self.max_buckets), defaultdict(int), defaultdict(int)
            )
        return found

    def refresh(self) -> None:
        """Fold in every row appended since the last refresh (rebuilding if rows went away)."""
        with self._lock, self.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            run_ids = set(conn.scalars(select(Run.id)))
            maxima = {
                "replay": conn.scalar(select(func.max(ReplayWindow.id))) or 0,
                "eager": conn.scalar(select(func.max(EagerFallback.id))) or 0,
                "sizes": conn.scalar(select(func.max(BatchSizeCount.id))) or 0,
                "violations": conn.scalar(select(func.max(Violation.id))) or 0,
            }
            vanished = self._known_run_ids - run_ids
            folds = self._folds_read(conn)
            if vanished or folds is None or any(maxima[name] < last for name, last in self._last_ids.items()):
                self._reset()
            self._fold_mark = conn.scalar(select(func.max(WindowFold.id))) or 0
            maxima = self._settled(maxima)
            if maxima == self._last_ids and run_ids == self._known_run_ids:
                return
            self._memo.clear()
            self._known_run_ids = run_ids
            if maxima["replay"] > self._last_ids["replay"] or maxima["eager"] > self._last_ids["eager"]:
                grain = self._grain(conn)
                self._fold_replays(conn, maxima["replay"], grain)
                self._fold_eager(conn, maxima["eager"], grain)
            self._fold_batch_sizes(conn, maxima["sizes"])
            self._fold_findings(conn, maxima["violations"])
            self._last_ids = maxima
            self._rebuilding = False
            self._keep_within_budget()

    def _folds_read(self, conn: Connection) -> bool | None:
        """True when every fold since the last refresh removed only rows already read (or there was
        none); None when one removed rows not read yet, or fold rows went away: rebuild."""
        f = WindowFold
        mark = conn.scalar(select(func.max(f.id))) or 0
        if mark == self._fold_mark:
            return True
        if mark < self._fold_mark:
            return None
        removed = conn.execute(
            select(func.max(f.last_replay_window_id), func.max(f.last_eager_fallback_id),
                   func.max(f.last_batch_size_id)).where(f.id > self._fold_mark)
        ).one()
        read = (self._last_ids["replay"], self._last_ids["eager"], self._last_ids["sizes"])
        within = all((newest or 0) <= last for newest, last in zip(removed, read, strict=True))
        return True if within else None

    def _rows(self, model: Any, name: str, upto: int) -> ColumnElement[bool]:
        """The rows of ``model`` to fold in: the recorders' rows since the last refresh; in a
        rebuild, every folded row too (one a later fold made adds nothing new)."""
        raw = and_(model.id > self._last_ids[name], model.id <= upto, model.windows == 1)
        return or_(raw, model.windows > 1) if self._rebuilding else raw

    def buckets_held(self) -> int:
        """Time buckets held over all runs: what the memory of the rollup grows with."""
        with self._lock:
            return sum(len(run.series.buckets) for run in self._runs.values())

    def _keep_within_budget(self) -> None:
        total = sum(len(run.series.buckets) for run in self._runs.values())
        for run in sorted(self._runs.values(), key=lambda r: -len(r.series.buckets)):
            while total > self.total_buckets and len(run.series.buckets) > 1:
                before = len(run.series.buckets)
                run.series.coarsen()
                total -= before - len(run.series.buckets)
            if total <= self.total_buckets:
                return

    def warm(self) -> None:
        """Load everything there is before the first request (the daemon calls this at start)."""
        self.refresh()
        if self.settle_seconds:
            time.sleep(self.settle_seconds)
            self.refresh()

    def _settled(self, maxima: dict[str, int]) -> dict[str, int]:
        """The newest maxima seen at least ``settle_seconds`` ago (never above today's, never below
        what is already folded)."""
        if not self.settle_seconds:
            return maxima
        now = self._clock()
        self._sightings.append((now, maxima))
        ripe = now - self.settle_seconds
        while len(self._sightings) > 1 and self._sightings[1][0] <= ripe:
            self._sightings.popleft()
        seen_at, settled = self._sightings[0]
        if seen_at > ripe:
            return dict(self._last_ids)
        return {name: max(self._last_ids[name], min(settled[name], maxima[name])) for name in maxima}

    def _grain(self, conn: Connection) -> float:
        """The time-bucket width to group new rows by: one second for a trickle of new rows, coarser
        (a power of two) when the rows to fold span more time than ``max_buckets`` seconds."""
        if self._last_ids["replay"] or self._last_ids["eager"]:
            return 1.0
        first = conn.scalar(select(func.min(ReplayWindow.window_start)))
        last = conn.scalar(select(func.max(ReplayWindow.window_start)))
        grain = 1.0
        if first is not None and last is not None:
            while (last - first) / grain > self.max_buckets:
                grain *= 2
        return grain

    def _fold_replays(self, conn: Connection, upto: int, grain: float) -> None:
        w = ReplayWindow
        bucket = time_bucket(conn, w.window_start, grain)
        for run_id, index, replays, real, padding in conn.execute(
            select(w.run_id, bucket, *(integer_sum(c) for c in (w.replays, w.num_real_tokens,
                                                                  w.padding_tokens)))
            .where(self._rows(w, "replay", upto))
            .group_by(w.run_id, bucket)
        ):
            self._run(run_id).series.bucket(index * grain).add(TrafficTotals(replays, real, padding))

    def _fold_eager(self, conn: Connection, upto: int, grain: float) -> None:
        e = EagerFallback
        bucket = time_bucket(conn, e.window_start, grain)
        for run_id, index, batches in conn.execute(
            select(e.run_id, bucket, integer_sum(e.batches))
            .where(self._rows(e, "eager", upto))
            .group_by(e.run_id, bucket)
        ):
            self._run(run_id).series.bucket(index * grain).eager_batches += batches

    def _fold_batch_sizes(self, conn: Connection, upto: int) -> None:
        b = BatchSizeCount
        untold = case((b.uniform_batches.is_(None), b.batches), else_=0)
        for run_id, size, batches, decode, unknown in conn.execute(
            select(b.run_id, b.num_real_tokens, integer_sum(b.batches), integer_sum(b.uniform_batches),
                   integer_sum(untold))
            .where(self._rows(b, "sizes", upto))
            .group_by(b.run_id, b.num_real_tokens)
        ):
            run = self._run(run_id)
            run.batch_sizes[size] += batches
            if decode:
                run.decode_sizes[size] += decode
            run.untold += unknown or 0

    def _fold_findings(self, conn: Connection, upto: int) -> None:
        v = Violation
        for run_id, kind, rows in conn.execute(
            select(v.run_id, v.kind, func.count(v.id))
            .where(v.id > self._last_ids["violations"], v.id <= upto)
            .group_by(v.run_id, v.kind)
        ):
            self._run(run_id).findings[kind] += rows

    # Readers: memoised per scope until the next refresh folds new rows.

    def _memoised(self, key: tuple, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._memo:
                self._memo[key] = compute()
            return self._memo[key]

    def _selected(self, run_ids: Iterable[int] | None) -> list[RunTraffic]:
        if run_ids is None:
            return list(self._runs.values())
        return [self._runs[r] for r in run_ids if r in self._runs]

    def batch_sizes(self, run_ids: Iterable[int] | None = None) -> dict[int, int]:
        """real token count -> batches, ascending."""
        scope = _scope(run_ids)

        def compute() -> dict[int, int]:
            merged: dict[int, int] = defaultdict(int)
            for run in self._selected(scope):
                for size, batches in run.batch_sizes.items():
                    merged[size] += batches
            return dict(sorted(merged.items()))

        return self._memoised(("batch_sizes", scope), compute)

    def decode_batch_sizes(self, run_ids: Iterable[int] | None = None) -> tuple[dict[int, int], int]:
        """real token count -> the batches that replayed a uniform-decode graph, ascending; and how
        many batches' rows do not say (written before this was told)."""
        scope = _scope(run_ids)

        def compute() -> tuple[dict[int, int], int]:
            merged: dict[int, int] = defaultdict(int)
            untold = 0
            for run in self._selected(scope):
                untold += run.untold
                for size, batches in run.decode_sizes.items():
                    merged[size] += batches
            return dict(sorted(merged.items())), untold

        return self._memoised(("decode_batch_sizes", scope), compute)

    def findings(self, run_ids: Iterable[int] | None = None) -> dict[str, int]:
        """violation kind -> distinct findings."""
        scope = _scope(run_ids)

        def compute() -> dict[str, int]:
            merged: dict[str, int] = defaultdict(int)
            for run in self._selected(scope):
                for kind, rows in run.findings.items():
                    merged[kind] += rows
            return dict(sorted(merged.items()))

        return self._memoised(("findings", scope), compute)

    def series(
        self, run_ids: Iterable[int] | None = None, points: int = 120
    ) -> list[tuple[float, TrafficTotals]]:
        """Traffic over time as at most about ``points`` (bucket start, traffic) pairs, oldest first."""
        scope = _scope(run_ids)
        return self._memoised(("series", scope, points), lambda: self._series(scope, points))

    def _series(self, scope: tuple[int, ...] | None, points: int) -> list[tuple[float, TrafficTotals]]:
        runs = [r for r in self._selected(scope) if r.series.buckets]
        if not runs:
            return []
        starts = [i * r.series.width for r in runs for i in r.series.buckets]
        first, last = min(starts), max(starts)
        width = max(max(r.series.width for r in runs), (last - first) / points or 1.0)
        merged: dict[int, TrafficTotals] = defaultdict(TrafficTotals)
        for run in runs:
            for index, traffic in run.series.buckets.items():
                merged[int((index * run.series.width - first) // width)].add(traffic)
        return [(first + i * width, merged[i]) for i in sorted(merged)]

def _scope(run_ids: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if run_ids is None else tuple(sorted(run_ids))

