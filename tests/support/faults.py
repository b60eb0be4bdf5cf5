"""A planted-fault bench for the graph wrappers: one reference-decoder graph served by a plain, a
micro-batched or a piecewise wrapper, static inputs written as an engine writes them, and every
fault a replay check must catch planted through the public API.

``GraphUnderTest.build(kind, runtime)`` captures one graph of ``SIZE`` tokens and locks; ``step``
writes a batch into the static inputs and replays; the ``plant_*`` methods make one replay go wrong
the way an engine bug would. The tests (CPU, eager backend) and their CUDA twins share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import (
    AddressDriftError,
    BakedValueChangedError,
    LayoutMismatchError,
    StaleInputError,
    UnexpectedCaptureError,
)
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.piecewise import PiecewiseGraph
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.slices import maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper
from capture_core.wrapper import CUDAGraphWrapper

SIZE = 8
KINDS = ("plain", "ubatch", "piecewise")
INPUTS = ["input_ids", "positions", "slot_ids"]

K = ViolationKind
FAULTS = {
    # fault: (what is reported, about which name, what debug mode raises)
    "address_drift": (K.ADDRESS_DRIFT, "input_ids", AddressDriftError),
    "layout_mismatch": (K.LAYOUT_MISMATCH, "input_ids", LayoutMismatchError),
    "reassigned_weight": (K.ADDRESS_DRIFT, "self.layers.0.qkv_proj.weight", AddressDriftError),
    "stale_input": (K.STALE_INPUT, "input_ids", StaleInputError),
    "baked_host_value": (K.BAKED_VALUE_CHANGED, "logit_scale", BakedValueChangedError),
    "baked_slot": (K.BAKED_VALUE_CHANGED, "slot_offset", BakedValueChangedError),
    "late_wrapper": (K.UNEXPECTED_CAPTURE, None, UnexpectedCaptureError),
}
BAKED_ON_CUDA = ("baked_attribute", "baked_item")
"""Host values the model reads from itself: CUDA graphs bake them in, the eager backend re-reads them."""
CASES = [(kind, fault) for kind in KINDS for fault in FAULTS]
IDS = [f"{kind}-{fault}" for kind, fault in CASES]



class ScaledDecoder(ReferenceDecoder):
    """The reference decoder with host values in its step, each of which a CUDA graph bakes in at
    capture: ``logit_scale``, a Python float argument; ``attribute_scale``, a float it reads from
    itself; ``host_scale``, a CPU tensor it reads with ``.item()``; ``slot_offset``, a Python int
    added to every KV slot (where this engine's share of the cache starts), so a graph captured
    with another offset writes other slots than the step declares. (The eager backend's replay
    re-runs the model on its captured arguments, so it bakes only the arguments.)"""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.attribute_scale = 1.0
        self.host_scale = torch.ones(())  # a plain attribute on the CPU, neither parameter nor buffer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any = None,
        logit_scale: float = 1.0,
        slot_offset: int = 0,
    ) -> torch.Tensor:
        logits = super().forward(input_ids, positions, slot_ids + slot_offset, kv_cache, attn_metadata)
        return logits * (logit_scale * self.attribute_scale * self.host_scale.item())

    def kv_written(self, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The reference decoder's region, at the slots this call's ``slot_offset`` names."""
        layers, planes, slots, heads, positions = super().kv_written(context, args, kwargs)
        return (layers, planes, slots + kwargs.get("slot_offset", 0), heads, positions)


def outside_region_writers(violations: list[Any]) -> set[str]:
    """Who wrote a mutated input outside the region its step declares, by the canary's findings."""
    outside = (v.message for v in violations if "outside the region" in v.message)
    return {message.split(": ", 1)[1].split(" wrote")[0] for message in outside}


def checked_graph(kind: str, observer: Any, mode: str, policy: str, backend: str = "eager") -> GraphUnderTest:
    """A captured graph with every check on and every replay sampled (so the canary runs on each),
    after two clean steps that must record nothing."""
    runtime = GraphRuntime(
        backend, observer=observer, progress=False, warmup_iters=1 if backend == "eager" else 2,
        address_check=mode, unexpected_capture=policy, canary=True, sampling=Sampling(first=0, every=1),
    )
    under_test = GraphUnderTest.build(kind, runtime, device="cuda" if backend == "cuda" else "cpu")
    under_test.step()
    under_test.step()
    if backend == "cuda":
        torch.cuda.synchronize()
    assert observer.violations == [], [v.message for v in observer.violations]
    return under_test


@dataclass
class GraphUnderTest:
    kind: str
    runtime: GraphRuntime
    model: ScaledDecoder
    wrapper: Any
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    kv_cache: torch.Tensor
    seed: int = 0
    metadata: Any = field(default=None)

    @classmethod
    def build(
        cls, kind: str, runtime: GraphRuntime, device: str = "cpu", name: str | None = None
    ) -> GraphUnderTest:
        # Twice the slots a step uses: room for a step's slots moved by ``slot_offset``.
        config = ModelConfig.tiny(num_layers=2, max_num_seqs=2 * SIZE, max_seq_len=32, device=device)
        model = ScaledDecoder(config, seed=3)
        checked = {"per_step_inputs": INPUTS, "mutated_inputs": {"kv_cache": model.kv_written}}
        if kind == "plain":
            wrapper: Any = CUDAGraphWrapper(model, runtime, CUDAGraphMode.FULL, name=name or kind, **checked)
        elif kind == "ubatch":
            wrapper = UBatchWrapper(model, runtime, name=name or kind, handover_timeout=30, **checked)
        elif kind == "piecewise":
            wrapper = PiecewiseGraph(model, runtime, name=name or kind, **checked)
        else:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        ids, positions, slots = (torch.zeros(SIZE, dtype=torch.long, device=device) for _ in INPUTS)
        graph = cls(kind, runtime, model, wrapper, ids, positions, slots, model.new_kv_cache())
        with runtime.capture_phase():
            graph.step()
        return graph

    # -- the engine's side ------------------------------------------------------------------------
    def write(self) -> None:
        """This step's values copied into the static inputs: one decode token per request, each in
        its own KV slot (and, for the piecewise graph, the metadata its eager attention reads)."""
        self.seed += 1
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.model.config.vocab_size, (SIZE,), generator=generator).tolist()
        contexts = torch.randint(0, 16, (SIZE,), generator=generator).tolist()
        slots = torch.randperm(SIZE, generator=generator).tolist()
        batch = flatten_requests([[t] for t in tokens], contexts, slots, device=self.input_ids.device)
        self.input_ids.copy_(batch.input_ids)
        self.positions.copy_(batch.positions)
        self.slot_ids.copy_(batch.slot_ids)
        self.metadata = batch.attn_metadata

    def call(self, *tokens: torch.Tensor, **extra: Any) -> torch.Tensor:
        """Replay (or capture) on ``tokens`` (default: the static inputs) under the step's context."""
        ids, positions, slots = tokens or (self.input_ids, self.positions, self.slot_ids)
        descriptor = BatchDescriptor(SIZE, SIZE, True)
        if self.kind == "piecewise":
            context = set_forward_context(CUDAGraphMode.PIECEWISE, BatchDescriptor(SIZE))
            extra = {"attn_metadata": self.metadata, **extra}
        elif self.kind == "ubatch":
            _, slices = maybe_create_ubatch_slices(True, [1] * SIZE, SIZE, SIZE, 2)
            context = set_forward_context(CUDAGraphMode.FULL, descriptor, ubatch_slices=slices)
        else:
            context = set_forward_context(CUDAGraphMode.FULL, descriptor)
        with torch.no_grad(), context:
            return self.wrapper(ids, positions, slots, self.kv_cache, **extra)

    def step(self, **extra: Any) -> torch.Tensor:
        self.write()
        return self.call(**extra)

    # -- the faults ------------------------------------------------------------------------------
    def plant_address_drift(self) -> torch.Tensor:
        """A fresh ``input_ids`` tensor instead of a copy_ into the static one."""
        self.write()
        return self.call(self.input_ids.clone(), self.positions, self.slot_ids)

    def plant_layout_mismatch(self) -> torch.Tensor:
        """``input_ids`` at its address, read as another dtype (``x.view(torch.int32)``)."""
        self.write()
        return self.call(self.input_ids.view(torch.int32)[:SIZE], self.positions, self.slot_ids)

    def plant_reassigned_weight(self) -> torch.Tensor:
        """A weight reloaded by assignment (``lin.weight = nn.Parameter(new)``), not copy_."""
        layer = self.model.layers[0].qkv_proj
        layer.weight = nn.Parameter(layer.weight.detach().clone() * 1.5, requires_grad=False)
        return self.step()

    def plant_stale_input(self) -> torch.Tensor:
        """A step that forgets to write its inputs: the static ones still hold the previous step's."""
        return self.call()

    def plant_baked_host_value(self) -> torch.Tensor:
        """A Python scalar argument other than at capture: the graph replays the captured one."""
        return self.step(logit_scale=2.0)

    def plant_baked_slot(self) -> torch.Tensor:
        """A Python int that moves where the step writes the KV cache (``slot_offset``), other than at
        capture: the graph writes the captured slots, outside the region this step declares."""
        return self.step(slot_offset=SIZE)

    def plant_baked_attribute(self) -> torch.Tensor:
        """A value the model reads from itself, changed after capture (CUDA graphs bake it in)."""
        self.model.attribute_scale = 2.0
        return self.step()

    def plant_baked_item(self) -> torch.Tensor:
        """A CPU tensor the model reads with ``.item()``, changed after capture (baked on CUDA)."""
        self.model.host_scale.fill_(2.0)
        return self.step()

    def plant_late_wrapper(self) -> GraphUnderTest:
        """A second model served after start-up locked capture (a lazily built draft model), its
        capture phase begun late; returns the draft."""
        return GraphUnderTest.build(self.kind, self.runtime, str(self.input_ids.device), name="draft")
