"""Property tests: padding to capture sizes, and dispatch across every mode (hypothesis)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from capture_core.dispatcher import CUDAGraphDispatcher
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason, SizeTable

size_lists = st.lists(st.integers(1, 600), min_size=1, max_size=40, unique=True).map(sorted)
token_counts = st.integers(1, 700)
modes = st.sampled_from(list(CUDAGraphMode))


@given(size_lists, token_counts)
def test_padding_lands_on_the_smallest_capture_size_that_holds_the_batch(sizes, num_tokens):
    table = SizeTable(sizes)
    placed = table.place(num_tokens)
    if num_tokens > sizes[-1]:
        assert placed.captured_size is None
        assert placed.eager_reason is EagerReason.ABOVE_MAX_CAPTURE_SIZE
        return
    padded = placed.captured_size
    assert padded in sizes and padded >= num_tokens
    assert not [s for s in sizes if num_tokens <= s < padded]
    assert placed.eager_reason is None and placed.padding_tokens == padded - num_tokens


@given(modes, size_lists, token_counts, st.booleans(), st.integers(1, 4), st.integers(0, 2), st.data())
def test_dispatch_routes_every_batch_to_an_existing_graph_or_eager_with_the_reason(
    mode, sizes, num_tokens, uniform, query_len, max_loras, data
):
    dispatcher = CUDAGraphDispatcher(mode, sizes, uniform_decode_query_len=query_len, max_loras=max_loras)
    loras = data.draw(st.integers(0, max_loras), label="active loras")
    routed = dispatcher.route(num_tokens, uniform, has_lora=loras > 0, num_active_loras=loras)
    assert routed.mode in mode.valid_runtime_modes()
    assert routed.num_real_tokens == num_tokens
    assert routed.descriptor.num_active_loras == loras
    if mode is CUDAGraphMode.NONE:
        assert (routed.mode, routed.eager_reason) == (CUDAGraphMode.NONE, EagerReason.MODE_NONE)
    elif num_tokens > sizes[-1]:
        assert (routed.mode, routed.eager_reason) == (CUDAGraphMode.NONE, EagerReason.ABOVE_MAX_CAPTURE_SIZE)
        assert routed.descriptor.num_tokens == num_tokens
    elif routed.mode is CUDAGraphMode.NONE:
        # Only a batch with no graph of its kind: a mixed (or unevenly sized) batch, decode-only config.
        assert mode.mixed_mode() is CUDAGraphMode.NONE
        assert routed.eager_reason is EagerReason.NO_GRAPH_FOR_MIXED_BATCH
    else:
        padded = SizeTable(sizes).pad(num_tokens)
        assert routed.eager_reason is None
        assert routed.descriptor in dispatcher.keys[routed.mode]
        assert routed.descriptor.num_tokens == padded and routed.padding_tokens == padded - num_tokens
        if routed.descriptor.uniform:
            assert uniform and mode.separate_routine() and routed.mode is CUDAGraphMode.FULL
            assert routed.descriptor.num_reqs == padded // query_len
        else:
            assert routed.mode is mode.mixed_mode() and routed.descriptor.num_reqs is None


@given(modes, size_lists, st.integers(0, 2))
def test_the_capture_list_holds_every_key_once_largest_first(mode, sizes, max_loras):
    dispatcher = CUDAGraphDispatcher(mode, sizes, max_loras=max_loras)
    listed = dispatcher.capture_list()
    expected = {(m, d) for m, descriptors in dispatcher.keys.items() for d in descriptors}
    assert len(listed) == len(expected) and set(listed) == expected
    tokens = [d.num_tokens for _, d in listed]
    assert tokens == sorted(tokens, reverse=True)
