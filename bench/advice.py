"""Advice benchmark: advised capture sizes against powers of two and vLLM's list (CPU only).

Traffic: the bundled Azure conversation trace through the continuous-batching scheduler at the
padding benchmark's speedups (0.05x to 11x, 2,000 steps each after 1,000 warm-up steps). Pooled,
that is decode batches of 1..256 tokens, the "trace, all speedups" row of bench/padding.py: a
fleet whose load ranges over two orders of magnitude. At each graph count (9: powers of two up to
256; 35: vLLM's default list up to 256; 16 and 67 for the curve) the padding waste of the advised
sizes against the fixed lists'. Then each speedup alone (one deployment at one load), where the
advice is made for that traffic. Last, the time ``advise`` takes on a histogram of 1,000,000
batches of the same traffic (from the batch list to the advice, the waste curve included), the
median of repeated runs.

    python3 bench/advice.py --out bench/results/advice.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import command_line, print_table, print_targets, target, write_results
from bench.padding import DEFAULT_SPEEDUPS
from capture_core.reference import TrafficConfig, decode_batch_sizes, load_trace
from capture_core.sizes import capture_sizes
from inspector.advice.recommend import advise
from inspector.advice.sizes import Histogram, project

MAX_BATCH = 256
GRAPH_COUNTS = (9, 16, 35, 67)
LARGE_BATCHES = 1_000_000


def sizes_by_speedup(steps_per_speedup: int, warmup_steps: int, seed: int) -> dict[float, list[int]]:
    """Every step's batch size at each speedup (the padding benchmark's traffic)."""
    trace = load_trace()
    found = {}
    for speedup in DEFAULT_SPEEDUPS:
        config = TrafficConfig(max_num_seqs=MAX_BATCH, speedup=speedup, seed=seed, warmup_steps=warmup_steps)
        found[speedup] = decode_batch_sizes(trace, config, steps_per_speedup)
    return found


def per_load(by_speedup: dict[float, list[int]]) -> list[dict[str, Any]]:
    """Each speedup's traffic advised on alone, at powers of two's and vLLM's graph counts."""
    rows = []
    for speedup, sizes in by_speedup.items():
        histogram = Histogram.of(sizes)
        row: dict[str, Any] = {"speedup": speedup, "smallest": histogram.sizes[0],
                               "largest": histogram.largest}
        for name in ("pow2", "vllm"):
            fixed = capture_sizes(name, MAX_BATCH)
            advice = advise(histogram, fixed, source="bench")  # as many sizes as the list has
            row[name] = project(histogram, fixed).traffic.padding_waste
            row[f"advised_{name}"] = advice.advised.traffic.padding_waste
        rows.append(row)
    return rows


def worst_ratio(rows: list[dict[str, Any]], name: str) -> float:
    """The largest advised-over-fixed waste ratio of the loads where the fixed list pads at all."""
    return max(r[f"advised_{name}"] / r[name] for r in rows if r[name])


def compare(histogram: Histogram) -> list[dict[str, Any]]:
    """Padding waste of the fixed lists and of the advised sizes at each graph count."""
    fixed = {"pow2": capture_sizes("pow2", MAX_BATCH), "vllm": capture_sizes("vllm", MAX_BATCH)}
    rows = []
    for graphs in GRAPH_COUNTS:
        advice = advise(histogram, fixed["vllm"], source="bench", max_graphs=graphs, max_size=MAX_BATCH)
        row: dict[str, Any] = {"graphs": graphs, "advised": advice.advised.traffic.padding_waste,
                               "advised_sizes": list(advice.sizes)}
        for name, sizes in fixed.items():
            if len(sizes) == graphs:
                row[name] = project(histogram, sizes).traffic.padding_waste
        rows.append(row)
    return rows


def time_advice(batch_sizes: list[int], repeats: int) -> list[float]:
    """Seconds from a list of batch sizes to the advice at vLLM's graph count, ``repeats`` times."""
    current = capture_sizes("vllm", MAX_BATCH)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        advise(Histogram.of(batch_sizes), current, source="bench")
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/advice.json"),
                        help="where to write the JSON result (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2000, help="scheduler steps per speedup (default 2000)")
    parser.add_argument("--warmup-steps", type=int, default=1000,
                        help="steps simulated before measuring, so the engine is busy (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the large advice (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the trace offsets (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="a fast check of every path: 200 steps per speedup, 20,000 batches timed")
    args = parser.parse_args(argv)
    steps, large = (200, 20_000) if args.quick else (args.steps, LARGE_BATCHES)

    by_speedup = sizes_by_speedup(steps, args.warmup_steps, args.seed)
    histogram = Histogram.of(size for sizes in by_speedup.values() for size in sizes)
    rows = compare(histogram)
    loads = per_load(by_speedup)
    # The large histogram: the same traffic, scheduled for as many steps as there are batches.
    per_speedup = -(-large // len(DEFAULT_SPEEDUPS))
    more = sizes_by_speedup(per_speedup, args.warmup_steps, args.seed + 1).values()
    large_sizes = [size for sizes in more for size in sizes][:large]
    seconds = time_advice(large_sizes, args.repeats)

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}%"

    print_table(f"Padding waste on {histogram.total:,} batches of 1..{histogram.largest} tokens",
                ("graphs", "powers of two", "vLLM's list", "advised"),
                [(r["graphs"], pct(r.get("pow2")), pct(r.get("vllm")), pct(r["advised"])) for r in rows])
    headers = ("speedup", "batches", "powers of two (9)", "advised (9)", "vLLM's list (35)", "advised (35)")
    print_table("Each load alone (advised at the fixed list's graph count)", headers,
                [(f"{r['speedup']:g}x", f"{r['smallest']}..{r['largest']}", pct(r["pow2"]),
                  pct(r["advised_pow2"]), pct(r["vllm"]), pct(r["advised_vllm"])) for r in loads])
    median = statistics.median(seconds)
    print(f"\nadvise on {len(large_sizes):,} batches ({len(Histogram.of(large_sizes))} distinct sizes): "
          f"median {median:.3f} s of {len(seconds)} runs (min {min(seconds):.3f}, max {max(seconds):.3f})")
    at = {r["graphs"]: r for r in rows}
    targets = [
        target("pooled: advised waste at 9 graphs over powers of two's", at[9]["advised"] / at[9]["pow2"],
               0.3333),
        target("pooled: advised waste at 35 graphs over vLLM's list's", at[35]["advised"] / at[35]["vllm"],
               0.5),
        target("each load: worst advised over powers of two's at 9", worst_ratio(loads, "pow2"), 0.3333),
        target("each load: worst advised over vLLM's list's at 35", worst_ratio(loads, "vllm"), 0.5),
        target(f"seconds to advise on {len(large_sizes):,} batches", median, 1.0, unit=" s"),
    ]
    print_targets(targets)
    write_results(
        args.out, benchmark="advice", command=command_line(), device=torch.device("cpu"),
        config={"max_batch": MAX_BATCH, "speedups": list(DEFAULT_SPEEDUPS), "steps_per_speedup": steps,
                "warmup_steps": args.warmup_steps, "seed": args.seed, "graph_counts": list(GRAPH_COUNTS),
                "timed_batches": len(large_sizes), "repeats": args.repeats, "quick": args.quick},
        results={"batches": histogram.total, "distinct_sizes": len(histogram), "waste": rows,
                 "per_load": loads, "advise_seconds": seconds, "advise_median_seconds": median},
        targets=targets,
        notes=["waste: padding tokens over the tokens the graphs computed, on the same histogram"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
