"""`graph-inspector advise`: the capture sizes your traffic wants, and the lines to paste.

The traffic is a CSV of requests replayed through the reference continuous-batching scheduler
(``--trace``): every step's batch size, as a decode graph cache would meet it. The advice compares
the advised sizes with the current ones (``--current``) on that same histogram.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

TRACE_WARMUP_STEPS = 1000
"""Steps simulated before the first counted one, so the histogram starts from a busy engine."""
PROGRESS_WORK = 2_000_000
"""Candidate sizes x graph counts above which the optimiser shows its progress."""


def run(args: argparse.Namespace) -> int:
    from inspector.advice.costs import StepTimes
    from inspector.advice.recommend import CURVE_GRAPHS, advise
    from inspector.advice.render import as_dict, render_text
    from inspector.errors import UsageError

    step_cost = None
    if args.step_times is not None:
        try:
            step_cost = StepTimes.read(args.step_times)
        except ValueError as error:
            raise UsageError(f"--step-times: {error}") from None
    histogram, source, engine_max = _trace_histogram(args)
    if args.max_size is not None and args.max_size > engine_max:
        raise UsageError(f"--max-size {args.max_size} is above the engine's largest batch ({engine_max}, "
                         "--max-num-seqs): a graph that large would never replay")
    current = _current_sizes(args.current, engine_max)
    work = len(histogram) * max(CURVE_GRAPHS, args.max_graphs or 0)
    with _progress(work >= PROGRESS_WORK and args.format == "text") as progress:
        advice = advise(
            histogram, current, source=source, max_graphs=args.max_graphs,
            capture_time_budget=args.capture_time_budget,
            memory_budget_bytes=None if args.memory_budget is None else args.memory_budget * 2**20,
            max_size=args.max_size, step_cost=step_cost, progress=progress,
        )
    if args.format == "json":
        sys.stdout.write(json.dumps(as_dict(advice), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(advice))
    return 0


def _trace_histogram(args: argparse.Namespace) -> tuple[Any, str, int]:
    """The batch sizes of ``args.steps`` scheduled steps of the trace; its source; the batch cap."""
    import os

    from capture_core.reference import TraceError, TrafficConfig, decode_batch_sizes, load_trace
    from inspector.advice.sizes import Histogram
    from inspector.errors import UsageError

    path = None if args.trace == PACKAGED_TRACE else args.trace
    try:
        trace = load_trace(path)
    except TraceError as error:
        raise UsageError(f"--trace: {error}") from None
    config = TrafficConfig(max_num_seqs=args.max_num_seqs, speedup=args.speedup, seed=args.seed,
                           warmup_steps=TRACE_WARMUP_STEPS)
    sizes = decode_batch_sizes(trace, config, args.steps)
    source = (f"{os.path.basename(trace.source)} ({len(trace):,} requests at {args.speedup:g}x through "
              f"continuous batching, up to {args.max_num_seqs} running, {args.steps:,} steps)")
    return Histogram.of(sizes), source, args.max_num_seqs


PACKAGED_TRACE = "packaged"
"""``--trace`` without a path: the Azure conversation trace that ships with capture_core."""


def _current_sizes(spec: str, largest: int) -> list[int]:
    """``pow2``, ``vllm`` (up to ``largest``) or a comma-separated list of sizes."""
    from capture_core.sizes import capture_sizes
    from inspector.errors import UsageError

    if spec in ("pow2", "vllm"):
        return capture_sizes(spec, largest)
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    wrong = next((part for part in parts if not part.isdigit() or int(part) < 1), None)
    if wrong is not None or not parts:
        what = f"{wrong!r} is not a size" if wrong is not None else "no sizes"
        raise UsageError(f"--current {spec!r}: {what}; give pow2, vllm or sizes such as 1,2,4,8")
    return sorted({int(part) for part in parts})


class _progress:
    """The optimiser's progress on stderr for long histograms (a context manager giving the callback)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from capture_core.progress import ProgressBar

        def advance(done: int, total: int) -> None:
            if self.bar is None:
                self.bar = ProgressBar(total - 1, "Advising")
            self.bar.advance(f"{done} graphs")

        return advance

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
