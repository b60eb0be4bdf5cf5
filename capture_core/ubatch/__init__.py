"""Micro-batching (DBO): split a step into equal-shape micro-batches that overlap compute and comm.

``slices`` holds the arithmetic (where to split, whether to), ``context`` the turn-taking of the
ubatches and their streams, ``threads`` the threads a step runs them on, ``wrapper`` the graph
source that captures all ubatches into one graph,
and ``dp`` the per-step agreement between data-parallel ranks. The reference decoder with a
communication step per layer, the workload micro-batching exists for, is
``capture_core.reference.overlap``.
"""

from capture_core.ubatch.context import (
    UBatchAbortedError,
    UBatchContext,
    UBatchHandoverError,
    UBatchRing,
    current_ubatch_context,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    make_ubatch_contexts,
)
from capture_core.ubatch.dp import (
    DPCoordination,
    DPCoordinationError,
    DPObserver,
    DPRequest,
    coordinate_batch_across_dp,
)
from capture_core.ubatch.slices import (
    UBatchConfig,
    UBatchSlice,
    UBatchSlices,
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
)
from capture_core.ubatch.threads import UBatchThreads
from capture_core.ubatch.wrapper import UBatchGraphEntry, UBatchWrapper

__all__ = [
    "DPCoordination",
    "DPCoordinationError",
    "DPObserver",
    "DPRequest",
    "UBatchAbortedError",
    "UBatchConfig",
    "UBatchContext",
    "UBatchGraphEntry",
    "UBatchHandoverError",
    "UBatchRing",
    "UBatchSlice",
    "UBatchSlices",
    "UBatchThreads",
    "UBatchWrapper",
    "check_ubatch_thresholds",
    "coordinate_batch_across_dp",
    "current_ubatch_context",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
    "is_last_ubatch_empty",
    "make_ubatch_contexts",
    "maybe_create_ubatch_slices",
]
