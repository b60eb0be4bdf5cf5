"""Host values a graph baked in at capture: non-tensor arguments and the wrapped module's attributes.

A CUDA graph replays the kernels recorded at capture, with every host value they were launched with:
a Python float passed as an argument (a temperature, a logit scale), a flag that picked a branch on
the host, an int added to an index, an attribute the model read from itself (a LoRA scaling set by an
adapter switch, ``training``). The caller changing one later changes nothing in the graph. So at
capture every such value is kept, and a replay where one differs is a ``baked_value_changed``,
naming it and both values:

* the call's non-tensor arguments, at the top level and inside lists, tuples and dicts (an argument
  left out is its default; fields of objects and dataclasses, such as attention metadata whose host
  integers change every step, are not compared);
* the plain attributes (numbers, strings, bools, None, enums) of the wrapped module itself and, on
  sampled replays and in debug mode, of every module inside it (``self.layers.0.attn.scaling``).

The replay guard compares each argument as passed and each of the module's own attributes by
identity first, then by equality (``x is v or x == v``): one term per value, none for a call that
passes tensors only. A value the graph does not read (a request id, a step counter) is declared with
``unread`` and not kept; a name picks that argument or attribute and everything inside it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from capture_core.checks import Finding, ParameterNames
from capture_core.events import ViolationKind
from capture_core.inputs import Step, access_at, read_at

SCALARS = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)
"""What a graph bakes as a value (compared by equality)."""
MAX_VALUES = 256
"""How many values one call's arguments may hold before the rest is left unchecked (and named)."""
_MODULE_OWN = frozenset(nn.Module().__dict__) - {"training"}
"""nn.Module's own bookkeeping attributes (hook dicts and the like): never baked by a graph."""
_MISSING = object()
_OPAQUE = object()
"""An object that is no plain value (attention metadata, an engine's batch): its fields are the
eager code's business and are not compared."""


def same(a: Any, b: Any) -> bool:
    """Equal as a graph would see them (NaN equals NaN)."""
    if a is b:
        return True
    try:
        if a == b:
            return True
    except Exception:
        return False
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Argument:
    """One non-tensor value of a captured call, where it is, and what it was."""

    name: str
    root: int | str
    steps: tuple[Step, ...]
    value: Any

    def access(self) -> str:
        return access_at(self.root, self.steps)


def _values(value: Any, name: str, root: int | str, steps: tuple[Step, ...]) -> Iterator[Argument]:
    """The scalar values in ``value``, through lists, tuples and dicts; a tensor (the input checks'
    business) as itself, an object or a dataclass as ``_OPAQUE``: neither is compared."""
    if isinstance(value, (*SCALARS, torch.Tensor)):
        yield Argument(name, root, steps, value)
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        for i, item in enumerate(value):
            yield from _values(item, f"{name}[{i}]", root, (*steps, (False, i)))
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, (str, int)) and not isinstance(key, bool):
                yield from _values(item, f"{name}[{key!r}]", root, (*steps, (False, key)))
    else:
        yield Argument(name, root, steps, _OPAQUE)


def _compared(value: Any) -> bool:
    return value is not _OPAQUE and not isinstance(value, torch.Tensor)


def _picked(name: str, unread: Sequence[str]) -> bool:
    return any(name == u or name.startswith((f"{u}[", f"{u}.")) for u in unread)


def _bound(names: ParameterNames, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """Every parameter's value for this call, defaults included (None: the call does not bind)."""
    if names.signature is None:
        return None
    try:
        bound = names.signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


class BakedValues:
    """The host values one captured call baked in: its non-tensor arguments (when ``call``, the
    captured ``(args, kwargs)``, is given) and its module's attributes, and how a later call is
    compared with them."""

    def __init__(
        self,
        names: ParameterNames,
        call: tuple[Sequence[Any], Mapping[str, Any]] | None,
        module: nn.Module | None,
        unread: Sequence[str],
    ) -> None:
        self.names = names
        self.unread = tuple(unread)
        self.has_call = call is not None
        self.unchecked: list[str] = []
        self.passed: list[Argument] = []
        """The values as the call passed them: compared by the replay guard."""
        self.bound: dict[str, Any] | None = None
        """Every parameter's values, defaults included: compared by the closer look."""
        seen: list[str] = []
        if call is not None:
            args, kwargs = call
            found: list[Argument] = []
            for position, value in enumerate(args):
                found += _values(value, names.name_of(position), position, ())
            for key, value in kwargs.items():
                found += _values(value, key, key, ())
            found = [a for a in found if _compared(a.value)]
            if len(found) > MAX_VALUES:
                first, count = found[MAX_VALUES].name, len(found)
                self.unchecked.append(f"{first} and after ({count} values, over {MAX_VALUES}: not checked)")
            seen += [a.name for a in found]
            self.passed = [a for a in found[:MAX_VALUES] if not _picked(a.name, self.unread)]
            bound = _bound(names, args, kwargs)
            if bound is not None:
                self.bound = self._bound_values(bound)
                seen += [a.name for p, v in bound.items() for a in _values(v, p, p, ())]
        self.own: list[tuple[nn.Module, str, str, Any]] = []
        """``(module, attribute, name, value)`` of the wrapped module's own plain attributes."""
        self.inner: list[tuple[nn.Module, str, str, Any]] = []
        """The same for every module inside it (compared on sampled replays)."""
        if module is not None:
            for prefix, owner in module.named_modules(remove_duplicate=False):
                held = self.own if owner is module else self.inner
                for attribute, value in vars(owner).items():
                    name = f"self.{prefix}.{attribute}" if prefix else f"self.{attribute}"
                    if attribute in _MODULE_OWN or not isinstance(value, SCALARS):
                        continue
                    seen.append(name)
                    if not _picked(name, self.unread):
                        held.append((owner, attribute, name, value))
        self.unknown = [u for u in self.unread if (u.startswith("self.") or call is not None)
                        and not any(_picked(name, [u]) for name in seen)]
        """The ``unread`` names that pick no baked argument or attribute (a mistake to say)."""

    def _bound_values(self, bound: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for parameter, value in bound.items():
            for found in _values(value, parameter, parameter, ()):
                if not _picked(found.name, self.unread):
                    values[found.name] = found.value
        return values

    def find_changes(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, deep: bool) -> list[Finding]:
        """Every baked value that differs now (the arguments by parameter, defaults included; the
        module's own attributes; with ``deep``, every inner module's too)."""
        findings = []
        now = None if self.bound is None else _bound(self.names, args, kwargs)
        if now is not None and self.bound is not None:
            current = self._bound_values(now)
            for name in dict.fromkeys([*self.bound, *current]):
                was, is_ = self.bound.get(name, _MISSING), current.get(name, _MISSING)
                if _compared(was) and _compared(is_) and not same(was, is_):
                    findings.append(_changed("argument", name, was, is_))
        else:
            for argument in self.passed:
                try:
                    value = read_at(argument.root, argument.steps, args, kwargs)
                except (LookupError, TypeError, AttributeError):
                    value = _MISSING
                if _compared(value) and not same(argument.value, value):
                    findings.append(_changed("argument", argument.name, argument.value, value))
        for owner, attribute, name, value in (*self.own, *(self.inner if deep else ())):
            current_value = vars(owner).get(attribute, _MISSING)
            if not same(value, current_value):
                findings.append(_changed("attribute", name, value, current_value))
        return findings

    def argument_terms(self) -> list[tuple[str, Any]]:
        """``(access expression, value)`` per argument as passed: compared on every replay."""
        return [(a.access(), a.value) for a in self.passed]

    def attribute_terms(self) -> list[tuple[dict[str, Any], str, Any]]:
        """``(the module's __dict__, attribute, value)`` per own attribute: compared on every replay."""
        return [(vars(owner), attribute, value) for owner, attribute, _, value in self.own]


def _changed(what: str, name: str, was: Any, now: Any) -> Finding:
    gone = "is gone" if now is _MISSING else f"is {shown(now)} now"
    then = "absent" if was is _MISSING else shown(was)
    detail = f"{what} {name!r} was {then} at capture and {gone}: the graph replays what it captured"
    return Finding(ViolationKind.BAKED_VALUE_CHANGED, name, detail)
