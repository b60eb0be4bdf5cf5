"""What the recorder's flush thread takes from an engine's serving thread, by replay-window length.

The flush thread writes one replay window a ``flush_interval``: every graph key replayed in it, every
batch size seen, the running totals bumped. Its Python work holds the GIL, so in an engine whose
serving thread is host-bound (a small model, where a vLLM step is about 4.3 ms of host work on the
H200) each millisecond it holds the GIL is a millisecond of serving lost; no per-step clock sees it.

This measures it side by side in one process: a serving thread runs steps of fixed Python work (about
``--step-us`` each), and each step is recorded as the vLLM integration records it (the padded size's
counter bumped, an eager step above the largest capture size). The steps' token counts are the
bundled Azure conversation trace through continuous batching with chunked prefill (the demo's
traffic), padded to vLLM's default capture sizes. Arms, alternating round by round:

* ``window <s>``: a recorder writing a real SQLite file with that window length;
* ``no writes``: the same recorder with a window longer than the round (only its close writes, after
  the timed loop).

The figures, medians of the rounds: the flush thread's own CPU time and the statements the database
ran (each a hand-over of the GIL) per second of serving, and steps per second against ``no writes``
(which on a shared VM moves between rounds by more than the flush thread costs).

    python3 bench/window_cost.py --out bench/results/cpu/window_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.engine.interfaces import ExecuteStyle

from bench import common
from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason, SizeTable, vllm_default_sizes

NO_WRITES = 10_000.0
"""A window no round reaches: the recorder writes only at close, outside the timed loop."""


def trace_steps(count: int) -> list[tuple[int, bool]]:
    """(real tokens, uniform decode) of ``count`` steps of the demo's traffic (the trace, chunked
    prefill)."""
    from capture_core.reference import ContinuousBatchScheduler, TrafficConfig, load_trace

    config = TrafficConfig(max_num_seqs=256, speedup=4.0, step_seconds=0.02, seed=0, warmup_steps=400,
                           chunked_prefill=True, max_num_batched_tokens=2048)
    return [(step.num_real_tokens, step.uniform_decode)
            for step in ContinuousBatchScheduler(load_trace(), config).take(count)]


class Flushes:
    """The flush thread's CPU time, summed over its flushes (``time.thread_time`` inside each)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, recorder: Any) -> None:
        flusher = recorder._flusher
        original = flusher.flush_once

        def flush_once(include_traffic: bool, ended: bool) -> bool:
            began = time.thread_time()
            try:
                return original(include_traffic, ended)
            finally:
                self.seconds += time.thread_time() - began
        flusher.flush_once = flush_once


class Executions:
    """Statements the database runs while inside (each row of an ``executemany`` counted: SQLite
    steps each one on its own, and Python's ``sqlite3`` lets go of the GIL and takes it back for
    each, a hand-over between the flush thread and the serving thread every time; SQLAlchemy's
    "insertmanyvalues" batches are one statement each)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> Executions:
        event.listen(Engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
              executemany: bool) -> None:
        batched = context is not None and context.execute_style is ExecuteStyle.INSERTMANYVALUES
        self.count += len(parameters) if executemany and not batched else 1


def calibrate(step_us: float) -> int:
    """Loop iterations of about ``step_us`` microseconds of Python work."""
    spins = 10_000
    began = time.perf_counter()
    work(spins)
    per_spin = (time.perf_counter() - began) / spins
    return max(1, int(step_us * 1e-6 / per_spin))


def work(spins: int) -> int:
    total = 0
    for i in range(spins):
        total += i & 7
    return total


def serve(recorder: Any, steps: list[tuple[int, bool]], spins: int, seconds: float) -> float:
    """Steps per second over ``seconds`` of serving, each step recorded as the vLLM integration records
    it under vLLM's default mode: a uniform decode step replays FULL, a mixed one PIECEWISE, one above
    the largest capture size runs eagerly."""
    sizes = vllm_default_sizes(512)
    table = SizeTable(sizes)
    padded = {n: table.pad(n) for n, _ in steps}
    full = {s: BatchDescriptor(s, s, True) for s in sizes}
    mixed = {s: BatchDescriptor(s) for s in sizes}
    FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
    began = time.perf_counter()
    deadline = began + seconds
    done = 0
    while time.perf_counter() < deadline:
        real, uniform = steps[done % len(steps)]
        size = padded[real]
        if size is None:
            recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, real, PIECEWISE)
        elif uniform:
            recorder.replay_cell(FULL, full[size], real)[0] += 1
        else:
            recorder.replay_cell(PIECEWISE, mixed[size], real)[0] += 1
        work(spins)
        done += 1
    return done / (time.perf_counter() - began)


def arm(window: float, steps: list[tuple[int, bool]], spins: int, seconds: float) -> dict[str, float]:
    """One round of one arm: steps per second, the flush thread's CPU seconds and the statements the
    database ran, per second of serving."""
    from inspector.recording.recorder import Recorder

    with tempfile.TemporaryDirectory(prefix="graph-inspector-window-") as tmp:
        recorder = Recorder(f"sqlite:///{tmp}/window.db", label="window cost", flush_interval=window)
        flushes = Flushes()
        flushes.wrap(recorder)
        recorder.start()
        recorder.flush(timeout=60)  # the store opened and the run written before the timed loop
        flushes.seconds = 0.0
        executed = Executions()
        try:
            with executed:
                rate = serve(recorder, steps, spins, seconds)
            spent = flushes.seconds
        finally:
            recorder.close()
    return {"steps_per_s": rate, "flush_cpu_share": spent / seconds,
            "statements_per_s": executed.count / seconds}


def label_of(window: float) -> str:
    return "no writes" if window == NO_WRITES else f"window {window:g} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="1,10", help="window lengths to compare, seconds (default 1,10)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds (default 6)")
    parser.add_argument("--round-s", type=float, default=25.0, help="seconds of serving per arm and round")
    parser.add_argument("--step-us", type=float, default=4300.0,
                        help="Python work per step (default 4300: a tiny model's vLLM step on the H200)")
    parser.add_argument("--trace-steps", type=int, default=20_000, help="steps taken from the trace")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    steps = trace_steps(args.trace_steps)
    spins = calibrate(args.step_us)
    windows = [float(w) for w in args.windows.split(",")]
    seen: dict[str, list[dict[str, float]]] = {}
    for index in range(args.rounds):
        for window in [NO_WRITES, *windows] if index % 2 == 0 else [*windows, NO_WRITES]:
            figures = arm(window, steps, spins, args.round_s)
            seen.setdefault(label_of(window), []).append(figures)
            print(f"  round {index + 1} {label_of(window):>12}: {figures['steps_per_s']:7.1f} steps/s, flush "
                  f"thread {figures['flush_cpu_share'] * 100:.3f}% of a second, "
                  f"{figures['statements_per_s']:.1f} statements a second", flush=True)
    base = seen["no writes"]
    results: dict[str, Any] = {}
    print(f"median of {args.rounds} rounds of {args.round_s:g} s:")
    for label, rounds_seen in seen.items():
        ratio = [r["steps_per_s"] / b["steps_per_s"] for r, b in zip(rounds_seen, base, strict=True)]
        results[label] = {
            "rounds": rounds_seen, "steps_ratio_to_no_writes": statistics.median(ratio),
            "flush_cpu_share": statistics.median(r["flush_cpu_share"] for r in rounds_seen),
            "statements_per_s": statistics.median(r["statements_per_s"] for r in rounds_seen),
        }
        print(f"  {label:>12}: flush thread {results[label]['flush_cpu_share'] * 100:.3f}% of a second, "
              f"{results[label]['statements_per_s']:.1f} statements a second, "
              f"steps/s {statistics.median(ratio):.4f} of no writes")
    if args.out:
        common.write_results(args.out, benchmark="window_cost", command=common.command_line(),
                             device=torch.device("cpu"), config=vars(args) | {"out": str(args.out)},
                             results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
