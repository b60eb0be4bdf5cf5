"""No false alarms: traffic through each runner with every check on, the canary included, records no
violation: 10,000 always-on and 1,000 debug replays of each runner here (on the eager backend, marked
slow), and ``bench/gpu_checks.py`` runs as many on CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


def random_step(runner: DecodeRunner | MixedBatchRunner, rng: random.Random) -> tuple:
    """One step of random traffic's inputs: decode batches of 1..16 (and, for the mixed runner,
    prefill and decode requests mixed), so batches grow and shrink over their padding."""
    if isinstance(runner, MixedBatchRunner):
        count = rng.randint(1, 5)
        tokens = [[rng.randrange(100) for _ in range(rng.choice((1, 1, 2, 3)))] for _ in range(count)]
        contexts, slots = [rng.randrange(12) for _ in range(count)], rng.sample(range(16), count)
        batch = flatten_requests(tokens, contexts, slots)
        return batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata
    count = rng.randint(1, 16)
    return torch.randint(0, 100, (count,)), torch.randint(0, 30, (count,)), torch.randperm(16)[:count]


@pytest.mark.slow
@pytest.mark.parametrize("kind", RUNNERS)
def test_ten_thousand_always_on_and_a_thousand_debug_replays_record_nothing(kind, observer) -> None:
    rng = random.Random(len(kind))
    for mode, wanted in (("always_on", 10_000), ("debug", 1_000)):
        runtime = GraphRuntime(
            "eager", observer=observer, progress=False, warmup_iters=1, address_check=mode, canary=True,
            sampling=Sampling(first=1, every=100),
        )
        runner = make_runner(kind, runtime)
        runner.capture()
        before = len(observer.replays)
        while len(observer.replays) - before < wanted:
            runner.step(*random_step(runner, rng))
        assert observer.violations == [], observer.violations[0].message
    assert len(observer.replays) >= 11_000


def serve(runner: DecodeRunner | MixedBatchRunner, steps: int, seed: int) -> None:
    """Random decode (and, for the mixed runner, prefill) traffic, each step checked against eager."""
    rng = random.Random(seed)
    for _ in range(steps):
        inputs = random_step(runner, rng)
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


def every_replay_sampled(observer) -> GraphRuntime:
    return GraphRuntime(
        "eager", observer=observer, progress=False, warmup_iters=0, canary=True,
        sampling=Sampling(first=0, every=1),
    )


class Allocations(TorchDispatchMode):
    """Every fresh tensor the ops under it make (not views of their inputs), by size in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs))
        given = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for out in pytree.tree_leaves(result):
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in given:
                self.sizes.append(out.untyped_storage().nbytes())
        return result


class UndeclaredDecoder(ReferenceDecoder):
    """The reference decoder without ``kv_written``: its runner cannot say where a step writes."""

    kv_written = None


@pytest.mark.parametrize("declared", [True, False], ids=["region", "whole copy"])
def test_the_canary_keeps_a_region_the_size_of_the_batch_where_the_model_says(declared, observer) -> None:
    config = ModelConfig.tiny(max_num_seqs=64, max_seq_len=32)
    model = (ReferenceDecoder if declared else UndeclaredDecoder)(config, seed=7)
    runtime = every_replay_sampled(observer)
    runner = DecodeRunner(model, runtime, [2])
    runner.capture()
    inputs = (torch.tensor([3, 4]), torch.tensor([5, 9]), torch.tensor([10, 40]))
    cache_bytes = runner.kv_cache.untyped_storage().nbytes()
    with Allocations() as sampled:
        runner.step(*inputs)
    runtime.canary = False
    with Allocations() as plain:
        runner.step(*inputs)
    assert observer.violations == [] and len(observer.replays) == 2
    # Two steps (the replay and the eager one) allocate what one step does, twice, and the canary
    # adds its copies: of the batch's region, or of the whole cache.
    assert max(plain.sizes) < cache_bytes // 16
    if declared:
        assert max(sampled.sizes) == max(plain.sizes)
        region = 2 * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # 2 tokens of float32
        extra = sum(sampled.sizes) - 2 * sum(plain.sizes)
        assert 3 * region <= extra < cache_bytes // 8
    else:
        assert cache_bytes in sampled.sizes  # the whole cache, copied


@pytest.mark.parametrize("kind", RUNNERS)
def test_every_replay_sampled_through_each_runner_records_nothing(kind, observer) -> None:
    runtime = every_replay_sampled(observer)
    runner = make_runner(kind, runtime)
    runner.capture()
    serve(runner, 60, seed=11)
    assert observer.violations == []
    assert len(observer.replays) >= 40
