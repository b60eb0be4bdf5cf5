"""Running micro-batches on threads that take turns, so one ubatch's comm hides under another's compute.

Each micro-batch runs the model on its own thread, but only one thread runs at a time: they pass a
token round a ring of CPU events. A ubatch that reaches a communication point records "compute
done" on the compute stream, hands the CPU to the next ubatch, and when its turn comes back issues
its communication on the comm stream (after a GPU wait on its own compute event). The GPU then
runs ubatch 0's communication while ubatch 1's compute kernels, queued meanwhile, fill the SMs.

Threads, not coroutines, because the model is ordinary PyTorch code that calls ``dbo_*`` helpers
deep inside; a thread can park there without the model being rewritten. PyTorch's current stream,
grad mode and this project's forward context are all thread-local, so each ubatch keeps its own.

Without CUDA (``compute_stream is None``) every stream operation is a no-op and the hand-over of
threads is still real, which is what the CPU tests pin.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch

DEFAULT_HANDOVER_TIMEOUT_S = 60.0


class UBatchHandoverError(RuntimeError):
    """A micro-batch waited too long for its turn, or the ring was aborted by a failing ubatch."""


class UBatchAbortedError(UBatchHandoverError):
    """This ubatch stopped because another one failed; the other one's error is the real cause."""


class UBatchRing:
    """What the ubatches of one step share: the CPU events of the ring, the barrier, the streams.

    ``events[i]`` is set when ubatch ``i`` may run. The barrier holds the ubatch threads and the
    main thread, so no ubatch starts before every thread is parked (and, for capture, has set up
    its CUDA context). ``compute_stream`` may be bound late, at ``release``: during graph capture
    it is the capturing stream, which only exists once capture has begun.

    ``timeout`` bounds each wait for a turn; ``start_timeout`` bounds the wait at the barrier,
    which includes thread start-up and CUDA set-up (seconds, on a first use), so by default it is
    never shorter than ``DEFAULT_HANDOVER_TIMEOUT_S``.
    """

    def __init__(
        self,
        num_ubatches: int,
        *,
        compute_stream: torch.cuda.Stream | None = None,
        comm_stream: torch.cuda.Stream | None = None,
        timeout: float = DEFAULT_HANDOVER_TIMEOUT_S,
        start_timeout: float | None = None,
    ) -> None:
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        if timeout <= 0 or (start_timeout is not None and start_timeout <= 0):
            raise ValueError(f"the hand-over timeouts must be positive, got {timeout} and {start_timeout}")
        self.num_ubatches = num_ubatches
        self.timeout = timeout
        if start_timeout is None:
            start_timeout = max(timeout, DEFAULT_HANDOVER_TIMEOUT_S)
        self.start_timeout = start_timeout
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.events = [threading.Event() for _ in range(num_ubatches)]
        self.barrier = threading.Barrier(num_ubatches + 1)
        self.running: int | None = None
        """The ubatch that holds the CPU now (None before release and after the last exit)."""
        self._abort_reason: str | None = None
        self._lock = threading.Lock()

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    def abort(self, reason: str) -> None:
        """Wake every waiter so it fails fast instead of hanging; the first reason wins."""
        with self._lock:
            if self._abort_reason is None:
                self._abort_reason = reason
        self.barrier.abort()
        for event in self.events:
            event.set()

    def wait_at_barrier(self, who: str) -> None:
        try:
            self.barrier.wait(self.start_timeout)
        except threading.BrokenBarrierError:
            if self._abort_reason is not None:
                raise UBatchAbortedError(f"{who} stopped: {self._abort_reason}") from None
            reason = f"not every ubatch thread reached the start barrier within {self.start_timeout:g}s"
            self.abort(reason)
            raise UBatchHandoverError(f"{who}: {reason}") from None

    def release(self, compute_stream: torch.cuda.Stream | None = None) -> None:
        """Let ubatch 0 run (called by the main thread once everyone is at the barrier).

        On CUDA the compute stream is ``compute_stream``, else the one bound at construction, else
        the caller's current stream: the ubatches' work then orders after what the caller queued.
        """
        if compute_stream is not None:
            self.compute_stream = compute_stream
        elif self.compute_stream is None and self.comm_stream is not None:
            self.compute_stream = torch.cuda.current_stream(self.comm_stream.device)
        self.events[0].set()

    def take_turn(self, ubatch_id: int) -> None:
        """Block until it is ``ubatch_id``'s turn; time out with a clear error, never hang."""
        event = self.events[ubatch_id]
        if not event.wait(self.timeout):
            holder = "no ubatch" if self.running is None else f"ubatch {self.running}"
            reason = (
                f"ubatch {ubatch_id} waited {self.timeout:g}s for its turn while {holder} held the CPU: "
                "a hand-over is stuck (a ubatch that never yields, or one that yields a different number "
                "of times than the others)"
            )
            self.abort(reason)
            raise UBatchHandoverError(reason)
        if self._abort_reason is not None:
            raise UBatchAbortedError(f"ubatch {ubatch_id} stopped: {self._abort_reason}")
        event.clear()
        self.running = ubatch_id

    def pass_turn(self, ubatch_id: int) -> None:
        """Hand the CPU to the next ubatch in the ring."""
        if self.running != ubatch_id:
            reason = f"ubatch {ubatch_id} tried to hand over while ubatch {self.running} held the CPU"
            self.abort(reason)
            raise UBatchHandoverError(reason)
        self.running = None
        self.events[(ubatch_id + 1) % self.num_ubatches].set()


_local = threading.local()


class UBatchContext:
    """One micro-batch's view of the ring: its turn, its streams and its two GPU events.

    Use as a context manager on the ubatch's own thread: entering waits at the barrier and then for
    the turn, and switches to the compute stream; leaving re-joins the comm stream into the compute
    stream, restores the thread's stream and passes the turn on.
    """

    def __init__(
        self,
        ubatch_id: int,
        ring: UBatchRing,
        forward_context: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        if not 0 <= ubatch_id < ring.num_ubatches:
            raise ValueError(f"ubatch_id must be in 0..{ring.num_ubatches - 1}, got {ubatch_id}")
        self.id = ubatch_id
        self.ring = ring
        self.forward_context = forward_context
        on_gpu = ring.comm_stream is not None
        self.gpu_compute_done = torch.cuda.Event() if on_gpu else None
        self.gpu_comm_done = torch.cuda.Event() if on_gpu else None
        self.current_stream: torch.cuda.Stream | None = None
        self._original_stream: torch.cuda.Stream | None = None
        self._used_comm = False

    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        return self.ring.compute_stream

    @property
    def comm_stream(self) -> torch.cuda.Stream | None:
        return self.ring.comm_stream

    @property
    def on_gpu(self) -> bool:
        return self.ring.comm_stream is not None

    # -- entering and leaving -------------------------------------------------------------------
    def __enter__(self) -> UBatchContext:
        if getattr(_local, "context", None) is not None:
            raise RuntimeError("this thread already runs a ubatch; ubatch contexts do not nest")
        _local.context = self
        try:
            self.ring.wait_at_barrier(f"ubatch {self.id}")
            self.ring.take_turn(self.id)
        except BaseException:
            _local.context = None
            raise
        if self.forward_context is not None:
            self.forward_context.__enter__()
        if self.on_gpu:
            self._original_stream = torch.cuda.current_stream()
            self._update_stream(self.compute_stream)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _local.context = None
        try:
            if self.forward_context is not None:
                self.forward_context.__exit__(exc_type, exc, tb)
            if self.on_gpu:
                if exc is None and self._used_comm:
                    # Join the comm stream back: during capture every forked stream must re-join.
                    self._update_stream(self.compute_stream)
                    self._signal_comm_done()
                    self._wait_comm_done()
                torch.cuda.set_stream(self._original_stream)
        finally:
            if exc is not None and not isinstance(exc, UBatchAbortedError):
                self.ring.abort(f"ubatch {self.id} failed: {exc!r}")
            elif exc is None:
                self.ring.pass_turn(self.id)

    # -- streams (no-ops without CUDA) ----------------------------------------------------------
    def _update_stream(self, stream: torch.cuda.Stream | None) -> None:
        self.current_stream = stream
        if stream is not None:
            torch.cuda.set_stream(stream)

    def _signal_compute_done(self) -> None:
        if self.gpu_compute_done is not None:
            self.gpu_compute_done.record(self.compute_stream)

    def _signal_comm_done(self) -> None:
        if self.gpu_comm_done is not None:
            self.gpu_comm_done.record(self.comm_stream)

    def _wait_compute_done(self) -> None:
        if self.gpu_compute_done is not None and self.comm_stream is not None:
            self.comm_stream.wait_event(self.gpu_compute_done)

    def _wait_comm_done(self) -> None:
        if self.gpu_comm_done is not None and self.compute_stream is not None:
            self.compute_stream.wait_event(self.gpu_comm_done)

    def _check_on(self, stream: torch.cuda.Stream | None, name: str) -> None:
        if self.on_gpu and torch.cuda.current_stream() != stream:
            raise RuntimeError(f"ubatch {self.id} expected to be on the {name} stream")

    # -- hand-over ------------------------------------------------------------------------------
    def _cpu_yield(self) -> None:
        self.ring.pass_turn(self.id)
        self.ring.take_turn(self.id)

    def yield_(self) -> None:
        """Let the next ubatch run; resume on whatever stream this ubatch was on."""
        stream = torch.cuda.current_stream() if self.on_gpu else None
        self._cpu_yield()
        self._update_stream(stream)

    def switch_to_comm(self) -> None:
        self._used_comm = True
        self._update_stream(self.comm_stream)

    def switch_to_compute(self) -> None:
        self._update_stream(self.compute_stream)

    def switch_to_comm_sync(self) -> None:
        """Move to the comm stream, which first waits for this ubatch's compute so far."""
        self._used_comm = True
        self._signal_compute_done()
        self._update_stream(self.comm_stream)
        self._wait_compute_done()

    def switch_to_compute_sync(self) -> None:
        """Move to the compute stream, which first waits for this ubatch's comm so far."""
        self._signal_comm_done()
        self._update_stream(self.compute_stream)
        self._wait_comm_done()

    def yield_and_switch_from_compute_to_comm(self) -> None:
        """Mark compute done, let the next ubatch compute, then issue comm once it is our turn."""
        self._check_on(self.compute_stream, "compute")
        self._used_comm = True
        self._signal_compute_done()
        self._cpu_yield()
        self._update_stream(self.comm_stream)
        self._wait_compute_done()

    def yield_and_switch_from_comm_to_compute(self) -> None:
        """Mark comm done, let the next ubatch run, then compute once our comm has landed."""
        self._check_on(self.comm_stream, "comm")
        self._signal_comm_done()
        self._cpu_yield()
        self._update_stream(self.compute_stream)
        self._wait_comm_done()


def make_ubatch_contexts(
    ring: UBatchRing,
    forward_contexts: Sequence[contextlib.AbstractContextManager[Any] | None] | None = None,
) -> list[UBatchContext]:
    """One context per ubatch of ``ring``, each with its own forward context (or none)."""
    if forward_contexts is not None and len(forward_contexts) != ring.num_ubatches:
        raise ValueError(f"need {ring.num_ubatches} forward contexts, got {len(forward_contexts)}")
    return [
        UBatchContext(i, ring, None if forward_contexts is None else forward_contexts[i])
        for i in range(ring.num_ubatches)
    ]


def current_ubatch_context() -> UBatchContext | None:
    """The ubatch the calling thread runs, or None outside micro-batching."""
    return getattr(_local, "context", None)


def dbo_enabled() -> bool:
    """True on a ubatch thread: model code may then yield and switch streams."""
    return current_ubatch_context() is not None


def dbo_current_ubatch_id() -> int:
    """The calling thread's ubatch index; 0 outside micro-batching (the whole batch is ubatch 0)."""
    context = current_ubatch_context()
    return 0 if context is None else context.id


def _on_ubatch(method: Callable[[UBatchContext], None]) -> Callable[[], None]:
    """Make a module-level helper that acts on the caller's ubatch and does nothing outside one."""

    def helper() -> None:
        context = current_ubatch_context()
        if context is not None:
            method(context)

    helper.__name__ = f"dbo_{method.__name__.rstrip('_')}"
    helper.__doc__ = f"``UBatchContext.{method.__name__}`` on the calling ubatch; a no-op outside DBO."
    return helper


dbo_yield = _on_ubatch(UBatchContext.yield_)
dbo_switch_to_comm = _on_ubatch(UBatchContext.switch_to_comm)
dbo_switch_to_compute = _on_ubatch(UBatchContext.switch_to_compute)
dbo_switch_to_comm_sync = _on_ubatch(UBatchContext.switch_to_comm_sync)
dbo_switch_to_compute_sync = _on_ubatch(UBatchContext.switch_to_compute_sync)
dbo_yield_and_switch_from_compute_to_comm = _on_ubatch(UBatchContext.yield_and_switch_from_compute_to_comm)
dbo_yield_and_switch_from_comm_to_compute = _on_ubatch(UBatchContext.yield_and_switch_from_comm_to_compute)
