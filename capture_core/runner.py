"""The decode runner: the bucketed CUDA-graph decode loop of the tutorial, on the graph cache.

Start-up: allocate the static KV cache and static inputs (token ids, positions, KV slots) at the
largest capture size, then capture one FULL graph per bucket, largest first, inside the capture
phase, and lock. Each step: the dispatcher picks the bucket (or eager, with the reason, above the
largest), real values are ``copy_``-ed into the static inputs, the padding rows point at the KV
cache's spare slot, the graph replays, and the logits are sliced to the real tokens.

With micro-batching on (``ubatch=UBatchConfig(enabled=True)``), every bucket at or above the decode
token threshold is captured as ONE graph of its micro-batches (``UBatchWrapper``, as vLLM's DBO),
and every step padded to such a bucket replays it; smaller buckets keep their plain graphs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher, Dispatch
from capture_core.faults import plant_address_drift, plant_unexpected_capture
from capture_core.forward_context import ForwardContext, set_forward_context, use_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.sizes import SizeTable
from capture_core.step_runner import INPUT_NAMES, StepRunner, Tokens
from capture_core.ubatch.slices import (
    UBatchConfig,
    UBatchSlice,
    check_ubatch_thresholds,
    maybe_create_ubatch_slices,
)
from capture_core.ubatch.wrapper import UBatchWrapper
from capture_core.wrapper import CUDAGraphWrapper, GraphEntry

FULL = CUDAGraphMode.FULL


class DecodeRunner(StepRunner):
    """Uniform-decode steps (one new token per request) served from FULL graphs per bucket.

    ``model`` follows the reference decoder's contract: ``model(input_ids, positions, slot_ids,
    kv_cache) -> logits[num_tokens, vocab]`` with fixed shapes per token count, ``new_kv_cache()``
    with a spare padding slot at index ``max_num_seqs``, and a ``config`` with ``max_num_seqs``
    and ``device`` (or pass them). ``mode`` must decode in FULL graphs (FULL, FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE) or be NONE (every step eager). ``ubatch`` turns on micro-batching of the
    buckets at or above its decode token threshold (off by default).
    """

    def __init__(
        self,
        model: Any,
        runtime: GraphRuntime,
        sizes: SizeTable | Sequence[int],
        mode: CUDAGraphMode = CUDAGraphMode.FULL,
        max_num_seqs: int | None = None,
        device: torch.device | str | None = None,
        name: str = "decode",
        ubatch: UBatchConfig | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        if mode.decode_mode() not in (CUDAGraphMode.FULL, CUDAGraphMode.NONE):
            raise ValueError(
                f"the decode runner replays FULL graphs for decode steps; mode {mode.name} decodes "
                f"in {mode.decode_mode().name}"
            )
        if max_num_seqs is None:
            max_num_seqs = getattr(config, "max_num_seqs", None)
        if max_num_seqs is None:
            raise ValueError("pass max_num_seqs: the model has no config.max_num_seqs")
        self.max_num_seqs: int = max_num_seqs
        device = torch.device(device if device is not None else getattr(config, "device", "cpu"))
        if runtime.backend_name == "cuda" and device.type != "cuda":
            raise ValueError(
                f"the cuda graph backend records CUDA work, but the model is on {device}: "
                "move it to the GPU (ModelConfig(device='cuda')) or use the eager backend"
            )
        super().__init__(
            model, runtime, CUDAGraphDispatcher(mode, sizes), padding_slot=max_num_seqs, device=device
        )
        table = self.dispatcher.sizes
        if table.max_size > self.max_num_seqs:
            raise ValueError(
                f"the largest capture size {table.max_size} is above max_num_seqs={self.max_num_seqs}: "
                "a decode step has one token per request, so it can never fill that bucket"
            )
        self.ubatch = ubatch if ubatch is not None else UBatchConfig()
        self.ubatch_slices: dict[int, tuple[UBatchSlice, ...]] = {}
        """Bucket size -> the micro-batches its graph is captured as (empty: no micro-batching)."""
        if mode.decode_mode() is CUDAGraphMode.FULL:
            self.ubatch_slices = {
                size: _split(size, self.ubatch.num_ubatches)
                for size in table.sizes
                if check_ubatch_thresholds(self.ubatch, size, uniform_decode=True)
                and size >= self.ubatch.num_ubatches > 1
            }
        self.graphed: CUDAGraphWrapper | UBatchWrapper
        if self.ubatch_slices:
            tokens = self.graph_options["per_step_inputs"]
            checked = self.graph_options
            self.graphed = UBatchWrapper(model, runtime, name=name, token_inputs=tokens, **checked)
        else:
            self.graphed = CUDAGraphWrapper(model, runtime, FULL, name=name, **self.graph_options)
        self._decode_mode = mode.decode_mode()
        self._routes = self._route_table()
        self._contexts = [
            None if route is None else self._new_context(route.mode, route.descriptor, route.num_real_tokens)
            for route in self._routes
        ]
        """Each route's forward context, built once (index = token count), as its route is."""

    def _route_table(self) -> list[Dispatch | None]:
        """Every decode batch size's dispatch, worked out once; index = token count.

        Routing is a pure function of the token count for uniform decode, so the step path reads a
        list instead of building descriptors; and each entry carries the very descriptor object
        that is captured, which lets the wrapper find its graph by identity.
        """
        canonical = {d: d for keys in self.dispatcher.keys.values() for d in keys}
        table: list[Dispatch | None] = [None]
        for num_tokens in range(1, self.dispatcher.sizes.max_size + 1):
            routed = self.dispatcher.route(num_tokens, uniform_decode=True)
            descriptor = canonical.get(routed.descriptor, routed.descriptor)
            table.append(Dispatch(routed.mode, descriptor, num_tokens, routed.eager_reason))
        return table

    def route(self, num_tokens: int) -> Dispatch:
        """Where a decode step of ``num_tokens`` goes (a graph's descriptor, or eager with the reason)."""
        if 0 < num_tokens < len(self._routes):
            routed = self._routes[num_tokens]
            assert routed is not None
            return routed
        return self.dispatcher.route(num_tokens, uniform_decode=True)  # above the table, or an error

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        return self.dispatcher.sizes.sizes

    @property
    def graphs(self) -> Mapping[BatchDescriptor, GraphEntry]:
        """Every graph this runner holds, by descriptor (micro-batched ones included)."""
        return self.graphed.graphs

    def _context(
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_tokens: int, attn_metadata: Any = None
    ) -> use_forward_context:
        """The step's forward context: its micro-batches too when its bucket is micro-batched (a
        routed step's was built with its route)."""
        if num_tokens < len(self._contexts):
            context = self._contexts[num_tokens]
            if context is not None and context.descriptor is descriptor and context.mode is mode:
                return use_forward_context(context)
        return use_forward_context(self._new_context(mode, descriptor, num_tokens))

    def _new_context(
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_tokens: int
    ) -> ForwardContext:
        slices = self.ubatch_slices.get(descriptor.num_tokens) if mode is CUDAGraphMode.FULL else None
        context = set_forward_context(mode, descriptor, num_tokens, ubatch_slices=slices).context
        assert context is not None
        return context

    def _call_graphs(
        self, mode: CUDAGraphMode, views: dict[str, torch.Tensor], attn_metadata: Any = None
    ) -> torch.Tensor:
        return self.graphed(views["input_ids"], views["positions"], views["slot_ids"], self.kv_cache)

    def capture(self) -> None:
        """Capture every bucket's graph, largest first, with a progress bar; then lock capture.

        To capture other graphs on the same runtime too (a mixed-batch runner), call this inside
        ``with runtime.capture_phase():``: the lock then falls when that outer phase ends.
        """
        graphs = [(CUDAGraphMode.FULL, d) for d in self.dispatcher.capture_descriptors(CUDAGraphMode.FULL)]
        self._capture_graphs(graphs, label=f"Capturing {self.graphed.name} graphs")

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """One decode step; returns logits ``[num_real_tokens, vocab]``.

        On a graph, the result is a view of the graph's static output: read it (or clone it)
        before the next step overwrites it.
        """
        routed = self.route(_num_tokens(input_ids, positions, slot_ids))
        return self._serve(routed, self._decode_mode, (input_ids, positions, slot_ids))

    def count_tokens(self, tokens: Tokens, attn_metadata: Any = None) -> int:
        """A decode step's token count: the three inputs are 1-D, of one non-zero length."""
        return _num_tokens(*tokens)

    def inject_address_drift(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """A planted fault: this step's ``input_ids`` go into a fresh tensor, not the static buffer.

        This is the classic engine bug: the graph still reads the static buffer, which holds the
        previous step's token ids, so the logits are stale. The drift event is marked injected; in
        DEBUG checks this raises ``AddressDriftError``. ``FaultNotPlantable`` for an eager step.
        """
        routed = self.route(_num_tokens(input_ids, positions, slot_ids))
        return plant_address_drift(self, routed, self.step, input_ids, positions, slot_ids)

    def inject_unexpected_capture(self) -> BatchDescriptor:
        """A planted fault: ask for a decode graph that start-up never captured, after the lock.

        Runs on dummy inputs (writing only the spare KV slot). The event is marked injected; what
        follows is the runtime's policy (raise ``UnexpectedCaptureError``, serve eagerly, or
        capture). Returns the descriptor it asked for.
        """
        return plant_unexpected_capture(self, self.graphed)

    def __repr__(self) -> str:
        return (
            f"DecodeRunner(mode={self.mode.name}, sizes={list(self.capture_sizes)}, "
            f"backend={self.runtime.backend_name}, graphs={len(self.graphs)}, "
            f"ubatched={sorted(self.ubatch_slices)})"
        )


def _split(size: int, num_ubatches: int) -> tuple[UBatchSlice, ...]:
    """A bucket's micro-batches: equal token splits, the last one taking any remainder."""
    _, slices = maybe_create_ubatch_slices(True, [1] * size, size, size, num_ubatches)
    assert slices is not None
    return tuple(slices)


def _num_tokens(input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> int:
    shape = input_ids.shape
    if len(shape) != 1 or positions.shape != shape or slot_ids.shape != shape:
        tensors = (input_ids, positions, slot_ids)
        shapes = ", ".join(f"{n}={tuple(t.shape)}" for n, t in zip(INPUT_NAMES, tensors, strict=True))
        raise ValueError(f"input_ids, positions and slot_ids must be 1-D of one length, got {shapes}")
    if shape[0] == 0:
        raise ValueError("a decode step needs at least one token")
    return shape[0]
