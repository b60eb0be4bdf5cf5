"""What each graph is worth: graph against eager step time at every capture size, as the cache times it.

For the reference decoder's small (~60M) and large (~1.3B) models, bf16, on vLLM's default capture
list up to 256 (35 sizes), a ``DecodeRunner`` with a real ``Recorder`` times its own steps the way
it does in production (``capture_core.step_time``): the first ``--samples`` replays of every graph are
sampled, each timed with CUDA events on the stream (read once complete, nothing waits), and the
canary runs the same step eagerly, timed the same way. The figures per size are the medians of
those samples: replay time, eager time, and the speedup (eager over replay); the recorder's
``step_times`` row (means) is read back beside them.

Beside the cache's own figures, the same steps timed the benchmark way (``bench/common.py``: each
step bracketed by events and synchronised, interleaved rounds): the runner's step with its checks off
(copy in, replay, slice) and the model called eagerly. The cache times the replay alone, so its
figure sits a little below the runner's step; the two are side by side so the difference is seen.

Each model's curve is written as ``step_times_<model>.csv`` (``size,graph_seconds,eager_seconds``)
beside ``--out``, and the advice on the bundled trace is judged with it (``bench/advice_time.py``):
timed advice against token advice at 9 and 35 graphs, and a lone request's step.

    python3 bench/gpu_step_time.py --out bench/results/h200/gpu_step_time.json

``--quick``: the tiny model at sizes 1, 2, 4 in seconds (on a CPU the eager backend stands in and
times with the host clock: replay and eager are the same computation there, so the figures are no
graph speedup and no result).
"""

from __future__ import annotations

import csv
import gc
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.advice import MAX_BATCH, sizes_by_speedup
from bench.advice_time import compare, report
from bench.common import (
    Budget,
    CallTimer,
    Stats,
    base_parser,
    command_line,
    print_table,
    print_targets,
    resolve_device,
    temporary_recorder,
    time_interleaved,
    write_results,
)
from capture_core.canary import Sampling
from capture_core.checks import AddressCheckMode
from capture_core.events import FanOutObserver
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import capture_sizes
from inspector.advice.costs import StepTimes
from inspector.advice.sizes import Histogram

POSITION = 100
"""Every request of a timed step decodes at this position (as in bench/gpu_decode.py)."""


class KeptStepTimes:
    """An observer that keeps every timed step: (mode, size, path) -> seconds."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, int, str], list[float]] = defaultdict(list)
        self.clocks: set[str] = set()

    def on_capture(self, event: Any) -> None: ...

    def on_replay(self, *args: Any) -> None: ...

    def on_eager(self, *args: Any) -> None: ...

    def on_violation(self, event: Any) -> None: ...

    def on_step_time(self, mode: CUDAGraphMode, descriptor: Any, graph_seconds: float | None,
                     eager_seconds: float | None, samples: int = 1, clock: str = "") -> None:
        self.clocks.add(clock)
        for path, seconds in (("graph", graph_seconds), ("eager", eager_seconds)):
            if seconds is not None:
                self.samples[(mode.label, descriptor.num_tokens, path)].extend([seconds] * samples)


def decode_inputs(batch: int, config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(0, config.vocab_size, (batch,), generator=generator).to(device)
    positions = torch.full((batch,), min(POSITION, config.max_seq_len - 1), dtype=torch.long, device=device)
    slot_ids = torch.arange(batch, dtype=torch.long, device=device)
    return input_ids, positions, slot_ids


def measure_model(name: str, sizes: list[int], device: torch.device, args: Any, budget: Budget,
                  models_left: int) -> dict[str, Any]:
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    config = getattr(ModelConfig, name)(dtype=dtype, device=str(device), max_num_seqs=max(sizes))
    model = ReferenceDecoder(config)
    kept = KeptStepTimes()
    print(f"\n== {name}: {model.param_count() / 1e6:.1f}M parameters, {len(sizes)} capture sizes", flush=True)
    with temporary_recorder(f"bench gpu_step_time {name}") as recorder:
        runtime = GraphRuntime("cuda" if on_cuda else "eager", observer=FanOutObserver(kept, recorder),
                               progress=False, canary=True, sampling=Sampling(first=args.samples, every=0))
        runner = DecodeRunner(model, runtime, sizes, mode=CUDAGraphMode.FULL)
        runner.capture()
        for size in sizes:  # the cache's own timing: every replay of these is sampled
            inputs = decode_inputs(size, config, device)
            for _ in range(args.samples):
                runner.step(*inputs)
        runtime.collect_step_times()
        assert recorder.flush(timeout=30), recorder.last_error
        recorded = _recorded_means(recorder.url)
        # The benchmark's own timing, side by side: the runner's step (checks off) and eager.
        timer = CallTimer(device)
        runtime.address_check = AddressCheckMode.OFF
        bench: dict[int, dict[str, float]] = {}
        for index, size in enumerate(sizes):
            inputs = decode_inputs(size, config, device)
            variants = {"runner": lambda i=inputs: runner.step(*i),
                        "eager": lambda i=inputs: _eager(model, runner.kv_cache, i)}
            share = budget.share((len(sizes) - index) + (models_left - 1) * len(sizes))
            rounds = max(3, min(args.rounds, int(share / max(1e-3, 2 * args.iters * 0.01))))
            samples = time_interleaved(variants, timer, rounds=rounds, iters=args.iters)
            bench[size] = {variant: Stats.of(times).median / 1e3 for variant, times in samples.items()}
        runtime.address_check = AddressCheckMode.ALWAYS_ON
        violations = _violations(recorder.url)
    rows = []
    for size in sizes:
        graph = kept.samples.get(("full", size, "graph"), [])
        eager = kept.samples.get(("full", size, "eager"), [])
        g, e = (statistics.median(graph) if graph else None), (statistics.median(eager) if eager else None)
        rows.append({
            "size": size, "graph_samples": len(graph), "eager_samples": len(eager),
            "graph_seconds": g, "eager_seconds": e, "speedup": None if not g or e is None else e / g,
            "recorded_mean": recorded.get(size),
            "bench_runner_step_seconds": bench[size]["runner"], "bench_eager_seconds": bench[size]["eager"],
            "bench_speedup": bench[size]["eager"] / bench[size]["runner"],
        })
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return {"model": name, "clocks": sorted(kept.clocks), "sizes": rows, "violations": violations}


def _eager(model: ReferenceDecoder, kv_cache: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs, kv_cache)


def _recorded_means(url: str) -> dict[int, dict[str, float | None]]:
    """What the recorder wrote: the mean replay and eager time per captured size (``step_times``)."""
    from sqlalchemy import select

    from inspector.storage.models import StepTime
    from inspector.storage.store import open_store

    store = open_store(url, upgrade=False)
    try:
        with store.engine.connect() as conn:
            rows = conn.execute(select(StepTime.captured_size, StepTime.graph_seconds, StepTime.graph_samples,
                                       StepTime.eager_seconds, StepTime.eager_samples)
                                .where(StepTime.mode == "full")).all()
    finally:
        store.dispose()
    return {size: {"graph_seconds": gs / gn if gn else None, "eager_seconds": es / en if en else None}
            for size, gs, gn, es, en in rows}


def _violations(url: str) -> int:
    """Findings the run recorded (the canary compared every sampled step: none expected)."""
    from sqlalchemy import func, select

    from inspector.storage.models import Violation
    from inspector.storage.store import open_store

    store = open_store(url, upgrade=False)
    try:
        with store.engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(Violation)) or 0)
    finally:
        store.dispose()


def write_curve(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["size", "graph_seconds", "eager_seconds"])
        for row in rows:
            if row["graph_seconds"] is not None:
                out.writerow([row["size"], f"{row['graph_seconds']:.9f}",
                              "" if row["eager_seconds"] is None else f"{row['eager_seconds']:.9f}"])


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n\n")[0], default_out="bench/results/gpu_step_time.json",
                         default_budget_s=240)
    parser.add_argument("--models", nargs="+", default=["small", "large"], choices=("tiny", "small", "large"),
                        help="reference decoder sizes (default: small large)")
    parser.add_argument("--samples", type=int, default=20,
                        help="sampled (timed) replays and canary steps per capture size (default 20)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="most interleaved rounds of the side-by-side check (default 10)")
    parser.add_argument("--iters", type=int, default=3, help="steps per round of the side-by-side check")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda":
        torch.set_num_threads(1)  # the tiny model's kernels: threads only spin against each other
    models = ["tiny"] if args.quick else args.models
    sizes = [1, 2, 4] if args.quick else capture_sizes("vllm", MAX_BATCH)
    if args.quick:
        args.samples, args.rounds = min(args.samples, 3), 3
    notes = [] if device.type == "cuda" else [
        "no CUDA device here: the eager backend stands in, its 'replay' re-runs the model, timed with the "
        "host clock (no graph, no speedup: not a result)"]
    budget = Budget(args.budget_s)
    results, targets = [], []
    steps = 200 if args.quick else 2000
    by_speedup = sizes_by_speedup(steps, 1000, 0)
    histogram = Histogram.of(size for batch in by_speedup.values() for size in batch)
    for index, name in enumerate(models):
        result = measure_model(name, sizes, device, args, budget, len(models) - index)
        curve_path = args.out.parent / f"step_times_{name}.csv"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_curve(curve_path, result["sizes"])
        result["curve_csv"] = str(curve_path)
        rows = result["sizes"]
        print_table(
            f"{name}: step time per capture size (the cache's own timing, medians of {args.samples})",
            ("size", "replay", "eager", "speedup", "bench: runner step", "bench: eager", "bench speedup"),
            [(r["size"], _us(r["graph_seconds"]), _us(r["eager_seconds"]),
              "-" if r["speedup"] is None else f"x{r['speedup']:.2f}", _us(r["bench_runner_step_seconds"]),
              _us(r["bench_eager_seconds"]), f"x{r['bench_speedup']:.2f}") for r in rows],
        )
        timed = [(r["size"], r["graph_seconds"]) for r in rows if r["graph_seconds"] is not None]
        eager = [(r["size"], r["eager_seconds"]) for r in rows if r["eager_seconds"] is not None]
        if len(timed) >= 2:  # --quick and a CPU: the code path only (its targets are neither met nor missed)
            comparison = compare(histogram, StepTimes.of(timed), StepTimes.of(eager) if eager else None,
                                 str(curve_path))
            result["advice"] = comparison
            targets += report(comparison, histogram, f"{name} model")
        results.append(result)
    if device.type != "cuda":
        targets = [dict(t, met=None) for t in targets]
    print_targets(targets)
    write_results(args.out, benchmark="gpu_step_time", command=command_line(), device=device,
                  config={"models": models, "sizes": sizes, "samples": args.samples, "quick": args.quick},
                  results=results, targets=targets, notes=notes)
    return 0


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    raise SystemExit(main())
