"""The capture core's own record (issue 2): buckets 1..256 of the reference decoder on CUDA graphs.

For the ~60M-parameter reference decoder in bf16, power-of-two buckets 1..256, through
``DecodeRunner`` on the capture core:

* capture seconds (warm-ups plus capture) and pool bytes per graph, captured largest first into
  one shared pool;
* graph-pool memory: the shared pool, against one pool per graph, against the largest graph alone
  (each measured from the caching allocator's segments of that pool id);
* replay against eager at every bucket: max abs error against the same model run eagerly on the
  same padded inputs (same shapes, so it should be exactly 0) and on the unpadded batch (bf16
  kernels of another shape: small), and how often the greedy token agrees;
* the cost of the always-on address check: median step time with the check OFF and ALWAYS_ON,
  timed interleaved in one run, per bucket; and the host cost of the wrapper itself per call with
  the replay stubbed out (OFF, ALWAYS_ON), against a bare call, so the figure is not lost in GPU
  time.

    python3 bench/gpu_core.py --out bench/results/gpu_core.json

``--quick`` runs the tiny model on buckets 1, 2, 4 (on a CPU through the eager backend, where the
memory figures are skipped with a note): a check that the script works, not a result.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.check_cost import lagging
from bench.common import (
    Budget,
    CallTimer,
    base_parser,
    command_line,
    needs_cuda,
    print_table,
    print_targets,
    resolve_device,
    target,
    time_interleaved,
    write_results,
)
from capture_core.backends import CudaGraphBackend, EagerBackend, GraphBackend, pool_reserved_bytes
from capture_core.checks import AddressCheckMode
from capture_core.forward_context import ForwardContext, use_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import power_of_two_sizes

MIB = 2**20
SHARED_POOL_TARGET = 1.25  # shared pool / largest graph alone
WRAPPER_TARGET_US = 1.0  # host time the wrapper adds to a replay, check ALWAYS_ON
BF16_ERROR_TARGET = 0.1  # max abs logit error, replay vs unpadded eager


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def make_backend(on_cuda: bool, shared_pool: bool = True) -> GraphBackend:
    return CudaGraphBackend(shared_pool=shared_pool) if on_cuda else EagerBackend()


def captured_runner(
    model: ReferenceDecoder, sizes: list[int], backend: GraphBackend, progress: bool = False
) -> tuple[DecodeRunner, float]:
    runtime = GraphRuntime(backend, address_check=AddressCheckMode.ALWAYS_ON, progress=progress)
    runner = DecodeRunner(model, runtime, sizes, mode=CUDAGraphMode.FULL)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    runner.capture()
    return runner, time.perf_counter() - started


def pools_total(runner: DecodeRunner) -> tuple[int, int]:
    """Reserved bytes of every distinct pool the runner's graphs live in, and how many pools."""
    pools = {tuple(entry.graph.pool) for entry in runner.graphs.values()}
    return sum(pool_reserved_bytes(pool) for pool in pools), len(pools)


def random_batch(config: ModelConfig, num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator)
    positions = torch.randint(0, config.max_seq_len, (num_tokens,), generator=generator)
    slot_ids = torch.randperm(config.max_num_seqs, generator=generator)[:num_tokens]
    return tuple(t.to(config.device) for t in (input_ids, positions, slot_ids))


def replay_vs_eager(runner: DecodeRunner, config: ModelConfig) -> list[dict[str, Any]]:
    """Per bucket: a full bucket and a padded batch, each against eager (padded and unpadded)."""
    rows = []
    for size in runner.capture_sizes:
        for num_tokens in sorted({size, size // 2 + 1}):
            if runner.dispatcher.sizes.pad(num_tokens) != size:
                continue
            batch = random_batch(config, num_tokens, seed=size * 1000 + num_tokens)
            replayed = runner.step(*batch).float().clone()
            views = runner.buffers.views(size)  # the padded inputs the graph just read
            with torch.no_grad():
                padded = runner.model(
                    views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache
                )
            padded = padded[:num_tokens].float()
            unpadded = runner.step_eager(*batch).float()
            rows.append(
                {
                    "bucket": size,
                    "num_tokens": num_tokens,
                    "max_abs_err_same_padded_inputs": (replayed - padded).abs().max().item(),
                    "max_abs_err_unpadded_eager": (replayed - unpadded).abs().max().item(),
                    "max_abs_logit": unpadded.abs().max().item(),
                    "greedy_token_agreement": (replayed.argmax(-1) == unpadded.argmax(-1))
                    .float()
                    .mean()
                    .item(),
                }
            )
    return rows


def check_cost_per_step(
    runner: DecodeRunner, config: ModelConfig, buckets: list[int], timer: CallTimer, rounds: int, iters: int
) -> list[dict[str, Any]]:
    """Median step time with the address check OFF and ALWAYS_ON, interleaved, per bucket."""
    runtime = runner.runtime
    rows = []
    for size in buckets:
        batch = random_batch(config, size, seed=size)

        def step_with(
            mode: AddressCheckMode, batch: tuple[torch.Tensor, ...] = batch
        ) -> Callable[[], object]:
            def call() -> object:
                runtime.address_check = mode
                return runner.step(*batch)

            return call

        samples = time_interleaved(
            {"off": step_with(AddressCheckMode.OFF), "always_on": step_with(AddressCheckMode.ALWAYS_ON)},
            timer,
            rounds=rounds,
            iters=iters,
        )
        off, on = statistics.median(samples["off"]), statistics.median(samples["always_on"])
        rows.append(
            {
                "bucket": size,
                "step_ms_check_off": off,
                "step_ms_check_always_on": on,
                "difference_us": (on - off) * 1e3,
                "samples_each": len(samples["off"]),
            }
        )
    runtime.address_check = AddressCheckMode.ALWAYS_ON
    return rows


def wrapper_host_cost(runner: DecodeRunner, size: int, calls: int, repeats: int) -> dict[str, Any]:
    """Host nanoseconds per call: a bare (stubbed) replay, and the wrapper around it, check OFF / ON.

    The replay itself is stubbed out so that GPU time and launch queues cannot hide a sub-microsecond
    difference; the forward context is entered once outside the loop, as it is once per step. Every
    variant also sets the stale-input check's version cells back, standing for the step's writes.
    """
    descriptor = runner.route(size).descriptor  # the captured descriptor object, as step() uses
    entry = runner.graphed.graphs[descriptor]
    graph = entry.graph
    real_replay = graph.replay
    views = runner.buffers.views(size)
    args = (views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)
    runtime = runner.runtime

    def stub() -> None:
        return None

    def per_call(fn: Callable[[], object]) -> float:
        best = []
        for _ in range(repeats):
            started = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            best.append((time.perf_counter_ns() - started) / calls)
        return statistics.median(best)

    written = lagging(entry.checks.per_step)  # the step's writes, so the stale-input terms pass
    graph.replay = stub
    try:
        with use_forward_context(ForwardContext(CUDAGraphMode.FULL, descriptor, size)):
            bare = per_call(lambda: (written(), graph.replay()))
            runtime.address_check = AddressCheckMode.OFF
            off = per_call(lambda: (written(), runner.graphed(*args)))
            runtime.address_check = AddressCheckMode.ALWAYS_ON
            on = per_call(lambda: (written(), runner.graphed(*args)))
    finally:
        graph.replay = real_replay
        runtime.address_check = AddressCheckMode.ALWAYS_ON
    return {
        "bucket": size,
        "inputs_checked": len(entry.input_names),
        "bare_call_ns": bare,
        "wrapper_check_off_ns": off,
        "wrapper_check_always_on_ns": on,
        "added_check_off_us": (off - bare) / 1e3,
        "added_check_always_on_us": (on - bare) / 1e3,
        "check_alone_ns": on - off,
    }


def run(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    on_cuda = device.type == "cuda"
    budget = Budget(args.budget_s)
    notes: list[str] = []
    if args.quick:
        if not on_cuda:
            torch.set_num_threads(1)  # the tiny model's kernels only contend for threads on a CPU
        config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=64, device=str(device))
        sizes = [1, 2, 4]
    else:
        dtype = torch.bfloat16 if on_cuda else torch.float32
        config = ModelConfig.small(dtype=dtype, device=str(device), max_num_seqs=args.max_batch)
        sizes = power_of_two_sizes(args.max_batch)
    model = ReferenceDecoder(config)
    print(f"reference decoder: {model.param_count() / 1e6:.1f}M parameters, {config.dtype}, buckets {sizes}")

    # 1. Shared pool, largest first: per-graph capture seconds and pool bytes.
    backend = make_backend(on_cuda)
    runner, capture_all_s = captured_runner(model, sizes, backend, progress=True)
    per_graph = [
        {"bucket": d.num_tokens, "capture_s": e.capture_seconds, "pool_bytes": e.pool_bytes}
        for d, e in sorted(runner.graphs.items(), key=lambda item: item[0].num_tokens)
    ]
    memory: dict[str, Any] = {}
    if on_cuda:
        memory["shared_pool_bytes"], _ = pools_total(runner)

    # 2. Replay against eager at every bucket.
    accuracy = replay_vs_eager(runner, config)

    # 3. The always-on check: per step (real replays), and per wrapper call (host only).
    timer = CallTimer(device)
    step_buckets = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    rounds, iters = (2, 5) if args.quick else (6, Budget.reps_for(budget.share(3), 0.3, floor=10, ceiling=60))
    check_steps = check_cost_per_step(runner, config, step_buckets, timer, rounds, iters)
    host = [wrapper_host_cost(runner, size, 2000 if not args.quick else 200, 15) for size in step_buckets]
    del runner, backend
    free_memory()

    # 4. One pool per graph, and the largest graph alone.
    if on_cuda:
        separate, _ = captured_runner(model, sizes, make_backend(True, shared_pool=False))
        memory["pool_per_graph_bytes"], memory["pools_per_graph"] = pools_total(separate)
        memory["pool_per_graph_each"] = {d.num_tokens: e.pool_bytes for d, e in separate.graphs.items()}
        del separate
        free_memory()
        alone, _ = captured_runner(model, [sizes[-1]], make_backend(True))
        memory["largest_alone_bytes"], _ = pools_total(alone)
        del alone
        free_memory()
        memory["shared_over_largest"] = memory["shared_pool_bytes"] / memory["largest_alone_bytes"]
        memory["per_graph_over_shared"] = memory["pool_per_graph_bytes"] / memory["shared_pool_bytes"]
    else:
        notes.append(needs_cuda("every graph-pool memory figure (the eager backend holds no pool)"))
        notes.append("on the eager backend a 'replay' re-runs the model: step times are not graph timings")

    worst_padded = max(r["max_abs_err_same_padded_inputs"] for r in accuracy)
    worst_unpadded = max(r["max_abs_err_unpadded_eager"] for r in accuracy)
    worst_host = max(h["added_check_always_on_us"] for h in host)
    targets = [
        target("shared pool / largest graph alone", memory.get("shared_over_largest"), SHARED_POOL_TARGET,
               unit="x", applies=on_cuda),
        target("replay vs eager on the same padded inputs, max abs error", worst_padded, 1e-6,
               applies=on_cuda),
        target("replay vs unpadded eager, max abs logit error", worst_unpadded, BF16_ERROR_TARGET,
               applies=on_cuda),
        target("wrapper host time added to a replay, check ALWAYS_ON", worst_host, WRAPPER_TARGET_US,
               unit=" us", applies=on_cuda),
    ]
    results = {
        "params": model.param_count(),
        "capture_all_s": capture_all_s,
        "per_graph": per_graph,
        "memory": memory,
        "replay_vs_eager": accuracy,
        "check_cost_per_step": check_steps,
        "wrapper_host_cost": host,
    }
    config_record = {
        "model": "tiny" if args.quick else "small",
        "dtype": str(config.dtype).removeprefix("torch."),
        "max_seq_len": config.max_seq_len,
        "buckets": sizes,
        "warmup_iters": 3,
        "backend": "cuda" if on_cuda else "eager",
        "budget_s": args.budget_s,
        "elapsed_s": budget.elapsed,
        "quick": args.quick,
    }
    payload = write_results(
        args.out, benchmark="gpu_core", command=command_line(), device=device,
        config=config_record, results=results, targets=targets, notes=notes,
    )
    print_report(results)
    print_targets(targets)
    for note in notes:
        print(f"note: {note}")
    print(f"\nwrote {args.out}")
    return payload


def print_report(results: dict[str, Any]) -> None:
    print_table(
        f"Capture, largest first into one shared pool ({results['capture_all_s']:.2f} s for all)",
        ("bucket", "capture s", "pool MiB"),
        [(g["bucket"], g["capture_s"], g["pool_bytes"] / MIB) for g in results["per_graph"]],
    )
    memory = results["memory"]
    if memory:
        print_table(
            "Graph-pool memory",
            ("layout", "MiB", "pools"),
            [
                ("one shared pool, largest first", memory["shared_pool_bytes"] / MIB, 1),
                ("one pool per graph", memory["pool_per_graph_bytes"] / MIB, memory["pools_per_graph"]),
                ("largest graph alone", memory["largest_alone_bytes"] / MIB, 1),
            ],
        )
    print_table(
        "Replay vs eager",
        ("bucket", "tokens", "err same padded", "err unpadded", "max |logit|", "greedy agree"),
        [
            (r["bucket"], r["num_tokens"], r["max_abs_err_same_padded_inputs"],
             r["max_abs_err_unpadded_eager"], r["max_abs_logit"], r["greedy_token_agreement"])
            for r in results["replay_vs_eager"]
        ],
    )
    print_table(
        "Always-on address check, per step (median ms, interleaved)",
        ("bucket", "check off ms", "always on ms", "diff us", "samples"),
        [
            (r["bucket"], r["step_ms_check_off"], r["step_ms_check_always_on"], r["difference_us"],
             r["samples_each"])
            for r in results["check_cost_per_step"]
        ],
    )
    print_table(
        "Wrapper host cost per call, replay stubbed (median ns)",
        ("bucket", "inputs", "bare", "wrapper off", "wrapper on", "added on us", "check ns"),
        [
            (h["bucket"], h["inputs_checked"], h["bare_call_ns"], h["wrapper_check_off_ns"],
             h["wrapper_check_always_on_ns"], h["added_check_always_on_us"], h["check_alone_ns"])
            for h in results["wrapper_host_cost"]
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.splitlines()[0], default_out="bench/results/gpu_core.json", default_budget_s=90
    )
    parser.add_argument("--max-batch", type=int, default=256, help="largest bucket (default 256)")
    args = parser.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
