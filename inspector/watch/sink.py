"""Where a watch's records go: the inspector's Recorder, plus the watch's own writer beside it.

Given a database URL, the watch starts a Recorder at the first record, not at install, so the many
Python processes a launcher starts (workers, helpers, the launcher itself) leave no empty runs
behind: only processes that capture a graph (or hear a torch.compile skip) appear. Given a Recorder,
it records into that one and leaves it running. Captures and violations go through the Recorder's
public methods, handed over by ``WatchFlusher`` once per interval (never woken by a capture);
replays and compile events are written by the flusher itself (see ``flush.py`` for why).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.watch.watcher import CompileEvent

if TYPE_CHECKING:
    from inspector.watch.flush import CountedGraph, WatchFlusher


def describe_device() -> str:
    """The current CUDA device as the run's ``device`` column shows it (``cpu`` without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return "cpu"


class RecorderSink:
    """A GraphObserver over an inspector Recorder that also writes per-graph replays.

    ``flush_interval``: how often the watch writes (seconds; default the Recorder's own, 1 s for
    the Recorder it starts). Every record waits for the next write, however many arrive meanwhile.

    ``counts_replays_itself`` tells the watcher not to call ``on_replay`` per replay: the hook's
    per-graph counter is all this sink needs, which keeps the replay path to one integer bump.
    """

    counts_replays_itself = True

    def __init__(
        self,
        url: str | None = None,
        *,
        recorder: Any = None,
        label: str = "watch",
        flush_interval: float | None = None,
    ) -> None:
        self.url = url
        self.label = label
        # The watch writes on the Recorder's clock: a Recorder you started sets the interval.
        default = recorder.flush_interval if recorder is not None else 1.0
        self.flush_interval = default if flush_interval is None else flush_interval
        self.recorder: Any = recorder
        self.owns_recorder = recorder is None
        self.flusher: WatchFlusher | None = None
        self._graphs: Sequence[CountedGraph] = ()
        self._lock = threading.Lock()
        self._closed = False

    def bind(self, graphs: Sequence[CountedGraph]) -> None:
        """The list of graphs (the watcher's, or an engine integration's) whose replay counters the
        flusher writes."""
        self._graphs = graphs

    def start(self) -> None:
        """Start recording now (the Recorder, the flusher) rather than at the first record: for an
        engine integration whose eager batches go to the Recorder directly."""
        self._started()

    def _started(self) -> WatchFlusher:
        # The database side (SQLAlchemy and the models) is imported here, at the first record, not
        # at install: a watched process that never captures a graph never loads it.
        from inspector.watch.flush import WatchFlusher

        with self._lock:
            if self.flusher is None:
                if self.recorder is None:
                    from inspector.recording.recorder import Recorder

                    self.recorder = Recorder(
                        self.url,
                        label=self.label,
                        flush_interval=self.flush_interval,
                        config={"source": "graph-inspector watch"},
                        device=describe_device(),
                    )
                self.recorder.start()
                self.flusher = WatchFlusher(self.recorder, self._graphs, interval=self.flush_interval)
                self.flusher.start()
                # Registered after the Recorder's own exit hook, so it runs first: the last replay
                # window links to graph rows while the Recorder can still flush them.
                atexit.register(self.close)
            return self.flusher

    # -- GraphObserver -------------------------------------------------------------------------

    def on_capture(self, event: CaptureEvent) -> None:
        self._started().add_record(event)

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        """Not called by the watch's hooks (see ``counts_replays_itself``); forwarded for others."""
        self._started()
        self.recorder.on_replay(mode, descriptor, num_real_tokens)

    def on_eager(self, reason: EagerReason, num_tokens: int, mode: CUDAGraphMode) -> None:
        self._started()
        self.recorder.on_eager(reason, num_tokens, mode)

    def on_violation(self, event: ViolationEvent) -> None:
        self._started().add_record(event)

    def on_compile_event(self, event: CompileEvent) -> None:
        self._started().add_compile_event(event)

    def close(self) -> None:
        """Write the last window and compile events; end the run when the Recorder is ours."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self.flusher is not None:
            self.flusher.close()
        if self.owns_recorder and self.recorder is not None:
            self.recorder.close()
