"""The mixed-batch runner: one engine step for any batch, under any CUDA-graph mode.

Where ``DecodeRunner`` serves uniform-decode steps from FULL graphs, this runner serves what a
continuous-batching engine actually meets: prefill chunks and decodes flattened into one batch.
The dispatcher routes each step (FULL graph for uniform decode, piecewise graph for mixed, or eager
with the reason), the inputs are ``copy_``-ed into static buffers padded to the graph's size, and
the logits are sliced back to the real tokens.

The stack follows vLLM's: a FULL ``CUDAGraphWrapper`` around a ``PiecewiseGraph`` around the
model. Under a FULL context the outer wrapper captures the whole step (attention included, on its
fixed-shape path); under a PIECEWISE context it stands aside and the piecewise graph replays its
segments with per-request attention between them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher, Dispatch
from capture_core.faults import plant_address_drift, plant_unexpected_capture
from capture_core.modes import CUDAGraphMode
from capture_core.piecewise import PiecewiseEntry, PiecewiseGraph
from capture_core.runtime import GraphRuntime
from capture_core.sizes import SizeTable
from capture_core.step_runner import StepRunner, Tokens
from capture_core.wrapper import CUDAGraphWrapper, GraphEntry

FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE


class StepMetadata(Protocol):
    """What the runner reads from a step's attention metadata (``model.AttentionMetadata``)."""

    @property
    def num_actual_tokens(self) -> int: ...

    @property
    def query_lens(self) -> tuple[int, ...]: ...


class MixedBatchRunner(StepRunner):
    """Serve flattened mixed prefill/decode steps of a reference-decoder-like model.

    ``model(input_ids, positions, slot_ids, kv_cache, attn_metadata=None) -> logits``, with
    ``new_kv_cache()`` and ``config.padding_slot`` / ``config.device`` as the reference decoder
    has them. ``mode`` is any configuration mode; NONE runs every step eagerly.
    """

    def __init__(
        self,
        model: Any,
        runtime: GraphRuntime,
        sizes: SizeTable | Sequence[int],
        mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE,
        *,
        uniform_decode_query_len: int = 1,
        name: str = "model",
    ) -> None:
        dispatcher = CUDAGraphDispatcher(mode, sizes, uniform_decode_query_len=uniform_decode_query_len)
        super().__init__(
            model, runtime, dispatcher, padding_slot=model.config.padding_slot,
            device=torch.device(model.config.device),
        )
        self.piecewise: PiecewiseGraph | None = None
        if mode.has_piecewise_cudagraphs():
            self.piecewise = PiecewiseGraph(model, runtime, name=f"{name}.piecewise", **self.graph_options)
        inner = self.piecewise if self.piecewise is not None else model
        self.full: CUDAGraphWrapper | None = None
        if mode.has_full_cudagraphs():
            self.full = CUDAGraphWrapper(
                inner, runtime, FULL, name=f"{name}.full", module=model, **self.graph_options
            )
        self._top = self.full if self.full is not None else inner

    def _call_graphs(
        self, mode: CUDAGraphMode, views: dict[str, torch.Tensor], attn_metadata: Any = None
    ) -> torch.Tensor:
        # A FULL graph runs attention on its fixed-shape path; per-request metadata would be baked in.
        extra = {"attn_metadata": attn_metadata} if mode is PIECEWISE and attn_metadata is not None else {}
        return self._top(views["input_ids"], views["positions"], views["slot_ids"], self.kv_cache, **extra)

    def capture(self) -> None:
        """Capture every graph the dispatcher lists, largest first, then lock capture."""
        self._capture_graphs(self.dispatcher.capture_list(), label="Capturing graphs")

    def is_uniform_decode(self, attn_metadata: StepMetadata) -> bool:
        """Every request decodes the same number of tokens (what FULL decode graphs serve)."""
        return all(q == self.dispatcher.uniform_decode_query_len for q in attn_metadata.query_lens)

    def route(self, attn_metadata: StepMetadata) -> Dispatch:
        """Where a step with this metadata goes (no events)."""
        uniform = self.is_uniform_decode(attn_metadata)
        return self.dispatcher.route(attn_metadata.num_actual_tokens, uniform_decode=uniform)

    def count_tokens(self, tokens: Tokens, attn_metadata: Any = None) -> int:
        """The tokens the metadata describes, which ``input_ids`` must hold."""
        num_tokens: int = attn_metadata.num_actual_tokens
        if tokens[0].shape[0] != num_tokens:
            raise ValueError(
                f"the metadata describes {num_tokens} tokens but input_ids has {tokens[0].shape[0]}"
            )
        return num_tokens

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        attn_metadata: StepMetadata,
    ) -> torch.Tensor:
        """One step over the real (unpadded) tokens; returns logits ``[num_real_tokens, vocab]``.

        On a graph the result is a view of its static output: read it before the next step.
        """
        tokens = (input_ids, positions, slot_ids)
        num_tokens = self.count_tokens(tokens, attn_metadata)
        uniform = self.is_uniform_decode(attn_metadata)
        routed = self.dispatcher.route(num_tokens, uniform_decode=uniform)
        wanted = self.mode.decode_mode() if uniform else self.mode.mixed_mode()
        return self._serve(routed, wanted, tokens, attn_metadata)

    @property
    def graphs(self) -> Mapping[BatchDescriptor, GraphEntry | PiecewiseEntry]:
        """Every graph this runner holds, by descriptor: the FULL ones and the piecewise ones."""
        held: dict[BatchDescriptor, GraphEntry | PiecewiseEntry] = {}
        for wrapper in (self.full, self.piecewise):
            if wrapper is not None:
                held.update(wrapper.graphs)
        return held

    def inject_address_drift(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                             attn_metadata: StepMetadata) -> torch.Tensor:
        """A planted fault: this step's ``input_ids`` go into a fresh tensor, not the static buffer.

        The graph (FULL or piecewise) reads the previous step's ids, so the logits are stale; the
        drift event is marked injected; DEBUG checks raise ``AddressDriftError``. A step that runs
        eagerly has no graph to drift (``FaultNotPlantable``).
        """
        routed = self.route(attn_metadata)
        return plant_address_drift(self, routed, self.step, input_ids, positions, slot_ids, attn_metadata)

    def inject_unexpected_capture(self) -> BatchDescriptor:
        """A planted fault: a decode batch of a size start-up never captured, after the lock.

        Dummy inputs write only the spare KV slot; the event is marked injected and the runtime's
        policy decides what follows. ``FaultNotPlantable`` when the mode captures no decode graphs
        or every size up to the largest has one. Returns the descriptor it asked for.
        """
        return plant_unexpected_capture(self, self._top)

    def __repr__(self) -> str:
        return (
            f"MixedBatchRunner(mode={self.mode.name}, sizes={list(self.dispatcher.sizes.sizes)}, "
            f"backend={self.runtime.backend_name})"
        )
