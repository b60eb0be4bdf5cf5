"""A parent that records while it starts child processes that record: what the fork tests and
``bench/fork_bench.py`` run, and how they count every event the children reported.

A child reports to the recorder it inherited (a fork's child) and to one it starts itself; each
child reports the same events to each. What became of them is read back per child, by pid: the
events its runs recorded, those counted as dropped (the run's row, and the sidecar's lines of that
pid), and the rest, lost without a count.

Importable by ``multiprocessing``'s spawn start method (a module, not a test file).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from capture_core.descriptor import BatchDescriptor
from tests.support.recording import FULL, capture, drift

PARENT_LABEL = "parent"
OWN_LABEL = "child's own"
DESCRIPTOR = BatchDescriptor(4, 4, True)

inherited: Any = None
"""The parent's recorder, which a forked child inherits (None in a spawned child)."""


def child(url: str, events: int, flush_interval: float = 0.05, close_timeout: float = 10.0) -> None:
    """A child's work: ``events`` replays (and a capture and a violation) to the recorder it inherited,
    if any, and the same to a recorder of its own. It returns, and its process ends as
    ``multiprocessing`` ends it."""
    from inspector.recording.recorder import Recorder

    if inherited is not None:
        report(inherited, events)
    own = Recorder(url, label=OWN_LABEL, flush_interval=flush_interval, close_timeout=close_timeout).start()
    report(own, events)


def report(recorder: Any, events: int) -> None:
    recorder.on_capture(capture(DESCRIPTOR))
    for _ in range(events):
        recorder.on_replay(FULL, DESCRIPTOR, 3)
    recorder.on_violation(drift(DESCRIPTOR, actual=0x1000))


def reported(events: int) -> int:
    """What ``report`` reports, counted as events: the replays, a capture and a violation."""
    return events + 2


@dataclass
class Busy:
    """The parent's engine: a thread reporting replays to the parent's recorder without pause, so
    that its flushes (every ``flush_interval``) are under way when the children are made."""

    recorder: Any
    replays: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in range(200):
                self.recorder.on_replay(FULL, DESCRIPTOR, 3)
            self.replays += 200
            time.sleep(0.0005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.replays


def start_children(method: str, count: int, url: str, events: int, **options: Any
                   ) -> list[multiprocessing.Process]:
    context = multiprocessing.get_context(method)
    processes = [context.Process(target=child, args=(url, events), kwargs=options) for _ in range(count)]
    for process in processes:
        process.start()
    return processes


@contextmanager
def slow_writes(seconds: float, armed: threading.Event, entered: threading.Event) -> Iterator[None]:
    """In this process: while ``armed``, the next traffic write of a recorder's flush thread sleeps
    ``seconds`` inside its transaction (the write lock held) after setting ``entered``: a flush
    under way, for a fork to meet. A forked child's flushes are not slowed."""
    from sqlalchemy import Engine, event

    pid = os.getpid()

    def slow(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if (armed.is_set() and os.getpid() == pid and statement.startswith("INSERT INTO replay_windows")
                and threading.current_thread().name == "graph-inspector-recorder"):
            armed.clear()
            entered.set()
            time.sleep(seconds)

    event.listen(Engine, "before_cursor_execute", slow)
    try:
        yield
    finally:
        event.remove(Engine, "before_cursor_execute", slow)


@dataclass
class Account:
    """What became of the events one child reported, to every recorder it reported to."""

    reported: int
    recorded: int
    dropped: int
    runs: dict[str, int]
    """Its runs, by label (a run per recorder it reported to)."""

    @property
    def unaccounted(self) -> int:
        return self.reported - self.recorded - self.dropped


def accounts(url: str, reported_by: dict[int, int]) -> dict[int, Account]:
    """pid -> its account, for each child of ``reported_by`` (pid -> the events it reported): the
    events its runs hold, and those counted as dropped, in their rows, in the sidecar's lines of
    those runs, and in the sidecar's lines of its recorders that have no run (one inert there)."""
    from sqlalchemy import func, select

    from inspector.recording.losses import Sidecar, run_losses
    from inspector.storage.models import Graph, ReplayWindow, Run, Violation
    from inspector.storage.store import open_store, sqlite_file

    store = open_store(url, upgrade=False)
    sidecar = Sidecar(sqlite_file(url))
    try:
        found: dict[int, Account] = {}
        with store.engine.connect() as conn:
            for pid, count in reported_by.items():
                runs = dict(conn.execute(select(Run.id, Run.label).where(Run.pid == pid)).all())
                ids = list(runs)
                recorded = sum(conn.scalar(query) or 0 for query in (
                    select(func.sum(ReplayWindow.replays)).where(ReplayWindow.run_id.in_(ids)),
                    select(func.count()).select_from(Graph).where(Graph.run_id.in_(ids)),
                    select(func.sum(Violation.count)).where(Violation.run_id.in_(ids)),
                ))
                dropped = run_losses(conn, sidecar, ids).total().events
                dropped += sum(losses.events for who, losses in sidecar.recorders()
                               if who.pid == pid and who.run_id is None)
                labels: dict[str, int] = {}
                for label in runs.values():
                    labels[label] = labels.get(label, 0) + 1
                found[pid] = Account(count, recorded, dropped, labels)
        return found
    finally:
        store.dispose()


def run_scenario(url: str, method: str, children: int, events: int, flush_interval: float = 0.01
                 ) -> dict[str, Any]:
    """The benchmark's scenario: a parent recording without pause (its recorder flushing every
    ``flush_interval``) starts ``children`` children one after another (``fork`` or ``spawn``), each
    of which reports ``events`` replays (and a capture and a violation) to the recorder it inherited
    (forked) and to one of its own; then everything each reported is accounted for."""
    global inherited
    from inspector.recording.recorder import Recorder

    recorder = Recorder(url, label=PARENT_LABEL, flush_interval=flush_interval).start()
    inherited = recorder if method == "fork" else None
    busy = Busy(recorder)
    context = multiprocessing.get_context(method)
    processes, start_seconds = [], []
    for _ in range(children):
        process = context.Process(target=child, args=(url, events))
        started = time.perf_counter()
        process.start()
        start_seconds.append(time.perf_counter() - started)
        processes.append(process)
    for process in processes:
        process.join(600)
    parent_reported = busy.stop()
    recorder.close()
    inherited = None
    per_child = (2 if method == "fork" else 1) * reported(events)
    found = accounts(url, {process.pid: per_child for process in processes})
    parent = accounts(url, {os.getpid(): parent_reported})[os.getpid()]
    return {
        "exitcodes": [process.exitcode for process in processes],
        "start_seconds": start_seconds,
        "parent": {"reported": parent.reported, "recorded": parent.recorded, "dropped": parent.dropped},
        "children": [{"pid": pid, "reported": a.reported, "recorded": a.recorded, "dropped": a.dropped,
                      "unaccounted": a.unaccounted, "runs": a.runs} for pid, a in found.items()],
    }
