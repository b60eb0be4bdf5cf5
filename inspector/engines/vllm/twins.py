"""vLLM's graphs served through capture_core's graph core, so every replay check applies to them.

vLLM captures and replays its own graphs; graph-inspector changes none of that. Each vLLM
``CUDAGraphWrapper`` (the V1 runner's FULL wrapper around the model, and every PIECEWISE piece in
both runners) gets a *twin*: a capture_core ``CUDAGraphWrapper`` whose graph source is the vLLM
wrapper itself. A call the twin has no graph for goes through capture_core's capture admission (so a
capture after vLLM's capture phase is an unexpected capture, reported with its stack) and then to
vLLM, which captures; the twin records the inputs vLLM captured on, the capture's time and the pool
bytes it took. A call it has a graph for runs capture_core's replay checks (the generated guard on
every replay; the closer look on sampled ones) and then vLLM's own replay. The V2 runner's FULL
graphs, which vLLM captures in its ``CudaGraphManager`` and replays without a call, are handed over
with ``CUDAGraphWrapper.adopt`` and checked against the runner's persistent input buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from capture_core.checks import ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError
from capture_core.inputs import InputLayout
from capture_core.modes import CUDAGraphMode
from capture_core.wrapper import CUDAGraphWrapper, GraphCall, GraphEntry
from inspector.watch.pools import allocator_pool_bytes, pool_id

VllmCall = Callable[..., Any]
"""vLLM's own ``CUDAGraphWrapper.__call__`` (or ``run_fullgraph``), as it was before the hooks."""


class EngineGraph:
    """A graph vLLM holds: running it is calling vLLM's own method on its owner with the call's
    arguments (``arguments=False``: with none of them, as ``run_fullgraph(manager, execution)``)."""

    outputs = None
    capture_seconds = 0.0
    pool_bytes = 0

    def __init__(self, call: VllmCall, owner: Any, *fixed: Any, arguments: bool = True) -> None:
        self.call, self.owner, self.fixed, self.arguments = call, owner, fixed, arguments

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if self.arguments:
            return self.call(self.owner, *args, **kwargs)
        return self.call(self.owner, *self.fixed)

    def replay(self) -> None:
        raise GraphCacheError("a vLLM graph is replayed through vLLM (run), never on its own")


@dataclass
class EngineEntry(GraphEntry):
    """One graph vLLM captured, as its twin holds it."""

    runs_pass: ClassVar[bool] = True


class PoolMeter:
    """Bytes a capture added to a graph pool: the pool's reserved segments after, less before."""

    def __init__(self, handle: object) -> None:
        self.pool = pool_id(handle)
        self.before = self.bytes()

    def bytes(self) -> int:
        return 0 if self.pool is None else allocator_pool_bytes(self.pool)

    def grown(self) -> int:
        return max(self.bytes() - self.before, 0)


class WrapperSource:
    """The graph source of a twin of one vLLM ``CUDAGraphWrapper``: vLLM captures, the twin records."""

    def __init__(
        self, vllm_wrapper: Any, vllm_call: VllmCall, names: Callable[[Sequence[Any]], ParameterNames]
    ) -> None:
        self.vllm_wrapper = vllm_wrapper
        self.vllm_call = vllm_call
        self.names = names

    def capture(self, wrapper: CUDAGraphWrapper, call: GraphCall, unexpected: bool) -> tuple[GraphEntry, Any]:
        layout = InputLayout.record(self.names(call.args), call.args, call.kwargs)
        meter = PoolMeter(getattr(self.vllm_wrapper, "graph_pool", None))
        started = time.perf_counter()
        outputs = self.vllm_call(self.vllm_wrapper, *call.args, **call.kwargs)
        seconds = time.perf_counter() - started
        graph = EngineGraph(self.vllm_call, self.vllm_wrapper)
        context = call.context
        entry = EngineEntry(
            context.descriptor, context.mode, graph, layout, seconds, meter.grown(), unexpected
        )
        return entry, outputs

    def run_eagerly(self, call: GraphCall) -> Any:
        return self.vllm_wrapper.runnable(*call.args, **call.kwargs)


class ManagerSource:
    """The graph source of the V2 runner's FULL graphs: vLLM's ``CudaGraphManager`` captures them at
    start-up (they are adopted then), so a call for one it does not hold goes to vLLM as it would:
    vLLM refuses it."""

    has_eager_form = False

    def __init__(self, manager: Any, run_fullgraph: VllmCall, execution: Callable[[BatchDescriptor], Any]):
        self.manager = manager
        self.run_fullgraph = run_fullgraph
        self.execution = execution

    def capture(self, wrapper: CUDAGraphWrapper, call: GraphCall, unexpected: bool) -> tuple[GraphEntry, Any]:
        execution = self.execution(call.context.descriptor)
        outputs = self.run_fullgraph(self.manager, execution)  # vLLM refuses a graph it never captured
        descriptor = call.context.descriptor
        entry = manager_entry(
            self.manager, self.run_fullgraph, execution, descriptor, call.kwargs, 0.0, 0, unexpected
        )
        return entry, outputs

    def run_eagerly(self, call: GraphCall) -> Any:
        raise GraphCacheError("the V2 runner's FULL graphs have no eager form (the canary skips them)")


def manager_entry(
    manager: Any,
    run_fullgraph: VllmCall,
    execution: Any,
    descriptor: BatchDescriptor,
    inputs: Mapping[str, Any],
    capture_seconds: float,
    pool_bytes: int,
    unexpected: bool,
) -> EngineEntry:
    """The entry of one FULL graph the V2 runner's manager captured, on the inputs it reads."""
    layout = InputLayout.record(ParameterNames(), (), dict(inputs))
    graph = EngineGraph(run_fullgraph, manager, execution, arguments=False)
    return EngineEntry(descriptor, CUDAGraphMode.FULL, graph, layout, capture_seconds, pool_bytes, unexpected)
