"""Host values a graph bakes in at capture: a non-tensor argument or a module attribute that differs
at replay is a ``baked_value_changed``, found at that replay with no sampled one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from capture_core.canary import Sampling
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import BakedValueChangedError, GraphCacheError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(4)
NEVER = Sampling(first=0, every=0)
"""No sampled replay: what is found is found by the replay guard."""
BIAS = torch.zeros(4)


class Sampler(nn.Module):
    """Logits scaled by a temperature argument and by a LoRA-style scaling the adapter switch sets;
    a flag picks a branch on the host; ``inner.gain`` is an attribute of a module inside."""

    def __init__(self) -> None:
        super().__init__()
        self.scaling = 1.0
        self.inner = nn.Linear(4, 4)
        self.inner.gain = 1.0

    def forward(self, x: torch.Tensor, temperature: float = 1.0, greedy: bool = False, extras=None):
        out = self.inner(x) * self.scaling * self.inner.gain / temperature
        return out.argmax(-1).float() if greedy else out


def graph(observer, mode: str = "always_on", sampling: Sampling = NEVER, **options):
    runtime = GraphRuntime("eager", observer=observer, progress=False, address_check=mode, sampling=sampling)
    model = Sampler().requires_grad_(False).eval()
    wrapper = CUDAGraphWrapper(model, runtime, name="sampler", **options)
    x = torch.ones(4, 4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, 0.7, extras={"top_k": 5, "bias": BIAS})
    return model, wrapper, x


def replay(wrapper, x, *args, **kwargs):
    kwargs.setdefault("extras", {"top_k": 5, "bias": BIAS})
    with set_forward_context(FULL, DESC):
        return wrapper(x, *args, **kwargs)


def found(observer) -> list[tuple[ViolationKind, str | None]]:
    return [(v.kind, v.input_name) for v in observer.violations]


def test_a_python_argument_other_than_at_capture_is_found_at_that_replay(observer) -> None:
    _, wrapper, x = graph(observer)
    for _ in range(3):
        replay(wrapper, x, 0.7)  # the same temperature, another float object
    assert observer.violations == []
    replay(wrapper, x, 1.3)
    [event] = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.BAKED_VALUE_CHANGED, "temperature")
    assert "argument 'temperature' was 0.7 at capture and is 1.3 now" in event.message
    assert "unread=" in event.message  # the fix names the way out for a value the graph does not read
    replay(wrapper, x, 1.3)
    assert len(observer.violations) == 2  # every faulty replay


@pytest.mark.parametrize(("call", "name", "values"), [
    (lambda w, x: replay(w, x, 0.7, True), "greedy", "False at capture and is True"),  # a host branch
    (lambda w, x: replay(w, x, 0.7, greedy=True), "greedy", "False at capture and is True"),
    (lambda w, x: replay(w, x, 0.7, extras={"top_k": 50, "bias": BIAS}), "extras['top_k']", "5 at"),
])
def test_a_flag_a_default_or_a_value_inside_a_container_is_compared_too(call, name, values, observer) -> None:
    _, wrapper, x = graph(observer)
    replay(wrapper, x, 0.7, False)  # the default passed as such: the same value
    assert observer.violations == []
    call(wrapper, x)
    [event] = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.BAKED_VALUE_CHANGED, name)
    assert values in event.message


def test_the_wrapped_module_s_attributes_are_compared_at_every_replay(observer) -> None:
    model, wrapper, x = graph(observer)
    model.scaling = 0.5  # an adapter switch
    replay(wrapper, x, 0.7)
    model.scaling = 1.0
    model.train()  # a host branch (dropout, batch norm) the graph took in eval mode
    replay(wrapper, x, 0.7)
    baked = ViolationKind.BAKED_VALUE_CHANGED
    assert found(observer) == [(baked, "self.scaling"), (baked, "self.training")]
    assert "attribute 'self.training' was False at capture and is True now" in observer.violations[1].message


def test_an_inner_module_s_attribute_is_compared_on_sampled_and_debug_replays(observer) -> None:
    model, wrapper, x = graph(observer, sampling=Sampling(first=0, every=3))
    model.inner.gain = 2.0
    for _ in range(3):
        replay(wrapper, x, 0.7)
    assert found(observer) == [(ViolationKind.BAKED_VALUE_CHANGED, "self.inner.gain")]  # the third, sampled
    model, wrapper, x = graph(observer, mode="debug")
    model.inner.gain = 2.0
    with pytest.raises(BakedValueChangedError, match=r"'self\.inner\.gain' was 1\.0 at capture and is 2\.0"):
        replay(wrapper, x, 0.7)


def test_debug_mode_raises_at_the_faulty_replay(observer) -> None:
    _, wrapper, x = graph(observer, mode="debug")
    replay(wrapper, x, 0.7)
    with pytest.raises(BakedValueChangedError, match=r"'temperature' was 0\.7 at capture and is 0\.9"):
        replay(wrapper, x, 0.9)


def test_a_value_the_graph_does_not_read_is_declared_and_a_wrong_name_is_refused(observer) -> None:
    model, wrapper, x = graph(observer, unread=["extras", "self.scaling"])
    model.scaling = 3.0
    replay(wrapper, x, 0.7, extras={"top_k": 1, "bias": BIAS})
    assert observer.violations == []
    with pytest.raises(GraphCacheError, match=r"unread names 'temprature', 'self\.scale' pick no"):
        graph(observer, unread=["temprature", "self.scale"])


@dataclass
class Metadata:
    """Attention metadata: host integers that change every step, read by eager code, not the graph."""

    seq_lens: torch.Tensor
    max_seq_len: int


def test_fields_of_objects_are_not_compared_and_nan_equals_nan(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=NEVER)
    wrapper = CUDAGraphWrapper(lambda x, meta, eps: x * 2, runtime, name="step")
    x, lens = torch.ones(4), torch.ones(4, dtype=torch.long)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, Metadata(lens, 7), float("nan"))
    for step in range(3):
        with set_forward_context(FULL, DESC):
            wrapper(x, Metadata(lens, 8 + step), float("nan"))
    assert observer.violations == []


def test_a_tensor_where_the_capture_had_none_is_a_tensor_the_graph_never_reads(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False, sampling=NEVER)
    wrapper = CUDAGraphWrapper(lambda x, bias=None: x if bias is None else x + bias, runtime, name="shift")
    x = torch.ones(4)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(x, None)
    with set_forward_context(FULL, DESC):
        wrapper(x, torch.ones(4))
    [event] = observer.violations
    assert (event.kind, event.input_name) == (ViolationKind.ADDRESS_DRIFT, "bias")
    assert "was no tensor input at capture" in event.message
