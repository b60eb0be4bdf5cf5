"""``UBatchWrapper``: serve a model step as micro-batches, captured together into one graph.

The forward context carries the step's ubatch slices (padded, as ``maybe_create_ubatch_slices``
returns them). With slices and a FULL runtime mode, the first call of a descriptor captures all
ubatches - each on its own thread, taking turns through a ``UBatchContext`` ring, with their comm
on a second stream - into ONE graph keyed by that descriptor; later calls check the inputs and
replay it. Without FULL mode the ubatches run on threads without a graph. A FULL step without
slices gets a plain graph of the model - except for a descriptor held as a ubatch graph, which
runs eagerly rather than replay a graph of another split.

The graphs are served by the one graph-serving core (``CUDAGraphWrapper``), with this wrapper as
its graph source: capture, the capture lock, the checks, the events and the replay are the core's,
exactly as for plain graphs; this module only decides what one "call" of the captured callable is.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from capture_core.checks import ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError
from capture_core.events import CaptureEvent
from capture_core.forward_context import ForwardContext, get_forward_context, use_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason
from capture_core.ubatch.context import (
    DEFAULT_HANDOVER_TIMEOUT_S,
    UBatchContext,
    UBatchRing,
    make_ubatch_contexts,
)
from capture_core.ubatch.slices import UBatchSlice
from capture_core.ubatch.threads import UBatchThreads
from capture_core.wrapper import (
    CallableSource,
    CanaryPart,
    CUDAGraphWrapper,
    GraphCall,
    GraphEntry,
    MutatedInputs,
)

FULL = CUDAGraphMode.FULL
DEFAULT_TOKEN_INPUTS = ("input_ids", "positions", "slot_ids")


@dataclass
class UBatchGraphEntry(GraphEntry):
    """A captured micro-batched graph: a plain graph entry plus the slices it was captured with."""

    ubatch_slices: tuple[UBatchSlice, ...] = ()

    @property
    def num_ubatches(self) -> int:
        return len(self.ubatch_slices)

    def capture_event(self, wrapper: str, backend: str, warmup_iters: int) -> CaptureEvent:
        """The plain graph's capture event, with the micro-batches it was captured as."""
        return dataclasses.replace(
            super().capture_event(wrapper, backend, warmup_iters),
            num_ubatches=self.num_ubatches,
            ubatch_slices=tuple(s.as_tuple() for s in self.ubatch_slices),
        )


@dataclass(frozen=True)
class _UBatchCall:
    """One ubatch's share of a step: its slice, its arguments (token inputs sliced) and context."""

    ubatch_slice: UBatchSlice
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    forward_context: ForwardContext


class _UBatchedStep:
    """The whole micro-batched step as one zero-argument callable: what the backend captures.

    Every call runs the ubatches on fresh threads and concatenates their outputs. While the CUDA
    backend captures it (``prefetch``), the threads for the *next* call are started and parked at
    the barrier at the end of each call that is not itself being captured (and once before the
    backend starts), so the threads the capture uses have set up their CUDA state before capture
    begins, as they must.
    """

    def __init__(self, wrapper: UBatchWrapper, calls: Sequence[_UBatchCall], device: torch.device) -> None:
        self.wrapper = wrapper
        self.calls = list(calls)
        self.device = device
        self.on_gpu = device.type == "cuda"
        self._ready: UBatchThreads | None = None
        self.prefetch = False

    def _threads(self) -> UBatchThreads:
        wrapper = self.wrapper
        comm = wrapper.comm_stream(self.device) if self.on_gpu else None
        ring = UBatchRing(len(self.calls), comm_stream=comm, timeout=wrapper.handover_timeout)
        contexts = make_ubatch_contexts(ring, [use_forward_context(c.forward_context) for c in self.calls])
        # Grad and inference mode are thread-local: the ubatch threads inherit the caller's.
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        work = [functools.partial(_run_one, wrapper.runnable, c, grad, inference) for c in self.calls]
        setup = functools.partial(_cuda_thread_setup, self.device, comm) if self.on_gpu else None
        return UBatchThreads(contexts, work, thread_setup=setup, name=f"{wrapper.name}-ubatch")

    def prepare(self) -> None:
        """Start the next call's threads now and wait until they are parked (CUDA state ready)."""
        if self._ready is None:
            threads = self._threads()
            threads.start()
            self._ready = threads

    def discard(self) -> None:
        """Stop threads that were prepared but will not be used."""
        if self._ready is not None:
            threads, self._ready = self._ready, None
            threads.ring.abort("the prepared ubatch threads were not needed")
            for thread in threads.threads:
                thread.join(threads.ring.timeout)

    def __call__(self) -> torch.Tensor:
        threads, self._ready = self._ready, None
        if threads is None:
            threads = self._threads()
            threads.start()
        stream = torch.cuda.current_stream(self.device) if self.on_gpu else None
        outputs = threads.finish(stream)
        result = _concat(outputs, self.wrapper.name)
        if self.prefetch and not (self.on_gpu and torch.cuda.is_current_stream_capturing()):
            self.prepare()
        return result


def _run_one(runnable: Callable[..., Any], call: _UBatchCall, grad: bool, inference: bool) -> Any:
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return runnable(*call.args, **call.kwargs)


def _cuda_thread_setup(device: torch.device, comm: torch.cuda.Stream | None, context: UBatchContext) -> None:
    """Create this thread's CUDA state before any capture begins.

    The device, cuBLAS handles on both streams, and the ubatch's two events (torch creates an
    event on its first record): creating handles or events is no stream operation, and a thread
    must not make such calls while another thread's capture is under way.
    """
    torch.cuda.set_device(device)
    torch.cuda.current_blas_handle()
    for event in (context.gpu_compute_done, context.gpu_comm_done):
        if event is not None:
            event.record()
    if comm is not None:
        with torch.cuda.stream(comm):
            torch.cuda.current_blas_handle()


def _concat(outputs: Sequence[Any], wrapper: str) -> torch.Tensor:
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        kinds = sorted({type(o).__name__ for o in outputs})
        raise GraphCacheError(
            f"UBatchWrapper {wrapper!r} concatenates each ubatch's output along the token dimension, "
            f"so the model must return one tensor; it returned {', '.join(kinds)}"
        )
    return torch.cat(list(outputs), dim=0)


class UBatchWrapper:
    """Run ``runnable`` as micro-batches when the forward context carries ubatch slices.

    ``token_inputs`` names the arguments that hold one row per token (sliced per ubatch along
    dimension 0); every other argument (the KV cache, say) is passed whole to every ubatch. The
    model must return one tensor with a row per token. ``handover_timeout`` bounds how long a
    ubatch waits for its turn before the step fails with a clear error instead of hanging.
    ``per_step_inputs`` and ``mutated_inputs`` are the core's (see ``CUDAGraphWrapper``).

    Its graphs are served by one ``CUDAGraphWrapper`` (``core``), keyed by descriptor like every
    other graph, with this wrapper as the core's graph source: a FULL step with slices is captured
    as one graph of all its ubatches, a FULL step without slices as a plain graph of the model.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime: GraphRuntime,
        *,
        name: str | None = None,
        token_inputs: Sequence[str] = DEFAULT_TOKEN_INPUTS,
        handover_timeout: float = DEFAULT_HANDOVER_TIMEOUT_S,
        per_step_inputs: Sequence[str] = (),
        mutated_inputs: MutatedInputs = None,
        compared: CanaryPart | None = None,
    ) -> None:
        if handover_timeout <= 0:
            raise ValueError(f"handover_timeout must be positive, got {handover_timeout}")
        self.runnable = runnable
        self.runtime = runtime
        self.name = name or getattr(runnable, "__qualname__", None) or type(runnable).__name__
        self.token_inputs = frozenset(token_inputs)
        self.handover_timeout = handover_timeout
        self.parameter_names = ParameterNames.of(runnable)
        self._plain = CallableSource(runnable)
        self.core = CUDAGraphWrapper(
            runnable, runtime, FULL, name=self.name, source=self,
            per_step_inputs=per_step_inputs, mutated_inputs=mutated_inputs, compared=compared,
        )
        self._comm_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @property
    def graphs(self) -> Mapping[BatchDescriptor, GraphEntry]:
        """Descriptor -> graph: micro-batched ones (``UBatchGraphEntry``) and plain ones (read-only view)."""
        return self.core.graphs

    def comm_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream every ubatch's communication runs on (one per device, made on first use)."""
        with self._lock:
            stream = self._comm_streams.get(device)
            if stream is None:
                stream = self._comm_streams[device] = torch.cuda.Stream(device)
            return stream

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        if context is None:
            return self.runnable(*args, **kwargs)
        if context.mode is not FULL:
            return self.run_eagerly(GraphCall(context, args, kwargs))
        if not context.ubatch_slices:
            held = self.core.lookup(context.descriptor)
            if isinstance(held, UBatchGraphEntry):
                # Micro-batching was called off for this step (say, the DP ranks disagreed), but this
                # size is held as a ubatch graph: run eagerly rather than replay another split.
                self.runtime.observer.on_eager(EagerReason.UBATCH_GRAPH_ONLY, context.num_real_tokens, FULL)
                return self.runnable(*args, **kwargs)
        return self.core(*args, **kwargs)

    def run_eagerly(self, call: GraphCall) -> Any:
        """Without a graph: the ubatches on their threads when the step has slices, else the model."""
        if call.context.ubatch_slices:
            return self._step(*call)()
        return self._plain.run_eagerly(call)

    def capture(self, wrapper: CUDAGraphWrapper, call: GraphCall, unexpected: bool) -> tuple[GraphEntry, Any]:
        """The core's capture of one step: all its ubatches into one graph, or a plain graph."""
        if not call.context.ubatch_slices:
            return self._plain.capture(wrapper, call, unexpected)
        step = self._step(*call)
        step.prefetch = step.on_gpu and self.runtime.backend_name == "cuda"
        if step.prefetch:
            step.prepare()
        try:
            slices = tuple(ubatch.ubatch_slice for ubatch in step.calls)
            entry = wrapper.capture_entry(
                call, step, unexpected, captured_args=((), {}), entry_type=UBatchGraphEntry,
                ubatch_slices=slices,
            )
        finally:
            step.prefetch = False
            step.discard()
        return entry, entry.outputs

    def _step(self, context: ForwardContext, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _UBatchedStep:
        """Split the call's token inputs by the context's slices: one ``_UBatchCall`` per ubatch."""
        slices: Sequence[UBatchSlice] = context.ubatch_slices
        named = [(self.parameter_names.name_of(i), value) for i, value in enumerate(args)]
        token_values = [v for n, v in named if n in self.token_inputs]
        token_values += [v for n, v in kwargs.items() if n in self.token_inputs]
        if not token_values:
            raise GraphCacheError(
                f"UBatchWrapper {self.name!r} found none of its token inputs {sorted(self.token_inputs)} "
                "among the call's arguments, so it cannot split the step into ubatches"
            )
        num_tokens = int(token_values[0].shape[0])
        _check_slices(slices, num_tokens, self.name)
        calls = []
        for index, ubatch in enumerate(slices):
            part = ubatch.token_slice
            sub_args = tuple(v[part] if n in self.token_inputs else v for n, v in named)
            sub_kwargs = {n: (v[part] if n in self.token_inputs else v) for n, v in kwargs.items()}
            real = _real_tokens(ubatch, context.num_real_tokens)
            descriptor = BatchDescriptor(ubatch.num_tokens, None, context.descriptor.uniform)
            # Ubatch threads run the model plainly (mode NONE): the graph, if any, is this one.
            forward = ForwardContext(CUDAGraphMode.NONE, descriptor, real, None, _attn_part(context, index))
            calls.append(_UBatchCall(ubatch, sub_args, sub_kwargs, forward))
        return _UBatchedStep(self, calls, token_values[0].device)

    def __repr__(self) -> str:
        held = self.core.graphs.values()
        ubatched = sorted(e.descriptor.num_tokens for e in held if isinstance(e, UBatchGraphEntry))
        return (
            f"UBatchWrapper({self.name!r}, backend={self.runtime.backend_name}, "
            f"ubatch_graphs={ubatched}, plain_graphs={len(held) - len(ubatched)})"
        )


def _check_slices(slices: Sequence[UBatchSlice], num_tokens: int, wrapper: str) -> None:
    """The slices must tile the call's tokens exactly, in order: otherwise rows would be lost."""
    position = 0
    for index, ubatch in enumerate(slices):
        if not isinstance(ubatch, UBatchSlice):
            raise GraphCacheError(f"ubatch_slices[{index}] is {type(ubatch).__name__}, not a UBatchSlice")
        if ubatch.token_slice.start != position or ubatch.num_tokens == 0:
            break
        position = ubatch.token_slice.stop
    else:
        if position == num_tokens:
            return
    spans = [(s.token_slice.start, s.token_slice.stop) for s in slices]
    raise GraphCacheError(
        f"UBatchWrapper {wrapper!r}: the forward context's ubatch slices {spans} do not tile the "
        f"call's {num_tokens} tokens; pass the padded slices of maybe_create_ubatch_slices for this "
        "padded token count"
    )


def _real_tokens(ubatch: UBatchSlice, num_real_tokens: int) -> int:
    """How many of a ubatch's tokens are real, given the step's real token count."""
    start, stop = ubatch.token_slice.start, ubatch.token_slice.stop
    return max(0, min(stop, num_real_tokens) - start)


def _attn_part(context: ForwardContext, index: int) -> Any:
    """A ubatch's attention metadata when the step carries one per ubatch, else none."""
    metadata = context.attn_metadata
    if isinstance(metadata, (list, tuple)) and len(metadata) == len(context.ubatch_slices):
        return metadata[index]
    return None
