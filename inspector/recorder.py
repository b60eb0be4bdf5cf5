"""The recorder: the graph cache's observer, writing what it sees into the inspector's database.

Two threads, one direction. The engine's thread calls ``on_replay``/``on_eager`` once per batch:
they bump a counter in a dict and return (no lock, no I/O). Counters only ever grow, so the flush
thread reads them without stopping the engine: it copies the dict (atomic under the GIL), diffs
the copy against what it last *committed*, and writes the difference as this window's rows. A
failed write commits nothing, so the next window simply covers the gap: no count is lost to a race
or to an outage. Captures and violations are rare and carry full records; they are queued, the
flush thread is woken and writes them at once.

Nothing here raises into the engine once recording has started: a locked, unwritable or vanished
database is retried with backoff (a vanished SQLite file is recreated and what went into the old
one is written again), a corrupt one is left alone, and what cannot be kept is counted as events
(``losses``: replays, eager batches, violation occurrences, captures, real tokens), logged, and
written to the run's row when the database is writable again; what is lost at or after ``close()``
goes where ``inspector.losses`` says. The counters assume one engine thread calls ``on_replay`` at
a time.

A recorder that is a rank of a job (``job``, or torchrun's or SLURM's environment, and more than
one rank) also keeps the order of its batches (``inspector.steps``: one list append per batch), and
rank 0's recorder compares the ranks after each window (``inspector.ranks``).
"""

from __future__ import annotations

import atexit
import logging
import sqlite3
import threading
import time
import weakref
from collections import deque
from typing import Any

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, FanOutObserver, NullObserver, ViolationEvent
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.batch import (
    EagerKey,
    FlushBatch,
    PendingRecords,
    ReplayKey,
    TrafficWindow,
    traffic_since,
)
from inspector.errors import DatabaseError
from inspector.losses import Losses, RunIdentity, settle
from inspector.process import describe_process
from inspector.ranks import RankCheck
from inspector.steps import StepLog
from inspector.store import (
    Store,
    StoreCorrupt,
    StoreUnavailable,
    StoreVanished,
    open_store,
    resolve_url,
    sqlite_file,
    translate_error,
)
from inspector.writer import RunWriter, update_run

log = logging.getLogger("graph_inspector.recorder")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class Recorder:
    """Records one process's (one rank's) graph-cache events into a database.

    ``flush_interval`` is the replay-window length in seconds. ``max_pending`` bounds the records
    (captures and distinct violations) held while the database is unavailable; beyond it new ones
    are dropped and counted. ``close_timeout`` bounds how long ``close`` keeps retrying.

    ``job`` names the distributed job this process is a rank of (default: torchrun's or SLURM's,
    from the environment; "" for none). ``step_sequence`` keeps the order of the batches for the
    ranks to be compared (default: when the run is a rank of a job of more than one rank).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        label: str = "",
        flush_interval: float = 1.0,
        config: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | None = None,
        max_pending: int = 100_000,
        close_timeout: float = 10.0,
        job: str | None = None,
        step_sequence: bool | None = None,
    ) -> None:
        if not flush_interval > 0:
            raise ValueError(f"flush_interval must be positive, got {flush_interval}")
        self.url = resolve_url(url)
        self.label = label
        self.flush_interval = float(flush_interval)
        self.max_pending = max_pending
        self.close_timeout = close_timeout
        self.info = describe_process(label, config, rank, world_size, device, job)
        # Hot-path counters, written by the engine thread only: key -> [count].
        self._replays: dict[ReplayKey, list[int]] = {}
        self._eager: dict[EagerKey, list[int]] = {}
        if step_sequence is None:
            step_sequence = bool(self.info.job) and self.info.world_size > 1
        self.step_log = StepLog(max_pending) if step_sequence else None
        # The hot path appends each bumped counter cell here (None: the order is not kept).
        self._steps: list | None = self.step_log.entries if self.step_log is not None else None
        self._rank_check = RankCheck.of(self.info)
        # Rare events, appended by the engine, drained by the flush thread.
        self._capture_queue: deque[CaptureEvent] = deque()
        self._violation_queue: deque[ViolationEvent] = deque()
        self._arrival_losses = Losses()
        """Dropped by the engine's thread (queue full, or closed); the flush thread's are apart."""
        # Flush-thread state.
        self._store: Store | None = None
        self._writer: RunWriter | None = None
        self._pending = PendingRecords(max_pending)
        self._committed_replays: dict[ReplayKey, int] = {}
        self._committed_eager: dict[EagerKey, int] = {}
        self._window_start = time.time()
        self._backend: str | None = None
        self._flush_losses = Losses()
        self._recorded_losses = Losses()
        """The losses the run's row (or the sidecar) holds."""
        self._failures = 0
        self._retry_at = 0.0
        self._refused: str | None = None
        """Why this database is never written again (it is corrupt), once it is."""
        self.last_error: str | None = None
        # Coordination.
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._flush_requested = 0
        self._flush_completed = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self._finished = False
        """The flush thread is done: every count it did not write since is lost after close()."""

    # ------------------------------------------------------------------ the observer protocol

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        """Hot path: one dict lookup and one integer bump (and one list append for a rank of a job).

        The key spells out the descriptor's fields: hashing and comparing a tuple of ints is done in
        C, while the dataclass's own ``__hash__``/``__eq__`` are Python calls that would cost more
        than everything else here (a dispatcher hands over a new, equal descriptor every batch).
        """
        key = (
            mode._value_,
            descriptor.num_tokens,
            descriptor.num_reqs,
            descriptor.uniform,
            descriptor.has_lora,
            descriptor.num_active_loras,
            num_real_tokens,
        )
        try:
            cell = self._replays[key]
        except KeyError:
            cell = self._replays[key] = [0]
        cell[0] += 1
        steps = self._steps
        if steps is not None:
            steps.append(cell)

    def on_eager(self, reason: EagerReason, num_real_tokens: int, mode: CUDAGraphMode) -> None:
        key = (reason._value_, mode._value_, num_real_tokens)
        try:
            cell = self._eager[key]
        except KeyError:
            cell = self._eager[key] = [0]
        cell[0] += 1
        steps = self._steps
        if steps is not None:
            steps.append(cell)

    def on_dp_coordination(self, coordination: Any) -> None:
        """``coordinate_batch_across_dp(..., observer=recorder)`` calls this once per step, after the
        ranks agreed: the batches from here to the next agreement are one step of the sequence."""
        steps = self._steps
        if steps is not None:
            steps.append(coordination)

    def on_capture(self, event: CaptureEvent) -> None:
        if self._closed or len(self._capture_queue) >= self.max_pending:
            self._arrival_losses.captures += 1
            return
        self._capture_queue.append(event)
        self._wake.set()

    def on_violation(self, event: ViolationEvent) -> None:
        if self._closed or len(self._violation_queue) >= self.max_pending:
            self._arrival_losses.violations += 1
            return
        self._violation_queue.append(event)
        self._wake.set()

    # ------------------------------------------------------------------ lifecycle

    @property
    def dropped(self) -> int:
        """Events this recorder could not keep (it also logged them): ``losses.events``."""
        return self.losses.events

    @property
    def losses(self) -> Losses:
        """What this recorder could not keep, by kind, counted as the engine reported it; after
        ``close()``, every replay and eager batch reported since its last window too."""
        losses = self._arrival_losses.copy()
        losses.add(self._flush_losses)
        if self._finished:
            losses.add_traffic(self._take_traffic(time.time())[0])
        return losses

    @property
    def run_id(self) -> int | None:
        """The run's row id, once the run row is written."""
        return None if self._writer is None else self._writer.run_id

    def start(self) -> Recorder:
        """Open the database (upgraded to head), write the run row, start the flush thread.

        Raises ``DatabaseError`` for a mistake in what it was given, which retrying cannot fix (a
        malformed URL, a file that is not this tool's database, a newer schema). A database that is
        merely unavailable (locked, unwritable) is logged and retried in the background; a corrupt
        one is logged, left untouched and never written, and every event is counted as dropped.
        """
        if self._thread is not None:
            return self
        try:
            self._open(time.time())
        except DatabaseError as error:
            if not isinstance(error, (StoreUnavailable, StoreCorrupt)):
                raise
            self._note_failure(error, time.monotonic())
        except Exception as error:  # whatever else goes wrong is the recorder's, never the engine's
            self._note_failure(error, time.monotonic())
        self._thread = threading.Thread(target=self._flush_loop, name="graph-inspector-recorder", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        return self

    def flush(self, timeout: float | None = None) -> bool:
        """Write everything seen so far now; True once it is committed, False on timeout."""
        if self._thread is None or not self._thread.is_alive() or self._refused:
            return False
        with self._done:
            self._flush_requested += 1
            target = self._flush_requested
        self._wake.set()
        with self._done:
            return self._done.wait_for(lambda: self._flush_completed >= target, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write the last window, end the run, stop the thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake.set()
        thread.join(self.close_timeout + 5.0 if timeout is None else timeout)
        if thread.is_alive():
            log.error(
                "graph-inspector recorder: the final flush did not finish; %d events dropped", self.dropped
            )
        _closed_recorders.add(self)

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @classmethod
    def attach(cls, *targets: Any, url: str | None = None, **kwargs: Any) -> Recorder:
        """Start a recorder and make it the observer of ``targets`` (anything with ``.observer``).

        An observer already in place keeps receiving events, alongside the recorder.
        """
        recorder = cls(url, **kwargs).start()
        for target in targets:
            existing = getattr(target, "observer", None)
            if existing is None or type(existing) is NullObserver:
                target.observer = recorder
            else:
                target.observer = FanOutObserver(existing, recorder)
        return recorder

    # ------------------------------------------------------------------ the flush thread

    def _flush_loop(self) -> None:
        next_window = time.monotonic() + self.flush_interval
        while not self._stopping:
            now = time.monotonic()
            wait = min(next_window, self._retry_at) if self._failures else next_window
            self._wake.wait(max(0.0, wait - now))
            self._wake.clear()
            if self._stopping:
                break
            with self._done:
                requested = self._flush_requested
            self._drain_queues()
            now = time.monotonic()
            if self._failures and now < self._retry_at:
                continue
            window_due = now >= next_window or requested > self._flush_completed
            if not (window_due or self._pending):
                continue
            if self._flush_once(include_traffic=window_due, ended=False):
                with self._done:
                    self._flush_completed = max(self._flush_completed, requested)
                    self._done.notify_all()
            if window_due:
                next_window = time.monotonic() + self.flush_interval
        self._final_flush()

    def _final_flush(self) -> None:
        """At close: keep retrying until ``close_timeout``, then count what is left as dropped and
        record what the run's row could not take (``inspector.losses``)."""
        deadline = time.monotonic() + self.close_timeout
        while True:
            self._drain_queues()
            if committed := self._flush_once(include_traffic=True, ended=True):
                break
            if self._refused or time.monotonic() >= deadline:
                self._drop_everything()
                break
            time.sleep(max(0.0, min(self._retry_at, deadline) - time.monotonic()))
        self._finished = True
        self._settle_losses("lost at close()", try_database=committed)
        with self._done:
            self._flush_completed = self._flush_requested
            self._done.notify_all()
        if self._store is not None:
            self._store.dispose()

    def _drain_queues(self) -> None:
        while self._capture_queue:
            event = self._capture_queue.popleft()
            if self._admit(self._pending.add_capture, event):
                self._backend = getattr(event, "backend", self._backend)
            else:
                self._lose(Losses(captures=1), "a capture")
        while self._violation_queue:
            if not self._admit(self._pending.add_violation, self._violation_queue.popleft()):
                self._lose(Losses(violations=1), "a violation")

    @staticmethod
    def _admit(add: Any, event: Any) -> bool:
        """``add(event)``: False when the pending set is full, or the event is malformed."""
        try:
            return bool(add(event))
        except Exception:  # a malformed event must not stop the recording of every later one
            log.exception("graph-inspector recorder: could not queue an event; it was dropped")
            return False

    def _flush_once(self, include_traffic: bool, ended: bool) -> bool:
        """One attempt at one transaction; True when it committed."""
        wall = time.time()
        if self._refused:
            return False
        batch = None
        try:
            if self._writer is not None and self._writer.store.vanished():
                self._on_vanished()
            writer = self._writer or self._open(wall)
            steps = None
            if include_traffic:
                if self.step_log is not None:  # before the counters: every cell taken is in them
                    steps = self.step_log.pending(self._replays, self._eager, final=ended)
                traffic, replay_counts, eager_counts = self._take_traffic(wall)
            else:
                traffic, replay_counts, eager_counts = TrafficWindow(self._window_start, wall), None, None
            batch = FlushBatch(
                captures=self._pending.captures_to_write(),
                violations=dict(self._pending.violations),
                traffic=traffic,
                backend=self._backend,
                losses=self.losses,
                ended_at=wall if ended else None,
                steps=steps,
            )
            writer.write(batch, wall)
        except Exception as error:
            if isinstance(error, StoreVanished):
                self._on_vanished()
            elif batch is not None and _refused_as_it_is(error):
                self._shed(batch, (replay_counts, eager_counts), error)
            self._note_failure(error, time.monotonic())
            return False
        # Committed (the queues are drained on this thread only, so nothing arrived meanwhile).
        self._recorded_losses = batch.losses
        self._pending.clear()
        self._pending.resend_graphs = False
        if replay_counts is not None and eager_counts is not None:
            self._committed_replays = replay_counts
            self._committed_eager = eager_counts
            self._window_start = traffic.window_end
            if self.step_log is not None:
                self.step_log.committed()
            if self._rank_check is not None:
                self._rank_check.after_flush(writer.store, final=ended)
        if self._failures:
            log.warning("graph-inspector recorder: %s is writable again", writer.store.display_url)
        self._failures = 0
        self.last_error = None
        return True

    def _open(self, wall: float) -> RunWriter:
        store = open_store(self.url)
        writer = RunWriter(store, self.info)
        try:
            writer.create_run(wall, self._backend)
        except Exception:
            store.dispose()
            raise
        self._store, self._writer = store, writer
        return writer

    def _on_vanished(self) -> None:
        if self._store is None:
            return
        log.warning(
            "graph-inspector recorder: the database file %s vanished; recording into a new one",
            self._store.sqlite_path,
        )
        self._store.dispose()
        self._store = self._writer = None
        self._pending.resend_graphs = True

    def _shed(self, batch: FlushBatch, snapshot: tuple[dict | None, dict | None], error: BaseException
              ) -> None:
        """The database refused the batch as it is (a value it cannot store), which no retry can
        change: give up its records, or, when it had none, its traffic, so the rest gets through."""
        if batch.captures or batch.violations:
            lost, what = self._pending.shed(), "records the database refused"
        elif snapshot[0] is not None and snapshot[1] is not None:
            lost, what = Losses(), "a traffic window the database refused"
            lost.add_traffic(batch.traffic)
            self._committed_replays, self._committed_eager = snapshot  # dealt with: counted as lost
        else:
            return
        self._lose(lost, f"{what}: {_first_line(error)}")

    def _take_traffic(self, wall: float) -> tuple[TrafficWindow, dict, dict]:
        """The counts since the last commit, and the snapshot to adopt if the write commits."""
        replay_counts = {key: cell[0] for key, cell in self._replays.copy().items()}
        eager_counts = {key: cell[0] for key, cell in self._eager.copy().items()}
        window = TrafficWindow(self._window_start, wall)
        traffic_since(window, replay_counts, self._committed_replays, eager_counts, self._committed_eager)
        return window, replay_counts, eager_counts

    def _note_failure(self, error: BaseException, now: float) -> None:
        if isinstance(error, (DBAPIError, sqlite3.Error)):
            error = translate_error(error, self.url)
        self._failures += 1
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._failures - 1))
        self._retry_at = now + backoff
        self.last_error = _first_line(error)
        if isinstance(error, StoreCorrupt):
            self._refuse(error)
        elif self._failures == 1:
            log.warning(
                "graph-inspector recorder: cannot write %s (%s); retrying with backoff",
                self.url,
                self.last_error,
            )
        if isinstance(error, DatabaseError) and not isinstance(error, (StoreUnavailable, StoreCorrupt)):
            log.error("graph-inspector recorder: %s", error)

    @property
    def _trouble(self) -> str:
        """Why nothing is written, in a few words for the lines that count losses."""
        return "the database is corrupt" if self._refused else f"database unavailable: {self.last_error}"

    def _refuse(self, error: StoreCorrupt) -> None:
        if self._refused is None:
            self._refused = str(error)
            log.error("graph-inspector recorder: %s; nothing more is written to it, and every event is "
                      "counted as dropped", error)

    def _lose(self, lost: Losses, what: str) -> None:
        self._flush_losses.add(lost)
        log.error("graph-inspector recorder: dropped %s (%s); %s events dropped in all", lost.describe(),
                  what, f"{self.dropped:,}")

    def _drop_everything(self) -> None:
        traffic, self._committed_replays, self._committed_eager = self._take_traffic(time.time())
        lost = self._pending.clear()  # the snapshot is dealt with: counted as lost, just below
        lost.add_traffic(traffic)
        if self.step_log is not None:  # the order of batches counted above, not events
            self.step_log.drop()
        if lost:
            self._lose(lost, self._trouble)

    def record_late_losses(self) -> None:
        """After close(): what the engine reported since is lost; count it in the run's row, or
        where ``inspector.losses`` says. The exit hook calls this for every closed recorder."""
        if self._finished:
            self._settle_losses("reported after close()", try_database=True)
            if self._store is not None:
                self._store.dispose()

    def _settle_losses(self, why: str, *, try_database: bool) -> None:
        """Put the losses the run's row does not hold yet where a reader finds them."""
        writer, write_row = self._writer, None
        if try_database and writer is not None and writer.run_id is not None and not self._refused:
            run_id = writer.run_id

            def write_row(losses: Losses) -> None:
                with writer.store.writer() as conn:
                    update_run(conn, run_id, time.time(), losses=losses)

        who = RunIdentity(self.run_id, self.info.host, self.info.pid, self.info.started_at)
        self._recorded_losses = settle(self.losses, self._recorded_losses, write_row=write_row,
                                       database=sqlite_file(self.url), who=who, why=why,
                                       trouble=self._trouble)


_closed_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


@atexit.register
def _record_late_losses() -> None:
    """Registered before any recorder's own exit hook, so it runs after them all."""
    for recorder in list(_closed_recorders):
        try:
            recorder.record_late_losses()
        except Exception:  # at exit, a log line is all there is to give
            log.exception("graph-inspector recorder: could not record the losses after close()")


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _refused_as_it_is(error: BaseException) -> bool:
    """The database refused a value in the batch (it would refuse it again), rather than being
    unable to take any write now."""
    if isinstance(error, (DataError, IntegrityError)):
        return True
    return not isinstance(error, (SQLAlchemyError, DatabaseError, OSError, sqlite3.Error))
