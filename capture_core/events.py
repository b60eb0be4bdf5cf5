"""What the graph cache tells its observers, and the observer protocol itself.

capture_core knows nothing of databases or pages: it emits these events to one observer. The
replay path calls ``on_replay`` with values it already holds, so an observer that bumps a counter is
all it pays for. Captures, fallbacks and violations are rare and carry full records.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason


class ViolationKind(str, enum.Enum):
    ADDRESS_DRIFT = "address_drift"
    """A tensor the graph reads (an input at any depth, or a parameter or buffer of the wrapped
    module) lives somewhere other than at capture: the graph reads the old memory."""
    LAYOUT_MISMATCH = "layout_mismatch"
    """Same address, other shape, strides, storage offset, dtype or device: the graph's kernels read
    the memory as the captured layout."""
    STALE_INPUT = "stale_input"
    """A declared per-step input was not written since the previous replay."""
    UNEXPECTED_CAPTURE = "unexpected_capture"
    """A capture after start-up locked capture, on any path."""
    REPLAY_MISMATCH = "replay_mismatch"
    """A sampled replay and the same step run eagerly disagree beyond tolerance (a host value baked
    into the graph at capture, say)."""
    RERECORD_STORM = "rerecord_storm"
    """One call site capturing again and again once its graphs are in use (graph-inspector watch)."""
    COMPILE_SKIP = "compile_skip"
    """torch.compile gave up on CUDA graphs for a function, with its reason (graph-inspector watch)."""
    RANK_DIVERGENCE = "rank_divergence"
    """Ranks of one job captured, or replayed at one step, different graphs (inspector.ranks.check)."""


@dataclass(frozen=True)
class CaptureEvent:
    """One graph captured: its key, what it baked in, what it cost."""

    descriptor: BatchDescriptor
    mode: CUDAGraphMode
    backend: str
    wrapper: str
    input_names: tuple[str, ...]
    input_addresses: tuple[int, ...]
    capture_seconds: float
    pool_bytes: int
    warmup_iters: int
    num_segments: int = 1
    num_ubatches: int = 1
    ubatch_slices: tuple[tuple[int, int, int, int], ...] = ()
    """Per ubatch: (request start, request stop, token start, token stop)."""
    unexpected: bool = False
    captured_at: float = field(default_factory=time.time)
    unchecked_inputs: tuple[str, ...] = ()
    """Inputs or checks that could not be applied to this graph, each with the reason (a set among
    the arguments, an inference tensor without a version counter, ...): named, not skipped silently."""
    engine_key: str = ""
    """The key of the engine that captured the graph, in the engine's own words, where one did
    (vLLM's ``BatchDescriptor(...)`` or its V2 runner's ``BatchExecutionDescriptor(...)``)."""
    discarded: bool = False
    """Captured only to be thrown away by the engine, never to serve a step (vLLM captures graphs of
    its largest sizes while it profiles memory, then clears them): shown apart from serving graphs."""


@dataclass(frozen=True)
class ViolationEvent:
    """Something that makes the cache silently wrong or slow, as it was seen."""

    kind: ViolationKind
    descriptor: BatchDescriptor
    mode: CUDAGraphMode
    wrapper: str
    message: str
    input_name: str | None = None
    expected_address: int | None = None
    actual_address: int | None = None
    stack: str = ""
    max_abs_error: float | None = None
    """For a replay mismatch: the largest absolute difference between replay and eager."""
    max_rel_error: float | None = None
    """For a replay mismatch: the largest difference relative to the eager value."""
    injected: bool = False
    """True when a demo or test planted the fault on purpose; shown as such everywhere."""
    seen_at: float = field(default_factory=time.time)


@runtime_checkable
class GraphObserver(Protocol):
    """Receives the graph cache's events. Must never raise into the engine."""

    def on_capture(self, event: CaptureEvent) -> None: ...

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        """Hot path: one call per replayed batch. Bump a counter, nothing more."""

    def on_eager(self, reason: EagerReason, num_real_tokens: int, mode: CUDAGraphMode) -> None:
        """A batch of ``num_real_tokens`` ran eagerly; ``mode`` is what it would have replayed in."""

    def on_violation(self, event: ViolationEvent) -> None: ...


class NullObserver:
    """The default observer: does nothing, costs one method call."""

    def on_capture(self, event: CaptureEvent) -> None:
        pass

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        pass

    def on_eager(self, reason: EagerReason, num_real_tokens: int, mode: CUDAGraphMode) -> None:
        pass

    def on_violation(self, event: ViolationEvent) -> None:
        pass


class FanOutObserver:
    """Sends every event to several observers, in order."""

    def __init__(self, *observers: GraphObserver) -> None:
        self.observers = observers

    def on_capture(self, event: CaptureEvent) -> None:
        for observer in self.observers:
            observer.on_capture(event)

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        for observer in self.observers:
            observer.on_replay(mode, descriptor, num_real_tokens)

    def on_eager(self, reason: EagerReason, num_real_tokens: int, mode: CUDAGraphMode) -> None:
        for observer in self.observers:
            observer.on_eager(reason, num_real_tokens, mode)

    def on_violation(self, event: ViolationEvent) -> None:
        for observer in self.observers:
            observer.on_violation(event)
