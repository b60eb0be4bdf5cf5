"""Divergence located: the first module whose output differs between a graph and the same step run eagerly.

``replay_mismatch`` says which output of a step differs; where in the model it started is what a
user then bisects by hand. Here the same step runs twice with a forward hook on every submodule of
the wrapped module that copies out what it returned:

* as the graph computes it: the call as it was captured (its Python values, such as a scalar
  argument the graph baked in, on the tensors the graph reads). On the CUDA backend this is a
  *probe graph* of that call, captured in a memory pool of its own and replayed once (so whatever
  differs under capture differs here too), then freed: it never goes through the capture guard, so
  it is never an unexpected capture, and no capture event is told. On the eager backend it is the
  captured call run again, which is what that backend's replay is. A pass of piecewise segments is
  not probed (its attention runs on each step's own metadata between the segments, so its captured
  call is not what it computes): the record says so.
* eagerly, as today's call asks.

Both runs start from the same state (what the step writes is kept aside and put back, as the canary
does; the random generators are reset for each) and the engine's state is left as it was found.
The hooked outputs are compared in the order the modules finished, with the canary's tolerances,
on the real rows only (the wrapper's ``compared``): the first that differs is the divergence, with
its max absolute and relative error, and the modules before it that agree. When the probe's final
output agrees with the eager step's, the probe did not reproduce the mismatch (a value that changed
since capture and is not in the captured call, such as a module attribute): it says so, and names
no module.

It runs when the canary finds a ``replay_mismatch`` (``GraphRuntime(locate_divergence=True)``, the
default: a rare event, and the probe costs two steps and one capture), or on demand
(``CUDAGraphWrapper.locate``). The result goes to the observer's optional ``on_divergence``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from capture_core.backends import gc_frozen
from capture_core.canary import MutatedInput, RandomState, _difference, _tensors, _with
from capture_core.forward_context import ForwardContext, use_forward_context
from capture_core.inputs import InputLayout, TensorInput

PROBE_GRAPH = "a probe graph of the captured call, in a pool of its own"
PROBE_RERUN = "the captured call run again (the eager backend's replay)"
NOT_PROBED_ADOPTED = ("not probed: the engine captured this graph itself, so the call it was captured on "
                      "is not known here")
NOT_PROBED_PASS = ("not probed: a pass of segment graphs runs its attention on each step's own metadata, so "
                   "its captured call is not what it computes")

Part = Callable[[str, torch.Tensor], torch.Tensor]
"""What of a module's output is compared (its real rows), by the module's name."""


@dataclass(frozen=True)
class Divergence:
    """Where a graph and the same step run eagerly part, as the probe found it."""

    module: str | None
    """The first module whose output differs (None: none differs, or the probe did not reproduce)."""
    max_abs_error: float | None
    max_rel_error: float | None
    agreeing: tuple[str, ...]
    """The modules that finished before it and agree: the outermost of them (a layer, not its parts)."""
    modules_compared: int
    reproduced: bool
    """The probe's final output differs from the eager step's, as the graph's did."""
    probe: str

    @property
    def message(self) -> str:
        if self.module is None:
            if not self.reproduced:
                return (f"not located: {self.probe} computes what the eager step computes, so what differs "
                        "was not in the captured call (a value that changed since capture outside the "
                        "call's arguments, such as a module attribute, or state the probe cannot see)")
            return f"not located: no module's output differs ({self.modules_compared} compared)"
        before = ", ".join(self.agreeing[-3:]) if self.agreeing else "none"
        return (f"first differs at module {self.module!r}: max abs error {self.max_abs_error:.3g}, max rel "
                f"error {self.max_rel_error:.3g}; {len(self.agreeing)} module(s) before it agree (the last: "
                f"{before}); {self.modules_compared} compared, by {self.probe}")


class _Outputs:
    """Forward hooks on every module: each finished module's outputs, copied, in finishing order."""

    def __init__(self, module: nn.Module, root: str) -> None:
        self.names = {id(sub): (name or root) for name, sub in module.named_modules()}
        self.module = module
        self.seen: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []

    def _hook(self, sub: nn.Module, inputs: Any, output: Any) -> None:
        name = self.names[id(sub)]
        copies = [(part, tensor.detach().clone()) for part, tensor in _tensors(output, "output")]
        self.seen.append((name, copies))

    @contextmanager
    def hooked(self) -> Iterator[None]:
        with ExitStack() as stack:
            for sub in self.module.modules():
                stack.callback(sub.register_forward_hook(self._hook).remove)
            yield


class _StepState:
    """What a locating run may write, kept so every run starts from the same state and the engine's
    is left as it was found: a declared region's values, or a whole mutated input (run on a copy)."""

    def __init__(self, layout: InputLayout, mutated: Sequence[MutatedInput] | None, context: ForwardContext,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.regions: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
        self.whole: list[TensorInput] = []
        targets = [MutatedInput(spec) for spec in layout.inputs] if mutated is None else mutated
        for target in targets:
            try:
                value = target.spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                continue
            if not isinstance(value, torch.Tensor):
                continue
            if target.written is None:
                self.whole.append(target.spec)
            else:
                index = target.written(context, args, kwargs)
                self.regions.append((value, index, value[index]))

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args, kwargs`` with every wholly mutated input replaced by a copy of it."""
        new_args, new_kwargs = list(args), dict(kwargs)
        for spec in self.whole:
            try:
                value = spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                continue
            holder: Any = new_args if isinstance(spec.root, int) else new_kwargs
            holder[spec.root] = _with(holder[spec.root], spec.steps, value.clone())
        return tuple(new_args), new_kwargs

    def put_back(self) -> None:
        for state, index, kept in self.regions:
            state[index] = kept


@dataclass
class Probe:
    """One step to locate: the runnable, its module, the call as captured and as asked today."""

    runnable: Callable[..., Any]
    module: nn.Module
    root: str
    layout: InputLayout
    mutated: Sequence[MutatedInput] | None
    context: ForwardContext
    captured: tuple[tuple[Any, ...], dict[str, Any]]
    today: tuple[tuple[Any, ...], dict[str, Any]]
    part: Callable[[str, torch.Tensor, ForwardContext], torch.Tensor] | None
    how: str
    """``PROBE_GRAPH`` or ``PROBE_RERUN``."""

    def locate(self) -> Divergence:
        state = _StepState(self.layout, self.mutated, self.context, *self.today)
        random = RandomState.of_call(self.layout, *self.today)
        try:
            eager = self._run(state, random, self.today, graph=False)  # first: any lazy set-up runs eagerly
            probed = self._run(state, random, self.captured, graph=self.how == PROBE_GRAPH)
        finally:
            state.put_back()
            random.restore()
        return self._compare(probed, eager)

    def _run(self, state: _StepState, random: RandomState, call: tuple[tuple[Any, ...], dict[str, Any]],
             graph: bool) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
        state.put_back()
        random.restore()
        args, kwargs = state.call(*call)
        outputs = _Outputs(self.module, self.root)
        with use_forward_context(None), torch.no_grad():
            if not graph:
                with outputs.hooked():
                    self.runnable(*args, **kwargs)
            else:
                probe = torch.cuda.CUDAGraph()
                pool = torch.cuda.graph_pool_handle()  # its own: no graph of the cache shares it
                with outputs.hooked(), gc_frozen(), torch.cuda.graph(probe, pool=pool):
                    self.runnable(*args, **kwargs)
                probe.replay()
                torch.cuda.synchronize()
                del probe  # its pool goes with it; the copies hold what it computed
        return outputs.seen

    def _compare(self, probed: list[tuple[str, list]], eager: list[tuple[str, list]]) -> Divergence:
        agreeing: list[str] = []
        compared = 0
        first = None
        for (name, graph_parts), (eager_name, eager_parts) in zip(probed, eager, strict=False):
            if name != eager_name or len(graph_parts) != len(eager_parts):
                first = (name, math.inf, math.inf)  # the two runs went through other modules
                break
            if not graph_parts:
                continue
            compared += 1
            worst = None
            for (part, graph_value), (_, eager_value) in zip(graph_parts, eager_parts, strict=True):
                graph_value, eager_value = self._real(name, graph_value), self._real(name, eager_value)
                found = _difference(f"{name} {part}", graph_value, eager_value, "output")
                if found is not None and (worst is None or _abs(found) > _abs(worst)):
                    worst = found
            if worst is not None:
                first = (name, worst.max_abs_error, worst.max_rel_error)
                break
            agreeing.append(name)
        reproduced = self._differs(probed, eager)
        if first is None or not reproduced:
            return Divergence(None, None, None, (), compared, reproduced, self.how)
        outermost = tuple(n for n in agreeing if not any(n.startswith(other + ".") for other in agreeing))
        return Divergence(first[0], first[1], first[2], outermost, compared, reproduced, self.how)

    def _differs(self, probed: list[tuple[str, list]], eager: list[tuple[str, list]]) -> bool:
        """The probe's final output (the module's own, which finishes last) differs from eager's."""
        if not probed or not eager or probed[-1][0] != eager[-1][0]:
            return True
        name = probed[-1][0]
        for (part, graph_value), (_, eager_value) in zip(probed[-1][1], eager[-1][1], strict=False):
            if _difference(part, self._real(name, graph_value), self._real(name, eager_value), "output"):
                return True
        return len(probed[-1][1]) != len(eager[-1][1])

    def _real(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.part is None else self.part(name, tensor, self.context)


def _abs(finding: Any) -> float:
    return finding.max_abs_error or 0.0
