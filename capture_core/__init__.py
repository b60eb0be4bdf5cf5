"""capture_core: a CUDA-graph cache for LLM decoding (torch and the standard library only).

The public surface, in the order a decode loop meets it: modes and descriptors (the graph key),
capture sizes and the dispatcher (which graph a batch replays), the forward context, the runtime
(shared pool, capture lock, checks, observer), the wrapper, static buffers and the decode runner;
then piecewise graphs for mixed batches. Micro-batching lives in the ``capture_core.ubatch``
subpackage (imported here as ``ubatch``); the reference workload (a decoder with random weights, a
real serving trace and a continuous-batching scheduler) in ``capture_core.reference``, outside the
cache's surface.

A decode loop on the graph cache (CUDA graphs on a GPU, the eager stand-in elsewhere)::

    import torch
    from capture_core import DecodeRunner, GraphRuntime
    from capture_core.reference import ModelConfig, ReferenceDecoder

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

from __future__ import annotations

from capture_core.lazy import lazy_exports

# Names resolve on first use (PEP 562), so that `import capture_core.modes` (the daemon needs two
# enums) does not import the backends and the rest of the torch-heavy code.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "capture_core.backends": (
        "CapturedGraph",
        "CudaGraphBackend",
        "EagerBackend",
        "GraphBackend",
        "pool_reserved_bytes",
        "select_backend",
    ),
    "capture_core.buffers": ("BufferSpec", "StaticBuffers"),
    "capture_core.canary": ("Sampling",),
    "capture_core.checks": ("AddressCheckMode", "Finding", "ParameterNames", "effective_check_mode"),
    "capture_core.errors": (
        "AddressDriftError",
        "BakedValueChangedError",
        "GraphCacheError",
        "GraphCheckError",
        "LayoutMismatchError",
        "ReplayMismatchError",
        "StaleInputError",
        "StaleOutputError",
        "UnexpectedCaptureError",
    ),
    "capture_core.descriptor": ("BatchDescriptor",),
    "capture_core.dispatcher": ("CUDAGraphDispatcher", "Dispatch"),
    "capture_core.events": (
        "CaptureEvent",
        "FanOutObserver",
        "GraphObserver",
        "KindRecord",
        "NullObserver",
        "ViolationEvent",
        "ViolationKind",
    ),
    "capture_core.guard": ("ReplayChecks",),
    "capture_core.inputs": ("InputLayout", "TensorInput", "TensorLayout"),
    "capture_core.forward_context": (
        "ForwardContext",
        "get_forward_context",
        "set_forward_context",
        "use_forward_context",
    ),
    "capture_core.mixed_runner": ("MixedBatchRunner",),
    "capture_core.modes": ("CUDAGraphMode",),
    "capture_core.piecewise": (
        "PiecewiseEntry",
        "PiecewiseGraph",
        "SplitModel",
        "attention_boundary",
        "is_break_point",
        "split_at_break_points",
    ),
    "capture_core.progress": ("ProgressBar",),
    "capture_core.runner": ("DecodeRunner",),
    "capture_core.runtime": (
        "CaptureDecision",
        "CapturePhase",
        "GraphRuntime",
        "UnexpectedCapturePolicy",
    ),
    "capture_core.sizes": (
        "EagerReason",
        "Padding",
        "SizeTable",
        "capture_sizes",
        "power_of_two_sizes",
        "validate_sizes",
        "vllm_default_sizes",
    ),
    "capture_core.state": ("ModuleState",),
    "capture_core.step_runner": ("StepRunner",),
    "capture_core.wrapper": (
        "CUDAGraphWrapper",
        "CallableSource",
        "GraphCall",
        "GraphEntry",
        "GraphRole",
        "GraphSource",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
