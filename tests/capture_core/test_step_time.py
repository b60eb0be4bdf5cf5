"""Step time: sampled replays, the canary's eager steps and sampled eager fallbacks are timed and told
to the observer; unsampled replays run what they ran before (the eager backend's host clock here;
``test_step_time_cuda.py`` has the CUDA events)."""

from __future__ import annotations

import time

import pytest
import torch

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.events import FanOutObserver
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.step_time import HOST_CLOCK, StepTimer
from capture_core.wrapper import CUDAGraphWrapper

pytestmark = pytest.mark.usefixtures("single_thread_torch")

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(4)
NAP = 0.004
"""What the timed step sleeps: a host clock around what really ran must see it."""


class Napping:
    """``x * 2`` after a short sleep; counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        time.sleep(NAP)
        return x * 2


def wrapped(observer, sampling: Sampling, **options) -> tuple[CUDAGraphWrapper, torch.Tensor]:
    runtime = GraphRuntime("eager", observer=observer, progress=False, warmup_iters=0, sampling=sampling,
                           **options)
    wrapper = CUDAGraphWrapper(Napping(), runtime, name="napping")
    x = torch.ones(4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    return wrapper, x


def replay(wrapper: CUDAGraphWrapper, x: torch.Tensor, times: int) -> None:
    for _ in range(times):
        with set_forward_context(FULL, DESC):
            wrapper(x)


def test_sampled_replays_and_the_canarys_eager_steps_are_timed_on_the_host_clock(observer) -> None:
    wrapper, x = wrapped(observer, Sampling(first=1, every=3), canary=True)
    replay(wrapper, x, 7)
    # Replays 1, 4 and 7 are sampled: each is timed, and so is its canary step.
    graph = [t for t in observer.step_times if t[2] is not None]
    eager = [t for t in observer.step_times if t[3] is not None]
    assert len(graph) == len(eager) == 3
    for mode, descriptor, graph_s, eager_s, samples, clock in observer.step_times:
        assert (mode, descriptor, samples, clock) == (FULL, DESC, 1, HOST_CLOCK)
        assert (graph_s if graph_s is not None else eager_s) >= NAP  # what really ran: the model, re-run
    assert all(t[3] is None for t in graph) and all(t[2] is None for t in eager)


def test_unsampled_replays_time_nothing_and_never_reach_the_timer(observer, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(StepTimer, "time", lambda *args, **kwargs: calls.append(args))
    wrapper, x = wrapped(observer, Sampling(first=0, every=0), canary=True)
    replay(wrapper, x, 50)
    assert wrapper.runnable.runs == 51 and calls == [] and observer.step_times == []


def test_without_the_canary_only_the_replay_is_timed(observer) -> None:
    wrapper, x = wrapped(observer, Sampling(first=2, every=0))
    replay(wrapper, x, 5)
    assert [(t[2] is not None, t[3] is None) for t in observer.step_times] == [(True, True)] * 2


@pytest.mark.parametrize(
    "options", [{"step_timing": False}, {"address_check": "off"}], ids=["timing-off", "checks-off"]
)
def test_timing_off_or_checks_off_times_nothing(observer, options) -> None:
    wrapper, x = wrapped(observer, Sampling(first=5, every=1), canary=True, **options)
    replay(wrapper, x, 5)
    assert observer.step_times == []


def test_an_observer_without_on_step_time_is_left_alone(observer) -> None:
    class Plain:
        def on_capture(self, event) -> None: ...
        def on_replay(self, *args) -> None: ...
        def on_eager(self, *args) -> None: ...
        def on_violation(self, event) -> None: ...

    wrapper, x = wrapped(FanOutObserver(Plain(), observer), Sampling(first=4, every=0), canary=True)
    replay(wrapper, x, 2)
    assert len(observer.step_times) == 4
    wrapper.runtime.observer = Plain()
    replay(wrapper, x, 2)  # sampled and timed too, told to nobody: the observer has no call to hear it
    assert wrapper.runnable.runs == 1 + 2 * 4 and len(observer.step_times) == 4


def test_eager_fallbacks_are_timed_per_size_on_the_sampling_schedule(observer) -> None:
    config = ModelConfig.tiny(max_num_seqs=12, max_seq_len=32)
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=Sampling(first=1, every=2))
    runner = DecodeRunner(ReferenceDecoder(config, seed=1), runtime, [1, 2, 4], mode=FULL)
    runner.capture()
    for size in (6, 6, 6, 6, 9):  # above the largest capture size: eager, with the reason
        ids = torch.arange(size)
        runner.step(ids, ids % 8, ids)
    timed = [(mode, d.num_tokens, g, e is not None, clock) for mode, d, g, e, _, clock in observer.step_times]
    # Per size: the first fallback, then one in two (the 1st and 3rd of size 6, the 1st of size 9).
    assert timed == [(CUDAGraphMode.NONE, 6, None, True, HOST_CLOCK)] * 2 + [
        (CUDAGraphMode.NONE, 9, None, True, HOST_CLOCK)]
    assert len(observer.eagers) == 5
