"""No false alarms: traffic through each runner with every check on, the canary included, records no
violation (on the eager backend here; ``bench/gpu_checks.py`` runs 10,000 replays of each on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from capture_core.canary import Sampling
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.slices import UBatchConfig

pytestmark = pytest.mark.usefixtures("single_thread_torch")

CONFIG = ModelConfig.tiny(max_num_seqs=16, max_seq_len=32)
RUNNERS = ("decode", "micro-batched decode", "mixed piecewise")
STEPS = 24


def make_runner(kind: str, runtime: GraphRuntime) -> DecodeRunner | MixedBatchRunner:
    model = ReferenceDecoder(CONFIG, seed=7)
    if kind == "mixed piecewise":
        return MixedBatchRunner(model, runtime, [4, 8, 16], CUDAGraphMode.FULL_AND_PIECEWISE)
    ubatch = UBatchConfig(enabled=True, decode_token_threshold=8) if kind == "micro-batched decode" else None
    return DecodeRunner(model, runtime, [1, 2, 4, 8, 16], ubatch=ubatch)


def serve(runner: DecodeRunner | MixedBatchRunner, steps: int, seed: int) -> None:
    """Random decode (and, for the mixed runner, prefill) traffic, each step checked against eager."""
    rng = random.Random(seed)
    for _ in range(steps):
        if isinstance(runner, MixedBatchRunner):
            count = rng.randint(1, 5)
            tokens = [[rng.randrange(100) for _ in range(rng.choice((1, 1, 2, 3)))] for _ in range(count)]
            contexts, slots = [rng.randrange(12) for _ in range(count)], rng.sample(range(16), count)
            batch = flatten_requests(tokens, contexts, slots)
            inputs = (batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)
        else:
            count = rng.randint(1, 16)
            ids, positions = torch.randint(0, 100, (count,)), torch.randint(0, 30, (count,))
            inputs = (ids, positions, torch.randperm(16)[:count])
        kv_before = runner.kv_cache.clone()
        logits = runner.step(*inputs).clone()
        runner.kv_cache.copy_(kv_before)
        torch.testing.assert_close(logits, runner.step_eager(*inputs))


@pytest.mark.parametrize("mode", ["always_on", "debug"])
@pytest.mark.parametrize("kind", RUNNERS)
def test_clean_traffic_with_every_check_records_no_violation(kind, mode, observer) -> None:
    runtime = GraphRuntime(
        "eager", observer=observer, progress=False, warmup_iters=1, address_check=mode,
        canary=True, sampling=Sampling(first=2, every=3),
    )
    runner = make_runner(kind, runtime)
    runner.capture()
    serve(runner, STEPS, seed=len(kind))
    assert observer.violations == []
    assert len(observer.replays) + len(observer.eagers) >= STEPS
    assert len(observer.replays) > STEPS // 2
