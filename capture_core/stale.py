"""Stale static inputs: a per-step input that nobody wrote since the previous replay.

A forgotten ``copy_`` leaves the static input holding the previous step's values, and the graph
computes the previous step again, at the right address with the right layout: no other check can
see it. Which inputs are per-step is declared (the runners know theirs; a wrapper takes the names
as ``per_step_inputs``), and two ways tell whether one was written:

* always on: PyTorch's version counter, which every in-place write bumps (``copy_``, ``fill_``,
  an indexed assignment; a view shares its base's counter). A replay whose input's counter has not
  moved since the previous replay of any graph reading that buffer is stale. One attribute read per
  input; it needs the tensor to have a counter, which tensors made under ``torch.inference_mode()``
  do not.
* in debug mode: a sentinel. After each replay the inputs are filled with a value no real input
  holds (the most negative integer of an integer dtype, NaN for a float), and an input still
  holding it at the next replay was not (fully) written. It works for every tensor, inference
  tensors included; it reads the input back (a device sync) and leaves the sentinel in the buffer
  between steps, so it is for debugging and CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from capture_core.checks import Finding
from capture_core.events import ViolationKind
from capture_core.inputs import TensorInput, compare


def sentinel_of(dtype: torch.dtype) -> int | float | None:
    """The value no real input of ``dtype`` holds, or None where every value is plausible."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return torch.iinfo(dtype).min
    return None


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


class VersionCells:
    """The version each buffer had at its last replay, shared by every graph that reads it.

    Keyed by the buffer that owns the memory (a view's ``_base``), because graphs of different
    sizes read different views of one static buffer and share its counter: a step that writes the
    buffer and replays the 8-token graph, then replays the 4-token graph without writing, is stale.
    """

    def __init__(self) -> None:
        self._cells: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def cell(self, tensor: torch.Tensor, version: int) -> list[int]:
        base = tensor if tensor._base is None else tensor._base
        held = self._cells.get(id(base))
        if held is None or held[0] is not base:
            held = self._cells[id(base)] = (base, [version])
        return held[1]


class PerStepInputs:
    """The declared per-step inputs of one graph, and the state that tells a stale one."""

    def __init__(self, inputs: Sequence[TensorInput], cells: VersionCells) -> None:
        self.inputs = tuple(inputs)
        self.versioned: list[tuple[TensorInput, list[int]]] = []
        """Inputs with a version counter, each with its buffer's shared last-replay version."""
        self.unchecked: list[str] = []
        for spec in self.inputs:
            version = _version(spec.tensor)
            if version is None:
                self.unchecked.append(
                    f"{spec.name} (an inference tensor, without a version counter: found stale only in "
                    "debug mode)"
                )
            else:
                cell = cells.cell(spec.tensor, version)
                # Inputs that share a buffer share its counter: one of them speaks for all.
                if all(cell is not held for _, held in self.versioned):
                    self.versioned.append((spec, cell))
            if sentinel_of(spec.tensor.dtype) is None:
                self.unchecked.append(
                    f"{spec.name} ({spec.tensor.dtype} has no sentinel value: not checked in debug mode)"
                )

    def displaced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
        """The inputs this call does not pass at their captured place: another tensor there is a
        drift (reported as one where inputs are checked), not a stale input."""
        names = set()
        for spec in self.inputs:
            try:
                value = spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                value = None
            if compare(spec.name, spec.tensor, spec.key, value, deep=False) is not None:
                names.add(spec.name)
        return names

    def stale_by_version(self, skip: set[str]) -> list[Finding]:
        """The inputs whose counter did not move since the previous replay; notes the counters."""
        findings = []
        for spec, cell in self.versioned:
            version = spec.tensor._version
            if version == cell[0] and spec.name not in skip:
                findings.append(_stale(spec, "its version counter did not move"))
            cell[0] = version
        return findings

    def stale_by_sentinel(self, skip: set[str]) -> list[Finding]:
        """The inputs still holding the sentinel of the previous replay (reads them back)."""
        findings = []
        for spec in self.inputs:
            sentinel = sentinel_of(spec.tensor.dtype)
            if sentinel is None or spec.name in skip:
                continue
            left = spec.tensor.isnan() if sentinel != sentinel else spec.tensor == sentinel
            count = int(left.sum())
            if count:
                what = f"{count} of {spec.tensor.numel()} elements still hold the debug sentinel"
                findings.append(_stale(spec, what))
        return findings

    def poison(self) -> None:
        """Fill every input with its sentinel (after a debug replay), then note the new counters."""
        for spec in self.inputs:
            sentinel = sentinel_of(spec.tensor.dtype)
            if sentinel is not None:
                spec.tensor.fill_(sentinel)
        for spec, cell in self.versioned:
            cell[0] = spec.tensor._version

    def guard_terms(self) -> list[tuple[torch.Tensor, list[int]]]:
        """``(tensor, cell)`` per buffer with a counter, for the replay guard."""
        return [(spec.tensor, cell) for spec, cell in self.versioned]


def _stale(spec: TensorInput, why: str) -> Finding:
    detail = f"input {spec.name!r} was not written since the previous replay ({why})"
    return Finding(ViolationKind.STALE_INPUT, spec.name, detail, spec.address, spec.address)
