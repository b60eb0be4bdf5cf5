"""What one graph's replays are checked against, and the guard that keeps the common replay cheap.

Every check a replay needs is known at capture: which tensors the call hands the graph and where
(``inputs``), the wrapped module's state (``state``), the per-step inputs (``stale``), which replays
are sampled (``canary.Sampling``). ``ReplayChecks`` holds them for one graph and compiles one
*guard* from them: a single generated function whose body is a flat run of comparisons -
``args[0] is <captured tensor> and args[3][2][0] is <captured tensor> and ...`` - the module
registration count and the count of moves of captured tensors (``capture_core.swaps``: ``.data =``,
``set_``, ``resize_``, ``as_strided_``, a storage resized...) against the ones last checked, whether
each per-step input's version counter moved since its last replay, whether this step's padding rows
held real tokens at their last replay (the newest row-status entry: same size, and at least as many
real tokens), and a countdown to the next sampled replay. Identity tests and integer compares: the
cheapest questions Python can ask, with no loop, no attribute chain worked out at replay, no
allocation, and no call into torch for a captured tensor whose moves are counted: what costs a guard
most on a busy host is the first call of each kind into torch (a cold ``data_ptr()``, ``_version``,
``shape``), not the number of tensors. A tensor that is not the captured one (a fresh view of the
static buffer, made per step by many engines) is read the captured way: its address, shape, strides
and dtype; a captured one whose moves cannot be counted (a class with its own ``set_`` or
``__setattr__``) has its address read, and its shape and strides when its version counter moved.

A tensor of a subclass that overrides ``__torch_function__`` (vLLM's weights are such parameters)
answers every method and attribute through that Python hook: on a CPU here ``data_ptr()`` took 3.4 us
on one against 0.2 us on a plain parameter. A guard holding any such tensor runs its comparisons with
the subclass hooks off (``torch._C.DisableTorchFunctionSubclass``, once for the whole guard), where
each reads the tensor itself again.

When the guard says yes, the replay goes ahead and the counters move on. When it says no (or in
debug mode, always), ``inspect`` looks closer and says what is wrong, if anything: a fresh view
at the captured address and layout, say, is fine and only costs this closer look.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from capture_core.baked import BakedValues
from capture_core.canary import MutatedInput, Sampling
from capture_core.checks import Finding
from capture_core.inputs import InputLayout, TensorInput, version_of
from capture_core.stale import PerStepInputs
from capture_core.state import REGISTRATIONS, ModuleState
from capture_core.swaps import DATA_SWAPS, counted, watch

_NEVER = 1 << 62
"""A countdown that never runs out (no replay after this one is sampled)."""

Guard = Callable[[tuple[Any, ...], dict[str, Any], int], bool]
"""``clean(args, kwargs, real)``: ``real`` is the step's real token count (the forward context's)."""


class ReplayChecks:
    """Everything one graph's replays are checked against.

    ``check_inputs`` is False for a pass of segment graphs, whose segments check their own inputs;
    ``state``, ``per_step`` and ``baked`` (the host values the capture baked in) are None where they
    do not apply. ``mutated`` are the inputs the step
    writes, each with where (for the canary; None: every tensor input, copied whole).
    """

    def __init__(
        self,
        layout: InputLayout,
        *,
        check_inputs: bool,
        state: ModuleState | None,
        per_step: PerStepInputs | None,
        mutated: Sequence[MutatedInput] | None,
        sampling: Sampling,
        baked: BakedValues | None = None,
    ) -> None:
        self.layout = layout
        self.baked = baked
        self.check_inputs = check_inputs
        self.state = state
        self.per_step = per_step
        self.mutated = mutated
        self.sampling = sampling
        written = {id(spec) for spec in per_step.inputs} if per_step is not None else set()
        self.layout_versions: dict[int, list[int] | None] = {}
        """Per input (by position), the version at which the captured object's layout was last read;
        None for an input whose layout is read at every replay (a per-step input, whose counter the
        step's write moves anyway; an inference tensor, which has none)."""
        for index, spec in enumerate(layout.inputs):
            version = version_of(spec.tensor)
            self.layout_versions[index] = None if version is None or id(spec) in written else [version]
        watch(self, (spec.tensor for spec in layout.inputs))  # their moves counted from here on
        self.counted_inputs = {index for index, spec in enumerate(layout.inputs) if counted(spec.tensor)}
        """The inputs whose moves are counted (``capture_core.swaps``): the guard takes the captured
        object's address and layout on the count's word instead of reading them."""
        self.input_swaps_at = [DATA_SWAPS[0]]
        """The count of moves when the inputs were last found as captured (by a closer look)."""
        self.countdown = [0]
        """Replays until the next sampled one (1: the next); the guard counts it down."""
        self._done = 0
        self._armed = 0
        self.looks = 0
        """Closer looks so far (``inspect``): sampled replays, and those the guard did not wave through."""
        self._arm(0)
        self.guard_source, self.clean = self._compile()

    @property
    def unchecked(self) -> tuple[str, ...]:
        """What could not be checked, each with the reason: for the capture record."""
        found = list(self.layout.unchecked) if self.check_inputs else []
        found += self.baked.unchecked if self.baked is not None else []
        return (*found, *(self.per_step.unchecked if self.per_step is not None else ()))

    @property
    def replays(self) -> int:
        """Replays of this graph so far, guarded or inspected."""
        return self._done + (self._armed - self.countdown[0])

    def _arm(self, done: int) -> None:
        gap = self.sampling.gap(done)
        self._done = done
        self._armed = self.countdown[0] = _NEVER if gap is None else gap

    def inspect(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], real: int, debug: bool
    ) -> tuple[list[Finding], bool]:
        """The closer look at one replay of ``real`` real tokens: what is wrong, and whether it is a
        sampled replay (whose checks also re-read what the guard takes on trust, and which the canary
        may run on)."""
        sampled = debug or self.countdown[0] <= 1
        self.looks += 1
        findings: list[Finding] = []
        if self.check_inputs:
            findings += self._input_changes(args, kwargs)
        state = self.state
        if state is not None and (sampled or state.changed_since_checked() or state.moved()):
            findings += state.find_changes()
        if self.baked is not None:
            findings += self.baked.find_changes(args, kwargs, deep=sampled)
        if self.per_step is not None:
            findings += self.per_step.inspect(args, kwargs, real, debug, self.replays + 1)
        self._arm(self.replays + 1)
        return findings, sampled

    def _input_changes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Finding]:
        """The inputs not as captured, the very objects captured re-read too; the counters of those
        still as captured are noted as checked."""
        inputs, swaps = self.layout.inputs, DATA_SWAPS[0]
        found = self.layout.find_changes(args, kwargs, deep=True)
        if not found:
            self.input_swaps_at[0] = swaps
        wrong = {f.name for f in found}
        for index, cell in self.layout_versions.items():
            if cell is not None and inputs[index].name not in wrong:
                cell[0] = inputs[index].tensor._version
        return found

    def _same(self, index: int, spec: TensorInput, bind: Callable[[Any], str]) -> str:
        """The guard's term for one input: the captured object itself (whose moves the count, compared
        once, covers: no read of it at all); or, for one whose moves cannot be counted, still at its
        address and, when its version counter moved (an in-place ``set_``, ``resize_`` or
        ``as_strided_`` moves it, as a write does), still of its shape and strides; or else a tensor at
        the captured address read the captured way (a fresh view of the static buffer, made per step
        by many engines). Storage offset and device are left to the closer look: with the same
        address, shape, strides and dtype the kernels read exactly what they were recorded for."""
        address, shape, stride, _, dtype, _ = spec.key
        # the layout as literals in the code: no lookup, and constants the code object keeps together
        shaped = f"v.shape == {tuple(shape)!r} and v.stride() == {tuple(stride)!r}"
        fresh = f"v.data_ptr() == {address} and {shaped} and v.dtype is {bind(dtype)}"
        captured = bind(spec.tensor)
        if index in self.counted_inputs:
            return f"((v := {spec.access()}) is {captured} or {fresh})"
        cell = self.layout_versions[index]
        if cell is None:
            own = f"v.data_ptr() == {address} and {shaped}"
        else:
            seen = bind(cell)
            own = f"v.data_ptr() == {address} and ((n := v._version) == {seen}[0] or {shaped} and " \
                  f"not {seen}.__setitem__(0, n))"
        return f"((v := {spec.access()}) is {captured} and {own} or v is not {captured} and {fresh})"

    def _compile(self) -> tuple[str, Guard]:
        """The guard: True when this replay needs no closer look (and then its counters move on)."""
        bound: dict[str, Any] = {}

        def bind(value: Any) -> str:
            name = f"_{len(bound)}"
            bound[name] = value
            return name

        same = []
        if self.check_inputs or (self.baked is not None and self.baked.has_call):
            same.append(f"len(args) == {self.layout.arity[0]} and len(kwargs) == {self.layout.arity[1]}")
        if self.check_inputs:
            if self.counted_inputs:
                same.append(f"{bind(DATA_SWAPS)}[0] == {bind(self.input_swaps_at)}[0]")
            same += [self._same(index, spec, bind) for index, spec in enumerate(self.layout.inputs)]
        if self.state is not None:
            same.append(f"{bind(REGISTRATIONS)}[0] == {bind(self.state.checked_at)}[0]")
            same.append(f"{bind(DATA_SWAPS)}[0] == {bind(self.state.swaps_at)}[0]")
            same += [f"{bind(held)}.data_ptr() == {address}" for held, address in self.state.guard_terms()]
        if self.baked is not None:  # identity first; ``is True``: an equality that is no bool says no
            same += [f"((x := {access}) is {bind(v)} or (x == {bind(v)}) is True)"
                     for access, v in self.baked.argument_terms()]
            same += [f"((x := {bind(held)}[{key!r}]) is {bind(v)} or (x == {bind(v)}) is True)"
                     for held, key, v in self.baked.attribute_terms()]
        per_step = self.per_step
        terms = per_step.guard_terms() if per_step is not None else []
        versions = [(bind(tensor), bind(cell)) for tensor, cell in terms]
        rows = per_step.rows if per_step is not None else None
        if per_step is not None:  # no comparison of the group still on its way back from the device
            same.append(f"{bind(per_step.group.waiting)}[0] is None")
        if rows is not None:  # the newest row status: this size, and no padding row that held a token
            same.append(f"(top := {bind(rows.entries)}[-1])[0] == {per_step.size} and real >= top[1]")
        countdown = bind(self.countdown)
        lines = ["def clean(args, kwargs, real):"]
        if per_step is not None and per_step.always_look:  # an input without a counter: always compare
            lines.append("    return False")
        if same:
            lines += ["    try:", f"        if not ({' and '.join(same)}):", "            return False",
                      "    except Exception:", "        return False"]
        lines += [f"    v{i} = {tensor}._version" for i, (tensor, _) in enumerate(versions)]
        if versions:
            stale = " or ".join(f"v{i} == {cell}[0]" for i, (_, cell) in enumerate(versions))
            lines += [f"    if {stale}:", "        return False"]
        lines += [f"    if {countdown}[0] <= 1:", "        return False", f"    {countdown}[0] -= 1"]
        lines += [f"    {cell}[0] = v{i}" for i, (_, cell) in enumerate(versions)]
        if rows is not None:
            lines.append("    top[1] = real")
        lines.append("    return True")
        read = [spec.tensor for index, spec in enumerate(self.layout.inputs)
                if self.check_inputs and index not in self.counted_inputs]
        read += [held for held, _ in self.state.guard_terms()] if self.state is not None else []
        read += [tensor for tensor, _ in terms]
        if any(torch._C._has_torch_function_unary(tensor) for tensor in read):  # methods read below it
            body = ["    with _no_subclass_hooks():", *(f"    {line}" for line in lines[1:])]
            lines = [lines[0], *body]
            bound["_no_subclass_hooks"] = torch._C.DisableTorchFunctionSubclass
        source = "\n".join(lines) + "\n"
        namespace = dict(bound)
        exec(compile(source, "<replay guard>", "exec"), namespace)
        return source, namespace["clean"]
