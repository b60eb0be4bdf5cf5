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
from capture_core.errors import (
    AddressDriftError,
    BakedValueChangedError,
    GraphCacheError,
    LayoutMismatchError,
    ReplayMismatchError,
    StaleInputError,
    StaleOutputError,
    UnexpectedCaptureError,
)
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason


@dataclass(frozen=True)
class KindRecord:
    """Everything said about one kind of violation, in one place: the messages and DEBUG mode's
    error (``capture_core.checks``, ``runtime``), the dashboard's pages, the metric's help, the
    report, the alert and the API's contract all read it."""

    label: str
    """The kind in words, as a sentence uses it: ``address drift``."""
    meaning: str
    """What was found, and what it does to the graph."""
    fix: str
    """What to do about it."""
    error: type[GraphCacheError] | None = None
    """What is raised for it (DEBUG mode's checks, the RAISE policy); None: recorded, never raised."""


class ViolationKind(str, enum.Enum):
    """What the validation catches: each member is one kind and its ``record``. A new kind is one
    member here (and the check that reports it)."""

    record: KindRecord

    def __new__(cls, value: str, record: KindRecord) -> ViolationKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.record = record
        return member

    ADDRESS_DRIFT = "address_drift", KindRecord(
        label="address drift",
        meaning=(
            "A tensor the graph reads (an input at any depth, or a parameter or buffer of the wrapped "
            "module) lives somewhere other than at capture, so the graph reads stale memory."
        ),
        fix=(
            "The graph reads the captured memory, so it would compute on stale values: copy new values "
            "into the captured tensor with copy_() instead of passing (or assigning) a new tensor"
        ),
        error=AddressDriftError,
    )
    LAYOUT_MISMATCH = "layout_mismatch", KindRecord(
        label="layout mismatch",
        meaning=(
            "The same address read with another shape, strides, storage offset, dtype or device: the "
            "graph's kernels read the memory as the captured layout."
        ),
        fix=(
            "The graph's kernels read that memory as the captured shape, strides and dtype: pass a "
            "tensor laid out as at capture (the captured tensor itself)"
        ),
        error=LayoutMismatchError,
    )
    STALE_INPUT = "stale_input", KindRecord(
        label="stale input",
        meaning=(
            "A declared per-step input nobody wrote since the previous replay, whatever the writer (a "
            "copy_, a kernel, a numpy view), or padding rows that still hold an earlier step's real "
            "tokens (they would write that request's KV slot again)."
        ),
        fix=(
            "The graph would compute on the previous step's values: copy_() this step's values into it "
            "before every replay, and pad the rows past the real tokens"
        ),
        error=StaleInputError,
    )
    BAKED_VALUE_CHANGED = "baked_value_changed", KindRecord(
        label="baked value changed",
        meaning=(
            "A host value the graph baked in at capture differs now: a non-tensor argument (a "
            "temperature, a flag that picked a branch) or an attribute of the wrapped module (a LoRA "
            "scaling, training); the graph replays the captured one."
        ),
        fix=(
            "The graph replays the value it was captured with: pass the value as a tensor input (copy_ "
            "each step's value into it), key the graph by it, or, where the graph does not read it, "
            "declare it with unread=(...)"
        ),
        error=BakedValueChangedError,
    )
    STALE_OUTPUT = "stale_output", KindRecord(
        label="stale output",
        meaning=(
            "A graph output was read after a later replay of the same graph wrote that memory again "
            "(debug mode): it held the later step's values."
        ),
        fix=(
            "A graph writes its outputs into the same memory at every replay: clone (or read) an output "
            "you keep before the same graph replays again"
        ),
        error=StaleOutputError,
    )
    UNEXPECTED_CAPTURE = "unexpected_capture", KindRecord(
        label="unexpected capture",
        meaning=(
            "A capture after start-up locked capture, on any path: a latency spike, or an error by "
            "policy."
        ),
        fix="Add this size to the capture sizes so it is captured at start-up",
        error=UnexpectedCaptureError,
    )
    REPLAY_MISMATCH = "replay_mismatch", KindRecord(
        label="replay mismatch",
        meaning=(
            "A sampled replay computed something other than the same step run eagerly, beyond "
            "tolerance (a host value baked in at capture, say)."
        ),
        fix=(
            "The graph computes something other than the eager step: a host value (a Python scalar, an "
            ".item(), a branch taken on the host) was baked in at capture; pass it as a tensor input, "
            "or key the graph by it"
        ),
        error=ReplayMismatchError,
    )
    RERECORD_STORM = "rerecord_storm", KindRecord(
        label="re-record storm",
        meaning=(
            "One call site capturing again and again once its graphs are in use (graph-inspector "
            "watch): a capture on the serving path each time, and new pool memory."
        ),
        fix=(
            "Give the call site the inputs it captured: the same shapes (pad to captured sizes) at "
            "the same addresses (static buffers refilled with copy_())"
        ),
    )
    COMPILE_SKIP = "compile_skip", KindRecord(
        label="compile skip",
        meaning=(
            "torch.compile gave up on CUDA graphs for a function, with its reason (graph-inspector "
            "watch): that function runs without them."
        ),
        fix="Remove the reason torch.compile gives (the message quotes it), or accept the function eager",
    )
    RANK_DIVERGENCE = "rank_divergence", KindRecord(
        label="rank divergence",
        meaning=(
            "Ranks of one job captured, or replayed at the same step, different graphs: the next "
            "collective would hang or mix shapes."
        ),
        fix=(
            "Give every rank the same capture sizes and the same graph at every step (agree on the "
            "batch across ranks, coordinate_batch_across_dp)"
        ),
    )


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


@dataclass(frozen=True)
class DivergenceEvent:
    """Where a graph and the same step run eagerly part: the first module whose output differs
    (``capture_core.locate``), found after a ``replay_mismatch`` or on demand."""

    descriptor: BatchDescriptor
    mode: CUDAGraphMode
    wrapper: str
    module: str | None
    """The first module whose output differs; None when the probe located none (``message`` says why)."""
    max_abs_error: float | None
    max_rel_error: float | None
    agreeing: tuple[str, ...]
    """The modules that finished before it and agree (the outermost of them)."""
    modules_compared: int
    reproduced: bool
    """The probe of the captured call differs from the eager step, as the graph's replay did."""
    probe: str
    """How the step was computed as the graph computes it (a probe graph, or the call re-run)."""
    message: str
    injected: bool = False
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

    def on_step_time(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        graph_seconds: float | None,
        eager_seconds: float | None,
        samples: int = 1,
        clock: str = "cuda_events",
    ) -> None:
        """Optional (the runtime calls it on observers that have it). The mean time of ``samples``
        replays of the graph keyed ``(mode, descriptor)`` (``graph_seconds``) and/or of ``samples``
        steps of the same size run without a graph (``eager_seconds``; an eager fallback is keyed
        by mode ``NONE`` and the descriptor of its real tokens); None where that kind was not timed.
        ``clock`` says how: ``cuda_events`` (the stream's span, or the host's launch time where that
        is longer) or ``host_clock`` (the eager backend, whose "replays" re-run the model). Called
        for sampled steps only, never on the common replay path (``capture_core.step_time``)."""

    def on_divergence(self, event: DivergenceEvent) -> None:
        """Optional (called on observers that have it): where a graph and its eager step part."""


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

    def on_step_time(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        graph_seconds: float | None,
        eager_seconds: float | None,
        samples: int = 1,
        clock: str = "cuda_events",
    ) -> None:
        pass

    def on_divergence(self, event: DivergenceEvent) -> None:
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

    def on_step_time(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        graph_seconds: float | None,
        eager_seconds: float | None,
        samples: int = 1,
        clock: str = "cuda_events",
    ) -> None:
        """To the observers that take step times (the call is optional)."""
        for observer in self.observers:
            on_step_time = getattr(observer, "on_step_time", None)
            if on_step_time is not None:
                on_step_time(mode, descriptor, graph_seconds, eager_seconds, samples, clock)

    def on_divergence(self, event: DivergenceEvent) -> None:
        """To the observers that take divergences (the call is optional)."""
        for observer in self.observers:
            on_divergence = getattr(observer, "on_divergence", None)
            if on_divergence is not None:
                on_divergence(event)
