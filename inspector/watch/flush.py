"""The watch's own writer, for what the Recorder cannot key: per-graph replays and compile events.

The Recorder counts replays by the descriptor's fields (fast, and right for capture_core, where a
descriptor is a graph). Watched graphs are told apart by call site and shapes, which are not
descriptor fields: two engines' 8-token graphs would share one counter. So the watch counts replays
itself - the replay hook bumps ``WatchedGraph.replays``, nothing else - and this writer turns the
counters into the same ``replay_windows`` and ``replay_totals`` rows the Recorder writes, keyed by
each graph's identity and linked to the graph rows the Recorder wrote for its captures. It also
writes torch.compile's skips and re-records into ``compile_events``.

Like the Recorder, it runs on its own thread, diffs monotonic counters against what it last
committed (a failed write loses nothing: the next window covers the gap), and never raises into
the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, insert, select, update

from inspector.models import CompileRecord, Graph, ReplayTotal, ReplayWindow
from inspector.store import Store, open_store
from inspector.watch.watcher import CompileEvent, WatchedGraph

log = logging.getLogger(__name__)

FINAL_ATTEMPTS = 5


class WatchFlusher:
    """Writes watched graphs' replay windows and compile events for the Recorder's run."""

    def __init__(self, recorder: Any, graphs: Sequence[WatchedGraph], *, interval: float = 1.0) -> None:
        self.recorder = recorder
        self.graphs = graphs
        self.interval = interval
        self.failures = 0
        self._compile_events: list[CompileEvent] = []
        self._lock = threading.Lock()
        self._committed: dict[int, int] = {}
        """id(WatchedGraph) -> replays committed."""
        self._totals: set[str] = set()
        """Identity keys that have a replay_totals row in this run."""
        self._window_start = time.time()
        self._store: Store | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="graph-inspector-watch", daemon=True)
        self._thread.start()

    def add_compile_event(self, event: CompileEvent) -> None:
        with self._lock:
            self._compile_events.append(event)
        self._wake.set()

    @property
    def pending_compile_events(self) -> int:
        return len(self._compile_events)

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
        """One transaction: this window's replays per graph, the totals, pending compile events."""
        run_id = self.recorder.run_id
        if run_id is None:
            return False  # the Recorder has not written its run yet (database unavailable)
        self.recorder.flush(timeout=5.0)  # the graph rows the windows link to come first
        now = time.time()
        counts = {id(graph): (graph, graph.replays) for graph in list(self.graphs)}
        with self._lock:
            events = list(self._compile_events)
        try:
            if self._store is None:
                self._store = open_store(self.recorder.url, upgrade=False)
            with self._store.writer() as conn:
                new_totals = self._write_replays(conn, run_id, counts, now)
                for event in events:
                    upsert_compile_event(conn, run_id, event)
        except Exception as error:  # kept for the next window; the engine goes on
            self.failures += 1
            if self.failures == 1:
                log.warning("graph-inspector watch: cannot write replays yet (%s); retrying", error)
            return False
        self.failures = 0
        self._committed.update({key: count for key, (_, count) in counts.items()})
        self._totals |= new_totals
        self._window_start = now
        with self._lock:
            del self._compile_events[: len(events)]
        return True

    def _write_replays(
        self, conn: Connection, run_id: int, counts: dict[int, tuple[WatchedGraph, int]], now: float
    ) -> set[str]:
        by_key: dict[str, tuple[WatchedGraph, int]] = {}
        for key, (graph, count) in counts.items():
            delta = count - self._committed.get(key, 0)
            if delta > 0:
                identity = graph.descriptor.key
                _, seen = by_key.get(identity, (graph, 0))
                by_key[identity] = (graph, seen + delta)
        if not by_key:
            return set()
        graph_ids = dict(
            conn.execute(
                select(Graph.descriptor_key, Graph.id)
                .where(Graph.run_id == run_id, Graph.mode == "full", Graph.descriptor_key.in_(list(by_key)))
                .order_by(Graph.id)
            ).all()
        )  # the latest capture of an identity wins
        windows, new_totals = [], set()
        for identity, (graph, replays) in by_key.items():
            tokens = replays * graph.descriptor.captured_size
            row = _descriptor_columns(graph) | {
                "run_id": run_id,
                "graph_id": graph_ids.get(identity),
                "replays": replays,
                "num_real_tokens": tokens,
                "padding_tokens": 0,
            }
            windows.append(row | {"window_start": self._window_start, "window_end": now})
            if identity in self._totals:
                conn.execute(
                    update(ReplayTotal)
                    .where(
                        ReplayTotal.run_id == run_id,
                        ReplayTotal.mode == "full",
                        ReplayTotal.descriptor_key == identity,
                    )
                    .values(
                        replays=ReplayTotal.replays + replays,
                        num_real_tokens=ReplayTotal.num_real_tokens + tokens,
                        graph_id=row["graph_id"],
                        updated_at=now,
                    )
                )
            else:
                conn.execute(insert(ReplayTotal).values(row | {"updated_at": now}))
                new_totals.add(identity)
        conn.execute(insert(ReplayWindow), windows)
        return new_totals


def _descriptor_columns(graph: WatchedGraph) -> dict[str, object]:
    descriptor = graph.descriptor
    return {
        "mode": "full",
        "captured_size": descriptor.captured_size,
        "num_reqs": descriptor.num_reqs,
        "uniform": descriptor.uniform,
        "has_lora": descriptor.has_lora,
        "num_active_loras": descriptor.num_active_loras,
        "descriptor_key": descriptor.key,
    }


def upsert_compile_event(conn: Connection, run_id: int, event: CompileEvent) -> None:
    """Repeats of one kind, function and reason in a run bump the count."""
    function = event.function[:200]
    known = conn.execute(
        select(CompileRecord.id).where(
            CompileRecord.run_id == run_id,
            CompileRecord.kind == event.kind.value,
            CompileRecord.function == function,
            CompileRecord.reason == event.reason,
        )
    ).scalar()
    if known is None:
        conn.execute(
            insert(CompileRecord).values(
                run_id=run_id,
                kind=event.kind.value,
                function=function,
                reason=event.reason,
                message=event.message,
                count=1,
                first_seen_at=event.seen_at,
                last_seen_at=event.seen_at,
            )
        )
    else:
        conn.execute(
            update(CompileRecord)
            .where(CompileRecord.id == known)
            .values(count=CompileRecord.count + 1, last_seen_at=event.seen_at)
        )
