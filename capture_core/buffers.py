"""Static input buffers: allocated once at the largest capture size, shared by every graph.

A graph bakes in the addresses of its inputs, so inputs must live in tensors that never move. Each
graph of ``n`` tokens reads the first ``n`` rows (a prefix view: same address as the full buffer);
a step copies its real values into the prefix with ``copy_`` and fills the rest up to the padded
size with a pad value (a dummy token, position 0, the spare KV-cache slot).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferSpec:
    """One static buffer: element type, the value padding rows get, and any trailing dimensions."""

    dtype: torch.dtype
    pad_value: int | float = 0
    trailing_shape: tuple[int, ...] = ()


class StaticBuffers:
    """Named tensors of ``max_tokens`` rows; ``views(n)`` are their first ``n`` rows."""

    def __init__(
        self,
        max_tokens: int,
        specs: Mapping[str, BufferSpec],
        device: torch.device | str | None = None,
    ) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not specs:
            raise ValueError("static buffers need at least one buffer spec")
        self.max_tokens = max_tokens
        self.specs = dict(specs)
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.full(
                (max_tokens, *spec.trailing_shape), spec.pad_value, dtype=spec.dtype, device=device
            )
            for name, spec in self.specs.items()
        }
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def views(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """Prefix views of every buffer (cached: the step path asks for them every time)."""
        views = self._views.get(num_tokens)
        if views is None:
            self._check_size(num_tokens)
            views = {name: tensor[:num_tokens] for name, tensor in self.tensors.items()}
            self._views[num_tokens] = views
        return views

    def reset(self) -> None:
        """Fill every buffer with its pad value (dummy inputs for capture runs)."""
        for name, tensor in self.tensors.items():
            tensor.fill_(self.specs[name].pad_value)

    def load(
        self, num_tokens: int, **values: torch.Tensor | Sequence[int] | Sequence[float]
    ) -> dict[str, torch.Tensor]:
        """Copy real values into the first rows, pad the rest up to ``num_tokens``, return the views."""
        views = self.views(num_tokens)
        for name, value in values.items():
            if name not in self.tensors:
                raise ValueError(f"no static buffer named {name!r}; buffers: {', '.join(self.tensors)}")
            view = views[name]
            source = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            real = source.shape[0]
            if real > num_tokens:
                raise ValueError(f"{name} has {real} rows, more than the padded size {num_tokens}")
            if real == num_tokens:  # the common case at a bucket's size: no slicing on the step path
                view.copy_(source)
                continue
            view[:real].copy_(source)
            view[real:].fill_(self.specs[name].pad_value)
        return views

    @contextmanager
    def relocated(self, name: str) -> Iterator[torch.Tensor]:
        """Inside the block, buffer ``name`` is a fresh tensor at a new address (a planted fault).

        What an engine does when it builds a new input tensor instead of copying into the static
        one: a graph still reads the static buffer (the previous step's values), and the address
        check sees the input move. The static buffer is back when the block ends.
        """
        if name not in self.tensors:
            raise ValueError(f"no static buffer named {name!r}; buffers: {', '.join(self.tensors)}")
        static, views = self.tensors[name], self._views
        self.tensors[name] = torch.empty_like(static)
        self._views = {}
        try:
            yield self.tensors[name]
        finally:
            # The very view objects the graphs captured come back: their replay guards stay cheap.
            self.tensors[name], self._views = static, views

    def _check_size(self, num_tokens: int) -> None:
        if not 0 < num_tokens <= self.max_tokens:
            raise ValueError(
                f"num_tokens must be in 1..{self.max_tokens} (the largest capture size), got {num_tokens}"
            )
