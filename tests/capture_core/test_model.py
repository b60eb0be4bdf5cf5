"""The reference decoder: shapes, determinism, causal attention over the KV cache, padding."""

from __future__ import annotations

import pytest
import torch

from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(ModelConfig.tiny(max_num_seqs=8, max_seq_len=64), seed=0)


def _run(model: ReferenceDecoder, kv: torch.Tensor, tokens, contexts, slots, **kw) -> torch.Tensor:
    batch = flatten_requests(tokens, contexts, slots, **kw)
    return model(batch.input_ids, batch.positions, batch.slot_ids, kv)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 60, "num_heads": 8}, "not divisible by num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "not a multiple of num_kv_heads"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}, "head_dim 3 must be even"),
    ],
)
def test_config_rejects_impossible_shapes_with_a_clear_message(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**overrides)


def test_named_sizes_have_the_promised_parameter_counts() -> None:
    def count(config: ModelConfig) -> int:
        return ReferenceDecoder(config).param_count()

    assert count(ModelConfig.tiny(device="meta")) < 1_000_000
    assert 50e6 <= count(ModelConfig.small(device="meta")) <= 70e6
    assert 1.1e9 <= count(ModelConfig.large(device="meta")) <= 1.5e9


def test_weights_are_deterministic_for_a_seed_and_differ_between_seeds() -> None:
    config = ModelConfig.tiny(max_num_seqs=2, max_seq_len=8)
    a, b, c = (ReferenceDecoder(config, seed=s) for s in (7, 7, 8))
    params = zip(a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True)
    for (name, pa), (_, pb), (_, pc) in params:
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_kv_cache_has_a_spare_padding_slot(model: ReferenceDecoder) -> None:
    c = model.config
    kv = model.new_kv_cache()
    assert kv.shape == (c.num_layers, 2, c.max_num_seqs + 1, c.num_kv_heads, c.max_seq_len, c.head_dim)
    assert c.padding_slot == c.max_num_seqs
    assert not kv.any()


def test_logits_are_finite_with_the_right_shape(model: ReferenceDecoder) -> None:
    kv = model.new_kv_cache()
    logits = _run(model, kv, [[1, 2, 3], [4]], [0, 0], [0, 1])
    assert logits.shape == (4, model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_prefill_in_one_step_equals_decoding_token_by_token(model: ReferenceDecoder) -> None:
    prompt = [5, 9, 13, 2, 7, 11]
    prefill = _run(model, model.new_kv_cache(), [prompt], [0], [3])
    kv = model.new_kv_cache()
    stepwise = torch.cat([_run(model, kv, [[tok]], [i], [3]) for i, tok in enumerate(prompt)])
    torch.testing.assert_close(prefill, stepwise, rtol=1e-5, atol=1e-5)


def test_each_token_sees_only_earlier_positions_of_its_own_slot(model: ReferenceDecoder) -> None:
    alone = _run(model, model.new_kv_cache(), [[1, 2, 3]], [0], [0])
    together = _run(model, model.new_kv_cache(), [[1, 2, 3], [8, 8, 8, 8]], [0, 0], [0, 1])
    torch.testing.assert_close(together[:3], alone, rtol=1e-5, atol=1e-5)
    # Changing a later token must not change an earlier token's logits (causality).
    changed = _run(model, model.new_kv_cache(), [[1, 2, 4]], [0], [0])
    torch.testing.assert_close(changed[:2], alone[:2], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(changed[2], alone[2])


def test_padding_tokens_write_only_the_padding_slot(model: ReferenceDecoder) -> None:
    c = model.config
    plain_kv, padded_kv = model.new_kv_cache(), model.new_kv_cache()
    plain = _run(model, plain_kv, [[1, 2], [3]], [0, 0], [0, 1])
    padded = _run(model, padded_kv, [[1, 2], [3]], [0, 0], [0, 1], pad_to=8, padding_slot=c.padding_slot)
    assert padded.shape[0] == 8
    torch.testing.assert_close(padded[:3], plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_kv[:, :, : c.padding_slot], plain_kv[:, :, : c.padding_slot])
    assert padded_kv[:, :, c.padding_slot].any()


def test_flatten_requests_rejects_a_pad_smaller_than_the_batch() -> None:
    with pytest.raises(ValueError, match="smaller than the batch"):
        flatten_requests([[1, 2, 3]], [0], [0], pad_to=2, padding_slot=8)


def test_bfloat16_model_runs_and_stays_close_to_float32() -> None:
    config = ModelConfig.tiny(max_num_seqs=2, max_seq_len=16)
    full = ReferenceDecoder(config, seed=1)
    half = ReferenceDecoder(ModelConfig.tiny(max_num_seqs=2, max_seq_len=16, dtype=torch.bfloat16), seed=1)
    args = ([[3, 1, 4, 1, 5]], [0], [1])
    reference = _run(full, full.new_kv_cache(), *args)
    approx = _run(half, half.new_kv_cache(), *args)
    assert approx.dtype == torch.bfloat16
    assert (approx.float() - reference).abs().max() < 0.25 * reference.abs().max()


@pytest.mark.cuda
def test_the_whole_step_captures_as_one_cuda_graph_and_replays_equal_to_eager() -> None:
    config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=64, device="cuda")
    model = ReferenceDecoder(config)
    batch = flatten_requests([[1, 2, 3], [4], [5, 6]], [0, 4, 1], [0, 1, 2], pad_to=8,
                             padding_slot=config.padding_slot, device="cuda")
    eager_kv, graph_kv = model.new_kv_cache(), model.new_kv_cache()
    expected = model(batch.input_ids, batch.positions, batch.slot_ids, eager_kv)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(batch.input_ids, batch.positions, batch.slot_ids, graph_kv)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # A host sync or a data-dependent shape inside the step would make the capture itself fail.
    with torch.cuda.graph(graph):
        static_logits = model(batch.input_ids, batch.positions, batch.slot_ids, graph_kv)
    graph_kv.zero_()
    graph.replay()
    torch.testing.assert_close(static_logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graph_kv, eager_kv)
