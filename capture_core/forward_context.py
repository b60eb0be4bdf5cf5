"""The forward context: how a wrapper deep inside a model learns what batch it is serving.

The engine decides the runtime mode and the graph key once per step (through the dispatcher) and
sets them here; every ``CUDAGraphWrapper`` called during that forward pass reads them instead of
being passed them through the model's signature. The context is thread-local, because micro-batch
threads each run their own slice of the batch under their own context.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """What one forward pass runs as: runtime mode, graph key and how many tokens are real.

    ``ubatch_slices`` and ``attn_metadata`` are carried for the micro-batching and piecewise
    machinery; the graph wrapper itself only reads the first three fields.
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


def get_forward_context() -> ForwardContext | None:
    """The context of the forward pass running on this thread, or None outside one."""
    return _local.context


@contextmanager
def set_forward_context(
    mode: CUDAGraphMode,
    descriptor: BatchDescriptor,
    num_real_tokens: int | None = None,
    ubatch_slices: Any = None,
    attn_metadata: Any = None,
) -> Iterator[ForwardContext]:
    """Run a forward pass as ``mode`` / ``descriptor`` on this thread; restores the outer context.

    ``num_real_tokens`` defaults to the descriptor's (padded) token count, which is what a capture
    run with dummy inputs wants.
    """
    if not mode.is_runtime_mode():
        raise ValueError(f"a forward pass runs in a runtime mode (NONE, PIECEWISE, FULL), not {mode.name}")
    real = descriptor.num_tokens if num_real_tokens is None else num_real_tokens
    context = ForwardContext(mode, descriptor, real, ubatch_slices, attn_metadata)
    with use_forward_context(context):
        yield context


@contextmanager
def use_forward_context(context: ForwardContext | None) -> Iterator[ForwardContext | None]:
    """Install an existing context on this thread (a micro-batch thread inheriting its parent's)."""
    previous = _local.context
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous
