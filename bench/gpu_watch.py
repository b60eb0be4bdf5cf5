"""Watching engines that capture their own CUDA graphs (``inspector.watch``), end to end on a GPU.

Three parts, one run, everything recorded into one SQLite file (``--db``, default beside the JSON)
that ``graph-inspector serve --db ...`` shows afterwards:

1. **A plain PyTorch decode loop** over the reference decoder that captures its own graphs, the
   way hand-written engines do: one ``torch.cuda.graph`` per batch bucket, largest first, one
   shared pool, static inputs; then ``--steps`` decode steps of random batch sizes replay them.
   Watched with ``install(db, ready_after=...)``; after the steps one new bucket is captured on
   the serving path, which must be recorded as an unexpected capture with its stack. Checked:
   replay equals eager, and the database holds every graph, its replays, its pool bytes, the
   never-replayed buckets and the unexpected capture.
2. **torch.compile(mode="reduce-overhead")** on the reference decoder, twice: (a) the KV cache
   passed as an ordinary input, which the model writes in place, so inductor skips CUDA graphs
   ("skipping cudagraphs due to mutated inputs") - the skip must be recorded with its reason; (b)
   the KV cache marked static (``torch._dynamo.mark_static_address``), so cudagraph trees capture
   and replay - the graphs and their replays must be recorded.
3. **The cost of watching**: host microseconds per ``replay()`` of a one-kernel graph, bare
   against watched (the hook and a real Recorder into SQLite), interleaved burst by burst in one
   run. Target: under 1 us added per replay.

    python3 bench/gpu_watch.py --out bench/results/h200/gpu_watch.json

Without CUDA every part says it was skipped (the CPU tests cover the hooks on an eager stand-in).
"""

from __future__ import annotations

import random
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    Budget,
    Stats,
    base_parser,
    command_line,
    host_us_per_call,
    needs_cuda,
    print_table,
    print_targets,
    resolve_device,
    target,
    write_results,
)
from capture_core.reference import ModelConfig, ReferenceDecoder
from inspector import watch
from inspector.storage.store import open_store
from inspector.watch.summary import WatchSummary, watch_summary

TARGET_ADDED_US = 1.0
BUCKETS = (256, 128, 64, 32, 16, 8, 4, 2, 1)
"""Capture sizes, largest first so the smaller graphs reuse the shared pool."""
LATE_BUCKET = 48
"""A size first seen on the serving path: its capture is the unexpected one."""


# ------------------------------------------------------------------------------ 1. the decode loop


class DecodeLoop:
    """A hand-written engine: static inputs, one graph per bucket in a shared pool, pad and replay."""

    def __init__(self, model: ReferenceDecoder) -> None:
        config = model.config
        self.model = model
        self.config = config
        device = torch.device(config.device)
        size = max(BUCKETS)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_ids = torch.full((size,), config.padding_slot, dtype=torch.long, device=device)
        self.kv_cache = model.new_kv_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    def views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        return self.input_ids[:bucket], self.positions[:bucket], self.slot_ids[:bucket], self.kv_cache

    def capture(self, bucket: int) -> None:
        """Warm up on a side stream, then capture this bucket's graph into the shared pool."""
        graph = torch.cuda.CUDAGraph()
        self.outputs[bucket] = capture_step(graph, self.model, *self.views(bucket), pool=self.pool)
        self.pool = graph.pool() if self.pool is None else self.pool
        self.graphs[bucket] = graph

    def bucket_for(self, batch: int) -> int:
        return min(b for b in self.graphs if b >= batch)

    def stage(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, bucket: int) -> None:
        n = tokens.shape[0]
        self.input_ids[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.slot_ids[:n].copy_(slots)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_ids[n:bucket].fill_(self.config.padding_slot)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        bucket = self.bucket_for(tokens.shape[0])
        self.stage(tokens, positions, slots, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: tokens.shape[0]]


def capture_step(
    graph: torch.cuda.CUDAGraph,
    model: ReferenceDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    kv_cache: torch.Tensor,
    pool: Any = None,
) -> torch.Tensor:
    """The engine's capture call site: the watch names graphs by this line and these shapes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(input_ids, positions, slot_ids, kv_cache)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, pool=pool):
        logits = model(input_ids, positions, slot_ids, kv_cache)
    return logits


def random_batch(rng: random.Random, config: ModelConfig, step: int, device: torch.device) -> tuple:
    batch = rng.randint(1, 96)  # real traffic rarely fills the largest buckets: they stay unreplayed
    tokens = torch.randint(0, config.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), step % config.max_seq_len, dtype=torch.long, device=device)
    slots = torch.arange(batch, dtype=torch.long, device=device)
    return tokens, positions, slots


def run_decode_loop(db: str, config: ModelConfig, steps: int, ready_after: int, seed: int) -> dict[str, Any]:
    label = f"gpu_watch decode loop #{secrets.token_hex(3)}"
    device = torch.device(config.device)
    model = ReferenceDecoder(config, seed=seed)
    engine = DecodeLoop(model)
    watcher = watch.install(db, label=label, ready_after=ready_after)
    try:
        started = time.perf_counter()
        for bucket in BUCKETS:
            engine.capture(bucket)
        capture_s = time.perf_counter() - started
        rng = random.Random(seed)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for step in range(steps):
            engine.step(*random_batch(rng, config, step, device))
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - started) / steps
        tokens, positions, slots = random_batch(rng, config, steps, device)
        replayed = engine.step(tokens, positions, slots).clone()
        with torch.no_grad():
            eager = model(tokens, positions, slots, engine.kv_cache)
        max_diff = float((replayed - eager).abs().max())
        engine.capture(LATE_BUCKET)  # a new size on the serving path
        ready = watcher.ready_reason
        pools = {str(g.pool) for g in watcher.graphs}
    finally:
        watch.uninstall()
    summary = summary_of(db, label)
    unexpected = [g for g in summary.graphs if g.unexpected]
    return {
        "label": label,
        "model_params": model.param_count(),
        "buckets": list(BUCKETS),
        "steps": steps,
        "capture_all_s": capture_s,
        "step_ms": step_s * 1e3,
        "replay_vs_eager_max_abs_diff": max_diff,
        "ready": ready,
        "graphs": len(summary.graphs),
        "replays_recorded": summary.replays,
        "replays_expected": steps + 1,
        "pool_bytes_total": sum(g.pool_bytes for g in summary.graphs),
        "pools": len(pools),
        "never_replayed": [g.key for g in summary.never_replayed],
        "unexpected_captures": [g.key for g in unexpected],
        "violations": summary.violations,
        "per_graph": [
            {"key": g.key, "replays": g.replays, "pool_bytes": g.pool_bytes, "capture_s": g.capture_seconds}
            for g in summary.graphs
        ],
    }


# ------------------------------------------------------------------------------ 2. torch.compile


def run_compiled(db: str, config: ModelConfig, steps: int, seed: int) -> dict[str, Any]:
    results = {}
    for variant, static_cache in (("kv cache as input", False), ("kv cache marked static", True)):
        torch._dynamo.reset()
        label = f"gpu_watch torch.compile, {variant} #{secrets.token_hex(3)}"
        model = ReferenceDecoder(config, seed=seed)
        kv_cache = model.new_kv_cache()
        if static_cache:
            torch._dynamo.mark_static_address(kv_cache)
        compiled = torch.compile(model, mode="reduce-overhead")
        device = torch.device(config.device)
        batch = 8
        tokens = torch.randint(0, config.vocab_size, (batch,), device=device)
        slots = torch.arange(batch, dtype=torch.long, device=device)
        watch.install(db, label=label)
        try:
            started = time.perf_counter()
            with torch.no_grad():
                for step in range(steps):
                    positions = torch.full((batch,), step, dtype=torch.long, device=device)
                    compiled(tokens, positions, slots, kv_cache)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        finally:
            watch.uninstall()
        summary = summary_of(db, label)
        results[variant] = {
            "label": label,
            "steps": steps,
            "seconds_incl_compile": seconds,
            "graphs": len(summary.graphs),
            "replays_recorded": summary.replays,
            "graph_keys": [g.key for g in summary.graphs],
            "sites": sorted({g.site for g in summary.graphs}),
            "compile_events": [
                {"kind": e.kind, "function": e.function, "reason": e.reason, "count": e.count}
                for e in summary.compile_events
            ],
            "violations": summary.violations,
        }
    return results


# ------------------------------------------------------------------------------ 3. the cost


def one_kernel_graph(x: torch.Tensor) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.mul(2.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul(2.0)
    return graph


def run_overhead(db: str, budget: Budget, calls: int, max_repeats: int, quick: bool) -> list[dict[str, Any]]:
    """Host us per replay: the original ``replay`` against the watch's, same calling convention."""
    x = torch.ones(1024, device="cuda")
    unwatched = one_kernel_graph(x)  # captured before the watch: the hook runs, finds nothing
    watch.install(db, label=f"gpu_watch overhead #{secrets.token_hex(3)}")
    try:
        watched = one_kernel_graph(x)
        hooked = torch.cuda.CUDAGraph.__dict__["replay"]
        original = hooked.__wrapped__
        variants: dict[str, Callable[[], object]] = {
            "bare replay()": lambda: original(watched),
            "watched replay(), recorder": lambda: hooked(watched),
            "hooked replay() of an unwatched graph": lambda: hooked(unwatched),
        }
        device = torch.device("cuda")
        probe = {
            n: Stats.of(host_us_per_call(f, calls=calls, repeats=3, device=device)).median
            for n, f in variants.items()
        }
        per_round_s = sum(probe.values()) * calls / 1e6
        repeats = (
            5 if quick else Budget.reps_for(budget.left * 0.8, per_round_s, floor=20, ceiling=max_repeats)
        )
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                samples[name].extend(host_us_per_call(fn, calls=calls, repeats=1, device=device))
    finally:
        watch.uninstall()
    bare = Stats.of(samples["bare replay()"]).median
    rows = []
    for name, values in samples.items():
        stats = Stats.of(values)
        rows.append(
            {
                "variant": name,
                **stats.as_dict("us"),
                "added_us": stats.median - bare,
                "bursts": repeats,
                "calls_per_burst": calls,
            }
        )
    return rows


# ------------------------------------------------------------------------------ the run


def summary_of(db: str, label: str) -> WatchSummary:
    store = open_store(db, upgrade=False)
    try:
        return watch_summary(store, label=label)
    finally:
        store.dispose()


def run(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    budget = Budget(args.budget_s)
    out = Path(args.out)
    db_path = Path(args.db) if args.db else out.with_suffix(".db")
    db = f"sqlite:///{db_path.resolve()}"
    notes: list[str] = []
    results: dict[str, Any] = {"db": db}
    targets = []
    if device.type != "cuda":
        notes += [needs_cuda(part) for part in ("decode loop", "torch.compile", "replay overhead")]
    else:
        if db_path.exists() and not args.db:
            db_path.unlink()  # our own output from an earlier run: start clean
        for suffix in ("-wal", "-shm"):
            with_suffix = Path(f"{db_path}{suffix}")
            if with_suffix.exists() and not args.db:
                with_suffix.unlink()
        size = "tiny" if args.quick else args.model
        config = getattr(ModelConfig, size)(device="cuda")
        steps = 20 if args.quick else args.steps
        results["decode_loop"] = run_decode_loop(
            db, config, steps, ready_after=min(50, steps), seed=args.seed
        )
        if args.no_compile:
            notes.append("torch.compile part skipped (--no-compile)")
        else:
            compile_config = getattr(ModelConfig, "tiny" if args.quick else args.compile_model)(device="cuda")
            results["compiled"] = run_compiled(db, compile_config, args.compile_steps, seed=args.seed)
        results["overhead"] = run_overhead(
            db, budget, 50 if args.quick else args.calls, args.repeats, args.quick
        )
        added = next(
            r["added_us"] for r in results["overhead"] if r["variant"] == "watched replay(), recorder"
        )
        loop = results["decode_loop"]
        targets = [
            target("watched replay(): host us added per replay", added, TARGET_ADDED_US, unit=" us"),
            target(
                "decode loop: replays lost between hook and database",
                abs(loop["replays_expected"] - loop["replays_recorded"]),
                1,
            ),
            target("decode loop: unexpected captures not recorded", 1 - len(loop["unexpected_captures"]), 1),
            target("decode loop: replay vs eager max |diff|", loop["replay_vs_eager_max_abs_diff"], 1e-3),
        ]
    config = {
        "device": str(device),
        "model": args.model,
        "compile_model": args.compile_model,
        "steps": args.steps,
        "compile_steps": args.compile_steps,
        "quick": args.quick,
    }
    payload = write_results(
        out,
        benchmark="gpu_watch",
        command=command_line(),
        device=device,
        config=config,
        results=results,
        targets=targets,
        notes=notes,
    )
    report(results, notes, targets)
    return payload


def report(results: dict[str, Any], notes: list[str], targets: list[dict[str, Any]]) -> None:
    loop = results.get("decode_loop")
    if loop:
        print_table(
            f"Decode loop watched into {results['db']} ({loop['steps']} steps, {loop['graphs']} graphs)",
            ("graph", "replays", "pool MiB", "capture ms"),
            [
                (g["key"], g["replays"], g["pool_bytes"] / 2**20, g["capture_s"] * 1e3)
                for g in loop["per_graph"]
            ],
        )
        print(
            f"replay vs eager max |diff|: {loop['replay_vs_eager_max_abs_diff']:.2e}; ready: {loop['ready']}"
        )
        unexpected = loop["unexpected_captures"]
        print(f"never replayed: {len(loop['never_replayed'])}; unexpected captures: {unexpected}")
        print(f"violations: {loop['violations']}")
    for variant, part in results.get("compiled", {}).items():
        print_table(
            f"torch.compile(mode='reduce-overhead'), {variant}: {part['graphs']} graphs, "
            f"{part['replays_recorded']} replays, {part['seconds_incl_compile']:.1f} s with compile",
            ("kind", "function", "count", "reason"),
            [(e["kind"], e["function"] or "-", e["count"], e["reason"][:90]) for e in part["compile_events"]]
            or [("(none)", "-", 0, "-")],
        )
    if results.get("overhead"):
        print_table(
            "Replay overhead (host us per replay, one-kernel graph, interleaved bursts)",
            ("variant", "median us", "p10 us", "p90 us", "added us"),
            [
                (r["variant"], r["median_us"], r["p10_us"], r["p90_us"], r["added_us"])
                for r in results["overhead"]
            ],
        )
    for note in notes:
        print(f"note: {note}")
    if targets:
        print_targets(targets)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.split("\n\n")[0], default_out="bench/results/gpu_watch.json", default_budget_s=40
    )
    parser.add_argument(
        "--db",
        default=None,
        help="SQLite file to record into (default: the --out path with .db; replaced each run)",
    )
    parser.add_argument(
        "--model",
        default="small",
        choices=("tiny", "small", "large"),
        help="the decode loop's reference model (default small)",
    )
    parser.add_argument(
        "--compile-model",
        default="tiny",
        choices=("tiny", "small", "large"),
        help="the reference model size torch.compile runs on (default tiny: two compiles must fit "
        "run_gpu.sh's slot; the skip and the trees' graphs do not depend on the size)",
    )
    parser.add_argument("--steps", type=int, default=300, help="decode steps of the watched loop")
    parser.add_argument(
        "--compile-steps",
        type=int,
        default=12,
        help="steps per torch.compile variant (warm-up, record, then replays)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=200, help="replays per timed burst")
    parser.add_argument("--repeats", type=int, default=400, help="most bursts per variant")
    args = parser.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
