"""Step time on real CUDA graphs (marked ``cuda``: run on the H200): sampled replays and the canary's
eager steps are timed with CUDA events that nothing waits for; the events are read once complete."""

from __future__ import annotations

import pytest
import torch

from capture_core.canary import Sampling
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.step_time import CUDA_EVENTS

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16]


def cuda_runner(observer, sampling: Sampling, canary: bool) -> DecodeRunner:
    config = ModelConfig.small(max_num_seqs=32, device="cuda")
    runtime = GraphRuntime("cuda", observer=observer, progress=False, sampling=sampling, canary=canary)
    runner = DecodeRunner(ReferenceDecoder(config, seed=0), runtime, SIZES, mode=CUDAGraphMode.FULL)
    runner.capture()
    return runner


def step(runner: DecodeRunner, size: int) -> torch.Tensor:
    ids = torch.arange(size, device="cuda")
    return runner.step(ids, ids % 16, ids)


def test_every_size_gets_a_graph_and_an_eager_time_from_cuda_events(observer) -> None:
    runner = cuda_runner(observer, Sampling(first=1, every=0), canary=True)
    for size in SIZES:
        step(runner, size)
    runner.runtime.collect_step_times()
    assert runner.runtime.step_timer is not None and runner.runtime.step_timer.pending == 0
    times = {(d.num_tokens, g is None): (g if g is not None else e, clock)
             for _, d, g, e, _, clock in observer.step_times}
    assert sorted(times) == sorted((size, eager) for size in SIZES for eager in (False, True))
    assert all(seconds > 0 and clock == CUDA_EVENTS for seconds, clock in times.values())
    assert observer.violations == []


def test_a_timed_replay_does_not_wait_for_the_gpu(observer) -> None:
    runner = cuda_runner(observer, Sampling(first=1, every=0), canary=False)
    timer = runner.runtime.step_timer
    assert timer is not None
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keep the stream busy for about a second (clock cycles)
    step(runner, 8)  # its first replay: sampled, timed
    assert timer.pending == 1 and observer.step_times == []  # recorded, not waited for
    assert runner.runtime.collect_step_times() == 1
    ((_, descriptor, graph_seconds, eager_seconds, _, clock),) = observer.step_times
    # The span starts where the replay does in the stream, after the busy kernel before it.
    assert descriptor.num_tokens == 8 and eager_seconds is None and clock == CUDA_EVENTS
    assert 0 < graph_seconds < 0.1
