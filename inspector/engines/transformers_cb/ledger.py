"""What the integration counts of transformers' continuous batching, and the records it makes of it.

Pure bookkeeping, no transformers and no database: the patches (``patches.py``) read transformers'
decisions and tell the ledger; the ledger keeps a ``CBGraph`` per captured graph, whose replays the
watch's flusher writes (per graph, by real tokens), and builds the capture records the Recorder
writes. Every step a graph replays is one dict bump on the engine's thread.

A capture during transformers' warm-up (``ModelRunner.warmup``) is a start-up capture. Any later one
is *late*: transformers captures a graph the first time a step meets its key, on the serving path,
and that step pays a warm-up forward and the capture (``capture_seconds``) and the pool grows
(``pool_bytes``). Late graphs are recorded as captured after start-up (``unexpected`` on the graph's
row), and their step as an eager batch for that reason (its tokens were computed by the warm-up
forward, not a replay); they are not violations: capturing lazily is how transformers works.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from capture_core.events import CaptureEvent
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.engines.transformers_cb.keys import CBKey
from inspector.watch.identity import CapturedInputs, WatchedDescriptor

BACKEND = "cuda"
"""transformers' own torch.cuda.CUDAGraph objects."""
WARMUP_FORWARDS = 1
"""transformers runs the step once eagerly (in the graph pool) before it captures it."""
GraphSlot = tuple[int, "int | None", tuple[int, ...]]
"""(runner, IO pair, transformers' key): where a graph is found again."""


@dataclass(eq=False)
class CBGraph:
    """One graph transformers captured, and its replays by the real tokens of their batches."""

    key: CBKey
    descriptor: WatchedDescriptor
    wrapper: str
    capture_seconds: float
    pool_bytes: int
    late: bool
    captured_at: float
    replays_by_real_tokens: dict[int, int] = field(default_factory=dict)
    mode: ClassVar[CUDAGraphMode] = CUDAGraphMode.FULL
    """transformers captures the whole step (forward, logits, sampling) as one graph."""

    @property
    def replays(self) -> int:
        return sum(self.replays_by_real_tokens.values())

    @property
    def num_real_tokens(self) -> int:
        return sum(real * count for real, count in self.replays_by_real_tokens.items())

    @property
    def padding_tokens(self) -> int:
        return self.replays * self.key.num_q_tokens - self.num_real_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.descriptor.key,
            "transformers_key": list(self.key.key),
            "pair": self.key.pair,
            "path": self.key.path,
            "captured_size": self.key.num_q_tokens,
            "late": self.late,
            "capture_seconds": self.capture_seconds,
            "pool_bytes": self.pool_bytes,
            "replays": self.replays,
            "num_real_tokens": self.num_real_tokens,
            "padding_tokens": self.padding_tokens,
        }


@dataclass
class Ledger:
    """Every graph and eager batch one attachment has seen."""

    graphs: list[CBGraph] = field(default_factory=list)
    """In capture order; the flusher reads the list while the engine appends to it."""
    eager: dict[str, list[int]] = field(default_factory=dict)
    """Eager batches by reason: [batches, real tokens]."""
    _slots: dict[GraphSlot, CBGraph] = field(default_factory=dict)

    def graph(self, slot: GraphSlot) -> CBGraph | None:
        return self._slots.get(slot)

    def captured(
        self,
        key: CBKey,
        *,
        seconds: float,
        pool_bytes: int,
        late: bool,
        inputs: CapturedInputs,
        seen_capture: bool = True,
    ) -> tuple[CBGraph, CaptureEvent]:
        """A graph transformers captured (``seen_capture``) or, when it was captured before the
        integration attached, first met replaying: its cost is then unknown (0 s, 0 bytes)."""
        wrapper = f"transformers ModelRunner {key.path} path"
        if not seen_capture:
            wrapper += " (captured before graph-inspector attached: cost not seen)"
        graph = CBGraph(
            key=key,
            descriptor=key.descriptor(),
            wrapper=wrapper,
            capture_seconds=seconds,
            pool_bytes=pool_bytes,
            late=late,
            captured_at=time.time(),
        )
        self._slots[(key.runner, key.pair, key.key)] = graph
        self.graphs.append(graph)
        event = CaptureEvent(
            descriptor=graph.descriptor,
            mode=graph.mode,
            backend=BACKEND,
            wrapper=wrapper,
            input_names=inputs.names,
            input_addresses=inputs.addresses,
            capture_seconds=seconds,
            pool_bytes=pool_bytes,
            warmup_iters=WARMUP_FORWARDS if seen_capture else 0,
            unexpected=late,
            captured_at=graph.captured_at,
            engine_key=key.engine_text,
        )
        return graph, event

    def count_eager(self, reason: EagerReason, num_real_tokens: int) -> None:
        totals = self.eager.setdefault(reason.value, [0, 0])
        totals[0] += 1
        totals[1] += num_real_tokens

    def summary(self) -> dict[str, Any]:
        """What was seen, for logs and benchmarks (the database holds the same, written)."""
        late = [g for g in self.graphs if g.late]
        return {
            "graphs": len(self.graphs),
            "start_up_graphs": len(self.graphs) - len(late),
            "late_captures": len(late),
            "late_capture_seconds": sum(g.capture_seconds for g in late),
            "pool_bytes": sum(g.pool_bytes for g in self.graphs),
            "replays": sum(g.replays for g in self.graphs),
            "num_real_tokens": sum(g.num_real_tokens for g in self.graphs),
            "padding_tokens": sum(g.padding_tokens for g in self.graphs),
            "eager": {reason: {"batches": b, "num_real_tokens": t} for reason, (b, t) in self.eager.items()},
            "by_graph": [g.as_dict() for g in self.graphs],
        }
