"""The decode runner on real CUDA graphs (marked ``cuda``: skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from capture_core.backends import pool_reserved_bytes
from capture_core.checks import AddressCheckMode
from capture_core.errors import AddressDriftError, UnexpectedCaptureError
from capture_core.events import ViolationKind
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(ModelConfig.tiny(max_num_seqs=32, max_seq_len=64, device="cuda"), seed=2)


def cuda_batch(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 512, (num_tokens,), generator=generator).cuda(),
        torch.randint(0, 64, (num_tokens,), generator=generator).cuda(),
        torch.randperm(32, generator=generator)[:num_tokens].cuda(),
    )


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_cuda_graph_replay_equals_eager_at_every_bucket(model, observer, mode):
    runtime = GraphRuntime("cuda", observer=observer, progress=False)
    runner = DecodeRunner(model, runtime, SIZES, mode=mode)
    runner.capture()
    assert [e.backend for e in observer.captures] == ["cuda"] * len(SIZES)
    assert [e.descriptor.num_tokens for e in observer.captures] == sorted(SIZES, reverse=True)
    assert observer.captures[0].pool_bytes > 0  # the largest graph grows the shared pool
    assert pool_reserved_bytes(runtime.backend.pool) >= sum(e.pool_bytes for e in observer.captures)
    for num_tokens in range(1, SIZES[-1] + 1):
        batch = cuda_batch(num_tokens, seed=num_tokens)
        replayed = runner.step(*batch).clone()
        torch.testing.assert_close(replayed, runner.step_eager(*batch), rtol=1e-4, atol=1e-4)
    assert len(observer.replays) == SIZES[-1] and observer.violations == []


def test_cuda_drift_is_reported_and_the_graph_reads_the_captured_buffer(model, observer):
    runtime = GraphRuntime("cuda", observer=observer, progress=False)
    runner = DecodeRunner(model, runtime, SIZES)
    runner.capture()
    first, second = cuda_batch(4, seed=1), cuda_batch(4, seed=2)
    runner.step(*first)
    stale = runner.inject_address_drift(second[0], first[1], first[2]).clone()
    (event,) = observer.violations
    assert event.kind is ViolationKind.ADDRESS_DRIFT and event.input_name == "input_ids" and event.injected
    torch.testing.assert_close(stale, runner.step_eager(*first), rtol=1e-4, atol=1e-4)
    runtime.address_check = AddressCheckMode.DEBUG
    with pytest.raises(AddressDriftError):
        runner.inject_address_drift(*second)


def test_cuda_unexpected_capture_raises_after_the_lock(model, observer):
    runtime = GraphRuntime("cuda", observer=observer, progress=False)
    runner = DecodeRunner(model, runtime, [1, 4])
    runner.capture()
    with pytest.raises(UnexpectedCaptureError):
        runner.inject_unexpected_capture()
    assert observer.violations[0].kind is ViolationKind.UNEXPECTED_CAPTURE
