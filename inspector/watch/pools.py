"""Pool memory of a graph, from the caching allocator's segments tagged with the graph's pool id.

``torch.cuda.memory_allocated()`` cannot tell which graph holds what, and misses blocks a graph
freed back into its private pool; the allocator's snapshot tags every segment with the pool it
belongs to (``segment_pool_id``), so the bytes a capture added to its pool are the pool's reserved
bytes after the capture less those before it. Captures are rare, so the snapshot's cost is fine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PoolId = tuple[int, int]
PoolMeter = Callable[[PoolId], int]
"""Reserved bytes of one graph pool."""


def pool_id(handle: object) -> PoolId | None:
    """A graph pool handle (what ``CUDAGraph.pool()`` or ``graph_pool_handle()`` return) as a key."""
    if handle is None:
        return None
    try:
        first, second = handle  # type: ignore[misc]
        return int(first), int(second)
    except (TypeError, ValueError):
        return None


def allocator_pool_bytes(pool: PoolId) -> int:
    """Bytes the CUDA caching allocator has reserved in segments of ``pool`` (0 without CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    total = 0
    for segment in _segments(pool):
        if pool_id(segment.get("segment_pool_id")) == pool:
            total += int(segment.get("total_size", 0))
    return total


_SNAPSHOT_FORMS: list[Callable[[PoolId], list[dict]]] = [
    # Newest first: one pool's segments without allocation traces (cheap), then one pool's, then
    # everything (torch releases before per-pool snapshots); the first form that works is kept.
    lambda pool: torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False),
    lambda pool: torch.cuda.memory_snapshot(mempool_id=pool),
    lambda pool: torch.cuda.memory_snapshot(),
]


def _segments(pool: PoolId) -> list[dict]:
    while len(_SNAPSHOT_FORMS) > 1:
        try:
            return _SNAPSHOT_FORMS[0](pool)
        except TypeError:  # this torch does not take these arguments
            _SNAPSHOT_FORMS.pop(0)
    return _SNAPSHOT_FORMS[0](pool)


def pool_text(pool: PoolId | None) -> str:
    return "unknown" if pool is None else f"{pool[0]}:{pool[1]}"
