"""The graph runtime: what every wrapper of one engine shares.

One ``GraphRuntime`` holds the backend (and through it the one shared graph pool), the capture
guard, the address-check mode, the unexpected-capture policy, the warm-up count and the observer.
Wrappers ask it whether they may capture and tell it what they found; it turns findings into
events, and events into errors where the configuration says so.

The capture guard: captures happen only inside ``with runtime.capture_phase():``. Leaving the
outermost phase locks capture for good - start-up is over. Before the phase, a batch with no graph
simply runs eagerly. After the lock, every capture attempt is an *unexpected capture* (in
production: a multi-second stall of one step), on every path: a batch of a size start-up never
captured, a capture phase or a second runner started late (a lazily built draft model), a direct
``capture()``. It is always reported with its stack, then raised (``UnexpectedCaptureError``),
served eagerly or captured anyway, by policy. Never silent.

The replay checks (see ``capture_core.checks``) run in the configured mode; ``sampling`` says which
replays get the closer look (and the canary, when ``canary=True``; debug mode samples every replay
and always runs the canary). The same sampled replays, the canary's eager steps and a sampled share
of the eager fallbacks are timed (``step_timing``, on by default; ``capture_core.step_time``), and
their times told to the observer.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from capture_core.backends import GraphBackend, select_backend
from capture_core.canary import Sampling
from capture_core.checks import (
    AddressCheckMode,
    Finding,
    effective_check_mode,
    finding_message,
)
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCheckError, UnexpectedCaptureError
from capture_core.events import (
    CaptureEvent,
    DivergenceEvent,
    GraphObserver,
    NullObserver,
    ViolationEvent,
    ViolationKind,
)
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.progress import ProgressBar
from capture_core.shadows import StepBuffers
from capture_core.sizes import EagerReason
from capture_core.step_time import StepPath, StepTimer

log = logging.getLogger(__name__)

DEFAULT_WARMUP_ITERS = 3


class UnexpectedCapturePolicy(str, enum.Enum):
    """What to do with a capture attempt after the lock (the event is emitted in every case)."""

    RAISE = "raise"
    EAGER = "eager"
    """Serve the batch eagerly: slower, but no stall and no crash."""
    ENGINE = "engine"
    """Leave the capture attempt to the engine that owns the graphs (an engine attached through its
    own extension points, such as vLLM, which raises unless its own capture phase is open): it is
    reported here and then goes ahead exactly as it would without graph-inspector."""
    CAPTURE = "capture"
    """Capture anyway (the stall happens), recorded with ``CaptureEvent.unexpected=True``.

    The warm-ups then run on the step's real inputs: fine for a forward pass whose side effects
    repeat identically (the reference decoder rewrites the same KV entries), not for one that
    accumulates state - use RAISE or EAGER for such a model.
    """

    @classmethod
    def parse(cls, value: UnexpectedCapturePolicy | str) -> UnexpectedCapturePolicy:
        if isinstance(value, UnexpectedCapturePolicy):
            return value
        try:
            return cls(value.strip().lower())
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            message = f"unknown unexpected-capture policy {value!r}; choose one of {choices}"
            raise ValueError(message) from None


class CapturePhase(str, enum.Enum):
    BEFORE = "before"
    CAPTURING = "capturing"
    LOCKED = "locked"


class CaptureDecision(enum.Enum):
    """The runtime's answer to a wrapper that has no graph for a batch."""

    CAPTURE = "capture"
    CAPTURE_UNEXPECTED = "capture_unexpected"
    EAGER = "eager"


class GraphRuntime:
    """Shared state and policy for every graph wrapper of one engine."""

    def __init__(
        self,
        backend: str | GraphBackend = "auto",
        *,
        address_check: AddressCheckMode | str = AddressCheckMode.ALWAYS_ON,
        unexpected_capture: UnexpectedCapturePolicy | str = UnexpectedCapturePolicy.RAISE,
        warmup_iters: int = DEFAULT_WARMUP_ITERS,
        observer: GraphObserver | None = None,
        progress: bool = True,
        sampling: Sampling | None = None,
        canary: bool = False,
        step_timing: bool = True,
        locate_divergence: bool = True,
    ) -> None:
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise ValueError(f"warmup_iters must be an integer >= 0, got {warmup_iters!r}")
        self.backend: GraphBackend = select_backend(backend)
        self.address_check: AddressCheckMode = effective_check_mode(address_check)
        self.sampling = sampling if sampling is not None else Sampling()
        """Which replays of each graph get the closer look (set before capture: graphs keep theirs)."""
        self.canary = canary
        """Run the replay-vs-eager canary on sampled replays (debug mode runs it on every replay)."""
        self.step_buffers = StepBuffers(self.report_findings)
        """The per-step input buffers of every graph: versions, shadows, which rows held tokens."""
        self.locate_divergence = locate_divergence
        """On a ``replay_mismatch``, find the first module whose output differs (``capture_core.locate``)."""
        self.step_timer: StepTimer | None = None
        """Times the sampled replays, the canary's eager steps and sampled eager fallbacks (None: off)."""
        if step_timing:
            # a backend named cuda where CUDA is not: an engine's stand-in, timed by the host clock
            device_events = self.backend.name == "cuda" and torch.cuda.is_available()
            self.step_timer = StepTimer(self._report_step_time, self.sampling, device_events=device_events)
        self.unexpected_capture = UnexpectedCapturePolicy.parse(unexpected_capture)
        self.warmup_iters = warmup_iters
        self.observer = observer if observer is not None else NullObserver()
        self.progress = progress
        self.phase = CapturePhase.BEFORE
        self._phase_depth = 0
        self._injected_depth = 0
        self._warned: set[tuple[str, str, str, str | None]] = set()
        # Serialises captures (micro-batch threads may reach a capture together); replays never take it.
        self.capture_lock = threading.RLock()
        log.info(
            "graph runtime: backend=%s address_check=%s unexpected_capture=%s warmup_iters=%d "
            "sampling=first %d then 1 in %d canary=%s step_timing=%s",
            self.backend_name, self.address_check.value, self.unexpected_capture.value, warmup_iters,
            self.sampling.first, self.sampling.every, "on" if canary else "off",
            self.step_timer.clock if self.step_timer is not None else "off",
        )

    @property
    def observer(self) -> GraphObserver:
        """Receives the graph cache's events."""
        return self._observer

    @observer.setter
    def observer(self, observer: GraphObserver) -> None:
        self._observer = observer
        on_replay = getattr(type(observer), "on_replay", None)
        self.replay_observer: Callable[[CUDAGraphMode, BatchDescriptor, int], None] | None = (
            None if on_replay is NullObserver.on_replay else observer.on_replay)
        """The observer's ``on_replay``, or None for one that ignores replays (the replay path then
        makes no call)."""

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def locked(self) -> bool:
        return self.phase is CapturePhase.LOCKED

    @contextmanager
    def capture_phase(self) -> Iterator[GraphRuntime]:
        """Allow captures inside; leaving the outermost phase locks capture for good.

        A phase entered after the lock (a runner started late) unlocks nothing: every capture
        attempt inside it is an unexpected capture, reported and handled by the policy.
        """
        if self.phase is CapturePhase.LOCKED:
            log.warning("a capture phase began after the lock: every capture in it is an unexpected capture")
            yield self
            return
        self._phase_depth += 1
        self.phase = CapturePhase.CAPTURING
        try:
            yield self
        finally:
            self._phase_depth -= 1
            if self._phase_depth == 0:
                self.lock()

    def lock(self) -> None:
        """End start-up: from now on every capture attempt is an unexpected capture."""
        self.phase = CapturePhase.LOCKED
        log.info("graph capture locked: later capture attempts are unexpected captures")

    @contextmanager
    def injected_faults(self) -> Iterator[None]:
        """Mark every violation reported inside as planted on purpose (``injected=True``)."""
        self._injected_depth += 1
        try:
            yield
        finally:
            self._injected_depth -= 1

    def admit_capture(
        self, wrapper: str, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int
    ) -> CaptureDecision:
        """Decide what a wrapper with no graph for ``descriptor`` does; may raise by policy."""
        if self.phase is CapturePhase.CAPTURING:
            return CaptureDecision.CAPTURE
        if self.phase is CapturePhase.BEFORE:
            self.observer.on_eager(EagerReason.BEFORE_CAPTURE_PHASE, num_real_tokens, mode)
            return CaptureDecision.EAGER
        policy = self.unexpected_capture
        outcome = {
            UnexpectedCapturePolicy.RAISE: "raised an error",
            UnexpectedCapturePolicy.EAGER: "served the batch eagerly",
            UnexpectedCapturePolicy.CAPTURE: "captured it anyway, stalling this step",
            UnexpectedCapturePolicy.ENGINE: (
                "left it to the engine, which captures or refuses by its own rules"
            ),
        }[policy]
        message = (
            f"unexpected capture: wrapper {wrapper!r} has no graph for {descriptor.key} ({mode.label}) "
            f"and capture was locked at the end of start-up; policy {policy.value!r} {outcome}. "
            f"{ViolationKind.UNEXPECTED_CAPTURE.record.fix}."
        )
        event = self.report(ViolationKind.UNEXPECTED_CAPTURE, wrapper, mode, descriptor, message)
        if policy is UnexpectedCapturePolicy.RAISE:
            raise UnexpectedCaptureError(message, [event])
        if policy is UnexpectedCapturePolicy.EAGER:
            self.observer.on_eager(EagerReason.UNEXPECTED_CAPTURE, num_real_tokens, mode)
            return CaptureDecision.EAGER
        return CaptureDecision.CAPTURE_UNEXPECTED

    def _report_step_time(
        self, path: StepPath, mode: CUDAGraphMode, descriptor: BatchDescriptor, seconds: float, clock: str
    ) -> None:
        """One timed step, to an observer that takes step times (the call is optional)."""
        on_step_time = getattr(self.observer, "on_step_time", None)
        if on_step_time is None:
            return
        if path is StepPath.GRAPH:
            on_step_time(mode, descriptor, seconds, None, 1, clock)
        else:
            on_step_time(mode, descriptor, None, seconds, 1, clock)

    def run_eager_fallback(
        self, descriptor: BatchDescriptor, run: Callable[..., Any], *args: Any
    ) -> Any:
        """``run(*args)``: a batch served without a graph, at ``descriptor``'s size (its real tokens),
        timed when the step timer samples it (keyed by mode ``NONE``: no graph ran)."""
        if self.step_timer is None:
            return run(*args)
        return self.step_timer.eager(CUDAGraphMode.NONE, descriptor, run, *args)

    def report_divergence(self, event: DivergenceEvent) -> DivergenceEvent:
        """Send where a graph and its eager step part to an observer that takes it (marked injected
        inside ``injected_faults()``), and log it."""
        if self._injected_depth and not event.injected:
            event = replace(event, injected=True)
        log.warning("%sgraph %s (%s) of wrapper %r: %s", "[injected] " if event.injected else "",
                    event.descriptor.key, event.mode.label, event.wrapper, event.message)
        on_divergence = getattr(self.observer, "on_divergence", None)
        if on_divergence is not None:
            on_divergence(event)
        return event

    def collect_step_times(self, wait: bool = True) -> int:
        """Report the timed steps whose CUDA events are still unread (waiting for the GPU with
        ``wait``): call it at the end of a run, so the last samples are not left behind. How many."""
        return 0 if self.step_timer is None else self.step_timer.collect(wait)

    def report_capture(self, event: CaptureEvent) -> None:
        log.debug(
            "captured %s %s in %s: %.3fs, %d pool bytes (backend %s)",
            event.mode.label, event.descriptor.key, event.wrapper, event.capture_seconds,
            event.pool_bytes, event.backend,
        )
        self.observer.on_capture(event)

    def report_violation(self, event: ViolationEvent) -> ViolationEvent:
        """Send a violation to the observer, marked injected inside ``injected_faults()``."""
        if self._injected_depth and not event.injected:
            event = replace(event, injected=True)
        # Every event reaches the observer; the log warns once per kind, wrapper, graph and input,
        # so a drift on every step does not bury the log.
        key = (event.kind.value, event.wrapper, event.descriptor.key, event.input_name)
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, "%s%s", "[injected] " if event.injected else "", event.message)
        self.observer.on_violation(event)
        return event

    def report(
        self,
        kind: ViolationKind,
        wrapper: str,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        message: str,
        stack: str | None = None,
        **details: Any,
    ) -> ViolationEvent:
        """Report one violation seen by ``wrapper`` in graph ``descriptor``, with the caller's stack."""
        event = ViolationEvent(
            kind=kind, descriptor=descriptor, mode=mode, wrapper=wrapper, message=message,
            stack=caller_stack() if stack is None else stack, **details,
        )
        return self.report_violation(event)

    def report_findings(
        self, wrapper: str, mode: CUDAGraphMode, descriptor: BatchDescriptor, findings: Sequence[Finding]
    ) -> None:
        """One event per finding of a replay check; then, in DEBUG mode, raise the error of the first
        one's kind (``AddressDriftError``, ``LayoutMismatchError``, ...) naming every such finding."""
        stack = caller_stack()
        events = [
            self.report(
                finding.kind, wrapper, mode, descriptor,
                finding_message(wrapper, mode, descriptor, [finding]), stack,
                input_name=finding.name, expected_address=finding.expected_address,
                actual_address=finding.actual_address, max_abs_error=finding.max_abs_error,
                max_rel_error=finding.max_rel_error,
            )
            for finding in findings
        ]
        if findings and self.address_check is AddressCheckMode.DEBUG:
            error = findings[0].kind.record.error or GraphCheckError
            raise error(finding_message(wrapper, mode, descriptor, findings), events)

    def settle_checks(self) -> None:
        """Read back every per-step comparison still on its way from the device and report what it
        found. On CUDA in always-on mode a comparison is read at its group's next closer look
        without a sync; call this at the end of serving (or before asserting on the events) to have
        the last one too. It waits for the device."""
        self.step_buffers.settle()

    def capture_all(
        self,
        graphs: Iterable[tuple[CUDAGraphMode, BatchDescriptor]],
        run: Callable[[CUDAGraphMode, BatchDescriptor], Any],
        label: str = "Capturing graphs",
    ) -> None:
        """Capture every ``(mode, descriptor)``, largest first, with a progress bar.

        For each one, ``run(mode, descriptor)`` is called under that forward context inside the
        capture phase; it should call the wrapped model once on dummy inputs of that size.
        """
        ordered = sorted(graphs, key=lambda md: md[1].num_tokens, reverse=True)
        bar = ProgressBar(len(ordered), label, enabled=self.progress)
        try:
            with self.capture_phase():
                for mode, descriptor in ordered:
                    with set_forward_context(mode, descriptor):
                        run(mode, descriptor)
                    bar.advance(f"{mode.name} tokens={descriptor.num_tokens}")
        finally:
            bar.close()


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_internal(filename: str) -> bool:
    """A frame of the graph cache itself: any module of this package (runner, piecewise, ubatch)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def caller_stack(limit: int = 30) -> str:
    """The caller's stack, without the graph cache's own frames: where the bad call came from."""
    frames = [f for f in traceback.extract_stack() if not _is_internal(f.filename)]
    return "".join(traceback.format_list(frames[-limit:]))
