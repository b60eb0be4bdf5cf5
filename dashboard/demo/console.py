"""What the demo prints: what is about to run, and the summary of what was recorded.

The summary's figures come from the database through ``inspector.reading.queries`` (the same read model as
the dashboard's overview), not from the demo's own counting, so the console and the pages agree.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from dashboard.demo.options import PROMPT_SCALE, RAMP_STEPS, is_decode_only, token_budget
from dashboard.demo.workload import capture_sizes_of

if TYPE_CHECKING:
    from capture_core.reference import Trace
    from dashboard.demo.traffic import DemoResult
    from dashboard.demo.workload import Runner

MAX_LISTED_VIOLATIONS = 100
MAX_LISTED_GRAPHS = 10_000


def announce(backend: str, model_name: str, runner: Runner, trace: Trace, args: argparse.Namespace) -> None:
    if backend == "cuda":
        import torch

        print(f"graph-inspector demo: cuda backend: real CUDA graphs on {torch.cuda.get_device_name()}")
    else:
        print("graph-inspector demo: eager backend: no CUDA GPU here, so each 'replay' re-runs the model on "
              "the captured inputs. Captures, address checks and events are the same as on a GPU; "
              "timings are not graph timings.")
    config = runner.model.config
    sizes = capture_sizes_of(runner)
    print(f"  model: reference decoder '{model_name}' ({runner.model.param_count():,} parameters, "
          f"{str(config.dtype).removeprefix('torch.')}), mode {args.mode}, {len(sizes)} capture sizes "
          f"({args.capture_sizes}: {size_list(sizes)})")
    ubatched = sorted(getattr(runner, "ubatch_slices", {}))
    if ubatched:
        print(f"  micro-batching: {len(ubatched)} buckets ({size_list(tuple(ubatched))}) captured as one "
              f"graph of {runner.ubatch.num_ubatches} micro-batches each (DBO)")
    source = "Azure LLM conversation trace, 2023" if args.trace is None else os.path.basename(trace.source)
    print(f"  traffic: {len(trace):,} real requests ({source}) through continuous batching, up to "
          f"{args.max_batch} running, {args.speedup:g}x speed, seed {args.seed}")
    if not is_decode_only(args):
        print(f"  chunked prefill: prompts 1/{PROMPT_SCALE} of their traced length, up to "
              f"{token_budget(args.max_batch)} tokens a step; a cold start, the trace's speed ramping "
              f"up to {args.speedup:g}x over the first {RAMP_STEPS} steps")


def size_list(sizes: tuple[int, ...]) -> str:
    if len(sizes) <= 10:
        return ", ".join(map(str, sizes))
    return f"{sizes[0]}, {sizes[1]}, {sizes[2]} ... {sizes[-1]}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def print_summary(store: Any, run_id: int, runner: Runner, result: DemoResult, url: str) -> None:
    from capture_core.reference import batch_size_stats
    from inspector.reading.queries import Queries

    queries = Queries(store.engine)
    summary = queries.summary(run_id)
    graphs, traffic = summary["graphs"], summary["traffic"]
    stats = batch_size_stats(result.batch_sizes)
    rate = result.steps / result.seconds if result.seconds else float("inf")
    print(f"\ngraph-inspector demo: {result.steps} steps on the {runner.runtime.backend_name} backend "
          f"in {result.seconds:.1f} s ({rate:.0f} steps/s)")
    unexpected = graphs.get("unexpected", 0)
    pool = graphs.get("pool_bytes", 0)
    memory = f"{pool / 2**20:.1f} MiB graph pool" if pool else "no graph pool (eager backend)"
    by_mode = ", ".join(f"{mode}: {n}" for mode, n in sorted(graphs.get("by_mode", {}).items()))
    print(f"  graphs captured   {graphs['count']}" + (f" ({by_mode})" if by_mode else "")
          + (f", of which {unexpected} unexpected" if unexpected else "") + f", {memory}")
    print(f"  batch sizes       {stats.min}..{stats.max}, mean {stats.mean:.0f}, changed on "
          f"{100 * stats.changed_share:.0f}% of steps ({stats.distinct} distinct sizes)")
    ubatched = getattr(runner, "ubatch_slices", {})
    if ubatched:
        split = sum(1 for n in result.batch_sizes if n <= runner.dispatcher.sizes.max_size
                    and runner.route(n).descriptor.captured_size in ubatched)
        print(f"  micro-batched     {split} of {result.steps} steps ran as "
              f"{runner.ubatch.num_ubatches} micro-batches in one graph ({len(ubatched)} buckets)")
    if result.prefill_steps is not None:
        print(f"  step kinds        {result.steps - result.prefill_steps} decode only, "
              f"{result.prefill_steps} with prompt chunks")
    _print_coverage(queries, run_id, capture_sizes_of(runner))
    batches = traffic["replays"] + traffic["eager_batches"]
    print(f"  replay hit ratio  {_percent(traffic['hit_ratio'])} of {batches} batches")
    print(f"  padding waste     {_percent(traffic['padding_waste'])} of the tokens the graphs computed")
    fallbacks = sum(row["batches"] for row in summary["eager"])
    reasons = ", ".join(f"{row['reason']}: {row['batches']}" for row in summary["eager"])
    print(f"  eager fallbacks   {fallbacks}" + (f" ({reasons})" if reasons else ""))
    _print_violations(queries, run_id)
    _print_faults(result)
    print(f"  database          {url}")
    _print_advice(queries, run_id, url)


def _print_advice(queries: Any, run_id: int, url: str) -> None:
    """Point at the advice, with what it would change for this very traffic."""
    from inspector.advice.recommend import advise
    from inspector.advice.recorded import read_recorded
    from inspector.errors import UsageError

    recorded = read_recorded(queries, [run_id], url)
    try:
        advice = advise(recorded.histogram, recorded.capture_sizes, source=recorded.source)
    except UsageError:
        return  # nothing captured, so nothing to compare with (mode none)
    print(f"  advice            the same {advice.graphs} graphs, sized for this traffic, would pad "
          f"{_percent(advice.advised.traffic.padding_waste)} instead of "
          f"{_percent(advice.current.traffic.padding_waste)}: the dashboard's Advice page, or "
          f"graph-inspector advise --db {url}")


def _print_coverage(queries: Any, run_id: int, sizes: tuple[int, ...]) -> None:
    """How much of the cache the traffic used: start-up graphs that replayed, capture sizes met."""
    listed = queries.graphs(run_id=run_id, sort="size", per_page=MAX_LISTED_GRAPHS).items
    graphs = [(g["mode"], g["descriptor"]["captured_size"], g["traffic"]["replays"]) for g in listed
              if not g["unexpected"]]
    if not graphs:
        return
    met = {size for _, size, replays in graphs if replays}
    idle: dict[str, list[int]] = {}
    for mode, size, replays in graphs:
        if not replays:
            idle.setdefault(mode, []).append(size)
    replayed = len(graphs) - sum(map(len, idle.values()))
    line = f"  graphs replayed   {replayed} of {len(graphs)} captured at start-up, "
    line += "every capture size met" if met >= set(sizes) else f"{len(met)} of {len(sizes)} capture sizes met"
    if idle:
        never = "; ".join(f"{mode} {size_list(tuple(idle[mode]))}" for mode in sorted(idle))
        line += f" (never replayed: {never})"
    print(line)


def _print_violations(queries: Any, run_id: int) -> None:
    findings = queries.violations(run_id=run_id, per_page=MAX_LISTED_VIOLATIONS)
    kinds = Counter(v["kind"] for v in findings.items)
    injected = sum(1 for v in findings.items if v["injected"])
    listed = ", ".join(f"{kind}: {n}" for kind, n in sorted(kinds.items()))
    line = f"  violations        {findings.total}" + (f" ({listed})" if listed else "")
    if injected:
        line += f"; {injected} injected on purpose by the demo"
    print(line)


def _print_faults(result: DemoResult) -> None:
    planted = []
    if result.drift_step is not None:
        planted.append(f"an address drift at step {result.drift_step}")
    if result.unexpected_step is not None:
        planted.append(f"an unexpected capture at step {result.unexpected_step}")
    if planted:
        print(f"  injected faults   {' and '.join(planted)}, labelled 'injected' on every page")
    for why in result.skipped:
        print(f"  ({why})")
    if result.drift_raised:
        print("  (debug address checks are on: the injected drift raised, as it would in CI)")
