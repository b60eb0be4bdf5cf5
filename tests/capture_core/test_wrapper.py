"""The graph wrapper on the eager backend: capture on first use, replay after, what it records."""

from __future__ import annotations

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(4)


class ScaleAndShift(torch.nn.Module):
    """``x * scale + kv_caches[1]``: a positional, a list and a keyword input; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor, kv_caches: list[torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * scale + kv_caches[1]


def make_inputs() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    return torch.ones(4), [torch.zeros(4), torch.full((4,), 10.0)], torch.tensor(2.0)


def test_outside_a_forward_context_the_runnable_runs_directly(runtime, observer):
    module = ScaleAndShift()
    wrapper = CUDAGraphWrapper(module, runtime)
    x, kv, scale = make_inputs()
    with runtime.capture_phase():
        out = wrapper(x, kv, scale=scale)
    assert torch.equal(out, torch.full((4,), 12.0))
    assert module.calls == 1
    assert wrapper.graphs == {}
    assert observer.captures == [] and observer.replays == []


def test_a_batch_of_another_runtime_mode_passes_through(runtime, observer):
    module = ScaleAndShift()
    wrapper = CUDAGraphWrapper(module, runtime, CUDAGraphMode.PIECEWISE)
    x, kv, scale = make_inputs()
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, kv, scale=scale)
    assert module.calls == 1 and wrapper.graphs == {}


def test_before_the_capture_phase_a_missing_graph_runs_eagerly_with_the_reason(runtime, observer):
    module = ScaleAndShift()
    wrapper = CUDAGraphWrapper(module, runtime)
    x, kv, scale = make_inputs()
    with set_forward_context(FULL, DESC, num_real_tokens=3):
        out = wrapper(x, kv, scale=scale)
    assert torch.equal(out, torch.full((4,), 12.0))
    assert observer.eagers == [(EagerReason.BEFORE_CAPTURE_PHASE, 3, FULL)]
    assert wrapper.graphs == {} and observer.captures == [] and observer.violations == []


def test_first_use_in_the_capture_phase_warms_up_then_captures_and_records(runtime, observer):
    module = ScaleAndShift()
    wrapper = CUDAGraphWrapper(module, runtime, name="toy")
    x, kv, scale = make_inputs()
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        out = wrapper(x, kv, scale=scale)
    assert torch.equal(out, torch.full((4,), 12.0))
    assert module.calls == runtime.warmup_iters + 1 == 4
    (event,) = observer.captures
    assert event.descriptor == DESC and event.mode is FULL and event.wrapper == "toy"
    assert event.backend == "eager" and event.pool_bytes == 0 and event.warmup_iters == 3
    assert event.input_names == ("x", "kv_caches[0]", "kv_caches[1]", "scale")
    assert event.input_addresses == (x.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), scale.data_ptr())
    assert event.capture_seconds > 0 and not event.unexpected
    entry = wrapper.graphs[DESC]
    assert entry.addresses == dict(zip(event.input_names, event.input_addresses, strict=True))
    assert entry.capture_seconds == event.capture_seconds and entry.pool_bytes == 0


@pytest.mark.parametrize("warmup_iters", [0, 1, 5])
def test_the_warm_up_count_is_configurable(observer, warmup_iters):
    runtime = GraphRuntime("eager", observer=observer, warmup_iters=warmup_iters, progress=False)
    module = ScaleAndShift()
    wrapper = CUDAGraphWrapper(module, runtime)
    x, kv, scale = make_inputs()
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, kv, scale=scale)
    assert module.calls == warmup_iters + 1
    assert observer.captures[0].warmup_iters == warmup_iters


def test_later_calls_replay_on_the_static_inputs_and_return_the_static_output(runtime, observer):
    module = ScaleAndShift()
    wrapper = CUDAGraphWrapper(module, runtime)
    x, kv, scale = make_inputs()
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        first = wrapper(x, kv, scale=scale)
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with set_forward_context(FULL, DESC, num_real_tokens=3):
        second = wrapper(x, kv, scale=scale)
    assert second is first  # graphs write into their static outputs
    assert torch.equal(second, torch.tensor([12.0, 14.0, 16.0, 18.0]))
    assert len(observer.captures) == 1
    assert observer.replays == [(FULL, DESC, 3)]
    assert observer.violations == []


def test_each_descriptor_gets_its_own_graph(runtime, observer):
    wrapper = CUDAGraphWrapper(ScaleAndShift(), runtime)
    x, kv, scale = make_inputs()
    other = BatchDescriptor(4, 4, True)
    with runtime.capture_phase():
        for descriptor in (DESC, other, DESC):
            with set_forward_context(FULL, descriptor):
                wrapper(x, kv, scale=scale)
    assert set(wrapper.graphs) == {DESC, other}
    assert [e.descriptor for e in observer.captures] == [DESC, other]
    assert observer.replays == [(FULL, DESC, 4)]


def test_an_equal_descriptor_object_finds_the_graph_captured_under_another(runtime, observer):
    wrapper = CUDAGraphWrapper(ScaleAndShift(), runtime)
    x, kv, scale = make_inputs()
    with runtime.capture_phase(), set_forward_context(FULL, BatchDescriptor(4, 4, True)):
        wrapper(x, kv, scale=scale)
    for _ in range(2):
        with set_forward_context(FULL, BatchDescriptor(4, 4, True)):
            wrapper(x, kv, scale=scale)
    assert len(observer.captures) == 1 and len(observer.replays) == 2


def test_a_wrapper_serves_only_graph_modes():
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        CUDAGraphWrapper(ScaleAndShift(), GraphRuntime("eager"), CUDAGraphMode.NONE)


def test_repr_names_the_backend(runtime):
    assert "backend=eager" in repr(CUDAGraphWrapper(ScaleAndShift(), runtime, name="m"))


def test_violations_are_never_swallowed_for_a_wrapper_without_signature(runtime, observer):
    """A callable torch cannot introspect still gets checked, with inputs named by position."""
    wrapper = CUDAGraphWrapper(torch.add, runtime)
    a, b = torch.ones(3), torch.ones(3)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(a, b)
    with set_forward_context(FULL, DESC):
        wrapper(a, torch.ones(3))
    names = observer.captures[0].input_names
    assert len(names) == 2
    (violation,) = observer.violations
    assert violation.kind is ViolationKind.ADDRESS_DRIFT and violation.input_name == names[1]


def test_two_threads_reaching_one_missing_graph_capture_it_once(runtime, observer):
    import threading
    import time

    started = threading.Barrier(2)

    def slow_double(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)  # keeps the first capture going while the other thread arrives
        return x * 2

    wrapper = CUDAGraphWrapper(slow_double, runtime)
    x = torch.ones(4)
    results = []

    def worker() -> None:
        started.wait()
        with set_forward_context(FULL, DESC):
            results.append(wrapper(x).clone())

    with runtime.capture_phase():
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(observer.captures) == 1 and len(observer.replays) == 1
    assert all(torch.equal(r, torch.full((4,), 2.0)) for r in results)


class EngineHeld:
    """A graph source whose graphs an engine captured and replays by itself (as vLLM's V2 runner does):
    the wrapper is handed them with ``adopt``, has no eager form of the step, and replays through it."""

    has_eager_form = False

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, wrapper, call, unexpected):
        raise AssertionError("an engine-held graph is adopted, never captured through the wrapper")

    def run_eagerly(self, call):
        raise AssertionError("the canary must not run a graph with no eager form")


def test_a_graph_captured_elsewhere_is_adopted_and_its_replays_are_checked(observer):
    from capture_core.checks import ParameterNames
    from capture_core.inputs import InputLayout
    from capture_core.wrapper import GraphEntry

    runtime = GraphRuntime("eager", observer=observer, canary=True, progress=False)
    source = EngineHeld()
    wrapper = CUDAGraphWrapper(lambda **k: None, runtime, name="engine", source=source, module=None)

    class Held:  # what the engine replays: a pass that counts itself
        outputs = None
        capture_seconds, pool_bytes = 0.25, 4096

        def run(self, args, kwargs):
            source.replays += 1
            return "replayed"

    class HeldEntry(GraphEntry):
        runs_pass = True

    buffer = torch.zeros(4)
    layout = InputLayout.record(ParameterNames(), (), {"input_ids": buffer})
    with runtime.capture_phase():
        wrapper.adopt(HeldEntry(DESC, FULL, Held(), layout, 0.25, 4096, False))
    (event,) = observer.captures
    assert (event.wrapper, event.input_names, event.capture_seconds, event.pool_bytes) == (
        "engine", ("input_ids",), 0.25, 4096)
    with set_forward_context(FULL, DESC):
        for _ in range(3):  # the first replay is sampled: no canary for a graph with no eager form
            assert wrapper(input_ids=buffer) == "replayed"
        assert wrapper(input_ids=torch.zeros(4)) == "replayed"  # a buffer replaced, not written
    assert source.replays == 4
    (drift,) = observer.violations
    assert (drift.kind, drift.input_name) == (ViolationKind.ADDRESS_DRIFT, "input_ids")


def test_an_adopted_graph_s_per_step_inputs_are_snapshot_before_each_replay(observer):
    """A graph captured elsewhere holds no snapshot of its own: the wrapper takes it before each
    replay, so a buffer written where no counter sees it is no stale input, and one not written is."""
    from capture_core.checks import ParameterNames
    from capture_core.errors import StaleInputError
    from capture_core.inputs import InputLayout
    from capture_core.wrapper import GraphEntry

    runtime = GraphRuntime("eager", observer=observer, progress=False, address_check="debug")
    wrapper = CUDAGraphWrapper(
        lambda **k: None, runtime, name="engine", source=EngineHeld(), module=None,
        per_step_inputs=["input_ids"],
    )

    class Held:
        outputs = None

        def replay(self):
            pass

    buffer = torch.zeros(4)
    layout = InputLayout.record(ParameterNames(), (), {"input_ids": buffer})
    with runtime.capture_phase():
        wrapper.adopt(GraphEntry(DESC, FULL, Held(), layout, 0.0, 0, False))
    with set_forward_context(FULL, DESC):
        for token in range(5):
            buffer.numpy()[:] = token + 1  # written where no version counter sees it
            wrapper(input_ids=buffer)
        assert observer.violations == []
        with pytest.raises(StaleInputError, match="'input_ids'"):
            wrapper(input_ids=buffer)
