"""Stale static inputs: a per-step input nobody wrote since the previous replay, whatever the writer.

A forgotten ``copy_`` leaves the static input holding the previous step's values, and the graph
computes the previous step again, at the right address with the right layout: no other check can
see it. Which inputs are per-step is declared (the runners know theirs; a wrapper takes the names
as ``per_step_inputs``). An input counts as written when either of two signals says so:

* its version counter moved since the previous replay of its buffer: every torch op that writes it
  moves it (``copy_``, an indexed write, ``add_``); free to read, and exact for torch's writes;
* its values differ from those it held at that replay: every graph copies its per-step inputs into
  a shadow as part of its own work (``snapshot``: inside the captured CUDA graph, no host cost), so
  the previous replay's values are on the device when the closer look compares (``Comparison``).

The comparison runs when a counter did not move (a Triton or CUDA kernel, a numpy view or a write
through ``.data`` wrote the buffer, which no counter sees; an inference tensor has no counter; or
nothing wrote it) and on every debug replay. A step that wrote none of its per-step inputs is stale.
An input left unwritten while others were written is stale while the group's writes have all been
seen by torch's counters; once any input of the group changed without its counter moving, an
unchanged input is taken as one rewritten with equal values (a slot that stays, a repeated token).

For inputs with a row per token, the padding rows are checked too: a padding row that held a real
token at the replay that last read it (``rows.RowStatus``) and whose values in every token-row input
are unchanged was not rewritten, and would write that earlier request's KV slot again. An engine
whose kernels never read padding rows says so (``padding_rewritten=False``).

Where the comparison's result is read: at once on the CPU and in debug mode (which raises at the
faulty replay; on CUDA it synchronises); on CUDA in always-on mode it is copied to pinned host
memory without a sync and read at the group's next closer look (or ``GraphRuntime.settle_checks()``),
and the finding names the replay it was found at. Nothing here ever writes an engine's buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from capture_core.checks import Finding
from capture_core.events import ViolationKind
from capture_core.inputs import TensorInput, compare, version_of
from capture_core.rows import Entry, RowStatus
from capture_core.shadows import StepBuffers, buffer_key

Report = Callable[[Sequence[Finding]], None]
"""Reports findings found late (a comparison read back after its replay), as the wrapper would."""


class PerStepInputs:
    """The declared per-step inputs of one graph, and what tells a stale one or a stale padding row.

    ``size`` is the graph's token count: an input whose first dimension is that long has a row per
    token, and with ``check_padding`` its padding rows are checked. ``report`` reports findings of a
    comparison read back after its replay.
    """

    def __init__(
        self,
        inputs: Sequence[TensorInput],
        buffers: StepBuffers,
        size: int,
        check_padding: bool,
        report: Report,
    ) -> None:
        self.inputs = tuple(inputs)
        self.size = size
        self.report = report
        self.records = [buffers.buffer(spec.tensor) for spec in self.inputs]
        pairs = list(zip(self.inputs, self.records, strict=True))
        self.shadows = [record.shadow_of(spec.tensor) for spec, record in pairs]
        self.token_rows = [
            i for i, spec in enumerate(self.inputs) if spec.tensor.dim() >= 1 and spec.tensor.shape[0] == size
        ]
        keys = [buffer_key(spec.tensor) for spec in self.inputs]
        row_keys = [keys[i] for i in self.token_rows] if check_padding else []
        self.group = buffers.group(keys, row_keys)
        self.rows: RowStatus | None = self.group.rows if self.token_rows else None
        self.versioned: list[tuple[TensorInput, list[int]]] = []
        """One input per buffer with a version counter, with the buffer's last-replay version."""
        self.uncounted = [spec.name for spec, record in pairs if record.version is None]
        self.unchecked: list[str] = []
        for spec, record in pairs:
            if record.version is not None and all(cell is not record.version for _, cell in self.versioned):
                self.versioned.append((spec, record.version))
        if row_keys and self.group.rows is None:
            names = ", ".join(self.inputs[i].name for i in self.token_rows)
            self.unchecked.append(
                f"{names} (padding rows not checked: another graph group reads these buffers)"
            )

    def snapshot(self) -> None:
        """Copy every per-step input into its shadow: part of each replay (captured into the graph)."""
        with torch.no_grad():
            for shadow, spec in zip(self.shadows, self.inputs, strict=True):
                shadow.copy_(spec.tensor)

    @property
    def always_look(self) -> bool:
        """Whether every replay needs the closer look (an input without a version counter)."""
        return bool(self.uncounted)

    def guard_terms(self) -> list[tuple[torch.Tensor, list[int]]]:
        """``(tensor, cell)`` per buffer with a counter, for the replay guard."""
        return [(spec.tensor, cell) for spec, cell in self.versioned]

    def displaced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
        """The inputs this call does not pass at their captured place, as captured: another tensor
        there is a drift (reported as one where inputs are checked), not a stale input."""
        out = set()
        for index, spec in enumerate(self.inputs):
            try:
                value = spec.read(args, kwargs)
            except (LookupError, TypeError, AttributeError):
                value = None
            if compare(spec.name, spec.tensor, spec.key, value, deep=True) is not None:
                out.add(index)
        return out

    def inspect(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], real: int, debug: bool, replay: int
    ) -> list[Finding]:
        """The closer look at replay number ``replay`` of this graph: a comparison read back earlier
        is reported first; this replay's findings are returned (or, on CUDA in always-on mode,
        reported when its comparison is read back)."""
        group = self.group
        if group.pending is not None:
            group.pending.settle()
        skip = self.displaced(args, kwargs)
        versions = [version_of(spec.tensor) for spec in self.inputs]
        moved = [
            version is not None and record.version is not None and version != record.version[0]
            for version, record in zip(versions, self.records, strict=True)
        ]
        for version, record in zip(versions, self.records, strict=True):
            if record.version is not None and version is not None:
                record.version[0] = version
        rows = self.rows
        candidates = rows.real_rows(real, self.size) if rows is not None and real < self.size else []
        if not debug and not candidates and all(moved[i] for i in range(len(self.inputs)) if i not in skip):
            if self.rows is not None:
                self.rows.record(self.size, real)
            return []
        deferred = not debug and defers(self.inputs[0].tensor.device)
        comparison = Comparison(self, moved, skip, candidates, real, replay, deferred)
        if deferred:
            group.pending = comparison
            return []
        return comparison.decide()


def defers(device: torch.device) -> bool:
    """Whether a comparison made on ``device`` is read back later, without a sync (on CUDA)."""
    return device.type == "cuda"


class Readback:
    """A comparison's result on its way to the host: on CUDA copied to pinned memory behind an event
    (no sync), read when ``values()`` is asked for (waiting for the device only if it is not done)."""

    def __init__(self, bits: torch.Tensor) -> None:
        self.event: Any = None
        if bits.is_cuda:
            self.host = torch.empty(bits.shape, dtype=bits.dtype, pin_memory=True)
            self.host.copy_(bits, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = bits

    def values(self) -> list[bool]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Comparison:
    """One replay's comparison of its per-step inputs with their shadows (the previous replay's
    values): made on the device, read back at once or later (``deferred``: without a sync)."""

    def __init__(
        self,
        step: PerStepInputs,
        moved: list[bool],
        skip: set[int],
        candidates: list[int],
        real: int,
        replay: int,
        deferred: bool,
    ) -> None:
        self.step, self.moved, self.skip, self.candidates, self.real = step, moved, skip, candidates, real
        self.replay = replay
        self.compared = [i for i in range(len(step.inputs)) if i not in skip]
        self.row_inputs = [i for i in step.token_rows if i not in skip] if candidates else []
        with torch.no_grad():
            bits = self._bits()
        self.entry: Entry | None = None
        self.values: list[bool] | None = None
        self.readback: Readback | None = None
        if deferred:
            self.readback = Readback(bits)
            if step.rows is not None:  # the candidates count as real until the values are back
                self.entry = step.rows.record(step.size, real, candidates)
        else:
            self.values = bits.tolist()

    def _bits(self) -> torch.Tensor:
        """One flat bool tensor: per compared input, whether any value changed; then per token-row
        input, for each candidate padding row, whether the row changed."""
        step, parts = self.step, []
        for i in self.compared:
            parts.append((step.inputs[i].tensor != step.shadows[i]).any().reshape(1))
        spans = _spans(self.candidates)
        for i in self.row_inputs:
            diff = step.inputs[i].tensor != step.shadows[i]
            rows = diff.reshape(diff.shape[0], -1).any(1)
            parts += [rows[low:high] for low, high in spans]
        return torch.cat(parts)

    def settle(self) -> None:
        """Read a deferred comparison back (waiting for the device if it is not done) and report it."""
        step = self.step
        if step.group.pending is self:
            step.group.pending = None
        assert self.readback is not None
        self.values = self.readback.values()
        findings = self.decide()
        if findings:
            step.report(findings)

    def decide(self) -> list[Finding]:
        """The stale inputs and stale padding rows the values say, the group's writer noted."""
        step, values = self.step, self.values
        assert values is not None
        changed = dict(zip(self.compared, values[: len(self.compared)], strict=True))
        written = {i: self.moved[i] or changed[i] for i in self.compared}
        if any(changed[i] and not self.moved[i] for i in self.compared):
            step.group.foreign = True
        stale_rows = self._unchanged_rows(values[len(self.compared):])
        late = self.readback is not None
        if step.rows is not None:
            if self.entry is None:
                step.rows.record(step.size, self.real, stale_rows)
            else:
                RowStatus.settle(self.entry, self.real, stale_rows)
        findings = []
        if self.compared and not any(written.values()):
            findings = [_stale(step.inputs[i], "no input of the step was written: each holds, bit for bit, "
                               "the previous replay's values, and no torch op wrote it", self, late)
                        for i in self.compared]
        elif not step.group.foreign:
            others = ", ".join(repr(step.inputs[i].name) for i in self.compared if written[i])
            findings = [
                _stale(step.inputs[i], f"its version counter did not move and its values did not change, "
                       f"while the step wrote {others}", self, late)
                for i in self.compared if not written[i] and step.records[i].version is not None
            ]
        if stale_rows and not (self.compared and not any(written.values())):
            findings += [_stale_padding(step.inputs[i], stale_rows, self, late) for i in self.row_inputs]
        return findings

    def _unchanged_rows(self, row_bits: list[bool]) -> list[int]:
        """The candidate padding rows unchanged in every token-row input."""
        count = len(self.candidates)
        if not self.row_inputs or not count:
            return []
        per_input = [row_bits[k * count:(k + 1) * count] for k in range(len(self.row_inputs))]
        return [row for j, row in enumerate(self.candidates) if not any(bits[j] for bits in per_input)]


def _spans(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as ``[low, high)`` runs."""
    spans: list[tuple[int, int]] = []
    for row in rows:
        if spans and spans[-1][1] == row:
            spans[-1] = (spans[-1][0], row + 1)
        else:
            spans.append((row, row + 1))
    return spans


def _when(comparison: Comparison, late: bool) -> str:
    if not late:
        return ""
    return f" (replay {comparison.replay} of this graph, read back at its group's next replay)"


def _stale(spec: TensorInput, why: str, comparison: Comparison, late: bool) -> Finding:
    detail = f"input {spec.name!r} was not written since the previous replay: {why}{_when(comparison, late)}"
    return Finding(ViolationKind.STALE_INPUT, spec.name, detail, spec.address, spec.address)


def _stale_padding(spec: TensorInput, rows: list[int], comparison: Comparison, late: bool) -> Finding:
    shown = ", ".join(f"{low}" if high == low + 1 else f"{low}..{high - 1}" for low, high in _spans(rows))
    detail = (
        f"input {spec.name!r}: padding rows {shown} (this step has {comparison.real} real tokens of "
        f"{comparison.step.size}) still hold the values of an earlier step's real tokens, unchanged in "
        f"every per-step input: the padded rows would write those requests' KV slots again"
        f"{_when(comparison, late)}"
    )
    return Finding(ViolationKind.STALE_INPUT, spec.name, detail, spec.address, spec.address)
