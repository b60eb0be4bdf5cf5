"""Graph backends: what "capture" and "replay" mean on this host.

``CudaGraphBackend`` records a real ``torch.cuda.CUDAGraph`` into one shared memory pool.
``EagerBackend`` stands in on hosts without CUDA: it keeps every piece of bookkeeping, validation
and every event identical, but its "graph" re-runs the callable. It re-runs it on the *captured*
inputs - as a CUDA graph reads the captured memory - so a drifted input gives stale results on a
CPU too, and the tests of the address checks mean something without a GPU. It is named "eager"
wherever it reports, so nobody mistakes its timings for graph timings.
"""

from __future__ import annotations

import abc
import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Protocol
from unittest import mock

import torch

from capture_core.errors import GraphCacheError

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "cuda", "eager")


class CapturedGraph(Protocol):
    """One captured graph: its static outputs and what capturing it cost."""

    outputs: Any
    capture_seconds: float
    """Wall time of the warm-up runs plus the capture: the stall a capture costs a step."""
    pool_bytes: int
    """Growth of the graph pool's reserved bytes during this capture (0 for the eager backend)."""

    def replay(self) -> None:
        """Run the graph again on the captured input memory, refreshing ``outputs`` in place."""


class GraphBackend(abc.ABC):
    """Captures callables into graphs. One backend object per ``GraphRuntime``.

    A capture is the same on every backend: warm up, then record one call under a frozen garbage
    collector, timed from the first warm-up. A backend says how it warms up (``warming_up``) and
    what recording makes (``record``).
    """

    name: ClassVar[str]

    def capture(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        warmup_iters: int,
        prologue: Callable[[], None] | None = None,
    ) -> CapturedGraph:
        """Warm up ``fn`` ``warmup_iters`` times, then capture one call; ``outputs`` hold its results.

        ``prologue`` is the checks' own work, captured with every call (the per-step inputs copied
        into their shadows): it reads the inputs, writes only its own tensors, and returns nothing."""
        self.check(fn, args, kwargs)
        if prologue is not None:
            fn = self.with_prologue(fn, prologue)
        with self.warming_up() as started:
            for _ in range(warmup_iters):
                fn(*args, **kwargs)
        return self.record(fn, args, kwargs, started)

    def with_prologue(self, fn: Callable[..., Any], prologue: Callable[[], None]) -> Callable[..., Any]:
        """``fn`` that runs ``prologue`` first, in line on the same stream. (Forked onto a side stream
        and joined inside a CUDA graph, the prologue's few small copies cost 1-2.5% of a decode step
        on the H200 where in line they cost 0-0.2%, as much as no prologue: ``bench/runner_device.py``.)"""

        def run(*args: Any, **kwargs: Any) -> Any:
            prologue()
            return fn(*args, **kwargs)

        return run

    def check(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuse a capture this backend cannot make (the default refuses none)."""
        return None

    @contextmanager
    def warming_up(self) -> Iterator[float]:
        """Around the warm-up runs; yields the capture's start time."""
        yield time.perf_counter()

    @abc.abstractmethod
    def record(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], started: float
    ) -> CapturedGraph:
        """Record one call of ``fn`` as a graph."""


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Keep the garbage collector out of a capture: freeze what exists, disable collection.

    A collection during capture is slow (every capture would pay for a full walk of the heap) and
    may free a tensor whose memory the graph is about to bake in. ``torch.cuda.graph`` may call
    ``gc.collect()`` itself on entry; that call is made a no-op for the duration.
    """
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        with mock.patch.object(gc, "collect", lambda generation=2: 0):
            yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def pool_reserved_bytes(pool: tuple[int, int]) -> int:
    """Bytes reserved by one CUDA graph pool: its segments in the caching allocator's snapshot.

    ``torch.cuda.memory_allocated()`` cannot measure a graph: blocks freed inside the pool at the
    end of a capture stay reserved for the graph but no longer count as allocated.
    """
    wanted = tuple(pool)
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment["segment_pool_id"]) == wanted
    )


class CudaGraph:
    """A real CUDA graph and the static outputs it writes."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        outputs: Any,
        seconds: float,
        pool_bytes: int,
        pool: tuple[int, int],
    ) -> None:
        self.graph = graph
        self.outputs = outputs
        self.capture_seconds = seconds
        self.pool_bytes = pool_bytes
        self.pool = pool
        self.replay = direct_replay(graph)


def direct_replay(graph: torch.cuda.CUDAGraph) -> Callable[[], None]:
    """``graph.replay`` without the Python frame torch's ``CUDAGraph`` puts before its C method (a
    frame and a ``super()`` call on every replay, about as long as the replay guard): the C method
    bound to the graph, where torch's frame has nothing to do for it (no pool tracker, where this torch
    has one); torch's own method otherwise."""
    if getattr(graph, "_tracker", None) is not None:
        return graph.replay
    for base in type(graph).__mro__[1:]:
        method = base.__dict__.get("replay")
        if method is not None:
            return method.__get__(graph, base)
    return graph.replay


class CudaGraphBackend(GraphBackend):
    """Captures into ``torch.cuda.CUDAGraph``; by default every graph shares one memory pool.

    Capturing the largest graph first into the shared pool lets every smaller graph reuse its
    memory; ``shared_pool=False`` gives each graph its own pool (only useful to measure the gain).
    """

    name = "cuda"

    def __init__(self, shared_pool: bool = True) -> None:
        if not torch.cuda.is_available():
            raise GraphCacheError(
                "the cuda graph backend needs a CUDA GPU and a CUDA build of torch; "
                "use backend='eager' (or 'auto') on this host"
            )
        self.shared_pool = shared_pool
        self._pool: tuple[int, int] | None = None
        self._side_stream: torch.cuda.Stream | None = None
        # pool -> (device-wide reserved bytes, the pool's reserved bytes) right after its last
        # capture: lets the next capture skip one walk of the allocator snapshot when nothing was
        # reserved or released anywhere since.
        self._last_reserved: dict[tuple[int, int], tuple[int, int]] = {}

    @property
    def pool(self) -> tuple[int, int] | None:
        """The shared pool's id once the first graph is captured."""
        return self._pool

    def _next_pool(self) -> tuple[int, int]:
        if self._pool is None or not self.shared_pool:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def check(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        _require_cuda_work(fn, args, kwargs)

    @contextmanager
    def warming_up(self) -> Iterator[float]:
        """Warm up on a side stream, as torch.cuda.make_graphed_callables does: lazy initialisation
        (cuBLAS handles, autotuning) happens there and not inside the capture."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        started = time.perf_counter()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield started
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def record(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], started: float
    ) -> CudaGraph:
        pool = self._next_pool()
        reserved_before = self._pool_reserved_now(pool)
        graph = torch.cuda.CUDAGraph()
        with gc_frozen(), torch.cuda.graph(graph, pool=pool):
            outputs = fn(*args, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        reserved_after = pool_reserved_bytes(pool)
        self._last_reserved[pool] = (torch.cuda.memory_reserved(), reserved_after)
        # Capturing records kernels without running them: replay once so the outputs are real.
        graph.replay()
        return CudaGraph(graph, outputs, seconds, reserved_after - reserved_before, pool)

    def _pool_reserved_now(self, pool: tuple[int, int]) -> int:
        """The pool's reserved bytes: remembered from its last capture while the device-wide
        reserved total has not moved since (no segment reserved or released anywhere), else walked."""
        last = self._last_reserved.get(pool)
        if last is not None and last[0] == torch.cuda.memory_reserved():
            return last[1]
        return pool_reserved_bytes(pool)


def _require_cuda_work(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse a capture whose tensor inputs are all on the CPU.

    CPU work runs immediately during a capture and is not recorded, so such a "graph" would
    replay nothing and hand back the capture run's outputs forever: silently wrong, never slow.
    A callable without tensor inputs (a closure over its buffers, as a micro-batched step is)
    cannot be judged from here and is let through.
    """
    tensors = [
        item
        for value in (*args, *kwargs.values())
        for item in (value if isinstance(value, (list, tuple)) else (value,))
        if isinstance(item, torch.Tensor)
    ]
    if not tensors or any(t.is_cuda for t in tensors):
        return
    name = getattr(fn, "__qualname__", type(fn).__name__)
    raise GraphCacheError(
        f"cannot capture {name!r} as a CUDA graph: none of its tensor inputs is on a CUDA device, "
        "and CPU work is not recorded in a graph. Move the model and its inputs to the GPU, or use "
        "backend='eager'."
    )


class EagerGraph:
    """The eager backend's "graph": the callable and the very inputs it was captured with."""

    pool_bytes = 0

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        outputs: Any,
        seconds: float,
    ) -> None:
        self._fn = fn
        self._args = tuple(args)
        self._kwargs = dict(kwargs)
        self.outputs = outputs
        self.capture_seconds = seconds

    def replay(self) -> None:
        with torch.no_grad():
            copy_outputs(self.outputs, self._fn(*self._args, **self._kwargs))


class EagerBackend(GraphBackend):
    """For hosts without CUDA: same bookkeeping and events; a replay re-runs the callable."""

    name = "eager"

    def record(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], started: float
    ) -> EagerGraph:
        with gc_frozen():
            outputs = fn(*args, **kwargs)
        return EagerGraph(fn, args, kwargs, outputs, time.perf_counter() - started)


def copy_outputs(destination: Any, source: Any) -> None:
    """Copy a fresh result into the kept outputs, through tuples, lists and dicts of tensors."""
    if isinstance(destination, torch.Tensor):
        destination.copy_(source)
    elif isinstance(destination, (list, tuple)):
        for dst, src in zip(destination, source, strict=True):
            copy_outputs(dst, src)
    elif isinstance(destination, dict):
        for key, dst in destination.items():
            copy_outputs(dst, source[key])


def select_backend(choice: str | GraphBackend = "auto") -> GraphBackend:
    """``auto``: CUDA graphs when a GPU is present, else the eager backend (logged as such)."""
    if not isinstance(choice, str):
        return choice
    name = choice.strip().lower()
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown graph backend {choice!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return CudaGraphBackend()
    log.info("graph backend: eager (no CUDA here: 'replays' re-run the model, timings are not graph timings)")
    return EagerBackend()
