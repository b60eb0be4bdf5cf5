"""The order in which one rank ran its batches: the step sequence that the ranks of a job compare.

Data-parallel ranks must replay the same graph at the same step, or their next collective pairs
up wrongly and hangs. Counts per graph cannot show that (two ranks can replay the same graphs
equally often in another order), so a recorder that is a rank of a job also keeps the order. Its
hot path appends the counter cell it just bumped to a list (one ``list.append``, no allocation);
the flush thread drains the list and turns it into labels, run-length encoded: a steady decode
loop replaying one size for a thousand steps is one ``[label, 1000]`` pair.

A **step** is one batch through the cache (a replay or an eager batch), numbered from the run's
start. When the engine agrees on each step with the other ranks through
``coordinate_batch_across_dp(..., observer=recorder)``, each agreement starts a step instead, and
every batch until the next one belongs to it; so a rank that ran two batches, or none, in one step
still lines up with the others at the next.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode

log = logging.getLogger("graph_inspector.recorder")

EAGER = "eager"
"""The label of a batch run without a graph (whatever the reason: the eager table keeps those)."""
IDLE = "idle"
"""The label of a coordinated step in which this rank ran no batch through the cache."""
JOINED = " + "
"""Between the labels of the batches of one coordinated step that ran more than one."""

Run = list  # [label, steps]


def replay_label(mode: CUDAGraphMode, descriptor: BatchDescriptor) -> str:
    """A replayed graph as a step sequence names it: its mode and descriptor key."""
    return f"{mode.label} {descriptor.key}"


@dataclass
class StepSegment:
    """Consecutive steps of one rank, from ``first_step``: ``runs`` of ``[label, steps]``."""

    first_step: int
    runs: list[Run] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(count for _, count in self.runs)

    @property
    def end_step(self) -> int:
        """The step after the last one."""
        return self.first_step + self.steps

    def add(self, label: str, count: int = 1) -> None:
        if self.runs and self.runs[-1][0] == label:
            self.runs[-1][1] += count
        else:
            self.runs.append([label, count])

    def extend(self, other: StepSegment) -> None:
        """Append ``other``, which starts where this one ends."""
        assert other.first_step == self.end_step, (other.first_step, self.end_step)
        for label, count in other.runs:
            self.add(label, count)

    def to_json(self) -> str:
        return json.dumps(self.runs, separators=(",", ":"))

    @classmethod
    def from_json(cls, first_step: int, text: str) -> StepSegment:
        return cls(first_step, [[str(label), int(count)] for label, count in json.loads(text)])


class StepTracker:
    """The flush thread's side: turns the cells the hot path appended into numbered steps.

    ``take`` is given the entries drained since the last call and the recorder's counter dicts
    (replay key -> cell, eager key -> cell); anything that is not a cell is a coordination marker.
    The steps it returns are complete; a coordinated step stays open until the next marker (or
    ``close``), since more of its batches may still come.
    """

    def __init__(self) -> None:
        self.next_step = 0
        self.coordinated = False
        self._labels: dict[int, str] = {}
        """id(cell) -> label. Cells are never removed from the recorder's dicts, so ids stay theirs."""
        self._open: list[str] | None = None
        """The labels of the coordinated step still open (None: none is)."""

    def take(
        self, entries: Sequence[Any], replays: Mapping[tuple, list[int]], eager: Mapping[tuple, list[int]]
    ) -> StepSegment:
        segment = StepSegment(self.next_step)
        for entry in entries:
            if type(entry) is not list:  # a coordination marker: a new step begins
                self.coordinated = True
                if self._open is not None:
                    segment.add(_step_label(self._open))
                self._open = []
                continue
            label = self._labels.get(id(entry))
            if label is None:
                self._learn(replays, eager)
                label = self._labels[id(entry)]
            if self._open is not None:
                self._open.append(label)
            else:
                segment.add(label)
        self.next_step = segment.end_step
        return segment

    def close(self) -> StepSegment:
        """The open coordinated step, if any, as the last segment."""
        segment = StepSegment(self.next_step)
        if self._open is not None:
            segment.add(_step_label(self._open))
            self._open = None
        self.next_step = segment.end_step
        return segment

    def _learn(self, replays: Mapping[tuple, list[int]], eager: Mapping[tuple, list[int]]) -> None:
        modes: dict[Any, CUDAGraphMode] = {}
        for key, cell in replays.items():
            if id(cell) not in self._labels:
                mode_value, tokens, reqs, uniform, has_lora, loras, _ = key
                mode = modes.get(mode_value) or modes.setdefault(mode_value, CUDAGraphMode(mode_value))
                descriptor = BatchDescriptor(tokens, reqs, uniform, has_lora, loras)
                self._labels[id(cell)] = replay_label(mode, descriptor)
        for cell in eager.values():
            self._labels.setdefault(id(cell), EAGER)


class StepLog:
    """A recorder's step sequence: the hot path appends to ``entries``; the flush thread calls
    ``pending`` for what to write, then ``committed`` once it is written.

    The flush thread takes entries off the front of the list with one slice and one ``del`` of the
    same length; under the GIL each is a single operation, so an append racing with them lands
    after the part taken and is read at the next flush, never lost. What could not be written yet
    accumulates (run-length encoded); beyond ``limit`` runs it is dropped and counted, leaving a
    gap that the comparison skips.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self.entries: list[Any] = []
        self.limit = limit
        self.dropped_steps = 0
        self._tracker = StepTracker()
        self._pending: StepSegment | None = None

    def pending(
        self, replays: Mapping[tuple, list[int]], eager: Mapping[tuple, list[int]], final: bool = False
    ) -> StepSegment | None:
        """Every step not yet written, the ones since the last call included (None: no steps)."""
        taken = len(self.entries)
        entries = self.entries[:taken]
        del self.entries[:taken]
        segment = self._tracker.take(entries, replays, eager)
        if final:
            segment.extend(self._tracker.close())
        if self._pending is None or len(self._pending.runs) > self.limit:
            if self._pending is not None:
                log.error("graph-inspector recorder: dropped %d steps of the step sequence (not written "
                          "for too long); the ranks' comparison skips them", self._pending.steps)
                self.dropped_steps += self._pending.steps
            self._pending = segment
        else:
            self._pending.extend(segment)
        return self._pending if self._pending.runs else None

    def committed(self) -> None:
        self._pending = None

    def drop(self) -> int:
        """Give up what is pending (the database stayed unavailable); the steps it held."""
        steps = self._pending.steps if self._pending is not None else 0
        self.dropped_steps += steps
        self._pending = None
        return steps


def _step_label(labels: list[str]) -> str:
    return JOINED.join(labels) if labels else IDLE


# ------------------------------------------------------------------------------------ comparing


@dataclass(frozen=True)
class Stretch:
    """Steps ``start`` .. ``stop`` (exclusive) in which every rank ran the same label each step."""

    start: int
    stop: int
    labels: dict[int, str]
    """rank -> its label for these steps."""

    @property
    def agreed(self) -> bool:
        return len(set(self.labels.values())) == 1


def stretches(sequences: Mapping[int, Iterable[StepSegment]], start: int, stop: int) -> Iterator[Stretch]:
    """Walk the ranks' sequences over steps ``start`` .. ``stop`` together, one stretch at a time
    (a stretch ends wherever any rank's label changes). Steps some rank has no record of (its
    recorder dropped them) are skipped. Costs the number of runs, not of steps."""
    walkers = {rank: _Walker(segments, start) for rank, segments in sequences.items()}
    step = start
    while step < stop and walkers:
        labels, until = {}, stop
        for rank, walker in walkers.items():
            label, run_end = walker.at(step)
            if label is None:  # a gap in this rank's record: skip to where it resumes
                labels = None
                until = min(until, run_end)
                break
            labels[rank] = label
            until = min(until, run_end)
        if labels is not None:
            yield Stretch(step, until, labels)
        step = until


class _Walker:
    """Reads one rank's segments (in step order) at increasing steps."""

    def __init__(self, segments: Iterable[StepSegment], start: int) -> None:
        self._runs = iter(
            (first, first + count, label)
            for segment in segments
            for first, count, label in _numbered(segment)
            if first + count > start
        )
        self._current: tuple[int, int, str] | None = next(self._runs, None)

    def at(self, step: int) -> tuple[str | None, int]:
        """The label at ``step`` and the step where it stops holding (None: no record there, until
        the returned step)."""
        while self._current is not None and self._current[1] <= step:
            self._current = next(self._runs, None)
        if self._current is None:
            return None, 1 << 62
        first, end, label = self._current
        if step < first:
            return None, first
        return label, end


def _numbered(segment: StepSegment) -> Iterator[tuple[int, int, str]]:
    step = segment.first_step
    for label, count in segment.runs:
        yield step, count, label
        step += count
