"""Stale static inputs: a declared per-step input nobody wrote since the previous replay."""

from __future__ import annotations

import pytest
import torch

from capture_core.checks import GraphCacheError, StaleInputError
from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.stale import sentinel_of
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL


def lookup(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.clamp(0, table.shape[0] - 1)]


def make(observer, mode: str = "always_on") -> tuple[CUDAGraphWrapper, torch.Tensor, torch.Tensor]:
    runtime = GraphRuntime("eager", observer=observer, progress=False, address_check=mode)
    wrapper = CUDAGraphWrapper(lookup, runtime, name="lookup", per_step_inputs=["ids"])
    return wrapper, torch.zeros(8, dtype=torch.long), torch.arange(10.0)


def call(wrapper: CUDAGraphWrapper, ids: torch.Tensor, table: torch.Tensor, size: int = 8) -> torch.Tensor:
    with set_forward_context(FULL, BatchDescriptor(size)):
        return wrapper(ids[:size], table)


def test_a_replay_without_a_write_since_the_previous_one_is_stale(observer) -> None:
    wrapper, ids, table = make(observer)
    with wrapper.runtime.capture_phase():
        call(wrapper, ids, table)
    ids.copy_(torch.arange(8))
    call(wrapper, ids, table)
    assert observer.violations == []
    out = call(wrapper, ids, table)  # forgot this step's copy_: the previous step's ids again
    (event,) = observer.violations
    assert (event.kind, event.input_name, event.wrapper) == (ViolationKind.STALE_INPUT, "ids", "lookup")
    assert "was not written since the previous replay (its version counter did not move)" in event.message
    assert torch.equal(out, table[:8])  # reported, and the replay went on
    ids[:3] = 1  # any in-place write counts, on any view of the buffer
    call(wrapper, ids, table)
    assert len(observer.violations) == 1


def test_graphs_of_other_sizes_share_the_buffer_and_see_each_other_s_writes(observer) -> None:
    wrapper, ids, table = make(observer)
    with wrapper.runtime.capture_phase():
        call(wrapper, ids, table, 8)
        call(wrapper, ids, table, 4)
    ids.copy_(torch.arange(8))
    call(wrapper, ids, table, 8)  # written, then replayed at 8
    call(wrapper, ids, table, 4)  # not written again: stale, though the 4-token graph never replayed
    assert [(v.input_name, v.descriptor.num_tokens) for v in observer.violations] == [("ids", 4)]


def test_only_declared_inputs_are_checked_and_an_unknown_name_is_refused(observer) -> None:
    wrapper, ids, table = make(observer)
    with wrapper.runtime.capture_phase():
        call(wrapper, ids, table)
    ids.fill_(2)
    call(wrapper, ids, table)  # ``table`` is not written between replays: it is not per-step
    assert observer.violations == []
    runtime = GraphRuntime("eager", progress=False)
    wrong = CUDAGraphWrapper(lookup, runtime, name="wrong", per_step_inputs=["token_ids"])
    refused = pytest.raises(GraphCacheError, match=r"'token_ids' names no tensor input.*ids, table")
    with runtime.capture_phase(), refused:
        call(wrong, ids, table)


def test_debug_mode_poisons_the_inputs_after_each_replay_and_finds_a_sentinel_left(observer) -> None:
    wrapper, ids, table = make(observer, mode="debug")
    with wrapper.runtime.capture_phase():
        call(wrapper, ids, table)
    ids.copy_(torch.arange(8))
    call(wrapper, ids, table)
    assert bool((ids == sentinel_of(torch.long)).all())  # left holding the sentinel for the next step
    ids[:5] = 3  # a partial write: three rows still hold the sentinel
    with pytest.raises(StaleInputError, match=r"3 of 8 elements still hold the debug sentinel"):
        call(wrapper, ids, table)
    assert observer.violations[0].kind is ViolationKind.STALE_INPUT


def test_under_inference_mode_the_capture_record_says_so_and_debug_mode_still_finds_it(observer) -> None:
    with torch.inference_mode():
        wrapper, ids, table = make(observer)  # inference tensors: no version counter
        with wrapper.runtime.capture_phase():
            call(wrapper, ids, table)
        call(wrapper, ids, table)
        call(wrapper, ids, table)
    [capture] = observer.captures
    assert capture.unchecked_inputs == (
        "ids (an inference tensor, without a version counter: found stale only in debug mode)",
    )
    assert observer.violations == []  # no false alarm, and no counter to tell a stale step
    with torch.inference_mode():
        wrapper, ids, table = make(observer, mode="debug")
        with wrapper.runtime.capture_phase():
            call(wrapper, ids, table)
        ids.copy_(torch.arange(8))
        call(wrapper, ids, table)
        with pytest.raises(StaleInputError, match="'ids'"):
            call(wrapper, ids, table)


def test_a_dtype_without_a_sentinel_is_named_in_the_capture_record(observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    wrapper = CUDAGraphWrapper(lambda mask: mask.float(), runtime, name="mask", per_step_inputs=["mask"])
    with runtime.capture_phase(), set_forward_context(FULL, BatchDescriptor(4)):
        wrapper(torch.zeros(4, dtype=torch.bool))
    [capture] = observer.captures
    assert capture.unchecked_inputs == ("mask (torch.bool has no sentinel value: not checked in debug mode)",)
