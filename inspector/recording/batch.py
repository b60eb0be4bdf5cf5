"""What one flush writes: the recorder's pending records and traffic deltas, as plain data.

The recorder builds a ``FlushBatch`` from its queues and counters on the flush thread (its traffic
with ``traffic_since``); the ``writer`` module turns it into rows in one transaction. Keeping the
two apart lets the batch be retried whole after a failed transaction and counted exactly when it
must be dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, DivergenceEvent, ViolationEvent
from capture_core.modes import CUDAGraphMode
from inspector.ranks.steps import StepSegment
from inspector.recording.losses import Losses
from inspector.storage.models import Graph
from inspector.storage.text import column_limits, storable

KEY_LIMIT = column_limits(Graph)["descriptor_key"]

GraphKey = tuple[str, str]
"""(mode label, descriptor key): how a graph is found again within one run."""

ViolationKey = tuple[str, str, str, str | None, int | None, int | None]
"""(kind, mode label, descriptor key, input name, expected address, actual address)."""

ReplayKey = tuple[Any, int, "int | None", bool, bool, int, int]
"""The recorder's replay counter key: (mode value, the descriptor's five fields in order, real tokens)."""

EagerKey = tuple[str, Any, int]
"""The recorder's eager counter key: (reason value, mode value, real tokens)."""

StepTimeKey = tuple[Any, int, "int | None", bool, bool, int, str]
"""The recorder's step-time key: (mode value, the descriptor's five fields in order, clock)."""

StepTimeSums = tuple[float, int, float, int]
"""(graph seconds, graph samples, eager seconds, eager samples) summed over a run so far."""


def graph_key(mode: CUDAGraphMode, descriptor: BatchDescriptor) -> GraphKey:
    return (mode.label, stored_key(descriptor))


def stored_key(descriptor: BatchDescriptor) -> str:
    """The descriptor's key as ``descriptor_key`` holds it: storable, and cut with a digest so that
    long keys sharing their start stay apart (see ``inspector.storage.text``)."""
    return storable(descriptor.key, KEY_LIMIT, digest=True)


def violation_key(event: ViolationEvent) -> ViolationKey:
    """Two findings are the same finding when all of these agree (then only its count grows)."""
    return (
        event.kind.value,
        event.mode.label,
        stored_key(event.descriptor),
        event.input_name,
        event.expected_address,
        event.actual_address,
    )


@dataclass
class PendingViolation:
    """Occurrences of one finding not yet written: the first event seen, and how many since."""

    event: ViolationEvent
    count: int
    first_seen_at: float
    last_seen_at: float

    def add(self, event: ViolationEvent) -> None:
        self.count += 1
        self.first_seen_at = min(self.first_seen_at, event.seen_at)
        self.last_seen_at = max(self.last_seen_at, event.seen_at)


@dataclass
class PendingRecords:
    """Captures and violations the flush thread drained from the engine's queues and has not yet
    committed, each kind bounded by ``limit`` (beyond it a new record is refused, for the caller to
    count as dropped). Every capture so far is kept too (as many as ``limit``): after the database
    file vanished they are written again, so that the new file's windows link to their graphs."""

    limit: int
    captures: list[CaptureEvent] = field(default_factory=list)
    violations: dict[ViolationKey, PendingViolation] = field(default_factory=dict)
    divergences: list[DivergenceEvent] = field(default_factory=list)
    """Where graphs part from their eager steps (the located detail of a ``replay_mismatch``)."""
    all_captures: list[CaptureEvent] = field(default_factory=list)
    resend_graphs: bool = False

    def __bool__(self) -> bool:
        return bool(self.captures or self.violations or self.divergences)

    def add_capture(self, event: CaptureEvent) -> bool:
        if len(self.captures) >= self.limit:
            return False
        self.captures.append(event)
        if len(self.all_captures) < self.limit:
            self.all_captures.append(event)
        return True

    def add_violation(self, event: ViolationEvent) -> bool:
        key = violation_key(event)
        pending = self.violations.get(key)
        if pending is not None:
            pending.add(event)
        elif len(self.violations) >= self.limit:
            return False
        else:
            self.violations[key] = PendingViolation(event, 1, event.seen_at, event.seen_at)
        return True

    def add_divergence(self, event: DivergenceEvent) -> bool:
        if len(self.divergences) >= self.limit:
            return False
        self.divergences.append(event)
        return True

    def captures_to_write(self) -> list[CaptureEvent]:
        if not self.resend_graphs:
            return list(self.captures)
        known = {id(event) for event in self.all_captures}
        return self.all_captures + [event for event in self.captures if id(event) not in known]

    def clear(self) -> Losses:
        """Forget what is pending (it was committed, or is given up); how many events that was."""
        # A divergence is the located detail of a violation: one lost counts as a violation's occurrence.
        occurrences = sum(v.count for v in self.violations.values()) + len(self.divergences)
        events = Losses(captures=len(self.captures), violations=occurrences)
        self.divergences.clear()
        self.captures.clear()
        self.violations.clear()
        return events

    def shed(self) -> Losses:
        """Give up what is pending because the database refused it as it is (``clear``), and never
        send those captures again."""
        shed = {id(event) for event in self.captures}
        self.all_captures = [event for event in self.all_captures if id(event) not in shed]
        return self.clear()


@dataclass
class ReplayDelta:
    """Replays of one graph key since the last committed window."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    replays: int = 0
    num_real_tokens: int = 0

    @property
    def padding_tokens(self) -> int:
        return self.descriptor.captured_size * self.replays - self.num_real_tokens


@dataclass
class StepTimeDelta:
    """Timed steps of one graph key since the last committed window: sums and sample counts."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    clock: str
    graph_seconds: float = 0.0
    graph_samples: int = 0
    eager_seconds: float = 0.0
    eager_samples: int = 0


@dataclass
class TrafficWindow:
    """Everything counted in the hot path since the last committed window."""

    window_start: float
    window_end: float
    replays: dict[GraphKey, ReplayDelta] = field(default_factory=dict)
    eager: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    """(reason, mode label) -> [batches, real tokens]."""
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """real token count -> batches (replayed or eager)."""
    uniform_batch_sizes: dict[int, int] | None = None
    """real token count -> those of its batches that replayed a uniform-decode graph (None: not told)."""
    step_times: dict[GraphKey, StepTimeDelta] = field(default_factory=dict)
    """Timed steps per graph key (running totals only: no window rows)."""

    def rows(self) -> int:
        return len(self.replays) + len(self.eager) + len(self.batch_sizes) + len(self.step_times)

    def losses(self) -> Losses:
        """What this window counts as when it is lost: its replays, eager batches and their tokens."""
        lost = Losses()
        for delta in self.replays.values():
            lost.replays += delta.replays
            lost.real_tokens += delta.num_real_tokens
        for batches, tokens in self.eager.values():
            lost.eager_batches += batches
            lost.real_tokens += tokens
        return lost


def traffic_since(
    window: TrafficWindow,
    replays: dict[ReplayKey, int],
    committed_replays: dict[ReplayKey, int],
    eager: dict[EagerKey, int],
    committed_eager: dict[EagerKey, int],
) -> TrafficWindow:
    """Fill ``window`` with the counts that grew since the committed snapshot (counters only grow).
    A recorder tells the batches that replayed a uniform-decode graph apart (the decode steps)."""
    modes: dict[Any, CUDAGraphMode] = {}
    if window.uniform_batch_sizes is None:
        window.uniform_batch_sizes = {}
    decode = window.uniform_batch_sizes
    for key, count in replays.items():
        delta = count - committed_replays.get(key, 0)
        if delta <= 0:
            continue
        mode_value, tokens, reqs, uniform, has_lora, loras, real = key
        mode = modes.get(mode_value) or modes.setdefault(mode_value, CUDAGraphMode(mode_value))
        descriptor = BatchDescriptor(
            num_tokens=tokens, num_reqs=reqs, uniform=uniform, has_lora=has_lora, num_active_loras=loras
        )
        gkey = graph_key(mode, descriptor)
        entry = window.replays.get(gkey)
        if entry is None:
            entry = window.replays[gkey] = ReplayDelta(mode, descriptor)
        entry.replays += delta
        entry.num_real_tokens += real * delta
        window.batch_sizes[real] = window.batch_sizes.get(real, 0) + delta
        if uniform:
            decode[real] = decode.get(real, 0) + delta
    for key, count in eager.items():
        delta = count - committed_eager.get(key, 0)
        if delta <= 0:
            continue
        reason, mode_value, real = key
        mode = modes.get(mode_value) or modes.setdefault(mode_value, CUDAGraphMode(mode_value))
        totals = window.eager.setdefault((reason, mode.label), [0, 0])
        totals[0] += delta
        totals[1] += real * delta
        window.batch_sizes[real] = window.batch_sizes.get(real, 0) + delta
    return window


def step_times_since(
    window: TrafficWindow, sums: dict[StepTimeKey, StepTimeSums], committed: dict[StepTimeKey, StepTimeSums]
) -> TrafficWindow:
    """Add to ``window`` the timed steps summed since the committed snapshot (sums only grow)."""
    for key, (graph_s, graph_n, eager_s, eager_n) in sums.items():
        old_graph_s, old_graph_n, old_eager_s, old_eager_n = committed.get(key, (0.0, 0, 0.0, 0))
        if graph_n == old_graph_n and eager_n == old_eager_n:
            continue
        mode_value, tokens, reqs, uniform, has_lora, loras, clock = key
        mode = CUDAGraphMode(mode_value)
        descriptor = BatchDescriptor(
            num_tokens=tokens, num_reqs=reqs, uniform=uniform, has_lora=has_lora, num_active_loras=loras
        )
        gkey = graph_key(mode, descriptor)
        delta = window.step_times.get(gkey)
        if delta is None:
            delta = window.step_times[gkey] = StepTimeDelta(mode, descriptor, clock)
        delta.graph_seconds += graph_s - old_graph_s
        delta.graph_samples += graph_n - old_graph_n
        delta.eager_seconds += eager_s - old_eager_s
        delta.eager_samples += eager_n - old_eager_n
    return window


@dataclass
class FlushBatch:
    """One transaction's worth of records."""

    captures: list[CaptureEvent]
    violations: dict[ViolationKey, PendingViolation]
    traffic: TrafficWindow
    backend: str | None
    losses: Losses
    """Everything the recorder has dropped so far (the run row keeps the running totals)."""
    ended_at: float | None = None
    steps: StepSegment | None = None
    """This rank's steps since the last committed window (ranks of a job only)."""
    divergences: list[DivergenceEvent] = field(default_factory=list)
