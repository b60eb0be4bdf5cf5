"""Micro-batching (DBO): split a step into equal-shape micro-batches that overlap compute and comm."""

from capture_core.ubatch.slices import (
    UBatchConfig,
    UBatchSlice,
    UBatchSlices,
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
)

__all__ = [
    "UBatchConfig",
    "UBatchSlice",
    "UBatchSlices",
    "check_ubatch_thresholds",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
]
