"""capture_core: a CUDA-graph cache for LLM decoding (torch and the standard library only).

The public surface, in the order a decode loop meets it: modes and descriptors (the graph key),
capture sizes and the dispatcher (which graph a batch replays), the forward context, the runtime
(shared pool, capture lock, checks, observer), the wrapper, static buffers and the decode runner.
"""

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
from capture_core.modes import CUDAGraphMode
from capture_core.progress import ProgressBar
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
from capture_core.wrapper import CUDAGraphWrapper, GraphEntry

__all__ = [
    "AddressCheckMode",
    "AddressDriftError",
    "BatchDescriptor",
    "BufferSpec",
    "CUDAGraphDispatcher",
    "CUDAGraphMode",
    "CUDAGraphWrapper",
    "CaptureDecision",
    "CaptureEvent",
    "CapturePhase",
    "CapturedGraph",
    "CudaGraphBackend",
    "Dispatch",
    "Drift",
    "EagerBackend",
    "EagerReason",
    "FanOutObserver",
    "ForwardContext",
    "GraphBackend",
    "GraphCacheError",
    "GraphEntry",
    "GraphObserver",
    "GraphRuntime",
    "InputLayout",
    "NullObserver",
    "Padding",
    "ParameterNames",
    "ProgressBar",
    "SizeTable",
    "StaticBuffers",
    "UnexpectedCaptureError",
    "UnexpectedCapturePolicy",
    "ViolationEvent",
    "ViolationKind",
    "capture_sizes",
    "effective_check_mode",
    "get_forward_context",
    "pool_reserved_bytes",
    "power_of_two_sizes",
    "select_backend",
    "set_forward_context",
    "use_forward_context",
    "validate_sizes",
    "vllm_default_sizes",
]
