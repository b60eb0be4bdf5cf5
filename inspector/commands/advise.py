"""`graph-inspector advise`: the capture sizes your traffic wants, and the lines to paste.

The traffic is what a database recorded (``--db``, every run or ``--run`` ones pooled: the batch
sizes of every step, replayed or eager, the graphs start-up captured, which are the current
configuration and the capture costs, and the step times the runs recorded, which padding is weighed
by), or a CSV of requests replayed through the reference continuous-batching scheduler
(``--trace``, padding counted in tokens unless ``--step-times`` gives a time per size). The advice
compares the advised sizes with the current ones: as the runs recorded them, or projected on the
same histogram (a trace, or ``--current``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

TRACE_WARMUP_STEPS = 1000
"""Steps simulated before the first counted one, so the histogram starts from a busy engine."""
PROGRESS_WORK = 250_000
"""Candidate sizes x graph counts above which the optimiser shows its progress (about half a second)."""


def run(args: argparse.Namespace) -> int:
    from inspector.advice.costs import StepTimes
    from inspector.advice.recommend import CURVE_GRAPHS, advise
    from inspector.advice.render import as_dict, render_text
    from inspector.advice.weighing import Weighing
    from inspector.errors import UsageError

    include = _sizes_option("--include", args.include) if args.include is not None else []
    traffic = _trace_traffic(args) if args.trace is not None else _recorded(args)
    weighing = traffic.weighing or Weighing.by_tokens("a trace records no step times (give --step-times)")
    if args.step_times is not None:
        try:
            weighing = Weighing.from_csv(StepTimes.read(args.step_times), args.step_times)
        except ValueError as error:
            raise UsageError(f"--step-times: {error}") from None
    histogram, engine_max = traffic.histogram, traffic.engine_max
    if args.max_size is not None and engine_max is not None and args.max_size > engine_max:
        where = "--max-num-seqs" if args.trace is not None else "the runs' configuration"
        raise UsageError(f"--max-size {args.max_size} is above the engine's largest batch ({engine_max}, "
                         f"{where}): a graph that large would never replay")
    if args.current is not None:
        current = _current_sizes(args.current, engine_max or histogram.largest)
    else:
        current = list(traffic.capture_sizes)
    work = len(histogram) * max(CURVE_GRAPHS, args.max_graphs or 0)
    with _progress(work >= PROGRESS_WORK and args.format == "text") as progress:
        advice = advise(
            histogram, current, source=traffic.source, max_graphs=args.max_graphs,
            capture_time_budget=args.capture_time_budget,
            memory_budget_bytes=None if args.memory_budget is None else args.memory_budget * 2**20,
            max_size=args.max_size, costs=traffic.costs, weighing=weighing, include=include,
            lone_request_slack=args.lone_request_slack / 100,
            current=traffic.current if args.current is None else None, decode=traffic.decode,
            gpu_memory_utilization=args.gpu_memory_utilization,
            gpu_memory_bytes=None if args.gpu_memory_gib is None else args.gpu_memory_gib * 2**30,
            progress=progress,
        )
    if args.format == "json":
        sys.stdout.write(json.dumps(as_dict(advice), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(advice))
    return 0


def _recorded(args: argparse.Namespace) -> Any:
    """What the database at ``--db`` recorded, for ``--run`` (every run when none is given)."""
    from inspector.advice.recorded import read_recorded
    from inspector.reading.queries import Queries
    from inspector.storage.store import open_store

    with open_store(args.db, upgrade=False) as store:
        store.require_head()
        queries = Queries(store.engine)
        queries.rollup.warm()  # a one-shot read: wait out the rows other writers have yet to commit
        return read_recorded(queries, args.run, store.display_url)


def _trace_traffic(args: argparse.Namespace) -> Any:
    """The batch sizes of ``args.steps`` scheduled steps of the trace, against vLLM's list by default."""
    import os

    from capture_core.reference import TraceError, TrafficConfig, decode_batch_sizes, load_trace
    from capture_core.sizes import capture_sizes
    from inspector.advice.engines import DecodeTraffic
    from inspector.advice.recorded import RecordedTraffic
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
    histogram = Histogram.of(sizes)
    # The scheduler's steps are decode steps, one token a request: every batch is the decode list's.
    return RecordedTraffic(run_ids=(), source=source, histogram=histogram,
                           capture_sizes=tuple(capture_sizes("vllm", args.max_num_seqs)), costs=None,
                           engine_max=args.max_num_seqs, decode=DecodeTraffic(histogram))


PACKAGED_TRACE = "packaged"
"""``--trace`` without a path: the Azure conversation trace that ships with capture_core."""


def _current_sizes(spec: str, largest: int) -> list[int]:
    """``pow2``, ``vllm`` (up to ``largest``) or a comma-separated list of sizes."""
    from capture_core.sizes import capture_sizes

    if spec in ("pow2", "vllm"):
        return capture_sizes(spec, largest)
    return _sizes_option("--current", spec, "pow2, vllm or ")


def _sizes_option(option: str, spec: str, also: str = "") -> list[int]:
    """A comma-separated list of sizes (``UsageError`` naming ``option`` for anything else)."""
    from inspector.errors import UsageError

    parts = [part.strip() for part in spec.split(",") if part.strip()]
    wrong = next((part for part in parts if not part.isdigit() or int(part) < 1), None)
    if wrong is not None or not parts:
        what = f"{wrong!r} is not a size" if wrong is not None else "no sizes"
        raise UsageError(f"{option} {spec!r}: {what}; give {also}sizes such as 1,2,4,8")
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
