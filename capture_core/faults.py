"""Planted faults: the two violations the inspector exists to catch, made on purpose.

A demo, a test or a CI smoke check needs a real address drift and a real unexpected capture to show
that both are caught and recorded. Both runners offer them (``inject_address_drift``,
``inject_unexpected_capture``) through the two functions here, so a planted fault takes the paths a
real one would: the drift is the runner's own step with its ``input_ids`` written into a fresh
tensor instead of the static buffer (the graph replays stale ids, the address check sees the move),
the unexpected capture is a decode batch of a size start-up never captured, after the lock. Every
violation they cause is marked ``injected``, so nobody mistakes it for a finding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from capture_core.buffers import StaticBuffers
from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher, Dispatch
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime


class FaultNotPlantable(ValueError):
    """The runner has nothing to plant this fault on (the step runs eagerly, no size is left)."""


class FaultTarget(Protocol):
    """What planting a fault reads of a runner (``DecodeRunner`` and ``MixedBatchRunner`` have it)."""

    runtime: GraphRuntime
    mode: CUDAGraphMode
    dispatcher: CUDAGraphDispatcher
    buffers: StaticBuffers
    kv_cache: torch.Tensor

    @property
    def graphs(self) -> Mapping[BatchDescriptor, Any]: ...


def plant_address_drift(
    runner: FaultTarget, routed: Dispatch, step: Callable[..., torch.Tensor], *inputs: Any
) -> torch.Tensor:
    """``step(*inputs)`` (the runner's own step) with ``input_ids`` written into a fresh tensor.

    ``routed`` is where the step goes; a step that runs eagerly has no graph to drift. Returns the
    step's logits, stale ones: the graph read the previous step's ids. In DEBUG checks the step
    raises ``AddressDriftError`` (recorded first, as every drift).
    """
    if routed.eager_reason is not None:
        what = f"{routed.num_real_tokens} tokens run eagerly ({routed.eager_reason.value})"
        raise FaultNotPlantable(f"{what}: there is no graph to drift")
    with runner.runtime.injected_faults(), runner.buffers.relocated("input_ids"):
        return step(*inputs)


def plant_unexpected_capture(runner: FaultTarget, graphed: Callable[..., Any]) -> BatchDescriptor:
    """Ask ``graphed`` (the runner's outermost graph wrapper) for a decode graph start-up never captured.

    The smallest batch size without a capture size, on dummy inputs that write only the spare KV
    slot; what follows is the runtime's policy (raise ``UnexpectedCaptureError``, serve eagerly, or
    capture). Returns the descriptor it asked for.
    """
    mode, descriptor = _uncaptured_decode(runner)
    runner.buffers.reset()  # dummy inputs: every write lands in the spare padding slot
    views = runner.buffers.views(descriptor.num_tokens)
    with runner.runtime.injected_faults(), torch.no_grad(), set_forward_context(mode, descriptor):
        graphed(views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)
    return descriptor


def _uncaptured_decode(runner: FaultTarget) -> tuple[CUDAGraphMode, BatchDescriptor]:
    """The mode decode batches replay in, and the key of a decode batch of the smallest uncaptured size."""
    mode = runner.mode.decode_mode()
    if mode is CUDAGraphMode.NONE:
        raise FaultNotPlantable(f"mode {runner.mode.name} captures no decode graphs: none can be unexpected")
    table, held = runner.dispatcher.sizes, runner.graphs
    for size in range(1, table.max_size + 1):
        # A FULL graph fixes the request count of a uniform decode; a piecewise one serves any.
        uniform = mode is CUDAGraphMode.FULL
        descriptor = BatchDescriptor(size, size if uniform else None, uniform)
        if size not in table and descriptor not in held:
            return mode, descriptor
    raise FaultNotPlantable(f"every batch size up to {table.max_size} has a graph: none is left to capture")
