"""The watch's flusher, for what the Recorder cannot key: per-graph replays and compile events.

The Recorder counts replays by the descriptor's fields (fast, and right for capture_core, where a
descriptor is a graph). Watched graphs are told apart by call site and shapes, which are not
descriptor fields: two engines' 8-token graphs would share one counter. So the watch counts replays
itself - the replay hook bumps ``WatchedGraph.replays``, nothing else - and this flusher turns the
counters into replay windows, written through ``inspector.storage.writer`` like the Recorder's (the same
rows and running totals), under each graph's own mode and identity, linked to the graph rows the
Recorder wrote for its captures. It also records torch.compile's skips and re-records.

An engine integration whose graphs are keyed by more than the descriptor's fields (transformers'
continuous batching: ``inspector.engines.transformers_cb``) counts the same way, and also knows each
batch's real tokens: its graphs count their replays by real tokens
(``replays_by_real_tokens``), which this flusher writes as real and padding tokens and as the
batch-size histogram. The watch cannot see padding: its graphs have none of that, and each replay
counts as the whole captured size.

Like the Recorder, it runs on its own thread, diffs monotonic counters against what it last
committed (a failed write loses nothing: the next window covers the gap), and never raises into
the engine.

It is also the watch's only clock for writes: captures and violations are handed to the Recorder
here, once per interval, not as they happen. torch.compile's cudagraph trees can capture a graph
per ``generate()`` (transformers' static cache re-records on every call), and a write woken per
capture - the graph row, its re-record event, its storm violation - is database work on a thread
that takes the GIL from a host-bound decode loop several times a second. Nothing the watch does at
a capture wakes a writer; an interval with nothing new writes nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy import Connection

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent
from capture_core.modes import CUDAGraphMode
from inspector.recording.batch import ReplayDelta, TrafficWindow, graph_key
from inspector.storage.store import Store, open_store
from inspector.storage.writer import KnownTotals, append_traffic, graph_ids, record_compile_event
from inspector.watch.watcher import CompileEvent

log = logging.getLogger(__name__)

FINAL_ATTEMPTS = 5


class CountedGraph(Protocol):
    """A graph whose replays the program's thread counts and this flusher writes."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    replays: int
    """Replays so far (read when ``replays_by_real_tokens`` is None)."""
    replays_by_real_tokens: dict[int, int] | None
    """Replays so far by the real tokens of their batch, where the engine tells them; None where
    it does not (each replay then counts as the whole captured size)."""


Counts = tuple[CountedGraph, int, "dict[int, int] | None"]
"""A graph, its replays and its replays by real tokens, as one flush read them."""


class WatchFlusher:
    """Writes watched graphs' replay windows and compile events for the Recorder's run."""

    def __init__(self, recorder: Any, graphs: Sequence[CountedGraph], *, interval: float = 1.0) -> None:
        self.recorder = recorder
        self.graphs = graphs
        self.interval = interval
        self.failures = 0
        self._compile_events: list[CompileEvent] = []
        self._records: deque[CaptureEvent | ViolationEvent] = deque()
        """Captures and violations for the Recorder, handed over at the next flush, in order."""
        self._lock = threading.Lock()
        self._committed: dict[int, int] = {}
        """id(graph) -> replays committed."""
        self._committed_sizes: dict[int, dict[int, int]] = {}
        """id(graph) -> its replays by real tokens committed (graphs that count them)."""
        self._totals: KnownTotals | None = None
        """The running totals the run has, read at the first write: a watch installed again on a
        Recorder you own writes into the run an earlier installation wrote into."""
        self._window_start = time.time()
        self._store: Store | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="graph-inspector-watch", daemon=True)
        self._thread.start()

    def add_record(self, event: CaptureEvent | ViolationEvent) -> None:
        """A capture or violation for the Recorder, at the next flush (a deque append: any thread)."""
        self._records.append(event)

    def add_compile_event(self, event: CompileEvent) -> None:
        with self._lock:
            self._compile_events.append(event)

    @property
    def pending_compile_events(self) -> int:
        return len(self._compile_events)

    @property
    def pending_records(self) -> int:
        return len(self._records)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._stop.is_set():
                self.flush_once()

    def close(self) -> None:
        """Stop the thread and write what is left, retrying a few times; report what could not be."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for attempt in range(FINAL_ATTEMPTS):
            if self.flush_once():
                break
            time.sleep(0.1 * 2**attempt)
        else:
            log.error(
                "graph-inspector watch: could not write the last replay window and %d compile events",
                len(self._compile_events),
            )
        if self._store is not None:
            self._store.dispose()

    def flush_once(self) -> bool:
        """Hand the Recorder its captures and violations; then one transaction: this window's
        replays per graph, the totals, pending compile events (none when nothing is new)."""
        handed = self._hand_over()
        run_id = self.recorder.run_id
        if run_id is None:
            return False  # the Recorder has not written its run yet (database unavailable)
        if handed:
            self.recorder.flush(timeout=5.0)  # the graph rows the windows link to come first
        now = time.time()
        counts = {id(graph): _read(graph) for graph in list(self.graphs)}
        with self._lock:
            events = list(self._compile_events)
        if not events and all(count <= self._committed.get(key, 0) for key, (_, count, _) in counts.items()):
            return True  # nothing new: no transaction
        try:
            if self._store is None:
                self._store = open_store(self.recorder.url, upgrade=False)
            with self._store.writer() as conn:
                known = self._totals if self._totals is not None else KnownTotals.of_run(conn, run_id)
                new_totals = self._write_replays(conn, run_id, counts, now, known)
                for event in events:
                    record_compile_event(conn, run_id, event)
        except Exception as error:  # kept for the next window; the engine goes on
            self.failures += 1
            if self.failures == 1:
                log.warning("graph-inspector watch: cannot write replays yet (%s); retrying", error)
            return False
        self.failures = 0
        self._committed.update({key: count for key, (_, count, _) in counts.items()})
        self._committed_sizes.update({key: sizes for key, (_, _, sizes) in counts.items() if sizes})
        known.update(new_totals)
        self._totals = known
        self._window_start = now
        with self._lock:
            del self._compile_events[: len(events)]
        return True

    def _hand_over(self) -> int:
        """Pass the queued captures and violations to the Recorder, which writes them in one go."""
        handed = 0
        while self._records:
            event = self._records.popleft()
            if isinstance(event, CaptureEvent):
                self.recorder.on_capture(event)
            else:
                self.recorder.on_violation(event)
            handed += 1
        return handed

    def _write_replays(
        self,
        conn: Connection,
        run_id: int,
        counts: dict[int, Counts],
        now: float,
        known: KnownTotals,
    ) -> KnownTotals:
        """This window's replays per graph key (graphs of one key add up), linked to their graph rows."""
        window = TrafficWindow(self._window_start, now)
        for key, (graph, count, sizes) in counts.items():
            replays = count - self._committed.get(key, 0)
            if replays <= 0:
                continue
            gkey = graph_key(graph.mode, graph.descriptor)
            delta = window.replays.get(gkey)
            if delta is None:
                delta = window.replays[gkey] = ReplayDelta(graph.mode, graph.descriptor)
            delta.replays += replays
            if sizes is None:  # the watch cannot see padding: a batch is the whole captured size
                delta.num_real_tokens += replays * graph.descriptor.captured_size
                continue
            committed = self._committed_sizes.get(key, {})
            for real, total in sizes.items():
                batches = total - committed.get(real, 0)
                if batches > 0:
                    delta.num_real_tokens += real * batches
                    window.batch_sizes[real] = window.batch_sizes.get(real, 0) + batches
        if not window.replays:
            return KnownTotals()
        ids = graph_ids(conn, run_id, window.replays)
        return append_traffic(conn, run_id, [window], ids, known, now)


def _read(graph: CountedGraph) -> Counts:
    """One graph's counters as they are now. A copy of the by-tokens dict is one C call (atomic
    under the GIL), and the replays are its sum, so the two always agree."""
    by_tokens = graph.replays_by_real_tokens
    if by_tokens is None:
        return graph, graph.replays, None
    sizes = dict(by_tokens)
    return graph, sum(sizes.values()), sizes
