"""Piecewise graphs on the eager backend: the split, capture, replay == eager, checks, the guard."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from capture_core.descriptor import BatchDescriptor
from capture_core.errors import AddressDriftError, UnexpectedCaptureError
from capture_core.events import CaptureEvent, NullObserver, ViolationEvent, ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.piecewise import PiecewiseGraph, attention_boundary, is_break_point, split_at_break_points
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason

PIECEWISE = CUDAGraphMode.PIECEWISE
CONFIG = ModelConfig.tiny(num_layers=3, max_num_seqs=8, max_seq_len=32)
SIZE = 16


class Recording(NullObserver):
    def __init__(self) -> None:
        self.captures: list[CaptureEvent] = []
        self.violations: list[ViolationEvent] = []
        self.eager: list[EagerReason] = []
        self.replays = 0

    def on_capture(self, event: CaptureEvent) -> None:
        self.captures.append(event)

    def on_replay(self, mode, descriptor, num_real_tokens) -> None:
        self.replays += 1

    def on_eager(self, reason, num_tokens, mode) -> None:
        self.eager.append(reason)

    def on_violation(self, event: ViolationEvent) -> None:
        self.violations.append(event)


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(CONFIG, seed=5)


class Static:
    """Static input buffers of SIZE tokens, written with copy_ as an engine does."""

    def __init__(self, model: ReferenceDecoder) -> None:
        self.input_ids = torch.zeros(SIZE, dtype=torch.long)
        self.positions = torch.zeros(SIZE, dtype=torch.long)
        self.slot_ids = torch.full((SIZE,), CONFIG.padding_slot, dtype=torch.long)
        self.kv_cache = model.new_kv_cache()

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slot_ids, self.kv_cache

    def load(self, tokens, contexts, slots):
        batch = flatten_requests(tokens, contexts, slots, pad_to=SIZE, padding_slot=CONFIG.padding_slot)
        self.input_ids.copy_(batch.input_ids)
        self.positions.copy_(batch.positions)
        self.slot_ids.copy_(batch.slot_ids)
        return batch


def _captured(model, observer, **runtime_options):
    runtime = GraphRuntime("eager", observer=observer, progress=False, **runtime_options)
    piecewise = PiecewiseGraph(model, runtime)
    static = Static(model)
    with torch.no_grad(), runtime.capture_phase(), set_forward_context(PIECEWISE, BatchDescriptor(SIZE)):
        piecewise(*static.args())
    static.kv_cache.zero_()
    return piecewise, static


MIXES = [
    ([[1, 2, 3, 4, 5]], [0], [0]),
    ([[7], [8], [9]], [3, 0, 5], [1, 2, 3]),
    ([[1, 2], [3], [4, 5, 6, 7, 8, 9], [10]], [4, 9, 0, 2], [0, 4, 5, 7]),
    ([[2] * SIZE], [0], [6]),
]


def test_the_model_splits_into_one_segment_more_than_its_attention_calls(model) -> None:
    split = split_at_break_points(model)
    assert len(split.break_names) == CONFIG.num_layers
    assert len(split.segment_names) == CONFIG.num_layers + 1
    for name in split.break_names:
        assert any(is_break_point(m) for m in getattr(split.module, name).modules())


def test_a_model_without_break_points_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="no break points: mark its attention module"):
        split_at_break_points(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_an_untraceable_model_is_refused_with_the_reason() -> None:
    @attention_boundary
    class Mark(nn.Module):
        def forward(self, x):
            return x

    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mark = Mark()

        def forward(self, x):
            if x.sum() > 0:  # host control flow on a tensor: fx cannot trace it
                x = x * 2
            return self.mark(x)

    with pytest.raises(ValueError, match=r"torch\.fx could not trace it"):
        split_at_break_points(DataDependent())


def test_outside_a_piecewise_context_the_model_runs_directly(model) -> None:
    observer = Recording()
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    piecewise = PiecewiseGraph(model, runtime)
    static = Static(model)
    static.load(*MIXES[1])
    expected = model(*static.args()[:3], static.kv_cache.clone())
    with torch.no_grad(), runtime.capture_phase():
        plain = piecewise(*static.args()[:3], static.kv_cache.clone())
        with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(SIZE)):
            under_full = piecewise(*static.args()[:3], static.kv_cache.clone())
    assert observer.captures == [] and piecewise.graphs == {} and observer.replays == 0
    torch.testing.assert_close(plain, expected)
    torch.testing.assert_close(under_full, expected)


def test_capture_reports_one_piecewise_graph_with_its_segments(model) -> None:
    observer = Recording()
    piecewise, _ = _captured(model, observer)
    [event] = observer.captures
    assert event.mode is PIECEWISE
    assert event.descriptor == BatchDescriptor(SIZE, None)
    assert event.num_segments == CONFIG.num_layers + 1 == piecewise.num_segments
    assert event.backend == "eager" and event.wrapper == piecewise.name
    assert event.input_names[:2] == ("segment0.input_ids", "segment0.positions")
    # A value handed across an attention call is named after the attention's parameter.
    assert "segment1.layers_0_attn_out" in event.input_names
    assert {name.split(".")[0] for name in event.input_names} == {
        f"segment{i}" for i in range(piecewise.num_segments)
    }
    assert len(event.input_addresses) == len(event.input_names)
    assert event.capture_seconds > 0 and event.pool_bytes == 0
    entry = piecewise.graphs[BatchDescriptor(SIZE)]
    assert entry.num_segments == event.num_segments
    assert all(seg.mode is PIECEWISE for seg in entry.segments)


@pytest.mark.parametrize("mix", MIXES, ids=["prefill", "decodes", "mixed", "full-prefill"])
def test_replayed_mixed_batches_equal_the_eager_model(model, mix) -> None:
    observer = Recording()
    piecewise, static = _captured(model, observer)
    batch = static.load(*mix)
    eager_kv = static.kv_cache.clone()
    expected = model(batch.input_ids, batch.positions, batch.slot_ids, eager_kv, batch.attn_metadata)
    real = batch.attn_metadata.num_actual_tokens
    with torch.no_grad(), set_forward_context(PIECEWISE, BatchDescriptor(SIZE), real):
        replayed = piecewise(*static.args(), attn_metadata=batch.attn_metadata)
    torch.testing.assert_close(replayed[:real], expected[:real])
    torch.testing.assert_close(static.kv_cache, eager_kv)
    assert observer.replays == 1 and len(observer.captures) == 1 and observer.violations == []


def test_successive_steps_replay_one_graph_and_keep_the_cache_consistent(model) -> None:
    observer = Recording()
    piecewise, static = _captured(model, observer)
    eager_kv = static.kv_cache.clone()
    steps = [
        ([[1, 2, 3], [4, 5]], [0, 0], [0, 1]),
        ([[6], [7]], [3, 2], [0, 1]),
        ([[8], [9, 9]], [4, 3], [0, 1]),
    ]
    for step in steps:
        batch = static.load(*step)
        real = batch.attn_metadata.num_actual_tokens
        expected = model(batch.input_ids, batch.positions, batch.slot_ids, eager_kv, batch.attn_metadata)
        with torch.no_grad(), set_forward_context(PIECEWISE, BatchDescriptor(SIZE), real):
            replayed = piecewise(*static.args(), attn_metadata=batch.attn_metadata)
        torch.testing.assert_close(replayed[:real], expected[:real])
    assert observer.replays == len(steps)


def test_drift_on_a_positional_input_is_reported_per_segment_and_replay_goes_on(model) -> None:
    observer = Recording()
    piecewise, static = _captured(model, observer)
    moved_positions = static.positions.clone()
    with torch.no_grad(), set_forward_context(PIECEWISE, BatchDescriptor(SIZE)):
        piecewise(static.input_ids, moved_positions, static.slot_ids, static.kv_cache)
    drifts = observer.violations
    assert drifts and all(v.kind is ViolationKind.ADDRESS_DRIFT for v in drifts)
    assert {v.input_name for v in drifts} == {"positions"}
    # Every segment that reads positions (each one before an attention call) reports it, by name.
    readers = {f"{piecewise.name}/segment{i}" for i in range(CONFIG.num_layers)}
    assert {v.wrapper for v in drifts} == readers
    assert all(v.actual_address == moved_positions.data_ptr() for v in drifts)
    assert observer.replays == 1


def test_drift_on_a_keyword_input_raises_in_debug_mode_naming_segment_and_input(model) -> None:
    observer = Recording()
    piecewise, static = _captured(model, observer, address_check="debug")
    moved_ids = static.input_ids.clone()
    with (
        torch.no_grad(),
        set_forward_context(PIECEWISE, BatchDescriptor(SIZE)),
        pytest.raises(AddressDriftError, match=r"'input_ids'.*segment0|segment0.*'input_ids'"),
    ):
        piecewise(
            input_ids=moved_ids,
            positions=static.positions,
            slot_ids=static.slot_ids,
            kv_cache=static.kv_cache,
        )
    [violation] = observer.violations
    assert violation.input_name == "input_ids"
    assert violation.expected_address == static.input_ids.data_ptr()


def test_keyword_calls_with_the_captured_tensors_replay_cleanly(model) -> None:
    observer = Recording()
    piecewise, static = _captured(model, observer, address_check="debug")
    with torch.no_grad(), set_forward_context(PIECEWISE, BatchDescriptor(SIZE)):
        piecewise(
            input_ids=static.input_ids,
            positions=static.positions,
            slot_ids=static.slot_ids,
            kv_cache=static.kv_cache,
        )
    assert observer.violations == [] and observer.replays == 1


def test_before_the_capture_phase_a_batch_runs_eagerly_once_reported(model) -> None:
    observer = Recording()
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    piecewise = PiecewiseGraph(model, runtime)
    static = Static(model)
    with torch.no_grad(), set_forward_context(PIECEWISE, BatchDescriptor(SIZE)):
        piecewise(*static.args())
    assert observer.eager == [EagerReason.BEFORE_CAPTURE_PHASE]
    assert observer.captures == [] and piecewise.graphs == {}


@pytest.mark.parametrize("policy", ["raise", "eager", "capture"])
def test_a_capture_after_the_lock_is_one_unexpected_capture_whatever_the_policy(model, policy) -> None:
    observer = Recording()
    piecewise, static = _captured(model, observer, unexpected_capture=policy)
    other = BatchDescriptor(8)
    args = (static.input_ids[:8], static.positions[:8], static.slot_ids[:8], static.kv_cache)
    with torch.no_grad(), set_forward_context(PIECEWISE, other):
        if policy == "raise":
            with pytest.raises(UnexpectedCaptureError, match="has no graph for tokens=8"):
                piecewise(*args)
        else:
            logits = piecewise(*args)
            assert logits.shape == (8, CONFIG.vocab_size)
    [violation] = observer.violations
    assert violation.kind is ViolationKind.UNEXPECTED_CAPTURE and violation.wrapper == piecewise.name
    if policy == "eager":
        assert observer.eager == [EagerReason.UNEXPECTED_CAPTURE] and other not in piecewise.graphs
    if policy == "capture":
        assert observer.captures[-1].unexpected and observer.captures[-1].descriptor == other
        assert piecewise.graphs[other].unexpected
    if policy == "raise":
        assert other not in piecewise.graphs and len(observer.captures) == 1


def test_sizes_captured_largest_first_each_replay_equal_to_eager(model) -> None:
    observer = Recording()
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    piecewise = PiecewiseGraph(model, runtime)
    static = Static(model)
    sizes = [16, 8, 4]
    runtime.capture_all(
        [(PIECEWISE, BatchDescriptor(n)) for n in sizes],
        lambda mode, desc: piecewise(*(t[: desc.num_tokens] for t in static.args()[:3]), static.kv_cache),
    )
    assert [e.descriptor.num_tokens for e in observer.captures] == sizes
    static.kv_cache.zero_()
    for size in sizes:
        batch = flatten_requests([[3] * (size - 1), [4]], [0, 2], [0, 1])
        static.input_ids[:size].copy_(batch.input_ids)
        static.positions[:size].copy_(batch.positions)
        static.slot_ids[:size].copy_(batch.slot_ids)
        eager_kv = static.kv_cache.clone()
        expected = model(batch.input_ids, batch.positions, batch.slot_ids, eager_kv, batch.attn_metadata)
        views = (t[:size] for t in static.args()[:3])
        with torch.no_grad(), set_forward_context(PIECEWISE, BatchDescriptor(size)):
            replayed = piecewise(*views, static.kv_cache, attn_metadata=batch.attn_metadata)
        torch.testing.assert_close(replayed, expected)
    assert observer.violations == []
