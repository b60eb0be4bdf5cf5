"""capture_core: a CUDA-graph cache for LLM decoding (torch and the standard library only).

The public surface, in the order a decode loop meets it: modes and descriptors (the graph key),
capture sizes and the dispatcher (which graph a batch replays), the forward context, the runtime
(shared pool, capture lock, checks, observer), the wrapper, static buffers and the decode runner;
then piecewise graphs for mixed batches, the reference decoder and the traffic model. Micro-
batching lives in the ``capture_core.ubatch`` subpackage (imported here as ``ubatch``).

A decode loop on the graph cache (CUDA graphs on a GPU, the eager stand-in elsewhere)::

    import torch
    from capture_core import DecodeRunner, GraphRuntime, ModelConfig, ReferenceDecoder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ReferenceDecoder(ModelConfig.tiny(max_num_seqs=8, max_seq_len=32, device=device))
    runtime = GraphRuntime("auto", address_check="always_on", unexpected_capture="raise")
    runner = DecodeRunner(model, runtime, sizes=[1, 2, 4, 8])
    runner.capture()                        # largest first, one shared pool; then capture locks
    slots = torch.tensor([0, 3, 5])
    tokens = torch.tensor([17, 42, 7])
    for position in range(4):
        logits = runner.step(tokens, torch.full((3,), position), slots)   # padded to the bucket of 4
        tokens = logits.argmax(-1)

Any callable becomes graph-served the same way: wrap it in ``CUDAGraphWrapper(fn, runtime)`` and
call it under ``set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(num_tokens))``, on static
inputs that are refilled with ``copy_`` (the address check reports any that move). Pass an
observer (``inspector.Recorder``, or anything with the ``GraphObserver`` methods) to record it.
"""

from capture_core import ubatch
from capture_core.backends import (
    CapturedGraph,
    CudaGraphBackend,
    EagerBackend,
    GraphBackend,
    pool_reserved_bytes,
    select_backend,
)
from capture_core.buffers import BufferSpec, StaticBuffers
from capture_core.checks import (
    AddressCheckMode,
    AddressDriftError,
    Drift,
    GraphCacheError,
    InputLayout,
    ParameterNames,
    effective_check_mode,
)
from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher, Dispatch
from capture_core.events import (
    CaptureEvent,
    FanOutObserver,
    GraphObserver,
    NullObserver,
    ViolationEvent,
    ViolationKind,
)
from capture_core.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
    use_forward_context,
)
from capture_core.model import AttentionMetadata, FlatBatch, ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.modes import CUDAGraphMode
from capture_core.piecewise import (
    PiecewiseEntry,
    PiecewiseGraph,
    SplitModel,
    attention_boundary,
    is_break_point,
    split_at_break_points,
)
from capture_core.progress import ProgressBar
from capture_core.runner import DecodeRunner
from capture_core.runtime import (
    CaptureDecision,
    CapturePhase,
    GraphRuntime,
    UnexpectedCaptureError,
    UnexpectedCapturePolicy,
)
from capture_core.sizes import (
    EagerReason,
    Padding,
    SizeTable,
    capture_sizes,
    power_of_two_sizes,
    validate_sizes,
    vllm_default_sizes,
)
from capture_core.traffic import (
    BatchSizeStats,
    ContinuousBatchScheduler,
    PaddingStats,
    Trace,
    TraceError,
    TraceRequest,
    TrafficConfig,
    batch_size_histogram,
    batch_size_stats,
    decode_batch_sizes,
    load_trace,
    padding_stats,
)
from capture_core.wrapper import CUDAGraphWrapper, GraphEntry

__all__ = [
    "AddressCheckMode",
    "AddressDriftError",
    "AttentionMetadata",
    "BatchDescriptor",
    "BatchSizeStats",
    "BufferSpec",
    "CUDAGraphDispatcher",
    "CUDAGraphMode",
    "CUDAGraphWrapper",
    "CaptureDecision",
    "CaptureEvent",
    "CapturePhase",
    "CapturedGraph",
    "ContinuousBatchScheduler",
    "CudaGraphBackend",
    "DecodeRunner",
    "Dispatch",
    "Drift",
    "EagerBackend",
    "EagerReason",
    "FanOutObserver",
    "FlatBatch",
    "ForwardContext",
    "GraphBackend",
    "GraphCacheError",
    "GraphEntry",
    "GraphObserver",
    "GraphRuntime",
    "InputLayout",
    "ModelConfig",
    "NullObserver",
    "Padding",
    "PaddingStats",
    "ParameterNames",
    "PiecewiseEntry",
    "PiecewiseGraph",
    "ProgressBar",
    "ReferenceDecoder",
    "SizeTable",
    "SplitModel",
    "StaticBuffers",
    "Trace",
    "TraceError",
    "TraceRequest",
    "TrafficConfig",
    "UnexpectedCaptureError",
    "UnexpectedCapturePolicy",
    "ViolationEvent",
    "ViolationKind",
    "attention_boundary",
    "batch_size_histogram",
    "batch_size_stats",
    "capture_sizes",
    "decode_batch_sizes",
    "effective_check_mode",
    "flatten_requests",
    "get_forward_context",
    "is_break_point",
    "load_trace",
    "padding_stats",
    "pool_reserved_bytes",
    "power_of_two_sizes",
    "select_backend",
    "set_forward_context",
    "split_at_break_points",
    "ubatch",
    "use_forward_context",
    "validate_sizes",
    "vllm_default_sizes",
]
