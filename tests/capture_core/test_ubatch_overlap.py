"""CommOverlapDecoder: the exchange per layer, overlapped on the comm stream or kept in line."""

from __future__ import annotations

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.reference.overlap import CommOverlapDecoder, spin_cycles_per_us
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.context import current_ubatch_context, dbo_current_ubatch_id
from capture_core.ubatch.slices import maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper

FULL = CUDAGraphMode.FULL


class LoggedExchange(CommOverlapDecoder):
    """Notes, at every send, which ubatch sent and on which stream (None on CPU)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sends: list[tuple[int, str | None]] = []

    def _send(self, hidden: torch.Tensor, received: torch.Tensor) -> None:
        context = current_ubatch_context()
        stream = None
        if context is not None and context.on_gpu:
            current = torch.cuda.current_stream()
            stream = "comm" if current == context.comm_stream else "compute"
        self.sends.append((dbo_current_ubatch_id(), stream))
        super()._send(hidden, received)


def decode_inputs(model: ReferenceDecoder, tokens: int) -> tuple[torch.Tensor, ...]:
    cfg = model.config
    g = torch.Generator().manual_seed(11)
    device = cfg.device
    return (
        torch.randint(0, cfg.vocab_size, (tokens,), generator=g).to(device),
        torch.randint(0, 30, (tokens,), generator=g).to(device),
        torch.randperm(cfg.max_num_seqs, generator=g)[:tokens].to(device),
    )


def run_ubatched(
    decoder: CommOverlapDecoder, runtime: GraphRuntime, inputs: tuple[torch.Tensor, ...], kv: torch.Tensor
) -> torch.Tensor:
    tokens = int(inputs[0].shape[0])
    _, slices = maybe_create_ubatch_slices(True, [1] * tokens, tokens, tokens, 2)
    wrapper = UBatchWrapper(decoder, runtime, handover_timeout=30)
    descriptor = BatchDescriptor(tokens, tokens, True)
    with runtime.capture_phase(), set_forward_context(FULL, descriptor, tokens, ubatch_slices=slices):
        wrapper(*inputs, kv)
        return wrapper(*inputs, kv).clone()


@pytest.mark.parametrize("overlap", [True, False])
def test_in_line_and_overlapped_exchanges_take_the_same_turns_and_give_eager_logits(overlap: bool) -> None:
    model = ReferenceDecoder(ModelConfig.tiny(max_seq_len=64, max_num_seqs=16), seed=5)
    decoder = LoggedExchange(model, payload_bytes=1024, overlap=overlap)
    inputs = decode_inputs(model, 8)
    kv = model.new_kv_cache()
    expected = model(*inputs, kv.clone())
    out = run_ubatched(decoder, GraphRuntime("eager", progress=False, warmup_iters=1), inputs, kv)
    torch.testing.assert_close(out, expected)
    # Two layers, one exchange each, ubatches alternating: the order DBO's overlap depends on.
    per_run = [(0, None), (1, None)] * model.config.num_layers
    assert decoder.sends == per_run * 3  # warm-up, capture (the eager backend's run) and one replay
    assert torch.equal(decoder.payload_dst, decoder.payload_src)


def test_outside_micro_batching_the_exchanges_run_in_line_with_the_same_logits() -> None:
    model = ReferenceDecoder(ModelConfig.tiny(max_seq_len=64, max_num_seqs=16), seed=5)
    inputs = decode_inputs(model, 5)
    kv = model.new_kv_cache()
    expected = model(*inputs, kv.clone())
    for overlap in (True, False):
        decoder = LoggedExchange(model, overlap=overlap)
        torch.testing.assert_close(decoder(*inputs, kv.clone()), expected)
        assert decoder.sends == [(0, None)] * model.config.num_layers


def test_bad_comm_settings_get_clear_errors() -> None:
    model = ReferenceDecoder(ModelConfig.tiny(), seed=0)
    with pytest.raises(ValueError, match="payload_bytes must be >= 0"):
        CommOverlapDecoder(model, -1)
    with pytest.raises(ValueError, match="wait_us must be >= 0"):
        CommOverlapDecoder(model, wait_us=-5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="wait_us spins a CUDA kernel; the model is on cpu"):
            CommOverlapDecoder(model, wait_us=10)


@pytest.mark.cuda
def test_cuda_exchanges_go_to_the_comm_stream_only_when_overlapped() -> None:
    model = ReferenceDecoder(ModelConfig.tiny(max_seq_len=64, max_num_seqs=16, device="cuda"), seed=5)
    inputs = decode_inputs(model, 8)
    kv = model.new_kv_cache()
    expected = model(*inputs, kv.clone())
    assert spin_cycles_per_us(torch.cuda.current_device()) > 100  # any GPU clock is over 100 MHz
    for overlap, stream in ((True, "comm"), (False, "compute")):
        decoder = LoggedExchange(model, payload_bytes=1 << 16, wait_us=20, overlap=overlap)
        assert decoder.wait_cycles > 0
        out = run_ubatched(decoder, GraphRuntime("cuda", progress=False, warmup_iters=1), inputs, kv)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        # Warm-up and capture ran the model (2 layers x 2 ubatches each); the replay ran no Python.
        assert decoder.sends == [(0, stream), (1, stream)] * model.config.num_layers * 2
