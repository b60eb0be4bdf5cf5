"""Mixed prefill/decode batches: flattened requests give the logits of running them one by one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_core.reference import AttentionMetadata, ModelConfig, ReferenceDecoder, flatten_requests

CONFIG = ModelConfig.tiny(max_num_seqs=6, max_seq_len=32)


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(CONFIG, seed=3)


def _prefilled_cache(model: ReferenceDecoder, contexts: list[list[int]], slots: list[int]) -> torch.Tensor:
    """A cache holding each request's earlier tokens, written one request at a time."""
    kv = model.new_kv_cache()
    for tokens, slot in zip(contexts, slots, strict=True):
        if tokens:
            batch = flatten_requests([tokens], [0], [slot])
            model(batch.input_ids, batch.positions, batch.slot_ids, kv)
    return kv


def _check_mixed_equals_one_by_one(
    model: ReferenceDecoder, contexts: list[list[int]], new_tokens: list[list[int]], pad_to: int | None
) -> None:
    slots = list(range(len(new_tokens)))
    base = _prefilled_cache(model, contexts, slots)
    context_lens = [len(c) for c in contexts]

    one_by_one_kv = base.clone()
    one_by_one = []
    for tokens, context, slot in zip(new_tokens, context_lens, slots, strict=True):
        alone = flatten_requests([tokens], [context], [slot])
        one_by_one.append(model(alone.input_ids, alone.positions, alone.slot_ids, one_by_one_kv))
    expected = torch.cat(one_by_one)

    batch = flatten_requests(new_tokens, context_lens, slots, pad_to=pad_to, padding_slot=CONFIG.padding_slot)
    real = batch.attn_metadata.num_actual_tokens
    per_request_kv, gathered_kv = base.clone(), base.clone()
    per_request = model(batch.input_ids, batch.positions, batch.slot_ids, per_request_kv, batch.attn_metadata)
    gathered = model(batch.input_ids, batch.positions, batch.slot_ids, gathered_kv)

    torch.testing.assert_close(per_request[:real], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gathered[:real], expected, rtol=1e-5, atol=1e-5)
    real_slots = slice(0, CONFIG.padding_slot)
    torch.testing.assert_close(per_request_kv[:, :, real_slots], one_by_one_kv[:, :, real_slots])
    torch.testing.assert_close(gathered_kv[:, :, real_slots], one_by_one_kv[:, :, real_slots])
    if pad_to is not None and pad_to > real:
        assert not per_request[real:].isnan().any()


def test_a_mix_of_decodes_prefill_chunks_and_a_fresh_prompt(model: ReferenceDecoder) -> None:
    contexts = [[1, 2, 3, 4], [5, 6], [], [7, 8, 9]]
    new_tokens = [[10], [11, 12, 13], [14, 15, 16, 17, 18], [19]]
    _check_mixed_equals_one_by_one(model, contexts, new_tokens, pad_to=16)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(
        st.tuples(
            st.lists(st.integers(0, CONFIG.vocab_size - 1), max_size=8),
            st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=CONFIG.max_num_seqs,
    ),
    extra_padding=st.none() | st.integers(0, 5),
)
def test_any_mixed_batch_equals_its_requests_run_one_by_one(model, requests, extra_padding) -> None:
    contexts = [c for c, _ in requests]
    new_tokens = [n for _, n in requests]
    pad_to = None if extra_padding is None else sum(map(len, new_tokens)) + extra_padding
    _check_mixed_equals_one_by_one(model, contexts, new_tokens, pad_to)


def test_metadata_describes_offsets_lengths_and_uniform_decode() -> None:
    meta = AttentionMetadata.build(query_lens=[1, 3, 1], context_lens=[4, 0, 9], slot_ids=[2, 0, 5])
    assert meta.query_start_loc == (0, 1, 4, 5)
    assert meta.seq_lens == (5, 3, 10)
    assert meta.num_actual_tokens == 5
    assert meta.query_lens == (1, 3, 1)
    assert not meta.is_uniform_decode
    assert AttentionMetadata.build([1, 1], [3, 4], [0, 1]).is_uniform_decode
    assert meta.prefill_requests == (1,)
    decodes = meta.decode_tensors(torch.device("cpu"))
    assert decodes.rows.tolist() == [0, 4] and decodes.slots.tolist() == [2, 5]
    assert decodes.seq_lens.tolist() == [5, 10] and decodes.max_seq_len == 10
    assert meta.decode_tensors(torch.device("cpu")) is decodes  # built once per step and device
    assert AttentionMetadata.build([2, 3], [0, 0], [0, 1]).decode_tensors(torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query_start_loc": (0, 2), "seq_lens": (2, 3), "slot_ids": (0, 1)}, "num_reqs \\+ 1 query offsets"),
        ({"query_start_loc": (1, 2), "seq_lens": (1,), "slot_ids": (0,)}, "must start at 0"),
        ({"query_start_loc": (0, 0), "seq_lens": (1,), "slot_ids": (0,)}, "query length 0"),
        ({"query_start_loc": (0, 3), "seq_lens": (2,), "slot_ids": (0,)}, "shorter than its query length"),
        ({"query_start_loc": (0, 1, 2), "seq_lens": (1, 1), "slot_ids": (3, 3)}, "its own KV slot"),
    ],
)
def test_inconsistent_metadata_is_rejected_with_a_clear_message(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata(**kwargs)
