"""Synthetic inspector databases: a small realistic one for page tests and screenshots, and a
bulk one (a million replay windows) for the dashboard benchmark.

Both are written through the inspector's one write path (``inspector.storage.writer``), so that they hold
exactly what a recorder leaves behind, without running a model: the small one flush by flush
through a ``RunWriter`` as a recorder writes it, the bulk one with the same functions in large
executemany batches.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from capture_core.reference import TrafficConfig, decode_batch_sizes, load_trace
from capture_core.sizes import EagerReason, SizeTable, power_of_two_sizes, vllm_default_sizes
from inspector.recording.batch import (
    FlushBatch,
    PendingViolation,
    ReplayDelta,
    StepTimeDelta,
    TrafficWindow,
    graph_key,
    violation_key,
)
from inspector.recording.losses import Losses
from inspector.storage.store import Store
from inspector.storage.writer import (
    KnownTotals,
    RunInfo,
    RunWriter,
    append_traffic,
    insert_graphs,
    insert_run,
    insert_violations,
    update_run,
)

MIB = 1 << 20
HOSTILE_MESSAGE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> drift'
"""A violation message that would run script if any page rendered data as HTML (tests look for it)."""

INPUT_NAMES = ("input_ids", "positions", "kv_caches[0]", "kv_caches[1]", "attn_metadata.slot_mapping")
MODES = {"full": CUDAGraphMode.FULL, "piecewise": CUDAGraphMode.PIECEWISE}
ABOVE_MAX = EagerReason.ABOVE_MAX_CAPTURE_SIZE.value


def seed_sample(store: Store, *, now: float, seed: int = 7) -> dict[str, int]:
    """Two runs: a finished CUDA run (FULL decode graphs plus piecewise mixed graphs) and a live
    eager-backend run with an injected address drift, an injected unexpected capture and a
    violation whose text is hostile HTML. Returns the ids tests look for."""
    rng = random.Random(seed)
    cuda = SampleRun(store, "llama-1b decode (H200)", host="gpu-node-07", device="NVIDIA H200",
                     backend="cuda", started_at=now - 3 * 3600,
                     config={"mode": "full_and_piecewise", "sizes": "vllm", "max_size": 256,
                             "checks": "cheap"})
    eager = SampleRun(store, "ci smoke (eager backend)", host="ci-runner-3", device="cpu", backend="eager",
                      config={"mode": "full", "sizes": "pow2", "max_size": 64, "checks": "debug"},
                      started_at=now - 900)
    sizes, eager_sizes = vllm_default_sizes(256), power_of_two_sizes(64)
    cuda.capture(_graphs("cuda", sizes, ("full", "piecewise"), captured_at=now - 3 * 3600 + 5, rng=rng))
    eager.capture(_graphs("eager", eager_sizes, ("full",), captured_at=now - 890, rng=rng))
    cuda_traffic = _traffic(cuda.captured, sizes, start=now - 3 * 3600 + 60, end=now - 3600, window=30.0,
                            rng=rng, mean_batch=120)
    eager_traffic = _traffic(eager.captured, eager_sizes, start=now - 860, end=now - 2, window=5.0, rng=rng,
                             mean_batch=64)
    cuda.flush_traffic(cuda_traffic)
    eager.flush_traffic(eager_traffic)
    cuda.flush(now - 3600, traffic=_step_times(cuda.captured, cuda_traffic, now - 3600))
    drift = eager.violation(
        "address_drift", ("full", 64), input_name="positions", expected=0x7F3A2C000400,
        actual=0x7F3A2C9F0400, injected=True, count=12,
        message="input 'positions' moved since capture: the graph reads stale memory",
        first_seen_at=now - 600, last_seen_at=now - 30,
    )
    unexpected = eager.violation(
        "unexpected_capture", ("full", 32), input_name=None, expected=None, actual=None, injected=True,
        count=1, message="capture of tokens=32 after start-up was locked (policy: serve eagerly)",
        first_seen_at=now - 420, last_seen_at=now - 420,
    )
    hostile = cuda.violation(
        "address_drift", ("full", 8), input_name="kv_caches[1]", expected=0x7F0000100000,
        actual=0x7F0000200000, injected=False, count=3, message=HOSTILE_MESSAGE,
        first_seen_at=now - 2 * 3600, last_seen_at=now - 2 * 3600 + 40,
    )
    cuda.flush(now - 3600, ended=True)
    eager.flush(now - 2)
    return {
        "cuda_run": cuda.run_id,
        "eager_run": eager.run_id,
        "cuda_graph": cuda.graph_id(("full", 8)),
        "eager_graph": eager.graph_id(("full", 64)),
        "drift": drift,
        "unexpected": unexpected,
        "hostile": hostile,
    }


SLOWER_THAN_EAGER = 152
"""The sample CUDA run's FULL graph of this size replays slower than eager: the one marked not faster."""


def _step_times(captured: dict[tuple[str, int], CaptureEvent], traffic: list[TrafficWindow],
                now: float) -> TrafficWindow:
    """Timed steps of every FULL graph that replayed, as an H200's might read: a replay of ~0.3 ms
    growing with the size, eager ~2 ms (launch-bound) growing less; one graph slower than eager."""
    replayed = {key for window in traffic for key in window.replays}
    window = TrafficWindow(now, now)
    for (mode, size), event in captured.items():
        key = graph_key(event.mode, event.descriptor)
        if mode != "full" or key not in replayed:
            continue
        graph_s = 0.0003 + 2e-6 * size
        eager_s = 0.0002 + 2e-6 * size if size == SLOWER_THAN_EAGER else 0.002 + 1e-6 * size
        window.step_times[key] = StepTimeDelta(event.mode, event.descriptor, "cuda_events", graph_s * 3, 3,
                                               eager_s * 2, 2)
    return window


@dataclass
class SampleRun:
    """One synthetic run, written the way its recorder would: a run row, then one flush per event."""

    store: Store
    label: str
    host: str
    device: str
    backend: str
    config: dict[str, Any]
    started_at: float
    captured: dict[tuple[str, int], CaptureEvent] = field(default_factory=dict)
    writer: RunWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = RunWriter(self.store, _run_info(self.label, self.host, self.device, self.config,
                                                      self.started_at))
        self.writer.create_run(self.started_at, self.backend)

    @property
    def run_id(self) -> int:
        assert self.writer.run_id is not None
        return self.writer.run_id

    def flush(self, now: float, *, captures: list[CaptureEvent] | None = None,
              traffic: TrafficWindow | None = None, violations: dict | None = None,
              ended: bool = False) -> None:
        """One flush of the run's recorder at ``now``: what is given, and the run seen then."""
        batch = FlushBatch(captures or [], violations or {}, traffic or TrafficWindow(now, now),
                           self.backend, losses=Losses(), ended_at=now if ended else None)
        self.writer.write(batch, now)

    def capture(self, events: list[CaptureEvent]) -> None:
        self.captured.update({(e.mode.label, e.descriptor.captured_size): e for e in events})
        self.flush(max(e.captured_at for e in events), captures=events)

    def flush_traffic(self, windows: list[TrafficWindow]) -> None:
        for window in windows:
            self.flush(window.window_end, traffic=window)

    def graph_id(self, graph: tuple[str, int]) -> int:
        event = self.captured[graph]
        return self.writer.graph_ids[graph_key(event.mode, event.descriptor)]

    def violation(self, kind: str, graph: tuple[str, int], *, input_name: str | None, expected: int | None,
                  actual: int | None, injected: bool, count: int, message: str, first_seen_at: float,
                  last_seen_at: float) -> int:
        captured = self.captured[graph]
        event = ViolationEvent(kind=ViolationKind(kind), descriptor=captured.descriptor, mode=captured.mode,
                               wrapper=captured.wrapper, message=message, input_name=input_name,
                               expected_address=expected, actual_address=actual, stack=_stack(kind, message),
                               injected=injected, seen_at=first_seen_at)
        key = violation_key(event)
        pending = PendingViolation(event, count, first_seen_at, last_seen_at)
        self.flush(last_seen_at, violations={key: pending})
        return self.writer.violation_ids[key]


def touch_run(store: Store, run_id: int, at: float | None = None) -> None:
    """What a recorder's flush does to its run: ``last_seen_at`` moves to now, so the run is live."""
    with store.writer() as conn:
        update_run(conn, run_id, time.time() if at is None else at)


def flush_eager_batch(store: Store, run_id: int, num_real_tokens: int = 300) -> None:
    """What a recorder's next flush writes after one more batch ran eagerly (above the largest size)."""
    now = time.time()
    window = TrafficWindow(now - 1.0, now, eager={(ABOVE_MAX, "full"): [1, num_real_tokens]},
                           batch_sizes={num_real_tokens: 1}, uniform_batch_sizes={})
    with store.writer() as conn:
        append_traffic(conn, run_id, [window], {}, KnownTotals.of_run(conn, run_id), now)
        update_run(conn, run_id, now)


def seed_bulk(
    store: Store,
    *,
    now: float,
    graphs: int = 1_000,
    windows: int = 1_000_000,
    violations: int = 100_000,
    runs: int = 10,
    chunk: int = 50_000,
) -> None:
    """A large database for the benchmark: ``graphs`` graphs over ``runs`` runs, ``windows`` replay
    windows spread over them (plus a tenth as many eager and batch-size windows), ``violations``.

    Written through the write module in transactions of about ``chunk`` rows each."""
    sizes = vllm_default_sizes(512)
    per_run = -(-graphs // runs)
    span = 7 * 24 * 3600.0
    run_ids, events = [], []
    with store.writer() as conn:
        for i in range(runs):
            start, end = now - span + i * span / runs, now - span + (i + 1) * span / runs
            info = _run_info(f"bench run {i}", f"node-{i:02d}", "NVIDIA H200", {"mode": "full_and_piecewise"},
                             start)
            run_ids.append(insert_run(conn, info, end, "cuda"))
            update_run(conn, run_ids[-1], end, ended_at=end)
        for n in range(graphs):
            mode = "full" if (n // len(sizes)) % 2 == 0 else "piecewise"
            size = sizes[n % len(sizes)]
            events.append((run_ids[n // per_run], _capture("cuda", mode, size, captured_at=now - span,
                                                           pool_bytes=size * MIB)))
        by_run = {run_id: [e for r, e in events if r == run_id] for run_id in run_ids}
        graph_ids = {run_id: insert_graphs(conn, run_id, captured) for run_id, captured in by_run.items()}
    totals = {run_id: KnownTotals() for run_id in run_ids}
    steps = max(1, windows // max(1, graphs))
    per_chunk = max(1, chunk // per_run)
    for run_id, captured in by_run.items():
        for first in range(0, steps, per_chunk):
            traffic = list(_bulk_windows(now, span, captured, first, min(per_chunk, steps - first), steps))
            _append(store, run_id, traffic, graph_ids[run_id], totals[run_id], now)
    for rows in _chunked(_bulk_eager_and_sizes(now, span, run_ids, windows // 10), chunk):
        for run_id in run_ids:
            _append(store, run_id, [w for r, w in rows if r == run_id], {}, totals[run_id], now)
    for rows in _chunked(_bulk_violations(now, span, events, violations), chunk):
        with store.writer() as conn:
            for run_id in run_ids:
                insert_violations(conn, run_id, {key: p for r, key, p in rows if r == run_id})


def _append(store: Store, run_id: int, windows: list[TrafficWindow], graph_ids: dict, known: KnownTotals,
            now: float) -> None:
    if windows:
        with store.writer() as conn:
            created = append_traffic(conn, run_id, windows, graph_ids, known, now)
        known.update(created)


def _run_info(label: str, host: str, device: str, config: dict[str, Any], started_at: float) -> RunInfo:
    return RunInfo(label=label, host=host, pid=4242, process="python3 -m serve_llm --cuda-graphs", rank=0,
                   world_size=1, device=device, config=json.dumps(config), started_at=started_at)


def _descriptor(mode: str, size: int) -> BatchDescriptor:
    if mode == "full":
        return BatchDescriptor(size, size, True)
    return BatchDescriptor(size)


def _capture(backend: str, mode: str, size: int, *, captured_at: float, pool_bytes: int,
             rng: random.Random | None = None) -> CaptureEvent:
    base = 0x7F3A2C000000 + size * 0x1000
    ubatched = mode == "full" and size >= 128
    return CaptureEvent(
        descriptor=_descriptor(mode, size), mode=MODES[mode], backend=backend,
        wrapper="LlamaForCausalLM.forward",
        input_names=INPUT_NAMES, input_addresses=tuple(base + i * 0x200000 for i in range(len(INPUT_NAMES))),
        capture_seconds=0.02 + size / 2000 + (rng.random() * 0.01 if rng else 0.0), pool_bytes=pool_bytes,
        warmup_iters=2, num_segments=1 if mode == "full" else 17, num_ubatches=2 if ubatched else 1,
        ubatch_slices=((0, size // 2, 0, size // 2), (size // 2, size, size // 2, size)) if ubatched else (),
        captured_at=captured_at,
    )


def _graphs(backend: str, sizes: list[int], modes: tuple[str, ...], *, captured_at: float,
            rng: random.Random) -> list[CaptureEvent]:
    """Largest first, as the cache captures them: the first graph holds the pool, the rest reuse it."""
    events: list[CaptureEvent] = []
    for mode in modes:
        # Piecewise graphs leave attention out, so each holds less of its own than a FULL graph.
        share = 1.0 if mode == "full" else 0.55
        for size in reversed(sizes):
            first = not events
            pool = size * 1.5 * MIB if first else (0.25 + size / 64 + rng.random() * 0.5) * share * MIB
            event = _capture(backend, mode, size, captured_at=captured_at, pool_bytes=int(pool), rng=rng)
            events.append(event)
            captured_at += event.capture_seconds
    return events


def _traffic(graphs: dict[tuple[str, int], CaptureEvent], sizes: list[int], *, start: float, end: float,
             window: float, rng: random.Random, mean_batch: int) -> list[TrafficWindow]:
    """Continuous-batching traffic from the packaged Azure trace (40 steps a window); ``mean_batch``
    sets how fast the trace is replayed, and a few steps exceed the largest capture size."""
    table = SizeTable(sizes)
    steps = _trace_batch_sizes(int((end - start) / window) * 40 + 40, mean_batch, max(sizes) + 32, rng)
    windows = []
    t = start
    while t < end:
        traffic = TrafficWindow(t, t + window, uniform_batch_sizes={})  # as a recorder tells them
        for n, count in Counter(next(steps) for _ in range(40)).items():
            traffic.batch_sizes[n] = count
            padded = table.pad(n)
            if padded is None:
                eager = traffic.eager.setdefault((ABOVE_MAX, "full"), [0, 0])
                eager[0] += count
                eager[1] += n * count
                continue
            mode = "full" if rng.random() < 0.8 or ("piecewise", padded) not in graphs else "piecewise"
            graph = graphs[(mode, padded)]
            key = graph_key(graph.mode, graph.descriptor)
            delta = traffic.replays.setdefault(key, ReplayDelta(graph.mode, graph.descriptor))
            delta.replays += count
            delta.num_real_tokens += n * count
            if graph.descriptor.uniform:
                assert traffic.uniform_batch_sizes is not None
                traffic.uniform_batch_sizes[n] = traffic.uniform_batch_sizes.get(n, 0) + count
        windows.append(traffic)
        t += window
    return windows


def _trace_batch_sizes(count: int, mean_batch: int, max_num_seqs: int, rng: random.Random) -> Iterator[int]:
    """Decode batch sizes of the real trace through the continuous-batching scheduler, replayed
    fast enough for batches around ``mean_batch`` (measured: ~28 running at 1x, 20 ms steps)."""
    config = TrafficConfig(
        max_num_seqs=max_num_seqs, speedup=max(1.0, mean_batch / 28.0), seed=rng.randrange(1 << 16),
        warmup_steps=500,
    )
    return iter(decode_batch_sizes(load_trace(), config, count))


def _stack(kind: str, message: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "serve_llm/engine.py", line 412, in step\n    logits = self.runner.step(batch)\n'
        '  File "capture_core/runner.py", line 198, in step\n    return self.wrapper(**inputs)\n'
        f'  File "capture_core/wrapper.py", line 233, in __call__\n    self._check_addresses(inputs)\n'
        f"{kind}: {message}"
    )


def _chunked(rows: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _bulk_windows(now: float, span: float, events: list[CaptureEvent], first: int, count: int, steps: int
                  ) -> Iterator[TrafficWindow]:
    """Windows ``first`` .. ``first + count`` of one run's graphs: each graph replays 10 times a window."""
    step = span / steps
    keyed = [(graph_key(e.mode, e.descriptor), e.mode, e.descriptor) for e in events]
    for i in range(first, first + count):
        t = now - span + i * step
        window = TrafficWindow(t, t + step)
        for n, (key, mode, descriptor) in enumerate(keyed):
            real = descriptor.captured_size * (5 + (i + n) % 7)
            window.replays[key] = ReplayDelta(mode, descriptor, replays=10, num_real_tokens=real)
        yield window


def _bulk_eager_and_sizes(now: float, span: float, run_ids: list[int], count: int
                          ) -> Iterator[tuple[int, TrafficWindow]]:
    """Eager-fallback windows and, apart, batch-size windows: ``count`` of each, spread over the runs."""
    reasons = (ABOVE_MAX, EagerReason.NO_GRAPH_FOR_MIXED_BATCH.value, EagerReason.BEFORE_CAPTURE_PHASE.value)
    for i in range(count):
        t = now - span + i * span / count
        run_id = run_ids[i % len(run_ids)]
        yield run_id, TrafficWindow(t, t + 1.0, eager={(reasons[i % 3], "full"): [1 + i % 3, 600]})
        yield run_id, TrafficWindow(t, t, batch_sizes={1 + (i * 37) % 600: 1 + i % 5})


def _bulk_violations(now: float, span: float, events: list[tuple[int, CaptureEvent]], count: int
                     ) -> Iterator[tuple[int, tuple, PendingViolation]]:
    """``count`` distinct findings: address drifts of the graphs' inputs, and unexpected captures of
    sizes never captured (one finding each; a repeat would only bump a finding's count)."""
    for i in range(count):
        run_id, graph = events[i % len(events)]
        t = now - span + i * span / count
        drift = i % 4 != 0
        event = ViolationEvent(
            kind=ViolationKind.ADDRESS_DRIFT if drift else ViolationKind.UNEXPECTED_CAPTURE,
            descriptor=graph.descriptor if drift else BatchDescriptor(1024 + i), mode=graph.mode,
            wrapper=graph.wrapper, message=f"finding {i}", input_name="positions" if drift else None,
            expected_address=0x7F0000000000 + i if drift else None,
            actual_address=0x7F1000000000 + i if drift else None, seen_at=t,
        )
        yield run_id, violation_key(event), PendingViolation(event, 1 + i % 3, t, t + 5)


def seed_job(url: str, job: str = "torchrun:sample-job") -> dict[str, int]:
    """A data-parallel job of two ranks, recorded by their own Recorders (rank 0's compares them):
    rank 1 captured a 16-token graph where rank 0 captured 8, and at step 3 replayed 4 tokens
    where rank 0 replayed 2. Returns the ranks' run ids."""
    from inspector.recording.recorder import Recorder

    sizes = {0: (1, 2, 4, 8), 1: (1, 2, 4, 16)}
    steps = [1, 2, 4, 2, 1, 4]
    recorders = {rank: Recorder(url, label=f"dp rank {rank}", job=job, rank=rank, world_size=2,
                                flush_interval=0.05).start() for rank in (1, 0)}
    for rank, recorder in recorders.items():
        for size in sizes[rank]:
            recorder.on_capture(_capture("eager", "full", size, captured_at=time.time(),
                                         pool_bytes=size * MIB))
        for step, size in enumerate(steps):
            served = 4 if rank == 1 and step == 3 else size
            recorder.on_replay(CUDAGraphMode.FULL, _descriptor("full", served), served)
    recorders[1].close()  # rank 0 compares once more as it closes: after rank 1 wrote everything
    recorders[0].close()
    return {f"rank{rank}_run": recorder.run_id or 0 for rank, recorder in recorders.items()}
