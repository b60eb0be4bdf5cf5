"""Advice on time against advice on tokens: the bundled trace, weighed by measured step times.

Traffic: the bundled Azure conversation trace through the continuous-batching scheduler at the
padding benchmark's speedups, pooled (the "trace, all speedups" histogram of ``bench/advice.py``:
decode batches of 1..256 tokens). Step times: a CSV of ``size,graph_seconds[,eager_seconds]`` per
captured size, as ``bench/gpu_step_time.py`` writes it on the H200 from the graphs' own timed
replays (``--step-times``), the same step-time model ``graph-inspector advise`` builds from a
recorded run.

At 9 graphs (powers of two's count up to 256) and 35 (vLLM's list's), two advices on the same
histogram: padding counted in tokens (what ``advise`` did before step times were recorded) and
padding weighed by the step times (now its default wherever they are recorded). Both are judged by
the step-time model: the modelled step time of every batch at its padded size, summed. Targets: the
timed advice models faster than the token advice at both counts, and keeps a lone request's step
(one token, padded to the smallest advised size) within 5% of its best (a graph of size 1).

    python3 bench/advice_time.py --step-times bench/results/h200/step_times_small.csv \\
        --out bench/results/advice_time_small.json

``--quick`` runs 200 steps per speedup on a made-up launch-bound curve (``--step-times`` not
needed): every code path in seconds, figures not results.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.advice import MAX_BATCH, sizes_by_speedup
from bench.common import command_line, print_table, print_targets, target, write_results
from capture_core.sizes import capture_sizes
from inspector.advice.costs import StepTimes
from inspector.advice.recommend import advise
from inspector.advice.sizes import Histogram
from inspector.advice.weighing import LONE_REQUEST_SLACK, Weighing, modelled_seconds

GRAPH_COUNTS = (9, 35)
QUICK_CURVE = [(1, 0.0005), (64, 0.00052), (128, 0.0006), (256, 0.0009)]
"""A launch-bound-then-compute-bound curve for --quick (made up: never a result)."""


def read_curve(path: Path) -> tuple[StepTimes, StepTimes | None]:
    """The graph (and, where given, eager) step time per size from ``size,graph_seconds[,eager]``."""
    graph, eager = [], []
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if not row or not row[0].strip().isdigit():
                continue
            graph.append((int(row[0]), float(row[1])))
            if len(row) > 2 and row[2].strip():
                eager.append((int(row[0]), float(row[2])))
    return StepTimes.of(graph), (StepTimes.of(eager) if eager else None)


def compare(histogram: Histogram, curve: StepTimes, eager: StepTimes | None, source: str
            ) -> list[dict[str, Any]]:
    """Token advice against timed advice at each graph count, both judged by the step-time model."""
    timed = Weighing(curve, f"the step times in {source}", by_time=True, eager=eager)
    tokens = Weighing.by_tokens("the advice before step times were recorded")
    current = capture_sizes("vllm", MAX_BATCH)
    best_lone = curve(1)
    rows = []
    for graphs in GRAPH_COUNTS:
        row: dict[str, Any] = {"graphs": graphs}
        for name, weighing in (("tokens", tokens), ("time", timed)):
            advice = advise(histogram, current, source="bench", max_graphs=graphs, max_size=MAX_BATCH,
                            weighing=weighing)
            seconds = modelled_seconds(histogram, advice.sizes, timed)
            lone = curve(advice.sizes[0])
            row[name] = {
                "sizes": list(advice.sizes),
                "modelled_step_seconds": seconds,
                "padding_waste": advice.advised.traffic.padding_waste,
                "lone_request_seconds": lone,
                "lone_request_over_best": lone / best_lone - 1,
            }
        row["time_saved"] = 1 - row["time"]["modelled_step_seconds"] / row["tokens"]["modelled_step_seconds"]
        row["same_sizes"] = row["time"]["sizes"] == row["tokens"]["sizes"]
        row["curve_departure_from_affine"] = affine_departure(curve)
        rows.append(row)
    return rows


def affine_departure(curve: StepTimes) -> float:
    """How far the measured step times are from a straight line in tokens (least squares over the
    measured sizes): the largest departure over the time at that size. Where it is small, a padding
    token costs about the same time at every size, so the fewest padding tokens are also about the least
    time, and both advices may choose the same sizes."""
    sizes, seconds = curve.sizes, curve.seconds
    n = len(sizes)
    if n < 2:
        return 0.0
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    spread = sum((x - mean_x) ** 2 for x in sizes)
    pairs = list(zip(sizes, seconds, strict=True))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread if spread else 0.0
    return max(abs(y - (mean_y + slope * (x - mean_x))) / y for x, y in pairs)


def report(rows: list[dict[str, Any]], histogram: Histogram, title: str) -> list[dict[str, Any]]:
    """Print the comparison; the targets it is judged by."""
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f} ms"

    print_table(
        f"{title}: {histogram.total:,} batches of 1..{histogram.largest} tokens, modelled step time summed",
        ("graphs", "tokens: modelled", "time: modelled", "saved", "lone request (tokens)",
         "lone request (time)", "smallest (tokens, time)", "same sizes"),
        [(r["graphs"], f"{r['tokens']['modelled_step_seconds']:.3f} s",
          f"{r['time']['modelled_step_seconds']:.3f} s",
          f"{100 * r['time_saved']:.2f}%",
          f"{ms(r['tokens']['lone_request_seconds'])} (+{100 * r['tokens']['lone_request_over_best']:.1f}%)",
          f"{ms(r['time']['lone_request_seconds'])} (+{100 * r['time']['lone_request_over_best']:.1f}%)",
          f"{r['tokens']['sizes'][0]}, {r['time']['sizes'][0]}", "yes" if r["same_sizes"] else "no")
         for r in rows],
    )
    if rows:
        print(f"the step times depart from a straight line in tokens by at most "
              f"{100 * rows[0]['curve_departure_from_affine']:.1f}% (the straighter, the more alike both "
              "advices choose)")
    targets = []
    for r in rows:
        targets.append(target(f"{title}: timed advice's modelled step time over the token advice's at "
                              f"{r['graphs']} graphs", r["time"]["modelled_step_seconds"]
                              / r["tokens"]["modelled_step_seconds"], 1.0))
        targets.append(target(f"{title}: a lone request's step over its best, timed advice at {r['graphs']} "
                              "graphs", r["time"]["lone_request_over_best"], LONE_REQUEST_SLACK))
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-times", type=Path,
                        help="CSV of size,graph_seconds[,eager_seconds] (bench/gpu_step_time.py writes it)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/advice_time.json"),
                        help="where to write the JSON result (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2000, help="scheduler steps per speedup (default 2000)")
    parser.add_argument("--warmup-steps", type=int, default=1000, help="steps simulated first (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the trace offsets (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="200 steps per speedup on a made-up curve: every path in seconds, not a result")
    args = parser.parse_args(argv)
    if args.step_times is None and not args.quick:
        parser.error("--step-times CSV is needed (or --quick)")
    if args.quick:
        curve, eager, source = StepTimes.of(QUICK_CURVE), None, "a made-up curve (--quick)"
    else:
        try:
            curve, eager = read_curve(args.step_times)
        except (OSError, ValueError) as error:
            parser.error(f"--step-times {args.step_times}: {error}")
        source = str(args.step_times)
    steps = 200 if args.quick else args.steps
    by_speedup = sizes_by_speedup(steps, args.warmup_steps, args.seed)
    histogram = Histogram.of(size for sizes in by_speedup.values() for size in sizes)
    rows = compare(histogram, curve, eager, source)
    targets = report(rows, histogram, "bundled trace, all speedups")
    if args.quick:  # a made-up curve: nothing is met or missed
        targets = [dict(t, met=None) for t in targets]
    print_targets(targets)
    write_results(args.out, benchmark="advice_time", command=command_line(), device=torch.device("cpu"),
                  config={"steps_per_speedup": steps, "step_times": source, "graph_counts": GRAPH_COUNTS,
                          "quick": args.quick},
                  results={"rows": rows,
                           "curve": {"sizes": list(curve.sizes), "seconds": list(curve.seconds)}},
                  targets=targets,
                  notes=["--quick: a made-up curve, figures are not results"] if args.quick else [])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
