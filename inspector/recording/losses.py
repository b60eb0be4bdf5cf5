"""What recorders could not keep, counted as the engine reported it, and where that is written.

A recorder that cannot write (its database locked past ``close_timeout``, unwritable, full, gone
with its folder, corrupt) or whose pending set is full drops what it holds and counts it as
*events*, what the engine reported: every replay, eager batch, violation occurrence and capture,
and the real tokens of the lost batches (``Losses``). A lost window of 42,600 replays is 42,600
replays, however few rows it would have been.

Where the counts go:

1. into the run's row (``runs.dropped_*``) with every flush that commits, so a loss is on record
   as soon as the database takes a write again;
2. for a loss at or after ``close()``, when the database takes no more writes (or the run row was
   never written): into a sidecar file next to a SQLite database, ``<database>.losses`` (one JSON
   line per giving-up recorder, with the run's identity and its totals so far), which the
   dashboard, ``/metrics`` and ``graph-inspector report`` read and add in (``run_losses``);
3. always into the log (stderr, unless the engine configured logging), the only record where
   there is no file to put one next to (PostgreSQL) or it cannot be written either (a full disk).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, select

from inspector.storage.models import Run

if TYPE_CHECKING:
    from inspector.storage.store import Reader

log = logging.getLogger("graph_inspector.recorder")

SIDECAR_SUFFIX = ".losses"


@dataclass
class Losses:
    """Events a recorder dropped, by kind, and the real tokens of the dropped batches."""

    captures: int = 0
    violations: int = 0
    """Occurrences: a finding seen 5 times and lost counts 5."""
    replays: int = 0
    eager_batches: int = 0
    real_tokens: int = 0
    """``num_real_tokens`` of the lost replays and eager batches."""
    unclassified: int = 0
    """Counted before recorders counted losses by kind: a run recorded by an older version (whose
    count was of rows, not events). Never set by a recorder of this version."""

    @property
    def events(self) -> int:
        return self.captures + self.violations + self.replays + self.eager_batches + self.unclassified

    def __bool__(self) -> bool:
        return bool(self.events or self.real_tokens)

    def add(self, other: Losses) -> None:
        for name in _NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def most(self, other: Losses) -> Losses:
        """Each count's larger value: two records of one recorder's running totals, merged."""
        return Losses(**{name: max(getattr(self, name), getattr(other, name)) for name in _NAMES})

    def copy(self) -> Losses:
        return Losses(**asdict(self))

    def columns(self) -> dict[str, int]:
        """The run row's columns."""
        return {"dropped_events": self.events} | {f"dropped_{name}": getattr(self, name) for name in _KINDS}

    @classmethod
    def of_row(cls, dropped_events: int, *kinds: int) -> Losses:
        """What a run row's ``dropped_events`` and ``COLUMNS`` say (what ``dropped_events`` counts
        beyond the kinds is an older version's ``unclassified`` count)."""
        losses = cls(*kinds)
        losses.unclassified = max(0, dropped_events - losses.events)
        return losses

    def as_dict(self) -> dict[str, int]:
        """The JSON fields of an answer's ``dropped`` object."""
        return {"events": self.events, **asdict(self)}

    def describe(self) -> str:
        """``42,600 replays (170,400 real tokens), 3 violations``: what was lost, for a person."""
        parts = []
        if self.replays or self.eager_batches:
            batches = [f"{self.replays:,} replays"] if self.replays else []
            if self.eager_batches:
                batches.append(f"{self.eager_batches:,} eager batches")
            parts.append(f"{' and '.join(batches)} ({self.real_tokens:,} real tokens)")
        if self.violations:
            parts.append(f"{self.violations:,} violation occurrence(s)")
        if self.captures:
            parts.append(f"{self.captures:,} capture(s)")
        if self.unclassified:
            parts.append(f"{self.unclassified:,} counted before losses were counted by kind")
        return ", ".join(parts) or "nothing"


_NAMES = tuple(f.name for f in fields(Losses))
_KINDS = tuple(name for name in _NAMES if name != "unclassified")
COLUMNS = tuple(f"dropped_{name}" for name in _KINDS)
"""The runs table's per-kind dropped columns, in ``Losses``' order (``dropped_events`` is their
sum of events)."""


@dataclass(frozen=True)
class RunIdentity:
    """Which recorder a sidecar line is about: its run (None when the row was never written) and
    what the run row holds of its process; the pid and start time tell the run from one of the same
    id in a database since replaced."""

    run_id: int | None
    host: str
    pid: int
    started_at: float


def sidecar_path(database: Path) -> Path:
    return database.with_name(database.name + SIDECAR_SUFFIX)


def record_unwritten(database: Path | None, who: RunIdentity, losses: Losses, why: str) -> str:
    """Record ``losses`` (the recorder's totals so far) that its run row does not hold: in the log,
    and in the sidecar next to a SQLite ``database``. Says where they went."""
    run = "a run never written" if who.run_id is None else f"run {who.run_id}"
    where = "the log"
    if database is not None:
        path = sidecar_path(database)
        line = json.dumps({**asdict(who), "recorded_at": time.time(), "why": why, "losses": asdict(losses)})
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                size = os.fstat(fd).st_size
                torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a writer killed mid-line
                os.write(fd, (("\n" if torn else "") + line + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            where = str(path)
        except OSError as error:
            log.error("graph-inspector recorder: cannot write %s (%s)", path, error.strerror or error)
    log.error(
        "graph-inspector recorder: %s lost %s events in all (%s) that its run row does not hold (%s); "
        "recorded in %s", run, f"{losses.events:,}", losses.describe(), why, where,
    )
    return where


def settle(losses: Losses, recorded: Losses, *, write_row: Callable[[Losses], None] | None,
           database: Path | None, who: RunIdentity, why: str, trouble: str) -> Losses:
    """Put ``losses`` where a reader finds them when the run's row holds less (``recorded``): into
    the row (one attempt, through ``write_row``, when there is one), else the sidecar and the log
    (saying ``why`` they were lost and the ``trouble`` that keeps them from the row). Returns what
    is now on record."""
    if losses.events <= recorded.events:
        return recorded
    if write_row is not None:
        try:
            write_row(losses)
        except Exception as error:
            first = str(error).splitlines()[0] if str(error) else repr(error)
            trouble = f"the run's row could not take them: {first}"
        else:
            log.error("graph-inspector recorder: %s events %s are lost; run %s counts %s dropped",
                      f"{losses.events - recorded.events:,}", why, who.run_id, losses.describe())
            return losses
    record_unwritten(database, who, losses, f"{why}; {trouble}")
    return losses


class Sidecar:
    """A reader of one database's sidecar, reread only when the file changes."""

    def __init__(self, database: Path | None) -> None:
        self.path = None if database is None else sidecar_path(database)
        self._seen: tuple[int, int] | None = None
        self._lines: dict[tuple, tuple[RunIdentity, Losses]] = {}

    @classmethod
    def of_engine(cls, engine: Engine) -> Sidecar:
        from inspector.storage.store import sqlite_file

        return cls(sqlite_file(engine.url))

    def recorders(self) -> list[tuple[RunIdentity, Losses]]:
        """Each recorder's largest totals in the file (a recorder may write a line at close and
        another at exit, each with its totals so far)."""
        if self.path is None:
            return []
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._lines = None, {}
            return []
        if self._seen != (st.st_mtime_ns, st.st_size):
            self._lines = _parse(self.path)
            self._seen = (st.st_mtime_ns, st.st_size)
        return list(self._lines.values())


def _parse(path: Path) -> dict[tuple, tuple[RunIdentity, Losses]]:
    found: dict[tuple, tuple[RunIdentity, Losses]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            who = RunIdentity(entry["run_id"], entry["host"], entry["pid"], entry["started_at"])
            losses = Losses(**{name: int(entry["losses"].get(name, 0)) for name in _NAMES})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a torn line (a recorder killed mid-write) or another tool's; the rest count
        key = (who.host, who.pid, who.started_at, who.run_id)
        known = found.get(key)
        found[key] = (who, losses if known is None else known[1].most(losses))
    return found


@dataclass
class RecordedLosses:
    """What every record says was dropped: per run (its row and its sidecar lines, merged), and by
    recorders whose run is not in the database (never written, or the database was replaced)."""

    runs: dict[int, Losses]
    unattributed: Losses

    def total(self) -> Losses:
        total = self.unattributed.copy()
        for losses in self.runs.values():
            total.add(losses)
        return total


def run_losses(db: Reader, sidecar: Sidecar, run_ids: Sequence[int] | None = None) -> RecordedLosses:
    """The dropped events of ``run_ids`` (every run, and the unattributed ones, when None)."""
    columns = [getattr(Run, name) for name in COLUMNS]
    query = select(Run.id, Run.dropped_events, *columns)
    if run_ids is not None:
        query = query.where(Run.id.in_(run_ids))
    runs = {run_id: Losses.of_row(*counts) for run_id, *counts in db.execute(query)}
    unattributed = Losses()
    recorders = sidecar.recorders()
    if recorders:
        ids = {who.run_id for who, _ in recorders if who.run_id is not None}
        known = {
            run_id: (pid, started_at)
            for run_id, pid, started_at in db.execute(
                select(Run.id, Run.pid, Run.started_at).where(Run.id.in_(ids))
            )
        }
        for who, losses in recorders:
            if known.get(who.run_id) == (who.pid, who.started_at):
                if who.run_id in runs:
                    runs[who.run_id] = runs[who.run_id].most(losses)
            elif run_ids is None:
                unattributed.add(losses)
    return RecordedLosses(runs, unattributed)
