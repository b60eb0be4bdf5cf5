"""The flush thread's half of a recorder: what it takes from the engine's counters and queues, and
how it gets that into the database (``inspector.recording.recorder`` tells the whole story).

Each window it copies the counters, diffs the copy against what the database holds (the snapshot
of the last commit) and writes the difference with the records pending, in one transaction
(``inspector.storage.writer``); only a commit moves the snapshot. A vanished SQLite file is recreated and
what went into it is written again; a batch the database refuses as it is gives up its records
(or its traffic) and counts them as lost; the trouble with the database is ``inspector.recording.outage``'s.

What the thread has not written is its to answer for until ``close()`` stops waiting for it
(``Custody``): then ``close()`` counts it as lost, and the thread, whenever it gets through, finds
that and writes nothing more. So every event is written or counted once, however long a write
waits on the database's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

from capture_core.events import CaptureEvent, DivergenceEvent, ViolationEvent
from inspector.errors import DatabaseError
from inspector.ranks.check import RankCheck
from inspector.ranks.steps import StepLog
from inspector.recording.batch import (
    EagerKey,
    FlushBatch,
    PendingRecords,
    ReplayKey,
    StepTimeKey,
    StepTimeSums,
    TrafficWindow,
    step_times_since,
    traffic_since,
)
from inspector.recording.losses import Losses, RunIdentity, settle
from inspector.recording.outage import Outage, first_line, refused_as_it_is
from inspector.storage.store import (
    Store,
    StoreCorrupt,
    StoreUnavailable,
    StoreVanished,
    open_store,
    sqlite_file,
)
from inspector.storage.writer import RunInfo, RunWriter, update_run

log = logging.getLogger("graph_inspector.recorder")


class Counts(NamedTuple):
    """A copy of the engine's counters and step-time sums: what the database holds once it commits."""

    replays: dict[ReplayKey, int]
    eager: dict[EagerKey, int]
    step_times: dict[StepTimeKey, StepTimeSums]


class TakenOver(Exception):
    """``close()`` answered for what the flush thread had not written: the thread changes nothing more."""


class Custody:
    """Who answers for the events a recorder has not written: its flush thread, until ``close()``
    gives up waiting for it and takes them over.

    The thread makes every change to what it answers for (queued records into its pending set, a
    commit and what it adopts from it, a loss counted) holding the custody, which raises
    ``TakenOver`` once ``close()`` has it. A commit holds it from the moment the transaction has the
    write lock until the commit is adopted, so ``close()`` never counts as lost what the database
    keeps, nor misses what it does not: it waits for a commit under way, never for a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the thread may take it again inside a write that holds it
        self.taken_over = False

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self.taken_over:
                raise TakenOver
            yield

    def take_over(self, timeout: float) -> bool:
        """Take it from the thread (False when a commit under way did not end within ``timeout``)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self.taken_over = True
        self._lock.release()
        return True


class Flusher:
    """Writes one recorder's run: its counters (``replays``, ``eager``: key -> [count], bumped by the
    engine's thread), its queued ``captures`` and ``violations``, and the order of its batches
    (``step_log``). ``arrivals`` are the losses the engine's thread counted; the flusher's own are
    apart. Every method but ``losses`` and ``take_traffic`` runs on the flush thread."""

    def __init__(self, url: str, info: RunInfo, max_pending: int, *, replays: dict[ReplayKey, list[int]],
                 eager: dict[EagerKey, list[int]], step_times: dict[StepTimeKey, StepTimeSums],
                 captures: deque[CaptureEvent], violations: deque[ViolationEvent], arrivals: Losses,
                 step_log: StepLog | None, divergences: deque[DivergenceEvent] | None = None,
                 since: Counts | None = None) -> None:
        self.url, self.info = url, info
        self._replays, self._eager, self._step_times = replays, eager, step_times
        self._captures, self._violations, self._arrivals = captures, violations, arrivals
        self._divergences: deque[DivergenceEvent] = divergences if divergences is not None else deque()
        self.step_log = step_log
        self._rank_check = RankCheck.of(info)
        self.store: Store | None = None
        self._writer: RunWriter | None = None
        self.pending = PendingRecords(max_pending)
        # A forked child's run counts from the fork: what the parent had then is not its.
        self._committed = since if since is not None else Counts({}, {}, {})
        self._window_start = time.time()
        self._backend: str | None = None
        self._lost = Losses()
        self._recorded_losses = Losses()
        """The losses the run's row (or the sidecar) holds."""
        self.outage = Outage(url)
        self.custody = Custody()

    @property
    def run_id(self) -> int | None:
        return None if self._writer is None else self._writer.run_id

    def dispose(self) -> None:
        if self.store is not None:
            self.store.dispose()

    def let_go_after_fork(self) -> None:
        """In a forked child: let go of the parent's connections (``Store.let_go_after_fork``)."""
        if self.store is not None:
            self.store.let_go_after_fork()

    def losses(self) -> Losses:
        """What the engine's thread and the flusher dropped (not the traffic left unwritten)."""
        losses = self._arrivals.copy()
        losses.add(self._lost)
        return losses

    def first_attempt(self, wall: float) -> None:
        """Open the database and write the run row, once, as the recorder starts: ``DatabaseError`` for
        what no retry can fix; any other failure is the outage's, to retry."""
        try:
            self._open(wall)
        except DatabaseError as error:
            if not isinstance(error, (StoreUnavailable, StoreCorrupt)):
                raise
            self.outage.failed(error, time.monotonic())
        except Exception as error:  # whatever else goes wrong is the recorder's, never the engine's
            self.outage.failed(error, time.monotonic())

    def drain_queues(self) -> None:
        while self._captures:
            event = self._captures.popleft()
            if self._admit(self.pending.add_capture, event):
                self._backend = getattr(event, "backend", self._backend)
            else:
                self._lose(Losses(captures=1), "a capture")
        while self._violations:
            if not self._admit(self.pending.add_violation, self._violations.popleft()):
                self._lose(Losses(violations=1), "a violation")
        while self._divergences:  # the located detail of a violation: counted as one when lost
            if not self._admit(self.pending.add_divergence, self._divergences.popleft()):
                self._lose(Losses(violations=1), "a located divergence")

    @staticmethod
    def _admit(add: Any, event: Any) -> bool:
        """``add(event)``: False when the pending set is full, or the event is malformed."""
        try:
            return bool(add(event))
        except Exception:  # a malformed event must not stop the recording of every later one
            log.exception("graph-inspector recorder: could not queue an event; it was dropped")
            return False

    def flush_once(self, include_traffic: bool, ended: bool) -> bool:
        """One attempt at one transaction; True when it committed (``TakenOver`` when ``close()``
        answered for it meanwhile: the transaction is rolled back)."""
        if self.outage.refused:
            return False
        with ExitStack() as held:
            return self._flush_once(include_traffic, ended, lambda: held.enter_context(self.custody.held()))

    def _flush_once(self, include_traffic: bool, ended: bool, hold_custody: Callable[[], None]) -> bool:
        wall = time.time()
        batch = None
        try:
            if self._writer is not None and self._writer.store.vanished():
                self._on_vanished()
            writer = self._writer or self._open(wall)
            steps = None
            if include_traffic:
                if self.step_log is not None:  # before the counters: every cell taken is in them
                    steps = self.step_log.pending(self._replays, self._eager, final=ended)
                traffic, counts = self.take_traffic(wall)
            else:
                traffic, counts = TrafficWindow(self._window_start, wall), None
            batch = FlushBatch(
                captures=self.pending.captures_to_write(),
                violations=dict(self.pending.violations),
                divergences=list(self.pending.divergences),
                traffic=traffic,
                backend=self._backend,
                losses=self.losses(),
                ended_at=wall if ended else None,
                steps=steps,
            )
            writer.write(batch, wall, holding=hold_custody)
        except TakenOver:
            raise
        except Exception as error:
            if isinstance(error, StoreVanished):
                self._on_vanished()
            elif batch is not None and refused_as_it_is(error):
                hold_custody()
                self._shed(batch, counts, error)
            self.outage.failed(error, time.monotonic())
            return False
        # Committed, the custody held (the queues are drained on this thread only, so nothing arrived
        # meanwhile).
        self._recorded_losses = batch.losses
        self.pending.clear()
        self.pending.resend_graphs = False
        if counts is not None:
            self._committed = counts
            self._window_start = traffic.window_end
            if self.step_log is not None:
                self.step_log.committed()
            if self._rank_check is not None:
                self._rank_check.after_flush(writer.store, final=ended)
        self.outage.committed(writer.store.display_url)
        return True

    def _open(self, wall: float) -> RunWriter:
        store = open_store(self.url)
        writer = RunWriter(store, self.info)
        try:
            writer.create_run(wall, self._backend)
        except Exception:
            store.dispose()
            raise
        self.store, self._writer = store, writer
        return writer

    def _on_vanished(self) -> None:
        if self.store is None:
            return
        log.warning(
            "graph-inspector recorder: the database file %s vanished; recording into a new one",
            self.store.sqlite_path,
        )
        self.store.dispose()
        self.store = self._writer = None
        self.pending.resend_graphs = True

    def _shed(self, batch: FlushBatch, counts: Counts | None, error: BaseException) -> None:
        """The database refused the batch as it is (a value it cannot store), which no retry can
        change: give up its records, or, when it had none, its traffic, so the rest gets through."""
        if batch.captures or batch.violations or batch.divergences:
            lost, what = self.pending.shed(), "records the database refused"
        elif counts is not None:
            lost, what = Losses(), "a traffic window the database refused"
            lost.add(batch.traffic.losses())
            self._committed = counts  # dealt with: counted as lost
        else:
            return
        self._lose(lost, f"{what}: {first_line(error)}")

    def take_traffic(self, wall: float) -> tuple[TrafficWindow, Counts]:
        """The counts since the last commit, and the snapshot to adopt if the write commits."""
        counts = Counts(
            {key: cell[0] for key, cell in self._replays.copy().items()},
            {key: cell[0] for key, cell in self._eager.copy().items()},
            self._step_times.copy(),  # tuples, replaced whole by the engine's thread: no cell to tear
        )
        window = TrafficWindow(self._window_start, wall)
        committed = self._committed
        traffic_since(window, counts.replays, committed.replays, counts.eager, committed.eager)
        step_times_since(window, counts.step_times, committed.step_times)
        return window, counts

    def _lose(self, lost: Losses, what: str) -> None:
        self._lost.add(lost)
        log.error("graph-inspector recorder: dropped %s (%s); %s events dropped in all", lost.describe(),
                  what, f"{self.losses().events:,}")

    def drop_everything(self) -> None:
        traffic, self._committed = self.take_traffic(time.time())
        lost = self.pending.clear()  # the snapshot is dealt with: counted as lost, just below
        lost.add(traffic.losses())
        if self.step_log is not None:  # the order of batches counted above, not events
            self.step_log.drop()
        if lost:
            self._lose(lost, self.outage.trouble)

    def settle(self, total: Losses, why: str, *, try_database: bool) -> None:
        """Put ``total`` (the recorder's losses, in all) where a reader finds them, if the run's row
        does not hold them yet."""
        writer, write_row = self._writer, None
        if try_database and writer is not None and writer.run_id is not None and not self.outage.refused:
            run_id = writer.run_id

            def write_row(losses: Losses) -> None:
                with writer.store.writer() as conn:
                    update_run(conn, run_id, time.time(), losses=losses)

        who = RunIdentity(self.run_id, self.info.host, self.info.pid, self.info.started_at)
        self._recorded_losses = settle(total, self._recorded_losses, write_row=write_row,
                                       database=sqlite_file(self.url), who=who, why=why,
                                       trouble=self.outage.trouble)
