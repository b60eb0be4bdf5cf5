"""Every tensor a graph reads through its call's arguments: found once at capture, checked at replay.

A CUDA graph bakes in the address *and* the layout of every tensor it reads: its kernels were
recorded for that shape, those strides, that dtype, at that place. The walk finds tensors wherever
engines put them - positional and keyword arguments, lists and tuples at any depth, dicts,
dataclasses, named tuples and plain objects with tensor attributes - and names each as a user
reads it (``kv_caches[2][0]``, ``extras['bias']``, ``metadata.seq_lens``). Depth and count are
bounded; anything that cannot be walked (a set, an iterator, a dict key that is not a string or an
integer, more tensors than the bound) is named in the capture record with the reason, never
skipped in silence.

At replay the cheap question is "is every one of these the very tensor object captured?", asked
by the graph's guard (``capture_core.guard``) as one flat expression. Only when the answer is no
does ``find_changes`` look closer: a different object at the captured address with the captured
layout is fine (a fresh view of the static buffer); anything else is an ``address_drift`` (other
address, or gone) or a ``layout_mismatch`` (same address, other shape, strides, storage offset,
dtype or device) naming what changed. The very object captured can change in place too (``set_``,
``resize_``, ``as_strided_``, ``t_()``, ``.data =``): the guard reads its address on every replay
and its shape and strides whenever its version counter moved (each of those ops moves it), and
``find_changes(deep=True)`` (every closer look) re-reads the layout of the very objects captured.
"""

from __future__ import annotations

import dataclasses
import enum
import keyword
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from capture_core.checks import Finding, ParameterNames, moved, relaid

MAX_DEPTH = 8
"""How many containers deep the walk goes below an argument."""
MAX_TENSORS = 4096
"""How many tensors one call may hand a graph before the rest is named as not walked."""
MAX_NODES = 20_000
"""How many values the walk visits in all (plain objects can reach far)."""

_LEAVES = (
    type(None), bool, int, float, complex, str, bytes, enum.Enum, slice, range,
    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
)


LayoutKey = tuple[int, torch.Size, tuple[int, ...], int, torch.dtype, torch.device]
"""``(address, shape, strides, storage offset, dtype, device)``: compared as one tuple, because
building it is a third of the cost of building a ``TensorLayout`` and that is paid per replay."""


def version_of(tensor: torch.Tensor) -> int | None:
    """A tensor's version counter (every in-place op moves it), or None: an inference tensor has none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def layout_key(tensor: torch.Tensor) -> LayoutKey:
    t = tensor
    return (t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)


@dataclass(frozen=True)
class TensorLayout:
    """Where a tensor is and how its memory is read: what a graph bakes in for it."""

    address: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_key(cls, key: LayoutKey) -> TensorLayout:
        address, shape, stride, offset, dtype, device = key
        return cls(address, tuple(shape), stride, offset, dtype, device)

    def changes_to(self, now: TensorLayout) -> tuple[str, ...]:
        """What differs besides the address, each as ``shape (8,) -> (4,)``."""
        fields = ("shape", "stride", "storage_offset", "dtype", "device")
        labels = {"stride": "strides", "storage_offset": "storage offset"}
        return tuple(
            f"{labels.get(name, name)} {getattr(self, name)} -> {getattr(now, name)}"
            for name in fields
            if getattr(self, name) != getattr(now, name)
        )


def compare(
    name: str, tensor: torch.Tensor, key: LayoutKey, value: Any, *, deep: bool, what: str = "input"
) -> Finding | None:
    """What is wrong with ``value`` where the graph captured ``tensor`` (laid out as ``key``).

    The captured object itself is taken as unchanged unless ``deep``; another object is fine when it
    has the captured address and layout (a fresh view of the static buffer).
    """
    if value is tensor and not deep:
        return None
    if not isinstance(value, torch.Tensor):
        return moved(name, key[0], None, what)
    now = layout_key(value)
    if now == key:
        return None
    if now[0] != key[0]:
        return moved(name, key[0], now[0], what)
    return relaid(name, key[0], TensorLayout.from_key(key).changes_to(TensorLayout.from_key(now)), what)


Step = tuple[bool, Any]
"""One step down from an argument: ``(True, name)`` reads an attribute, ``(False, key)`` indexes."""


@dataclass(frozen=True)
class TensorInput:
    """One tensor a graph baked in: where it sits in the call, the object, and its captured layout."""

    name: str
    root: int | str
    """The argument it is reached from: a position, or a keyword."""
    steps: tuple[Step, ...]
    """The way down from that argument (empty for the argument itself)."""
    tensor: torch.Tensor
    """The captured object, kept: "is it still this object?" is the cheap replay check."""
    key: LayoutKey

    @property
    def address(self) -> int:
        return self.key[0]

    def access(self) -> str:
        """A Python expression that reads this input from ``args``/``kwargs`` (the guard's term)."""
        return access_at(self.root, self.steps)

    def read(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The value at this input's place in a call (``LookupError`` etc. when it is not there)."""
        return read_at(self.root, self.steps, args, kwargs)


def access_at(root: int | str, steps: tuple[Step, ...]) -> str:
    """A Python expression that reads the value at ``root`` and ``steps`` from ``args``/``kwargs``."""
    text = f"args[{root}]" if isinstance(root, int) else f"kwargs[{root!r}]"
    for is_attribute, key in steps:
        if not is_attribute:
            text += f"[{key!r}]"
        elif key.isidentifier() and not keyword.iskeyword(key):
            text += f".{key}"
        else:
            text = f"getattr({text}, {key!r})"
    return text


def read_at(root: int | str, steps: tuple[Step, ...], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The value at ``root`` and ``steps`` of a call (``LookupError`` etc. when it is not there)."""
    value = args[root] if isinstance(root, int) else kwargs[root]
    for is_attribute, key in steps:
        value = getattr(value, key) if is_attribute else value[key]
    return value


class _Walk:
    """One walk over a call's arguments: the tensors found and what could not be walked."""

    def __init__(self) -> None:
        self.inputs: list[TensorInput] = []
        self.unchecked: list[str] = []
        self.nodes = 0

    def visit(
        self, value: Any, name: str, root: int | str, steps: tuple[Step, ...], seen: frozenset[int]
    ) -> None:
        self.nodes += 1
        if isinstance(value, torch.Tensor):
            if len(self.inputs) < MAX_TENSORS:
                self.inputs.append(TensorInput(name, root, steps, value, layout_key(value)))
            else:
                self.unchecked.append(f"{name} (more than {MAX_TENSORS} tensor inputs: not checked)")
            return
        if isinstance(value, torch.nn.Module):
            self.unchecked.append(f"{name} (an nn.Module argument: its state is not checked)")
            return
        if isinstance(value, _LEAVES) or id(value) in seen:  # a leaf, or a cycle back up this path
            return
        children = self._children(value, name)
        if not children:
            return
        if len(steps) >= MAX_DEPTH or self.nodes >= MAX_NODES:
            if _holds_tensors(value):
                self.unchecked.append(f"{name} (deeper than {MAX_DEPTH} levels or too large: not checked)")
            return
        inner = seen | {id(value)}
        for child_name, step, child in children:
            self.visit(child, child_name, root, (*steps, step), inner)

    def _children(self, value: Any, name: str) -> list[tuple[str, Step, Any]]:
        """The values inside ``value``, each with its name and its step down; none for a leaf."""
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple: by field, read by index
            return [(f"{name}.{field}", (False, i), value[i]) for i, field in enumerate(value._fields)]
        if isinstance(value, (list, tuple)):
            return [(f"{name}[{i}]", (False, i), item) for i, item in enumerate(value)]
        if isinstance(value, dict):
            return self._items(value, name)
        if isinstance(value, (set, frozenset, Iterator)):
            reason = "an iterator: walking it would consume it" if isinstance(value, Iterator) else (
                f"a {type(value).__name__}: its items have no stable name"
            )
            if isinstance(value, Iterator) or _holds_tensors(value):
                self.unchecked.append(f"{name} ({reason})")
            return []
        if dataclasses.is_dataclass(value):
            attributes = [f.name for f in dataclasses.fields(value)]
        else:
            attributes = list(getattr(value, "__dict__", None) or ())
            slots = (s for cls in type(value).__mro__ for s in getattr(cls, "__slots__", ()))
            attributes += [s for s in slots if s not in attributes and hasattr(value, s)]
        return [(f"{name}.{attr}", (True, attr), getattr(value, attr)) for attr in attributes]

    def _items(self, mapping: dict[Any, Any], name: str) -> list[tuple[str, Step, Any]]:
        children = []
        for key, item in mapping.items():
            if isinstance(key, (str, int)) and not isinstance(key, bool):
                children.append((f"{name}[{key!r}]", (False, key), item))
            elif _holds_tensors(item):
                self.unchecked.append(f"{name}[{key!r}] (a {type(key).__name__} dict key: not checked)")
        return children


def _holds_tensors(value: Any, budget: int = 1000) -> bool:
    """Whether a tensor is reachable in ``value`` through containers (bounded)."""
    stack = [value]
    while stack and budget:
        budget -= 1
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(getattr(item, "__dict__", None), dict) and not isinstance(item, _LEAVES):
            stack.extend(vars(item).values())
    return False


class InputLayout:
    """The tensor inputs of one captured call, with what the graph baked in for each."""

    def __init__(
        self,
        inputs: Sequence[TensorInput],
        unchecked: Sequence[str] = (),
        arity: tuple[int, int] = (0, 0),
        parameter_names: ParameterNames | None = None,
    ) -> None:
        self.inputs: tuple[TensorInput, ...] = tuple(inputs)
        self.unchecked: tuple[str, ...] = tuple(unchecked)
        """Inputs the walk could not check, each with the reason (shown in the capture record)."""
        self.arity = arity
        """How many positional and keyword arguments the captured call had."""
        self.parameter_names = parameter_names or ParameterNames()

    @classmethod
    def record(cls, names: ParameterNames, args: Sequence[Any], kwargs: Mapping[str, Any]) -> InputLayout:
        """Walk every argument of a call and note each tensor in it, with its place and layout."""
        walk = _Walk()
        for position, value in enumerate(args):
            walk.visit(value, names.name_of(position), position, (), frozenset())
        for key, value in kwargs.items():
            walk.visit(value, key, key, (), frozenset())
        return cls(walk.inputs, walk.unchecked, (len(args), len(kwargs)), names)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def addresses(self) -> tuple[int, ...]:
        return tuple(i.address for i in self.inputs)

    def named(self, wanted: Sequence[str]) -> list[TensorInput]:
        """The inputs a list of names picks: each name picks that input and everything inside it
        (``kv_caches`` picks ``kv_caches[0]``, ...); a name that picks nothing is an error."""
        picked: list[TensorInput] = []
        for name in wanted:
            found = [i for i in self.inputs if i.name == name or i.name.startswith((f"{name}[", f"{name}."))]
            if not found:
                known = ", ".join(self.names) or "none"
                raise ValueError(f"{name!r} names no tensor input of this call (its tensor inputs: {known})")
            picked.extend(i for i in found if i not in picked)
        return picked

    def find_changes(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, deep: bool = False
    ) -> list[Finding]:
        """Every input that is not as captured, and every tensor the call passes that was no input at
        capture; ``deep`` also re-reads the layout of the very objects captured."""
        findings = []
        for spec in self.inputs:
            try:
                value = spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                value = None
            finding = compare(spec.name, spec.tensor, spec.key, value, deep=deep)
            if finding is not None:
                findings.append(finding)
        findings.extend(self._new_inputs(args, kwargs))
        return findings

    def _new_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[Finding]:
        """Tensors the call passes now that were no input at capture (an argument added, or one that
        held none, such as a None): the graph never reads them."""
        known, held = set(self.names), {spec.root for spec in self.inputs}
        walk = _Walk()
        for position, value in enumerate(args):
            if position not in held:
                walk.visit(value, self.parameter_names.name_of(position), position, (), frozenset())
        for key, value in kwargs.items():
            if key not in held:
                walk.visit(value, key, key, (), frozenset())
        for found in walk.inputs:
            if found.name not in known:
                yield moved(found.name, None, found.address)
