"""The replay-vs-eager canary: does a sampled replay compute what the same step computes eagerly?

No address shows a host value baked into a graph at capture: a Python scalar argument, an
``.item()`` of a CPU tensor, a branch taken once on the host, a module attribute read while
capturing. The graph replays the capture's value forever; the eager step uses today's. So on a
sampled replay the same step also runs eagerly: before the replay, copies are made of the inputs the
step mutates (the KV cache; every tensor input when the wrapper was not told which), the graph
replays on the real ones, then the step runs eagerly on the copies, and the outputs and the mutated
state are compared, with tolerances by dtype (``torch.testing``'s defaults). A difference is a
``replay_mismatch`` naming the graph, the output or state, the max absolute and relative error.
The replay's results stand: the copies are dropped.

Which replays are sampled is ``Sampling`` (the first few of every graph, then one in N; every
replay in debug mode). Between samples nothing of this runs; a sampled replay costs the copies, an
eager step and the comparison (measured in ``bench/check_cost.py`` and ``bench/gpu_checks.py``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from capture_core.checks import Finding
from capture_core.events import ViolationKind
from capture_core.inputs import InputLayout, Step, TensorInput

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}
"""(rtol, atol) per dtype, as ``torch.testing.assert_close`` has them; other dtypes compare exactly."""

Compared = Callable[[str, torch.Tensor], torch.Tensor]
"""Which part of an output or mutated input (by its name) the canary compares: all of it by
default; a runner leaves out its padding, which no real token reads and which padding rows may
write in any order (duplicate indices of a scatter on the GPU)."""


@dataclass(frozen=True)
class Sampling:
    """Which replays get the closer look: the first ``first`` of every graph, then one in ``every``
    (0: no more). Debug mode looks at every replay."""

    first: int = 1
    every: int = 1000

    def __post_init__(self) -> None:
        for name in ("first", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Sampling.{name} must be an integer >= 0, got {value!r}")

    def gap(self, done: int) -> int | None:
        """How many replays from now the next sampled one is (1: the next), after ``done`` replays;
        None when no later replay is sampled."""
        if done < self.first:
            return 1
        if not self.every:
            return None
        return self.every - (done - self.first) % self.every


class CanaryRun:
    """One sampled replay's canary: copies made before the replay, compared with it after."""

    def __init__(
        self,
        layout: InputLayout,
        mutated: Sequence[TensorInput] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.args, self.kwargs = args, kwargs
        self.copies: list[tuple[TensorInput, torch.Tensor]] = []
        eager_args, eager_kwargs = list(args), dict(kwargs)
        for spec in layout.inputs if mutated is None else mutated:
            try:
                value = spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                continue
            if isinstance(value, torch.Tensor):
                clone = value.clone()
                self.copies.append((spec, clone))
                holder: Any = eager_args if isinstance(spec.root, int) else eager_kwargs
                holder[spec.root] = _with(holder[spec.root], spec.steps, clone)
        self.eager_args, self.eager_kwargs = tuple(eager_args), eager_kwargs

    def compare(self, replayed: Any, eager: Any, part: Compared | None = None) -> list[Finding]:
        """The outputs, then the mutated state, that differ between the replay and the eager step;
        ``part`` picks what of each is compared (its padding is left out)."""
        pairs = []
        graph_outputs = dict(_tensors(replayed, "output"))
        eager_outputs = dict(_tensors(eager, "output"))
        for name in [*graph_outputs, *(name for name in eager_outputs if name not in graph_outputs)]:
            pairs.append((name, graph_outputs.get(name), eager_outputs.get(name), "output"))
        for spec, copied in self.copies:
            pairs.append((spec.name, spec.read(self.args, self.kwargs), copied, "the step's effect on"))
        findings = []
        for name, graph_value, eager_value, what in pairs:
            both = isinstance(graph_value, torch.Tensor) and isinstance(eager_value, torch.Tensor)
            if part is not None and both:
                graph_value, eager_value = part(name, graph_value), part(name, eager_value)
            finding = _difference(name, graph_value, eager_value, what)
            if finding is not None:
                findings.append(finding)
        return findings


def _with(value: Any, steps: tuple[Step, ...], new: Any) -> Any:
    """``value`` with ``new`` put at ``steps`` below it: containers on the way are shallow copies."""
    if not steps:
        return new
    (is_attribute, key), rest = steps[0], steps[1:]
    if is_attribute:
        clone = copy.copy(value)
        object.__setattr__(clone, key, _with(getattr(value, key), rest, new))
        return clone
    if isinstance(value, tuple):
        items = list(value)
        items[key] = _with(value[key], rest, new)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    clone = copy.copy(value)
    clone[key] = _with(value[key], rest, new)
    return clone


def _tensors(value: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of an output, named ``output``, ``output[0]``, ``output['logits']``."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [pair for i, item in enumerate(value) for pair in _tensors(item, f"{name}[{i}]")]
    if isinstance(value, dict):
        return [pair for key, item in value.items() for pair in _tensors(item, f"{name}[{key!r}]")]
    return []


def _difference(name: str, replayed: Any, eager: Any, what: str) -> Finding | None:
    """A ``replay_mismatch`` when ``replayed`` (the graph's) and ``eager`` differ beyond tolerance."""
    if not isinstance(replayed, torch.Tensor) or not isinstance(eager, torch.Tensor) or (
        replayed.shape != eager.shape or replayed.dtype != eager.dtype
    ):
        detail = f"{what} {name!r}: the replay gave {_shape_of(replayed)}, the eager step {_shape_of(eager)}"
        return Finding(
            ViolationKind.REPLAY_MISMATCH, name, detail, max_abs_error=math.inf, max_rel_error=math.inf
        )
    rtol, atol = TOLERANCES.get(replayed.dtype, (0.0, 0.0))
    if replayed.dtype.is_floating_point or replayed.dtype.is_complex:
        close = torch.isclose(replayed, eager, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = replayed == eager
    wrong = int((~close).sum())
    if not wrong:
        return None
    wide = torch.complex128 if replayed.dtype.is_complex else torch.float64
    graph_values, eager_values = replayed.to(wide), eager.to(wide)
    both_nan = graph_values.isnan() & eager_values.isnan()
    error = torch.where(both_nan, 0.0, (graph_values - eager_values).abs()).nan_to_num(nan=math.inf)
    relative = torch.where(error == 0, 0.0, error / eager_values.abs())
    max_abs, max_rel = float(error.max()), float(relative.nan_to_num(nan=math.inf).max())
    detail = (
        f"{what} {name!r} differs from the same step run eagerly: max abs error {max_abs:.3g}, max rel "
        f"error {max_rel:.3g} ({wrong} of {replayed.numel()} elements beyond rtol {rtol:g}, atol {atol:g} "
        f"for {replayed.dtype})"
    )
    return Finding(ViolationKind.REPLAY_MISMATCH, name, detail, max_abs_error=max_abs, max_rel_error=max_rel)


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "nothing" if value is None else f"a {type(value).__name__}"
