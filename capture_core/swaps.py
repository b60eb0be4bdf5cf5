"""Moves and re-layouts of a captured tensor's memory, counted where they happen.

A CUDA graph reads each tensor it was captured on at the address, and in the layout, it had then.
Python can change both under the same tensor object: ``t.data = new`` (an RL weight sync,
``module.to()``), ``t.set_(other)``, ``torch.utils.swap_tensors``, ``resize_``, ``as_strided_``,
``t_`` and the other in-place view methods, or a resize of the storage beneath. Re-reading every
captured tensor's address, shape and strides at every replay finds them, and costs a cold read of
each (inside vLLM on the H200 the replay guards took 19-24 us a step that way; on a CPU with its
caches evicted, the first call of each kind of tensor read, ``data_ptr()``, ``_version``, ``shape``,
``stride()``, cost more than everything else in the guard).

So they are counted where they happen instead, and a replay guard compares one integer with the
count it last checked at. A tensor is *watched* once a graph holds it (an input the capture saw, a
module's parameter or buffer; the base of a view, whose storage the view shares, too), and:

* ``torch.Tensor.__setattr__`` is given a Python body that calls the one it had and counts an
  assignment to ``data`` of a watched tensor (reading ``.data`` is untouched, so nothing
  torch.compile traces changes);
* ``set_``, ``resize_``, ``resize_as_``, ``as_strided_``, ``t_``, ``transpose_``, ``swapdims_``,
  ``swapaxes_``, ``squeeze_`` and ``unsqueeze_`` call the method they replaced and count when called
  on a watched tensor (these are common on other tensors, in an engine's sampler say: those are not
  counted, so they cost the guards nothing);
* ``torch.utils.swap_tensors`` counts when either tensor is watched;
* ``UntypedStorage.resize_`` and ``share_memory_`` always count (they move every tensor on the
  storage, and are rare).

Each does exactly what it did before, plus one integer bump. What is not counted: a tensor class
that defines one of these methods itself (``counted`` says no; the guard reads such a tensor at every
replay, as before), and a change made below Python (a C++ op resizing its ``out=`` tensor, a call
through ``torch.ops.aten``): the closer look on sampled replays (and every debug replay) re-reads
every tensor and finds those.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

DATA_SWAPS = [0]
"""How many times a watched tensor's memory was moved or re-laid out in place since the counting
was installed (a one-element list: replay guards read it)."""
LAYOUT_METHODS = ("set_", "resize_", "resize_as_", "as_strided_", "t_", "transpose_", "swapdims_",
                  "swapaxes_", "squeeze_", "unsqueeze_")
"""The in-place methods that change what memory a tensor object covers, or how it reads it."""
STORAGE_METHODS = ("resize_", "share_memory_")
"""The storage methods that move the memory of every tensor on the storage."""
_WATCHED: dict[int, list[Any]] = {}
"""id -> [tensor, how many holders watch it], for every tensor a graph holds. Held strongly while a
holder lives (a weak reference would make ``swap_tensors`` refuse the tensor), and let go with the
last holder, so a dead tensor's id is never taken for a live one's."""
_installed = [False]
_ours: dict[str, Any] = {}
"""Name -> the counting method installed on ``torch.Tensor`` (what ``counted`` compares with)."""


def watch_data_swaps() -> None:
    """Install the counting (once per process; it stays: each counted call costs one integer bump,
    each uncounted one a dictionary lookup)."""
    if _installed[0]:
        return
    setattr_before: Callable[[Any, str, Any], None] = torch.Tensor.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        setattr_before(self, name, value)
        if name == "data" and id(self) in _WATCHED:
            DATA_SWAPS[0] += 1

    _ours["__setattr__"] = torch.Tensor.__setattr__ = __setattr__
    for name in LAYOUT_METHODS:
        _ours[name] = _counting(torch.Tensor, name, watched_only=True)
    for name in STORAGE_METHODS:
        _counting(torch.UntypedStorage, name, watched_only=False)
    swap_before = torch.utils.swap_tensors

    @functools.wraps(swap_before)
    def swap_tensors(t1: Any, t2: Any) -> None:
        swap_before(t1, t2)
        if id(t1) in _WATCHED or id(t2) in _WATCHED:
            DATA_SWAPS[0] += 1

    torch.utils.swap_tensors = swap_tensors
    _installed[0] = True


def _counting(owner: type, name: str, watched_only: bool) -> Any:
    """``owner.name`` replaced by a method that calls it and counts (only on a watched tensor, where
    ``watched_only``)."""
    before = getattr(owner, name)

    @functools.wraps(before)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = before(self, *args, **kwargs)
        if not watched_only or id(self) in _WATCHED:
            DATA_SWAPS[0] += 1
        return result

    setattr(owner, name, method)
    return method


def watch(holder: object, tensors: Iterable[torch.Tensor]) -> None:
    """Count the moves of ``tensors`` (and of each one's base, when it is a view: resizing the base
    moves the storage they share) while ``holder`` (what checks them) lives."""
    watch_data_swaps()
    held = []
    for tensor in tensors:
        for one in (tensor, tensor._base):
            if one is not None:
                entry = _WATCHED.setdefault(id(one), [one, 0])
                entry[1] += 1
                held.append(id(one))
    weakref.finalize(holder, _release, held)


def _release(held: list[int]) -> None:
    for key in held:
        entry = _WATCHED.get(key)
        if entry is not None:
            entry[1] -= 1
            if not entry[1]:
                del _WATCHED[key]


def counted(tensor: torch.Tensor) -> bool:
    """Whether every move of this tensor is counted: it is watched, and its class keeps the counting
    methods (a class defining its own ``__setattr__``, ``set_``, ``resize_``... may bypass them)."""
    entry = _WATCHED.get(id(tensor))
    if not _installed[0] or entry is None or entry[0] is not tensor:
        return False
    kind = type(tensor)
    return all(getattr(kind, name) is method for name, method in _ours.items())
