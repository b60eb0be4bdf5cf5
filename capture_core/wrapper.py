"""``CUDAGraphWrapper``: wraps a callable and serves it from captured graphs, one per descriptor.

The wrapper reads the forward context. Outside one, or when the context's runtime mode is not the
wrapper's, it just calls the callable (a FULL wrapper stays out of the way of a PIECEWISE batch).
Otherwise the descriptor picks the graph: the first call captures it (inside the capture phase:
warm-ups, capture, a ``CaptureEvent`` with every tensor input's name and address); later calls
check the input addresses, tell the observer, and replay. The replay path is kept to a dictionary
lookup, the address loop and one observer call: it is benchmarked against a bare ``replay()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture_core.backends import CapturedGraph
from capture_core.checks import AddressCheckMode, InputLayout, ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent
from capture_core.forward_context import ForwardContext, get_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import CaptureDecision, GraphRuntime

_OFF = AddressCheckMode.OFF


@dataclass
class GraphEntry:
    """One captured graph, as the wrapper holds it (and as inspection tools read it)."""

    descriptor: BatchDescriptor
    mode: CUDAGraphMode
    graph: CapturedGraph
    layout: InputLayout
    capture_seconds: float
    pool_bytes: int
    unexpected: bool
    captured_at: float = field(default_factory=time.time)

    @property
    def outputs(self) -> Any:
        return self.graph.outputs

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def input_addresses(self) -> tuple[int, ...]:
        return self.layout.addresses

    @property
    def addresses(self) -> dict[str, int]:
        """Input name -> captured address."""
        return dict(zip(self.layout.names, self.layout.addresses, strict=True))

    def capture_event(self, wrapper: str, backend: str, warmup_iters: int) -> CaptureEvent:
        """What the observer is told of this graph's capture."""
        return CaptureEvent(
            descriptor=self.descriptor,
            mode=self.mode,
            backend=backend,
            wrapper=wrapper,
            input_names=self.layout.names,
            input_addresses=self.layout.addresses,
            capture_seconds=self.capture_seconds,
            pool_bytes=self.pool_bytes,
            warmup_iters=warmup_iters,
            unexpected=self.unexpected,
            captured_at=self.captured_at,
        )


class CUDAGraphWrapper:
    """Serve ``runnable`` from CUDA graphs (or the eager stand-in) keyed by ``BatchDescriptor``."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime: GraphRuntime,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        name: str | None = None,
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a graph wrapper serves FULL or PIECEWISE batches, not {runtime_mode.name}")
        self.runnable = runnable
        self.runtime = runtime
        self.runtime_mode = runtime_mode
        self.name = name or getattr(runnable, "__qualname__", None) or type(runnable).__name__
        self.parameter_names = ParameterNames.of(runnable)
        self._graphs: dict[BatchDescriptor, GraphEntry] = {}
        # id(captured descriptor object) -> entry. Hashing a frozen dataclass costs more than the
        # whole address check, so callers that pass the very descriptor object that was captured
        # (as the runner does) skip it. Only captured keys go in, and each entry holds its key,
        # so an id here can never be reused by another object.
        self._by_identity: dict[int, GraphEntry] = {}

    @property
    def graphs(self) -> Mapping[BatchDescriptor, GraphEntry]:
        """What this wrapper holds: descriptor -> captured graph entry (a copy, for inspection)."""
        return dict(self._graphs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        if context is None or context.mode is not self.runtime_mode:
            return self.runnable(*args, **kwargs)
        descriptor = context.descriptor
        entry = self._by_identity.get(id(descriptor))
        if entry is None or entry.descriptor is not descriptor:
            entry = self._graphs.get(descriptor)
            if entry is None:
                return self._capture_or_fallback(context, args, kwargs)
        runtime = self.runtime
        if runtime.address_check is not _OFF:
            drifts = entry.layout.find_drift(args, kwargs)
            if drifts:
                runtime.report_drift(self.name, context.mode, context.descriptor, drifts)
        runtime.observer.on_replay(context.mode, descriptor, context.num_real_tokens)
        entry.graph.replay()
        return entry.graph.outputs

    def _capture_or_fallback(
        self, context: ForwardContext, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        runtime = self.runtime
        with runtime.capture_lock:
            entry = self._graphs.get(context.descriptor)
            if entry is not None:  # another thread captured it while this one waited
                return self(*args, **kwargs)
            decision = runtime.admit_capture(
                self.name, context.mode, context.descriptor, context.num_real_tokens
            )
            if decision is CaptureDecision.EAGER:
                return self.runnable(*args, **kwargs)
            entry = self.capture(
                context.mode, context.descriptor, args, kwargs,
                unexpected=decision is CaptureDecision.CAPTURE_UNEXPECTED,
            )
            return entry.outputs

    def capture(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        unexpected: bool = False,
    ) -> GraphEntry:
        """Warm up, capture and record one graph for ``descriptor`` (no guard: callers check)."""
        runtime = self.runtime
        layout = InputLayout.record(self.parameter_names, args, kwargs)
        graph = runtime.backend.capture(self.runnable, args, kwargs, runtime.warmup_iters)
        entry = GraphEntry(
            descriptor, mode, graph, layout, graph.capture_seconds, graph.pool_bytes, unexpected
        )
        self._graphs[descriptor] = entry
        self._by_identity[id(descriptor)] = entry
        runtime.report_capture(entry.capture_event(self.name, runtime.backend_name, runtime.warmup_iters))
        return entry

    def __repr__(self) -> str:
        return (
            f"CUDAGraphWrapper({self.name!r}, mode={self.runtime_mode.name}, "
            f"backend={self.runtime.backend_name}, graphs={len(self._graphs)})"
        )
