"""Piecewise (breakable) CUDA graphs: capture everything but attention.

A mixed prefill/decode batch has attention shapes that vary with every batch, so one graph cannot
serve it. vLLM's answer, followed here: the model marks its attention modules as break points
(:func:`attention_boundary`), the model is split at those calls (``torch.fx`` tracing, break points
kept as opaque leaves), and the pieces between them - the *segments* - are each served by an
ordinary ``CUDAGraphWrapper`` in PIECEWISE mode. One forward pass replays segment, runs attention
eagerly, replays the next segment, and so on.

:class:`PiecewiseGraph` keys all of a pass's segment graphs by one descriptor (``num_tokens``,
``num_reqs=None``) and speaks for them, through the same graph-serving core as every other graph:
the capture guard is asked once per descriptor, the observer sees one capture (with
``num_segments`` and the segments' summed pool memory) and one replay per pass, while every
segment's inputs, positional and keyword, are checked at each replay and a violation names the
segment and the input.

A break point must not return a tensor the next segment reads: it fills an output buffer that
the code before it allocated. That buffer is then an output of the previous segment, so it lives
at a fixed address in the graph pool and the next segment's address check holds.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from torch import fx, nn
from torch.fx.passes.split_module import split_module

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import CaptureDecision, GraphRuntime
from capture_core.wrapper import (
    CanaryPart,
    CUDAGraphWrapper,
    GraphCall,
    GraphEntry,
    GraphRole,
    MutatedInputs,
)

_BREAK_ATTR = "_graph_inspector_break_point"
_PIECEWISE = CUDAGraphMode.PIECEWISE

ModuleType = TypeVar("ModuleType", bound=type[nn.Module])


def attention_boundary(module_class: ModuleType) -> ModuleType:
    """Class decorator: calls to modules of this class are graph break points.

    The module runs eagerly between graph segments, so it may have data-dependent shapes and host
    logic. It must not return a tensor the next segment reads: it fills an output buffer that the
    code before it allocated (which then lives at a fixed address inside the previous segment).
    """
    setattr(module_class, _BREAK_ATTR, True)
    return module_class


def is_break_point(module: nn.Module) -> bool:
    """True for modules whose class was marked with :func:`attention_boundary`."""
    return bool(getattr(type(module), _BREAK_ATTR, False))


def _holds_break_point(module: nn.Module) -> bool:
    return any(is_break_point(m) for m in module.modules())


class _BreakPointTracer(fx.Tracer):
    """Traces down to the break points and no further.

    A submodule with no break point inside stays one opaque call (its weights stay inside it,
    instead of becoming inputs of the segment); break points are opaque calls of their own.
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_break_point(m) or not _holds_break_point(m)


@dataclass(frozen=True)
class SplitModel:
    """A model cut at its break points: the top-level module and which children are what."""

    module: fx.GraphModule
    segment_names: tuple[str, ...]
    """Children of ``module`` that run as graph segments, in call order."""
    break_names: tuple[str, ...]
    """Children of ``module`` that are break points (run eagerly), in call order."""


def split_at_break_points(model: nn.Module) -> SplitModel:
    """Trace ``model`` with ``torch.fx`` and cut it before and after every break-point call."""
    if not _holds_break_point(model) or is_break_point(model):
        raise ValueError(
            f"{type(model).__name__} has no break points: mark its attention module class with "
            "@capture_core.piecewise.attention_boundary (or capture it as one FULL graph)"
        )
    try:
        graph = _BreakPointTracer().trace(model)
    except Exception as exc:  # fx raises many types; the caller needs to know what to change
        raise ValueError(
            f"cannot split {type(model).__name__} into piecewise graphs: torch.fx could not trace it "
            f"({type(exc).__name__}: {exc}). Keep data-dependent Python control flow inside the "
            "break-point modules."
        ) from exc
    traced = fx.GraphModule(model, _name_break_point_inputs(model, graph))
    partition_of: dict[fx.Node, int] = {}
    breaks: set[int] = set()
    partition = 0
    for node in traced.graph.nodes:
        if node.op == "call_module" and is_break_point(traced.get_submodule(node.target)):
            partition += 1
            partition_of[node] = partition
            breaks.add(partition)
            partition += 1
        else:
            partition_of[node] = partition
    split = split_module(traced, model, partition_of.__getitem__, keep_original_order=True)
    called = [n.target for n in split.graph.nodes if n.op == "call_module"]
    break_names = tuple(name for name in called if int(name.rsplit("_", 1)[1]) in breaks)
    segment_names = tuple(name for name in called if name not in break_names)
    return SplitModel(split, segment_names, break_names)


def _name_break_point_inputs(model: nn.Module, graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose values fed to a break point are named after its parameters.

    A segment's inputs are named after the graph values they carry, and those names reach capture
    events and the dashboard: ``layers_0_attn_out`` (the attention output buffer of layer 0) says
    what ``new_empty`` does not.
    """
    wanted: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op != "call_module" or not is_break_point(model.get_submodule(node.target)):
            continue
        params = inspect.signature(model.get_submodule(node.target).forward).parameters
        bound = [*zip(params, node.args, strict=False), *node.kwargs.items()]
        prefix = node.target.replace(".", "_")
        for param, value in bound:
            if isinstance(value, fx.Node) and value.op not in ("placeholder", "get_attr"):
                wanted.setdefault(value, f"{prefix}_{param}")
    renamed = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in wanted:
            args = fx.map_arg(node.args, copies.__getitem__)
            kwargs = fx.map_arg(node.kwargs, copies.__getitem__)
            copy = renamed.create_node(node.op, node.target, args, kwargs, wanted[node], node.type)
            copy.meta = dict(node.meta)
        else:
            copy = renamed.node_copy(node, copies.__getitem__)
        copies[node] = copy
    return renamed


class _SegmentPass:
    """The "graph" of a piecewise entry: the split model, whose segment wrappers replay their graphs
    for the pass's descriptor while the break points run eagerly between them."""

    pool_bytes = 0

    def __init__(self, module: fx.GraphModule, capture_seconds: float) -> None:
        self.module = module
        self.capture_seconds = capture_seconds
        self.outputs = None

    def run(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        return self.module(*args, **kwargs)


@dataclass
class PiecewiseEntry(GraphEntry):
    """One piecewise graph: the segment graphs captured for one descriptor, replayed as one pass."""

    segments: tuple[GraphEntry, ...] = ()

    runs_pass: ClassVar[bool] = True

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def input_names(self) -> tuple[str, ...]:
        """Every segment's inputs, named ``segment<i>.<input>``."""
        return tuple(
            f"segment{index}.{name}" for index, seg in enumerate(self.segments) for name in seg.input_names
        )

    @property
    def input_addresses(self) -> tuple[int, ...]:
        return tuple(address for seg in self.segments for address in seg.input_addresses)

    def capture_event(self, wrapper: str, backend: str, warmup_iters: int) -> CaptureEvent:
        return dataclasses.replace(
            super().capture_event(wrapper, backend, warmup_iters), num_segments=self.num_segments
        )


class PiecewiseGraph:
    """Serve a model from piecewise graphs: graph segments with eager attention between them.

    ``PiecewiseGraph(model, runtime)`` is called like the model. Under a forward context whose
    mode is PIECEWISE it replays (or, on first use in the capture phase, captures) the segments
    for the context's descriptor; under any other mode or outside a context it calls the model
    itself, so a FULL wrapper around it captures the whole model for decode batches.

    One graph-serving core (``CUDAGraphWrapper``) serves the pass, with this object as its graph
    source: the capture guard is asked once per descriptor and the observer sees one capture (with
    ``num_segments`` and the segments' summed pool memory) and one replay per pass; the pass checks
    the model's parameters and buffers, the declared ``per_step_inputs`` and runs the canary. Each
    segment is a core of its own that speaks to no observer (the pass does) and captures on the
    pass's decision; its inputs are checked at every replay, and a violation names the segment and
    the input.
    """

    def __init__(
        self,
        model: nn.Module,
        runtime: GraphRuntime,
        name: str | None = None,
        *,
        per_step_inputs: Sequence[str] = (),
        mutated_inputs: MutatedInputs = None,
        compared: CanaryPart | None = None,
    ) -> None:
        self.model = model
        self.runtime = runtime
        self.name = name or f"{type(model).__name__}.piecewise"
        self.split = split_at_break_points(model)
        # A FULL wrapper around this object names its inputs by the model's parameters.
        self.__signature__ = inspect.signature(model.forward)
        self.segments: list[CUDAGraphWrapper] = []
        for index, child in enumerate(self.split.segment_names):
            wrapper = CUDAGraphWrapper(
                getattr(self.split.module, child), runtime, _PIECEWISE,
                name=f"{self.name}/segment{index}", role=GraphRole.SEGMENT,
            )
            setattr(self.split.module, child, _WrappedSegment(wrapper))
            self.segments.append(wrapper)
        self.core = CUDAGraphWrapper(
            model, runtime, _PIECEWISE, name=self.name, source=self, role=GraphRole.PASS,
            per_step_inputs=per_step_inputs, mutated_inputs=mutated_inputs, compared=compared,
        )

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_break_points(self) -> int:
        return len(self.split.break_names)

    @property
    def graphs(self) -> Mapping[BatchDescriptor, GraphEntry]:
        """What this piecewise graph holds: descriptor -> its ``PiecewiseEntry`` (read-only view)."""
        return self.core.graphs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.core(*args, **kwargs)

    def run_eagerly(self, call: GraphCall) -> Any:
        return self.model(*call.args, **call.kwargs)

    def capture(self, wrapper: CUDAGraphWrapper, call: GraphCall, unexpected: bool) -> tuple[GraphEntry, Any]:
        """The core's capture of one pass: every segment captures its graph on the pass's decision."""
        decision = CaptureDecision.CAPTURE_UNEXPECTED if unexpected else CaptureDecision.CAPTURE
        for segment in self.segments:
            segment.decision = decision
        start = time.perf_counter()
        try:
            outputs = self.split.module(*call.args, **call.kwargs)
        finally:
            for segment in self.segments:
                segment.decision = None
        seconds = time.perf_counter() - start
        descriptor = call.context.descriptor
        segments = tuple(segment.lookup(descriptor) for segment in self.segments)
        missing = [w.name for w, seg in zip(self.segments, segments, strict=True) if seg is None]
        if missing:
            raise RuntimeError(
                f"{self.name}: no graph for {descriptor.key} in {', '.join(missing)} after a capturing "
                "pass; every segment must run once per forward pass"
            )
        held = tuple(seg for seg in segments if seg is not None)
        entry = PiecewiseEntry(
            descriptor, _PIECEWISE, _SegmentPass(self.split.module, seconds), wrapper.record_inputs(call),
            seconds, sum(seg.pool_bytes for seg in held), unexpected, segments=held,
            baked=wrapper.baked_of((call.args, call.kwargs)),
        )
        return entry, outputs

    def __repr__(self) -> str:
        return (
            f"PiecewiseGraph({self.name!r}, segments={self.num_segments}, "
            f"break_points={self.num_break_points}, backend={self.runtime.backend_name}, "
            f"graphs={len(self.core.graphs)})"
        )


class _WrappedSegment(nn.Module):
    """Puts a segment's graph wrapper where the split model calls the segment.

    The split model is an ``nn.Module`` whose children must be modules; this one hands the call
    straight to the wrapper, which names inputs by the segment's own signature.
    """

    def __init__(self, wrapper: CUDAGraphWrapper) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.segment = wrapper.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # no nn.Module hooks on the replay path
        return self.wrapper(*args, **kwargs)

