"""What one graph's replays are checked against, and the guard that keeps the common replay cheap.

Every check a replay needs is known at capture: which tensors the call hands the graph and where
(``inputs``), the wrapped module's state (``state``), the per-step inputs (``stale``), which replays
are sampled (``canary.Sampling``). ``ReplayChecks`` holds them for one graph and compiles one
*guard* from them: a single generated function whose body is a flat run of comparisons -
``args[0] is <captured tensor> and args[3][2][0] is <captured tensor> and ...``, the module
registration count against the one last checked, each per-step input's version counter against
its last replay's, whether this step's padding rows held real tokens at their last replay (the
newest row-status entry: same size, and at least as many real tokens), and a countdown to the next
sampled replay. Identity tests and integer compares: the cheapest questions Python can ask, with no
loop, no attribute chain worked out at replay, no allocation.

When the guard says yes, the replay goes ahead and the counters move on. When it says no (or in
debug mode, always), ``inspect`` looks closer and says what is wrong, if anything: a fresh view
at the captured address and layout, say, is fine and only costs this closer look.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from capture_core.canary import MutatedInput, Sampling
from capture_core.checks import Finding
from capture_core.inputs import InputLayout, TensorInput
from capture_core.stale import PerStepInputs
from capture_core.state import REGISTRATIONS, ModuleState

_NEVER = 1 << 62
"""A countdown that never runs out (no replay after this one is sampled)."""

Guard = Callable[[tuple[Any, ...], dict[str, Any], int], bool]
"""``clean(args, kwargs, real)``: ``real`` is the step's real token count (the forward context's)."""


class ReplayChecks:
    """Everything one graph's replays are checked against.

    ``check_inputs`` is False for a pass of segment graphs, whose segments check their own inputs;
    ``state`` and ``per_step`` are None where they do not apply. ``mutated`` are the inputs the step
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
    ) -> None:
        self.layout = layout
        self.check_inputs = check_inputs
        self.state = state
        self.per_step = per_step
        self.mutated = mutated
        self.sampling = sampling
        self.countdown = [0]
        """Replays until the next sampled one (1: the next); the guard counts it down."""
        self._done = 0
        self._armed = 0
        self._arm(0)
        self.guard_source, self.clean = self._compile()

    @property
    def unchecked(self) -> tuple[str, ...]:
        """What could not be checked, each with the reason: for the capture record."""
        found = list(self.layout.unchecked) if self.check_inputs else []
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
        findings: list[Finding] = []
        if self.check_inputs:
            findings += self.layout.find_changes(args, kwargs, deep=sampled)
        if self.state is not None and (sampled or self.state.checked_at[0] != REGISTRATIONS[0]):
            findings += self.state.find_changes()
        if self.per_step is not None:
            findings += self.per_step.inspect(args, kwargs, real, debug, self.replays + 1)
        self._arm(self.replays + 1)
        return findings, sampled

    @staticmethod
    def _same(spec: TensorInput, bind: Callable[[Any], str]) -> str:
        """The guard's term for one input: the captured object itself, or else a tensor at the
        captured address read the captured way (a fresh view of the static buffer, made per step by
        many engines). Storage offset and device are left to the closer look: with the same address,
        shape, strides and dtype the kernels read exactly what they were recorded for."""
        address, shape, stride, _, dtype, _ = spec.key
        return (
            f"((v := {spec.access()}) is {bind(spec.tensor)} or (v.data_ptr() == {address} and "
            f"v.shape == {bind(shape)} and v.stride() == {bind(stride)} and v.dtype is {bind(dtype)}))"
        )

    def _compile(self) -> tuple[str, Guard]:
        """The guard: True when this replay needs no closer look (and then its counters move on)."""
        bound: dict[str, Any] = {}

        def bind(value: Any) -> str:
            name = f"_{len(bound)}"
            bound[name] = value
            return name

        same = []
        if self.check_inputs:
            same.append(f"len(args) == {self.layout.arity[0]} and len(kwargs) == {self.layout.arity[1]}")
            same += [self._same(spec, bind) for spec in self.layout.inputs]
        if self.state is not None:
            same.append(f"{bind(REGISTRATIONS)}[0] == {bind(self.state.checked_at)}[0]")
        per_step = self.per_step
        terms = per_step.guard_terms() if per_step is not None else []
        versions = [(bind(tensor), bind(cell)) for tensor, cell in terms]
        rows = per_step.rows if per_step is not None else None
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
        source = "\n".join(lines) + "\n"
        namespace = dict(bound)
        exec(compile(source, "<replay guard>", "exec"), namespace)
        return source, namespace["clean"]
