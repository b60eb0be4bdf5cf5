"""Address checks: every tensor input, positional and keyword, by name; always-on and debug modes."""

from __future__ import annotations

import pytest
import torch

from capture_core.checks import AddressCheckMode, ParameterNames, effective_check_mode
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import AddressDriftError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.inputs import InputLayout
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
DESC = BatchDescriptor(8, 8, True)


def decode(input_ids: torch.Tensor, positions: torch.Tensor, *, kv_cache: torch.Tensor) -> torch.Tensor:
    """A stand-in model step: reads every input, so a stale one changes the answer."""
    return input_ids * 100 + positions + kv_cache.sum()


def captured(runtime: GraphRuntime) -> tuple[CUDAGraphWrapper, dict[str, torch.Tensor]]:
    inputs = {"input_ids": torch.arange(8), "positions": torch.zeros(8, dtype=torch.long),
              "kv_cache": torch.zeros(2, 3, dtype=torch.long)}
    wrapper = CUDAGraphWrapper(decode, runtime, name="decode")
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(inputs["input_ids"], inputs["positions"], kv_cache=inputs["kv_cache"])
    return wrapper, inputs


def replay(wrapper: CUDAGraphWrapper, input_ids, positions, kv_cache) -> torch.Tensor:
    with set_forward_context(FULL, DESC):
        return wrapper(input_ids, positions, kv_cache=kv_cache)


@pytest.mark.parametrize("moved", ["input_ids", "kv_cache"], ids=["positional", "keyword"])
def test_always_on_emits_a_drift_event_and_keeps_replaying(observer, moved):
    runtime = GraphRuntime("eager", observer=observer, address_check="always_on", progress=False)
    wrapper, inputs = captured(runtime)
    fresh = dict(inputs)
    fresh[moved] = inputs[moved].clone() + 1  # new values at a new address
    out = replay(wrapper, fresh["input_ids"], fresh["positions"], fresh["kv_cache"])
    # The replay went on, on the captured memory: the new values were never seen.
    assert torch.equal(out, decode(inputs["input_ids"], inputs["positions"], kv_cache=inputs["kv_cache"]))
    (event,) = observer.violations
    assert event.kind is ViolationKind.ADDRESS_DRIFT
    assert event.input_name == moved and event.wrapper == "decode"
    assert event.expected_address == inputs[moved].data_ptr()
    assert event.actual_address == fresh[moved].data_ptr()
    assert event.descriptor == DESC and event.mode is FULL
    assert "test_checks.py" in event.stack and "wrapper.py" not in event.stack
    assert not event.injected
    assert len(observer.replays) == 1


@pytest.mark.parametrize("moved", ["positions", "kv_cache"], ids=["positional", "keyword"])
def test_debug_raises_naming_input_descriptor_and_both_addresses(observer, moved):
    runtime = GraphRuntime("eager", observer=observer, address_check="debug", progress=False)
    wrapper, inputs = captured(runtime)
    fresh = dict(inputs)
    fresh[moved] = inputs[moved].clone()
    with pytest.raises(AddressDriftError) as raised:
        replay(wrapper, fresh["input_ids"], fresh["positions"], fresh["kv_cache"])
    message = str(raised.value)
    assert repr(moved) in message and DESC.key in message and "'decode'" in message
    assert f"{inputs[moved].data_ptr():#x}" in message and f"{fresh[moved].data_ptr():#x}" in message
    assert "copy_()" in message
    assert [v.input_name for v in observer.violations] == [moved]  # recorded before raising
    assert observer.replays == []


def test_every_drifted_input_is_reported(runtime, observer):
    wrapper, inputs = captured(runtime)
    replay(wrapper, inputs["input_ids"].clone(), inputs["positions"], inputs["kv_cache"].clone())
    assert [v.input_name for v in observer.violations] == ["input_ids", "kv_cache"]


def test_copying_into_the_captured_inputs_is_no_drift(runtime, observer):
    wrapper, inputs = captured(runtime)
    inputs["input_ids"].copy_(torch.arange(8) + 5)
    out = replay(wrapper, inputs["input_ids"], inputs["positions"], inputs["kv_cache"])
    assert torch.equal(out, (torch.arange(8) + 5) * 100)
    assert observer.violations == []


def test_off_mode_does_not_look(observer):
    runtime = GraphRuntime("eager", observer=observer, address_check=AddressCheckMode.OFF, progress=False)
    wrapper, inputs = captured(runtime)
    replay(wrapper, inputs["input_ids"].clone(), inputs["positions"], inputs["kv_cache"])
    assert observer.violations == [] and len(observer.replays) == 1


def test_a_missing_keyword_input_is_drift_to_nowhere(runtime, observer):
    wrapper, inputs = captured(runtime)
    with set_forward_context(FULL, DESC):
        out = wrapper(inputs["input_ids"], inputs["positions"])  # a graph still reads the captured one
    assert torch.equal(out, inputs["input_ids"] * 100)
    (event,) = observer.violations
    assert event.input_name == "kv_cache" and event.actual_address is None
    assert "missing or no longer a tensor" in event.message


def test_the_debug_environment_variable_forces_debug(monkeypatch, observer):
    monkeypatch.setenv("GRAPH_INSPECTOR_DEBUG", "1")
    assert effective_check_mode("off") is AddressCheckMode.DEBUG
    runtime = GraphRuntime("eager", observer=observer, address_check="always_on", progress=False)
    assert runtime.address_check is AddressCheckMode.DEBUG
    wrapper, inputs = captured(runtime)
    with pytest.raises(AddressDriftError):
        replay(wrapper, inputs["input_ids"], inputs["positions"].clone(), inputs["kv_cache"])


def test_mode_names_parse_and_bad_ones_list_the_choices():
    assert AddressCheckMode.parse("Always-On") is AddressCheckMode.ALWAYS_ON
    with pytest.raises(ValueError, match="off, always_on, debug"):
        AddressCheckMode.parse("sometimes")


def test_inputs_are_named_by_signature_by_position_and_inside_lists():
    def step(input_ids, positions, *rest, kv_caches=None):
        return input_ids

    names = ParameterNames.of(step)
    t = [torch.zeros(1) for _ in range(6)]
    layout = InputLayout.record(names, (t[0], 7, t[1], "x"), {"kv_caches": (t[2], None, t[3])})
    assert layout.names == ("input_ids", "rest[0]", "kv_caches[0]", "kv_caches[2]")
    assert layout.addresses == (t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr())
    unnamed = InputLayout.record(ParameterNames(), (1, 2, 3, t[4]), {})
    assert unnamed.names == ("args[3]",)


def test_a_module_is_named_by_its_forward():
    class Model(torch.nn.Module):
        def forward(self, input_ids, positions, slot_ids, kv_cache):
            return input_ids

    assert ParameterNames.of(Model()).positional == ("input_ids", "positions", "slot_ids", "kv_cache")


def test_a_drifted_list_item_is_named_with_its_index(runtime, observer):
    def layers(hidden, kv_caches):
        return hidden + sum(kv_caches)

    caches = [torch.zeros(2) for _ in range(4)]
    hidden = torch.ones(2)
    wrapper = CUDAGraphWrapper(layers, runtime)
    with runtime.capture_phase(), set_forward_context(FULL, DESC):
        wrapper(hidden, caches)
    moved = [*caches[:3], caches[3].clone()]
    with set_forward_context(FULL, DESC):
        wrapper(hidden, moved)
    (event,) = observer.violations
    assert event.input_name == "kv_caches[3]"
    assert event.expected_address == caches[3].data_ptr() and event.actual_address == moved[3].data_ptr()


def test_find_changes_covers_bare_nested_and_keyword_inputs():
    t = [torch.zeros(1) for _ in range(5)]
    layout = InputLayout.record(ParameterNames(("a", "b")), (t[0], [t[1], t[2]]), {"c": t[3], "d": (t[4],)})
    assert layout.find_changes((t[0], [t[1], t[2]]), {"c": t[3], "d": (t[4],)}) == []
    moved = [x.clone() for x in t]
    for index, call in enumerate(
        [
            ((moved[0], [t[1], t[2]]), {"c": t[3], "d": (t[4],)}),
            ((t[0], [t[1], moved[2]]), {"c": t[3], "d": (t[4],)}),
            ((t[0], [t[1], t[2]]), {"c": moved[3], "d": (t[4],)}),
            ((t[0], [t[1], t[2]]), {"c": t[3], "d": (moved[4],)}),
        ]
    ):
        (drift,) = layout.find_changes(*call)
        name = ["a", "b[1]", "c", "d[0]"][index]
        number = [0, 2, 3, 4][index]
        expected = (name, t[number].data_ptr(), moved[number].data_ptr())
        assert (drift.name, drift.expected_address, drift.actual_address) == expected
        assert drift.kind is ViolationKind.ADDRESS_DRIFT
