"""The errors the graph cache raises: a misuse to fix, or a check that found a graph computing the
wrong thing. Each kind of violation that raises names its error in its record
(``capture_core.events.ViolationKind``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capture_core.events import ViolationEvent


class GraphCacheError(RuntimeError):
    """A misuse of the graph cache that the caller must fix; the message says how. ``events`` are the
    violations it was raised for (their graph, input, addresses and stack), when it was raised for
    one: what a test runner reports it as."""

    def __init__(self, message: str, events: Sequence[ViolationEvent] = ()) -> None:
        super().__init__(message)
        self.events = tuple(events)


class GraphCheckError(GraphCacheError):
    """Raised in DEBUG mode when a replay check found that the graph would compute the wrong thing."""


class AddressDriftError(GraphCheckError):
    """A tensor the graph reads is no longer at its captured address."""


class LayoutMismatchError(GraphCheckError):
    """A tensor the graph reads is at its captured address but laid out otherwise."""


class StaleInputError(GraphCheckError):
    """A per-step input was not written since the previous replay."""


class ReplayMismatchError(GraphCheckError):
    """A sampled replay disagreed with the same step run eagerly."""


class BakedValueChangedError(GraphCheckError):
    """A host value the graph baked in at capture (an argument, a module attribute) differs now."""


class StaleOutputError(GraphCheckError):
    """A graph output was read after a later replay of the same graph wrote it again."""


class UnexpectedCaptureError(GraphCacheError):
    """A capture was attempted after start-up locked capture, under the RAISE policy."""
