"""What the decode runner and the mixed-batch runner share: static inputs, capture and the step.

A runner owns the model's static KV cache and static token inputs (token ids, positions, KV
slots) at the largest capture size. Start-up captures every graph its dispatcher lists, largest
first, on dummy inputs that write only the spare padding slot. Each step: the dispatcher's route
says which graph (or eager, with the reason); real values are ``copy_``-ed into the static inputs,
padding rows point at the spare slot, the outermost graph wrapper is called under the step's
forward context, and the logits are sliced back to the real tokens.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

import torch

from capture_core.buffers import BufferSpec, StaticBuffers
from capture_core.checks import ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher, Dispatch
from capture_core.forward_context import ForwardContext, set_forward_context, use_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime

INPUT_NAMES = ("input_ids", "positions", "slot_ids")
"""The static token inputs, in the order the model takes them (the KV cache follows)."""

Tokens = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A step's ``(input_ids, positions, slot_ids)``."""


class StepRunner(abc.ABC):
    """The shared half of a runner; a subclass says which graph wrapper a step calls."""

    def __init__(
        self,
        model: Any,
        runtime: GraphRuntime,
        dispatcher: CUDAGraphDispatcher,
        *,
        padding_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.runtime = runtime
        self.dispatcher = dispatcher
        self.mode = dispatcher.mode
        self.padding_slot = padding_slot
        self.device = device
        self.kv_cache: torch.Tensor = model.new_kv_cache()
        pads = {"input_ids": 0, "positions": 0, "slot_ids": padding_slot}
        self.buffers = StaticBuffers(
            dispatcher.sizes.max_size,
            {name: BufferSpec(torch.long, pads[name]) for name in INPUT_NAMES},
            device=device,
        )
        names = ParameterNames.of(model)
        self._kv_name = names.name_of(len(INPUT_NAMES))
        self.graph_options: dict[str, Any] = {
            "per_step_inputs": [names.name_of(i) for i in range(len(INPUT_NAMES))],
            "mutated_inputs": {self._kv_name: getattr(model, "kv_written", None)},
            "compared": self._real_part,
        }
        """What the runner's graph wrappers are told of the model's inputs (by the model's own
        parameter names): the token inputs are written every step, the KV cache is what a step
        mutates, where the model says (its ``kv_written``; a model that does not say has its cache
        copied whole by the canary), and the canary compares the real part of the logits and of the
        KV cache."""

    kv_slot_dim = 2
    """The KV cache's slot dimension, in the reference decoder's layout (layers, K/V, slots, ...)."""

    def _real_part(self, name: str, tensor: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """What of a step's logits and KV cache the canary compares: the real tokens' rows, and every
        slot but the spare padding slot, which padding rows write in any order on a GPU."""
        if name == self._kv_name:
            return tensor.narrow(self.kv_slot_dim, 0, self.padding_slot)
        if tensor.dim() and tensor.shape[0] == context.descriptor.num_tokens:
            return tensor[: context.num_real_tokens]
        return tensor

    @abc.abstractmethod
    def count_tokens(self, tokens: Tokens, attn_metadata: Any = None) -> int:
        """The step's real token count, once its inputs are checked to agree (ValueError if not)."""

    @abc.abstractmethod
    def _call_graphs(
        self, mode: CUDAGraphMode, views: dict[str, torch.Tensor], attn_metadata: Any = None
    ) -> torch.Tensor:
        """Call the runner's outermost graph wrapper on the static views."""

    def _context(
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_tokens: int, attn_metadata: Any = None
    ) -> use_forward_context:
        """The step's forward context (a runner may add what its graphs need)."""
        return set_forward_context(mode, descriptor, num_tokens, attn_metadata=attn_metadata)

    def _capture_graphs(self, graphs: Iterable[tuple[CUDAGraphMode, BatchDescriptor]], label: str) -> None:
        """Capture ``graphs``, largest first, with a progress bar; then lock (see ``capture_all``)."""
        self.buffers.reset()  # dummy inputs: every write lands in the spare padding slot

        def capture_one(mode: CUDAGraphMode, descriptor: BatchDescriptor) -> None:
            views = self.buffers.views(descriptor.num_tokens)
            with torch.no_grad(), self._context(mode, descriptor, descriptor.num_tokens):
                self._call_graphs(mode, views)

        self.runtime.capture_all(graphs, capture_one, label=label)

    def _serve(
        self,
        routed: Dispatch,
        wanted: CUDAGraphMode,
        tokens: Tokens,
        attn_metadata: Any = None,
    ) -> torch.Tensor:
        """One routed step over the real tokens: eager with its reason, or copy in, replay, slice.

        ``wanted`` is the mode the step would have replayed in, reported with an eager fallback.
        """
        num_tokens = routed.num_real_tokens
        if routed.eager_reason is not None:
            self.runtime.observer.on_eager(routed.eager_reason, num_tokens, wanted)
            run = self._run_eagerly
            return self.runtime.run_eager_fallback(routed.descriptor, run, tokens, attn_metadata)
        input_ids, positions, slot_ids = tokens  # keywords by hand: no dict built per step
        views = self.buffers.load(
            routed.descriptor.num_tokens, input_ids=input_ids, positions=positions, slot_ids=slot_ids
        )
        with torch.no_grad(), self._context(routed.mode, routed.descriptor, num_tokens, attn_metadata):
            logits = self._call_graphs(routed.mode, views, attn_metadata)
        return logits[:num_tokens]

    def step_eager(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        attn_metadata: Any = None,
    ) -> torch.Tensor:
        """The same step without graphs or padding: what every replay must equal."""
        tokens = (input_ids, positions, slot_ids)
        self.count_tokens(tokens, attn_metadata)
        return self._run_eagerly(tokens, attn_metadata)

    def _run_eagerly(self, tokens: Tokens, attn_metadata: Any) -> torch.Tensor:
        on_device = (t.to(self.device) for t in tokens)
        extra = () if attn_metadata is None else (attn_metadata,)
        with torch.no_grad():
            return self.model(*on_device, self.kv_cache, *extra)
