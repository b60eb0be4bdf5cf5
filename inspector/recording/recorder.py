"""The recorder: the graph cache's observer, writing what it sees into the inspector's database.

Two threads, one direction. The engine's thread calls ``on_replay``/``on_eager`` once per batch:
they bump a counter in a dict and return (no lock, no I/O). Counters only ever grow, so the flush
thread reads them without stopping the engine: it copies the dict (atomic under the GIL), diffs
the copy against what it last *committed*, and writes the difference as this window's rows. A
failed write commits nothing, so the next window simply covers the gap: no count is lost to a race
or to an outage. Captures and violations are rare and carry full records; they are queued, the
flush thread is woken and writes them at once. The ``Recorder`` is the engine's half and the
thread's loop; what the thread holds and writes is ``inspector.recording.flusher``'s, its trouble with the
database ``inspector.recording.outage``'s.

Nothing here raises into the engine once recording has started: a locked, unwritable or vanished
database is retried with backoff (a vanished SQLite file is recreated and what went into the old
one is written again), a corrupt one is left alone, and what cannot be kept is counted as events
(``losses``: replays, eager batches, violation occurrences, captures, real tokens), logged, and
written to the run's row when the database is writable again; what is lost at or after ``close()``
goes where ``inspector.recording.losses`` says. The counters assume one engine thread calls ``on_replay`` at
a time.

A recorder that is a rank of a job (``job``, or torchrun's or SLURM's environment, and more than
one rank) also keeps the order of its batches (``inspector.ranks.steps``: one list append per batch), and
rank 0's recorder compares the ranks after each window (``inspector.ranks.check``).
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, DivergenceEvent, FanOutObserver, NullObserver, ViolationEvent
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from capture_core.step_time import CLOCKS, CUDA_EVENTS
from inspector.ranks.steps import StepLog
from inspector.recording import forks
from inspector.recording.batch import EagerKey, ReplayKey, StepTimeKey, StepTimeSums
from inspector.recording.flusher import Counts, Flusher, TakenOver
from inspector.recording.losses import Losses
from inspector.recording.process import describe_process
from inspector.storage.store import resolve_url, sqlite_file
from inspector.storage.writer import RunInfo

log = logging.getLogger("graph_inspector.recorder")


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
        self._asked = (label, config, rank, world_size, device, job, step_sequence)
        """What the run's process description and its step sequence are made of (a fork makes them
        again, for the child)."""
        # Hot-path counters, written by the engine thread only: key -> [count].
        self._replays: dict[ReplayKey, list[int]] = {}
        self._eager: dict[EagerKey, list[int]] = {}
        # Step-time sums, replaced whole (a tuple) by the engine's thread at each timed step.
        self._step_times: dict[StepTimeKey, StepTimeSums] = {}
        self._begin(describe_process(label, config, rank, world_size, device, job), step_sequence)
        self._cancel_finalizer: Callable[[], None] = lambda: None
        self._late_why = "reported after close()"
        forks.track(self)

    def _begin(self, info: RunInfo, step_sequence: bool | None, since: Counts | None = None) -> None:
        """A run's state before its flush thread starts: at construction, and in a forked child
        (``since``: the counts at the fork, which the child's run counts from)."""
        self.info = info
        if step_sequence is None:
            step_sequence = bool(self.info.job) and self.info.world_size > 1
        self.step_log = StepLog(self.max_pending) if step_sequence else None
        # The hot path appends each bumped counter cell here (None: the order is not kept).
        self._steps: list | None = self.step_log.entries if self.step_log is not None else None
        # Rare events, appended by the engine, drained by the flush thread.
        self._capture_queue: deque[CaptureEvent] = deque()
        self._violation_queue: deque[ViolationEvent] = deque()
        self._divergence_queue: deque[DivergenceEvent] = deque()
        self._arrival_losses = Losses()
        """Dropped by the engine's thread (queue full, or closed); the flush thread's are apart."""
        self._flusher = Flusher(self.url, self.info, self.max_pending, replays=self._replays,
                                eager=self._eager, step_times=self._step_times, captures=self._capture_queue,
                                violations=self._violation_queue, divergences=self._divergence_queue,
                                arrivals=self._arrival_losses, step_log=self.step_log, since=since)
        """The flush thread's state, and its writes."""
        # Coordination.
        self._gate = threading.Lock()
        """Held around every use of the database (the flush thread's, start()'s, the exit hook's): a
        fork waits for it, so that none is under way when the child is made (``inspector.forks``)."""
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._flush_requested = 0
        self._flush_completed = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned_step_time = False
        self._finished = False
        """The flush thread is done, or close() took over from it: every count not written since is
        lost after close()."""
        self._close_deadline = 0.0
        """When (``time.monotonic()``) close() stops retrying: ``close_timeout`` after it was called."""

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

    def replay_cell(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int
                    ) -> list[int] | None:
        """The counter ``on_replay`` bumps for these arguments, for a caller that holds it and bumps
        ``cell[0] += 1`` itself (an engine integration whose step would otherwise pay the lookup every
        time); None where the order of steps is kept too (a rank of a job): call ``on_replay`` then.
        A cell lives as long as the recorder."""
        if self._steps is not None:
            return None
        key = (mode._value_, descriptor.num_tokens, descriptor.num_reqs, descriptor.uniform,
               descriptor.has_lora, descriptor.num_active_loras, num_real_tokens)
        return self._replays.setdefault(key, [0])

    def eager_cell(self, reason: EagerReason, num_real_tokens: int, mode: CUDAGraphMode) -> list[int] | None:
        """The counter ``on_eager`` bumps for these arguments, held by its caller as ``replay_cell``'s
        is (None where the order of steps is kept too: call ``on_eager`` then)."""
        if self._steps is not None:
            return None
        return self._eager.setdefault((reason._value_, mode._value_, num_real_tokens), [0])

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

    def on_divergence(self, event: DivergenceEvent) -> None:
        """Where a graph and its eager step part (rare: after a ``replay_mismatch``); written promptly."""
        if self._closed or len(self._divergence_queue) >= self.max_pending:
            self._arrival_losses.violations += 1
            return
        self._divergence_queue.append(event)
        self._wake.set()

    def on_step_time(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        graph_seconds: float | None,
        eager_seconds: float | None,
        samples: int = 1,
        clock: str = CUDA_EVENTS,
    ) -> None:
        """Timed steps (sampled ones only, never the common replay): added to the graph key's sums,
        written as running totals with the next window. A value that is no time (negative, not
        finite, a sample count below 1, an unknown clock) is left out, and logged once."""
        if not _step_time_ok(graph_seconds, eager_seconds, samples, clock):
            if not self._warned_step_time:
                self._warned_step_time = True
                log.warning("graph-inspector recorder: left out a step time that is no time: graph %r, "
                            "eager %r, samples %r, clock %r (logged once)", graph_seconds, eager_seconds,
                            samples, clock)
            return
        key = (mode._value_, descriptor.num_tokens, descriptor.num_reqs, descriptor.uniform,
               descriptor.has_lora, descriptor.num_active_loras, clock)
        graph_s, graph_n, eager_s, eager_n = self._step_times.get(key, (0.0, 0, 0.0, 0))
        if graph_seconds is not None:
            graph_s, graph_n = graph_s + graph_seconds * samples, graph_n + samples
        if eager_seconds is not None:
            eager_s, eager_n = eager_s + eager_seconds * samples, eager_n + samples
        self._step_times[key] = (graph_s, graph_n, eager_s, eager_n)

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
        losses = self._flusher.losses()
        if self._finished:
            losses.add(self._flusher.take_traffic(time.time())[0].losses())
        return losses

    @property
    def last_error(self) -> str | None:
        """Why the latest write failed, in a line (None while the database takes them)."""
        return self._flusher.outage.last_error

    @property
    def run_id(self) -> int | None:
        """The run's row id, once the run row is written."""
        return self._flusher.run_id

    def start(self) -> Recorder:
        """Open the database (upgraded to head), write the run row, start the flush thread.

        Raises ``DatabaseError`` for a mistake in what it was given, which retrying cannot fix (a
        malformed URL, a file that is not this tool's database, a newer schema). A database that is
        merely unavailable (locked, unwritable) is logged and retried in the background; a corrupt
        one is logged, left untouched and never written, and every event is counted as dropped.
        """
        if self._thread is not None:
            return self
        with self._gate:
            self._flusher.first_attempt(time.time())
        self._start_thread()
        atexit.register(self.close)
        self._cancel_finalizer = forks.on_exit(self.close)
        return self

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._flush_loop, name="graph-inspector-recorder", daemon=True)
        self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Write everything seen so far now; True once it is committed, False on timeout."""
        if self._thread is None or not self._thread.is_alive() or self._flusher.outage.refused:
            return False
        with self._done:
            self._flush_requested += 1
            target = self._flush_requested
        self._wake.set()
        with self._done:
            return self._done.wait_for(lambda: self._flush_completed >= target, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write the last window, end the run, stop the thread. Safe to call twice.

        The thread retries until ``close_timeout`` from now; close() waits for it that long and 5 s
        more (``timeout`` instead, when given) for a write waiting on the database's lock. A thread
        still held up then is taken over: what it had not written is counted as dropped, and it
        writes none of it later."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._cancel_finalizer()
        self._cancel_finalizer = forks.on_exit(self.record_late_losses)
        thread = self._thread
        if thread is None:
            return
        self._close_deadline = time.monotonic() + self.close_timeout
        self._stopping = True
        self._wake.set()
        thread.join(self.close_timeout + 5.0 if timeout is None else timeout)
        if thread.is_alive():
            self._take_over()
        _closed_recorders.add(self)

    def _take_over(self) -> None:
        """The flush thread is still held up (a write waiting on the database's lock): answer for
        what it has not written, so that nothing is lost with it when the process exits."""
        flusher = self._flusher
        if not flusher.custody.take_over(timeout=self.close_timeout + 5.0):
            log.error("graph-inspector recorder: the final commit did not end; what it holds is neither "
                      "known to be written nor counted as dropped")
            return
        flusher.drain_queues()
        flusher.drop_everything()
        self._finished = True
        log.error("graph-inspector recorder: the final flush did not finish; %s events dropped in all",
                  f"{self.dropped:,}")
        flusher.settle(self.losses, "lost at close()", try_database=False)

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
        try:
            self._flush_until_closed()
            self._final_flush()
        except TakenOver:  # close() answered for everything: nothing more to write or count
            pass
        with self._done:
            self._flush_completed = self._flush_requested
            self._done.notify_all()
        with self._gate:
            self._flusher.dispose()

    def _flush_until_closed(self) -> None:
        next_window = time.monotonic() + self.flush_interval
        flusher, outage = self._flusher, self._flusher.outage
        while not self._stopping:
            now = time.monotonic()
            wait = min(next_window, outage.retry_at) if outage.failures else next_window
            self._wake.wait(max(0.0, wait - now))
            self._wake.clear()
            if self._stopping:
                break
            with self._done:
                requested = self._flush_requested
            with flusher.custody.held():
                flusher.drain_queues()
            now = time.monotonic()
            if outage.failures and now < outage.retry_at:
                continue
            window_due = now >= next_window or requested > self._flush_completed
            if not (window_due or flusher.pending):
                continue
            with self._gate:
                committed = flusher.flush_once(include_traffic=window_due, ended=False)
            if committed:
                with self._done:
                    self._flush_completed = max(self._flush_completed, requested)
                    self._done.notify_all()
            if window_due:
                next_window = time.monotonic() + self.flush_interval

    def _final_flush(self) -> None:
        """At close: keep retrying until ``close_timeout`` after close() was called, then count what
        is left as dropped and record what the run's row could not take (``inspector.recording.losses``)."""
        deadline = self._close_deadline
        flusher = self._flusher
        while True:
            with flusher.custody.held():
                flusher.drain_queues()
            with self._gate:
                committed = flusher.flush_once(include_traffic=True, ended=True)
            if committed:
                break
            if flusher.outage.refused or time.monotonic() >= deadline:
                with flusher.custody.held():
                    flusher.drop_everything()
                break
            time.sleep(max(0.0, min(flusher.outage.retry_at, deadline) - time.monotonic()))
        with self._gate, flusher.custody.held():
            self._finished = True
            flusher.settle(self.losses, "lost at close()", try_database=committed)

    def record_late_losses(self) -> None:
        """After close(): what the engine reported since is lost; count it in the run's row, or
        where ``inspector.recording.losses`` says. The exit hook calls this for every closed recorder."""
        if self._finished:
            with self._gate:
                self._flusher.settle(self.losses, self._late_why, try_database=True)
                self._flusher.dispose()

    # ------------------------------------------------------------------ across a fork (inspector.forks)

    def hold_for_fork(self, timeout: float) -> bool:
        """Before a fork: wait (``timeout`` seconds at most) for a use of the database under way to
        end, and keep the next from starting until ``release_after_fork``. False when it did not end."""
        return self._gate.acquire(timeout=timeout)

    def release_after_fork(self) -> None:
        self._gate.release()

    def carry_into_child(self, parent: int, *, quiesced: bool) -> None:
        """In a process just forked from ``parent`` (where this recorder's thread is not, and its
        connections are the parent's), make the recorder this process's. ``quiesced``: no use of the
        database was under way at the fork (``hold_for_fork`` held it)."""
        started, old = self._thread is not None, self._flusher
        recording = started and not self._closed
        label, config, rank, world_size, device, job, step_sequence = self._asked
        if not started and not self._closed:  # it may yet start here, as this process's recorder
            self._begin(describe_process(label, config, rank, world_size, device, job), step_sequence)
            return
        # A child is not the rank or the job its parent is; its run counts from the fork.
        since = Counts({key: cell[0] for key, cell in self._replays.items()},
                       {key: cell[0] for key, cell in self._eager.items()}, self._step_times.copy())
        self._begin(describe_process(label, config, None, None, device, ""), False, since)
        if quiesced:
            old.let_go_after_fork()
        else:  # a connection in use at the fork may hold its driver's locks: never touched again
            _left_in_parent.append(old)
        forks.once_started(self, Recorder._on_exit_of_child)
        # Without quiet, a SQLite file cannot be used here: SQLite's record of its locks in this
        # process lists the parent's connection, which cannot be closed (its lock is held for ever).
        if recording and (quiesced or sqlite_file(self.url) is None):
            self._start_thread()
            return
        self._closed = self._finished = True
        if recording:
            self._late_why = (f"reported in process {self.info.pid}, forked from {parent} while this "
                              "recorder was writing to its database")
            log.error("graph-inspector recorder: process %d was forked from %d while a recorder was writing "
                      "to %s; it records nothing in this process, and what is reported to it here is counted "
                      "as lost: start a Recorder in the child", self.info.pid, parent, self.url)
        else:
            self._late_why = f"reported after close(), in process {self.info.pid} forked from {parent}"
        _closed_recorders.add(self)

    def _on_exit_of_child(self) -> None:
        self._cancel_finalizer = forks.on_exit(self.record_late_losses if self._closed else self.close)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Recorder records the process that started it and cannot be pickled into another: start one "
            "in the spawned process (a forked child carries its parent's recorders over)"
        )


def _step_time_ok(graph_seconds: float | None, eager_seconds: float | None, samples: int, clock: str) -> bool:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1 or clock not in CLOCKS:
        return False
    given = [value for value in (graph_seconds, eager_seconds) if value is not None]
    return bool(given) and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in given)


_closed_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
_left_in_parent: list[Flusher] = []
"""In a forked child: the flushers of recorders forked mid-write, whose connections stay untouched."""


@atexit.register
def _record_late_losses() -> None:
    """Registered before any recorder's own exit hook, so it runs after them all."""
    for recorder in list(_closed_recorders):
        try:
            recorder.record_late_losses()
        except Exception:  # at exit, a log line is all there is to give
            log.exception("graph-inspector recorder: could not record the losses after close()")

