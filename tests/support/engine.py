"""A small real engine for the regression-gate and ranks tests: the reference decoder served from
graphs by ``DecodeRunner`` on the eager backend, recorded through the inspector's ``Recorder``.

The eager backend holds no graph pool, so its graphs report 0 pool bytes. ``SharedPoolBackend`` is
the eager backend reporting pool memory the way one shared CUDA graph pool grows (deterministic,
so that two runs of the same code report the same bytes, as the CUDA caching allocator does): the
tests that need pool memory record through it, and say so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from capture_core.backends import EagerBackend, EagerGraph
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime

MIB = 1 << 20
GRAPH_OVERHEAD_BYTES = 64 << 10


class SharedPoolBackend(EagerBackend):
    """The eager backend, reporting pool bytes as a shared pool captured largest first would: a
    graph adds what its batch needs (``bytes_per_token`` per token) beyond what the pool already
    holds, plus a small overhead of its own."""

    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token
        self.reserved = 0

    def capture(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                warmup_iters: int, prologue: Callable[[], None] | None = None) -> EagerGraph:
        graph = super().capture(fn, args, kwargs, warmup_iters, prologue)
        need = int(args[0].shape[0]) * self.bytes_per_token  # args[0]: the token ids of this size
        graph.pool_bytes = max(0, need - self.reserved) + GRAPH_OVERHEAD_BYTES
        self.reserved = max(self.reserved, need)
        return graph


def decode_engine(sizes: Sequence[int], observer: Any, bytes_per_token: int = 0,
                  max_num_seqs: int = 32) -> DecodeRunner:
    """A runner of the tiny reference decoder with its graphs captured (and capture locked)."""
    torch.manual_seed(0)
    backend = SharedPoolBackend(bytes_per_token) if bytes_per_token else "eager"
    runtime = GraphRuntime(backend, observer=observer, progress=False, warmup_iters=1)
    model = ReferenceDecoder(ModelConfig.tiny(max_num_seqs=max_num_seqs, max_seq_len=16))
    runner = DecodeRunner(model, runtime, sizes=list(sizes))
    runner.capture()
    return runner


def decode_step(runner: DecodeRunner, num_tokens: int) -> torch.Tensor:
    """One decode step of ``num_tokens`` requests (request i writes KV slot i at position 0)."""
    ids = torch.arange(num_tokens, dtype=torch.long) % runner.model.config.vocab_size
    return runner.step(ids, torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens))


def decode_run(url: str, sizes: Sequence[int], batches: Iterable[int], *, bytes_per_token: int = 0,
               label: str = "") -> int:
    """A whole recorded run: capture ``sizes``, serve ``batches``; its run id."""
    from inspector.recording.recorder import Recorder

    with Recorder(url, label=label, job="") as recorder:
        runner = decode_engine(sizes, recorder, bytes_per_token)
        for num_tokens in batches:
            decode_step(runner, num_tokens)
    assert recorder.run_id is not None
    return recorder.run_id
