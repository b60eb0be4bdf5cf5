"""Moves of a parameter's memory that no module hook sees, counted as they happen.

A CUDA graph reads each weight at the address it had at capture. ``param.data = new`` (an RL weight
sync, ``module.to()``), ``param.set_(other)`` and ``torch.utils.swap_tensors`` put a parameter over
other memory without assigning anything to its module, so PyTorch's registration hooks never hear of
it. Reading every captured weight's address at every replay finds them, and costs one cold
``data_ptr()`` per weight per step: inside vLLM on the H200 the FULL graph's replay guard took about
40 us a step that way, most of it those reads.

So the three ways are counted where they happen instead, and a replay guard compares one integer:

* ``torch.nn.Parameter.__setattr__`` is given a Python body that calls the one it had and counts an
  assignment to ``data`` (every parameter class that does not define its own inherits it; reading
  ``.data`` is untouched, so nothing torch.compile traces changes);
* ``torch.nn.Parameter.set_`` calls ``Tensor.set_`` and counts;
* ``torch.utils.swap_tensors`` calls the one it replaced and counts.

Each does exactly what it did before, plus one integer bump. A parameter whose class defines its own
``__setattr__`` or ``set_`` (so the counted ones may not run) is not counted here: its address stays
in the guard (``counted``). Buffers are plain tensors and are read at every replay as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DATA_SWAPS = [0]
"""How many times a parameter's memory was swapped in place (``.data =``, ``set_``,
``swap_tensors``) since the counting was installed (a one-element list: replay guards read it)."""
_installed = [False]


def watch_data_swaps() -> None:
    """Install the counting (once per process; it stays: each swap costs one integer bump)."""
    if _installed[0]:
        return
    setattr_before: Callable[[Any, str, Any], None] = nn.Parameter.__setattr__
    set_before = torch.Tensor.set_

    def __setattr__(self: Any, name: str, value: Any) -> None:
        setattr_before(self, name, value)
        if name == "data":
            DATA_SWAPS[0] += 1

    @functools.wraps(set_before)
    def set_(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = set_before(self, *args, **kwargs)
        DATA_SWAPS[0] += 1
        return result

    swap_before = torch.utils.swap_tensors

    @functools.wraps(swap_before)
    def swap_tensors(t1: Any, t2: Any) -> None:
        swap_before(t1, t2)
        DATA_SWAPS[0] += 1

    nn.Parameter.__setattr__ = __setattr__
    nn.Parameter.set_ = set_
    torch.utils.swap_tensors = swap_tensors
    _installed[0] = True


def counted(tensor: torch.Tensor) -> bool:
    """Whether a swap of this tensor's memory is counted: a parameter whose class keeps the counting
    ``__setattr__`` and ``set_`` (a class defining its own may bypass them)."""
    if not _installed[0] or not isinstance(tensor, nn.Parameter):
        return False
    kind, own = type(tensor), nn.Parameter.__dict__
    return kind.__setattr__ is own["__setattr__"] and kind.set_ is own["set_"]
