"""Tensor inputs wherever engines put them, named as read, checked for address and layout."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from capture_core.canary import Sampling
from capture_core.checks import ParameterNames
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import LayoutMismatchError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.inputs import MAX_DEPTH, InputLayout
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(8)


@dataclasses.dataclass
class Metadata:
    seq_lens: torch.Tensor
    num_tokens: int


class Pair(NamedTuple):
    key: torch.Tensor
    value: torch.Tensor


class Holder:
    def __init__(self) -> None:
        self.bias = torch.zeros(8)
        self._scratch = [torch.zeros(8)]


def step(x, kv_caches, metadata, *, extras, pair, holder):
    """Reads every tensor it is handed, however deep."""
    out = x + metadata.seq_lens + extras["bias"] + pair.value + holder.bias + holder._scratch[0]
    return out + sum(k + v for k, v in kv_caches)


def call_args() -> tuple[tuple, dict]:
    t = [torch.full((8,), float(i)) for i in range(6)]
    args = (t[0], [(t[1], t[2]), (t[3], t[4])], Metadata(t[5], 8))
    pair = Pair(torch.ones(8), torch.ones(8))
    kwargs = {"extras": {"bias": torch.ones(8)}, "pair": pair, "holder": Holder()}
    return args, kwargs


def test_every_tensor_is_found_and_named_as_a_user_reads_it() -> None:
    args, kwargs = call_args()
    layout = InputLayout.record(ParameterNames.of(step), args, kwargs)
    assert layout.names == (
        "x", "kv_caches[0][0]", "kv_caches[0][1]", "kv_caches[1][0]", "kv_caches[1][1]",
        "metadata.seq_lens", "extras['bias']", "pair.key", "pair.value", "holder.bias", "holder._scratch[0]",
    )
    assert layout.unchecked == () and layout.find_changes(args, kwargs) == []


def test_what_cannot_be_walked_is_named_with_the_reason() -> None:
    deep: list = [torch.zeros(1)]
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    odd = {"set": {torch.zeros(1)}, (1, 2): torch.zeros(1), "module": torch.nn.Linear(1, 1), "deep": deep}
    layout = InputLayout.record(ParameterNames(("x",)), (torch.zeros(1),), {"odd": odd, "it": iter([1])})
    reasons = "\n".join(layout.unchecked)
    assert "odd['set'] (a set: its items have no stable name)" in reasons
    assert "odd[(1, 2)] (a tuple dict key: not checked)" in reasons
    assert "odd['module'] (an nn.Module argument: its state is not checked)" in reasons
    assert f"deeper than {MAX_DEPTH} levels" in reasons
    assert "it (an iterator: walking it would consume it)" in reasons
    assert layout.names == ("x",)


def captured(observer, **options) -> tuple[CUDAGraphWrapper, tuple, dict]:
    runtime = GraphRuntime("eager", observer=observer, progress=False, **options)
    wrapper = CUDAGraphWrapper(step, runtime, name="step")
    args, kwargs = call_args()
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(*args, **kwargs)
    return wrapper, args, kwargs


def replay(wrapper: CUDAGraphWrapper, args: tuple, kwargs: dict) -> torch.Tensor:
    with set_forward_context(FULL, DESC):
        return wrapper(*args, **kwargs)


NESTED_DRIFTS = {
    "kv_caches[1][0]": lambda a, k: ((a[0], [a[1][0], (a[1][1][0].clone(), a[1][1][1])], a[2]), k),
    "metadata.seq_lens": lambda a, k: ((a[0], a[1], Metadata(a[2].seq_lens.clone(), 8)), k),
    "extras['bias']": lambda a, k: (a, {**k, "extras": {"bias": torch.ones(8)}}),
    "pair.value": lambda a, k: (a, {**k, "pair": Pair(k["pair"].key, torch.ones(8))}),
    "holder.bias": lambda a, k: (a, k),
}


@pytest.mark.parametrize("name", list(NESTED_DRIFTS))
def test_a_fresh_tensor_at_any_depth_is_an_address_drift_named_by_its_path(name, observer) -> None:
    wrapper, args, kwargs = captured(observer)
    if name == "holder.bias":
        kwargs["holder"].bias = torch.zeros(8)  # the same object, an attribute replaced
    replay(wrapper, *NESTED_DRIFTS[name](args, kwargs))
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, name)


LAYOUTS = {
    "transposed": (lambda buf: buf, lambda buf: buf.t(), "strides (4, 1) -> (1, 4)"),
    "an unpadded prefix view": (lambda buf: buf[:8], lambda buf: buf[:5], "shape (8, 4) -> (5, 4)"),
    "another dtype": (
        lambda buf: buf, lambda buf: buf.view(torch.int32), "dtype torch.float32 -> torch.int32"
    ),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_same_address_read_another_way_is_a_layout_mismatch_naming_what_changed(case, observer) -> None:
    captured_view, replayed_view, change = LAYOUTS[case]
    buffer = torch.zeros(16, 4) if case == "an unpadded prefix view" else torch.zeros(4, 4)
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    wrapper = CUDAGraphWrapper(lambda x: x * 2, runtime, name="double")
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(captured_view(buffer))
    with set_forward_context(FULL, DESC):
        wrapper(replayed_view(buffer))
    (event,) = observer.violations
    assert event.kind is ViolationKind.LAYOUT_MISMATCH
    assert event.expected_address == event.actual_address == buffer.data_ptr()
    assert change in event.message and "captured address" in event.message


def test_a_layout_mismatch_raises_in_debug_mode(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False, address_check="debug")
    wrapper = CUDAGraphWrapper(lambda x: x * 2, runtime, name="double")
    x = torch.zeros(4, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    with set_forward_context(FULL, DESC), pytest.raises(LayoutMismatchError, match=r"'x'.*strides"):
        wrapper(x.t())


def test_a_fresh_view_at_the_captured_address_and_layout_is_no_violation(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    wrapper = CUDAGraphWrapper(lambda x: x * 2, runtime, name="double")
    buffer = torch.zeros(16)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(buffer[:8])
    for _ in range(3):  # what many engines pass: a new prefix view of the static buffer every step
        with set_forward_context(FULL, DESC):
            wrapper(buffer[:8])
    assert observer.violations == [] and len(observer.replays) == 3


IN_PLACE = {
    "t_": (lambda x: x.t_(), "strides (4, 1) -> (1, 4)"),
    "set_": (lambda x: x.set_(torch.zeros(4, 4)), "but is now at"),
    "resize_": (lambda x: x.resize_(2, 4), "shape (4, 4) -> (2, 4)"),
    "as_strided_": (lambda x: x.as_strided_((4, 2), (4, 2)), "strides (4, 1) -> (4, 2)"),
    ".data =": (lambda x: setattr(x, "data", torch.zeros(4, 4)), "but is now at"),
}


@pytest.mark.parametrize("change", IN_PLACE)
def test_a_captured_tensor_changed_in_place_is_found_at_that_replay_with_no_sampled_one(change, observer):
    """The object stays the same and its storage or layout changes under it: every one of these
    moves its version counter (``.data =`` moves its address), so the guard re-reads it."""
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=Sampling(first=0, every=0))
    # Summed: the eager backend's replay re-reads the object in whatever layout it has now.
    wrapper = CUDAGraphWrapper(lambda x: x.sum(), runtime, name="total")
    x = torch.zeros(4, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    for _ in range(3):
        x.add_(1)  # written in place: its counter moves, its layout does not
        with set_forward_context(FULL, DESC):
            wrapper(x)
    assert observer.violations == []
    change_it, said = IN_PLACE[change]
    change_it(x)
    with set_forward_context(FULL, DESC):
        wrapper(x)
    [event] = observer.violations
    assert event.kind in (ViolationKind.LAYOUT_MISMATCH, ViolationKind.ADDRESS_DRIFT)
    assert said in event.message
    assert event.input_name == "x" and len(observer.replays) == 4


def test_a_tensor_the_capture_never_saw_is_reported(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False)

    def shifted(x, bias=None):
        return x + (0 if bias is None else bias)

    wrapper = CUDAGraphWrapper(shifted, runtime, name="shifted")
    x = torch.zeros(4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    bias = torch.ones(4)
    with set_forward_context(FULL, DESC):
        wrapper(x, bias=bias)
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "bias")
    assert (event.expected_address, event.actual_address) == (None, bias.data_ptr())
    assert "the graph ignores it" in event.message


def test_the_replay_guard_is_one_flat_run_of_compares(observer) -> None:
    wrapper, _, _ = captured(observer)
    source = wrapper.graphs[DESC].checks.guard_source
    assert "for " not in source and "while " not in source
    assert source.count(") is _") == 11  # one identity test per tensor input
    assert "kwargs['extras']['bias']" in source and "args[2].seq_lens" in source
