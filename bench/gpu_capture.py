"""Capture: start-up time and graph-pool memory of the capture core against bare capture.

Two questions, for the reference decoder at two sizes (bf16) and power-of-two buckets 1..256:

* time: capturing every bucket through the capture core (``DecodeRunner.capture()`` with a real
  inspector ``Recorder`` as observer: warm-ups, capture, per-graph pool measurement, events)
  against a bare capture loop (``bench/bare_graphs.py``: the same warm-ups on a side stream, then
  ``torch.cuda.graph`` into one shared pool, largest first). The two alternate over several rounds
  (bare first, then core first, ...) after one untimed warm-up pass, so neither pays for the
  process's first cuBLAS/kernel loads. Target: the core within 1.1x of bare.
* memory: one shared pool captured largest first against one pool per graph, measured from the
  caching allocator's segments by pool id (``torch.cuda.memory_snapshot()``'s
  ``segment_pool_id``; ``memory_allocated()`` cannot see blocks freed inside a pool). Target: the
  shared pool under 1.25x of the largest graph's pool alone. Measured through the capture core
  (``CudaGraphBackend(shared_pool=...)``) and for the bare loop alike.

    python3 bench/gpu_capture.py --out bench/results/gpu_capture.json

``--quick`` captures the tiny model's buckets 1, 2, 4 (on a CPU through the eager backend, where
the bare loop and every memory figure are skipped with a note).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.bare_graphs import BareGraphLoop
from bench.common import (
    Budget,
    base_parser,
    command_line,
    needs_cuda,
    print_table,
    print_targets,
    resolve_device,
    target,
    temporary_recorder,
    write_results,
)
from capture_core.backends import CudaGraphBackend, EagerBackend, pool_reserved_bytes
from capture_core.checks import AddressCheckMode
from capture_core.events import GraphObserver
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import power_of_two_sizes

TIME_TARGET = 1.1
MEMORY_TARGET = 1.25
MIB = 2**20


def free_cuda_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def core_capture(
    model: ReferenceDecoder,
    sizes: list[int],
    device: torch.device,
    recorder: GraphObserver,
    *,
    shared_pool: bool = True,
) -> dict[str, Any]:
    """Capture every bucket through the capture core; seconds and pool bytes (per graph and total).

    Each call is a fresh runtime and runner (a runtime has one capture phase), recording into the
    model's one recorder, as a restarted engine would.
    """
    if device.type == "cuda":
        backend: Any = CudaGraphBackend(shared_pool=shared_pool)
    else:
        backend = EagerBackend()
    runtime = GraphRuntime(
        backend, address_check=AddressCheckMode.ALWAYS_ON, observer=recorder, progress=False
    )
    runner = DecodeRunner(model, runtime, sizes, mode=CUDAGraphMode.FULL)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    runner.capture()
    seconds = time.perf_counter() - started
    per_graph = {d.num_tokens: e.pool_bytes for d, e in runner.graphs.items()}
    result: dict[str, Any] = {"seconds": seconds, "graph_pool_bytes": per_graph}
    if device.type == "cuda":
        pools = {tuple(e.graph.pool) for e in runner.graphs.values()}
        result["pool_bytes_total"] = sum(pool_reserved_bytes(p) for p in pools)
        result["pools"] = len(pools)
        result["snapshot_s"] = snapshot_seconds(next(iter(pools)))
    del runner, runtime
    free_cuda_memory()
    return result


def snapshot_seconds(pool: tuple[int, int], repeats: int = 5) -> float:
    """Median seconds of one pool measurement (a walk of ``torch.cuda.memory_snapshot()``).

    The capture core measures each graph's pool before and after its capture, so twice this per
    graph is what that bookkeeping adds to start-up: the likely "why" of a core/bare time ratio.
    """
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        pool_reserved_bytes(pool)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bare_capture(
    model: ReferenceDecoder, kv_cache: torch.Tensor, sizes: list[int], *, shared_pool: bool = True
) -> dict[str, Any]:
    """Capture every bucket by hand; seconds and pool bytes (per graph pool, and in total)."""
    loop = BareGraphLoop(
        model, kv_cache, sizes, padding_slot=model.config.padding_slot, shared_pool=shared_pool
    )
    pools = {size: tuple(pool) for size, pool in loop.pools.items()}
    result = {
        "seconds": loop.total_capture_seconds,
        "pool_bytes_total": sum(pool_reserved_bytes(p) for p in set(pools.values())),
        "pools": len(set(pools.values())),
        "graph_pool_bytes": {size: pool_reserved_bytes(pool) for size, pool in pools.items()}
        if not shared_pool
        else {},
    }
    del loop
    free_cuda_memory()
    return result


def measure_model(
    name: str, sizes: list[int], device: torch.device, max_rounds: int, seconds: float
) -> tuple[dict[str, Any], list[str]]:
    """Timed rounds (as many as fit in ``seconds``, up to ``max_rounds``), then the memory figures."""
    with ExitStack() as stack:
        return _measure_model(stack, name, sizes, device, max_rounds, seconds)


def _measure_model(
    stack: ExitStack, name: str, sizes: list[int], device: torch.device, max_rounds: int, seconds: float
) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = getattr(ModelConfig, name)(dtype=dtype, device=str(device))
    model = ReferenceDecoder(config)
    result: dict[str, Any] = {
        "model": name,
        "params": model.param_count(),
        "dtype": str(dtype).removeprefix("torch."),
    }
    print(f"\n== {name}: {result['params'] / 1e6:.1f}M parameters, buckets {sizes}", flush=True)
    on_cuda = device.type == "cuda"
    kv_cache = model.new_kv_cache() if on_cuda else None
    recorder = stack.enter_context(temporary_recorder(f"bench gpu_capture {name}"))

    # Untimed: the process's first kernel loads and cuBLAS handles land here, not in round one.
    warm = core_capture(model, sizes, device, recorder)["seconds"]
    # A round captures twice (core and bare); the memory figures after the rounds take four captures.
    rounds = Budget.reps_for(seconds - 4 * warm, 2 * warm, floor=1, ceiling=max_rounds)
    result["rounds"] = rounds
    core_seconds, bare_seconds, snapshots = [], [], []
    for index in range(rounds):
        order = ("bare", "core") if index % 2 == 0 else ("core", "bare")
        for side in order:
            if side == "core":
                core = core_capture(model, sizes, device, recorder)
                core_seconds.append(core["seconds"])
                snapshots.extend([core["snapshot_s"]] if "snapshot_s" in core else [])
            elif on_cuda:
                bare_seconds.append(bare_capture(model, kv_cache, sizes)["seconds"])
    result["core_capture_s"] = core_seconds
    result["core_capture_s_median"] = statistics.median(core_seconds)
    if on_cuda:
        result["bare_capture_s"] = bare_seconds
        result["bare_capture_s_median"] = statistics.median(bare_seconds)
        result["time_ratio"] = result["core_capture_s_median"] / result["bare_capture_s_median"]
        result["core_minus_bare_s"] = result["core_capture_s_median"] - result["bare_capture_s_median"]
        # Two pool measurements per graph: the capture core's bookkeeping the bare loop does not do.
        result["snapshot_s_median"] = statistics.median(snapshots)
        result["pool_measurement_s"] = 2 * len(sizes) * result["snapshot_s_median"]
        core_shared = core_capture(model, sizes, device, recorder, shared_pool=True)
        core_separate = core_capture(model, sizes, device, recorder, shared_pool=False)
        bare_shared = bare_capture(model, kv_cache, sizes, shared_pool=True)
        bare_separate = bare_capture(model, kv_cache, sizes, shared_pool=False)
        largest = max(sizes)
        result["memory"] = {
            "core": _memory(core_shared, core_separate, largest),
            "bare": _memory(bare_shared, bare_separate, largest),
        }
    else:
        notes.append(needs_cuda("the bare capture loop and every pool-memory figure"))
    del kv_cache, model
    free_cuda_memory()
    return result, notes


def _memory(shared: dict[str, Any], separate: dict[str, Any], largest: int) -> dict[str, Any]:
    largest_alone = separate["graph_pool_bytes"][largest]
    return {
        "shared_pool_bytes": shared["pool_bytes_total"],
        "pool_per_graph_bytes": separate["pool_bytes_total"],
        "largest_graph_alone_bytes": largest_alone,
        "shared_over_largest": shared["pool_bytes_total"] / largest_alone if largest_alone else None,
        "per_graph_over_shared": separate["pool_bytes_total"] / shared["pool_bytes_total"]
        if shared["pool_bytes_total"]
        else None,
        "graph_pool_bytes_separate": separate["graph_pool_bytes"],
    }


def run(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    budget = Budget(args.budget_s)
    models = ["tiny"] if args.quick else args.models
    sizes = [1, 2, 4] if args.quick else power_of_two_sizes(args.max_batch)
    rounds = 1 if args.quick else args.rounds
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    failed: list[str] = []
    for index, name in enumerate(models):
        try:
            result, model_notes = measure_model(
                name, sizes, device, rounds, budget.share(len(models) - index)
            )
        except Exception as exc:  # one model failing (e.g. out of memory) keeps the other's figures
            traceback.print_exc()
            failed.append(name)
            message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            notes.append(f"{name}: FAILED, no figures: {type(exc).__name__}: {message}")
            free_cuda_memory()
            continue
        results.append(result)
        notes.extend(n for n in model_notes if n not in notes)
    args.failed_models = failed
    on_cuda = device.type == "cuda"
    targets = []
    for r in results:
        targets.append(
            target(
                f"{r['model']}: capture core / bare capture time",
                r.get("time_ratio"),
                TIME_TARGET,
                unit="x",
                applies=on_cuda,
            )
        )
        memory = r.get("memory", {}).get("core", {})
        targets.append(
            target(
                f"{r['model']}: shared pool / largest graph alone (core)",
                memory.get("shared_over_largest"),
                MEMORY_TARGET,
                unit="x",
                applies=on_cuda,
            )
        )
    config = {
        "models": models,
        "buckets": sizes,
        "max_rounds": rounds,
        "failed_models": failed,
        "warmup_iters": 3,
        "device": str(device),
        "backend": "cuda" if on_cuda else "eager",
        "budget_s": args.budget_s,
        "elapsed_s": budget.elapsed,
        "quick": args.quick,
    }
    payload = write_results(
        args.out,
        benchmark="gpu_capture",
        command=command_line(),
        device=device,
        config=config,
        results=results,
        targets=targets,
        notes=notes,
    )
    rows = [
        (
            r["model"],
            len(sizes),
            r["rounds"],
            r["core_capture_s_median"],
            r.get("bare_capture_s_median"),
            r.get("time_ratio"),
        )
        for r in results
    ]
    print_table(
        "Capture of all buckets (median seconds over the rounds)",
        ("model", "graphs", "rounds", "core s", "bare s", "core/bare", "core-bare s", "2 snapshots/graph s"),
        [
            (*row, r.get("core_minus_bare_s"), r.get("pool_measurement_s"))
            for row, r in zip(rows, results, strict=True)
        ],
    )
    memory_rows = []
    for r in results:
        for side, m in r.get("memory", {}).items():
            memory_rows.append(
                (
                    r["model"],
                    side,
                    m["shared_pool_bytes"] / MIB,
                    m["pool_per_graph_bytes"] / MIB,
                    m["largest_graph_alone_bytes"] / MIB,
                    m["shared_over_largest"],
                    m["per_graph_over_shared"],
                )
            )
    if memory_rows:
        print_table(
            "Graph pool memory (MiB, from allocator segments by pool id)",
            (
                "model",
                "capture",
                "shared",
                "pool per graph",
                "largest alone",
                "shared/largest",
                "per-graph/shared",
            ),
            memory_rows,
        )
    for note in notes:
        print(f"note: {note}")
    print_targets(targets)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.split("\n\n")[0], default_out="bench/results/gpu_capture.json", default_budget_s=90
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=["small", "large"],
        choices=("tiny", "small", "large"),
        help="reference decoder sizes",
    )
    parser.add_argument("--max-batch", type=int, default=256, help="largest bucket (powers of two up to it)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed capture rounds per side (alternating order)"
    )
    args = parser.parse_args(argv)
    run(args)
    return 1 if args.failed_models else 0


if __name__ == "__main__":
    raise SystemExit(main())
