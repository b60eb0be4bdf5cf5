"""Figures of a run of batch sizes: how they were spread, and how a capture-size list met them."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from capture_core.sizes import SizeTable, hit_ratio, padding_waste


@dataclass(frozen=True)
class BatchSizeStats:
    """How a run's batch sizes were spread."""

    steps: int
    min: int
    max: int
    mean: float
    p50: int
    p90: int
    p99: int
    distinct: int
    changed_share: float
    """Share of steps whose batch size differs from the step before (0..1)."""


def _percentile(ordered: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of a sorted sequence."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def batch_size_stats(sizes: Sequence[int]) -> BatchSizeStats:
    if not sizes:
        raise ValueError("batch_size_stats needs at least one batch size")
    ordered = sorted(sizes)
    changes = sum(1 for a, b in itertools.pairwise(sizes) if a != b)
    return BatchSizeStats(
        steps=len(sizes),
        min=ordered[0],
        max=ordered[-1],
        mean=sum(sizes) / len(sizes),
        p50=_percentile(ordered, 0.50),
        p90=_percentile(ordered, 0.90),
        p99=_percentile(ordered, 0.99),
        distinct=len(set(sizes)),
        changed_share=changes / (len(sizes) - 1) if len(sizes) > 1 else 0.0,
    )


def batch_size_histogram(sizes: Iterable[int]) -> dict[int, int]:
    """Batch size -> number of steps, sorted by size."""
    return dict(sorted(Counter(sizes).items()))


@dataclass(frozen=True)
class PaddingStats:
    """How a capture-size list met a run of batch sizes.

    ``padding_waste`` and ``hit_ratio`` are the glossary's, by the one formula of each
    (``capture_core.sizes``) that the inspector's figures use. Batches above the largest capture
    size run eagerly: they count against ``hit_ratio`` and waste nothing.
    """

    steps: int
    replayed_steps: int
    num_real_tokens: int
    """Real tokens of every batch, replayed or eager."""
    captured_tokens: int
    """Tokens the replayed graphs computed: the captured size of each replayed batch, summed."""
    eager_tokens: int
    """Real tokens of the batches that ran eagerly."""

    @property
    def padding_tokens(self) -> int:
        return self.captured_tokens - (self.num_real_tokens - self.eager_tokens)

    @property
    def padding_waste(self) -> float | None:
        """Padding tokens over the tokens the replayed graphs computed (None before any replay)."""
        return padding_waste(self.num_real_tokens - self.eager_tokens, self.padding_tokens)

    @property
    def hit_ratio(self) -> float | None:
        """Steps that replayed a graph over all steps (None before any step)."""
        return hit_ratio(self.replayed_steps, self.steps - self.replayed_steps)


def padding_stats(sizes: Iterable[int], table: SizeTable) -> PaddingStats:
    """Pad every batch size with ``table`` and total the waste and the replays."""
    steps = replayed = real = captured = eager = 0
    for n in sizes:
        steps += 1
        real += n
        captured_size = table.pad(n)
        if captured_size is None:
            eager += n
        else:
            replayed += 1
            captured += captured_size
    return PaddingStats(steps, replayed, real, captured, eager)

