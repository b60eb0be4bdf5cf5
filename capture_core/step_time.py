"""Step time: how long a graph's replay and the same step run eagerly take, measured off the hot path.

Only steps that already left the common replay path are timed: a sampled replay (the checks'
``Sampling`` picked it, so the guard sent it to the closer look), the canary's eager step, and a
sampled share of the eager fallbacks (the same schedule, per size). An unsampled replay runs
exactly what it ran before; with the checks off nothing is sampled, so nothing is timed.

How a step is timed depends on the backend, and the clock is named with every figure:

* ``cuda_events``: two CUDA events recorded on the current stream around what the step runs, and
  the host's clock beside them. Nothing waits for the GPU: the events are read once they have
  completed (``Event.query()``), at the next timed step, after the canary's comparison (which has
  synchronised already), or when ``collect(wait=True)`` is called at the end of a run. The step's
  time is the longer of the stream's span and the host's: an eager step that is launch-bound is slow
  on the host while the stream idles between kernels (then the span shows the gaps too), one that
  is GPU-bound is slow on the stream (its launches may have run ahead of the GPU).
* ``host_clock``: the eager backend's "replay" re-runs the model, so its time is the host's clock
  around what really ran, and a graph time from it is the time of running the model, not of a graph.

Each figure goes to the observer's ``on_step_time(mode, descriptor, graph_seconds, eager_seconds,
samples, clock)`` (see ``capture_core.events``), for observers that have it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode

CUDA_EVENTS = "cuda_events"
HOST_CLOCK = "host_clock"
CLOCKS = (CUDA_EVENTS, HOST_CLOCK)

MAX_PENDING = 256
"""Timed steps whose events may wait to be read; past this a sampled step goes untimed until some are
read (a sample skipped, never a wait)."""


class StepPath(enum.Enum):
    """What a timed step ran: the graph's replay, or the same step without a graph."""

    GRAPH = "graph"
    EAGER = "eager"


StepTimeReport = Callable[[StepPath, CUDAGraphMode, BatchDescriptor, float, str], None]
"""``report(path, mode, descriptor, seconds, clock)``: one timed step, once its time is known."""


@dataclass
class _Pending:
    """A step timed with CUDA events that has not been read yet."""

    path: StepPath
    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    start: torch.cuda.Event
    end: torch.cuda.Event
    host_seconds: float


class StepTimer:
    """Times the steps it is handed and reports each once its time is known (one per runtime).

    ``device_events``: time with CUDA events on the current stream (the CUDA backend), else with the
    host's clock. ``sampling`` is the schedule of the eager fallbacks timed, per size (the replays
    and canary steps are timed when the checks sample them).
    """

    def __init__(self, report: StepTimeReport, sampling: Sampling, *, device_events: bool) -> None:
        self._report = report
        self.sampling = sampling
        self.clock = CUDA_EVENTS if device_events else HOST_CLOCK
        self._device_events = device_events
        self._pending: list[_Pending] = []
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._eager_seen: dict[tuple[CUDAGraphMode, BatchDescriptor], int] = {}

    @property
    def pending(self) -> int:
        """Timed steps whose CUDA events have not been read yet."""
        return len(self._pending)

    def time(
        self,
        path: StepPath,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        run: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """``run(*args)``, timed as a step of ``path`` for the graph keyed ``(mode, descriptor)``."""
        if not self._device_events:
            started = time.perf_counter()
            result = run(*args)
            self._report(path, mode, descriptor, time.perf_counter() - started, HOST_CLOCK)
            return result
        self.collect()
        if len(self._pending) >= MAX_PENDING:
            return run(*args)
        start, end = self._spare.pop() if self._spare else (
            torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        started = time.perf_counter()
        start.record()
        result = run(*args)
        end.record()
        self._pending.append(_Pending(path, mode, descriptor, start, end, time.perf_counter() - started))
        return result

    def eager(
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor, run: Callable[..., Any], *args: Any
    ) -> Any:
        """An eager fallback: ``run(*args)``, timed when the schedule samples this size's next one."""
        key = (mode, descriptor)
        seen = self._eager_seen.get(key, 0)
        self._eager_seen[key] = seen + 1
        if self.sampling.gap(seen) != 1:
            return run(*args)
        return self.time(StepPath.EAGER, mode, descriptor, run, *args)

    def collect(self, wait: bool = False) -> int:
        """Report the timed steps whose events have completed (with ``wait``, all of them, waiting
        for the GPU); how many were reported."""
        if not self._pending:
            return 0
        done, still = [], []
        for pending in self._pending:
            if wait:
                pending.end.synchronize()
            (done if wait or pending.end.query() else still).append(pending)
        self._pending = still
        for pending in done:
            span = pending.start.elapsed_time(pending.end) / 1000.0
            seconds = max(span, pending.host_seconds)
            self._spare.append((pending.start, pending.end))
            self._report(pending.path, pending.mode, pending.descriptor, seconds, CUDA_EVENTS)
        return len(done)
