"""A planted divergence for the locating tests: the reference decoder with a host value baked into one
layer, served by a graph wrapper with every check and the canary on (CPU and CUDA alike).

``BakedLayerDecoder`` scales one layer's output by a Python float it is called with
(``layer_scale``): a graph captured with 1.0 keeps computing 1.0 whatever a later call passes, on the
eager backend (whose replay re-runs the call as captured) as on CUDA. The fault is planted by
calling the graph with another value: the guard reports it as a ``baked_value_changed`` argument,
and the canary finds the logits differ; the probe must find that the first module to differ is that
layer, every module before it agreeing. ``unread=("layer_scale",)`` declares (wrongly) that the
graph does not read it: then the canary alone finds it. (Not the last layer:
the final RMSNorm divides a scale of the last layer's output away, and the logits agree.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

SIZE = 8
BAKED_LAYER = 2


class ScaledLayer(nn.Module):
    """A decoder layer whose output is scaled by a host value set for each call (``scale``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.scale = 1.0

    def forward(self, *args: Any) -> torch.Tensor:
        return self.layer(*args) * self.scale


class BakedLayerDecoder(ReferenceDecoder):
    """The reference decoder with layer ``baked_layer`` scaled by the call's ``layer_scale``."""

    def __init__(self, config: ModelConfig, baked_layer: int = BAKED_LAYER, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.layers[baked_layer] = ScaledLayer(self.layers[baked_layer])
        self.baked_layer = baked_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any = None, layer_scale: float = 1.0) -> torch.Tensor:
        self.layers[self.baked_layer].scale = layer_scale
        return super().forward(input_ids, positions, slot_ids, kv_cache, attn_metadata)


@dataclass
class BakedGraph:
    """One captured graph of the decoder, its static inputs, and the step an engine would run."""

    runtime: GraphRuntime
    model: BakedLayerDecoder
    wrapper: CUDAGraphWrapper
    tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    kv_cache: torch.Tensor
    seed: int = 0

    @classmethod
    def build(cls, observer: Any, backend: str = "eager", baked_layer: int = BAKED_LAYER,
              unread: tuple[str, ...] = (), **runtime_options: Any) -> BakedGraph:
        device = "cuda" if backend == "cuda" else "cpu"
        config = ModelConfig.tiny(num_layers=4, max_num_seqs=SIZE, max_seq_len=32, device=device)
        model = BakedLayerDecoder(config, baked_layer, seed=5)
        runtime = GraphRuntime(backend, observer=observer, progress=False, canary=True,
                               sampling=Sampling(first=0, every=1),
                               warmup_iters=1 if backend == "eager" else 2, **runtime_options)
        wrapper = CUDAGraphWrapper(model, runtime, CUDAGraphMode.FULL, name="decoder",
                                   per_step_inputs=["input_ids", "positions", "slot_ids"],
                                   mutated_inputs={"kv_cache": model.kv_written}, unread=unread)
        tokens = tuple(torch.zeros(SIZE, dtype=torch.long, device=device) for _ in range(3))
        graph = cls(runtime, model, wrapper, tokens, model.new_kv_cache())  # type: ignore[arg-type]
        with runtime.capture_phase():
            graph.step()
        return graph

    def write(self) -> None:
        """This step's tokens, one decode token per request in its own slot, into the static inputs."""
        self.seed += 1
        generator = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, self.model.config.vocab_size, (SIZE,), generator=generator).tolist()
        contexts = torch.randint(0, 16, (SIZE,), generator=generator).tolist()
        device = self.kv_cache.device
        batch = flatten_requests([[t] for t in ids], contexts, list(range(SIZE)), device=device)
        values = (batch.input_ids, batch.positions, batch.slot_ids)
        for static, value in zip(self.tokens, values, strict=True):
            static.copy_(value)

    def step(self, layer_scale: float = 1.0) -> torch.Tensor:
        self.write()
        with torch.no_grad(), set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(SIZE, SIZE, True)):
            return self.wrapper(*self.tokens, self.kv_cache, layer_scale=layer_scale)
