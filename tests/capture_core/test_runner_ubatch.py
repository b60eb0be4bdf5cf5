"""The decode runner with micro-batching: buckets at or above the threshold are ubatch graphs."""

from __future__ import annotations

import threading

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationKind
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.slices import UBatchConfig

SIZES = [1, 2, 4, 8, 16]
DBO = UBatchConfig(enabled=True, decode_token_threshold=8)
FULL = CUDAGraphMode.FULL


def make_runner(
    model: ReferenceDecoder, observer: object, backend: str = "eager", **runtime_options
) -> DecodeRunner:
    runtime = GraphRuntime(backend, observer=observer, progress=False, **runtime_options)
    runner = DecodeRunner(model, runtime, SIZES, mode=CUDAGraphMode.FULL_DECODE_ONLY, ubatch=DBO)
    runner.capture()
    return runner


def decode_batch(model: ReferenceDecoder, num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    cfg = model.config
    generator = torch.Generator().manual_seed(seed)
    tensors = (
        torch.randint(0, cfg.vocab_size, (num_tokens,), generator=generator),
        torch.randint(0, cfg.max_seq_len, (num_tokens,), generator=generator),
        torch.randperm(cfg.max_num_seqs, generator=generator)[:num_tokens],
    )
    return tuple(t.to(cfg.device) for t in tensors)


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(ModelConfig.tiny(max_num_seqs=20, max_seq_len=32), seed=4)


@pytest.mark.usefixtures("single_thread_torch")
def test_buckets_from_the_threshold_up_are_captured_as_ubatch_graphs(model, observer) -> None:
    runner = make_runner(model, observer)
    assert sorted(runner.ubatch_slices) == [8, 16]
    captured = {e.descriptor.num_tokens: (e.num_ubatches, e.ubatch_slices) for e in observer.captures}
    assert captured[16] == (2, ((0, 8, 0, 8), (8, 16, 8, 16)))
    assert captured[8] == (2, ((0, 4, 0, 4), (4, 8, 4, 8)))
    assert [captured[n] for n in (1, 2, 4)] == [(1, ())] * 3  # plain graphs below the threshold
    assert [e.descriptor.num_tokens for e in observer.captures] == [16, 8, 4, 2, 1]  # largest first
    assert set(runner.graphs) == {BatchDescriptor(n, n, True) for n in SIZES}
    assert runner.runtime.locked and "ubatched=[8, 16]" in repr(runner)


@pytest.mark.usefixtures("single_thread_torch")
def test_every_step_equals_eager_whether_its_bucket_is_micro_batched_or_not(model, observer) -> None:
    runner = make_runner(model, observer)
    threads = []
    original = runner.graphed.runnable

    def noting_thread(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    runner.graphed.runnable = noting_thread  # the eager backend's "replay" runs the model again
    for num_tokens in (3, 5, 8, 13, 16):
        inputs = decode_batch(model, num_tokens, seed=num_tokens)
        threads.clear()
        replayed = runner.step(*inputs).clone()
        torch.testing.assert_close(replayed, runner.step_eager(*inputs))
        # 3 tokens replay the plain bucket-4 graph; from 5 on the bucket's two ubatches run on threads.
        expected = 0 if num_tokens <= 4 else 2
        assert sum(name.startswith("decode-ubatch") for name in threads) == expected, threads
    assert [(d.num_tokens, real) for _, d, real in observer.replays] == [
        (4, 3),
        (8, 5),
        (8, 8),
        (16, 13),
        (16, 16),
    ]
    assert observer.eagers == [] and observer.violations == []


@pytest.mark.usefixtures("single_thread_torch")
def test_a_planted_drift_on_a_micro_batched_bucket_is_caught(model, observer) -> None:
    runner = make_runner(model, observer, unexpected_capture="eager")
    first, second = decode_batch(model, 12, seed=1), decode_batch(model, 12, seed=2)
    runner.step(*first)
    stale = runner.inject_address_drift(second[0], first[1], first[2]).clone()
    (event,) = observer.violations
    assert (event.kind, event.input_name, event.injected) == (ViolationKind.ADDRESS_DRIFT, "input_ids", True)
    assert event.descriptor.num_tokens == 16
    torch.testing.assert_close(stale, runner.step_eager(*first))
    assert runner.inject_unexpected_capture() == BatchDescriptor(3, 3, True)
    assert [v.kind for v in observer.violations][-1] is ViolationKind.UNEXPECTED_CAPTURE


def test_without_micro_batching_or_below_every_threshold_the_runner_is_unchanged(model, observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    plain = DecodeRunner(model, runtime, SIZES)
    assert plain.ubatch_slices == {} and plain.ubatch.enabled is False
    high = UBatchConfig(enabled=True, decode_token_threshold=64)
    assert DecodeRunner(model, GraphRuntime("eager", progress=False), SIZES, ubatch=high).ubatch_slices == {}
    none = DecodeRunner(
        model, GraphRuntime("eager", progress=False), SIZES, mode=CUDAGraphMode.NONE, ubatch=DBO
    )
    assert none.ubatch_slices == {}


@pytest.mark.cuda
def test_cuda_micro_batched_buckets_replay_equal_eager(observer) -> None:
    model = ReferenceDecoder(ModelConfig.tiny(max_num_seqs=20, max_seq_len=32, device="cuda"), seed=4)
    runner = make_runner(model, observer, backend="cuda")
    assert [e.num_ubatches for e in observer.captures][:2] == [2, 2]
    assert all(e.backend == "cuda" and e.pool_bytes >= 0 for e in observer.captures)
    for num_tokens in range(1, 17):
        inputs = decode_batch(model, num_tokens, seed=num_tokens)
        torch.testing.assert_close(
            runner.step(*inputs).clone(), runner.step_eager(*inputs), rtol=1e-4, atol=1e-4
        )
    assert len(observer.replays) == 16 and observer.violations == []
