"""The wrapped module's parameters and buffers: reloaded by assignment, the graph reads the old ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import AddressDriftError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(2)
NO_SAMPLES = Sampling(first=0, every=0)
"""No sampled replay: only the always-on part of the check runs."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def captured(observer, sampling: Sampling = NO_SAMPLES, **options) -> tuple:
    model = Model().requires_grad_(False)
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=sampling, **options)
    wrapper = CUDAGraphWrapper(model, runtime, name="model")
    x = torch.ones(2, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    return model, wrapper, x


def replay(wrapper: CUDAGraphWrapper, x: torch.Tensor) -> None:
    with set_forward_context(FULL, DESC):
        wrapper(x)


def test_a_weight_reassigned_is_caught_at_the_next_replay_without_any_sampled_one(observer) -> None:
    model, wrapper, x = captured(observer)
    old = model.layers[0].lin.weight
    replay(wrapper, x)
    model.layers[0].lin.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    replay(wrapper, x)
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "self.layers.0.lin.weight")
    assert event.expected_address == old.data_ptr()
    assert event.actual_address == model.layers[0].lin.weight.data_ptr()
    assert "parameter 'self.layers.0.lin.weight'" in event.message and "copy_()" in event.message
    replay(wrapper, x)  # still wrong, so still reported
    assert len(observer.violations) == 2


def test_weights_loaded_with_copy_are_no_violation(observer) -> None:
    model, wrapper, x = captured(observer, sampling=Sampling(first=0, every=1))
    model.load_state_dict({name: torch.randn_like(t) for name, t in model.state_dict().items()})
    with torch.no_grad():
        model.layers[1].lin.bias.copy_(torch.ones(4))
    replay(wrapper, x)
    assert observer.violations == []


def test_a_buffer_or_a_whole_submodule_replaced_is_caught(observer) -> None:
    model, wrapper, x = captured(observer)
    model.layers[1].offset = torch.ones(4)
    replay(wrapper, x)
    assert [v.input_name for v in observer.violations] == ["self.layers.1.offset"]
    assert "buffer 'self.layers.1.offset'" in observer.violations[0].message
    observer.violations.clear()
    model.layers[0] = Block()
    replay(wrapper, x)
    names = {v.input_name for v in observer.violations}
    assert names >= {"self.layers.0.lin.weight", "self.layers.0.lin.bias", "self.layers.0.offset"}


@pytest.mark.parametrize("swap", [
    lambda p: setattr(p, "data", torch.randn(4, 4)),  # an RL weight sync does this
    lambda p: p.set_(torch.randn(4, 4)),
])
def test_a_weight_swapped_under_its_parameter_is_caught_at_the_next_replay(swap, observer) -> None:
    """``.data =`` keeps the Parameter object and moves its memory, which no hook sees: the guard
    reads every parameter's address, so the next replay finds it, with no sampled replay."""
    model, wrapper, x = captured(observer)
    replay(wrapper, x)
    swap(model.layers[0].lin.weight)
    replay(wrapper, x)
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "self.layers.0.lin.weight")
    replay(wrapper, x)  # still wrong, so still reported
    assert len(observer.violations) == 2


class HookedParameter(nn.Parameter):
    """A parameter subclass with its own ``__torch_function__``, as vLLM's weights are
    (``BasevLLMParameter``): every method and attribute of such a tensor goes through Python."""

    def __new__(cls, data: torch.Tensor) -> HookedParameter:
        return super().__new__(cls, data, requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        HookedParameter.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})

    calls = 0


def test_weights_of_a_hooked_subclass_are_read_with_the_hooks_off_and_a_swap_is_still_caught(
    observer,
) -> None:
    model = Model().requires_grad_(False)
    for block in model.layers:
        block.lin.weight = HookedParameter(block.lin.weight.detach())
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=NO_SAMPLES)
    wrapper = CUDAGraphWrapper(model, runtime, name="hooked")
    x = torch.ones(2, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    checks = next(iter(wrapper.graphs.values())).checks
    assert "with _no_subclass_hooks():" in checks.guard_source
    HookedParameter.calls = 0
    assert checks.clean((x,), {}, 2)
    assert HookedParameter.calls == 0  # every weight read without entering Python
    for _ in range(3):
        replay(wrapper, x)
    assert observer.violations == []
    model.layers[1].lin.weight.data = torch.randn(4, 4)  # a .data swap under the subclass parameter
    replay(wrapper, x)
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "self.layers.1.lin.weight")
    plain = captured(observer)[1]
    assert "_no_subclass_hooks" not in next(iter(plain.graphs.values())).checks.guard_source


def test_a_reassigned_weight_raises_in_debug_mode(observer) -> None:
    model, wrapper, x = captured(observer, address_check="debug")
    model.layers[1].lin.bias = nn.Parameter(torch.zeros(4), requires_grad=False)
    with pytest.raises(AddressDriftError, match=r"'self\.layers\.1\.lin\.bias'"):
        replay(wrapper, x)
    assert observer.violations[0].input_name == "self.layers.1.lin.bias" and observer.replays == []


def test_a_callable_that_is_no_module_has_no_state_unless_one_is_named(observer) -> None:
    model = Model().requires_grad_(False)
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=NO_SAMPLES)
    plain = CUDAGraphWrapper(lambda x: model(x), runtime, name="closure")
    named = CUDAGraphWrapper(lambda x: model(x), runtime, name="named", module=model)
    x = torch.ones(2, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        plain(x)
        named(x)
    model.layers[0].lin.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    for wrapper in (plain, named):
        replay(wrapper, x)
    assert [v.wrapper for v in observer.violations] == ["named"]
