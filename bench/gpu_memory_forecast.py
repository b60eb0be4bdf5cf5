"""Will these sizes fit? The pool forecast of an advised list against a real capture of it.

For the reference decoder (small and large, bf16), a ``DecodeRunner`` with a real ``Recorder``
captures vLLM's default list up to 256 (35 sizes) into one shared pool, largest first, and records
each graph's pool bytes, as any run does. From that record alone (``inspector.advice``'s recorded
traffic and cost model, read back from the database) the pool is forecast for other lists:

* the advice on the bundled trace at 9 and 16 graphs (``advise --memory-budget`` bounds lists by
  this forecast), and powers of two up to 256 (9 sizes);

then each list is captured for real in a fresh runtime (a pool of its own) and its pool read from the
caching allocator's segments (``torch.cuda.memory_snapshot()``'s ``segment_pool_id``). Target: every
forecast within 10% of the pool its real capture takes. The recorded list's own forecast is printed
too, and that list is captured a second time in a fresh runtime: whether what its first capture
reserved comes again (the forecast passes over one size's allocator segment jump, see
``inspector.advice.memory``).

    python3 bench/gpu_memory_forecast.py --out bench/results/h200/gpu_memory_forecast.json

``--quick``: the tiny model at sizes 1, 2, 4, 8 (on a CPU the eager backend has no pool: the forecast
is None there and the targets neither met nor missed).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.advice import MAX_BATCH, sizes_by_speedup
from bench.common import (
    base_parser,
    command_line,
    print_table,
    print_targets,
    resolve_device,
    target,
    temporary_recorder,
    write_results,
)
from capture_core.backends import pool_reserved_bytes
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import capture_sizes
from inspector.advice.costs import CostModel, RecordedGraph
from inspector.advice.memory import MIB
from inspector.advice.recommend import advise
from inspector.advice.sizes import Histogram

TARGET = 0.10
"""A forecast within 10% of the pool its real capture takes."""


def capture_pool(model: ReferenceDecoder, sizes: list[int], device: torch.device, recorder: Any = None
                 ) -> tuple[int, list[RecordedGraph]]:
    """Capture ``sizes`` in a fresh runtime: the pool's reserved bytes, and each graph as recorded."""
    runtime = GraphRuntime("cuda" if device.type == "cuda" else "eager", observer=recorder, progress=False)
    runner = DecodeRunner(model, runtime, sizes, mode=CUDAGraphMode.FULL)
    runner.capture()
    if device.type == "cuda":
        torch.cuda.synchronize()
    graphs = [RecordedGraph(d.num_tokens, e.capture_seconds, e.pool_bytes, run_id=1)
              for d, e in sorted(runner.graphs.items(), key=lambda item: -item[0].num_tokens)]
    pool = getattr(runtime.backend, "pool", None)
    real = pool_reserved_bytes(pool) if pool is not None else 0
    del runner, runtime
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return real, graphs


def recorded_costs(url: str) -> CostModel:
    """The cost model as ``graph-inspector advise`` fits it: from the database the recorder wrote."""
    from inspector.reading.queries import Queries
    from inspector.storage.store import open_store

    store = open_store(url, upgrade=False)
    try:
        return CostModel.fit(Queries(store.engine).start_up_graphs())
    finally:
        store.dispose()


def measure_model(name: str, device: torch.device, lists_for: Any, quick: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = [1, 2, 4, 8] if quick else capture_sizes("vllm", MAX_BATCH)
    config = getattr(ModelConfig, name)(dtype=dtype, device=str(device), max_num_seqs=max(sizes))
    model = ReferenceDecoder(config)
    print(f"\n== {name}: {model.param_count() / 1e6:.1f}M parameters", flush=True)
    with temporary_recorder(f"bench gpu_memory_forecast {name}") as recorder:
        recorded_pool, recorded = capture_pool(model, sizes, device, recorder)
        assert recorder.flush(timeout=30), recorder.last_error
        costs = recorded_costs(recorder.url)
    rows = []
    lists = [("recorded list", sizes), ("recorded list, captured again", sizes),
             *lists_for(costs, max(sizes))]
    for index, (label, chosen) in enumerate(lists):
        forecast = costs.pool_bytes(chosen) if costs.pool is not None else None
        real = recorded_pool if index == 0 else capture_pool(model, chosen, device)[0]
        error = None if not real or forecast is None else forecast / real - 1
        rows.append({"list": label, "sizes": chosen, "graphs": len(chosen), "forecast_bytes": forecast,
                     "real_bytes": real, "error": error})
    pools = {g.captured_size: g.pool_bytes for g in recorded}
    return {"model": name, "recorded_sizes": sizes, "recorded_pool_bytes": pools,
            "cost_model": costs.describe(), "lists": rows}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.split("\n\n")[0], default_out="bench/results/gpu_memory_forecast.json",
                         default_budget_s=240)
    parser.add_argument("--models", nargs="+", default=["small", "large"], choices=("tiny", "small", "large"),
                        help="reference decoder sizes (default: small large)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    models = ["tiny"] if args.quick else args.models
    by_speedup = sizes_by_speedup(200 if args.quick else 2000, 1000, 0)
    histogram = Histogram.of(size for batch in by_speedup.values() for size in batch)

    def lists_for(costs: CostModel, top: int) -> list[tuple[str, list[int]]]:
        current = capture_sizes("vllm", top)
        found = [("powers of two", capture_sizes("pow2", top))]
        for graphs in ((2, 3) if args.quick else (9, 16)):
            advice = advise(histogram, current, source="bench", max_graphs=graphs, max_size=top, costs=costs)
            found.append((f"advised, {graphs} graphs", list(advice.sizes)))
        return found

    results = [measure_model(name, device, lists_for, args.quick) for name in models]
    targets = []
    for result in results:
        print_table(
            f"{result['model']}: the pool each list needs, forecast from the recorded list, against a real "
            "capture",
            ("list", "graphs", "forecast", "real", "error"),
            [(r["list"], r["graphs"], _mib(r["forecast_bytes"]), _mib(r["real_bytes"]),
              "-" if r["error"] is None else f"{100 * r['error']:+.1f}%") for r in result["lists"]],
        )
        for row in result["lists"]:
            if row["list"] != "recorded list":
                targets.append(target(f"{result['model']}, {row['list']}: |forecast / real - 1|",
                                      None if row["error"] is None else abs(row["error"]), TARGET,
                                      applies=device.type == "cuda"))
    notes = [] if device.type == "cuda" else [
        "no CUDA device here: the eager backend has no graph pool, so nothing is forecast (not a result)"]
    print_targets(targets)
    write_results(args.out, benchmark="gpu_memory_forecast", command=command_line(), device=device,
                  config={"models": models, "quick": args.quick}, results=results, targets=targets,
                  notes=notes)
    return 0


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f} MiB"


if __name__ == "__main__":
    raise SystemExit(main())
