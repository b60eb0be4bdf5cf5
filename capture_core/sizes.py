"""Capture sizes: which batch sizes get a graph, and how a batch is padded up to one."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class EagerReason(str, enum.Enum):
    """Why a batch ran eagerly instead of replaying a graph (a small, fixed label set)."""

    ABOVE_MAX_CAPTURE_SIZE = "above_max_capture_size"
    MODE_NONE = "mode_none"
    NO_GRAPH_FOR_MIXED_BATCH = "no_graph_for_mixed_batch"
    BEFORE_CAPTURE_PHASE = "before_capture_phase"
    UNEXPECTED_CAPTURE = "unexpected_capture"
    UBATCH_GRAPH_ONLY = "ubatch_graph_only"
    """This size is captured only as a micro-batched graph and this step was not micro-batched."""
    NO_MATCHING_GRAPH = "no_matching_graph"
    """A graph of this size exists, but none for the rest of the batch's key (its request count,
    its LoRA count): an engine's dispatcher found no captured key for it."""
    ENGINE_FORCED = "engine_forced"
    """The engine chose to run this batch eagerly by a rule of its own (vLLM: cascade attention,
    encoder inputs in the step, a forced-eager step)."""


def power_of_two_sizes(max_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_size`` (and ``max_size`` itself when it is not a power of two)."""
    _check_positive_int("max_size", max_size)
    sizes, size = [], 1
    while size < max_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_size)
    return sizes


def vllm_default_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default list: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), cut at max."""
    _check_positive_int("max_size", max_size)
    candidates = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in candidates if s <= max_size]


def validate_sizes(sizes: Iterable[int]) -> list[int]:
    """Check an explicit capture-size list: non-empty, positive integers, strictly increasing."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("capture sizes must not be empty")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"capture sizes must be integers, got {size!r}")
        if size <= 0:
            raise ValueError(f"capture sizes must be positive, got {size} in {sizes}")
    seen: set[int] = set()
    duplicates = sorted({s for s in sizes if s in seen or seen.add(s)})
    if duplicates:
        raise ValueError(f"capture sizes must not repeat: {duplicates} appear more than once")
    if sizes != sorted(sizes):
        raise ValueError(f"capture sizes must be sorted ascending, got {sizes}")
    return sizes


def capture_sizes(policy: str, max_size: int = 256, sizes: Sequence[int] | None = None) -> list[int]:
    """Capture sizes by policy name: ``pow2``, ``vllm`` or ``explicit`` (with ``sizes``)."""
    if policy == "pow2":
        return power_of_two_sizes(max_size)
    if policy == "vllm":
        return vllm_default_sizes(max_size)
    if policy == "explicit":
        if sizes is None:
            raise ValueError("the explicit policy needs a list of sizes")
        return validate_sizes(sizes)
    raise ValueError(f"unknown capture-size policy {policy!r}; choose pow2, vllm or explicit")


@dataclass(frozen=True)
class Padding:
    """Where one batch lands: the captured size it is padded to, or eager with the reason."""

    num_real_tokens: int
    captured_size: int | None
    eager_reason: EagerReason | None

    @property
    def padding_tokens(self) -> int:
        """Tokens of padding: the captured size less the real tokens (0 for an eager batch)."""
        return 0 if self.captured_size is None else self.captured_size - self.num_real_tokens


def hit_ratio(replays: int, eager_batches: int) -> float | None:
    """Batches replayed over all batches (replayed + eager), 0..1; None before any batch. The one
    formula: the inspector's ``TrafficTotals`` and the reference workload's figures use it."""
    batches = replays + eager_batches
    return replays / batches if batches else None


def padding_waste(num_real_tokens: int, padding_tokens: int) -> float | None:
    """Padding tokens over the tokens the graphs computed (``num_real_tokens`` and
    ``padding_tokens`` of replays only), 0..1; None before any replay. The one formula."""
    computed = num_real_tokens + padding_tokens
    return padding_tokens / computed if computed else None


class SizeTable:
    """Pads any batch up to the smallest capture size that holds it.

    Lookups are O(1) through a dense table up to the largest size, since they sit on the step path.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes: tuple[int, ...] = tuple(validate_sizes(sizes))
        self.max_size = self.sizes[-1]
        table = [0] * (self.max_size + 1)
        for n in range(1, self.max_size + 1):
            table[n] = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._table = table

    def pad(self, num_real_tokens: int) -> int | None:
        """The captured size a batch of ``num_real_tokens`` replays, or None above the largest."""
        if num_real_tokens <= 0:
            raise ValueError(f"num_real_tokens must be positive, got {num_real_tokens}")
        if num_real_tokens > self.max_size:
            return None
        return self._table[num_real_tokens]

    def place(self, num_real_tokens: int) -> Padding:
        captured = self.pad(num_real_tokens)
        reason = EagerReason.ABOVE_MAX_CAPTURE_SIZE if captured is None else None
        return Padding(num_real_tokens, captured, reason)

    def __contains__(self, size: object) -> bool:
        return size in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"SizeTable({list(self.sizes)})"


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
