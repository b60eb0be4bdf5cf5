"""A planted-fault bench for the graph wrappers: one reference-decoder graph served by a plain, a
micro-batched or a piecewise wrapper, static inputs written as an engine writes them, and every
fault a replay check must catch planted through the public API, each beside the legitimate pattern
that must stay silent.

``GraphUnderTest.build(kind, runtime)`` captures one graph of ``SIZE`` tokens and locks; ``step``
writes a batch into the static inputs and replays; the ``plant_*`` methods make one replay go wrong
the way an engine bug would, and each fault's ``legit`` method runs the pattern real engines use
beside it (writes no version counter sees, padding rewritten, weights loaded with copy_, ...). The
tests (CPU, eager backend), their CUDA twins and ``bench/gpu_checks.py`` share it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import (
    AddressDriftError,
    BakedValueChangedError,
    GraphCacheError,
    LayoutMismatchError,
    StaleInputError,
    StaleOutputError,
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
WEIGHT = "self.layers.0.qkv_proj.weight"


@dataclass(frozen=True)
class Fault:
    """One planted fault: what is reported about which name, what debug mode raises, and the
    ``GraphUnderTest`` method that runs the legitimate pattern beside it."""

    kind: ViolationKind
    name: str | None
    error: type[GraphCacheError]
    legit: str
    debug_only: bool = False
    """Found in debug mode only (a stale output: always on, outputs are handed back as they are)."""
    inference: bool = False
    """Planted in a graph built and served under ``torch.inference_mode()``."""


FAULTS = {
    "address_drift": Fault(K.ADDRESS_DRIFT, "input_ids", AddressDriftError, "fresh_views"),
    "layout_mismatch": Fault(K.LAYOUT_MISMATCH, "input_ids", LayoutMismatchError, "fresh_views"),
    "input_storage_swapped": Fault(
        K.ADDRESS_DRIFT, "input_ids", AddressDriftError, "inputs_advanced_in_place"
    ),
    "reassigned_weight": Fault(K.ADDRESS_DRIFT, WEIGHT, AddressDriftError, "weights_loaded_with_copy"),
    "weight_data_swapped": Fault(K.ADDRESS_DRIFT, WEIGHT, AddressDriftError, "weights_loaded_with_copy"),
    "stale_input": Fault(K.STALE_INPUT, "input_ids", StaleInputError, "inputs_written_unseen"),
    "stale_input_inference": Fault(
        K.STALE_INPUT, "input_ids", StaleInputError, "inputs_written_unseen", inference=True
    ),
    "stale_padding": Fault(K.STALE_INPUT, "input_ids", StaleInputError, "padding_rewritten"),
    "baked_host_value": Fault(
        K.BAKED_VALUE_CHANGED, "logit_scale", BakedValueChangedError, "same_host_values"
    ),
    "baked_slot": Fault(K.BAKED_VALUE_CHANGED, "slot_offset", BakedValueChangedError, "same_host_values"),
    "baked_attribute": Fault(
        K.BAKED_VALUE_CHANGED, "self.attribute_scale", BakedValueChangedError, "same_host_values"
    ),
    "late_wrapper": Fault(K.UNEXPECTED_CAPTURE, None, UnexpectedCaptureError, "steps"),
    "stale_output": Fault(K.STALE_OUTPUT, "output", StaleOutputError, "outputs_cloned", debug_only=True),
}
"""Every fault a replay check catches at the replay it is planted in."""
ALWAYS_ON = [name for name, fault in FAULTS.items() if not fault.debug_only]
BAKED_ON_CUDA = ("baked_item",)
"""A host value the model reads from itself that no check keeps (a CPU tensor's ``.item()``): CUDA
graphs bake it in, the eager backend re-reads it; the canary finds it."""
ALWAYS_ON_CASES = [(kind, fault) for kind in KINDS for fault in ALWAYS_ON]
DEBUG_CASES = [(kind, fault) for kind in KINDS for fault in FAULTS]
LEGIT = sorted({(fault.legit, fault.inference) for fault in FAULTS.values()})
"""Each legitimate pattern once, with whether it runs under ``torch.inference_mode()``."""


def case_ids(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{kind}-{fault}" for kind, fault in cases]


def legit_ids(patterns: list[tuple[str, bool]]) -> list[str]:
    return [f"{legit}{'-inference' * inference}" for legit, inference in patterns]


def served(inference: bool) -> contextlib.AbstractContextManager:
    """How a graph is built and served: under ``torch.inference_mode()`` where ``inference``."""
    return torch.inference_mode() if inference else contextlib.nullcontext()



class ScaledDecoder(ReferenceDecoder):
    """The reference decoder with host values in its step, each of which a CUDA graph bakes in at
    capture: ``logit_scale``, a Python float argument; ``attribute_scale``, a float it reads from
    itself; ``host_scale``, a CPU tensor it reads with ``.item()``; ``slot_offset``, a Python int
    added to every KV slot (where this engine's share of the cache starts), so a graph captured
    with another offset writes other slots than the step declares. (The eager backend's replay
    re-runs the model on its captured arguments, so it bakes only the arguments.) With ``noise``
    the logits get noise drawn each step: from torch's generator (``"torch"``, in-graph sampling) or
    on the host (``"host"``, Python's ``random``: numbers a CUDA graph freezes at capture)."""

    def __init__(self, config: ModelConfig, seed: int = 0, noise: str | None = None) -> None:
        super().__init__(config, seed)
        self.attribute_scale = 1.0
        self.host_scale = torch.ones(())  # a plain attribute on the CPU, neither parameter nor buffer
        self.noise = noise
        self.host_random = random.Random(seed)

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
        logits = logits * (logit_scale * self.attribute_scale * self.host_scale.item())
        if self.noise == "torch":
            return logits + torch.rand_like(logits)
        if self.noise == "host":
            return logits + self.host_random.random()
        return logits

    def kv_written(self, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The reference decoder's region, at the slots this call's ``slot_offset`` names."""
        layers, planes, slots, heads, positions = super().kv_written(context, args, kwargs)
        return (layers, planes, slots + kwargs.get("slot_offset", 0), heads, positions)


def real_part(name: str, tensor: torch.Tensor, context: Any) -> torch.Tensor:
    """What the canary compares, as a runner says it: every KV slot but the spare one the padding
    rows write (in any order on a GPU), and the real tokens' rows of the logits."""
    if name == "kv_cache":
        return tensor.narrow(2, 0, tensor.shape[2] - 1)
    if tensor.dim() and tensor.shape[0] == context.descriptor.num_tokens:
        return tensor[: context.num_real_tokens]
    return tensor


def outside_region_writers(violations: list[Any]) -> set[str]:
    """Who wrote a mutated input outside the region its step declares, by the canary's findings."""
    outside = (v.message for v in violations if "outside the region" in v.message)
    return {message.split(": ", 1)[1].split(" wrote")[0] for message in outside}


EVERY_REPLAY = Sampling(first=0, every=1)
"""Every replay sampled, the canary on each: the strictest clean traffic."""


def checked_graph(
    kind: str, observer: Any, mode: str, policy: str, backend: str = "eager",
    sampling: Sampling = EVERY_REPLAY, noise: str | None = None,
) -> GraphUnderTest:
    """A captured graph with every check and the canary on (every replay sampled, by default), after
    two clean steps that must record nothing."""
    runtime = GraphRuntime(
        backend, observer=observer, progress=False, warmup_iters=1 if backend == "eager" else 2,
        address_check=mode, unexpected_capture=policy, canary=True, sampling=sampling,
    )
    device = "cuda" if backend == "cuda" else "cpu"
    under_test = GraphUnderTest.build(kind, runtime, device=device, noise=noise)
    under_test.step()
    under_test.step()
    under_test.settle()
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
        cls, kind: str, runtime: GraphRuntime, device: str = "cpu", name: str | None = None,
        noise: str | None = None,
    ) -> GraphUnderTest:
        # Twice the slots a step uses: room for a step's slots moved by ``slot_offset``.
        config = ModelConfig.tiny(num_layers=2, max_num_seqs=2 * SIZE, max_seq_len=32, device=device)
        model = ScaledDecoder(config, seed=3, noise=noise)
        checked = {
            "per_step_inputs": INPUTS, "mutated_inputs": {"kv_cache": model.kv_written},
            "compared": real_part,
        }
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
    def write(self, real: int = SIZE, writer: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
              pad: bool = True) -> None:
        """This step's values written into the static inputs (by ``writer``, default ``copy_``): one
        decode token per request of ``real``, each in its own KV slot (and, for the piecewise graph,
        the metadata its eager attention reads); the rows past ``real`` padded (token 0, position 0,
        the spare slot) unless ``pad`` is False."""
        writer = writer or (lambda buffer, values: buffer.copy_(values))
        self.seed += 1
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.model.config.vocab_size, (real,), generator=generator).tolist()
        contexts = torch.randint(0, 16, (real,), generator=generator).tolist()
        slots = torch.randperm(SIZE, generator=generator)[:real].tolist()
        batch = flatten_requests([[t] for t in tokens], contexts, slots, device=self.input_ids.device)
        for buffer, values in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                               (self.slot_ids, batch.slot_ids)):
            writer(buffer[:real], values)
        if pad and real < SIZE:
            pads = {self.input_ids: 0, self.positions: 0, self.slot_ids: self.model.config.padding_slot}
            for buffer, value in pads.items():
                writer(buffer[real:], torch.full((SIZE - real,), value, device=buffer.device))
        self.metadata = batch.attn_metadata

    def call(self, *tokens: torch.Tensor, real: int = SIZE, **extra: Any) -> torch.Tensor:
        """Replay (or capture) on ``tokens`` (default: the static inputs) under the step's context,
        ``real`` of its ``SIZE`` tokens real."""
        ids, positions, slots = tokens or (self.input_ids, self.positions, self.slot_ids)
        descriptor = BatchDescriptor(SIZE, SIZE, True)
        if self.kind == "piecewise":
            context = set_forward_context(CUDAGraphMode.PIECEWISE, BatchDescriptor(SIZE), real)
            extra = {"attn_metadata": self.metadata, **extra}
        elif self.kind == "ubatch":
            _, slices = maybe_create_ubatch_slices(True, [1] * SIZE, SIZE, SIZE, 2)
            context = set_forward_context(CUDAGraphMode.FULL, descriptor, real, ubatch_slices=slices)
        else:
            context = set_forward_context(CUDAGraphMode.FULL, descriptor, real)
        with torch.no_grad(), context:
            return self.wrapper(ids, positions, slots, self.kv_cache, **extra)

    def step(self, real: int = SIZE, **extra: Any) -> torch.Tensor:
        self.write(real)
        return self.call(real=real, **extra)

    def settle(self) -> None:
        """Wait for what the checks read back from the device (CUDA always on: at the next replay)."""
        self.runtime.settle_checks()
        if self.input_ids.is_cuda:
            torch.cuda.synchronize()

    # -- the legitimate patterns, each beside the faults it must not be taken for -------------------
    def steps(self) -> None:
        for _ in range(6):
            self.step()

    def fresh_views(self) -> None:
        """A fresh view of each static buffer every step (as engines slice theirs per step)."""
        for _ in range(6):
            self.write()
            self.call(self.input_ids[:SIZE], self.positions[:SIZE], self.slot_ids[:SIZE])

    def inputs_advanced_in_place(self) -> None:
        """Positions advanced in place (a read-modify-write of the static buffer between steps)."""
        for _ in range(6):
            self.write()
            self.positions.add_(1)
            self.call()

    def weights_loaded_with_copy(self) -> None:
        """New weights copied into the captured ones (a weight reload done right)."""
        for _ in range(3):
            with torch.no_grad():
                for tensor in self.model.state_dict().values():
                    if tensor.is_floating_point():
                        tensor.mul_(1.0)
            self.step()

    def inputs_written_unseen(self) -> None:
        """Inputs written where no version counter sees it: through ``.data`` (a CUDA kernel on the
        GPU), as a Triton kernel or a numpy view would write them."""
        for _ in range(6):
            self.write(writer=lambda buffer, values: buffer.data.copy_(values))
            self.call()

    def padding_rewritten(self) -> None:
        """Batches that shrink and grow, their padding rewritten; padding left as it was when it was
        padding already."""
        for real in (SIZE, SIZE // 2, SIZE // 2, 2, SIZE, 3):
            self.write(real)
            self.call(real=real)
        self.write(3, pad=False)  # rows 3.. held padding at the last replay: nothing to rewrite
        self.call(real=3)

    def same_host_values(self) -> None:
        """The captured host values passed (and set) again: equal values, other objects."""
        for _ in range(3):
            self.model.attribute_scale = float("1.0")
            self.step(logit_scale=float("1.0"), slot_offset=0)

    def outputs_cloned(self) -> None:
        """An output kept past the next step is cloned first; one read before it needs nothing."""
        kept = self.step().clone()
        read = self.step()
        read.sum()
        self.step()
        kept.sum()

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

    def plant_stale_input_inference(self) -> torch.Tensor:
        """The same, in a graph served under ``torch.inference_mode()`` (inference tensors: no
        version counter)."""
        return self.call()

    def plant_stale_padding(self) -> torch.Tensor:
        """A batch that shrank writes its real rows and leaves the rest: the padding rows still hold
        the previous step's real tokens (and would write their KV slots again)."""
        self.step()
        self.write(SIZE // 2, pad=False)
        return self.call(real=SIZE // 2)

    def plant_input_storage_swapped(self) -> torch.Tensor:
        """The captured ``input_ids`` object moved to other storage in place (``set_``): the step
        writes the new storage, the graph reads the old."""
        self.input_ids.set_(torch.empty_like(self.input_ids))
        return self.step()

    def plant_weight_data_swapped(self) -> torch.Tensor:
        """A weight swapped under its parameter (``param.data = new``, as an RL weight sync does)."""
        weight = self.model.layers[0].qkv_proj.weight
        weight.data = weight.detach().clone() * 1.5
        return self.step()

    def plant_stale_output(self) -> torch.Tensor:
        """An output kept past the next replay of its graph and read then (a verify step reading the
        draft's logits): it holds the later step's values."""
        kept = self.step()
        self.step()
        return kept.sum()

    def plant_baked_host_value(self) -> torch.Tensor:
        """A Python scalar argument other than at capture: the graph replays the captured one."""
        return self.step(logit_scale=2.0)

    def plant_baked_slot(self) -> torch.Tensor:
        """A Python int that moves where the step writes the KV cache (``slot_offset``), other than at
        capture: the graph writes the captured slots, outside the region this step declares."""
        return self.step(slot_offset=SIZE)

    def plant_baked_attribute(self) -> torch.Tensor:
        """A value the model reads from itself, changed after capture (an adapter switch)."""
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
