"""The forward context: how a wrapper deep inside a model learns what batch it is serving.

The engine decides the runtime mode and the graph key once per step (through the dispatcher) and
sets them here; every ``CUDAGraphWrapper`` called during that forward pass reads them instead of
being passed them through the model's signature. The context is thread-local, because micro-batch
threads each run their own slice of the batch under their own context.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode


class ForwardContext(NamedTuple):
    """What one forward pass runs as: runtime mode, graph key and how many tokens are real.

    ``ubatch_slices`` and ``attn_metadata`` are carried for the micro-batching and piecewise
    machinery; the graph wrapper itself only reads the first three fields. Immutable; a named
    tuple because one is built per step and a frozen dataclass costs several times more to build.
    """

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    num_real_tokens: int
    ubatch_slices: Any = None
    attn_metadata: Any = None


class _ThreadContext(threading.local):
    # A class-level default makes the per-call read a plain attribute access (it is on every call).
    context: ForwardContext | None = None


_local = _ThreadContext()
CURRENT = _local
"""The thread-local holder itself: ``CURRENT.context`` is what ``get_forward_context()`` returns,
read without the function call by the graph wrappers' replay path."""


def get_forward_context() -> ForwardContext | None:
    """The context of the forward pass running on this thread, or None outside one."""
    return _local.context


_RUNTIME_MODES = frozenset({CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL})


class use_forward_context:
    """Install an existing context on this thread (a micro-batch thread inheriting its parent's);
    restores the outer one on exit.

    A plain class rather than a ``@contextmanager`` generator: it is entered once per step on the
    hot path, and a generator-based manager costs several microseconds more per step.
    """

    __slots__ = ("_previous", "context")

    def __init__(self, context: ForwardContext | None) -> None:
        self.context = context
        self._previous: ForwardContext | None = None

    def __enter__(self) -> ForwardContext | None:
        self._previous = _local.context
        _local.context = self.context
        return self.context

    def __exit__(self, *exc_info: object) -> None:
        _local.context = self._previous


def set_forward_context(
    mode: CUDAGraphMode,
    descriptor: BatchDescriptor,
    num_real_tokens: int | None = None,
    ubatch_slices: Any = None,
    attn_metadata: Any = None,
) -> use_forward_context:
    """Run a forward pass as ``mode`` / ``descriptor`` on this thread; restores the outer context.

    ``num_real_tokens`` defaults to the descriptor's (padded) token count, which is what a capture
    run with dummy inputs wants. Use as ``with set_forward_context(...) as context:``.
    """
    if mode not in _RUNTIME_MODES:
        raise ValueError(f"a forward pass runs in a runtime mode (NONE, PIECEWISE, FULL), not {mode.name}")
    real = descriptor.num_tokens if num_real_tokens is None else num_real_tokens
    return use_forward_context(ForwardContext(mode, descriptor, real, ubatch_slices, attn_metadata))
