"""The runtime: capture guard and lock, unexpected-capture policies, fault injection, capture_all."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError, UnexpectedCaptureError
from capture_core.events import ViolationKind
from capture_core.forward_context import get_forward_context, set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import CapturePhase, GraphRuntime, UnexpectedCapturePolicy
from capture_core.sizes import EagerReason
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
CAPTURED = BatchDescriptor(8)
LATE = BatchDescriptor(2)
LATE_INPUT = torch.full((2,), 3.0)


def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def started(observer, policy: str) -> tuple[GraphRuntime, CUDAGraphWrapper]:
    """A runtime whose start-up captured one graph and locked."""
    runtime = GraphRuntime("eager", observer=observer, unexpected_capture=policy, progress=False)
    wrapper = CUDAGraphWrapper(square, runtime, name="square")
    with runtime.capture_phase(), set_forward_context(FULL, CAPTURED):
        wrapper(torch.ones(8))
    assert runtime.locked
    return runtime, wrapper


def late_call(wrapper: CUDAGraphWrapper) -> torch.Tensor:
    with set_forward_context(FULL, LATE, num_real_tokens=2):
        return wrapper(LATE_INPUT)


def assert_one_unexpected_capture_event(observer, policy: str) -> None:
    (event,) = observer.violations
    assert event.kind is ViolationKind.UNEXPECTED_CAPTURE
    assert event.descriptor == LATE and event.mode is FULL and event.wrapper == "square"
    assert f"policy {policy!r}" in event.message and LATE.key in event.message
    assert "late_call" in event.stack  # where the call came from, not the cache's own frames


def test_raise_policy_emits_the_event_then_raises_a_clear_error(observer):
    _, wrapper = started(observer, "raise")
    with pytest.raises(UnexpectedCaptureError, match="capture was locked") as raised:
        late_call(wrapper)
    assert "Add this size to the capture sizes" in str(raised.value)
    assert_one_unexpected_capture_event(observer, "raise")
    assert LATE not in wrapper.graphs and len(observer.captures) == 1


def test_eager_policy_emits_the_event_then_serves_eagerly(observer):
    _, wrapper = started(observer, "eager")
    assert torch.equal(late_call(wrapper), torch.full((2,), 9.0))
    assert_one_unexpected_capture_event(observer, "eager")
    assert observer.eagers == [(EagerReason.UNEXPECTED_CAPTURE, 2, FULL)]
    assert LATE not in wrapper.graphs
    late_call(wrapper)  # every attempt is reported, not just the first
    assert len(observer.violations) == 2


def test_capture_policy_emits_the_event_then_captures_marked_unexpected(observer):
    _, wrapper = started(observer, "capture")
    assert torch.equal(late_call(wrapper), torch.full((2,), 9.0))
    assert_one_unexpected_capture_event(observer, "capture")
    assert [e.unexpected for e in observer.captures] == [False, True]
    assert wrapper.graphs[LATE].unexpected
    late_call(wrapper)  # now it is a graph like any other: a replay, no new event
    assert len(observer.violations) == 1 and observer.replays[-1] == (FULL, LATE, 2)


def test_capture_is_locked_for_good_when_the_phase_ends(observer):
    runtime, wrapper = started(observer, "raise")
    assert runtime.phase is CapturePhase.LOCKED
    # A phase begun after the lock unlocks nothing: a capture inside it is an unexpected capture.
    with pytest.raises(GraphCacheError, match="capture was locked"), runtime.capture_phase():
        late_call(wrapper)
    assert runtime.locked
    assert_one_unexpected_capture_event(observer, "raise")


def test_nested_capture_phases_lock_when_the_outermost_ends(runtime):
    with runtime.capture_phase():
        with runtime.capture_phase():
            pass
        assert runtime.phase is CapturePhase.CAPTURING
    assert runtime.phase is CapturePhase.LOCKED


def test_the_capture_phase_locks_even_when_capture_fails(runtime):
    with pytest.raises(ZeroDivisionError), runtime.capture_phase():
        raise ZeroDivisionError
    assert runtime.locked


def test_injected_faults_are_marked_as_injected(observer):
    runtime, wrapper = started(observer, "eager")
    with runtime.injected_faults():
        late_call(wrapper)
        with set_forward_context(FULL, CAPTURED):
            wrapper(torch.ones(8))  # a fresh tensor: address drift
    late_call(wrapper)
    assert [(v.kind, v.injected) for v in observer.violations] == [
        (ViolationKind.UNEXPECTED_CAPTURE, True),
        (ViolationKind.ADDRESS_DRIFT, True),
        (ViolationKind.UNEXPECTED_CAPTURE, False),
    ]


def test_capture_all_goes_largest_first_under_each_context_with_progress(observer):
    stream = io.StringIO()
    runtime = GraphRuntime("eager", observer=observer, progress=True)
    wrapper = CUDAGraphWrapper(square, runtime)
    seen = []

    def run(mode, descriptor):
        context = get_forward_context()
        seen.append((context.mode, context.descriptor, context.num_real_tokens))
        wrapper(torch.ones(descriptor.num_tokens))

    graphs = [(FULL, BatchDescriptor(n)) for n in (1, 4, 2, 8)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stderr", stream)
        runtime.capture_all(graphs, run)
    assert [d.num_tokens for _, d, _ in seen] == [8, 4, 2, 1]
    assert all(real == d.num_tokens for _, d, real in seen)
    assert [e.descriptor.num_tokens for e in observer.captures] == [8, 4, 2, 1]
    assert runtime.locked
    lines = stream.getvalue().splitlines()
    assert lines[-1] == "Capturing graphs [####################] 4/4 FULL tokens=1"
    assert len(lines) == 4


def test_micro_batch_threads_have_their_own_forward_context(runtime):
    with set_forward_context(FULL, CAPTURED):
        seen = []
        thread = threading.Thread(target=lambda: seen.append(get_forward_context()))
        thread.start()
        thread.join()
        assert get_forward_context().descriptor == CAPTURED
    assert seen == [None] and get_forward_context() is None


def test_configuration_errors_are_clear():
    with pytest.raises(ValueError, match="raise, eager, engine, capture"):
        GraphRuntime("eager", unexpected_capture="ignore")
    with pytest.raises(ValueError, match="warmup_iters"):
        GraphRuntime("eager", warmup_iters=-1)
    with pytest.raises(ValueError, match="auto, cuda, eager"):
        GraphRuntime("tpu")
    assert UnexpectedCapturePolicy.parse(" EAGER ") is UnexpectedCapturePolicy.EAGER


@pytest.mark.parametrize("policy", ["raise", "eager", "capture", "engine"])
def test_a_capture_phase_begun_after_the_lock_captures_only_by_policy_and_always_records(observer, policy):
    runtime, _ = started(observer, policy)
    late = CUDAGraphWrapper(square, runtime, name="late")  # a model built after start-up
    with runtime.capture_phase(), set_forward_context(FULL, LATE, num_real_tokens=2):
        if policy == "raise":
            with pytest.raises(UnexpectedCaptureError):
                late(LATE_INPUT)
        else:
            assert torch.equal(late(LATE_INPUT), torch.full((2,), 9.0))
    assert runtime.locked
    (event,) = observer.violations
    assert (event.kind, event.wrapper) == (ViolationKind.UNEXPECTED_CAPTURE, "late")
    assert "test_runtime.py" in event.stack
    # ENGINE leaves the attempt to the graph source's owner; capture_core's own source then captures
    captured_late = policy in ("capture", "engine")
    assert [e.unexpected for e in observer.captures] == [False] + ([True] if captured_late else [])
    if policy == "engine":
        assert "left it to the engine" in event.message


def test_a_direct_capture_is_guarded_like_any_other(observer):
    runtime = GraphRuntime("eager", observer=observer, unexpected_capture="eager", progress=False)
    wrapper = CUDAGraphWrapper(square, runtime, name="square")
    with pytest.raises(GraphCacheError, match="before the capture phase"):
        wrapper.capture(CAPTURED, (torch.ones(8),))
    with runtime.capture_phase():
        entry = wrapper.capture(CAPTURED, (torch.ones(8),))
        assert entry is wrapper.capture(CAPTURED, (torch.ones(8),))  # held: not captured again
    assert entry is not None and not entry.unexpected
    assert wrapper.capture(LATE, (LATE_INPUT,)) is None  # after the lock: recorded, then the policy
    assert [v.kind for v in observer.violations] == [ViolationKind.UNEXPECTED_CAPTURE]
    assert observer.eagers == [(EagerReason.UNEXPECTED_CAPTURE, 2, FULL)]
    runtime.unexpected_capture = UnexpectedCapturePolicy.RAISE
    with pytest.raises(UnexpectedCaptureError):
        wrapper.capture(LATE, (LATE_INPUT,))
    assert len(observer.violations) == 2
