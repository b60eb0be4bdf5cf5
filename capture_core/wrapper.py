"""``CUDAGraphWrapper``: the one graph-serving core every kind of graph in this package goes through.

A wrapper holds graphs keyed by ``BatchDescriptor`` and reads the forward context. Outside one, or
when the context's runtime mode is not the wrapper's, it just calls the callable (a FULL wrapper
stays out of the way of a PIECEWISE batch). Otherwise the descriptor picks the graph. The first
call of a descriptor asks the runtime whether it may capture (under the capture lock, checking
that no other thread captured it meanwhile) and then captures (warm-ups, capture, a
``CaptureEvent`` with every tensor input's name and address) or runs the batch eagerly; later
calls are checked, told to the observer, and replayed.

What differs between plain, piecewise and micro-batched graphs is data: a ``GraphSource`` says
what one capture records and how a batch runs without a graph (the callable itself by default; a
``UBatchWrapper`` captures its ubatch threads, a ``PiecewiseGraph`` the segments of a pass), a
``GraphRole`` which checks are the wrapper's own, and an entry that ``runs_pass`` replays by running
its pass of segment graphs on the call's inputs.

Every replay check is written here once (see ``capture_core.checks``): each graph's generated guard
(``capture_core.guard``) runs on every always-on replay; when it says no, on sampled replays and on
every debug replay the closer look runs, then the canary where it is on. A graph with per-step
inputs copies them into their shadows as part of its own work (``capture_core.stale``), so the
closer look can tell a written input from a stale one whatever wrote it. The common replay path is a
dictionary lookup, the guard and one observer call: it is benchmarked against a bare ``replay()``
(``bench/gpu_overhead.py``).
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from capture_core.backends import CapturedGraph
from capture_core.baked import BakedValues
from capture_core.canary import CanaryRun, MutatedInput, Written
from capture_core.checks import AddressCheckMode, ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError
from capture_core.events import CaptureEvent, DivergenceEvent
from capture_core.forward_context import CURRENT as _FORWARD
from capture_core.forward_context import ForwardContext, set_forward_context, use_forward_context
from capture_core.guard import ReplayChecks
from capture_core.inputs import InputLayout
from capture_core.locate import (
    NOT_PROBED_ADOPTED,
    NOT_PROBED_PASS,
    PROBE_GRAPH,
    PROBE_RERUN,
    Divergence,
    Probe,
)
from capture_core.modes import CUDAGraphMode
from capture_core.outputs import Handouts
from capture_core.runtime import CaptureDecision, CapturePhase, GraphRuntime
from capture_core.stale import PerStepInputs
from capture_core.state import ModuleState
from capture_core.step_time import StepPath

_OFF, _DEBUG = AddressCheckMode.OFF, AddressCheckMode.DEBUG


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
    checks: ReplayChecks = field(init=False, repr=False)
    """What its replays are checked against (set by the wrapper that captured it)."""
    guard: Callable[[tuple[Any, ...], dict[str, Any], int], bool] = field(init=False, repr=False)
    """``checks.clean``, held here: the replay path reads it on every call."""
    per_step: PerStepInputs | None = field(default=None, repr=False)
    """The graph's per-step inputs, when it has any (their snapshot is captured into the graph)."""
    baked: BakedValues | None = field(default=None, repr=False)
    """The host values its capture baked in (its call's non-tensor arguments, its module's
    attributes)."""
    handouts: Handouts | None = field(default=None, repr=False)
    """In debug mode, what its replays handed out (a read of an output a later replay wrote again is
    a stale output)."""
    captured_call: tuple[tuple[Any, ...], dict[str, Any]] | None = field(default=None, repr=False)
    """The call it was captured on, where this wrapper captured it (what a probe of it runs:
    ``capture_core.locate``)."""

    runs_pass: ClassVar[bool] = False
    """True for an entry replayed by ``graph.run(args, kwargs)`` (a pass of segment graphs) rather
    than by ``graph.replay()`` into static outputs."""

    @property
    def outputs(self) -> Any:
        return self.graph.outputs

    @property
    def num_ubatches(self) -> int:
        return 1

    @property
    def num_segments(self) -> int:
        return 1

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def input_addresses(self) -> tuple[int, ...]:
        return self.layout.addresses

    @property
    def addresses(self) -> dict[str, int]:
        """Input name -> captured address."""
        return dict(zip(self.input_names, self.input_addresses, strict=True))

    def capture_event(self, wrapper: str, backend: str, warmup_iters: int) -> CaptureEvent:
        """What the observer is told of this graph's capture."""
        return CaptureEvent(
            descriptor=self.descriptor,
            mode=self.mode,
            backend=backend,
            wrapper=wrapper,
            input_names=self.input_names,
            input_addresses=self.input_addresses,
            capture_seconds=self.capture_seconds,
            pool_bytes=self.pool_bytes,
            warmup_iters=warmup_iters,
            unexpected=self.unexpected,
            captured_at=self.captured_at,
            unchecked_inputs=self.checks.unchecked,
        )


class SnapshotFirst:
    """A graph held without the per-step inputs' snapshot inside it (a pass of segment graphs, a graph
    an engine captured itself): the snapshot runs first, eagerly, at each replay."""

    def __init__(self, graph: Any, snapshot: Callable[[], None]) -> None:
        self.graph, self.snapshot = graph, snapshot

    def __getattr__(self, name: str) -> Any:  # outputs, capture_seconds, pool_bytes, ...
        return getattr(self.graph, name)

    def replay(self) -> None:
        self.snapshot()
        self.graph.replay()

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.snapshot()
        return self.graph.run(args, kwargs)


class GraphCall(NamedTuple):
    """One call of a wrapper that has no graph for its batch: what a graph source captures or runs."""

    context: ForwardContext
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class GraphSource(Protocol):
    """What a wrapper captures for a batch, and how it serves a batch it holds no graph for."""

    def capture(self, wrapper: CUDAGraphWrapper, call: GraphCall, unexpected: bool) -> tuple[GraphEntry, Any]:
        """Capture one graph for ``call.context.descriptor``: its entry, and this call's outputs."""
        ...

    def run_eagerly(self, call: GraphCall) -> Any:
        """Serve the batch without a graph."""
        ...

    # A source may say ``has_eager_form = False``: its graphs are replayed by an engine that holds no
    # eager form of the step (vLLM's V2 runner replays FULL graphs without a call), so the canary,
    # which compares a replay with the same step run eagerly, does not apply to them.


class CallableSource:
    """A plain graph: the wrapper's callable itself, captured on the call's own arguments."""

    def __init__(self, runnable: Callable[..., Any]) -> None:
        self.runnable = runnable

    def capture(self, wrapper: CUDAGraphWrapper, call: GraphCall, unexpected: bool) -> tuple[GraphEntry, Any]:
        entry = wrapper.capture_entry(call, self.runnable, unexpected)
        return entry, entry.outputs

    def run_eagerly(self, call: GraphCall) -> Any:
        return self.runnable(*call.args, **call.kwargs)


class GraphRole(enum.Enum):
    """What one wrapper's graphs are to the call they serve: which checks and reports are its own."""

    WHOLE = "whole"
    """The whole call (a plain or micro-batched graph): every check, and it speaks to the observer."""
    PASS = "pass"
    """A pass of segment graphs: it speaks to the observer and checks the module, the per-step inputs
    and the canary; its segments check their own inputs."""
    SEGMENT = "segment"
    """One segment of a pass: it checks its inputs; the pass speaks for it (capture, replay)."""


CanaryPart = Callable[[str, torch.Tensor, ForwardContext], torch.Tensor]
"""``compared(name, tensor, context)``: the part of an output or mutated input the canary compares."""

MutatedInputs = Sequence[str] | Mapping[str, Written | None] | None
"""What a step writes, for the canary: names, or names mapped to the region a call writes."""

_RUNNABLE: Any = object()
"""``module`` default: the runnable itself when it is an ``nn.Module``."""


class CUDAGraphWrapper:
    """Serve ``runnable`` from CUDA graphs (or the eager stand-in) keyed by ``BatchDescriptor``.

    ``source`` says what a capture records (default: ``runnable`` on the call's arguments), ``role``
    what the wrapper's graphs are to their call (see ``GraphRole``). ``module`` is the module whose
    parameters and buffers the graphs bake in (by default the runnable, when it is one; None: no
    module). ``per_step_inputs`` names the inputs every step must write before the replay (checked
    for ``stale_input``); ``mutated_inputs`` the inputs the step writes, which the canary checks:
    names (the canary copies each whole; None: every tensor input), or names mapped to where in it
    a call's step writes (``Written``: the canary then keeps and compares only that region, and a
    checksum of the rest; None: copied whole). Names are as capture records show them; a name picks
    that input and everything inside it. ``compared(name, tensor, context)`` picks what of an output
    or a mutated input the canary compares (default: all of it). ``padding_rewritten`` says the step
    rewrites the padding rows of its per-step inputs (checked: a padding row still holding an earlier
    step's real token is a stale input); False declares an engine that leaves them as they are (its
    kernels never read them). ``unread`` names the non-tensor arguments and module attributes
    (``self.<name>``) the graph does not read, so a change of theirs is no ``baked_value_changed``
    (a name picks that value and everything inside it). An owner capturing on a wrapper's behalf sets
    ``decision`` for the duration, instead of the wrapper asking the runtime's capture guard.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime: GraphRuntime,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        name: str | None = None,
        *,
        source: GraphSource | None = None,
        role: GraphRole = GraphRole.WHOLE,
        module: nn.Module | None = _RUNNABLE,
        per_step_inputs: Sequence[str] = (),
        mutated_inputs: MutatedInputs = None,
        compared: CanaryPart | None = None,
        padding_rewritten: bool = True,
        unread: Sequence[str] = (),
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a graph wrapper serves FULL or PIECEWISE batches, not {runtime_mode.name}")
        self.runnable = runnable
        self.runtime = runtime
        self.runtime_mode = runtime_mode
        self.name = name or getattr(runnable, "__qualname__", None) or type(runnable).__name__
        self.parameter_names = ParameterNames.of(runnable)
        self.source: GraphSource = source if source is not None else CallableSource(runnable)
        self.has_eager_form: bool = getattr(self.source, "has_eager_form", True)
        self.role = role
        self.reports = role is not GraphRole.SEGMENT
        if module is _RUNNABLE:
            module = runnable if isinstance(runnable, nn.Module) else None
        self.module: nn.Module | None = module if self.reports else None
        self.per_step_inputs = tuple(per_step_inputs)
        if isinstance(mutated_inputs, str):
            raise TypeError(f"mutated_inputs takes names or a mapping of names, not {mutated_inputs!r}")
        self.mutated_inputs: dict[str, Written | None] | None = (
            None if mutated_inputs is None
            else dict(mutated_inputs) if isinstance(mutated_inputs, Mapping)
            else dict.fromkeys(mutated_inputs)
        )
        self.compared = compared
        self.padding_rewritten = padding_rewritten
        if isinstance(unread, str):
            raise TypeError(f"unread takes names, not {unread!r}")
        self.unread = tuple(unread)
        self.decision: CaptureDecision | None = None
        self._graphs: dict[BatchDescriptor, GraphEntry] = {}
        # id(captured descriptor object) -> entry. Hashing a frozen dataclass costs more than the
        # whole replay guard, so callers that pass the very descriptor object that was captured
        # (as the runner does) skip it. Only captured keys go in, and each entry holds its key,
        # so an id here can never be reused by another object.
        self._by_identity: dict[int, GraphEntry] = {}

    @property
    def graphs(self) -> Mapping[BatchDescriptor, GraphEntry]:
        """What this wrapper holds: descriptor -> captured graph entry (a copy, for inspection)."""
        return dict(self._graphs)

    def lookup(self, descriptor: BatchDescriptor) -> GraphEntry | None:
        """The graph held for ``descriptor``, if any (by identity first, as the replay path does)."""
        entry = self._by_identity.get(id(descriptor))
        if entry is not None and entry.descriptor is descriptor:
            return entry
        return self._graphs.get(descriptor)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.serve(_FORWARD.context, args, kwargs)

    def serve(self, context: ForwardContext | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call under ``context``: the graph held for its descriptor replayed (checked as the
        address-check mode says), captured or run eagerly; with no context, or another mode's, the
        runnable runs. A call serves the current forward context; an engine integration that holds
        its own context per call (the vLLM integration's hook) passes it here instead of making it
        current around the call."""
        if context is None or context.mode is not self.runtime_mode:
            return self.runnable(*args, **kwargs)
        descriptor = context.descriptor
        entry = self._by_identity.get(id(descriptor))
        if entry is None or entry.descriptor is not descriptor:
            entry = self._graphs.get(descriptor)
            if entry is None:
                return self._capture_or_fallback(context, args, kwargs)
        runtime = self.runtime
        check = runtime.address_check
        real = context.num_real_tokens
        if check is not _OFF and (check is _DEBUG or not entry.guard(args, kwargs, real)):
            return self._replay_checked(entry, context, args, kwargs)
        graph = entry.graph
        if entry.runs_pass:
            outputs = graph.run(args, kwargs)
        else:
            graph.replay()
            outputs = graph.outputs
        if self.reports and runtime.replay_observer is not None:  # after the launch: overlaps the graph
            runtime.replay_observer(context.mode, descriptor, real)
        return outputs

    def _replay_checked(
        self, entry: GraphEntry, context: ForwardContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A replay the guard did not wave through: look closer, report, replay (with the canary on
        a sampled replay); in debug mode the outputs go out as views that know this replay."""
        runtime, checks = self.runtime, entry.checks
        debug = runtime.address_check is _DEBUG
        findings, sampled = checks.inspect(args, kwargs, context.num_real_tokens, debug)
        if findings:
            runtime.report_findings(self.name, context.mode, context.descriptor, findings)
        if self.reports and runtime.replay_observer is not None:
            runtime.replay_observer(context.mode, context.descriptor, context.num_real_tokens)
        canary = None
        if sampled and self.reports and self.has_eager_form and (debug or runtime.canary):
            part = None if self.compared is None else functools.partial(self.compared, context=context)
            canary = CanaryRun(checks.layout, checks.mutated, context, args, kwargs, part)
        timer = runtime.step_timer if sampled and self.reports else None
        if timer is None:
            outputs = _replay(entry, args, kwargs)
        else:
            key = (context.mode, context.descriptor)
            outputs = timer.time(StepPath.GRAPH, *key, _replay, entry, args, kwargs)
        if canary is not None:
            canary.replayed()
            try:  # the eager step runs plainly, nested wrappers included
                with use_forward_context(None), torch.no_grad():
                    call = GraphCall(context, canary.eager_args, canary.eager_kwargs)
                    if timer is None:
                        eager = self.source.run_eagerly(call)
                    else:
                        eager = timer.time(
                            StepPath.EAGER, context.mode, context.descriptor, self.source.run_eagerly, call
                        )
            except BaseException:
                canary.put_back()
                raise
            mismatches = canary.compare(outputs, eager)
            if timer is not None:
                timer.collect()  # the comparison read its results back: the events have completed
            if mismatches:
                if runtime.locate_divergence and self.module is not None:
                    self._locate(entry, context, args, kwargs)
                runtime.report_findings(self.name, context.mode, context.descriptor, mismatches)
        if debug and self.reports:  # handed out as views that know this replay (no copies)
            if entry.handouts is None:
                report = functools.partial(runtime.report_findings, self.name, entry.mode, entry.descriptor)
                entry.handouts = Handouts(report)
            outputs = entry.handouts.hand_out(outputs)
        return outputs

    def locate(
        self, descriptor: BatchDescriptor, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        **context: Any,
    ) -> DivergenceEvent:
        """On demand: where ``descriptor``'s graph and the same step run eagerly on these inputs part
        (``capture_core.locate``), told to the observer and returned. ``GraphCacheError`` when no such
        graph is held or the wrapper has no module to look inside."""
        entry = self.lookup(descriptor)
        if entry is None or self.module is None:
            what = "holds no graph for " + descriptor.key if entry is None else "has no module to look inside"
            raise GraphCacheError(f"wrapper {self.name!r} {what}: nothing to locate")
        with set_forward_context(self.runtime_mode, descriptor, **context) as forward:
            assert forward is not None
            return self._locate(entry, forward, tuple(args), dict(kwargs or {}))

    def _locate(
        self, entry: GraphEntry, context: ForwardContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> DivergenceEvent:
        """Find where the graph and its eager step part, and tell the observer (never raises: a
        probe that fails is told as such)."""
        assert self.module is not None
        runtime = self.runtime
        if entry.runs_pass or entry.captured_call is None or not self.has_eager_form:
            why = NOT_PROBED_PASS if entry.runs_pass else NOT_PROBED_ADOPTED
            found = Divergence(None, None, None, (), 0, False, why)
            message = found.probe
        else:
            how = PROBE_GRAPH if runtime.backend_name == "cuda" else PROBE_RERUN
            probe = Probe(self.runnable, self.module, self.name, entry.checks.layout, entry.checks.mutated,
                          context, entry.captured_call, (args, kwargs), self.compared, how)
            try:
                with runtime.capture_lock:
                    found = probe.locate()
                message = found.message
            except Exception as error:  # a diagnosis must never break the engine's step
                found = Divergence(None, None, None, (), 0, False, how)
                first = str(error).splitlines()[0] if str(error) else ""
                message = f"could not locate: {type(error).__name__}: {first}"
        event = DivergenceEvent(
            descriptor=context.descriptor, mode=context.mode, wrapper=self.name, module=found.module,
            max_abs_error=found.max_abs_error, max_rel_error=found.max_rel_error, agreeing=found.agreeing,
            modules_compared=found.modules_compared, reproduced=found.reproduced, probe=found.probe,
            message=message,
        )
        return runtime.report_divergence(event)

    def _capture_or_fallback(
        self, context: ForwardContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        runtime = self.runtime
        with runtime.capture_lock:
            if context.descriptor in self._graphs:  # another thread captured it while this one waited
                return self.serve(context, args, kwargs)
            decision = self.decision or runtime.admit_capture(
                self.name, context.mode, context.descriptor, context.num_real_tokens
            )
            call = GraphCall(context, args, kwargs)
            if decision is CaptureDecision.EAGER:
                if not self.reports:
                    return self.source.run_eagerly(call)
                size = BatchDescriptor(context.descriptor.num_tokens, has_lora=context.descriptor.has_lora,
                                       num_active_loras=context.descriptor.num_active_loras)
                return runtime.run_eager_fallback(size, self.source.run_eagerly, call)
            unexpected = decision is CaptureDecision.CAPTURE_UNEXPECTED
            entry, outputs = self.source.capture(self, call, unexpected)
            entry.captured_call = (args, kwargs)
            self.adopt(entry)
            return outputs

    def adopt(self, entry: GraphEntry) -> GraphEntry:
        """Hold ``entry`` from now on: build what its replays are checked against, keep it under its
        descriptor and tell the observer of its capture. Every capture goes through here; an
        engine that captures its graphs itself (vLLM's ``CudaGraphManager``) hands them over here
        so that their replays are checked and recorded like any other."""
        entry.checks = self._checks_for(entry)
        entry.guard = entry.checks.clean
        self._graphs[entry.descriptor] = entry
        self._by_identity[id(entry.descriptor)] = entry
        if self.reports:
            runtime = self.runtime
            runtime.report_capture(entry.capture_event(self.name, runtime.backend_name, runtime.warmup_iters))
        return entry

    def _checks_for(self, entry: GraphEntry) -> ReplayChecks:
        """What a new graph's replays are checked against, from the inputs its capture recorded."""
        layout = entry.layout
        if entry.per_step is None:  # a pass, or an engine's graph: its snapshot runs before each replay
            entry.per_step = self.per_step_of(layout, entry.mode, entry.descriptor)
            if entry.per_step is not None:
                entry.graph = SnapshotFirst(entry.graph, entry.per_step.snapshot)
        if entry.baked is None:  # no call of its own to compare (a pass, an adopted graph): the module's
            entry.baked = self.baked_of(None)
        try:
            mutated = None if self.mutated_inputs is None else [
                MutatedInput(spec, written)
                for name, written in self.mutated_inputs.items()
                for spec in layout.named([name])
            ]
        except ValueError as exc:
            raise GraphCacheError(f"wrapper {self.name!r}: {exc}") from None
        return ReplayChecks(
            layout,
            check_inputs=self.role is not GraphRole.PASS,
            state=ModuleState(self.module) if self.module is not None else None,
            per_step=entry.per_step,
            mutated=mutated,
            sampling=self.runtime.sampling,
            baked=entry.baked,
        )

    def baked_of(self, call: tuple[Sequence[Any], Mapping[str, Any]] | None) -> BakedValues | None:
        """The host values a graph captured on ``call`` (None: no call of its own) bakes in."""
        if call is None and self.module is None:
            return None
        baked = BakedValues(self.parameter_names, call, self.module, self.unread)
        if baked.unknown:
            raise GraphCacheError(
                f"wrapper {self.name!r}: unread names {', '.join(map(repr, baked.unknown))} pick no "
                "non-tensor argument or module attribute (self.<name>) of the captured call"
            )
        return baked

    def per_step_of(
        self, layout: InputLayout, mode: CUDAGraphMode, descriptor: BatchDescriptor
    ) -> PerStepInputs | None:
        """The per-step inputs of a graph of ``descriptor`` (None: none declared)."""
        try:
            picked = layout.named(self.per_step_inputs)
        except ValueError as exc:
            raise GraphCacheError(f"wrapper {self.name!r}: {exc}") from None
        if not picked:
            return None
        report = functools.partial(self.runtime.report_findings, self.name, mode, descriptor)
        buffers, size = self.runtime.step_buffers, descriptor.num_tokens
        return PerStepInputs(picked, buffers, size, self.padding_rewritten, report)

    def capture(
        self, descriptor: BatchDescriptor, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        **context: Any,
    ) -> GraphEntry | None:
        """Capture ``descriptor``'s graph now, on these inputs, as a call under that forward context
        (``context``: its other fields, such as ``ubatch_slices``) would. Inside the capture phase it
        captures; after the lock it is an unexpected capture like any other: reported, then raised,
        served eagerly (no graph: None) or captured, by policy. Before the phase it is refused."""
        if self.runtime.phase is CapturePhase.BEFORE:
            raise GraphCacheError(
                f"wrapper {self.name!r}: capture() before the capture phase; call it inside "
                "`with runtime.capture_phase():`"
            )
        held = self.lookup(descriptor)
        if held is not None:
            return held
        with set_forward_context(self.runtime_mode, descriptor, **context) as forward:
            assert forward is not None
            self._capture_or_fallback(forward, tuple(args), dict(kwargs or {}))
        return self.lookup(descriptor)

    def capture_entry(
        self,
        call: GraphCall,
        fn: Callable[..., Any],
        unexpected: bool,
        *,
        captured_args: tuple[Sequence[Any], Mapping[str, Any]] | None = None,
        entry_type: type[GraphEntry] = GraphEntry,
        **fields: Any,
    ) -> GraphEntry:
        """Record the call's inputs, capture ``fn`` (on ``captured_args``, by default the call's own
        arguments) with the per-step inputs' snapshot, and build the entry: the part of a capture
        every source shares."""
        runtime = self.runtime
        layout = self.record_inputs(call)
        context = call.context
        per_step = self.per_step_of(layout, context.mode, context.descriptor)
        snapshot = None if per_step is None else per_step.snapshot
        fn_args, fn_kwargs = captured_args if captured_args is not None else (call.args, call.kwargs)
        graph = runtime.backend.capture(fn, fn_args, fn_kwargs, runtime.warmup_iters, prologue=snapshot)
        return entry_type(
            context.descriptor, context.mode, graph, layout, graph.capture_seconds, graph.pool_bytes,
            unexpected, per_step=per_step, baked=self.baked_of((call.args, call.kwargs)), **fields,
        )

    def record_inputs(self, call: GraphCall) -> InputLayout:
        """Every tensor input of the call, named by this wrapper's parameters."""
        return InputLayout.record(self.parameter_names, call.args, call.kwargs)

    def __repr__(self) -> str:
        return (
            f"CUDAGraphWrapper({self.name!r}, mode={self.runtime_mode.name}, "
            f"backend={self.runtime.backend_name}, graphs={len(self._graphs)})"
        )


def _replay(entry: GraphEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Replay ``entry`` for this call: its pass of segment graphs, or its graph into static outputs."""
    graph = entry.graph
    if entry.runs_pass:
        return graph.run(args, kwargs)
    graph.replay()
    return graph.outputs
