"""The wrapped module's parameters and buffers: reloaded by assignment, the graph reads the old ones."""

from __future__ import annotations

import re

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


def captured_model(model: nn.Module, observer) -> tuple:
    """``model``'s graph captured with only the always-on checks: its wrapper, checks and input."""
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=NO_SAMPLES)
    wrapper = CUDAGraphWrapper(model, runtime, name="model")
    x = torch.ones(2, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x)
    return wrapper, next(iter(wrapper.graphs.values())).checks, x


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


class PassThroughParameter(nn.Parameter):
    """A parameter subclass whose ``__torch_function__`` only passes on, as vLLM's
    ``BasevLLMParameter``'s does (one torch.compile traces through)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class OwnSetattrParameter(HookedParameter):
    """A hooked parameter class with its own ``__setattr__``: it may bypass the counted one."""

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


@pytest.mark.parametrize("swap", [
    lambda p: setattr(p, "data", torch.randn(4, 4)),
    lambda p: p.set_(torch.randn(4, 4)),
    lambda p: torch.utils.swap_tensors(p, nn.Parameter(torch.randn(4, 4), requires_grad=False)),
])
def test_the_guard_reads_no_counted_weight_and_a_swap_under_a_hooked_subclass_is_caught(swap, observer):
    """vLLM's weights are a ``__torch_function__`` subclass: the guard reads none of them, nor any
    buffer (their moves are counted where they happen), so it never enters their hook, and a swap is
    still found at the next replay."""
    model = Model().requires_grad_(False)
    for block in model.layers:
        block.lin.weight = HookedParameter(block.lin.weight.detach())
    wrapper, checks, x = captured_model(model, observer)
    assert checks.state.guard_terms() == []
    source = checks.guard_source  # an address read only where the input is not the captured tensor
    assert source.count(".data_ptr()") == source.count(" or v.data_ptr()") == 1
    assert "_no_subclass_hooks" not in checks.guard_source
    HookedParameter.calls = 0
    assert checks.clean((x,), {}, 2)
    assert HookedParameter.calls == 0
    for _ in range(3):
        replay(wrapper, x)
    assert observer.violations == []
    with torch.no_grad():
        swap(model.layers[1].lin.weight)
    replay(wrapper, x)
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "self.layers.1.lin.weight")


def piece(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A compiled piece as torch.compile's piecewise backend calls it: its weights handed in as inputs."""
    return x @ weight


@pytest.mark.parametrize("kind", [nn.Parameter, HookedParameter])
@pytest.mark.parametrize("swap", [
    lambda p: setattr(p, "data", torch.randn(4, 4)),
    lambda p: p.set_(torch.randn(4, 4)),
    lambda p: torch.utils.swap_tensors(p, nn.Parameter(torch.randn(4, 4), requires_grad=False)),
])
def test_a_weight_handed_in_as_an_input_is_held_by_the_swap_count_and_its_swap_caught(kind, swap, observer):
    """A piece's weights are inputs: the guard takes their addresses on the count of moves' word (one
    compare for all), reads none of them, and still finds a swap at the next replay, and each replay
    after while it lasts; a swap of a parameter no graph holds costs nothing, one of a tensor another
    graph holds one closer look and no violation."""
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=NO_SAMPLES)
    wrapper = CUDAGraphWrapper(piece, runtime, name="piece")
    weight = HookedParameter(torch.randn(4, 4)) if kind is HookedParameter else nn.Parameter(
        torch.randn(4, 4), requires_grad=False)
    x = torch.ones(2, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, weight)
    checks = next(iter(wrapper.graphs.values())).checks
    assert checks.counted_inputs == {0, 1}
    # the captured tensors themselves: their identity alone, nothing read (a fresh tensor in their
    # place is still read at the captured address)
    for index in (0, 1):
        assert re.search(rf"\(\(v := args\[{index}\]\) is _\d+ or v\.data_ptr\(\) == ", checks.guard_source)
    assert "_version" not in checks.guard_source
    HookedParameter.calls = 0
    assert checks.clean((x, weight), {}, 2) and HookedParameter.calls == 0

    def replays(count: int) -> None:
        for _ in range(count):
            with set_forward_context(FULL, DESC):
                wrapper(x, weight)

    replays(3)
    assert observer.violations == [] and checks.looks == 0
    other = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    other.data = torch.zeros(4, 4)  # no graph holds it: not counted
    replays(3)
    assert observer.violations == [] and checks.looks == 0
    held_elsewhere, elsewhere = torch.zeros(3), GraphRuntime("eager", progress=False, sampling=NO_SAMPLES)
    other_graph = CUDAGraphWrapper(piece, elsewhere, name="other")
    with elsewhere.capture_phase(), set_forward_context(FULL, DESC):
        other_graph(held_elsewhere.view(1, 3), torch.ones(3, 4))
    held_elsewhere.resize_(5)  # counted: one closer look, then the guard again
    replays(3)
    assert observer.violations == [] and checks.looks == 1
    with torch.no_grad():
        swap(weight)
    replays(1)
    (event,) = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "weight")
    replays(1)  # still wrong, so still reported
    assert len(observer.violations) == 2


def test_a_parameter_class_that_may_bypass_the_count_keeps_its_address_in_the_guard(observer) -> None:
    model = Model().requires_grad_(False)
    model.layers[0].lin.weight = OwnSetattrParameter(model.layers[0].lin.weight.detach())
    wrapper, checks, x = captured_model(model, observer)
    held = {id(tensor) for tensor, _ in checks.state.guard_terms()}
    assert id(model.layers[0].lin.weight) in held and id(model.layers[1].lin.weight) not in held
    assert "with _no_subclass_hooks():" in checks.guard_source  # read with its hook off
    HookedParameter.calls = 0
    assert checks.clean((x,), {}, 2) and HookedParameter.calls == 0
    replay(wrapper, x)
    torch.Tensor.data.__set__(model.layers[0].lin.weight, torch.randn(4, 4))  # under the count
    replay(wrapper, x)
    (event,) = observer.violations
    assert event.input_name == "self.layers.0.lin.weight"


def test_a_buffer_shared_by_layers_is_read_once_and_its_swap_caught_under_every_name(observer) -> None:
    model = Model().requires_grad_(False)
    shared = model.layers[0].offset
    model.layers[1].offset = shared  # one rotary cache, held by every layer
    wrapper, checks, x = captured_model(model, observer)
    assert checks.state.guard_terms() == []  # its moves are counted: nothing read at replay
    replay(wrapper, x)
    shared.data = torch.ones(4)
    replay(wrapper, x)
    names = sorted(v.input_name for v in observer.violations)
    assert names == ["self.layers.0.offset", "self.layers.1.offset"]


MOVES = {
    ".data =": lambda t: setattr(t, "data", torch.zeros(4, 4)),
    "set_": lambda t: t.set_(torch.zeros(4, 4)),
    "resize_": lambda t: t.resize_(2, 8),
    "resize_as_": lambda t: t.resize_as_(torch.zeros(16)),
    "as_strided_": lambda t: t.as_strided_((4, 2), (4, 2)),
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),
    "swapdims_": lambda t: t.swapdims_(0, 1),
    "swapaxes_": lambda t: t.swapaxes_(0, 1),
    "squeeze_": lambda t: t.squeeze_(),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "swap_tensors": lambda t: torch.utils.swap_tensors(t, torch.zeros(4, 4)),
    "storage resize_": lambda t: t.untyped_storage().resize_(128),
    "storage of its base resized": lambda t: t._base.untyped_storage().resize_(128),
}


class Holder:
    """What watches tensors in the tests below (a graph's checks, in the product)."""


@pytest.mark.parametrize("move", MOVES)
def test_every_move_of_a_watched_tensor_is_counted_and_does_what_it_did(move) -> None:
    from capture_core.swaps import DATA_SWAPS, watch

    def fresh() -> torch.Tensor:
        return torch.zeros(8, 4)[:4] if move == "storage of its base resized" else torch.zeros(4, 4)

    holder, watched, other = Holder(), fresh(), fresh()
    watch(holder, [watched])
    before = DATA_SWAPS[0]
    MOVES[move](other)  # a tensor no graph holds (an engine's sampler re-shaping its own): not counted
    assert DATA_SWAPS[0] == before + move.startswith("storage")
    expected = fresh()
    MOVES[move](expected)
    before = DATA_SWAPS[0]
    MOVES[move](watched)
    assert DATA_SWAPS[0] == before + 1
    assert watched.shape == expected.shape and watched.stride() == expected.stride()
    del holder  # the last holder gone: the tensor is let go, and no longer counted
    before = DATA_SWAPS[0]
    watched.unsqueeze_(0)
    assert DATA_SWAPS[0] == before


def test_counting_changes_nothing_a_tensor_does_and_torch_compile_still_traces_it() -> None:
    from capture_core.swaps import DATA_SWAPS, watch

    weight = HookedParameter(torch.ones(3))
    linear = nn.Linear(2, 2)
    holder = Holder()
    watch(holder, [weight, *linear.parameters()])
    before = DATA_SWAPS[0]
    weight.note = "an attribute"  # not a swap
    weight.data = torch.full((3,), 2.0)
    assert DATA_SWAPS[0] == before + 1 and weight.note == "an attribute" and weight.tolist() == [2.0] * 3
    with pytest.raises(TypeError, match="has to be a tensor"):
        weight.data = 5
    with pytest.raises(TypeError, match="must be Tensor"):
        weight.resize_as_(5)  # the error it raised before, and nothing counted
    assert DATA_SWAPS[0] == before + 1
    linear.to(torch.float64)  # nn.Module._apply swaps each parameter's data
    assert DATA_SWAPS[0] == before + 3 and linear.weight.dtype == torch.float64

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.plain = nn.Parameter(torch.ones(3))
            self.hooked = PassThroughParameter(torch.full((3,), 3.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = (x * 1).unsqueeze_(0).t_()  # the counting methods, on a tensor the trace makes
            return y.squeeze_(1) * self.plain.data + self.hooked.data * self.hooked

    reads = Reads()
    watch(holder, list(reads.parameters()))
    compiled = torch.compile(reads, backend="eager", fullgraph=True)
    assert compiled(torch.ones(3)).tolist() == [10.0] * 3


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
