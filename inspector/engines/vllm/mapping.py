"""vLLM's vocabulary in graph-inspector's: its runtime modes, its two descriptors, its eager steps and
its configuration.

vLLM 0.25 keys a graph by ``BatchDescriptor(num_tokens, num_reqs, uniform, has_lora,
num_active_loras)`` (the V1 runner and every ``CUDAGraphWrapper``), and its V2 runner keys FULL graphs
by ``BatchExecutionDescriptor(cg_mode, num_tokens, num_reqs, uniform_token_count,
num_active_loras)``; both carry the padded token count, which is graph-inspector's captured size.
These functions read those objects by attribute only, so they are exercised without vLLM too.
"""

from __future__ import annotations

import enum
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason

_MODES = {"NONE": CUDAGraphMode.NONE, "PIECEWISE": CUDAGraphMode.PIECEWISE, "FULL": CUDAGraphMode.FULL,
          "FULL_DECODE_ONLY": CUDAGraphMode.FULL_DECODE_ONLY,
          "FULL_AND_PIECEWISE": CUDAGraphMode.FULL_AND_PIECEWISE}


_BY_MEMBER: dict[int, CUDAGraphMode] = {}
"""id(vLLM's enum member) -> graph-inspector's mode: members live as long as their class, and an
enum's ``name`` is a Python property, read at every step otherwise."""


def mode_of(vllm_mode: Any) -> CUDAGraphMode:
    """graph-inspector's mode for one of vLLM's ``CUDAGraphMode`` members (same names)."""
    found = _BY_MEMBER.get(id(vllm_mode))
    if found is not None:
        return found
    try:
        found = _MODES[vllm_mode.name]
    except (AttributeError, KeyError):
        raise ValueError(f"not a vLLM CUDA-graph mode: {vllm_mode!r}") from None
    if isinstance(vllm_mode, enum.Enum):
        _BY_MEMBER[id(vllm_mode)] = found
    return found


def descriptor_of(batch_descriptor: Any) -> BatchDescriptor:
    """A vLLM ``BatchDescriptor`` (the forward context's key, the V1 dispatcher's answer)."""
    loras = int(batch_descriptor.num_active_loras or 0)
    return BatchDescriptor(
        num_tokens=int(batch_descriptor.num_tokens),
        num_reqs=None if batch_descriptor.num_reqs is None else int(batch_descriptor.num_reqs),
        uniform=bool(batch_descriptor.uniform),
        has_lora=bool(batch_descriptor.has_lora) or loras > 0,
        num_active_loras=loras,
    )


def descriptor_of_execution(execution: Any) -> BatchDescriptor:
    """The V2 runner's ``BatchExecutionDescriptor``: uniform when it fixes a per-request token count
    (a uniform decode batch); its request count is None for PIECEWISE graphs, as vLLM's is."""
    loras = int(execution.num_active_loras or 0)
    return BatchDescriptor(
        num_tokens=int(execution.num_tokens),
        num_reqs=None if execution.num_reqs is None else int(execution.num_reqs),
        uniform=execution.uniform_token_count is not None,
        has_lora=loras > 0,
        num_active_loras=loras,
    )


def eager_reason(
    num_tokens: int,
    uniform: bool,
    configured: CUDAGraphMode,
    max_capture_size: int | None,
    *,
    forced: bool = False,
) -> tuple[EagerReason, CUDAGraphMode]:
    """Why vLLM ran a step of ``num_tokens`` eagerly, and the mode it would have replayed in.

    The reasons follow vLLM's dispatch order: graphs off; above the largest capture size; a step the
    engine forced eager (cascade attention, encoder inputs); a mixed batch in a configuration with
    no mixed graphs (FULL_DECODE_ONLY); else no captured key matched (a request or LoRA count).
    """
    would_be = configured.decode_mode() if uniform else configured.mixed_mode()
    if configured is CUDAGraphMode.NONE:
        return EagerReason.MODE_NONE, CUDAGraphMode.NONE
    if max_capture_size is None or num_tokens > max_capture_size:
        return EagerReason.ABOVE_MAX_CAPTURE_SIZE, would_be
    if forced:
        return EagerReason.ENGINE_FORCED, would_be
    if would_be is CUDAGraphMode.NONE:
        return EagerReason.NO_GRAPH_FOR_MIXED_BATCH, configured.decode_mode()
    return EagerReason.NO_MATCHING_GRAPH, would_be


def config_of(vllm_config: Any, runner: str, version: str) -> dict[str, Any]:
    """What a run records of vLLM's configuration: the capture sizes, the mode and the limits that
    decide which graph a step replays (and that ``graph-inspector advise`` bounds its advice by)."""
    compilation = vllm_config.compilation_config
    scheduler = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    sizes = compilation.cudagraph_capture_sizes
    return {
        "engine": "vllm",
        "vllm_version": version,
        "model_runner": runner,
        "model": str(getattr(model, "model", "")),
        "dtype": str(getattr(model, "dtype", "")),
        "max_model_len": getattr(model, "max_model_len", None),
        "compilation_mode": str(getattr(compilation, "mode", "")),
        "cudagraph_mode": getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode)),
        "cudagraph_capture_sizes": sorted(int(s) for s in sizes) if sizes else [],
        "max_cudagraph_capture_size": compilation.max_cudagraph_capture_size,
        "cudagraph_num_of_warmups": compilation.cudagraph_num_of_warmups,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": getattr(scheduler, "enable_chunked_prefill", None),
        "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
        "gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
        "kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None),
    }
