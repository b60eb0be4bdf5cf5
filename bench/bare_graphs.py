"""The limit every graph cache is measured against: decode graphs captured and replayed by hand.

``BareGraphLoop`` is what an engineer writes without any cache: static inputs at the largest size,
one ``torch.cuda.CUDAGraph`` per batch size captured largest first (warm-ups on a side stream, as
``torch.cuda.make_graphed_callables`` does), and a step that copies the inputs in, replays and
clones the logits out. No dispatcher, no checks, no observer, no padding: it only serves batch
sizes that are capture sizes, which is all the benchmarks ask of it.

With ``shared_pool=False`` each graph gets a pool of its own, which is what the capture benchmark
compares the shared pool against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


class BareGraphLoop:
    """Hand-written CUDA graphs of ``model(input_ids, positions, slot_ids, kv_cache)`` per size."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        kv_cache: torch.Tensor,
        sizes: Sequence[int],
        *,
        padding_slot: int,
        warmup_iters: int = 3,
        shared_pool: bool = True,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError("the bare graph loop captures CUDA graphs: it needs a CUDA KV cache")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = tuple(sorted(sizes))
        device = kv_cache.device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        # Capture on dummy inputs that write only into the spare slot, as the runner does.
        self.slot_ids = torch.full((largest,), padding_slot, dtype=torch.long, device=device)
        # Prefix views made once: the step path only copies into them.
        self.views = {
            size: (self.input_ids[:size], self.positions[:size], self.slot_ids[:size]) for size in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pools: dict[int, tuple[int, int]] = {}
        self.capture_seconds: dict[int, float] = {}
        self.total_capture_seconds = self._capture_all(warmup_iters, shared_pool)

    def _capture_all(self, warmup_iters: int, shared_pool: bool) -> float:
        side = torch.cuda.Stream()
        shared = torch.cuda.graph_pool_handle() if shared_pool else None
        torch.cuda.synchronize()
        started = time.perf_counter()
        for size in reversed(self.sizes):
            args = (*self.views[size], self.kv_cache)
            begin = time.perf_counter()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(warmup_iters):
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            pool = shared if shared is not None else torch.cuda.graph_pool_handle()
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            torch.cuda.synchronize()
            self.capture_seconds[size] = time.perf_counter() - begin
            self.graphs[size] = graph
            self.pools[size] = pool
        return time.perf_counter() - started

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """Copy in, replay, clone out. ``input_ids`` must hold exactly a capture size of tokens."""
        size = input_ids.shape[0]
        ids, pos, slots = self.views[size]
        ids.copy_(input_ids)
        pos.copy_(positions)
        slots.copy_(slot_ids)
        self.graphs[size].replay()
        return self.outputs[size].clone()
