"""UBatchContext: real threads taking turns, clear errors when a hand-over is stuck or a ubatch fails."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from capture_core.ubatch.context import (
    UBatchAbortedError,
    UBatchContext,
    UBatchHandoverError,
    UBatchRing,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    make_ubatch_contexts,
)
from capture_core.ubatch.threads import UBatchThreads


class TurnLog:
    """Records which ubatch ran which step, and fails if two ever run at once."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int]] = []
        self.active = 0
        self.overlaps = 0
        self._lock = threading.Lock()

    def step(self, step: int) -> None:
        with self._lock:
            self.active += 1
            if self.active != 1:
                self.overlaps += 1
        time.sleep(0.002)  # give a misbehaving scheduler the chance to run another ubatch now
        self.entries.append((dbo_current_ubatch_id(), step))
        with self._lock:
            self.active -= 1


def _run(n: int, work: Callable[[int], object], timeout: float = 10.0, **kw: object) -> list[object]:
    ring = UBatchRing(n, timeout=timeout)
    contexts = make_ubatch_contexts(ring, **kw)  # type: ignore[arg-type]
    return UBatchThreads(contexts, [lambda i=i: work(i) for i in range(n)]).run()


@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
def test_ubatches_take_turns_round_robin_and_never_overlap(num_ubatches: int) -> None:
    log = TurnLog()
    steps = 4

    def work(index: int) -> int:
        for step in range(steps):
            log.step(step)
            dbo_yield()
        return index * 10

    results = _run(num_ubatches, work)
    assert results == [i * 10 for i in range(num_ubatches)]
    assert log.entries == [(u, s) for s in range(steps) for u in range(num_ubatches)]
    assert log.overlaps == 0


def test_compute_comm_switches_hand_over_in_dbo_order() -> None:
    """The DBO pattern: compute, hand over for comm, hand over back; ubatch 0 leads every phase."""
    log: list[str] = []

    def work(index: int) -> None:
        for layer in range(2):
            log.append(f"u{index} compute {layer}")
            dbo_yield_and_switch_from_compute_to_comm()
            log.append(f"u{index} comm {layer}")
            dbo_yield_and_switch_from_comm_to_compute()

    _run(2, work)
    expected = []
    for layer in range(2):
        expected += [f"u0 compute {layer}", f"u1 compute {layer}", f"u0 comm {layer}", f"u1 comm {layer}"]
    assert log == expected


def test_dbo_flags_are_per_thread() -> None:
    seen: dict[int, tuple[bool, int, str]] = {}

    def work(index: int) -> None:
        seen[index] = (dbo_enabled(), dbo_current_ubatch_id(), threading.current_thread().name)

    _run(2, work)
    assert seen[0][:2] == (True, 0) and seen[1][:2] == (True, 1)
    assert seen[0][2] != seen[1][2]
    # Outside a ubatch: disabled, id 0, and every helper is a no-op.
    assert (dbo_enabled(), dbo_current_ubatch_id()) == (False, 0)
    for helper in (dbo_yield, dbo_switch_to_comm_sync, dbo_switch_to_compute_sync):
        helper()


def test_every_ubatch_gets_its_own_forward_context() -> None:
    state = threading.local()

    @contextlib.contextmanager
    def forward_context(value: str) -> Iterator[None]:
        state.value = value
        try:
            yield
        finally:
            state.value = None

    def work(index: int) -> str:
        dbo_yield()  # the other ubatch runs in between and must not clobber ours
        return state.value

    results = _run(2, work, forward_contexts=[forward_context("first"), forward_context("second")])
    assert results == ["first", "second"]


def test_stuck_hand_over_times_out_with_a_clear_error() -> None:
    def work(index: int) -> None:
        if index == 0:
            time.sleep(1.5)  # holds the CPU far longer than the hand-over timeout
        dbo_yield()

    started = time.monotonic()
    with pytest.raises(UBatchHandoverError, match=r"ubatch 1 waited 0\.3s for its turn while ubatch 0 held"):
        _run(2, work, timeout=0.3)
    assert time.monotonic() - started < 10


def test_thread_that_never_reaches_the_barrier_times_out() -> None:
    ring = UBatchRing(2, timeout=0.3, start_timeout=0.3)
    contexts = make_ubatch_contexts(ring)

    def slow_setup(context: UBatchContext) -> None:
        if context.id == 1:
            time.sleep(1.0)

    threads = UBatchThreads(contexts, [lambda: None, lambda: None], thread_setup=slow_setup)
    with pytest.raises(UBatchHandoverError, match=r"start barrier within 0\.3s"):
        threads.run()


def test_failing_setup_reports_the_setup_error() -> None:
    ring = UBatchRing(2, timeout=30)

    def bad_setup(context: UBatchContext) -> None:
        if context.id == 1:
            raise OSError("no CUDA context for you")

    threads = UBatchThreads(make_ubatch_contexts(ring), [lambda: 1, lambda: 2], thread_setup=bad_setup)
    started = time.monotonic()
    with pytest.raises(OSError, match="no CUDA context"):
        threads.run()
    assert time.monotonic() - started < 10  # at once, not after the 30 s timeout


def test_a_failing_ubatch_aborts_the_others_and_its_error_is_raised() -> None:
    aborted: list[BaseException] = []

    def work(index: int) -> None:
        try:
            dbo_yield()
            if index == 1:
                raise ValueError("ubatch 1 broke")
            dbo_yield()
        except UBatchAbortedError as exc:
            aborted.append(exc)
            raise

    started = time.monotonic()
    with pytest.raises(ValueError, match="ubatch 1 broke"):
        _run(2, work, timeout=30)
    assert time.monotonic() - started < 10  # the abort wakes ubatch 0 at once, not after the timeout
    assert len(aborted) == 1 and "ubatch 1 failed" in str(aborted[0])


def test_contexts_do_not_nest_and_ids_are_checked() -> None:
    ring = UBatchRing(2)
    with pytest.raises(ValueError, match=r"ubatch_id must be in 0\.\.1"):
        UBatchContext(2, ring)
    with pytest.raises(ValueError, match="need 2 forward contexts"):
        make_ubatch_contexts(ring, [None])
    with pytest.raises(ValueError, match="timeouts must be positive"):
        UBatchRing(2, timeout=0)
    with pytest.raises(ValueError, match="timeouts must be positive"):
        UBatchRing(2, start_timeout=-1)
    assert (UBatchRing(2, timeout=0.5).start_timeout, UBatchRing(2, timeout=90).start_timeout) == (60, 90)
    with pytest.raises(ValueError, match="one callable per ubatch"):
        UBatchThreads(make_ubatch_contexts(ring), [lambda: None])

    def nested(index: int) -> None:
        with UBatchContext(index, UBatchRing(2)):
            pass

    with pytest.raises(RuntimeError, match="do not nest"):
        _run(2, nested, timeout=5)


def test_threads_can_run_again_with_a_fresh_ring() -> None:
    """The wrapper runs every step on fresh threads; nothing is left over between steps."""
    before = threading.active_count()
    for _ in range(5):
        assert _run(2, lambda i: i) == [0, 1]
    assert threading.active_count() == before


@pytest.mark.cuda
def test_streams_and_events_on_gpu() -> None:
    compute = torch.cuda.Stream()
    comm = torch.cuda.Stream()
    ring = UBatchRing(2, comm_stream=comm, timeout=30)
    contexts = make_ubatch_contexts(ring)
    source = [torch.full((1 << 20,), float(i + 1), device="cuda") for i in range(2)]
    received = [torch.empty(1 << 20, device="cuda") for _ in range(2)]
    streams: dict[int, list[str]] = {0: [], 1: []}

    def name(stream: torch.cuda.Stream) -> str:
        return {compute: "compute", comm: "comm"}.get(stream, "other")

    def work(index: int) -> torch.Tensor:
        streams[index].append(name(torch.cuda.current_stream()))
        hidden = source[index] * 2
        dbo_yield_and_switch_from_compute_to_comm()
        streams[index].append(name(torch.cuda.current_stream()))
        received[index].copy_(hidden)
        dbo_yield_and_switch_from_comm_to_compute()
        streams[index].append(name(torch.cuda.current_stream()))
        return received[index] + 1

    with torch.cuda.stream(compute):
        results = UBatchThreads(contexts, [lambda i=i: work(i) for i in range(2)]).run(compute)
        compute.synchronize()
    assert streams == {0: ["compute", "comm", "compute"], 1: ["compute", "comm", "compute"]}
    for i in range(2):
        torch.testing.assert_close(results[i], torch.full_like(results[i], 2 * (i + 1) + 1))
