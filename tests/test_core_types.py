"""The small types every other part keys on: modes, descriptors, capture sizes."""

from __future__ import annotations

import dataclasses

import pytest

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import (
    EagerReason,
    SizeTable,
    capture_sizes,
    power_of_two_sizes,
    validate_sizes,
    vllm_default_sizes,
)

M = CUDAGraphMode


@pytest.mark.parametrize(
    ("mode", "decode", "mixed", "full", "piecewise", "separate"),
    [
        (M.NONE, M.NONE, M.NONE, False, False, False),
        (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE, False, True, False),
        (M.FULL, M.FULL, M.FULL, True, False, False),
        (M.FULL_DECODE_ONLY, M.FULL, M.NONE, True, False, True),
        (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE, True, True, True),
    ],
)
def test_mode_halves_and_helpers(mode, decode, mixed, full, piecewise, separate):
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.has_full_cudagraphs() is full
    assert mode.has_piecewise_cudagraphs() is piecewise
    assert mode.separate_routine() is separate
    assert mode.valid_runtime_modes() == {M.NONE, decode, mixed}
    assert all(m.is_runtime_mode() for m in mode.valid_runtime_modes())


def test_mode_parse_is_case_insensitive_and_names_the_choices():
    assert M.parse("full_and_piecewise") is M.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="choose one of NONE, PIECEWISE, FULL"):
        M.parse("fast")


def test_descriptor_is_frozen_hashable_and_validated():
    desc = BatchDescriptor(8, 8, uniform=True)
    assert {desc: 1}[BatchDescriptor(8, 8, True)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.num_tokens = 4  # type: ignore[misc]
    assert desc.relax_for_mixed_batch() == BatchDescriptor(8)
    assert desc.key == "tokens=8,reqs=8,uniform=1"
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        BatchDescriptor(0)
    with pytest.raises(ValueError, match="needs has_lora"):
        BatchDescriptor(4, num_active_loras=2)


def test_size_policies():
    assert power_of_two_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert power_of_two_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = vllm_default_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert 248 in sizes and 264 not in sizes and 272 in sizes
    assert capture_sizes("explicit", sizes=[1, 3, 9]) == [1, 3, 9]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([], "must not be empty"),
        ([4, 2, 8], "sorted ascending"),
        ([1, 2, 2, 4], r"must not repeat: \[2\]"),
        ([0, 1, 2], "must be positive"),
        ([-4, 1], "must be positive"),
        ([1, 2.5], "must be integers"),
    ],
)
def test_bad_size_lists_say_what_is_wrong(sizes, message):
    with pytest.raises(ValueError, match=message):
        validate_sizes(sizes)


def test_size_table_pads_to_the_smallest_size_that_holds_the_batch():
    table = SizeTable([1, 2, 4, 8])
    assert [table.pad(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    above = table.place(9)
    assert above.captured_size is None
    assert above.eager_reason is EagerReason.ABOVE_MAX_CAPTURE_SIZE
    assert table.place(5).padding_tokens == 3
    with pytest.raises(ValueError, match="num_real_tokens must be positive"):
        table.pad(0)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown capture-size policy 'fib'"):
        capture_sizes("fib")
    with pytest.raises(ValueError, match="max_size must be a positive integer"):
        power_of_two_sizes(0)
