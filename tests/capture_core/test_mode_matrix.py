"""The mode matrix: every CUDA-graph mode against every kind of batch.

First the dispatcher alone (a table: which runtime mode and graph key each batch gets, or eager
with which reason), then the same matrix end to end through ``MixedBatchRunner`` on the reference
decoder (the graph that actually served the step, and logits equal to the eager model), then
hypothesis over random step sequences.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_core.descriptor import BatchDescriptor
from capture_core.dispatcher import CUDAGraphDispatcher
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
FULL_DECODE_ONLY, FULL_AND_PIECEWISE = CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE
SIZES = [1, 2, 4, 8, 16]
D = BatchDescriptor

# kind -> (num_tokens, uniform_decode, has_lora, num_active_loras)
BATCHES = {
    "decode": (3, True, False, 0),
    "decode_at_a_size": (16, True, False, 0),
    "mixed": (5, False, False, 0),
    "decode_above_largest": (17, True, False, 0),
    "mixed_above_largest": (40, False, False, 0),
    "decode_lora": (3, True, True, 2),
    "mixed_lora": (5, False, True, 1),
}
ABOVE = (NONE, None, EagerReason.ABOVE_MAX_CAPTURE_SIZE)
NO_MIXED = (NONE, None, EagerReason.NO_GRAPH_FOR_MIXED_BATCH)


def _relaxed(mode: CUDAGraphMode) -> dict[str, tuple]:
    """PIECEWISE and FULL configurations: one graph per size for any batch, decode or mixed."""
    return {
        "decode": (mode, D(4), None),
        "decode_at_a_size": (mode, D(16), None),
        "mixed": (mode, D(8), None),
        "decode_above_largest": ABOVE,
        "mixed_above_largest": ABOVE,
        "decode_lora": (mode, D(4, None, False, True, 2), None),
        "mixed_lora": (mode, D(8, None, False, True, 1), None),
    }


# mode -> kind -> (runtime mode, graph key or None for eager, eager reason)
EXPECTED: dict[CUDAGraphMode, dict[str, tuple]] = {
    NONE: {kind: (NONE, None, EagerReason.MODE_NONE) for kind in BATCHES},
    PIECEWISE: _relaxed(PIECEWISE),
    FULL: _relaxed(FULL),
    FULL_DECODE_ONLY: {
        "decode": (FULL, D(4, 4, True), None),
        "decode_at_a_size": (FULL, D(16, 16, True), None),
        "mixed": NO_MIXED,
        "decode_above_largest": ABOVE,
        "mixed_above_largest": ABOVE,
        "decode_lora": (FULL, D(4, 4, True, True, 2), None),
        "mixed_lora": NO_MIXED,
    },
    FULL_AND_PIECEWISE: {
        "decode": (FULL, D(4, 4, True), None),
        "decode_at_a_size": (FULL, D(16, 16, True), None),
        "mixed": (PIECEWISE, D(8), None),
        "decode_above_largest": ABOVE,
        "mixed_above_largest": ABOVE,
        "decode_lora": (FULL, D(4, 4, True, True, 2), None),
        "mixed_lora": (PIECEWISE, D(8, None, False, True, 1), None),
    },
}
MATRIX = [(mode, kind) for mode in EXPECTED for kind in BATCHES]


class Recorder:
    def __init__(self) -> None:
        self.eager: list[tuple[EagerReason, int, CUDAGraphMode]] = []
        self.replays: list[tuple[CUDAGraphMode, BatchDescriptor, int]] = []
        self.captures: list = []
        self.violations: list = []

    def on_capture(self, event) -> None:
        self.captures.append(event)

    def on_replay(self, mode, descriptor, num_real_tokens) -> None:
        self.replays.append((mode, descriptor, num_real_tokens))

    def on_eager(self, reason, num_tokens, mode) -> None:
        self.eager.append((reason, num_tokens, mode))

    def on_violation(self, event) -> None:
        self.violations.append(event)


@pytest.mark.parametrize(("mode", "kind"), MATRIX, ids=[f"{m.name}-{k}" for m, k in MATRIX])
def test_dispatch_table(mode: CUDAGraphMode, kind: str) -> None:
    num_tokens, uniform, has_lora, loras = BATCHES[kind]
    observer = Recorder()
    dispatcher = CUDAGraphDispatcher(mode, SIZES, max_loras=2, observer=observer)
    want_mode, want_key, want_reason = EXPECTED[mode][kind]
    routed = dispatcher.route(num_tokens, uniform, has_lora, loras)
    assert (routed.mode, routed.eager_reason) == (want_mode, want_reason)
    if want_key is None:
        assert routed.descriptor == D(num_tokens, None, False, has_lora, loras)
    else:
        assert routed.descriptor == want_key
        assert routed.descriptor in dispatcher.keys[want_mode]
    assert dispatcher.dispatch(num_tokens, uniform, has_lora, loras) == (routed.mode, routed.descriptor)
    if want_reason is None:
        assert observer.eager == []
    else:
        wanted = mode.decode_mode() if uniform else mode.mixed_mode()
        assert observer.eager == [(want_reason, num_tokens, wanted)]


@pytest.mark.parametrize(
    ("mode", "full", "piecewise"),
    [
        (NONE, 0, 0),
        (PIECEWISE, 0, 15),
        (FULL, 15, 0),
        (FULL_DECODE_ONLY, 15, 0),
        (FULL_AND_PIECEWISE, 15, 15),
    ],
)
def test_capture_list_per_mode_is_largest_first_full_before_piecewise(mode, full, piecewise) -> None:
    dispatcher = CUDAGraphDispatcher(mode, SIZES, max_loras=2)  # 5 sizes x (no LoRA, 1, 2 adapters)
    listed = dispatcher.capture_list()
    assert sum(m is FULL for m, _ in listed) == full
    assert sum(m is PIECEWISE for m, _ in listed) == piecewise
    order = [(d.num_tokens, m is FULL) for m, d in listed]
    assert order == sorted(order, reverse=True)
    # Every graph listed is one some batch routes to: nothing is captured that is never replayed.
    for m, d in listed:
        routed = dispatcher.route(d.num_tokens, d.uniform, d.has_lora, d.num_active_loras)
        assert (routed.mode, routed.descriptor) == (m, d)


@pytest.mark.parametrize(
    ("mode", "num_tokens", "expected"),
    [
        (FULL_AND_PIECEWISE, 6, (FULL, D(8, 4, True))),  # 3 requests x 2 tokens
        (FULL_AND_PIECEWISE, 2, (FULL, D(2, 1, True))),
        (FULL_AND_PIECEWISE, 1, (PIECEWISE, D(1))),  # size 1 holds no whole 2-token request
        (FULL_DECODE_ONLY, 1, (NONE, D(1))),
    ],
)
def test_speculative_decode_graphs_hold_whole_requests(mode, num_tokens, expected) -> None:
    dispatcher = CUDAGraphDispatcher(mode, [1, 2, 4, 8], uniform_decode_query_len=2)
    routed = dispatcher.route(num_tokens, uniform_decode=True)
    assert (routed.mode, routed.descriptor) == expected


@given(
    mode=st.sampled_from(list(CUDAGraphMode)),
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=20, unique=True).map(sorted),
    query_len=st.integers(1, 4),
    max_loras=st.integers(0, 2),
)
def test_every_graph_in_any_capture_list_is_the_one_its_batches_replay(
    mode, sizes, query_len, max_loras
) -> None:
    dispatcher = CUDAGraphDispatcher(mode, sizes, uniform_decode_query_len=query_len, max_loras=max_loras)
    listed = dispatcher.capture_list()
    assert len(listed) == len(set(listed))
    assert {d for _, d in listed} == set().union(*dispatcher.keys.values())
    for m, d in listed:
        routed = dispatcher.route(d.num_tokens, d.uniform, d.has_lora, d.num_active_loras)
        assert (routed.mode, routed.descriptor, routed.eager_reason) == (m, d, None)
        assert m in mode.valid_runtime_modes()


def test_a_lora_batch_beyond_the_configured_adapters_is_refused() -> None:
    dispatcher = CUDAGraphDispatcher(FULL_AND_PIECEWISE, SIZES, max_loras=2)
    with pytest.raises(ValueError, match=r"num_active_loras must be in 1\.\.2"):
        dispatcher.route(3, True, has_lora=True, num_active_loras=3)


# ------------------------------------------------------------- end to end on the reference decoder

CONFIG = ModelConfig.tiny(max_num_seqs=16, max_seq_len=64)
RUNNER_SIZES = [4, 8, 16]
# kind -> (new tokens per request, context per request); slots are 0, 1, 2, ...
STEPS = {
    "decode": ([[5], [6], [7]], [4, 2, 9]),
    "mixed": ([[1, 2, 3], [4], [5, 6]], [0, 3, 1]),
    "decode_above_largest": ([[i] for i in range(1, 17 + 1)], [1] * 17),
    "mixed_above_largest": ([[3] * 10, [4] * 10], [0, 5]),
}
EXPECTED_STEP = {
    NONE: dict.fromkeys(STEPS, (NONE, None)),
    PIECEWISE: {"decode": (PIECEWISE, D(4)), "mixed": (PIECEWISE, D(8))},
    FULL: {"decode": (FULL, D(4)), "mixed": (FULL, D(8))},
    FULL_DECODE_ONLY: {"decode": (FULL, D(4, 4, True)), "mixed": (NONE, None)},
    FULL_AND_PIECEWISE: {"decode": (FULL, D(4, 4, True)), "mixed": (PIECEWISE, D(8))},
}


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(CONFIG, seed=11)


def _runner(model: ReferenceDecoder, mode: CUDAGraphMode, observer: Recorder) -> MixedBatchRunner:
    runtime = GraphRuntime("eager", observer=observer, progress=False, warmup_iters=1)
    runner = MixedBatchRunner(model, runtime, RUNNER_SIZES, mode)
    runner.capture()
    return runner


def _step_and_check(runner: MixedBatchRunner, model: ReferenceDecoder, tokens, contexts) -> None:
    batch = flatten_requests(tokens, contexts, list(range(len(tokens))))
    reference_kv = runner.kv_cache.clone()
    expected = model(batch.input_ids, batch.positions, batch.slot_ids, reference_kv, batch.attn_metadata)
    logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    real_slots = slice(0, CONFIG.padding_slot)
    torch.testing.assert_close(runner.kv_cache[:, :, real_slots], reference_kv[:, :, real_slots])


@pytest.mark.parametrize("mode", list(EXPECTED_STEP), ids=lambda m: m.name)
def test_each_mode_serves_each_kind_of_step_from_the_right_graph(model, mode) -> None:
    observer = Recorder()
    runner = _runner(model, mode, observer)
    graphs = {(e.mode, e.descriptor) for e in observer.captures}
    assert graphs == set(runner.dispatcher.capture_list())
    for kind, (tokens, contexts) in STEPS.items():
        observer.replays.clear()
        observer.eager.clear()
        _step_and_check(runner, model, tokens, contexts)
        want_mode, want_key = EXPECTED_STEP[mode].get(kind, (NONE, None))
        if want_key is None:
            assert observer.replays == [], kind
            [(reason, _, _)] = observer.eager
            if mode is NONE:
                assert reason is EagerReason.MODE_NONE
            elif kind.endswith("above_largest"):
                assert reason is EagerReason.ABOVE_MAX_CAPTURE_SIZE
            else:
                assert reason is EagerReason.NO_GRAPH_FOR_MIXED_BATCH
        else:
            real = sum(map(len, tokens))
            assert observer.replays == [(want_mode, want_key, real)], kind
            assert observer.eager == [], kind
    assert observer.violations == []


def test_piecewise_captures_carry_their_segment_count(model) -> None:
    observer = Recorder()
    _runner(model, FULL_AND_PIECEWISE, observer)
    segments = {e.mode: e.num_segments for e in observer.captures}
    assert segments == {FULL: 1, PIECEWISE: CONFIG.num_layers + 1}
    full_event = next(e for e in observer.captures if e.mode is FULL)
    assert full_event.input_names == ("input_ids", "positions", "slot_ids", "kv_cache")


request = st.tuples(st.integers(1, 6), st.integers(0, 20))  # (new tokens, context)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(list(CUDAGraphMode)),
    steps=st.lists(st.lists(request, min_size=1, max_size=6), min_size=1, max_size=3),
    decode_first=st.booleans(),
)
def test_any_sequence_of_steps_equals_the_eager_model_under_any_mode(
    model, mode, steps, decode_first
) -> None:
    observer = Recorder()
    runner = _runner(model, mode, observer)
    if decode_first:  # a uniform-decode step, so FULL decode graphs are exercised too
        steps = [[(1, c) for _, c in steps[0]], *steps]
    for step in steps:
        tokens = [[(7 * i + j) % CONFIG.vocab_size for j in range(n)] for i, (n, _) in enumerate(step)]
        _step_and_check(runner, model, tokens, [c for _, c in step])
    served = len(observer.replays) + len(observer.eager)
    assert served == len(steps)
    for replay_mode, _, _ in observer.replays:
        assert replay_mode in mode.valid_runtime_modes() and replay_mode is not NONE
    assert observer.violations == []


def test_steps_before_capture_run_eagerly_and_say_why(model) -> None:
    observer = Recorder()
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    runner = MixedBatchRunner(model, runtime, RUNNER_SIZES, FULL_AND_PIECEWISE)
    for tokens, contexts in (STEPS["decode"], STEPS["mixed"]):
        _step_and_check(runner, model, tokens, contexts)
    assert [(reason, mode) for reason, _, mode in observer.eager] == [
        (EagerReason.BEFORE_CAPTURE_PHASE, FULL),
        (EagerReason.BEFORE_CAPTURE_PHASE, PIECEWISE),
    ]
    assert observer.captures == [] and observer.replays == []


def test_a_step_whose_metadata_does_not_match_its_tokens_is_refused(model) -> None:
    runner = MixedBatchRunner(model, GraphRuntime("eager", progress=False), RUNNER_SIZES, FULL_AND_PIECEWISE)
    batch = flatten_requests([[1, 2], [3]], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="metadata describes 3 tokens but input_ids has 2"):
        runner.step(batch.input_ids[:2], batch.positions[:2], batch.slot_ids[:2], batch.attn_metadata)
