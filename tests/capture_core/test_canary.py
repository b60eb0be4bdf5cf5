"""The replay-vs-eager canary: sampled replays run again eagerly, on copies, and are compared."""

from __future__ import annotations

import pytest
import torch

from capture_core.canary import TOLERANCES, Sampling
from capture_core.checks import ReplayMismatchError
from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(4)
EVERY = Sampling(first=0, every=1)


class Step:
    """``(x * scale, {'sum': ...})``, and ``state += scale`` in place: outputs and a mutated input.
    Counts its runs, so a test can tell a replay from an eager run on the eager backend."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, x: torch.Tensor, state: torch.Tensor, *, scale: float) -> tuple:
        self.runs += 1
        state.add_(scale)
        return x * scale, {"sum": (x * scale).sum(0)}


def make(observer, sampling: Sampling = EVERY, **options) -> tuple:
    runtime = GraphRuntime(
        "eager", observer=observer, progress=False, warmup_iters=0, sampling=sampling, **options
    )
    step = Step()
    wrapper = CUDAGraphWrapper(step, runtime, name="step", mutated_inputs=["state"])
    x, state = torch.arange(8.0).reshape(4, 2), torch.zeros(4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, state, scale=1.0)
    return step, wrapper, x, state


def replay(wrapper: CUDAGraphWrapper, x: torch.Tensor, state: torch.Tensor, scale: float) -> tuple:
    with set_forward_context(FULL, DESC):
        return wrapper(x, state, scale=scale)


def test_a_schedule_samples_the_first_replays_then_one_in_n() -> None:
    schedule = Sampling(first=2, every=5)
    sampled = [n for n in range(1, 20) if schedule.gap(n - 1) == 1]
    assert sampled == [1, 2, 7, 12, 17]
    assert Sampling(first=1, every=0).gap(1) is None
    with pytest.raises(ValueError, match="every must be an integer >= 0"):
        Sampling(every=-1)


def test_a_host_value_baked_in_at_capture_is_a_replay_mismatch_with_its_errors(observer) -> None:
    _, wrapper, x, state = make(observer, canary=True)
    outputs, _ = replay(wrapper, x, state, scale=3.0)  # the graph keeps the captured 1.0
    kinds = {(v.kind, v.input_name) for v in observer.violations}
    names = ("output[0]", "output[1]['sum']", "state")
    assert kinds == {(ViolationKind.REPLAY_MISMATCH, name) for name in names}
    first = next(v for v in observer.violations if v.input_name == "output[0]")
    assert first.max_abs_error == pytest.approx(14.0)  # x * 3 - x * 1 at its largest, x = 7
    assert first.max_rel_error == pytest.approx(2 / 3)
    assert "max abs error 14" in first.message and f"rtol {TOLERANCES[torch.float32][0]:g}" in first.message
    assert "a host value" in first.message
    # The replay's results stand (the eager run worked on copies): the graph's x * 1, state + 1 twice.
    assert torch.equal(outputs, x) and torch.equal(state, torch.full((4,), 2.0))


def test_between_samples_no_eager_step_runs(observer) -> None:
    step, wrapper, x, state = make(observer, sampling=Sampling(first=1, every=3), canary=True)
    runs = step.runs
    for _ in range(7):
        replay(wrapper, x, state, scale=1.0)
    # Seven replays re-run the step on the eager backend; replays 1, 4 and 7 add an eager run each.
    assert step.runs - runs == 7 + 3
    assert observer.violations == []


def test_the_canary_is_off_by_default_outside_debug_mode(observer) -> None:
    step, wrapper, x, state = make(observer)
    runs = step.runs
    replay(wrapper, x, state, scale=3.0)
    assert step.runs - runs == 1 and observer.violations == []


def test_debug_mode_runs_it_on_every_replay_and_raises(observer) -> None:
    _, wrapper, x, state = make(observer, address_check="debug")
    replay(wrapper, x, state, scale=1.0)
    with pytest.raises(ReplayMismatchError, match=r"output 'output\[0\]' differs from the same step"):
        replay(wrapper, x, state, scale=2.0)
    assert observer.violations and len(observer.replays) == 2


def test_integer_outputs_must_match_exactly(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False, canary=True, sampling=EVERY)
    wrapper = CUDAGraphWrapper(lambda ids, *, offset: ids + offset, runtime, name="shift")
    ids = torch.arange(4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(ids, offset=1)
    with set_forward_context(FULL, DESC):
        wrapper(ids, offset=2)
    (event,) = observer.violations
    assert event.max_abs_error == 1.0
    assert "4 of 4 elements" in event.message and "torch.int64" in event.message
