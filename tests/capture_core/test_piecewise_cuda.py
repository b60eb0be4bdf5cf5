"""Piecewise graphs on a real GPU: segments captured into the shared pool, replay == eager."""

from __future__ import annotations

import pytest
import torch

from capture_core.backends import pool_reserved_bytes
from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, NullObserver, ViolationEvent
from capture_core.forward_context import set_forward_context
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime

pytestmark = pytest.mark.cuda

MIXES = {
    "decodes": ([[5], [6], [7], [8]], [9, 3, 12, 1]),
    "mixed": ([[1, 2, 3, 4, 5], [6], [7, 8, 9], [10]], [0, 7, 2, 11]),
    "one prefill": ([list(range(1, 30))], [0]),
}


class Log(NullObserver):
    def __init__(self) -> None:
        self.captures: list[CaptureEvent] = []
        self.violations: list[ViolationEvent] = []
        self.replays: list[tuple] = []

    def on_capture(self, event: CaptureEvent) -> None:
        self.captures.append(event)

    def on_replay(self, mode, descriptor, num_real_tokens) -> None:
        self.replays.append((mode, descriptor))

    def on_violation(self, event: ViolationEvent) -> None:
        self.violations.append(event)


def _runner(mode: CUDAGraphMode, dtype: torch.dtype = torch.float32) -> tuple[MixedBatchRunner, Log]:
    config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=64, device="cuda", dtype=dtype)
    log = Log()
    runtime = GraphRuntime("cuda", observer=log, progress=False)
    runner = MixedBatchRunner(ReferenceDecoder(config, seed=2), runtime, [8, 16, 32], mode)
    runner.capture()
    return runner, log


@pytest.mark.parametrize("kind", list(MIXES))
@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE], ids=lambda m: m.name
)
def test_replays_equal_eager_on_the_gpu(mode: CUDAGraphMode, kind: str) -> None:
    runner, log = _runner(mode)
    tokens, contexts = MIXES[kind]
    batch = flatten_requests(tokens, contexts, list(range(len(tokens))), device="cuda")
    reference_kv = runner.kv_cache.clone()
    eager = runner.model(batch.input_ids, batch.positions, batch.slot_ids, reference_kv, batch.attn_metadata)
    for _ in range(2):  # the second step replays on the cache the first wrote: same values again
        logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata).clone()
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
    real = slice(0, runner.padding_slot)
    torch.testing.assert_close(runner.kv_cache[:, :, real], reference_kv[:, :, real], rtol=1e-5, atol=1e-5)
    served = log.replays[-1][0]
    uniform = all(len(t) == 1 for t in tokens)
    if mode is CUDAGraphMode.FULL_AND_PIECEWISE and uniform:
        assert served is CUDAGraphMode.FULL
    else:
        assert served is CUDAGraphMode.PIECEWISE
    assert log.violations == []


def test_piecewise_graphs_hold_pool_memory_measured_from_the_shared_pool() -> None:
    runner, log = _runner(CUDAGraphMode.PIECEWISE)
    events = [e for e in log.captures if e.mode is CUDAGraphMode.PIECEWISE]
    assert [e.descriptor.num_tokens for e in events] == [32, 16, 8]  # largest first
    assert all(e.num_segments == runner.model.config.num_layers + 1 for e in events)
    assert all(e.backend == "cuda" for e in events)
    assert events[0].pool_bytes > 0
    # Each graph's figure is the growth of the one shared pool while its segments were captured,
    # so together they account for exactly what the pool holds.
    assert pool_reserved_bytes(runner.runtime.backend.pool) == sum(e.pool_bytes for e in events)


def test_drift_in_a_piecewise_replay_is_reported_on_the_gpu() -> None:
    runner, log = _runner(CUDAGraphMode.PIECEWISE)
    piecewise = runner.piecewise
    # The step's inputs written as a step writes them (the runner declares them per-step), so only
    # the drift is wrong: positions are then passed in a fresh tensor instead of the static one.
    ids, positions, slots = torch.arange(1, 9), torch.arange(8), torch.arange(8)
    views = runner.buffers.load(8, input_ids=ids, positions=positions, slot_ids=slots)
    moved = views["positions"].clone()
    with torch.no_grad(), set_forward_context(CUDAGraphMode.PIECEWISE, BatchDescriptor(8)):
        piecewise(views["input_ids"], moved, views["slot_ids"], runner.kv_cache)
    assert log.violations and {v.input_name for v in log.violations} == {"positions"}


def test_bfloat16_piecewise_replay_matches_eager_closely() -> None:
    runner, _ = _runner(CUDAGraphMode.PIECEWISE, dtype=torch.bfloat16)
    tokens, contexts = MIXES["mixed"]
    batch = flatten_requests(tokens, contexts, list(range(len(tokens))), device="cuda")
    reference_kv = runner.kv_cache.clone()
    eager = runner.model(batch.input_ids, batch.positions, batch.slot_ids, reference_kv, batch.attn_metadata)
    logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)
    assert (logits.float() - eager.float()).abs().max() <= 2e-2 * eager.float().abs().max()


def test_one_piecewise_graph_serves_different_mixes_in_turn() -> None:
    runner, log = _runner(CUDAGraphMode.PIECEWISE)
    steps = [
        ([[1, 2, 3], [4]], [0, 5]),  # 4 tokens -> the 8-token graph
        ([[5], [6, 7, 8, 9, 10]], [6, 0]),  # 6 tokens -> the same graph, other requests' shapes
        ([[11], [12], [13]], [7, 5, 12]),
    ]
    for tokens, contexts in steps:
        batch = flatten_requests(tokens, contexts, list(range(len(tokens))), device="cuda")
        inputs = (batch.input_ids, batch.positions, batch.slot_ids)
        eager = runner.model(*inputs, runner.kv_cache.clone(), batch.attn_metadata)
        torch.testing.assert_close(runner.step(*inputs, batch.attn_metadata), eager, rtol=1e-4, atol=1e-4)
    assert [d.num_tokens for _, d in log.replays] == [8, 8, 8]
