"""The replay-vs-eager canary: sampled replays run again eagerly (on copies, or on the real state
with a declared region kept aside) and are compared. The steps here change a Python argument the
graph bakes in; it is declared ``unread`` (a declaration that is wrong), so no baked-value check
reports it and the canary is what finds it, as it finds a value the model reads from itself."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from capture_core.canary import _PIECE, TOLERANCES, Sampling, _bit_sum
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import ReplayMismatchError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper
from tests.support.faults import outside_region_writers

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
    wrapper = CUDAGraphWrapper(step, runtime, name="step", mutated_inputs=["state"], unread=["scale"])
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
    wrapper = CUDAGraphWrapper(lambda ids, *, offset: ids + offset, runtime, name="shift", unread=["offset"])
    ids = torch.arange(4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(ids, offset=1)
    with set_forward_context(FULL, DESC):
        wrapper(ids, offset=2)
    (event,) = observer.violations
    assert event.max_abs_error == 1.0
    assert "4 of 4 elements" in event.message and "torch.int64" in event.message


class Scatter:
    """``state[slots] = x * scale``: a step that writes rows of a state, as a decode step writes its
    KV cache; the rows it writes are declared (``written``), so the canary keeps only those."""

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, state: torch.Tensor, *, scale: float) -> Any:
        state[slots] = x * scale
        return state[slots].sum(1)

    @staticmethod
    def written(context, args, kwargs) -> torch.Tensor:
        return args[1]


def scattering(observer, **options) -> tuple:
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=EVERY, canary=True, **options)
    wrapper = CUDAGraphWrapper(
        Scatter(), runtime, name="scatter", mutated_inputs={"state": Scatter.written}, unread=["scale"]
    )
    x, slots, state = torch.arange(1.0, 5.0).reshape(2, 2), torch.tensor([0, 1]), torch.zeros(6, 2)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, slots, state, scale=1.0)
    state.zero_()
    return wrapper, x, slots, state


def test_a_baked_value_written_into_the_region_is_a_mismatch_of_the_steps_writes(observer) -> None:
    wrapper, x, slots, state = scattering(observer)
    with set_forward_context(FULL, DESC):
        wrapper(x, slots, state, scale=3.0)  # the graph keeps the captured 1.0
    by_name = {v.input_name: v for v in observer.violations}
    assert set(by_name) == {"output", "state"}
    assert "what the step wrote to 'state' differs" in by_name["state"].message
    assert by_name["state"].max_abs_error == pytest.approx(8.0)  # 4 * 3 - 4 * 1
    assert not any("outside the region" in v.message for v in observer.violations)
    # The graph's writes stand, and nothing else of the state moved.
    assert torch.equal(state[:2], x) and not state[2:].any()


def test_a_graph_that_writes_another_slot_moves_the_checksum_outside_the_region(observer) -> None:
    wrapper, x, _, state = scattering(observer)
    moved = torch.tensor([4, 5])  # a fresh slots tensor: the graph still reads the captured one
    with set_forward_context(FULL, DESC):
        wrapper(x, moved, state, scale=1.0)
    found = [(v.kind, v.input_name) for v in observer.violations]
    assert found[0] == (ViolationKind.ADDRESS_DRIFT, "slots")
    outside = [v for v in observer.violations if "outside the region" in v.message]
    assert len(outside) == 1 and outside_region_writers(outside) == {"the graph"}
    assert outside[0].kind is ViolationKind.REPLAY_MISMATCH and outside[0].max_abs_error == float("inf")
    region = next(v for v in observer.violations if "what the step wrote to 'state'" in v.message)
    assert region.max_abs_error == pytest.approx(4.0)  # the graph left rows 4, 5 as they were
    # What the graph did stays (rows 0 and 1), the eager step's writes to the region do not.
    assert torch.equal(state[:2], x) and not state[2:].any()


def test_clean_replays_with_a_region_record_nothing_and_leave_the_graphs_writes(observer) -> None:
    wrapper, x, slots, state = scattering(observer)
    for step in range(5):
        x.add_(1.0)
        slots.copy_(torch.tensor([step % 6, (step + 3) % 6]))
        with set_forward_context(FULL, DESC):
            wrapper(x, slots, state, scale=1.0)
        assert torch.equal(state[slots], x)
    assert observer.violations == []


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.bool, torch.int32],
)
def test_the_bit_sum_sees_one_changed_element_of_any_dtype_and_reads_views_in_place(dtype) -> None:
    whole = (torch.rand(3, 4, 5, 6) * 100).to(dtype)
    state = whole[:, :3]  # a strided part, as the runner's comparison narrows the cache
    before = int(_bit_sum(state))
    assert int(_bit_sum(state.clone())) == before  # the same bits, the same sum, whatever the layout
    whole[0, 3, 0, 0] = ~whole[0, 3, 0, 0] if dtype is torch.bool else whole[0, 3, 0, 0] + 1
    assert int(_bit_sum(state)) == before  # outside the part
    state[2, 2, 4, 5] = ~state[2, 2, 4, 5] if dtype is torch.bool else state[2, 2, 4, 5] + 1
    assert int(_bit_sum(state)) != before


def test_the_bit_sum_of_a_layout_that_cannot_be_read_as_words_goes_in_bounded_pieces(monkeypatch) -> None:
    monkeypatch.setattr("capture_core.canary._PIECE", 7)
    state = torch.randint(0, 255, (5, 9, 3), dtype=torch.uint8)  # 3 bytes a row: not 8-byte words
    assert int(_bit_sum(state)) == int(state.sum(dtype=torch.int64))
    assert _PIECE > 7  # the module's own bound is untouched outside this test


class Sampler:
    """A step that draws random numbers from torch's generator, as in-graph sampling and dropout do:
    noise added to the logits, a token drawn from them (the exponential race vLLM samples with: no
    host sync, so a CUDA graph can hold it), and dropout on the hidden state."""

    def __call__(self, x: torch.Tensor) -> tuple:
        noisy = x + torch.rand_like(x)
        token = (noisy.softmax(-1) / torch.empty_like(noisy).exponential_()).argmax(-1)
        return torch.nn.functional.dropout(noisy, p=0.5, training=True), token


def sampling_step(observer, step: Any, backend: str = "eager", **options) -> tuple:
    runtime = GraphRuntime(
        backend, observer=observer, progress=False, warmup_iters=0 if backend == "eager" else 2,
        sampling=EVERY, canary=True, **options,
    )
    wrapper = CUDAGraphWrapper(step, runtime, name="sampler")
    x = torch.arange(8.0, device="cuda" if backend == "cuda" else "cpu").reshape(4, 2)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    return wrapper, x


@pytest.mark.parametrize("mode", ["always_on", "debug"])
def test_in_graph_sampling_draws_the_same_numbers_in_the_replay_and_the_eager_step(mode, observer) -> None:
    wrapper, x = sampling_step(observer, Sampler(), address_check=mode)
    torch.manual_seed(5)
    for _ in range(20):
        with set_forward_context(FULL, DESC):
            dropped, token = wrapper(x)
    next_draw = torch.rand(3)
    assert observer.violations == []
    # The engine's random stream went on as if only the replays had run (20 replays, no eager steps).
    plain = Sampler()
    torch.manual_seed(5)
    for _ in range(20):
        expected_dropped, expected_token = plain(x)
    assert torch.equal(dropped, expected_dropped) and torch.equal(token, expected_token)
    assert torch.equal(next_draw, torch.rand(3))


class HostDraw:
    """A step scaled by a number drawn on the host (Python's ``random``): a CUDA graph bakes the
    number drawn at capture into every replay, as it would a baked seed."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.rng.random()


@pytest.mark.parametrize("mode", ["always_on", "debug"])
def test_random_numbers_drawn_outside_torchs_generators_are_still_a_mismatch(mode, observer) -> None:
    wrapper, x = sampling_step(observer, HostDraw(), address_check=mode)
    call = set_forward_context(FULL, DESC)
    if mode == "debug":
        with call, pytest.raises(ReplayMismatchError, match="'output'"):
            wrapper(x)
    else:
        with call:
            wrapper(x)
    found = [(v.kind, v.input_name) for v in observer.violations]
    assert found == [(ViolationKind.REPLAY_MISMATCH, "output")]


class ItemDraw:
    """A step scaled by a number drawn from torch's CPU generator and read with ``.item()``: a CUDA
    graph keeps the number drawn at capture (the eager backend draws it again at each replay)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand(()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["always_on", "debug"])
def test_cuda_in_graph_sampling_compares_equal_and_numbers_frozen_at_capture_do_not(mode, observer) -> None:
    wrapper, x = sampling_step(observer, Sampler(), backend="cuda", address_check=mode)
    for _ in range(20):
        with set_forward_context(FULL, DESC):
            wrapper(x)
    torch.cuda.synchronize()
    assert observer.violations == []
    for frozen in (HostDraw(), ItemDraw()):
        wrapper, x = sampling_step(observer, frozen, backend="cuda", address_check="always_on")
        with set_forward_context(FULL, DESC):
            wrapper(x)
        torch.cuda.synchronize()
    assert [(v.kind, v.input_name, v.wrapper) for v in observer.violations] == [
        (ViolationKind.REPLAY_MISMATCH, "output", "sampler")
    ] * 2
