"""The replay-vs-eager canary: does a sampled replay compute what the same step computes eagerly?

No address shows a host value baked into a graph at capture: a Python scalar argument, an
``.item()`` of a CPU tensor, a branch taken once on the host, a module attribute read while
capturing. The graph replays the capture's value forever; the eager step uses today's. So on a
sampled replay the same step also runs eagerly, and the outputs and what the step wrote are
compared, with tolerances by dtype (``torch.testing``'s defaults). A difference is a
``replay_mismatch`` naming the graph, the output or state, the max absolute and relative error.
The replay's results stand.

What the step mutates (the KV cache) is the largest thing an engine holds, so it is never copied
whole where its owner says where a step writes it (a ``Written`` region, such as each real token's
(slot, position) of every layer's K and V planes):

* before the replay, the region's values are kept, and a checksum of the whole state taken (an
  exact sum of its bits, read once, nothing of its size allocated);
* after the replay, the region's values are taken (what the graph wrote) and the kept ones put
  back, and the checksum taken again: a change means the graph wrote outside the region (to a wrong
  slot or position);
* the eager step then runs on the real state, writes the region again, and its values are taken,
  the kept ones put back and the checksum taken a third time: a change since the second means the
  eager step wrote outside the region (its writes there stay); then the graph's values go back.

So the extra memory is three copies of the region, proportional to the batch, and the cost an eager
step, three reads of the state and the comparison. A mutated input without a region is copied
whole before the replay and the eager step runs on the copy (fine for small state); with no
mutated inputs named, every tensor input is.

Both runs draw the same random numbers: the generators the step draws from (the CPU's, each CUDA
device's among its inputs: seed and Philox offset; any ``torch.Generator`` passed as an argument) are
kept before the replay, put back before the eager step, and set to the replay's end state after it
(``RandomState``). In-graph sampling and dropout then compare like anything else, the engine's random
stream goes on as if only the replay had run, and a graph that froze its numbers at capture (drawn on
the host, or from a seed baked in) still differs from the eager step, which draws afresh.

Which replays are sampled is ``Sampling`` (the first few of every graph, then one in N; every
replay in debug mode). Between samples nothing of this runs; a sampled replay's cost is measured
in ``bench/check_cost.py`` and ``bench/gpu_checks.py``.
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
from capture_core.forward_context import ForwardContext
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


Written = Callable[[ForwardContext, tuple[Any, ...], dict[str, Any]], Any]
"""``written(context, args, kwargs)``: where this call's step writes a mutated input (within the part
``Compared`` picks of it, when there is one), as an index: ``state[index]`` reads those elements and
``state[index] = values`` writes them back (slices and index tensors, as for any tensor). Declared by
the owner of the state, from the step's own inputs: views of them are fine, the canary writes none
of them. A name that picks several tensors (a list of per-layer caches) gives each the same index."""


@dataclass(frozen=True)
class MutatedInput:
    """An input the step writes, and where (None: anywhere in it, so the canary copies it whole)."""

    spec: TensorInput
    written: Written | None = None


class _Region:
    """One mutated input's region on one sampled replay: its values before, the values the graph and
    the eager step wrote there, and checksums of the whole state (before, after each, region put back)."""

    def __init__(self, name: str, state: torch.Tensor, index: Any) -> None:
        self.name, self.state, self.index = name, state, index
        self.before = state[index]
        self.checksums = [_bit_sum(state)]
        self.taken: list[torch.Tensor] = []

    def take(self) -> None:
        """Keep the region's values now (what the last run wrote) and put the kept ones back."""
        self.taken.append(self.state[self.index])
        self.state[self.index] = self.before

    def checksum(self) -> None:
        self.checksums.append(_bit_sum(self.state))

    def findings(self) -> list[Finding]:
        """After the eager step's values are taken: the graph's go back, and what differs is said."""
        graph_values, eager_values = self.taken
        self.state[self.index] = graph_values
        before, after_graph, after_eager = (int(c) for c in torch.stack(self.checksums).tolist())
        found = _difference(self.name, graph_values, eager_values, "what the step wrote to")
        findings = [] if found is None else [found]
        for who, started, ended, stays in (
            ("the graph", before, after_graph, ""),
            ("the eager step", after_graph, after_eager, " (its writes there stay)"),
        ):
            if ended != started:
                detail = (
                    f"{who} wrote {self.name!r} outside the region this step writes (the state's "
                    f"checksum outside it moved){stays}: a write to a wrong slot or position, or a "
                    "region declared short of what the step writes"
                )
                findings.append(Finding(
                    ViolationKind.REPLAY_MISMATCH, self.name, detail, max_abs_error=math.inf,
                    max_rel_error=math.inf,
                ))
        return findings


class RandomState:
    """The state of every generator a step draws from: the CPU's default one, each listed CUDA
    device's default one (its seed and Philox offset, which a CUDA graph reads at replay), and any
    generator passed to the step; taken at once, put back at once."""

    def __init__(self, cuda_devices: Sequence[int], generators: Sequence[torch.Generator]) -> None:
        self.cuda_devices = tuple(cuda_devices)
        self.generators = tuple(generators)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(index) for index in self.cuda_devices]
        self.own = [generator.get_state() for generator in self.generators]

    @classmethod
    def of_call(cls, layout: InputLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RandomState:
        """The generators a call draws from: the defaults of the CPU and of its tensors' CUDA
        devices, and the generators among its arguments."""
        devices = {spec.tensor.device for spec in layout.inputs if spec.tensor.device.type == "cuda"}
        indices = sorted({d.index if d.index is not None else torch.cuda.current_device() for d in devices})
        passed = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Generator)]
        return cls(indices, passed)

    def again(self) -> RandomState:
        """The state of the same generators now."""
        return RandomState(self.cuda_devices, self.generators)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for index, state in zip(self.cuda_devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(state, index)
        for generator, state in zip(self.generators, self.own, strict=True):
            generator.set_state(state)


class CanaryRun:
    """One sampled replay's canary: what is kept before the replay, taken after it, and compared.

    Its life follows the replay: built before it (the state's region and the random generators
    kept), ``replayed()`` after it (the graph's writes taken and the state put back, the generators
    set back to where the replay began), then the eager step, then ``compare()`` (the generators set
    to where the replay ended, the findings made), or ``put_back()`` when the eager step failed.
    """

    def __init__(
        self,
        layout: InputLayout,
        mutated: Sequence[MutatedInput] | None,
        context: ForwardContext,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        part: Compared | None = None,
    ) -> None:
        self.args, self.kwargs, self.part = args, kwargs, part
        self.random_before = RandomState.of_call(layout, args, kwargs)
        self.random_after: RandomState | None = None
        self.copies: list[tuple[TensorInput, torch.Tensor]] = []
        self.regions: list[_Region] = []
        eager_args, eager_kwargs = list(args), dict(kwargs)
        targets = [MutatedInput(spec) for spec in layout.inputs] if mutated is None else mutated
        for target in targets:
            spec = target.spec
            try:
                value = spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                continue
            if not isinstance(value, torch.Tensor):
                continue
            if target.written is not None:
                state = value if part is None else part(spec.name, value)
                self.regions.append(_Region(spec.name, state, target.written(context, args, kwargs)))
                continue
            clone = value.clone()
            self.copies.append((spec, clone))
            holder: Any = eager_args if isinstance(spec.root, int) else eager_kwargs
            holder[spec.root] = _with(holder[spec.root], spec.steps, clone)
        self.eager_args, self.eager_kwargs = tuple(eager_args), eager_kwargs

    def replayed(self) -> None:
        """After the replay, before the eager step: take what the graph wrote, put the state back, and
        set the random generators back to where the replay began."""
        self._take()
        self.random_after = self.random_before.again()
        self.random_before.restore()

    def _take(self) -> None:
        # Every region is put back before any checksum is taken: states may share storage.
        for region in self.regions:
            region.take()
        for region in self.regions:
            region.checksum()

    def compare(self, replayed: Any, eager: Any) -> list[Finding]:
        """After the eager step: the mutated state, then the outputs, that differ between the replay
        and the eager step (a wrong write first: wrong outputs may follow from it). The graph's
        writes go back into the state, the random generators to where the replay left them."""
        self._random_as_replayed()
        pairs = [(spec.name, spec.read(self.args, self.kwargs), copied, "the step's effect on")
                 for spec, copied in self.copies]
        graph_outputs = dict(_tensors(replayed, "output"))
        eager_outputs = dict(_tensors(eager, "output"))
        for name in [*graph_outputs, *(name for name in eager_outputs if name not in graph_outputs)]:
            pairs.append((name, graph_outputs.get(name), eager_outputs.get(name), "output"))
        self._take()
        findings = [finding for region in self.regions for finding in region.findings()]
        part = self.part
        for name, graph_value, eager_value, what in pairs:
            both = isinstance(graph_value, torch.Tensor) and isinstance(eager_value, torch.Tensor)
            if part is not None and both:
                graph_value, eager_value = part(name, graph_value), part(name, eager_value)
            finding = _difference(name, graph_value, eager_value, what)
            if finding is not None:
                findings.append(finding)
        return findings

    def put_back(self) -> None:
        """When the eager step failed: the graph's writes go back into the state, the random
        generators to where the replay left them."""
        self._random_as_replayed()
        for region in self.regions:
            if region.taken:
                region.state[region.index] = region.taken[0]

    def _random_as_replayed(self) -> None:
        if self.random_after is not None:
            self.random_after.restore()


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PIECE = 1 << 22
"""Elements summed at a time where a state's bits cannot be read as 8-byte words in place."""


def _bit_sum(state: torch.Tensor) -> torch.Tensor:
    """A checksum of a tensor: its elements' bits read as integers and summed with wrap-around (a 0-d
    int64 tensor on its device). Exact integer arithmetic, so the same bits give the same sum in
    whatever order the reduction runs (no false alarm), and a write that changes elements changes it
    unless the changes cancel exactly (two elements swapped, say). It reads the tensor once and
    allocates nothing of its size."""
    words = state.view(_SAME_SIZE_INTEGER.get(state.element_size(), torch.int64))
    try:
        return words.view(torch.int64).sum()  # 8-byte words where the layout allows: no conversion
    except RuntimeError:
        pieces = _pieces(words)
        return torch.stack([piece.sum(dtype=torch.int64) for piece in pieces]).sum()


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``tensor`` of at most ``_PIECE`` elements that cover it (a conversion each, bounded)."""
    if tensor.numel() <= _PIECE or tensor.dim() == 0:
        return [tensor]
    row = tensor.numel() // tensor.shape[0]
    if row <= _PIECE:
        return list(tensor.split(_PIECE // row))
    return [piece for sub in tensor.unbind(0) for piece in _pieces(sub)]


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
