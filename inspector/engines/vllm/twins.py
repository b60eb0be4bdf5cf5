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

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from capture_core.checks import ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError
from capture_core.forward_context import ForwardContext
from capture_core.inputs import InputLayout
from capture_core.modes import CUDAGraphMode
from capture_core.wrapper import CUDAGraphWrapper, GraphCall, GraphEntry
from inspector.watch.pools import allocator_pool_bytes, pool_id

log = logging.getLogger("graph_inspector.vllm")

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


_ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})
_VIEWS = frozenset({"view", "reshape", "view_as", "unflatten", "flatten", "transpose", "permute", "unsqueeze",
                    "squeeze", "as_strided", "expand"})


def allocated_outputs(runnable: Any) -> frozenset[str]:
    """The outputs (by the canary's names: ``output``, ``output[i]``) a vLLM piece only allocates: a
    ``torch.empty`` buffer (through views) handed on uninitialised for the next op to fill - vLLM's
    attention layer allocates its output in the piece before the attention op, which writes it
    between pieces. Read from the piece's FX graph (vLLM's ``PiecewiseBackend.graph``); none where it
    has none."""
    graph = getattr(getattr(runnable, "graph", None), "graph", None)
    output = next((node for node in getattr(graph, "nodes", ()) if node.op == "output"), None)
    if output is None or not output.args:
        return frozenset()
    values = output.args[0]
    named = ([(f"output[{i}]", v) for i, v in enumerate(values)] if isinstance(values, (tuple, list))
             else [("output", values)])
    found = frozenset(name for name, node in named if _allocated(node))
    if found:
        log.info("the canary leaves out %s of %s: allocated there, written by the next op",
                 ", ".join(sorted(found)), type(runnable).__name__)
    return found


def _allocated(node: Any) -> bool:
    while _target(node) in _VIEWS and node.args:
        node = node.args[0]
    return _target(node) in _ALLOCATIONS


def _target(node: Any) -> str:
    """The op a graph node calls, by its short name (``torch.empty``, ``aten.empty.memory_format`` and
    the ``empty`` method all give ``empty``); "" for anything else."""
    if getattr(node, "op", None) not in ("call_function", "call_method"):
        return ""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.split(".")[0]


class ComparedPart:
    """What the canary compares of a vLLM graph's output: the rows of the step's real tokens (the rows
    of padding tokens hold whatever the graph's memory held: vLLM's kernels leave them unwritten or
    compute them from stale inputs, so a replay and an eager run may differ there and mean nothing),
    and nothing of an output the graph only allocated (``allocated``: its values are whatever memory
    the allocator handed over, in the replay's pool and in the eager run alike)."""

    def __init__(self, allocated: frozenset[str] = frozenset()) -> None:
        self.allocated = allocated

    def __call__(self, name: str, tensor: Any, context: ForwardContext) -> Any:
        if not getattr(tensor, "dim", None) or not tensor.dim():
            return tensor
        if name in self.allocated:
            return tensor[:0]
        if tensor.shape[0] == context.descriptor.num_tokens:
            return tensor[: context.num_real_tokens]
        return tensor
