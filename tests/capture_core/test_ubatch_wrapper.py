"""UBatchWrapper on the reference decoder: one graph for all ubatches, threads, lock and checks."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.errors import AddressDriftError, GraphCacheError, UnexpectedCaptureError
from capture_core.events import ViolationKind
from capture_core.forward_context import get_forward_context, set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.reference.overlap import CommOverlapDecoder
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason
from capture_core.ubatch.context import dbo_current_ubatch_id, dbo_enabled
from capture_core.ubatch.slices import UBatchSlice, maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE


class Probe(torch.nn.Module):
    """The overlap decoder, noting which ubatch (and thread) ran each call and on how many tokens."""

    def __init__(self, inner: CommOverlapDecoder) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[bool, int, int, str]] = []

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append(
            (dbo_enabled(), dbo_current_ubatch_id(), int(input_ids.shape[0]), threading.current_thread().name)
        )
        return self.inner(input_ids, positions, slot_ids, kv_cache)


@dataclass
class Step:
    """Static inputs of the largest size, and a way to load one decode step into them."""

    model: ReferenceDecoder
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    kv_cache: torch.Tensor

    def load(self, num_real: int, num_padded: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Write a decode step of ``num_real`` requests padded to ``num_padded``; return the views."""
        g = torch.Generator().manual_seed(seed)
        cfg = self.model.config
        self.input_ids[:num_real] = torch.randint(0, cfg.vocab_size, (num_real,), generator=g)
        self.positions[:num_real] = torch.randint(0, 40, (num_real,), generator=g)
        self.slot_ids[:num_real] = torch.randperm(cfg.max_num_seqs, generator=g)[:num_real]
        self.input_ids[num_real:num_padded] = 0
        self.positions[num_real:num_padded] = 0
        self.slot_ids[num_real:num_padded] = cfg.padding_slot
        return self.input_ids[:num_padded], self.positions[:num_padded], self.slot_ids[:num_padded]

    def expected(self, num_real: int, num_padded: int) -> torch.Tensor:
        """The plain decoder's logits for the loaded step, on a copy of the KV cache."""
        ids, pos, slots = (t[:num_padded] for t in (self.input_ids, self.positions, self.slot_ids))
        return self.model(ids, pos, slots, self.kv_cache.clone())[:num_real]


@pytest.fixture(scope="module")
def decoder() -> ReferenceDecoder:
    return ReferenceDecoder(ModelConfig.tiny(max_seq_len=64, max_num_seqs=32), seed=3)


def make_step(decoder: ReferenceDecoder, max_tokens: int = 16) -> Step:
    zeros = torch.zeros(max_tokens, dtype=torch.long, device=decoder.config.device)
    return Step(decoder, zeros.clone(), zeros.clone(), zeros.clone(), decoder.new_kv_cache())


@pytest.fixture
def step(decoder: ReferenceDecoder) -> Step:
    return make_step(decoder)


def make(decoder: ReferenceDecoder, observer: object, **runtime_kw: object) -> tuple[UBatchWrapper, Probe]:
    runtime = GraphRuntime("eager", observer=observer, progress=False, warmup_iters=1, **runtime_kw)
    probe = Probe(CommOverlapDecoder(decoder))
    return UBatchWrapper(probe, runtime, handover_timeout=20), probe


def run(
    wrapper: UBatchWrapper,
    step: Step,
    num_real: int,
    num_padded: int,
    *,
    mode: CUDAGraphMode = FULL,
    ubatch: bool = True,
    seed: int = 0,
    kv_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a step, run it through the wrapper under a forward context; (output, expected)."""
    ids, pos, slots = step.load(num_real, num_padded, seed)
    expected = step.expected(num_real, num_padded)
    _, padded = maybe_create_ubatch_slices(ubatch, [1] * num_real, num_padded, num_padded, 2)
    descriptor = BatchDescriptor(num_padded, num_padded, True)
    with set_forward_context(mode, descriptor, num_real, ubatch_slices=padded):
        out = wrapper(ids, pos, slots, kv_cache=step.kv_cache if kv_cache is None else kv_cache)
    return out[:num_real].clone(), expected


def ubatch_calls(probe: Probe) -> list[tuple[bool, int, int]]:
    return [call[:3] for call in probe.calls]


def test_without_graphs_the_ubatches_run_on_their_own_threads(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer)
    for mode in (NONE, PIECEWISE):
        probe.calls.clear()
        out, expected = run(wrapper, step, 7, 8, mode=mode)
        torch.testing.assert_close(out, expected)
        assert ubatch_calls(probe) == [(True, 0, 4), (True, 1, 4)]
        assert probe.calls[0][3] != probe.calls[1][3] != threading.current_thread().name
    assert wrapper.graphs == {} and observer.captures == []


def test_full_mode_captures_every_ubatch_into_one_graph_keyed_by_descriptor(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer)
    with wrapper.runtime.capture_phase():
        out, expected = run(wrapper, step, 7, 8)
    torch.testing.assert_close(out, expected)
    assert list(wrapper.graphs) == [BatchDescriptor(8, 8, True)]
    entry = wrapper.graphs[BatchDescriptor(8, 8, True)]
    assert entry.num_ubatches == 2
    first, second = UBatchSlice(slice(0, 4), slice(0, 4)), UBatchSlice(slice(4, 8), slice(4, 8))
    assert entry.ubatch_slices == (first, second)
    [event] = observer.captures
    assert (event.num_ubatches, event.ubatch_slices) == (2, ((0, 4, 0, 4), (4, 8, 4, 8)))
    assert (event.mode, event.descriptor.num_tokens, event.backend) == (FULL, 8, "eager")
    assert event.warmup_iters == 1
    assert event.input_names == ("input_ids", "positions", "slot_ids", "kv_cache")
    assert event.input_addresses[3] == step.kv_cache.data_ptr()
    # One warm-up and the capture itself, each a full ubatched run on the ubatch threads.
    assert ubatch_calls(probe) == [(True, 0, 4), (True, 1, 4)] * 2

    # Locked: new values copied into the same buffers replay the graph (no new capture).
    probe.calls.clear()
    out, expected = run(wrapper, step, 6, 8, seed=1)
    torch.testing.assert_close(out, expected)
    assert len(observer.captures) == 1
    assert observer.replays == [(FULL, BatchDescriptor(8, 8, True), 6)]
    assert ubatch_calls(probe) == [(True, 0, 4), (True, 1, 4)]  # the eager backend's replay re-runs


def test_three_ubatches_are_captured_into_one_graph_too(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer)
    ids, pos, slots = step.load(11, 12, seed=5)
    expected = step.expected(11, 12)
    _, padded = maybe_create_ubatch_slices(True, [1] * 11, 12, 12, 3)
    with wrapper.runtime.capture_phase(), set_forward_context(
        FULL, BatchDescriptor(12, 12, True), 11, ubatch_slices=padded
    ):
        out = wrapper(ids, pos, slots, step.kv_cache)
    torch.testing.assert_close(out[:11], expected)
    [event] = observer.captures
    assert event.ubatch_slices == ((0, 4, 0, 4), (4, 8, 4, 8), (8, 12, 8, 12))
    assert ubatch_calls(probe)[-3:] == [(True, 0, 4), (True, 1, 4), (True, 2, 4)]


def test_a_size_held_as_a_ubatch_graph_is_never_captured_as_a_plain_graph(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer)
    with wrapper.runtime.capture_phase():
        run(wrapper, step, 8, 8)
        probe.calls.clear()
        # Same size, micro-batching called off for this step: eager with the reason, no capture.
        out, expected = run(wrapper, step, 8, 8, ubatch=False, seed=2)
        torch.testing.assert_close(out, expected)
        assert ubatch_calls(probe) == [(False, 0, 8)]
        assert observer.eagers == [(EagerReason.UBATCH_GRAPH_ONLY, 8, FULL)]
        # Another size without micro-batching gets an ordinary plain graph.
        run(wrapper, step, 3, 4, ubatch=False)
    assert [(e.descriptor.num_tokens, e.num_ubatches) for e in observer.captures] == [(8, 2), (4, 1)]
    assert {d.num_tokens: e.num_ubatches for d, e in wrapper.graphs.items()} == {8: 2, 4: 1}


def test_before_the_capture_phase_ubatches_run_eagerly_with_the_reason(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer)
    out, expected = run(wrapper, step, 5, 8)
    torch.testing.assert_close(out, expected)
    assert observer.eagers == [(EagerReason.BEFORE_CAPTURE_PHASE, 5, FULL)]
    assert ubatch_calls(probe) == [(True, 0, 4), (True, 1, 4)]
    assert wrapper.graphs == {}


def test_the_capture_lock_applies_to_ubatch_graphs(decoder, step, observer) -> None:
    wrapper, _ = make(decoder, observer)
    with wrapper.runtime.capture_phase():
        pass
    with pytest.raises(UnexpectedCaptureError, match="unexpected capture"):
        run(wrapper, step, 8, 8)
    [violation] = observer.violations
    assert violation.kind is ViolationKind.UNEXPECTED_CAPTURE and violation.descriptor.num_tokens == 8
    assert wrapper.graphs == {}


def test_under_the_eager_policy_a_locked_ubatch_step_still_runs_on_threads(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer, unexpected_capture="eager")
    with wrapper.runtime.capture_phase():
        pass
    out, expected = run(wrapper, step, 8, 8)
    torch.testing.assert_close(out, expected)
    assert observer.eagers == [(EagerReason.UNEXPECTED_CAPTURE, 8, FULL)]
    assert [v.kind for v in observer.violations] == [ViolationKind.UNEXPECTED_CAPTURE]
    assert ubatch_calls(probe) == [(True, 0, 4), (True, 1, 4)]
    assert wrapper.graphs == {}


def test_address_drift_of_a_keyword_input_is_reported(decoder, step, observer) -> None:
    wrapper, _ = make(decoder, observer)
    with wrapper.runtime.capture_phase():
        run(wrapper, step, 8, 8)
    moved = step.kv_cache.clone()
    run(wrapper, step, 8, 8, kv_cache=moved)
    [violation] = observer.violations
    assert violation.kind is ViolationKind.ADDRESS_DRIFT and violation.input_name == "kv_cache"
    assert violation.expected_address == step.kv_cache.data_ptr()
    assert violation.actual_address == moved.data_ptr()
    assert len(observer.replays) == 1  # always-on: reported, and the step still replayed


def test_address_drift_raises_in_debug_mode(decoder, step, observer) -> None:
    wrapper, _ = make(decoder, observer, address_check="debug")
    with wrapper.runtime.capture_phase():
        run(wrapper, step, 8, 8)
    with pytest.raises(AddressDriftError, match="'kv_cache'"):
        run(wrapper, step, 8, 8, kv_cache=step.kv_cache.clone())


def test_slices_that_do_not_tile_the_tokens_get_a_clear_error(decoder, step, observer) -> None:
    wrapper, _ = make(decoder, observer)
    ids, pos, slots = step.load(8, 8, 0)
    bad = [UBatchSlice(slice(0, 4), slice(0, 4)), UBatchSlice(slice(4, 6), slice(4, 6))]
    with set_forward_context(NONE, BatchDescriptor(8), 8, ubatch_slices=bad), pytest.raises(
        GraphCacheError, match=r"\[\(0, 4\), \(4, 6\)\] do not tile the call's 8 tokens"
    ):
        wrapper(ids, pos, slots, step.kv_cache)


def test_outside_a_forward_context_the_model_runs_plainly(decoder, step, observer) -> None:
    wrapper, probe = make(decoder, observer)
    ids, pos, slots = step.load(4, 4, 0)
    expected = step.expected(4, 4)
    torch.testing.assert_close(wrapper(ids, pos, slots, step.kv_cache), expected)
    assert ubatch_calls(probe) == [(False, 0, 4)]


def test_prefetched_threads_serve_the_next_call_and_are_stopped_on_discard(decoder, step, observer) -> None:
    """The CUDA capture path's thread hand-off, exercised on CPU: each call runs on threads started
    (and parked at the barrier) by the call before it; what is left over is stopped, not leaked."""
    wrapper, probe = make(decoder, observer)
    ids, pos, slots = step.load(8, 8, seed=4)
    expected = step.expected(8, 8)
    _, padded = maybe_create_ubatch_slices(True, [1] * 8, 8, 8, 2)
    with set_forward_context(FULL, BatchDescriptor(8, 8, True), 8, ubatch_slices=padded):
        batched = wrapper._step(get_forward_context(), (ids, pos, slots, step.kv_cache), {})
    before = threading.active_count()
    batched.prefetch = True
    batched.prepare()
    for _ in range(3):
        parked = batched._ready
        assert parked is not None and all(t.is_alive() for t in parked.threads)
        torch.testing.assert_close(batched()[:8], expected)
        assert not any(t.is_alive() for t in parked.threads)
    assert threading.active_count() == before + 2  # the next call's threads, parked
    batched.discard()
    assert threading.active_count() == before and batched._ready is None
    assert [c[1] for c in probe.calls] == [0, 1] * 3


@pytest.mark.cuda
def test_cuda_ubatch_graph_replays_equal_eager(observer) -> None:
    decoder = ReferenceDecoder(ModelConfig.tiny(max_seq_len=64, max_num_seqs=32, device="cuda"), seed=3)
    cuda_step = make_step(decoder)
    runtime = GraphRuntime("cuda", observer=observer, progress=False, warmup_iters=2)
    probe = Probe(CommOverlapDecoder(decoder, payload_bytes=1 << 20))
    wrapper = UBatchWrapper(probe, runtime, handover_timeout=60)
    with runtime.capture_phase():
        out, expected = run(wrapper, cuda_step, 14, 16)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    [event] = observer.captures
    assert (event.backend, event.num_ubatches) == ("cuda", 2)
    assert event.ubatch_slices == ((0, 8, 0, 8), (8, 16, 8, 16))
    assert event.pool_bytes > 0
    probe.calls.clear()
    for seed in range(1, 4):
        out, expected = run(wrapper, cuda_step, 9 + seed, 16, seed=seed)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert probe.calls == []  # a replay is the graph alone: the model's Python does not run
    assert [r[2] for r in observer.replays] == [10, 11, 12]
