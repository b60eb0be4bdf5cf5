"""Static buffers: allocated once at the largest size; prefix views; copy_ in, padding filled."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from capture_core.buffers import BufferSpec, StaticBuffers


def make() -> StaticBuffers:
    return StaticBuffers(
        8,
        {
            "input_ids": BufferSpec(torch.long),
            "slot_ids": BufferSpec(torch.long, pad_value=16),
            "hidden": BufferSpec(torch.float32, pad_value=0.5, trailing_shape=(3,)),
        },
    )


def test_views_are_prefixes_of_one_allocation():
    buffers = make()
    full = buffers.tensors["input_ids"]
    for n in (1, 5, 8):
        view = buffers.views(n)["input_ids"]
        assert view.shape == (n,) and view.data_ptr() == full.data_ptr()
    assert buffers.views(4)["hidden"].shape == (4, 3)
    assert buffers.views(4) is buffers.views(4)  # cached for the step path


def test_load_copies_real_values_and_pads_the_rest():
    buffers = make()
    address = buffers.tensors["slot_ids"].data_ptr()
    views = buffers.load(4, input_ids=torch.tensor([7, 8, 9]), slot_ids=[3, 1, 2], hidden=torch.ones(2, 3))
    assert views["input_ids"].tolist() == [7, 8, 9, 0]
    assert views["slot_ids"].tolist() == [3, 1, 2, 16]
    assert views["hidden"].tolist() == [[1.0] * 3, [1.0] * 3, [0.5] * 3, [0.5] * 3]
    assert buffers.tensors["slot_ids"].data_ptr() == address  # copied in, never reallocated


def test_reset_fills_every_buffer_with_its_pad_value():
    buffers = make()
    buffers.load(8, input_ids=torch.arange(8))
    buffers.reset()
    assert buffers.tensors["input_ids"].tolist() == [0] * 8
    assert buffers.tensors["slot_ids"].tolist() == [16] * 8


def test_mistakes_get_clear_errors():
    buffers = make()
    with pytest.raises(ValueError, match=r"1\.\.8"):
        buffers.views(9)
    with pytest.raises(ValueError, match="more than the padded size"):
        buffers.load(2, input_ids=torch.arange(3))
    with pytest.raises(ValueError, match="no static buffer named 'positions'"):
        buffers.load(2, positions=torch.arange(2))
    with pytest.raises(ValueError, match="positive"):
        StaticBuffers(0, {"x": BufferSpec(torch.long)})


@given(st.integers(1, 16), st.data())
def test_load_always_leaves_real_values_then_padding(max_tokens, data):
    padded = data.draw(st.integers(1, max_tokens), label="padded size")
    real = data.draw(st.integers(0, padded), label="real rows")
    values = data.draw(st.lists(st.integers(-50, 50), min_size=real, max_size=real), label="values")
    buffers = StaticBuffers(max_tokens, {"ids": BufferSpec(torch.long, pad_value=-1)})
    buffers.load(max_tokens, ids=torch.arange(max_tokens) + 100)  # a previous, larger step
    view = buffers.load(padded, ids=torch.tensor(values, dtype=torch.long))["ids"]
    assert view.tolist() == values + [-1] * (padded - real)
    assert view.data_ptr() == buffers.tensors["ids"].data_ptr()


def test_after_a_relocation_the_views_are_the_very_ones_graphs_captured():
    buffers = StaticBuffers(8, {"input_ids": BufferSpec(torch.long)})
    captured = buffers.views(4)["input_ids"]
    with buffers.relocated("input_ids") as fresh:
        assert buffers.views(4)["input_ids"].data_ptr() == fresh.data_ptr() != captured.data_ptr()
    assert buffers.views(4)["input_ids"] is captured  # the replay guard's cheap identity test holds
