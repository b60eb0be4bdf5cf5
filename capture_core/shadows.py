"""What the graphs of one engine share about their per-step input buffers: versions, shadows, rows.

Graphs of different sizes read views of one static buffer, so what tells a written buffer from a
stale one belongs to the buffer, not to a graph (a step that writes the buffer, replays the 8-token
graph, then replays the 4-token graph without writing, is stale). Per buffer (one storage read as
one dtype), ``StepBuffers`` keeps:

* the version counter it had at its last replay (a one-element list the replay guard reads and
  updates in place), for buffers that have one (an inference tensor has none);
* a *shadow*: a tensor of the buffer's size on its device, into which every graph copies the rows it
  reads as part of its own work (``PerStepInputs.snapshot``, captured into the CUDA graph), so the
  values of the previous replay are at hand when a comparison needs them.

Per group (the per-step buffers one graph reads; every graph of a runner has the same group) it
keeps which rows held real tokens (``rows.RowStatus``), whether a write torch's counters do not see
was ever found in the group (``foreign``), and the comparison still on its way back from the device
(``pending``). A buffer read by two different groups has its padding rows checked in the first only:
the second could not know what the first's replays left in them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from capture_core.inputs import version_of
from capture_core.rows import RowStatus

if TYPE_CHECKING:
    from capture_core.stale import Comparison

BufferKey = tuple[int, torch.dtype, torch.device]


def buffer_key(tensor: torch.Tensor) -> BufferKey:
    return (tensor.untyped_storage().data_ptr(), tensor.dtype, tensor.device)


@dataclass(eq=False)
class StepBuffer:
    """One per-step buffer: its last replay's version (None: no counter) and its shadow."""

    tensor: torch.Tensor
    """The first tensor seen over this storage: kept, so the storage (and the key) stays its own."""
    version: list[int] | None
    shadow: torch.Tensor
    """The storage's elements, as a flat tensor: a view of it laid out as a graph's input is where
    that graph copies what it reads."""

    def shadow_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The shadow's part laid out as ``tensor`` (a view of this buffer's storage)."""
        return self.shadow.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


@dataclass(eq=False)
class StepGroup:
    """What the graphs that read one set of per-step buffers share."""

    rows: RowStatus | None
    """Which rows held real tokens (None: padding rows are not checked for this group)."""
    foreign: bool = False
    """True once an input of the group changed without its version counter moving: it is written by
    something torch does not see (a kernel, a numpy view, ``.data``), and an unchanged input may be
    one rewritten with equal values."""
    waiting: list[Comparison | None] = field(default_factory=lambda: [None])
    """The comparison whose result is still on its way back from the device (a one-element list: the
    replay guard of every graph of the group says no while it is there, so the next replay reads it)."""

    @property
    def pending(self) -> Comparison | None:
        return self.waiting[0]

    @pending.setter
    def pending(self, comparison: Comparison | None) -> None:
        self.waiting[0] = comparison


Report = Callable[[str, Any, Any, Sequence[Any]], None]
"""``report(wrapper, mode, descriptor, findings)``: the runtime's ``report_findings``."""


class StepBuffers:
    """The per-step buffers of one engine and their groups (one per ``GraphRuntime``)."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.buffers: dict[BufferKey, StepBuffer] = {}
        self.groups: dict[tuple[BufferKey, ...], StepGroup] = {}
        self._row_owner: dict[BufferKey, tuple[BufferKey, ...]] = {}

    def buffer(self, tensor: torch.Tensor) -> StepBuffer:
        """The record of the buffer ``tensor`` is a view of (made at its first capture)."""
        key = buffer_key(tensor)
        held = self.buffers.get(key)
        if held is None:
            storage = tensor.untyped_storage()
            with torch.inference_mode(False), torch.no_grad():  # our own tensor, updated in any mode
                shadow = torch.zeros(storage.nbytes() // tensor.element_size(), dtype=tensor.dtype,
                                     device=tensor.device)
            version = version_of(tensor)
            held = self.buffers[key] = StepBuffer(tensor, None if version is None else [version], shadow)
        return held

    def group(self, keys: Sequence[BufferKey], rows: Sequence[BufferKey]) -> StepGroup:
        """The group of a graph reading the buffers ``keys``; ``rows`` are those with a row per token
        whose padding rows the group checks (none: not checked), unless another group already reads
        one of them. The first graph of a group decides."""
        key = tuple(sorted(keys, key=repr))
        held = self.groups.get(key)
        if held is None:
            owned = bool(rows) and all(self._row_owner.get(k, key) == key for k in rows)
            if owned:
                self._row_owner.update(dict.fromkeys(rows, key))
            held = self.groups[key] = StepGroup(RowStatus() if owned else None)
        return held

    def settle(self) -> None:
        """Read back every comparison still on its way (a device sync) and report what it found."""
        for group in self.groups.values():
            if group.pending is not None:
                group.pending.settle()
