"""A graph output read after a later replay overwrote it (``stale_output``, debug mode).

A graph writes its outputs into the same memory at every replay, and the decode runner hands back
views of it (``logits[:num_tokens]``). An engine that keeps such a view past the next replay of the
same graph and reads it then (speculative decoding's verify step, reading the draft's logits after
the draft graph ran again) reads the later step's values, silently.

In debug mode every output tensor a replay hands back is a ``HandedOutput``: a view of the same
memory (no copy) that knows the replay it came from. Any torch operation on it, or on a view of it,
first asks whether a later replay of its graph has handed out that memory again; if so, the read is a
``stale_output``, reported and raised (``StaleOutputError``) naming the output and both replays.
What an operation computes from an output is a plain tensor, so the marker goes no further than the
views of the graph's own memory; reading a tensor's shape, dtype or device is no read of its values.
Outside debug mode outputs are handed back as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from capture_core.checks import Finding
from capture_core.events import ViolationKind

Report = Callable[[Sequence[Finding]], None]


class Handouts:
    """What one graph has handed out: per output memory (a storage's address), the replay that last
    handed it out; and how a stale read is reported."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.replays = 0
        self.latest: dict[int, int] = {}

    def hand_out(self, outputs: Any) -> Any:
        """After a replay: ``outputs`` with every tensor marked with this replay (views, no copies)."""
        self.replays += 1
        replay = self.replays

        def mark(name: str, tensor: torch.Tensor) -> torch.Tensor:
            self.latest[_storage(tensor)] = replay
            return _handed(tensor, (self, replay, name))

        return _map_tensors(outputs, "output", mark)

    def check(self, tensor: HandedOutput) -> None:
        handouts, replay, name = tensor._handout
        later = handouts.latest.get(_storage(tensor), replay)
        if later > replay:
            detail = (
                f"output {name!r} of replay {replay} was read after replay {later} of the same graph "
                "wrote that memory again: it holds the later step's values"
            )
            handouts.report([Finding(ViolationKind.STALE_OUTPUT, name, detail)])


def _storage(tensor: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage().data_ptr()


def _handed(tensor: torch.Tensor, handout: tuple[Handouts, int, str]) -> HandedOutput:
    with torch._C.DisableTorchFunctionSubclass():
        view = tensor.as_subclass(HandedOutput)
    view._handout = handout
    return view


_METADATA = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "names"})
"""Attributes that read a tensor's metadata, not its values."""
_METADATA_METHODS = frozenset({
    "data_ptr", "size", "stride", "dim", "numel", "storage_offset", "untyped_storage", "is_contiguous",
    "element_size", "__len__",
})
"""Methods that read a tensor's metadata, not its values (the replay guard's own reads among them)."""


class HandedOutput(torch.Tensor):
    """A graph output handed out in debug mode: a plain view of the graph's memory that checks, at
    every operation on it, that no later replay of its graph has written that memory again."""

    _handout: tuple[Handouts, int, str]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        handed = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, HandedOutput)]
        if not _metadata(func):
            for tensor in handed:
                tensor._handout[0].check(tensor)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if not handed:
            return result
        source = handed[0]
        memory = _storage(source)

        def keep(_: str, tensor: torch.Tensor) -> torch.Tensor:
            if _storage(tensor) != memory:  # computed from the output: a plain tensor
                return tensor
            return _handed(tensor, source._handout)

        return _map_tensors(result, "", keep)


def _metadata(func: Any) -> bool:
    """Whether ``func`` reads a tensor's metadata only (``x.shape``, ``x.data_ptr()``)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA
    return name in _METADATA_METHODS


def _map_tensors(value: Any, name: str, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(name, value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, f"{name}[{i}]", fn) for i, v in enumerate(value))
    if isinstance(value, list):
        return [_map_tensors(v, f"{name}[{i}]", fn) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _map_tensors(v, f"{name}[{k!r}]", fn) for k, v in value.items()}
    return value
