"""Address checks: does every tensor a graph baked in still live where it was captured?

A CUDA graph reads and writes fixed device addresses. If the caller passes a *new* tensor at
replay (instead of ``copy_``-ing into the captured one), the graph silently computes on stale
memory. vLLM compares only positional inputs and only under debug logging; here every tensor
input is checked - positional and keyword, and one level inside lists/tuples such as
``kv_caches[3]`` - by name, in one of three modes chosen by configuration.

The replay-time check is a loop over index tuples precomputed at capture; names, signatures and
stacks are only worked out once something has drifted.
"""

from __future__ import annotations

import enum
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode

DEBUG_ENV = "GRAPH_INSPECTOR_DEBUG"
"""Set to 1 to force DEBUG checks in this process (the pytest plugin does, for CI runs)."""


class GraphCacheError(RuntimeError):
    """A misuse of the graph cache that the caller must fix; the message says how."""


class AddressDriftError(GraphCacheError):
    """Raised in DEBUG mode when a replayed graph's input is no longer at its captured address."""


class AddressCheckMode(str, enum.Enum):
    """How replays check input addresses."""

    OFF = "off"
    ALWAYS_ON = "always_on"
    """Cheap: compare data pointers each replay; on drift emit an event and keep replaying."""
    DEBUG = "debug"
    """Like ALWAYS_ON, but a drift raises ``AddressDriftError`` after the event is emitted."""

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
    """How to name a callable's inputs: its positional parameter names and its ``*args`` name."""

    positional: tuple[str, ...] = ()
    var_positional: str | None = None

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
        return cls(tuple(positional), var_positional)

    def name_of(self, position: int) -> str:
        """``input_ids`` for a named parameter; ``args[3]`` (by position) when unnamed."""
        if position < len(self.positional):
            return self.positional[position]
        if self.var_positional is not None:
            return f"{self.var_positional}[{position - len(self.positional)}]"
        return f"args[{position}]"


@dataclass(frozen=True)
class TensorInput:
    """One tensor a graph baked in: where it sits in the call, and its captured address."""

    name: str
    keyword: str | None
    """The keyword it was passed under, or None when passed by position."""
    position: int
    """Its index among the positional arguments (unused for keyword inputs)."""
    item: int
    """Its index inside a list/tuple argument, or -1 for a bare tensor."""
    address: int


@dataclass(frozen=True)
class Drift:
    """One input found away from its captured address (``actual`` None: it is gone or not a tensor)."""

    name: str
    expected: int
    actual: int | None


class InputLayout:
    """The tensor inputs of one captured call, with the addresses the graph baked in."""

    def __init__(self, inputs: Sequence[TensorInput]) -> None:
        self.inputs: tuple[TensorInput, ...] = tuple(inputs)
        # The replay-time loops hold (where, address) only: no names, no attribute lookups. Bare
        # positional tensors (the common case) get a loop of their own without the item branch.
        self._bare_positional = tuple(
            (i.position, i.address) for i in inputs if i.keyword is None and i.item < 0
        )
        self._nested_positional = tuple(
            (i.position, i.item, i.address) for i in inputs if i.keyword is None and i.item >= 0
        )
        self._keyword = tuple((i.keyword, i.item, i.address) for i in inputs if i.keyword is not None)

    @classmethod
    def record(
        cls, names: ParameterNames, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> InputLayout:
        """Note every tensor input of a call: positional, keyword, and one level inside lists/tuples."""
        inputs: list[TensorInput] = []
        for position, value in enumerate(args):
            inputs.extend(_tensors_in(names.name_of(position), None, position, value))
        for keyword, value in kwargs.items():
            inputs.extend(_tensors_in(keyword, keyword, -1, value))
        return cls(inputs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def addresses(self) -> tuple[int, ...]:
        return tuple(i.address for i in self.inputs)

    def find_drift(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Drift]:
        """Every input not at its captured address; an empty list (the common case) costs one loop."""
        try:
            for position, address in self._bare_positional:
                if args[position].data_ptr() != address:
                    return self._drifts(args, kwargs)
            for position, item, address in self._nested_positional:
                if args[position][item].data_ptr() != address:
                    return self._drifts(args, kwargs)
            for keyword, item, address in self._keyword:
                value = kwargs[keyword] if item < 0 else kwargs[keyword][item]
                if value.data_ptr() != address:
                    return self._drifts(args, kwargs)
        except (IndexError, KeyError, TypeError, AttributeError):
            # The call no longer has the captured shape (an input moved, vanished or changed type).
            return self._drifts(args, kwargs)
        return []

    def _drifts(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Drift]:
        drifts = []
        for spec in self.inputs:
            actual = _address_at(spec, args, kwargs)
            if actual != spec.address:
                drifts.append(Drift(spec.name, spec.address, actual))
        return drifts


def _tensors_in(name: str, keyword: str | None, position: int, value: Any) -> list[TensorInput]:
    if isinstance(value, torch.Tensor):
        return [TensorInput(name, keyword, position, -1, value.data_ptr())]
    if isinstance(value, (list, tuple)):
        return [
            TensorInput(f"{name}[{index}]", keyword, position, index, item.data_ptr())
            for index, item in enumerate(value)
            if isinstance(item, torch.Tensor)
        ]
    return []


def _address_at(spec: TensorInput, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    try:
        value = kwargs[spec.keyword] if spec.keyword is not None else args[spec.position]
        if spec.item >= 0:
            value = value[spec.item]
    except (IndexError, KeyError, TypeError):
        return None
    return value.data_ptr() if isinstance(value, torch.Tensor) else None


def drift_message(
    wrapper: str, mode: CUDAGraphMode, descriptor: BatchDescriptor, drifts: Sequence[Drift]
) -> str:
    """A message that names the graph, each drifted input and both addresses, and the fix."""
    parts = [
        f"input {d.name!r} was captured at {d.expected:#x} but is "
        + ("missing or no longer a tensor" if d.actual is None else f"now at {d.actual:#x}")
        for d in drifts
    ]
    return (
        f"address drift in graph {descriptor.key} ({mode.label}) of wrapper {wrapper!r}: "
        + "; ".join(parts)
        + ". The graph reads the captured memory, so it would compute on stale values: copy new "
        "values into the captured tensor with copy_() instead of passing a new tensor."
    )
