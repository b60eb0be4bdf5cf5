"""Padding benchmark: power-of-two capture sizes against vLLM's default list (CPU only).

Every batch that replays a graph is padded up to a capture size; the padding is computed and thrown
away. This measures how much, per policy, on three kinds of traffic:

* trace: the demo's traffic, the Azure conversation trace through continuous batching
  (``capture_core.reference``) at several speedups, so decode batches span 1..max;
* demo: exactly the traffic of ``graph-inspector demo`` with its defaults (a cold start);
* mixed: the same trace with chunked prefill, whose token counts often exceed the largest capture
  size and run eagerly: this is where the hit rate (share of steps that replay) differs;
* uniform: batch sizes drawn uniformly from 1..max, checked against the exact expectation
  (computed by enumerating every size), which for power-of-two is the "about 25%" rule of thumb.

Waste is padded tokens over the tokens the graphs computed, the ratio the inspector records.

    python3 bench/padding.py --out bench/results/padding.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture_core.reference import (
    PaddingStats,
    TrafficConfig,
    batch_size_histogram,
    batch_size_stats,
    decode_batch_sizes,
    load_trace,
    padding_stats,
)
from capture_core.sizes import SizeTable, capture_sizes
from dashboard.demo.options import DEFAULT_SPEEDUP as DEMO_SPEEDUP
from dashboard.demo.options import DEFAULT_STEPS as DEMO_STEPS
from dashboard.demo.options import STEP_SECONDS as DEMO_STEP_SECONDS

POLICIES = ("pow2", "vllm")
DEFAULT_SPEEDUPS = (0.05, 0.25, 1.0, 2.0, 4.0, 8.0, 11.0)


def exact_uniform_waste(table: SizeTable, max_size: int) -> float:
    """Long-run waste for batch sizes uniform on 1..max_size: E[pad(n) - n] / E[pad(n)], exactly."""
    padded = sum(table.pad(n) or n for n in range(1, max_size + 1))
    real = max_size * (max_size + 1) // 2
    return (padded - real) / padded


def ratio_standard_error(sizes: list[int], table: SizeTable) -> float:
    """Standard error of the sampled waste ratio (delta method), to judge the exact figure by."""
    pads = [table.pad(n) or n for n in sizes]
    ratio = sum(p - n for p, n in zip(pads, sizes, strict=True)) / sum(pads)
    residuals = [(p - n) - ratio * p for p, n in zip(pads, sizes, strict=True)]
    mean_residual = sum(residuals) / len(residuals)
    variance = sum((r - mean_residual) ** 2 for r in residuals) / (len(residuals) - 1)
    return math.sqrt(variance / len(sizes)) / (sum(pads) / len(pads))


def _rounded(figure: float | None) -> float | None:
    return None if figure is None else round(figure, 6)


def policy_figures(stats: PaddingStats) -> dict[str, float | int | None]:
    return {
        "padding_waste": _rounded(stats.padding_waste),
        "hit_ratio": _rounded(stats.hit_ratio),
        "padding_tokens": stats.padding_tokens,
        "captured_tokens": stats.captured_tokens,
        "eager_steps": stats.steps - stats.replayed_steps,
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    tables = {policy: SizeTable(capture_sizes(policy, args.max_batch)) for policy in POLICIES}
    trace = load_trace(args.trace)
    started = time.perf_counter()

    trace_rows, all_sizes = [], []
    for speedup in args.speedups:
        config = TrafficConfig(max_num_seqs=args.max_batch, speedup=speedup, seed=args.seed,
                               warmup_steps=args.warmup_steps)
        sizes = decode_batch_sizes(trace, config, args.steps)
        all_sizes.extend(sizes)
        stats = batch_size_stats(sizes)
        row: dict[str, object] = {"speedup": speedup, "batch": asdict(stats)}
        for policy, table in tables.items():
            row[policy] = policy_figures(padding_stats(sizes, table))
        trace_rows.append(row)
    combined = {"batch": asdict(batch_size_stats(all_sizes))}
    combined.update({p: policy_figures(padding_stats(all_sizes, t)) for p, t in tables.items()})

    # The demo's own traffic: a cold start at its default speed, as `graph-inspector demo` runs it.
    demo_config = TrafficConfig(max_num_seqs=args.max_batch, speedup=DEMO_SPEEDUP,
                                step_seconds=DEMO_STEP_SECONDS, seed=args.seed)
    demo_sizes = decode_batch_sizes(trace, demo_config, DEMO_STEPS)
    demo: dict[str, object] = {"speedup": DEMO_SPEEDUP, "steps": DEMO_STEPS, "warmup_steps": 0,
                               "batch": asdict(batch_size_stats(demo_sizes)),
                               "histogram": batch_size_histogram(demo_sizes)}
    demo.update({p: policy_figures(padding_stats(demo_sizes, t)) for p, t in tables.items()})

    mixed_config = TrafficConfig(max_num_seqs=args.max_batch, speedup=4.0, seed=args.seed,
                                 warmup_steps=args.warmup_steps, chunked_prefill=True,
                                 max_num_batched_tokens=2048)
    mixed_sizes = decode_batch_sizes(trace, mixed_config, args.steps)
    mixed: dict[str, object] = {"speedup": 4.0, "max_num_batched_tokens": 2048,
                                "batch": asdict(batch_size_stats(mixed_sizes))}
    mixed.update({p: policy_figures(padding_stats(mixed_sizes, t)) for p, t in tables.items()})

    rng = random.Random(args.seed)
    uniform_sizes = [rng.randint(1, args.max_batch) for _ in range(args.uniform_samples)]
    uniform: dict[str, object] = {"samples": args.uniform_samples,
                                  "batch": asdict(batch_size_stats(uniform_sizes))}
    for policy, table in tables.items():
        sampled = padding_stats(uniform_sizes, table)
        exact = exact_uniform_waste(table, args.max_batch)
        error = ratio_standard_error(uniform_sizes, table)
        uniform[policy] = {
            **policy_figures(sampled),
            "exact_padding_waste": round(exact, 6),
            "standard_error": round(error, 6),
            "matches_exact": abs((sampled.padding_waste or 0.0) - exact) <= 5 * error,
        }

    return {
        "benchmark": "padding",
        "command": "python3 bench/padding.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "config": {"max_batch": args.max_batch, "steps_per_speedup": args.steps, "seed": args.seed,
                   "warmup_steps": args.warmup_steps, "trace": trace.source,
                   "capture_sizes": {p: list(t.sizes) for p, t in tables.items()}},
        "padding_waste_definition": "padded tokens / tokens computed by replayed graphs",
        "trace": trace_rows,
        "trace_combined": combined,
        "demo": demo,
        "mixed": mixed,
        "uniform": uniform,
        "seconds": round(time.perf_counter() - started, 2),
    }


def print_table(result: dict[str, object]) -> None:
    def pct(x: float) -> str:
        return f"{100 * x:6.2f}%"

    print(f"{'traffic':<22}{'batch min..max (mean)':>24}{'pow2 waste':>12}{'vllm waste':>12}"
          f"{'pow2 hit':>10}{'vllm hit':>10}")

    def line(name: str, row: dict) -> None:
        b = row["batch"]
        span = f"{b['min']}..{b['max']} ({b['mean']:.0f})"
        print(f"{name:<22}{span:>24}{pct(row['pow2']['padding_waste']):>12}{pct(row['vllm']['padding_waste']):>12}"
              f"{pct(row['pow2']['hit_ratio']):>10}{pct(row['vllm']['hit_ratio']):>10}")

    for row in result["trace"]:  # type: ignore[union-attr]
        line(f"trace x{row['speedup']:g}", row)
    line("trace, all speedups", result["trace_combined"])  # type: ignore[arg-type]
    line(f"demo ({DEMO_STEPS} steps)", result["demo"])  # type: ignore[arg-type]
    line("trace, chunked prefill", result["mixed"])  # type: ignore[arg-type]
    line("uniform 1..max", result["uniform"])  # type: ignore[arg-type]
    for policy in POLICIES:
        u = result["uniform"][policy]  # type: ignore[index]
        verdict = "matches" if u["matches_exact"] else "DOES NOT MATCH"
        print(f"uniform {policy}: sampled {pct(u['padding_waste'])} vs exact {pct(u['exact_padding_waste'])} "
              f"(standard error {100 * u['standard_error']:.3f} pts): {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/padding.json"),
                        help="where to write the JSON result (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2000,
                        help="scheduler steps per speedup (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=1000,
                        help="steps simulated before measuring, so the engine is busy (default: %(default)s)")
    parser.add_argument("--speedups", type=float, nargs="+", default=list(DEFAULT_SPEEDUPS),
                        help="trace speedups to replay (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=256,
                        help="largest capture size and max running requests (default: %(default)s)")
    parser.add_argument("--uniform-samples", type=int, default=200_000,
                        help="uniform batch sizes drawn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the trace offset and sampling")
    parser.add_argument("--trace", type=Path, default=None,
                        help="trace CSV (default: the packaged Azure trace)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.uniform_samples < 2 or args.max_batch < 1:
        parser.error("--steps and --max-batch must be positive, --uniform-samples at least 2")
    try:
        result = run(args)
    except ValueError as exc:  # TraceError and bad configs: a message, not a traceback
        print(f"padding: error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out} in {result['seconds']} s")
    failed = [p for p in POLICIES if not result["uniform"][p]["matches_exact"]]  # type: ignore[index]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
