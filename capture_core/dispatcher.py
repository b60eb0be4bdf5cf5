"""The one place that knows which graphs exist, and which one a batch replays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from capture_core.descriptor import BatchDescriptor
from capture_core.events import GraphObserver, NullObserver
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason, SizeTable


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where one batch goes: the runtime mode, the graph key, and why it is eager if it is."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    num_real_tokens: int
    eager_reason: EagerReason | None = None

    @property
    def padding_tokens(self) -> int:
        """The captured size less the real tokens."""
        return self.descriptor.num_tokens - self.num_real_tokens


class CUDAGraphDispatcher:
    """Holds the key set of every runtime mode and routes batches to them.

    ``uniform_decode_query_len`` is the number of tokens each request decodes in a uniform-decode
    step (1 without speculative decoding); a FULL decode graph of ``n`` tokens serves
    ``n // uniform_decode_query_len`` requests. ``max_loras`` > 0 adds LoRA variants of every key,
    one per active-adapter count.
    """

    def __init__(
        self,
        mode: CUDAGraphMode,
        sizes: SizeTable | Sequence[int],
        *,
        uniform_decode_query_len: int = 1,
        max_loras: int = 0,
        observer: GraphObserver | None = None,
    ) -> None:
        if uniform_decode_query_len <= 0:
            raise ValueError(f"uniform_decode_query_len must be positive, got {uniform_decode_query_len}")
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        self.mode = mode
        self.sizes = sizes if isinstance(sizes, SizeTable) else SizeTable(sizes)
        self.uniform_decode_query_len = uniform_decode_query_len
        self.max_loras = max_loras
        self.observer: GraphObserver = observer or NullObserver()
        self.keys: dict[CUDAGraphMode, frozenset[BatchDescriptor]] = self._build_keys()

    def _lora_variants(self) -> list[tuple[bool, int]]:
        return [(False, 0)] + [(True, n) for n in range(1, self.max_loras + 1)]

    def _build_keys(self) -> dict[CUDAGraphMode, frozenset[BatchDescriptor]]:
        keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(),
            CUDAGraphMode.PIECEWISE: set(),
        }
        mixed, decode = self.mode.mixed_mode(), self.mode.decode_mode()
        for has_lora, loras in self._lora_variants():
            for size in self.sizes.sizes:
                if mixed is not CUDAGraphMode.NONE:
                    keys[mixed].add(BatchDescriptor(size, None, False, has_lora, loras))
                uniform_fits = size % self.uniform_decode_query_len == 0
                if decode is CUDAGraphMode.FULL and self.mode.separate_routine() and uniform_fits:
                    reqs = size // self.uniform_decode_query_len
                    keys[decode].add(BatchDescriptor(size, reqs, True, has_lora, loras))
        return {mode: frozenset(descs) for mode, descs in keys.items()}

    def route(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        num_active_loras: int = 0,
    ) -> Dispatch:
        """Pure routing: no events. See ``dispatch`` for the observed version."""
        if has_lora and not 1 <= num_active_loras <= self.max_loras:
            raise ValueError(
                f"num_active_loras must be in 1..{self.max_loras} for a LoRA batch, got {num_active_loras}"
            )
        loras = num_active_loras if has_lora else 0
        eager = BatchDescriptor(num_tokens, None, False, has_lora, loras)
        if self.mode is CUDAGraphMode.NONE:
            return Dispatch(CUDAGraphMode.NONE, eager, num_tokens, EagerReason.MODE_NONE)
        padded = self.sizes.pad(num_tokens)
        if padded is None:
            return Dispatch(CUDAGraphMode.NONE, eager, num_tokens, EagerReason.ABOVE_MAX_CAPTURE_SIZE)
        if uniform_decode and self.mode.separate_routine() and padded % self.uniform_decode_query_len == 0:
            desc = BatchDescriptor(padded, padded // self.uniform_decode_query_len, True, has_lora, loras)
            if desc in self.keys[CUDAGraphMode.FULL]:
                return Dispatch(CUDAGraphMode.FULL, desc, num_tokens)
        relaxed = BatchDescriptor(padded, None, False, has_lora, loras)
        mixed = self.mode.mixed_mode()
        if mixed is not CUDAGraphMode.NONE and relaxed in self.keys[mixed]:
            return Dispatch(mixed, relaxed, num_tokens)
        # Only a mixed batch under a decode-only configuration has no graph of its size.
        return Dispatch(CUDAGraphMode.NONE, eager, num_tokens, EagerReason.NO_GRAPH_FOR_MIXED_BATCH)

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        num_active_loras: int = 0,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """Route a batch and tell the observer when it falls back to eager."""
        routed = self.route(num_tokens, uniform_decode, has_lora, num_active_loras)
        if routed.eager_reason is not None:
            wanted = self.mode.decode_mode() if uniform_decode else self.mode.mixed_mode()
            self.observer.on_eager(routed.eager_reason, num_tokens, wanted)
        return routed.mode, routed.descriptor

    def capture_descriptors(self, mode: CUDAGraphMode) -> list[BatchDescriptor]:
        """The graphs to capture for one runtime mode, largest first (smaller ones reuse its pool)."""
        if mode not in self.keys:
            return []
        return sorted(self.keys[mode], key=lambda d: (d.num_tokens, d.num_active_loras), reverse=True)

    def capture_list(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every graph of every mode, largest first: FULL before PIECEWISE at equal size."""
        modes = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
        items = [(m, d) for m in modes for d in self.capture_descriptors(m)]
        return sorted(items, key=lambda md: (md[1].num_tokens, md[0] is CUDAGraphMode.FULL), reverse=True)
