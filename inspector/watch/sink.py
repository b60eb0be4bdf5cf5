"""Where a watch sends its records when given a database URL: the inspector's Recorder.

The Recorder is started at the first record, not at install, so the many Python processes a
launcher starts (workers, tokenizer helpers, the launcher itself) leave no empty runs behind: only
processes that capture a graph (or hear a compile skip) appear. Compile events have no Recorder
method; they go to the ``compile_events`` table of the same database, linked to the Recorder's run,
written at once (they come from the compiler, never from the replay path) and kept for a retry
while the database is unavailable. Nothing here raises into the engine.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import select

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.models import CompileRecord
from inspector.store import Store, open_store
from inspector.watch.watcher import CompileEvent

log = logging.getLogger(__name__)


def describe_device() -> str:
    """The current CUDA device as the run's ``device`` column shows it (``cpu`` without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return "cpu"


class RecorderSink:
    """A GraphObserver that starts a Recorder at the first record and also keeps compile events."""

    def __init__(self, url: str | None, *, label: str = "watch", flush_interval: float = 1.0) -> None:
        self.url = url
        self.label = label
        self.flush_interval = flush_interval
        self.recorder: Any = None
        self.pending_compile_events: list[CompileEvent] = []
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _start(self) -> Any:
        with self._lock:
            if self.recorder is None:
                from inspector.recorder import Recorder

                recorder = Recorder(
                    self.url,
                    label=self.label,
                    flush_interval=self.flush_interval,
                    config={"source": "graph-inspector watch"},
                    device=describe_device(),
                )
                recorder.start()
                self.recorder = recorder
                # Later replays go straight to the Recorder's counter (graphs bind it at capture).
                self.on_replay = recorder.on_replay  # type: ignore[method-assign]
            return self.recorder

    # -- GraphObserver -------------------------------------------------------------------------

    def on_capture(self, event: CaptureEvent) -> None:
        self._start().on_capture(event)

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        self._start().on_replay(mode, descriptor, num_real_tokens)

    def on_eager(self, reason: EagerReason, num_tokens: int, mode: CUDAGraphMode) -> None:
        self._start().on_eager(reason, num_tokens, mode)

    def on_violation(self, event: ViolationEvent) -> None:
        self._start().on_violation(event)

    # -- compile events --------------------------------------------------------------------------

    def on_compile_event(self, event: CompileEvent) -> None:
        self._start()
        with self._lock:
            self.pending_compile_events.append(event)
            self._write_compile_events()

    def _write_compile_events(self) -> None:
        """Write what is pending in one transaction; on failure keep it for the next attempt."""
        run_id = self.recorder.run_id if self.recorder is not None else None
        if not self.pending_compile_events or run_id is None:
            return
        try:
            if self._store is None:
                self._store = open_store(self.recorder.url, upgrade=False)
            with self._store.session() as session:
                for event in self.pending_compile_events:
                    _upsert(session, run_id, event)
        except Exception as error:  # the engine goes on; the events wait for the next attempt
            log.warning("graph-inspector watch: compile events not written yet (%s)", error)
            return
        self.pending_compile_events.clear()

    def close(self) -> None:
        """Flush and end the run (when one was started); write the compile events still pending."""
        if self._closed:
            return
        self._closed = True
        if self.recorder is None:
            return
        self.recorder.flush(timeout=self.recorder.close_timeout)
        with self._lock:
            self._write_compile_events()
            if self.pending_compile_events:
                log.error(
                    "graph-inspector watch: %d compile events could not be written",
                    len(self.pending_compile_events),
                )
        self.recorder.close()
        if self._store is not None:
            self._store.dispose()


def _upsert(session: Any, run_id: int, event: CompileEvent) -> None:
    row = session.scalars(
        select(CompileRecord).where(
            CompileRecord.run_id == run_id,
            CompileRecord.kind == event.kind.value,
            CompileRecord.function == event.function[:200],
            CompileRecord.reason == event.reason,
        )
    ).first()
    if row is None:
        session.add(
            CompileRecord(
                run_id=run_id,
                kind=event.kind.value,
                function=event.function[:200],
                reason=event.reason,
                message=event.message,
                count=1,
                first_seen_at=event.seen_at,
                last_seen_at=event.seen_at,
            )
        )
    else:
        row.count += 1
        row.last_seen_at = max(row.last_seen_at, event.seen_at)
