"""The reference workload: what the demo, the tests and the benchmarks run on the graph cache.

Not the cache itself (that is the rest of ``capture_core``): a small Llama-style decoder with
random weights over vLLM-style flattened tokens (``decoder``, ``config``, ``batch``), a variant with
a communication step per layer for micro-batching (``overlap``), and real traffic: the Azure LLM
conversation trace (``trace``, data in ``data/``) replayed through a continuous-batching scheduler
(``scheduler``), with the figures of the batch sizes it produces (``stats``).

Names resolve on first use, so reading a trace or scheduling traffic does not import torch.
"""

from __future__ import annotations

from capture_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "capture_core.reference.batch": ("AttentionMetadata", "DecodeTensors", "FlatBatch", "flatten_requests"),
    "capture_core.reference.config": ("ModelConfig",),
    "capture_core.reference.decoder": ("ReferenceDecoder",),
    "capture_core.reference.overlap": ("CommOverlapDecoder",),
    "capture_core.reference.scheduler": (
        "ContinuousBatchScheduler",
        "PrefillChunk",
        "Step",
        "TrafficConfig",
        "decode_batch_sizes",
    ),
    "capture_core.reference.stats": (
        "BatchSizeStats",
        "PaddingStats",
        "batch_size_histogram",
        "batch_size_stats",
        "padding_stats",
    ),
    "capture_core.reference.trace": (
        "DEFAULT_TRACE_PATH",
        "Trace",
        "TraceError",
        "TraceRequest",
        "load_trace",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
