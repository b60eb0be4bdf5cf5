"""Stale static inputs: a declared per-step input nobody wrote since the previous replay, whatever
writes it, and padding rows that still hold an earlier step's real tokens."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError, StaleInputError
from capture_core.events import ViolationKind
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
MODES = ["always_on", "debug"]


def lookup(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.clamp(0, table.shape[0] - 1)]


def make(observer, mode: str = "always_on") -> tuple[CUDAGraphWrapper, torch.Tensor, torch.Tensor]:
    runtime = GraphRuntime("eager", observer=observer, progress=False, address_check=mode)
    wrapper = CUDAGraphWrapper(lookup, runtime, name="lookup", per_step_inputs=["ids"])
    return wrapper, torch.zeros(8, dtype=torch.long), torch.arange(10.0)


def call(wrapper: CUDAGraphWrapper, ids: torch.Tensor, table: torch.Tensor, size: int = 8) -> torch.Tensor:
    with set_forward_context(FULL, BatchDescriptor(size)):
        return wrapper(ids[:size], table)


def captured(observer, mode: str = "always_on") -> tuple[CUDAGraphWrapper, torch.Tensor, torch.Tensor]:
    wrapper, ids, table = make(observer, mode)
    with wrapper.runtime.capture_phase():
        call(wrapper, ids, table)
    return wrapper, ids, table


def kinds(observer) -> list[tuple[ViolationKind, str | None]]:
    return [(v.kind, v.input_name) for v in observer.violations]


def test_a_replay_without_a_write_since_the_previous_one_is_stale(observer) -> None:
    wrapper, ids, table = captured(observer)
    ids.copy_(torch.arange(8))
    call(wrapper, ids, table)
    assert observer.violations == []
    out = call(wrapper, ids, table)  # forgot this step's copy_: the previous step's ids again
    (event,) = observer.violations
    assert (event.kind, event.input_name, event.wrapper) == (ViolationKind.STALE_INPUT, "ids", "lookup")
    assert "each holds, bit for bit, the previous replay's values, and no torch op wrote it" in event.message
    assert torch.equal(out, table[:8])  # reported, and the replay went on
    ids[:3] = 1  # any in-place write counts, on any view of the buffer
    call(wrapper, ids, table)
    assert len(observer.violations) == 1


def test_graphs_of_other_sizes_share_the_buffer_and_see_each_other_s_writes(observer) -> None:
    wrapper, ids, table = make(observer)
    with wrapper.runtime.capture_phase():
        call(wrapper, ids, table, 8)
        call(wrapper, ids, table, 4)
    ids.copy_(torch.arange(8))
    call(wrapper, ids, table, 8)  # written, then replayed at 8
    call(wrapper, ids, table, 4)  # not written again: stale, though the 4-token graph never replayed
    assert [(v.input_name, v.descriptor.num_tokens) for v in observer.violations] == [("ids", 4)]


def test_only_declared_inputs_are_checked_and_an_unknown_name_is_refused(observer) -> None:
    wrapper, ids, table = captured(observer)
    ids.fill_(2)
    call(wrapper, ids, table)  # ``table`` is not written between replays: it is not per-step
    assert observer.violations == []
    runtime = GraphRuntime("eager", progress=False)
    wrong = CUDAGraphWrapper(lookup, runtime, name="wrong", per_step_inputs=["token_ids"])
    refused = pytest.raises(GraphCacheError, match=r"'token_ids' names no tensor input.*ids, table")
    with runtime.capture_phase(), refused:
        call(wrong, ids, table)


def through_numpy(ids: torch.Tensor, values: torch.Tensor) -> None:
    ids.numpy()[:] = values.numpy()


def through_data(ids: torch.Tensor, values: torch.Tensor) -> None:
    ids.data.copy_(values)  # ``.data`` has a version counter of its own


def through_raw_memory(ids: torch.Tensor, values: torch.Tensor) -> None:
    """What a Triton or CUDA kernel does to a static buffer: write its memory, nothing else."""
    ctypes.memmove(ids.data_ptr(), values.data_ptr(), values.numel() * values.element_size())


WRITERS = {"numpy": through_numpy, ".data": through_data, "raw memory": through_raw_memory}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("writer", WRITERS)
def test_a_buffer_written_where_no_version_counter_sees_it_is_no_stale_input(writer, mode, observer) -> None:
    wrapper, ids, table = captured(observer, mode)
    before = ids._version
    for step in range(30):
        WRITERS[writer](ids, torch.arange(8) * 3 + step % 7)
        assert torch.equal(call(wrapper, ids, table), table[(torch.arange(8) * 3 + step % 7).clamp(0, 9)])
    assert ids._version == before  # none of these writes moved the counter
    assert observer.violations == []
    # ... and a step that writes nothing is still stale, in both modes.
    if mode == "debug":
        with pytest.raises(StaleInputError, match="'ids'"):
            call(wrapper, ids, table)
    else:
        call(wrapper, ids, table)
    assert kinds(observer) == [(ViolationKind.STALE_INPUT, "ids")]


@pytest.mark.parametrize("mode", MODES)
def test_under_inference_mode_a_stale_step_is_found_at_the_faulty_replay(mode, observer) -> None:
    with torch.inference_mode():
        wrapper, ids, table = captured(observer, mode)  # inference tensors: no version counter
        for step in range(5):
            ids.copy_(torch.arange(8) + step)
            call(wrapper, ids, table)
        assert observer.violations == []
        if mode == "debug":
            with pytest.raises(StaleInputError, match="'ids'"):
                call(wrapper, ids, table)
        else:
            call(wrapper, ids, table)
    assert kinds(observer) == [(ViolationKind.STALE_INPUT, "ids")]
    assert observer.captures[0].unchecked_inputs == ()


def advance(positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[positions.clamp(0, table.shape[0] - 1)]


@pytest.mark.parametrize("mode", ["off", *MODES])
def test_an_engine_that_advances_its_inputs_in_place_runs_in_debug_mode_as_without_it(mode, observer) -> None:
    runtime = GraphRuntime("eager", observer=observer, progress=False, address_check=mode)
    wrapper = CUDAGraphWrapper(advance, runtime, name="advance", per_step_inputs=["positions"])
    positions, table = torch.zeros(4, dtype=torch.long), torch.arange(100.0)
    with runtime.capture_phase(), set_forward_context(FULL, BatchDescriptor(4)):
        wrapper(positions, table)
    seen = []
    for _ in range(10):
        positions.add_(1)  # a read-modify-write of the static buffer between steps
        with set_forward_context(FULL, BatchDescriptor(4)):
            seen.append(wrapper(positions, table).clone())
    assert observer.violations == []
    assert torch.equal(positions, torch.full((4,), 10))  # nothing of the checks was left in it
    assert torch.equal(torch.stack(seen), torch.arange(1.0, 11.0)[:, None].expand(10, 4))


def pair(ids: torch.Tensor, slots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.clamp(0, 9)] + slots


def pair_graph(observer, mode: str = "always_on", backend: str = "eager", **options) -> tuple:
    warmups = 1 if backend == "eager" else 2
    runtime = GraphRuntime(backend, observer=observer, progress=False, address_check=mode,
                           warmup_iters=warmups)
    wrapper = CUDAGraphWrapper(pair, runtime, name="pair", per_step_inputs=["ids", "slots"], **options)
    device = "cuda" if backend == "cuda" else "cpu"
    ids, slots = torch.zeros(8, dtype=torch.long, device=device), torch.full((8,), 99, device=device)
    table = torch.arange(10.0, device=device)
    with runtime.capture_phase():
        for size in (8, 4):
            with set_forward_context(FULL, BatchDescriptor(size)):
                wrapper(ids[:size], slots[:size], table)
    return wrapper, ids, slots, table


TOKENS = itertools.count(1)


def step(wrapper, ids, slots, table, real: int, size: int = 8, write=None, pad: bool = True) -> torch.Tensor:
    """A step of ``real`` tokens padded to ``size``: ids (new tokens each step) and slots written (by
    ``write``, default copy_), the padding rows set to pad values (token 0, the spare slot 99) unless
    ``pad`` is False."""
    write = write or (lambda buffer, values: buffer.copy_(values))
    device = ids.device
    write(ids[:real], torch.arange(real, device=device) + next(TOKENS))
    write(slots[:real], torch.arange(real, device=device) * 2)
    if pad and real < size:
        write(ids[real:size], torch.zeros(size - real, dtype=torch.long, device=device))
        write(slots[real:size], torch.full((size - real,), 99, device=device))
    with set_forward_context(FULL, BatchDescriptor(size), real):
        return wrapper(ids[:size], slots[:size], table)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("writer", ["copy_", "raw memory"])
def test_padding_rows_left_holding_an_earlier_step_s_real_tokens_are_stale(writer, mode, observer) -> None:
    write = None if writer == "copy_" else through_raw_memory
    wrapper, ids, slots, table = pair_graph(observer, mode)
    # Clean: the batch shrinks and its padding is rewritten; padding that was padding stays as it is.
    for real in (8, 5, 5, 3, 8, 6):
        step(wrapper, ids, slots, table, real, write=write)
        step(wrapper, ids, slots, table, real, write=write, pad=False)  # padding rows were padding already
    step(wrapper, ids, slots, table, 4, size=4, write=write)
    step(wrapper, ids, slots, table, 2, size=4, write=write)
    assert observer.violations == []
    step(wrapper, ids, slots, table, 8, write=write)
    if mode == "debug":
        with pytest.raises(StaleInputError, match=r"padding rows 5\.\.7 \(this step has 5 real tokens"):
            step(wrapper, ids, slots, table, 5, write=write, pad=False)  # rows 5..7 keep the last step's
    else:
        step(wrapper, ids, slots, table, 5, write=write, pad=False)
        step(wrapper, ids, slots, table, 5, write=write, pad=False)  # still there: reported again
    expected = [(ViolationKind.STALE_INPUT, "ids"), (ViolationKind.STALE_INPUT, "slots")]
    assert kinds(observer) == expected * (1 if mode == "debug" else 2)
    assert "would write those requests' KV slots again" in observer.violations[0].message
    step(wrapper, ids, slots, table, 5, write=write)  # padded again: clean from here
    step(wrapper, ids, slots, table, 5, write=write, pad=False)
    assert len(observer.violations) == len(expected) * (1 if mode == "debug" else 2)


def test_an_engine_that_leaves_padding_untouched_declares_it(observer) -> None:
    wrapper, ids, slots, table = pair_graph(observer, padding_rewritten=False)
    for real in (8, 5, 3, 8, 2):
        step(wrapper, ids, slots, table, real, pad=False)
    assert observer.violations == []


@pytest.mark.parametrize("mode", MODES)
def test_one_input_forgotten_is_stale_but_a_writer_torch_does_not_see_may_repeat_one(mode, observer) -> None:
    wrapper, ids, slots, table = pair_graph(observer, mode)
    step(wrapper, ids, slots, table, 8)
    ids.copy_(torch.arange(8) + 3)  # slots forgotten: all writes are torch's, so that is a fault
    with set_forward_context(FULL, BatchDescriptor(8)):
        if mode == "debug":
            with pytest.raises(StaleInputError, match=r"'slots' was not written.*while the step wrote 'ids'"):
                wrapper(ids, slots, table)
        else:
            wrapper(ids, slots, table)
    assert kinds(observer) == [(ViolationKind.STALE_INPUT, "slots")]
    # A group written where no counter sees it: the same slots again is a value that stays.
    wrapper, ids, slots, table = pair_graph(observer, mode)
    for token in range(5):
        through_raw_memory(ids, torch.arange(8) + token)
        through_raw_memory(slots, torch.arange(8) * 2)  # the same slots every step
        with set_forward_context(FULL, BatchDescriptor(8)):
            wrapper(ids, slots, table)
    assert len(observer.violations) == 1


def through_kernel(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """A CUDA kernel writing the buffer that its version counter does not see (a copy through
    ``.data``, as a Triton kernel handed the buffer's pointer would write it)."""
    buffer.data.copy_(values)


def settled(wrapper: CUDAGraphWrapper) -> None:
    wrapper.runtime.settle_checks()  # the always-on comparison is read back at the next replay
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("writer", ["copy_", "kernel"])
def test_cuda_graphs_tell_written_inputs_from_stale_ones_and_stale_padding(writer, mode, observer) -> None:
    write = None if writer == "copy_" else through_kernel
    wrapper, ids, slots, table = pair_graph(observer, mode, backend="cuda")
    for real in (8, 5, 5, 3, 8, 6, 8):
        step(wrapper, ids, slots, table, real, write=write)
        step(wrapper, ids, slots, table, real, write=write, pad=False)
    settled(wrapper)
    assert observer.violations == []
    if mode == "debug":
        with pytest.raises(StaleInputError, match=r"padding rows 5\.\.7"):
            step(wrapper, ids, slots, table, 5, write=write, pad=False)
    else:
        step(wrapper, ids, slots, table, 5, write=write, pad=False)
        settled(wrapper)
    assert kinds(observer) == [(ViolationKind.STALE_INPUT, "ids"), (ViolationKind.STALE_INPUT, "slots")]
    step(wrapper, ids, slots, table, 5, write=write)
    with set_forward_context(FULL, BatchDescriptor(8), 5):  # a step that writes nothing
        if mode == "debug":
            with pytest.raises(StaleInputError, match="no input of the step was written"):
                wrapper(ids, slots, table)
        else:
            wrapper(ids, slots, table)
            settled(wrapper)
    assert kinds(observer)[2:] == [(ViolationKind.STALE_INPUT, "ids"), (ViolationKind.STALE_INPUT, "slots")]
    if mode == "always_on":
        assert "read back at its group's next replay" in observer.violations[-1].message


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graphs_under_inference_mode_find_a_stale_step(mode, observer) -> None:
    with torch.inference_mode():
        wrapper, ids, slots, table = pair_graph(observer, mode, backend="cuda")
        for real in (8, 6, 8):
            step(wrapper, ids, slots, table, real)
        settled(wrapper)
        assert observer.violations == []
        with set_forward_context(FULL, BatchDescriptor(8)):
            if mode == "debug":
                with pytest.raises(StaleInputError):
                    wrapper(ids, slots, table)
            else:
                wrapper(ids, slots, table)
                settled(wrapper)
    assert kinds(observer) == [(ViolationKind.STALE_INPUT, "ids"), (ViolationKind.STALE_INPUT, "slots")]


def test_a_comparison_read_back_later_is_reported_at_the_group_s_next_replay(monkeypatch, observer) -> None:
    """On CUDA an always-on comparison is read back without a sync, at the group's next replay: the
    same path on the CPU here (``defers``), a stale step, then stale padding, each reported late."""
    monkeypatch.setattr("capture_core.stale.defers", lambda device: True)
    wrapper, ids, slots, table = pair_graph(observer)
    step(wrapper, ids, slots, table, 8)
    with set_forward_context(FULL, BatchDescriptor(8)):
        wrapper(ids, slots, table)  # forgot this step's writes: the comparison is on its way
    assert observer.violations == []
    step(wrapper, ids, slots, table, 8)  # written: its guard would wave it through, but one is waiting
    assert kinds(observer) == [(ViolationKind.STALE_INPUT, "ids"), (ViolationKind.STALE_INPUT, "slots")]
    assert "(replay 2 of this graph, read back at its group's next replay)" in observer.violations[0].message
    step(wrapper, ids, slots, table, 5, pad=False)  # rows 5..7 still hold the last step's tokens
    step(wrapper, ids, slots, table, 5)  # padded now: reads the last one back, and nothing is wrong with it
    assert len(observer.violations) == 4 and "padding rows 5..7" in observer.violations[2].message
    step(wrapper, ids, slots, table, 5, pad=False)  # was padding at the last replay: nothing to rewrite
    wrapper.runtime.settle_checks()
    assert len(observer.violations) == 4
