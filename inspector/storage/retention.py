"""Retention: old traffic windows folded into coarser ones, every count kept.

A recorder writes a row per graph key, eager reason and batch size at every flush: a week of 64
ranks at a 1 s flush is hundreds of millions of rows, though nobody reads last Tuesday by the
second. A policy of tiers ``AGE:GRAIN`` folds every window that started more than AGE ago into
windows GRAIN wide (aligned to multiples of GRAIN since the epoch); ``1h:1m 1d:1h`` keeps the last
hour at the flush's resolution, the last day by the minute, and anything older by the hour, so the
rows of a run grow with its length in hours, not seconds.

Folding keeps every figure: a folded row is the sum of the rows it replaces (replays, real and
padding tokens, batches, and ``windows``, the flush windows it holds) over the union of their
time spans, and the running totals, which every total is read from, are not touched. It is the one
writer that removes traffic rows; ``inspector.storage.writer`` appends them. The step sequences of ranks of
a job (``inspector.ranks.steps``) are folded the same way: the rows of a grain that follow one another
joined into one, every step and its label kept, so the ranks' check reads the same steps.

It runs as ``graph-inspector db prune --older-than 7d [--grain 1h]``, and in the daemon
(``serve --retain 1h:1m --retain 1d:1h``) on a schedule. Each transaction folds one run's rows of
one slice of time (an hour, or one grain when that is longer), so that recorders never wait on it
for long, and logs itself in ``window_folds``: where the fold got to (the next one starts there),
and the newest row of the slice, from which the daemon's rollup knows whether it had read every
row the fold removed or must rebuild.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Table,
    cast,
    exc,
    func,
    insert,
    literal,
    select,
    tuple_,
)
from sqlalchemy import delete as sql_delete

from inspector.errors import DatabaseError
from inspector.ranks.steps import StepSegment
from inspector.storage import models
from inspector.storage.store import Store, translate_error

FOLD_CACHE_KIB = -262144
"""SQLite's page cache for a fold transaction: 256 MiB (negative: KiB, as SQLite counts it)."""
SLICE_SECONDS = 3600.0
"""The time one fold transaction covers (at least one grain): an hour of one run's windows."""
FOLD_ATTEMPTS = 5
CONFLICT_BACKOFF_S = 0.1
"""The first wait before a fold that met another writer is tried again (doubled each time, with
up to as much again at random, so that two pruners do not meet again in step)."""
CONFLICT_STATES = frozenset({"40001", "40P01"})
"""PostgreSQL's serialization failure and deadlock."""

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """Seconds of ``90s``, ``30m``, ``12h``, ``7d``, ``2w`` (a bare number: seconds)."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive duration like 90s, 30m, 12h, 7d or 2w, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def describe_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{seconds / _UNITS[unit]:g}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Tier:
    """Windows that started more than ``older_than`` seconds ago are folded ``grain`` wide."""

    older_than: float
    grain: float

    @classmethod
    def parse(cls, text: str, default_grain: float = 3600.0) -> Tier:
        """``AGE:GRAIN`` (``1d:1h``), or ``AGE`` alone with ``default_grain``."""
        age, _, grain = text.partition(":")
        return cls(parse_duration(age), parse_duration(grain) if grain else default_grain)

    def __str__(self) -> str:
        return f"older than {describe_duration(self.older_than)} into {describe_duration(self.grain)} windows"


@dataclass(frozen=True)
class Policy:
    """Tiers, finest first; each older tier must be coarser."""

    tiers: tuple[Tier, ...]

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a retention policy needs at least one AGE:GRAIN tier")
        ordered = sorted(self.tiers, key=lambda t: t.older_than)
        for finer, coarser in itertools.pairwise(ordered):
            if coarser.grain <= finer.grain:
                raise ValueError(f"the tier {coarser} must be coarser than the younger tier {finer}")
        object.__setattr__(self, "tiers", tuple(ordered))

    def __str__(self) -> str:
        return ", ".join(str(tier) for tier in self.tiers)


@dataclass(frozen=True)
class _Foldable:
    """A traffic table: the columns a folded row keeps of each group, and those it sums."""

    model: Any
    key: tuple[str, ...]
    """Together with the time bucket, what rows must share to be folded into one."""
    same: tuple[str, ...]
    """Columns that follow from the key (a descriptor's fields): kept as they are."""
    counts: tuple[str, ...]
    last_id: str
    """``window_folds``' column for the newest row of this table in a folded slice."""

    @property
    def table(self) -> Table:
        return self.model.__table__


TABLES = (
    _Foldable(models.ReplayWindow, ("graph_id", "mode", "descriptor_key"),
              ("captured_size", "num_reqs", "uniform", "has_lora", "num_active_loras"),
              ("replays", "num_real_tokens", "padding_tokens"), "last_replay_window_id"),
    _Foldable(models.EagerFallback, ("reason", "mode"), (), ("batches", "num_real_tokens"),
              "last_eager_fallback_id"),
    _Foldable(models.BatchSizeCount, ("num_real_tokens",), (), ("batches", "uniform_batches"),
              "last_batch_size_id"),
)


@dataclass
class FoldReport:
    """What one prune did."""

    policy: Policy
    rows_removed: int = 0
    rows_added: int = 0
    transactions: int = 0
    seconds: float = 0.0
    by_table: dict[str, list[int]] = field(default_factory=dict)
    """table -> [rows removed, rows added]."""

    def line(self) -> str:
        if not self.rows_removed:
            return f"nothing to fold ({self.policy})"
        tables = ", ".join(f"{name} {gone:,} -> {made:,}" for name, (gone, made) in self.by_table.items())
        return (f"folded {self.rows_removed:,} rows into {self.rows_added:,} in {self.transactions} "
                f"transactions, {self.seconds:.1f} s ({tables}; {self.policy}); every total unchanged")


def prune(store: Store, policy: Policy, now: float | None = None) -> FoldReport:
    """Fold every run's traffic rows as ``policy`` says, finest tier first; a database error is a
    ``DatabaseError`` of one line (each slice folded before it stays folded)."""
    now = time.time() if now is None else now
    report = FoldReport(policy)
    started = time.perf_counter()
    try:
        for tier in policy.tiers:
            cutoff = math.floor((now - tier.older_than) / tier.grain) * tier.grain
            older = select(models.Run.id).where(models.Run.started_at < cutoff)
            with store.engine.connect() as conn:
                runs = conn.execute(older).scalars().all()
            for run_id in runs:
                _fold_run(store, run_id, tier.grain, cutoff, now, report)
    except exc.DBAPIError as error:
        raise translate_error(error, store.display_url) from None
    report.seconds = time.perf_counter() - started
    return report


def _fold_run(store: Store, run_id: int, grain: float, cutoff: float, now: float, report: FoldReport) -> None:
    """Fold ``run_id``'s rows that started before ``cutoff``, from where the last fold at ``grain``
    got to (less one grain, for windows written late), one slice with rows at a time. The last slice
    is logged even when it folded nothing, so that the next prune starts after it."""
    width = max(grain, math.floor(SLICE_SECONDS / grain) * grain)
    with store.engine.connect() as conn:
        f = models.WindowFold
        done = conn.scalar(select(func.max(f.range_end)).where(f.run_id == run_id, f.grain == grain))
        slices: set[int] = set()
        for m in (*(spec.model for spec in TABLES), models.StepSequence):
            span = [m.run_id == run_id, m.window_start < cutoff]
            if done is not None:
                span.append(m.window_start >= done - grain)
            index = time_bucket(conn, m.window_start, width)
            slices.update(conn.scalars(select(index).where(*span).distinct()))
    for index in sorted(slices):
        end = min((index + 1) * width, cutoff)
        progress = index == max(slices) and (done is None or end > done)
        _fold_slice(store, run_id, index * width, end, grain, now, report, progress)


def _fold_slice(store: Store, run_id: int, start: float, end: float, grain: float, now: float,
                report: FoldReport, progress: bool) -> None:
    """One transaction: the run's rows that started in ``[start, end)``, folded ``grain`` wide; it is
    logged when it folded anything, or (``progress``) to say how far folding got.

    On PostgreSQL a fold that meets another writer of the same rows (another pruner: ``db prune``
    while the daemon's retention runs) fails with a serialization failure and changes nothing; it
    is tried again on a new snapshot, where the other's work is done, up to ``FOLD_ATTEMPTS`` times.
    """
    for attempt in range(1, FOLD_ATTEMPTS + 1):
        try:
            by_table = _fold_slice_once(store, run_id, start, end, grain, now, progress)
        except exc.DBAPIError as error:
            if not _conflicted(error):
                raise translate_error(error, store.display_url) from None
            if attempt == FOLD_ATTEMPTS:
                raise DatabaseError(
                    f"{store.display_url}: folding run {run_id}'s windows kept meeting another writer of "
                    f"the same rows ({_first_line(error)}; {attempt} attempts); nothing was changed: run "
                    "it again"
                ) from None
            time.sleep(CONFLICT_BACKOFF_S * 2 ** (attempt - 1) * (1 + random.random()))
            continue
        for table, (gone, made) in by_table.items():
            counts = report.by_table.setdefault(table, [0, 0])
            counts[0] += gone
            counts[1] += made
            report.rows_removed += gone
            report.rows_added += made
        report.transactions += 1
        return


def _fold_slice_once(store: Store, run_id: int, start: float, end: float, grain: float, now: float,
                     progress: bool) -> dict[str, tuple[int, int]]:
    """``_fold_slice``'s transaction; what it removed and added, by table, once it committed."""
    by_table: dict[str, tuple[int, int]] = {}
    with _transaction(store) as conn:
        last_ids: dict[str, int] = {}
        for spec in TABLES:
            gone, made, last = _fold_table(conn, spec, run_id, start, end, grain)
            last_ids[spec.last_id] = last
            by_table[spec.table.name] = (gone, made)
        gone, made = _fold_steps(conn, run_id, start, end, grain)
        if gone:
            by_table[models.StepSequence.__tablename__] = (gone, made)
        removed = sum(gone for gone, _ in by_table.values())
        added = sum(made for _, made in by_table.values())
        if removed or progress:
            conn.execute(insert(models.WindowFold).values(
                run_id=run_id, folded_at=now, range_start=start, range_end=end, grain=grain,
                rows_removed=removed, rows_added=added, **last_ids,
            ))
    return by_table


def _first_line(error: exc.DBAPIError) -> str:
    return (str(error.orig).strip().splitlines() or [type(error.orig).__name__])[0]


def _conflicted(error: exc.DBAPIError) -> bool:
    """A serialization failure or a deadlock: the transaction was rolled back, and may be retried."""
    original = error.orig
    state = getattr(original, "sqlstate", None) or getattr(original, "pgcode", None)
    return state in CONFLICT_STATES


def _fold_table(conn: Connection, spec: _Foldable, run_id: int, start: float, end: float, grain: float
                ) -> tuple[int, int, int]:
    """Insert the folded rows of one table's slice, delete those they replace; (removed, added,
    the newest id in the slice)."""
    t = spec.table
    newest = conn.scalar(select(func.max(t.c.id))) or 0
    groups = [t.c[name] for name in (*spec.key, *spec.same)]
    spans = [func.min(t.c.window_start)]
    if "window_end" in t.c:
        spans.append(func.max(t.c.window_end))
    folded = (
        select(literal(run_id), *groups, *spans, *(func.sum(t.c[name]) for name in (*spec.counts, "windows")))
        .where(t.c.run_id == run_id, t.c.window_start >= start, t.c.window_start < end, t.c.id <= newest)
        .group_by(*groups, time_bucket(conn, t.c.window_start, grain))
        .having(func.count() > 1)
    )
    columns = ["run_id", *spec.key, *spec.same, "window_start", *(["window_end"] if len(spans) > 1 else []),
               *spec.counts, "windows"]
    conn.execute(t.insert().from_select(columns, folded))
    # What this transaction inserted (a snapshot of its own: see _transaction); rowcount of an
    # INSERT ... SELECT is not reported by every driver.
    added = conn.scalar(select(func.count()).where(t.c.run_id == run_id, t.c.id > newest))
    if not added:
        return 0, 0, 0
    # The rows replaced: older rows of the slice in the group (key and bucket) of a new row. (NULL
    # never equals NULL, and a window of a graph the run never captured has a NULL graph_id.)
    key = [func.coalesce(t.c[name], 0) if name == "graph_id" else t.c[name] for name in spec.key]
    bucket = time_bucket(conn, t.c.window_start, grain)
    made = select(*key, bucket).where(t.c.run_id == run_id, t.c.id > newest)
    replaced = [t.c.run_id == run_id, t.c.window_start >= start, t.c.window_start < end, t.c.id <= newest,
                tuple_(*key, bucket).in_(made)]
    # The newest row of the slice (an index-only look-up; the rows replaced are among them): the
    # rollup's test of whether it had read every row this fold removed.
    last = conn.scalar(select(func.max(t.c.id)).where(*replaced[:4])) or 0
    removed = conn.execute(sql_delete(t).where(*replaced)).rowcount
    return removed, added, last


def _fold_steps(conn: Connection, run_id: int, start: float, end: float, grain: float) -> tuple[int, int]:
    """A rank's step sequences of the slice: the rows of one ``grain``-wide bucket that follow one
    another step for step joined into one (run-length encoded: every step keeps its number and
    label, so the ranks compare the same; a gap, steps a recorder dropped, stays a gap). (removed,
    added)."""
    s = models.StepSequence
    rows = conn.execute(
        select(s.id, s.first_step, s.window_start, s.window_end, s.sequence)
        .where(s.run_id == run_id, s.window_start >= start, s.window_start < end)
        .order_by(s.first_step)
    )
    groups: list[tuple[int, StepSegment, list[int], list[float]]] = []
    for row_id, first_step, window_start, window_end, sequence in rows:
        bucket = math.floor(window_start / grain)
        if groups and groups[-1][0] == bucket and groups[-1][1].end_step == first_step:
            _, joined, ids, span = groups[-1]
            joined.extend(StepSegment.from_json(first_step, sequence))
            ids.append(row_id)
            span[1] = max(span[1], window_end)
        else:
            segment = StepSegment.from_json(first_step, sequence)
            groups.append((bucket, segment, [row_id], [window_start, window_end]))
    removed = added = 0
    for _, joined, ids, (window_start, window_end) in groups:
        if len(ids) < 2:
            continue
        conn.execute(sql_delete(s).where(s.id.in_(ids)))
        conn.execute(insert(s).values(run_id=run_id, first_step=joined.first_step, steps=joined.steps,
                                      window_start=window_start, window_end=window_end,
                                      sequence=joined.to_json()))
        removed, added = removed + len(ids), added + 1
    return removed, added


@contextmanager
def _transaction(store: Store) -> Iterator[Connection]:
    """SQLite: a write transaction (the write lock, the file checks). PostgreSQL: one snapshot for
    the whole fold (REPEATABLE READ), so the rows it deletes are exactly those it summed, whatever
    recorders commit meanwhile, and a second pruner at once fails instead of folding twice."""
    if store.is_sqlite:
        with store.writer() as conn:
            # A fold reads and rewrites thousands of pages, which SQLite's default 2 MiB page cache
            # would read again and again. Its own cache, for the transaction only.
            previous = conn.exec_driver_sql("PRAGMA cache_size").scalar()
            conn.exec_driver_sql(f"PRAGMA cache_size = {FOLD_CACHE_KIB}")
            try:
                yield conn
            finally:
                conn.exec_driver_sql(f"PRAGMA cache_size = {int(previous)}")
        return
    with store.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn, conn.begin():
        # Rows just written have no statistics yet, and an estimate of one row makes the planner
        # match a slice against its folded rows by nested loops: minutes for a slice of ten thousand
        # rows. Hashing the folded rows' keys is right at every size here.
        conn.exec_driver_sql("SET LOCAL enable_nestloop = off")
        yield conn


class Pruner:
    """The daemon's schedule: ``prune`` every ``every`` seconds on its own thread, each result
    passed to ``report`` (a failure too: retention must never stop the daemon)."""

    def __init__(self, store: Store, policy: Policy, every: float, report: Callable[[str], None]) -> None:
        self.store = store
        self.policy = policy
        self.every = every
        self.report = report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="graph-inspector-retention", daemon=True)

    def start(self) -> Pruner:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the schedule, waiting ``timeout`` seconds at most for a fold under way (one cut short
        at exit rolls back, losing nothing)."""
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                self.report(prune(self.store, self.policy).line())
            except Exception as error:  # the next round tries again
                self.report(f"prune failed, trying again in {describe_duration(self.every)}: {error}")
            if self._stop.wait(self.every):
                return


def time_bucket(conn: Connection, column: ColumnElement[float], grain: float) -> ColumnElement[int]:
    """The time-bucket index of a row: floor(time / grain). SQLite's CAST truncates, which is the
    floor for positive times (its floor() is an optional build); PostgreSQL's CAST rounds."""
    scaled = column / grain
    if conn.dialect.name != "sqlite":
        scaled = func.floor(scaled)
    return cast(scaled, BigInteger).label("bucket")
