"""One vLLM worker process's recording: its recorder, the runtime its graphs' twins share, its steps.

The process that builds a model runner records (vLLM loads its plugins in every process it starts;
only a worker holds graphs). What is recorded comes from vLLM's own decisions:

- each step, once, from the runner's dispatch (V1: ``_determine_batch_execution_and_padding``, the
  call that also builds vLLM's ``CUDAGraphStat``; V2: ``dispatch_cg_and_sync_dp``): a replay of the
  padded descriptor with the step's unpadded token count, or an eager step with its reason, exactly
  the figures vLLM's ``--cudagraph-metrics`` table counts (padding waste and hit ratio follow);
- each graph vLLM captures, keyed by its own descriptor: FULL graphs one by one, a PIECEWISE
  descriptor's pieces (one graph per piece, captured in order within one forward) gathered into one
  graph of N segments, with the time each capture took and the bytes it added to the graph pool;
  the graphs the V1 runner captures only to measure their memory and throws away are marked so;
- any capture after ``capture_model`` returned, as an unexpected capture (then vLLM does what it
  does: it refuses);
- the configuration (capture sizes, mode, limits) on the run.

Dummy runs (profiling, warm-up, capture) are not steps and are not counted.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from capture_core.backends import CapturedGraph, GraphBackend
from capture_core.checks import AddressCheckMode, ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError
from capture_core.events import CaptureEvent, NullObserver, ViolationEvent
from capture_core.forward_context import ForwardContext
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper
from inspector.engines.vllm.mapping import (
    config_of,
    descriptor_of,
    descriptor_of_execution,
    eager_reason,
    mode_of,
)
from inspector.engines.vllm.twins import (
    ComparedPart,
    ManagerSource,
    VllmCall,
    WrapperSource,
    allocated_outputs,
    manager_entry,
)
from inspector.engines.vllm.version import vllm_version

log = logging.getLogger("graph_inspector.vllm")

CANARY_ENV = "GRAPH_INSPECTOR_CANARY"
"""Set to 1 to run the replay-vs-eager canary on vLLM's sampled replays (its graphs with an eager form:
the V1 runner's FULL graphs and every PIECEWISE piece)."""
CHECKS_ENV = "GRAPH_INSPECTOR_CHECKS"
"""``always_on`` (the default): every replay of vLLM's graphs checked; ``off``: vLLM's graphs, steps and
padding recorded, their replays not checked (on the H200, a host-bound tiny model served 0.977 of its
tokens/s with the checks on and 0.991 recording only, each on identical work: BENCHMARKS.md, "vLLM");
``debug``: every check on every replay, the canary too (each replay of a graph with an eager form is
run again eagerly and compared), and the first finding raises inside vLLM's forward: for a test run or
a bisection, not for serving."""
CHECK_MODES = ("always_on", "off", "debug")
WINDOW_ENV = "GRAPH_INSPECTOR_WINDOW"
"""Seconds of one replay window: how often the recorder writes what vLLM's graphs did. By default vLLM's
own stats interval (``VLLM_LOG_STATS_INTERVAL``, 10 s unless set: how often vLLM logs its
``--cudagraph-metrics`` table). Each write holds the GIL beside vLLM's serving thread: on the trace's
traffic the recorder's thread took 0.9% of every second at 1 s windows and 0.13% at 10 s, on a CPU VM
(BENCHMARKS.md, "The ninth session"). At most ``MAX_WINDOW_S``."""
VLLM_STATS_INTERVAL = 10.0
"""vLLM's default ``VLLM_LOG_STATS_INTERVAL``, seconds."""
MAX_WINDOW_S = 30.0
"""The longest replay window: a run is shown live while it wrote within the last minute
(``inspector.reading.metrics.LIVE_AFTER_S``), so a longer one would show a serving vLLM as stale."""
_UNCHECKED = AddressCheckMode.OFF
_MAX_CONTEXTS = 4096
"""Descriptors and FULL contexts held by identity at most (each map is emptied when full)."""


class V2Step:
    """One V2 replay decision as recorded: vLLM's execution descriptor (held, so its id is not
    reused), the recorder's counter it bumps, the FULL replay's context and the FULL twin's entry for
    it (None for PIECEWISE, or a graph the twin does not hold), and whether every twin holds its
    graphs (then, with the checks off, the step's graph calls need nothing of them)."""

    __slots__ = ("captured", "cell", "context", "entry", "execution")

    def __init__(self, execution: Any, cell: list[int], context: ForwardContext | None, entry: Any,
                 captured: bool) -> None:
        self.execution, self.cell, self.context = execution, cell, context
        self.entry, self.captured = entry, captured


class EngineBackend(GraphBackend):
    """The backend of graphs the engine captures itself: real CUDA graphs, never captured here."""

    name = "cuda"

    def record(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any, started: float
    ) -> CapturedGraph:
        raise GraphCacheError("vLLM captures its own graphs; graph-inspector only records and checks them")


class _TwinObserver(NullObserver):
    """What the twins tell: captures (gathered by the session) and violations; never replays, which
    the session counts once per step from vLLM's dispatch."""

    def __init__(self, session: VllmSession) -> None:
        self.session = session

    def on_capture(self, event: CaptureEvent) -> None:
        self.session.graph_captured(event)

    def on_violation(self, event: ViolationEvent) -> None:
        self.session.violation(event)


class VllmSession:
    """The recording of one vLLM worker process (created by ``hooks.install``)."""

    def __init__(self, url: str, vllm_call: VllmCall, run_fullgraph: VllmCall | None) -> None:
        self.url = url
        self.vllm_call = vllm_call
        self.run_fullgraph = run_fullgraph
        self.recorder: Any = None
        self.runtime: GraphRuntime | None = None
        self.runner: Any = None
        self.runner_kind = ""
        self.configured = CUDAGraphMode.NONE
        self.max_capture_size: int | None = None
        self.dummy_depth = 0
        """Inside a dummy run (profiling, warm-up, capture): its dispatches are not steps."""
        self.profiling = False
        """Inside the V1 runner's CUDA-graph memory profiling: its graphs are thrown away."""
        self.step_tokens = 0
        """The current step's unpadded token count (for the forward context the twins read)."""
        self.plain = False
        """The current step's graph calls need nothing of the integration, so its hooks call vLLM's
        method at once: an eager step (vLLM's wrappers run their piece as it is), or, with the checks
        off, a replay of a descriptor whose graphs every twin holds (the step is recorded at its
        dispatch). Set by each step's dispatch; never inside a dummy run."""
        self._captured: set[tuple[CUDAGraphMode, BatchDescriptor]] = set()
        """(mode, descriptor) of every graph captured and not thrown away (a PIECEWISE one once all
        its pieces are)."""
        self._eager: dict[tuple[int, bool, bool], list[int]] = {}
        """(tokens, uniform, forced) -> the recorder's counter of such eager steps (their reason
        follows from these alone)."""
        self._lock = threading.Lock()
        self._phase: Any = None
        self._pieces: dict[tuple[CUDAGraphMode, BatchDescriptor], list[tuple[int, CaptureEvent]]] = {}
        self._piece_of: dict[str, tuple[int, int]] = {}
        self._descriptors: dict[Any, BatchDescriptor] = {}
        """vLLM's descriptor (either kind) -> graph-inspector's."""
        self._by_id: dict[int, tuple[Any, BatchDescriptor]] = {}
        """id(vLLM's descriptor) -> (it, graph-inspector's): held, so an id cannot be reused."""
        self._canonical: dict[BatchDescriptor, BatchDescriptor] = {}
        """One object per key: the twins find their graph by the descriptor's identity first."""
        self._context_key: Any = None
        self._context: ForwardContext | None = None
        self.v2_steps: dict[tuple[int, int], V2Step] = {}
        """(id of a V2 execution descriptor, the step's tokens) -> the step as recorded: what the V2
        dispatch hook needs for a decision it saw before (one lookup, one integer bump)."""
        self.last_v2_step: V2Step | None = None
        """The current V2 step, when it replays a descriptor seen before (its FULL context ready)."""
        self._full_contexts: dict[tuple[int, int], tuple[Any, ForwardContext]] = {}
        """(id of a V2 execution descriptor, real tokens) -> (that descriptor, its FULL context): the
        descriptor held, so its id cannot be reused while the entry lives."""
        self._parameter_names: dict[int, str] = {}
        self.full_twin: CUDAGraphWrapper | None = None
        self.full_manager: Any = None
        """The V2 ``CudaGraphManager`` whose FULL graphs the FULL twin holds: the model's (a speculator's
        managers replay their own graphs through the same ``run_fullgraph``, and those go to vLLM)."""
        self.twins: list[CUDAGraphWrapper] = []
        """Every twin made, the FULL twin among them (what ``looks`` reads)."""
        self._adopting: Any = None
        """The V2 execution descriptor of the FULL graph being handed to the FULL twin."""
        self._executions: dict[BatchDescriptor, Any] = {}
        self._closed = False

    # ------------------------------------------------------------------ start and stop

    def attach(self, runner: Any, kind: str) -> None:
        """Start recording for the first model runner this process builds."""
        with self._lock:
            if self.recorder is not None:
                return
            from inspector import Recorder

            config = runner.vllm_config
            compilation = config.compilation_config
            version = vllm_version() or "unknown"
            parallel = config.parallel_config
            self.runner, self.runner_kind = runner, kind
            self.configured = mode_of(compilation.cudagraph_mode)
            self.max_capture_size = compilation.max_cudagraph_capture_size
            self.runtime = GraphRuntime(
                EngineBackend(), address_check=_checks(), unexpected_capture="engine",
                warmup_iters=int(compilation.cudagraph_num_of_warmups), observer=_TwinObserver(self),
                progress=False, canary=_flag(CANARY_ENV),
            )
            self._phase = self.runtime.capture_phase()
            self._phase.__enter__()
            recorder = Recorder(
                self.url, label=f"vLLM {version} ({kind} model runner)", flush_interval=_window(),
                config=config_of(config, kind, version),
                rank=int(getattr(parallel, "rank", 0) or 0),
                world_size=int(getattr(parallel, "world_size", 1) or 1),
                device=str(getattr(runner, "device", "")),
            )
            recorder.start()
            self.recorder = recorder
            atexit.register(self.close)
            log.info("recording vLLM %s (%s model runner) into %s", version, kind, recorder.url)

    def capture_finished(self) -> None:
        """vLLM's ``capture_model`` returned: capture is over, later captures are unexpected."""
        self._flush_pieces()
        if self._phase is not None:
            phase, self._phase = self._phase, None
            phase.__exit__(None, None, None)

    def close(self) -> None:
        """Write what is left (at exit, or when vLLM shuts its worker down)."""
        if self._closed or self.recorder is None:
            return
        self._closed = True
        self._flush_pieces()
        self.recorder.close()

    # ------------------------------------------------------------------ steps

    def descriptor(self, vllm_descriptor: Any, execution: bool = False) -> BatchDescriptor:
        """graph-inspector's descriptor for one of vLLM's, the same object every time for the same key
        (so the twins find their graph by identity). Looked up by the object's identity first: the
        step's dispatch and its forward share one object, and the V2 runner hands over the same
        object for a size every step, while vLLM's frozen dataclasses hash in Python."""
        seen = self._by_id.get(id(vllm_descriptor))
        if seen is not None and seen[0] is vllm_descriptor:
            return seen[1]
        found = self._descriptors.get(vllm_descriptor)
        if found is None:
            made = descriptor_of_execution(vllm_descriptor) if execution else descriptor_of(vllm_descriptor)
            found = self._canonical.setdefault(made, made)
            self._descriptors[vllm_descriptor] = found
            if execution:
                self._executions.setdefault(found, vllm_descriptor)
        if len(self._by_id) >= _MAX_CONTEXTS:  # the V1 runner makes a new object every step
            self._by_id.clear()
        self._by_id[id(vllm_descriptor)] = (vllm_descriptor, found)
        return found

    def step(self, vllm_mode: Any, vllm_descriptor: Any, num_tokens: int, uniform: bool, *,
             execution: bool = False, forced: bool = False) -> None:
        """One step's decision: replayed as ``vllm_descriptor`` in ``vllm_mode``, or run eagerly. A V2
        replay (``execution``) is kept in ``v2_steps``, so the same decision later costs its hook one
        lookup."""
        recorder = self.recorder
        if recorder is None or self.dummy_depth:
            return
        self.step_tokens = num_tokens
        self.last_v2_step = None
        mode = mode_of(vllm_mode)
        if mode is CUDAGraphMode.NONE:
            self.eager_step(num_tokens, uniform, forced)
            return
        descriptor = self.descriptor(vllm_descriptor, execution)
        captured = (mode, descriptor) in self._captured
        self.plain = captured and self.unchecked()
        cell = recorder.replay_cell(mode, descriptor, num_tokens) if execution else None
        if cell is None:
            recorder.on_replay(mode, descriptor, num_tokens)
            return
        cell[0] += 1
        context = entry = None
        if mode is CUDAGraphMode.FULL:
            context = self.full_context(vllm_descriptor)
            entry = self.full_twin.lookup(descriptor) if self.full_twin is not None else None
        if len(self.v2_steps) >= _MAX_CONTEXTS:
            self.v2_steps.clear()
        known = V2Step(vllm_descriptor, cell, context, entry, captured)
        self.last_v2_step = self.v2_steps[id(vllm_descriptor), num_tokens] = known

    def unchecked(self) -> bool:
        """Whether the replay checks are off now (a benchmark may switch them between steps)."""
        runtime = self.runtime
        return runtime is not None and runtime.address_check is _UNCHECKED

    def eager_step(self, num_tokens: int, uniform: bool, forced: bool) -> None:
        """One eager step, counted under its reason (worked out once per tokens, uniformity and
        whether vLLM was told to run eagerly); its graph calls go straight to vLLM."""
        self.step_tokens = num_tokens
        self.last_v2_step = None
        self.plain = True
        recorder = self.recorder
        if recorder is None:  # a benchmark's level with the hooks in place and nothing recorded
            return
        key = (num_tokens, uniform, forced)
        cell = self._eager.get(key)
        if cell is None:
            reason, would_be = eager_reason(num_tokens, uniform, self.configured, self.max_capture_size,
                                            forced=forced)
            cell = recorder.eager_cell(reason, num_tokens, would_be)
            if cell is None:  # the order of steps is kept too: every step through the recorder
                recorder.on_eager(reason, num_tokens, would_be)
                return
            if len(self._eager) >= _MAX_CONTEXTS:
                self._eager.clear()
            self._eager[key] = cell
        cell[0] += 1

    def forget_captures(self) -> None:
        """vLLM threw graphs away: what was known of them (captured, decisions seen) is forgotten, so
        the next steps go the whole way through the twins until their graphs are captured again."""
        self._captured.clear()
        self.v2_steps.clear()
        self.last_v2_step = None
        self.plain = False

    def context(self, forward_context: Any) -> ForwardContext:
        """capture_core's forward context for vLLM's current one (built once per forward)."""
        if forward_context is self._context_key and self._context is not None:
            return self._context
        descriptor = self.descriptor(forward_context.batch_descriptor)
        real = descriptor.num_tokens if self.dummy_depth else min(self.step_tokens, descriptor.num_tokens)
        self._context = ForwardContext(mode_of(forward_context.cudagraph_runtime_mode), descriptor, real or 1)
        self._context_key = forward_context
        return self._context

    def full_context(self, execution: Any) -> ForwardContext:
        """The context of a V2 FULL replay (the V2 runner replays FULL graphs without vLLM's), made
        once per execution descriptor and real token count."""
        key = (id(execution), self.step_tokens)
        found = self._full_contexts.get(key)
        if found is not None and found[0] is execution:
            return found[1]
        descriptor = self.descriptor(execution, execution=True)
        real = min(self.step_tokens, descriptor.num_tokens) or 1
        context = ForwardContext(CUDAGraphMode.FULL, descriptor, real)
        if len(self._full_contexts) >= _MAX_CONTEXTS:
            self._full_contexts.clear()
        self._full_contexts[key] = (execution, context)
        return context

    # ------------------------------------------------------------------ graphs

    def twin(self, vllm_wrapper: Any) -> CUDAGraphWrapper:
        """The twin of one vLLM ``CUDAGraphWrapper`` (made on its first graph call)."""
        assert self.runtime is not None
        runnable = vllm_wrapper.runnable
        mode = mode_of(vllm_wrapper.runtime_mode)
        index = getattr(runnable, "piecewise_compile_index", None)
        total = getattr(runnable, "total_piecewise_compiles", None)
        pieces = isinstance(index, int) and isinstance(total, int) and total > 1
        if mode is CUDAGraphMode.PIECEWISE and pieces:
            name = f"vLLM PIECEWISE piece {index + 1}/{total}"
            self._piece_of[name] = (index, total)
        else:
            name = f"vLLM {mode.name} {type(runnable).__name__}"
        module = runnable if _is_module(runnable) else None
        twin = CUDAGraphWrapper(
            runnable, self.runtime, mode, name,
            source=WrapperSource(vllm_wrapper, self.vllm_call, self.input_names), module=module,
            compared=ComparedPart(allocated_outputs(runnable)),
        )
        vllm_wrapper.__dict__["_graph_inspector_twin"] = twin
        self.twins.append(twin)
        return twin

    def input_names(self, args: Sequence[Any]) -> ParameterNames:
        """A piece's positional inputs named: a weight by its parameter's name, others by position."""
        names = self._parameter_names
        if any(id(value) not in names for value in args if _is_parameter(value)):
            names = self._parameter_names = _parameter_names(self.runner)  # a capture: rare
        return ParameterNames(tuple(names.get(id(value), f"args[{i}]") for i, value in enumerate(args)))

    def adopt_full(self, manager: Any, execution: Any, inputs: dict[str, Any], seconds: float,
                   pool_bytes: int) -> None:
        """A FULL graph the V2 runner's ``CudaGraphManager`` just captured, handed to the FULL twin."""
        assert self.runtime is not None and self.run_fullgraph is not None
        if self.full_twin is None:
            self.full_manager = manager
            model = getattr(self.runner, "model", None)
            self.full_twin = CUDAGraphWrapper(
                _model_call, self.runtime, CUDAGraphMode.FULL, "vLLM FULL CudaGraphManager",
                source=ManagerSource(manager, self.run_fullgraph, self._executions.__getitem__),
                module=model if _is_module(model) else None,
            )
            self.twins.append(self.full_twin)
        descriptor = self.descriptor(execution, execution=True)
        twin, unexpected = self.full_twin, self.runtime.locked
        if unexpected:
            self.runtime.admit_capture(twin.name, CUDAGraphMode.FULL, descriptor, descriptor.num_tokens)
        entry = manager_entry(manager, self.run_fullgraph, execution, descriptor, inputs, seconds, pool_bytes,
                              unexpected)
        self._adopting = execution
        try:
            twin.adopt(entry)
        finally:
            self._adopting = None
        self.v2_steps.clear()  # a decision seen before holds the entry this one replaces

    def graph_captured(self, event: CaptureEvent) -> None:
        """A twin's capture, with vLLM's own key for it and whether vLLM captured it only to measure
        memory: a FULL graph goes to the recorder; a piece waits for its descriptor's other pieces
        (vLLM captures them in order within one forward)."""
        key = self._adopting if self._adopting is not None else self._context_key.batch_descriptor
        event = replace(event, engine_key=repr(key), discarded=self.profiling)
        piece = self._piece_of.get(event.wrapper)
        if piece is None:
            self.recorder.on_capture(event)
            if not event.discarded:
                self._captured.add((event.mode, event.descriptor))
            return
        index, total = piece
        key = (event.mode, event.descriptor)
        parts = self._pieces.setdefault(key, [])
        parts.append((index, event))
        if len(parts) == total:
            del self._pieces[key]
            self.recorder.on_capture(_pieces_as_one(parts, total))
            if not event.discarded:
                self._captured.add(key)

    def _flush_pieces(self) -> None:
        pending, self._pieces = self._pieces, {}
        for parts in pending.values():
            self.recorder.on_capture(_pieces_as_one(parts, max(i for i, _ in parts) + 1))

    def looks(self) -> list[dict[str, Any]]:
        """Per twin: its graphs' replays and how many had the closer look (sampled ones, and those
        the replay guard did not wave through: many more than sampled means the guard misses)."""
        found = []
        for twin in self.twins:
            checks = [entry.checks for entry in twin.graphs.values()]
            found.append({"wrapper": twin.name, "graphs": len(checks),
                          "replays": sum(c.replays for c in checks), "looks": sum(c.looks for c in checks)})
        return found

    def violation(self, event: ViolationEvent) -> None:
        if self.recorder is not None:
            self.recorder.on_violation(event)


def _checks() -> str:
    """The replay checks ``GRAPH_INSPECTOR_CHECKS`` asks for; anything else is said once, and checked."""
    value = os.environ.get(CHECKS_ENV, "").strip().lower() or "always_on"
    if value not in CHECK_MODES:
        log.warning("%s=%r is none of %s: the checks stay always_on", CHECKS_ENV, value,
                    ", ".join(CHECK_MODES))
        return "always_on"
    return value


def _window() -> float:
    """The replay window ``GRAPH_INSPECTOR_WINDOW`` asks for, else vLLM's stats interval, at most
    ``MAX_WINDOW_S``; a value that is no number of seconds in (0, 30] is said, and the default kept."""
    default = min(_vllm_stats_interval(), MAX_WINDOW_S)
    value = os.environ.get(WINDOW_ENV, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_WINDOW_S:  # nan and inf fail it too
        log.warning("%s=%r is not a number of seconds in (0, %g]: the replay window stays %g s", WINDOW_ENV,
                    value, MAX_WINDOW_S, default)
        return default
    return seconds


def _vllm_stats_interval() -> float:
    """vLLM's ``VLLM_LOG_STATS_INTERVAL`` as vLLM reads it (10 s where it is unset or not positive)."""
    try:
        from vllm import envs

        return float(envs.VLLM_LOG_STATS_INTERVAL)
    except (ImportError, AttributeError, ValueError):  # no vLLM here, or a value vLLM cannot read either
        return VLLM_STATS_INTERVAL


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _model_call(*args: Any, **kwargs: Any) -> Any:
    raise GraphCacheError("the V2 runner's FULL graphs are replayed by vLLM, not called")


def _is_parameter(value: Any) -> bool:
    import torch

    return isinstance(value, torch.nn.Parameter)


def _is_module(value: Any) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)


def _parameter_names(runner: Any) -> dict[int, str]:
    """id(parameter or buffer) -> its name in the runner's model (the pieces receive them as inputs)."""
    model = getattr(runner, "model", None)
    model = getattr(model, "runnable", model)  # the V1 runner's FULL wrapper holds the model
    if not _is_module(model):
        return {}
    names = {id(p): name for name, p in model.named_parameters()}
    names.update({id(b): name for name, b in model.named_buffers()})
    return names


def _pieces_as_one(parts: list[tuple[int, CaptureEvent]], total: int) -> CaptureEvent:
    """A PIECEWISE descriptor's pieces as one graph of ``total`` segments: their inputs (``piece<i>.``),
    capture times and pool bytes summed, unexpected when any was."""
    parts = sorted(parts, key=lambda p: p[0])
    first = parts[0][1]
    return CaptureEvent(
        descriptor=first.descriptor, mode=first.mode, backend=first.backend,
        wrapper=f"vLLM PIECEWISE ({total} pieces)",
        input_names=tuple(f"piece{i + 1}.{n}" for i, e in parts for n in e.input_names),
        input_addresses=tuple(a for _, e in parts for a in e.input_addresses),
        capture_seconds=sum(e.capture_seconds for _, e in parts),
        pool_bytes=sum(e.pool_bytes for _, e in parts),
        warmup_iters=first.warmup_iters, num_segments=total,
        unexpected=any(e.unexpected for _, e in parts), captured_at=first.captured_at,
        unchecked_inputs=tuple(f"piece{i + 1}.{n}" for i, e in parts for n in e.unchecked_inputs),
        engine_key=first.engine_key, discarded=first.discarded,
    )
