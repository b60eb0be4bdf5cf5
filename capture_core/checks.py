"""The replay checks' vocabulary: their modes, their findings, and the messages that name each one.

A CUDA graph reads fixed memory with fixed kernels, and computes silently wrong when what it baked
in at capture no longer holds: a tensor passed at replay that lives elsewhere (``address_drift``)
or is laid out otherwise (``layout_mismatch``), a weight of the wrapped module reassigned instead
of ``copy_``-ed into, a per-step input nobody wrote (``stale_input``), a host value frozen at
capture (``replay_mismatch``, from the sampled replay-vs-eager canary). vLLM compares positional
inputs only, under debug logging; here every check runs in one of three modes, by configuration:

* ``OFF``: no checks;
* ``ALWAYS_ON``: a cheap guard on every replay, a closer look on sampled ones; every finding is an
  event and the replay goes on;
* ``DEBUG``: the closer look on every replay, and a finding raises (its kind's error, a
  ``GraphCheckError``) once its event is out. ``GRAPH_INSPECTOR_DEBUG=1`` forces it for a process
  (the pytest plugin does).

Where the checks look: ``inputs`` (the call's tensors), ``state`` (the module's parameters and
buffers), ``stale`` (per-step inputs), ``canary`` (replay against eager), all run by ``watch``.
"""

from __future__ import annotations

import enum
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationKind
from capture_core.modes import CUDAGraphMode

DEBUG_ENV = "GRAPH_INSPECTOR_DEBUG"
"""Set to 1 to force DEBUG checks in this process (the pytest plugin does, for CI runs)."""


class AddressCheckMode(str, enum.Enum):
    """How replays are checked (the name is historical: addresses were the first check)."""

    OFF = "off"
    ALWAYS_ON = "always_on"
    """Cheap: a guard on every replay, a closer look on sampled ones; findings are events."""
    DEBUG = "debug"
    """Every check on every replay (the canary too); a finding raises after its event is emitted."""

    @classmethod
    def parse(cls, value: AddressCheckMode | str) -> AddressCheckMode:
        if isinstance(value, AddressCheckMode):
            return value
        try:
            return cls(value.strip().lower().replace("-", "_"))
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown address check mode {value!r}; choose one of {choices}") from None


def effective_check_mode(configured: AddressCheckMode | str) -> AddressCheckMode:
    """The configured mode, unless ``GRAPH_INSPECTOR_DEBUG=1`` forces DEBUG for this process."""
    if os.environ.get(DEBUG_ENV, "").strip() in ("1", "true", "yes", "on"):
        return AddressCheckMode.DEBUG
    return AddressCheckMode.parse(configured)


@dataclass(frozen=True)
class ParameterNames:
    """How to name a callable's inputs: its positional parameter names and its ``*args`` name; its
    signature, when it has one, binds a call to its parameters (defaults included)."""

    positional: tuple[str, ...] = ()
    var_positional: str | None = None
    signature: inspect.Signature | None = field(default=None, compare=False)

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> ParameterNames:
        """Read the names from ``fn``'s signature (a module's ``forward``); empty when it has none."""
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return cls()
        positional, var_positional = [], None
        for param in signature.parameters.values():
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                positional.append(param.name)
            elif param.kind is param.VAR_POSITIONAL:
                var_positional = param.name
        return cls(tuple(positional), var_positional, signature)

    def name_of(self, position: int) -> str:
        """``input_ids`` for a named parameter; ``args[3]`` (by position) when unnamed."""
        if position < len(self.positional):
            return self.positional[position]
        if self.var_positional is not None:
            return f"{self.var_positional}[{position - len(self.positional)}]"
        return f"args[{position}]"


@dataclass(frozen=True)
class Finding:
    """One thing a replay check found wrong with one input, parameter or output of a graph."""

    kind: ViolationKind
    name: str
    """What it is about, as a user reads it: ``input_ids``, ``kv_caches[2][0]``, ``self.lin.weight``,
    ``output[0]``."""
    detail: str
    """What is wrong with it, for the message."""
    expected_address: int | None = None
    actual_address: int | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None


def finding_message(
    wrapper: str, mode: CUDAGraphMode, descriptor: BatchDescriptor, findings: Sequence[Finding]
) -> str:
    """A message that names the graph, the wrapper, each finding (of the first one's kind) and the fix."""
    kind = findings[0].kind
    details = "; ".join(f.detail for f in findings if f.kind is kind)
    return (
        f"{kind.record.label} in graph {descriptor.key} ({mode.label}) of wrapper {wrapper!r}: {details}. "
        f"{kind.record.fix}."
    )


def moved(name: str, expected: int | None, actual: int | None, what: str = "input") -> Finding:
    """An address drift: ``name`` (an input, or the module's ``what``) is not at its captured address,
    or was no input at capture."""
    if expected is None:
        detail = f"{what} {name!r} was no tensor input at capture (now at {actual:#x}): the graph ignores it"
    elif actual is None:
        detail = f"{what} {name!r} was captured at {expected:#x} but is missing or no longer a tensor"
    else:
        detail = f"{what} {name!r} was captured at {expected:#x} but is now at {actual:#x}"
    return Finding(ViolationKind.ADDRESS_DRIFT, name, detail, expected, actual)


def relaid(name: str, address: int, changes: Sequence[str], what: str = "input") -> Finding:
    """A layout mismatch: ``name`` is at its captured address, read another way."""
    detail = f"{what} {name!r} is at its captured address {address:#x} but its {', '.join(changes)}"
    return Finding(ViolationKind.LAYOUT_MISMATCH, name, detail, address, address)
