"""What one flush writes: the recorder's pending records and traffic deltas, as plain data.

The recorder builds a ``FlushBatch`` from its queues and counters on the flush thread; the
``writer`` module turns it into rows in one transaction. Keeping the two apart lets the batch be
retried whole after a failed transaction and counted exactly when it must be dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent
from capture_core.modes import CUDAGraphMode

GraphKey = tuple[str, str]
"""(mode label, descriptor key): how a graph is found again within one run."""

ViolationKey = tuple[str, str, str, str | None, int | None, int | None]
"""(kind, mode label, descriptor key, input name, expected address, actual address)."""


def graph_key(mode: CUDAGraphMode, descriptor: BatchDescriptor) -> GraphKey:
    return (mode.label, descriptor.key)


def violation_key(event: ViolationEvent) -> ViolationKey:
    """Two findings are the same finding when all of these agree (then only its count grows)."""
    return (
        event.kind.value,
        event.mode.label,
        event.descriptor.key,
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
class TrafficWindow:
    """Everything counted in the hot path since the last committed window."""

    window_start: float
    window_end: float
    replays: dict[GraphKey, ReplayDelta] = field(default_factory=dict)
    eager: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    """(reason, mode label) -> [batches, real tokens]."""
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """real token count -> batches (replayed or eager)."""

    def rows(self) -> int:
        return len(self.replays) + len(self.eager) + len(self.batch_sizes)


@dataclass
class FlushBatch:
    """One transaction's worth of records."""

    captures: list[CaptureEvent]
    violations: dict[ViolationKey, PendingViolation]
    traffic: TrafficWindow
    backend: str | None
    dropped_events: int
    ended_at: float | None = None
