"""Planted faults, one implementation for both runners: recorded as injected, stale where they should
be, refused clearly where there is nothing to plant them on, and gone once planted."""

from __future__ import annotations

import pytest
import torch

from capture_core.buffers import BufferSpec, StaticBuffers
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import AddressDriftError
from capture_core.events import ViolationKind
from capture_core.faults import FaultNotPlantable
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import EagerReason

pytestmark = pytest.mark.usefixtures("single_thread_torch")

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
CONFIG = ModelConfig.tiny(max_num_seqs=16, max_seq_len=64)
SIZES = [4, 8, 16]
DECODE = ([[5], [6], [7]], [4, 2, 9])  # (new tokens per request, context per request)
OTHER_DECODE = ([[11], [12], [13]], [4, 2, 9])
MIXED = ([[1, 2, 3], [4], [5, 6]], [0, 3, 1])
OTHER_MIXED = ([[9, 8, 7], [6], [5, 4]], [0, 3, 1])


@pytest.fixture(scope="module")
def model() -> ReferenceDecoder:
    return ReferenceDecoder(CONFIG, seed=11)


def mixed_runner(model, observer, mode=CUDAGraphMode.FULL_AND_PIECEWISE, **options) -> MixedBatchRunner:
    runtime = GraphRuntime("eager", observer=observer, progress=False, warmup_iters=1, **options)
    runner = MixedBatchRunner(model, runtime, SIZES, mode)
    runner.capture()
    return runner


def flat(step):
    tokens, contexts = step
    batch = flatten_requests(tokens, contexts, list(range(len(tokens))))
    return batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata


@pytest.mark.parametrize(("first", "second", "served_by"), [(DECODE, OTHER_DECODE, FULL),
                                                            (MIXED, OTHER_MIXED, PIECEWISE)],
                         ids=["decode-on-full", "mixed-on-piecewise"])
def test_a_drift_on_the_mixed_runner_is_injected_and_reads_the_previous_step(
    model, observer, first, second, served_by
) -> None:
    runner = mixed_runner(model, observer)
    earlier = flat(first)
    runner.step(*earlier)
    later = flat(second)
    drifted = runner.inject_address_drift(later[0], *earlier[1:]).clone()
    (event,) = observer.violations
    assert (event.kind, event.input_name, event.injected) == (ViolationKind.ADDRESS_DRIFT, "input_ids", True)
    assert event.mode is served_by
    assert "test_faults.py" in event.stack and "capture_core/faults.py" not in event.stack
    torch.testing.assert_close(drifted, runner.step_eager(*earlier), rtol=1e-5, atol=1e-5)  # stale ids
    # The static buffer is back: the next step replays cleanly on its own ids.
    torch.testing.assert_close(runner.step(*later), runner.step_eager(*later), rtol=1e-5, atol=1e-5)
    assert len(observer.violations) == 1


def test_a_drift_raises_in_debug_mode_and_leaves_the_runner_whole(model, observer) -> None:
    runner = mixed_runner(model, observer, address_check="debug")
    step = flat(DECODE)
    with pytest.raises(AddressDriftError, match="'input_ids'"):
        runner.inject_address_drift(*step)
    assert [v.injected for v in observer.violations] == [True]
    torch.testing.assert_close(runner.step(*step), runner.step_eager(*step), rtol=1e-5, atol=1e-5)
    assert len(observer.violations) == 1


@pytest.mark.parametrize("runner_kind", ["decode", "mixed"])
def test_a_step_that_runs_eagerly_has_no_graph_to_drift(model, observer, runner_kind) -> None:
    above = [[i] for i in range(1, 18)], [1] * 17  # 17 tokens: above the largest capture size
    if runner_kind == "mixed":
        runner = mixed_runner(model, observer)
        inputs = flat(above)
    else:
        runner = DecodeRunner(model, GraphRuntime("eager", observer=observer, progress=False), SIZES)
        runner.capture()
        inputs = flat(above)[:3]
    message = r"17 tokens run eagerly \(above_max_capture_size\): there is no graph to drift"
    with pytest.raises(FaultNotPlantable, match=message):
        runner.inject_address_drift(*inputs)
    assert observer.violations == [] and observer.eagers == []


@pytest.mark.parametrize(("mode", "descriptor"), [
    (CUDAGraphMode.FULL_AND_PIECEWISE, BatchDescriptor(1, 1, True)),
    (FULL, BatchDescriptor(1, 1, True)),
    (PIECEWISE, BatchDescriptor(1)),
])
def test_the_mixed_runner_asks_for_the_smallest_size_start_up_never_captured(
    model, observer, mode, descriptor
) -> None:
    runner = mixed_runner(model, observer, mode, unexpected_capture="eager")
    assert runner.inject_unexpected_capture() == descriptor
    (event,) = observer.violations
    assert (event.kind, event.injected) == (ViolationKind.UNEXPECTED_CAPTURE, True)
    assert event.descriptor == descriptor
    assert observer.eagers == [(EagerReason.UNEXPECTED_CAPTURE, 1, mode.decode_mode())]
    assert not runner.kv_cache[:, :, : CONFIG.padding_slot].any(), "dummy inputs touch only the spare slot"


def test_under_the_capture_policy_each_planted_capture_takes_the_next_missing_size(model, observer) -> None:
    runner = mixed_runner(model, observer, unexpected_capture="capture")
    planted = [runner.inject_unexpected_capture() for _ in range(3)]
    assert planted == [BatchDescriptor(n, n, True) for n in (1, 2, 3)]
    assert {BatchDescriptor(n, n, True) for n in (1, 2, 3)} <= set(runner.graphs)
    assert [e.unexpected for e in observer.captures[-3:]] == [True] * 3


def test_no_unexpected_capture_without_decode_graphs_or_without_a_missing_size(model, observer) -> None:
    for mode in (NONE, CUDAGraphMode.PIECEWISE):
        runtime = GraphRuntime("eager", observer=observer, progress=False, warmup_iters=1)
        sizes = [1, 2, 3, 4] if mode is PIECEWISE else SIZES
        runner = MixedBatchRunner(model, runtime, sizes, mode)
        runner.capture()
        message = "captures no decode graphs" if mode is NONE else "every batch size up to 4 has a graph"
        with pytest.raises(FaultNotPlantable, match=message):
            runner.inject_unexpected_capture()
    decode = DecodeRunner(model, GraphRuntime("eager", progress=False), [1, 2], max_num_seqs=16)
    decode.capture()
    with pytest.raises(FaultNotPlantable, match="every batch size up to 2 has a graph"):
        decode.inject_unexpected_capture()
    assert observer.violations == []


def test_relocated_buffers_move_one_input_for_the_block_and_come_back() -> None:
    buffers = StaticBuffers(8, {"input_ids": BufferSpec(torch.long), "positions": BufferSpec(torch.long)})
    static = buffers.views(4)["input_ids"].data_ptr()
    with buffers.relocated("input_ids") as fresh:
        moved = buffers.load(4, input_ids=[1, 2, 3])
        assert moved["input_ids"].data_ptr() == fresh.data_ptr() != static
        assert moved["input_ids"].tolist() == [1, 2, 3, 0]
    assert buffers.views(4)["input_ids"].data_ptr() == static
    assert buffers.views(4)["input_ids"].tolist() == [0, 0, 0, 0], "the static buffer was not written"
    with pytest.raises(ValueError, match="no static buffer named 'kv'"), buffers.relocated("kv"):
        pass
