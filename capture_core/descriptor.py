"""The key of every graph."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """Everything that decides which graph a batch replays.

    ``num_tokens`` is the padded token count: the graph's captured size (vLLM's field name; the
    inspector's columns, metrics and API call it ``captured_size``). ``num_reqs`` is None when the graph
    serves any number of requests (piecewise graphs, whose attention runs eagerly); a FULL graph of
    a uniform-decode batch fixes it. ``uniform`` marks a uniform-decode batch (every request
    decodes the same number of tokens).
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")
        if self.num_reqs is not None and self.num_reqs <= 0:
            raise ValueError(f"num_reqs must be positive or None, got {self.num_reqs}")
        if self.num_active_loras < 0:
            raise ValueError(f"num_active_loras must be >= 0, got {self.num_active_loras}")
        if self.num_active_loras and not self.has_lora:
            raise ValueError("num_active_loras > 0 needs has_lora=True")

    @property
    def captured_size(self) -> int:
        """The token count this graph was captured at (``num_tokens``, named as everywhere else)."""
        return self.num_tokens

    def relax_for_mixed_batch(self) -> BatchDescriptor:
        """The descriptor a piecewise graph is keyed by: any request count, not uniform."""
        return replace(self, num_reqs=None, uniform=False)

    @property
    def key(self) -> str:
        """A short, stable text form for logs, records and URLs."""
        reqs = "any" if self.num_reqs is None else str(self.num_reqs)
        text = f"tokens={self.num_tokens},reqs={reqs},uniform={int(self.uniform)}"
        if self.has_lora:
            text += f",loras={self.num_active_loras}"
        return text
