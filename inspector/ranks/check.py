"""The ranks of one job, checked against each other: the same graphs captured, the same graph
replayed at every step.

Ranks that disagree hang: a data-parallel rank that captured another set of sizes, or replays an
8-token graph where the others replay 16 tokens, pairs up wrongly with them in its next collective.
``RankCheck`` finds that from what the ranks' recorders wrote (their ``graphs`` rows and step
sequences, see ``inspector.ranks.steps``) and records each difference as a ``rank_divergence`` violation
in the run of the rank that differs, so it is on the dashboard, in ``/metrics`` and in the report
while the job runs, not after it hung.

Which rank differs is decided by a vote: the graph (or the step's label) most ranks have is the
reference, a tie going to the lowest rank's side; with two ranks, rank 0's.

One recorder checks a job: rank 0's, on its flush thread, after each window it committed (and once
more when it closes, with whatever ranks have written by then). Steps are compared once every rank
of the job has recorded them; captured graphs once every rank has started serving (recorded a step
or a replay) and again whenever a rank's graphs change.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from inspector.ranks.steps import EAGER, JOINED, StepSegment, Stretch, stretches
from inspector.recording.batch import PendingViolation, violation_key
from inspector.storage import models
from inspector.storage.store import Store
from inspector.storage.text import column_limits, storable
from inspector.storage.writer import RunInfo, add_to_violation, insert_violations

log = logging.getLogger("graph_inspector.ranks")

CAPTURES = "captured graphs"
STEPS = "step sequence"
"""What a divergence is about (the ``wrapper`` of its violation: ``captured graphs of job J``)."""

GraphKey = tuple[str, str]
"""(mode label, descriptor key)."""


@dataclass(frozen=True, slots=True)
class StoredDescriptor(BatchDescriptor):
    """A descriptor read back from a row, with its stored key (a watched graph's is its identity).
    ``num_tokens`` 0 stands for no graph at all (a rank that ran eagerly where others were idle)."""

    stored_key: str = ""

    def __post_init__(self) -> None:
        pass  # read back from rows written by a recorder: nothing to validate

    @property
    def key(self) -> str:
        return self.stored_key


NO_GRAPH_MODE = CUDAGraphMode.NONE


@dataclass(frozen=True)
class RankRun:
    """The run that stands for one rank of the job: the newest with that rank."""

    run_id: int
    rank: int
    world_size: int
    ended: bool


@dataclass(frozen=True)
class Divergence:
    """One rank that differs from the others, about one graph."""

    run_id: int
    rank: int
    about: str
    """CAPTURES or STEPS."""
    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    message: str


def job_runs(db: Connection | Any, job: str) -> dict[int, RankRun]:
    """rank -> the newest run of ``job`` with that rank."""
    r = models.Run
    rows = db.execute(
        select(r.id, r.rank, r.world_size, r.ended_at).where(r.job == job).order_by(r.rank, r.id)
    )
    return {rank: RankRun(run_id, rank, world, ended is not None) for run_id, rank, world, ended in rows}


def captured_graphs(db: Connection | Any, run_ids: Sequence[int]) -> dict[int, dict[GraphKey, tuple]]:
    """run id -> (mode, descriptor key) -> the descriptor columns of the graph it captured."""
    g = models.Graph
    found: dict[int, dict[GraphKey, tuple]] = {run_id: {} for run_id in run_ids}
    rows = db.execute(
        select(g.run_id, g.mode, g.descriptor_key, g.captured_size, g.num_reqs, g.uniform, g.has_lora,
               g.num_active_loras)
        .where(g.run_id.in_(run_ids))
        .order_by(g.id)
    )
    for run_id, mode, key, *columns in rows:
        found[run_id][(mode, key)] = tuple(columns)
    return found


def _descriptor(key: GraphKey, columns: tuple | None) -> tuple[CUDAGraphMode, BatchDescriptor]:
    mode, descriptor_key = key
    if columns is None:
        return NO_GRAPH_MODE, StoredDescriptor(0, stored_key=descriptor_key)
    size, reqs, uniform, has_lora, loras = columns
    return CUDAGraphMode[mode.upper()], StoredDescriptor(size, reqs, bool(uniform), bool(has_lora), loras,
                                                        stored_key=descriptor_key)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _vote(holders: Mapping[str, set[int]], ranks: Sequence[int]) -> str:
    """The value most ranks hold; a tie goes to the lowest rank's."""
    lowest = min(ranks)
    return max(holders, key=lambda value: (len(holders[value]), lowest in holders[value]))


def rank_matrix(runs: Mapping[int, RankRun], graphs: Mapping[int, Mapping[GraphKey, tuple]],
                replays: Mapping[tuple[int, str, str], int], diverged: set[tuple[int, str, str]]
                ) -> list[dict[str, Any]]:
    """The ranks view: a row per graph key (by mode, then size) with a cell per rank: whether it
    captured the graph, its replays (keyed by (run id, mode, key)), and whether a divergence
    (keyed by (rank, mode, key)) was recorded for it."""
    def size(key: GraphKey) -> int:
        return next((held[key][0] for held in graphs.values() if key in held), 0)

    keys = {key for held in graphs.values() for key in held} | {(mode, key) for _, mode, key in replays}
    rows = []
    for mode, key in sorted(keys, key=lambda k: (k[0], size(k), k[1])):
        cells = [
            {"rank": rank, "captured": (mode, key) in graphs[run.run_id],
             "replays": replays.get((run.run_id, mode, key), 0), "diverged": (rank, mode, key) in diverged}
            for rank, run in runs.items()
        ]
        rows.append({"mode": mode, "key": key, "captured_size": size((mode, key)), "cells": cells,
                     "diverged": any(cell["diverged"] for cell in cells)})
    return rows


# ------------------------------------------------------------------------------ the comparisons


def capture_divergences(runs: Mapping[int, RankRun], graphs: Mapping[int, Mapping[GraphKey, tuple]]
                        ) -> list[Divergence]:
    """The graphs some ranks captured and others did not, each charged to the ranks on the minority
    side (a graph most ranks lack is extra where it is; one most ranks hold is missing elsewhere)."""
    ranks = sorted(runs)
    found = []
    every = sorted({key for rank in ranks for key in graphs[runs[rank].run_id]})
    for key in every:
        have = {rank for rank in ranks if key in graphs[runs[rank].run_id]}
        lack = set(ranks) - have
        if not lack:
            continue
        reference = _vote({"have": have, "lack": lack}, ranks)
        columns = next(graphs[runs[rank].run_id][key] for rank in sorted(have))
        mode, descriptor = _descriptor(key, columns)
        graph = f"{key[0]} {descriptor.key} (captured size {descriptor.captured_size})"
        for rank in sorted(lack if reference == "have" else have):
            if reference == "have":
                message = f"rank {rank} did not capture {graph}, which {_ranks_text(have)} captured"
            else:
                message = f"rank {rank} captured {graph}, which {_ranks_text(lack)} did not"
            found.append(Divergence(runs[rank].run_id, rank, CAPTURES, mode, descriptor, message))
    return found


@dataclass
class StepDivergences:
    """Walks stretches of agreed and differing steps; a rank that keeps differing over consecutive
    steps is one divergence, from its first step."""

    runs: Mapping[int, RankRun]
    graphs: Mapping[int, Mapping[GraphKey, tuple]]
    differing: dict[int, int] = field(default_factory=dict)
    """rank -> the step since which it differs (until it agrees again)."""
    last_stop: int | None = None

    def feed(self, stretch: Stretch) -> list[Divergence]:
        if self.last_stop is not None and stretch.start != self.last_stop:
            self.differing.clear()  # a gap in some rank's record: what follows is new
        self.last_stop = stretch.stop
        if stretch.agreed:
            self.differing.clear()
            return []
        holders: dict[str, set[int]] = defaultdict(set)
        for rank, label in stretch.labels.items():
            holders[label].add(rank)
        reference = _vote(holders, sorted(stretch.labels))
        found = []
        for rank, label in sorted(stretch.labels.items()):
            if label == reference:
                self.differing.pop(rank, None)
                continue
            if rank in self.differing:
                continue
            self.differing[rank] = stretch.start
            mode, descriptor = self._graph_of(rank, label, reference, holders[reference])
            message = (
                f"step {stretch.start}: rank {rank} ran {_shown(label)}, where "
                f"{_ranks_text(holders[reference])} ran {_shown(reference)}"
            )
            found.append(Divergence(self.runs[rank].run_id, rank, STEPS, mode, descriptor, message))
        return found

    def _graph_of(self, rank: int, label: str, reference: str, agreeing: set[int]
                  ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The graph the differing rank replayed, else the one the others did."""
        for owner, text in [(rank, label)] + [(r, reference) for r in sorted(agreeing)]:
            key = _graph_key(text)
            if key is not None:
                columns = self.graphs[self.runs[owner].run_id].get(key)
                if columns is not None:
                    return _descriptor(key, columns)
        return _descriptor(("none", label.split(JOINED)[0]), None)


def _graph_key(label: str) -> GraphKey | None:
    first = label.split(JOINED)[0]
    mode, _, key = first.partition(" ")
    return (mode, key) if key else None


def _shown(label: str) -> str:
    return "a batch eagerly" if label == EAGER else label


# ---------------------------------------------------------------------------------- the checker


class RankCheck:
    """Rank 0's recorder checks its job after each flush. Never raises: a failed check is logged
    and tried again at the next flush."""

    def __init__(self, job: str, world_size: int) -> None:
        self.job = job
        self.world_size = world_size
        self.checked_to = 0
        """Steps before this one are compared."""
        self._steps = StepDivergences({}, {})
        self._compared: dict[int, int] = {}
        """run id -> its graph count when the captures were last compared."""
        self._serving: set[int] = set()
        """Runs seen serving batches (once serving, always: not asked again)."""
        self._written: dict[tuple[int, str, str, str], int] = {}
        """(run id, about, mode, descriptor key) -> the violation row that records it."""
        self._unwritten: list[Divergence] = []
        """Found, not yet committed (the write failed: the next flush tries again)."""
        self._pending_ids: dict[tuple[int, str, str, str], int] = {}
        """Rows the current write made, adopted into ``_written`` once it commits."""

    @classmethod
    def of(cls, info: RunInfo) -> RankCheck | None:
        """The check a recorder runs: rank 0's of a job of more than one rank, else none."""
        if info.job and info.rank == 0 and info.world_size > 1:
            # The job as the runs table stores it (escaped, cut to the column): what the ranks' rows hold.
            return cls(storable(info.job, column_limits(models.Run)["job"]), info.world_size)
        return None

    def after_flush(self, store: Store, final: bool = False) -> int:
        """Compare what the ranks wrote since the last check (reading only), then record what
        differs (writing only then); how many divergences it recorded."""
        try:
            with store.engine.connect() as conn:
                self._unwritten += self.check(conn, final=final)
            if not self._unwritten:
                return 0
            now = time.time()
            with store.writer() as conn:
                for divergence in self._unwritten:
                    self._write(conn, divergence, now)
            self._adopt()
        except Exception as error:  # the engine goes on; the next flush tries again
            log.warning("graph-inspector: could not check the ranks of job %s: %s", self.job, error)
            self._pending_ids.clear()
            return 0
        written, self._unwritten = len(self._unwritten), []
        return written

    def check(self, conn: Connection, final: bool = False) -> list[Divergence]:
        """The divergences in what the ranks wrote since the last check."""
        runs = job_runs(conn, self.job)
        if len(runs) < 2 or (len(runs) < self.world_size and not final):
            return []
        run_ids = [run.run_id for run in runs.values()]
        graphs = captured_graphs(conn, run_ids)
        return self._captures(conn, runs, graphs, final) + self._step_divergences(conn, runs, graphs)

    def _captures(self, conn: Connection, runs: dict[int, RankRun], graphs: dict[int, dict], final: bool
                  ) -> list[Divergence]:
        unknown = [run.run_id for run in runs.values() if run.run_id not in self._serving]
        self._serving |= _serving(conn, unknown)
        ready = {rank: run for rank, run in runs.items() if run.ended or run.run_id in self._serving}
        if len(ready) < (2 if final else len(runs)):
            return []
        counts = {run.run_id: len(graphs[run.run_id]) for run in ready.values()}
        if counts == self._compared:
            return []
        self._compared = counts
        return capture_divergences(ready, graphs)

    def _step_divergences(self, conn: Connection, runs: dict[int, RankRun], graphs: dict[int, dict]
                          ) -> list[Divergence]:
        s = models.StepSequence
        by_run = {run.run_id: rank for rank, run in runs.items()}
        ends = [_steps_recorded(conn, run_id) for run_id in by_run]
        if None in ends:
            return []
        stop = min(end for end in ends if end is not None)
        if stop <= self.checked_to:
            return []
        sequences: dict[int, list[StepSegment]] = {rank: [] for rank in runs}
        rows = conn.execute(
            select(s.run_id, s.first_step, s.sequence)
            .where(s.run_id.in_(by_run), s.first_step + s.steps > self.checked_to, s.first_step < stop)
            .order_by(s.run_id, s.first_step)
        )
        for run_id, first_step, text in rows:
            sequences[by_run[run_id]].append(StepSegment.from_json(first_step, text))
        self._steps.runs, self._steps.graphs = runs, graphs
        found = []
        for stretch in stretches(sequences, self.checked_to, stop):
            found += self._steps.feed(stretch)
        self.checked_to = stop
        return found

    def _write(self, conn: Connection, divergence: Divergence, now: float) -> None:
        mine = (divergence.run_id, divergence.about, divergence.mode.label, divergence.descriptor.key)
        known = self._written.get(mine, self._pending_ids.get(mine))
        if known is not None:
            if divergence.about == STEPS:  # one more stretch of differing steps; a capture is once
                add_to_violation(conn, known, 1, now)
            return
        event = ViolationEvent(
            kind=ViolationKind.RANK_DIVERGENCE, descriptor=divergence.descriptor, mode=divergence.mode,
            wrapper=f"{divergence.about} of job {self.job}", message=divergence.message, seen_at=now,
        )
        key = violation_key(event)
        (self._pending_ids[mine],) = insert_violations(conn, divergence.run_id,
                                                       {key: PendingViolation(event, 1, now, now)}).values()

    def _adopt(self) -> None:
        """The write committed: the rows it made are known from now on."""
        self._written.update(self._pending_ids)
        self._pending_ids.clear()


def _steps_recorded(conn: Connection, run_id: int) -> int | None:
    """The step after the last one ``run_id`` recorded (None: none yet), from its newest row (an
    index lookup, however long the run)."""
    s = models.StepSequence
    return conn.scalar(
        select(s.first_step + s.steps).where(s.run_id == run_id).order_by(s.first_step.desc()).limit(1)
    )


def _serving(conn: Connection, run_ids: Sequence[int]) -> set[int]:
    """The runs that have served a batch (recorded a step, a replay or an eager batch): their
    capture phase is over, so their graphs can be compared."""
    return {
        run_id for run_id in run_ids
        if any(conn.scalar(select(model.id).where(model.run_id == run_id).limit(1)) is not None
               for model in (models.StepSequence, models.ReplayTotal, models.EagerTotal))
    }
