"""Fixtures for the graph-cache tests: an observer that keeps every event, and runtimes on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason


@dataclass
class RecordingObserver:
    """Keeps every event it is sent, in order, so tests can assert on exactly what was emitted."""

    captures: list[CaptureEvent] = field(default_factory=list)
    replays: list[tuple[CUDAGraphMode, BatchDescriptor, int]] = field(default_factory=list)
    eagers: list[tuple[EagerReason, int, CUDAGraphMode]] = field(default_factory=list)
    violations: list[ViolationEvent] = field(default_factory=list)
    step_times: list[tuple[CUDAGraphMode, BatchDescriptor, float | None, float | None, int, str]] = field(
        default_factory=list)

    def on_capture(self, event: CaptureEvent) -> None:
        self.captures.append(event)

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        self.replays.append((mode, descriptor, num_real_tokens))

    def on_eager(self, reason: EagerReason, num_tokens: int, mode: CUDAGraphMode) -> None:
        self.eagers.append((reason, num_tokens, mode))

    def on_violation(self, event: ViolationEvent) -> None:
        self.violations.append(event)

    def on_step_time(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, graph_seconds: float | None,
                     eager_seconds: float | None, samples: int = 1, clock: str = "cuda_events") -> None:
        self.step_times.append((mode, descriptor, graph_seconds, eager_seconds, samples, clock))


@pytest.fixture
def observer() -> RecordingObserver:
    return RecordingObserver()


@pytest.fixture(autouse=True)
def _no_debug_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI plugin may set GRAPH_INSPECTOR_DEBUG for the whole run; these tests choose their mode."""
    monkeypatch.delenv("GRAPH_INSPECTOR_DEBUG", raising=False)


@pytest.fixture
def runtime(observer: RecordingObserver) -> GraphRuntime:
    return GraphRuntime("eager", observer=observer, progress=False)


@pytest.fixture
def single_thread_torch() -> Iterator[None]:
    """One intra-op thread for small-model tests: on a small shared CPU, threads spin against each
    other (a tiny decoder step measured 15x slower with two threads on a loaded 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
