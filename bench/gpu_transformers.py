"""Hugging Face transformers' generate() with a static cache, bare against `graph-inspector watch`.

What a user of transformers runs: a Llama built from a config with random weights (no hub access),
``model.generate(..., cache_implementation="static")``, greedy, at batch 1, 4, 8 and 32, in two
modes: *eager* (no CUDA graphs at all) and *compiled* (``torch.compile(mode="reduce-overhead")``,
which transformers applies itself for a static cache: torch.compile's cudagraph trees).

Each measurement is a separate process, as a user would run it: ``python3 this --child ...`` bare,
or the same command under ``graph-inspector watch --db DB -- ...``. Rounds alternate the order
(bare first, then watched first) and repeat until ``--budget-s`` is spent; every process runs
every batch size (one warm-up generate, which compiles and captures, then ``--reps`` timed ones)
and reports its median seconds per generated token. The figures are, per mode and batch: the
median over processes, the spread over processes (min..max), and watched/bare. Every process of a
mode must generate the same tokens, watched or not. Targets: watched/bare at most 1.01 compiled and
1.005 eager (geometric mean over the batch sizes); tokens identical; the watched graphs' pool bytes
add up to what their pools hold (``torch.cuda.memory_snapshot``) and no more than the allocator
reserved (``torch.cuda.memory_stats``).

All watched processes record into one SQLite file (``--db``, default beside the JSON):
``graph-inspector serve --db sqlite:///...`` shows the graphs, grouped by compiled function, and
the re-records with their reasons.

    python3 bench/gpu_transformers.py --out $OUT/gpu_transformers.json    # about 7 minutes on an H200

Rounds go on while the last round's time still fits the budget (``--budget-s``, default 420 s; the
first round also pays for the cold compiles, later ones hit the inductor cache all processes share).

``--trees-debug-log`` lowers the cudagraph trees' logger to DEBUG in the child, as graph-inspector
watch did before it read re-record reasons off the trees' frames: with torch 2.11 that makes
generate fail at batch 32 (torch's debug-only message asserts). ``--quick`` runs a tiny model on
any device in seconds (eager only without CUDA: a CPU captures no graphs); its figures are not results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    base_parser,
    command_line,
    print_table,
    print_targets,
    resolve_device,
    target,
    write_results,
)

MODES = ("eager", "compiled")
VARIANTS = ("bare", "watched")
TARGET_RATIO = {"compiled": 1.01, "eager": 1.005}
TREES_LOGGER = "torch._inductor.cudagraph_trees.__cudagraphs"
MODELS = {
    # ~160M parameters: big enough that batch 32 is real GPU work, small enough to compile quickly
    "small": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "tiny": {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


# ------------------------------------------------------------------------------ the child process


def build_model(size: str, device: torch.device, prompt: int, new_tokens: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[size], max_position_embeddings=max(2048, prompt + new_tokens))
    torch.manual_seed(0)  # on the CPU, so every process has the same weights
    model = LlamaForCausalLM(config).eval()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype)


def prompt_ids(batch: int, prompt: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + batch)
    return torch.randint(3, vocab, (batch, prompt), generator=generator).to(device)


def generate(model: Any, ids: torch.Tensor, new_tokens: int, compiled: bool) -> torch.Tensor:
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = CompileConfig()
    if compiled and ids.device.type != "cuda":
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only by default
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # every sequence generates every token: equal work each run
            do_sample=False,
            cache_implementation="static",
            compile_config=compile_config,
            disable_compile=not compiled,
            pad_token_id=0,
        )


def run_child(args: Any) -> dict[str, Any]:
    """One process: every batch size once to warm up (compile, capture), then ``reps`` timed runs."""
    started = time.time()
    if args.trees_debug_log:
        logging.getLogger(TREES_LOGGER).setLevel(logging.DEBUG)
    device = resolve_device(args.device)
    compiled = args.mode == "compiled"
    model = build_model(args.model, device, args.prompt, args.new_tokens)
    result: dict[str, Any] = {
        "mode": args.mode,
        "pid": os.getpid(),
        "batches": {},
        "startup_s": started - args.launched_at if args.launched_at else None,
    }
    for batch in args.batches:
        ids = prompt_ids(batch, args.prompt, model.config.vocab_size, device)
        sync(device)
        begin = time.perf_counter()
        tokens = generate(model, ids, args.new_tokens, compiled)
        sync(device)
        first_s = time.perf_counter() - begin
        times, cpu_times, digests = [], [], {token_digest(tokens)}
        for _ in range(args.reps):
            begin, cpu_begin = time.perf_counter(), time.process_time()
            again = generate(model, ids, args.new_tokens, compiled)
            sync(device)
            times.append(time.perf_counter() - begin)
            cpu_times.append(time.process_time() - cpu_begin)
            digests.add(token_digest(again))
        result["batches"][str(batch)] = {
            "first_s": first_s,
            "times_s": times,
            "ms_per_token": 1e3 * statistics.median(times) / args.new_tokens,
            # the process's CPU time, every thread (the watch's writer too): less moved by a busy
            # machine than wall time, and the host work is where a watch could cost
            "cpu_ms_per_token": 1e3 * statistics.median(cpu_times) / args.new_tokens,
            "tokens": token_digest(tokens),
            "tokens_stable": len(digests) == 1,
            "first_row": tokens[0, -8:].tolist(),
        }
    result["memory"] = memory_report(device)
    result["watch"] = watch_report()
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_digest(tokens: torch.Tensor) -> str:
    return hashlib.sha256(json.dumps(tokens.tolist()).encode()).hexdigest()[:16]


def memory_report(device: torch.device) -> dict[str, Any]:
    """The allocator's view: reserved bytes overall and per graph pool (pool id -> bytes)."""
    if device.type != "cuda":
        return {}
    pools: dict[str, int] = defaultdict(int)
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            pools[f"{pool[0]}:{pool[1]}"] += int(segment["total_size"])
    stats = torch.cuda.memory_stats(device)
    return {
        "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
        "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
        "pool_reserved_bytes": dict(pools),
    }


def watch_report() -> dict[str, Any] | None:
    """What the watch in this process saw (None when the process is not watched)."""
    api = sys.modules.get("inspector.watch.api")  # imported by the watch's start-up hook, if watched
    watcher = api.current() if api is not None else None
    if watcher is None:
        return None
    by_pool: dict[str, int] = defaultdict(int)
    for graph in watcher.graphs:
        if graph.pool is not None:
            by_pool[f"{graph.pool[0]}:{graph.pool[1]}"] += graph.pool_bytes
    rerecords = [e for e in watcher.compile_events if e.kind.value == "compile_rerecord"]
    return {
        "hooks": api.hooks_path(),
        "graphs": len(watcher.graphs),
        "replays": watcher.replay_total(),
        "graph_pool_bytes": dict(by_pool),
        "functions": sorted({g.function for g in watcher.graphs}),
        "keys": [g.identity.key for g in watcher.graphs][:40],
        "rerecords": len(rerecords),
        "rerecord_reasons": sorted({e.reason for e in rerecords}),
        "skips": sorted({e.reason for e in watcher.compile_events if e.kind.value == "compile_skip"}),
        "watch_errors": watcher.watch_errors,
        "sink_errors": watcher.sink_errors,
    }


# ------------------------------------------------------------------------------ the parent


def child_command(args: Any, mode: str, variant: str, out: Path, db: str, label: str) -> list[str]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--mode",
        mode,
        "--child-out",
        str(out),
        "--device",
        args.device,
        "--model",
        args.model,
        "--batches",
        ",".join(map(str, args.batches)),
        "--reps",
        str(args.reps),
        "--prompt",
        str(args.prompt),
        "--new-tokens",
        str(args.new_tokens),
        "--launched-at",
        repr(time.time()),
    ]
    if variant == "bare":
        return command
    return [sys.executable, "-m", "dashboard.cli", "watch", "--db", db, "--label", label, "--", *command]


def run_process(args: Any, mode: str, variant: str, round_index: int, db: str, logs: Path, env: dict) -> dict:
    out = logs / f"{mode}-{variant}-r{round_index}.json"
    log = logs / f"{mode}-{variant}-r{round_index}.log"
    label = f"gpu_transformers {mode} r{round_index}"
    command = child_command(args, mode, variant, out, db, label)
    began = time.perf_counter()
    with log.open("w") as sink:
        # A session of its own, so that a process over its time limit is ended with everything
        # it started (the watched command's child is a grandchild of this one).
        child = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = child.wait(timeout=args.child_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            returncode = f"over its {args.child_timeout_s:g} s limit"
    wall_s = time.perf_counter() - began
    if returncode != 0 or not out.exists():
        tail = log.read_text()[-3000:]
        return {
            "mode": mode,
            "variant": variant,
            "round": round_index,
            "failed": returncode,
            "wall_s": wall_s,
            "log_tail": tail,
        }
    result = json.loads(out.read_text())
    return result | {"variant": variant, "round": round_index, "wall_s": wall_s}


def child_environment(cache_dir: str) -> dict[str, str]:
    """The same environment for every child: one inductor cache (later compiles hit it), and the
    repository importable (the watched command puts its own start-up hook in front)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH", ""), root) if p])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_parent(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    modes = list(args.modes)
    notes = []
    if device.type != "cuda" and "compiled" in modes:
        modes.remove("compiled")
        notes.append("compiled mode needs a CUDA device (a CPU captures no CUDA graphs): eager only")
    out = Path(args.out)
    db_path = Path(args.db) if args.db else out.with_suffix(".db")
    db_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm")):
        if not args.db and stale.exists():
            stale.unlink()  # our own output from an earlier run: start clean
    db = f"sqlite:///{db_path.resolve()}"
    logs = out.parent / f"{out.stem}-processes"
    logs.mkdir(parents=True, exist_ok=True)
    processes: list[dict[str, Any]] = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        env = child_environment(cache)
        round_index = 0
        while True:
            round_began = time.perf_counter()
            variants = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
            for mode in modes:
                for variant in variants:
                    processes.append(run_process(args, mode, variant, round_index, db, logs, env))
                    print(
                        f"round {round_index} {mode:8} {variant:7} {processes[-1]['wall_s']:6.1f} s"
                        f"{'  FAILED' if 'failed' in processes[-1] else ''}",
                        flush=True,
                    )
            round_index += 1
            round_s = time.perf_counter() - round_began
            spent = time.perf_counter() - began
            if round_index >= args.max_rounds or (
                round_index >= args.min_rounds and spent + round_s > args.budget_s
            ):
                break
    results = summarise(processes, modes, args.batches)
    results["db"] = db
    results["rounds"] = round_index
    results["seconds"] = time.perf_counter() - began
    results["processes"] = processes
    targets = make_targets(results, modes, applies=device.type == "cuda" and not args.quick)
    config = {k: v for k, v in vars(args).items() if k not in ("child", "child_out", "launched_at", "out")}
    payload = write_results(out, benchmark="gpu_transformers", command=command_line(), device=device,
                            config=config, results=results, targets=targets, notes=notes)
    report(results, modes, targets, notes)
    print(json.dumps({"out": str(out), "db": db, "ratios": results["ratios"], "targets": payload["targets"]}))
    return payload


def summarise(
    processes: list[dict[str, Any]], modes: Sequence[str], batches: Sequence[int]
) -> dict[str, Any]:
    ok = [p for p in processes if "failed" not in p]
    rows, ratios = [], {}
    for mode in modes:
        per_batch = []
        for batch in batches:
            cell: dict[str, Any] = {"mode": mode, "batch": batch}
            digests = {p["batches"][str(batch)]["tokens"] for p in ok if p["mode"] == mode}
            cell["tokens_identical"] = len(digests) == 1 and all(
                p["batches"][str(batch)]["tokens_stable"] for p in ok if p["mode"] == mode
            )
            for variant in VARIANTS:
                values = [
                    p["batches"][str(batch)]["ms_per_token"]
                    for p in ok
                    if p["mode"] == mode and p["variant"] == variant
                ]
                firsts = [
                    p["batches"][str(batch)]["first_s"]
                    for p in ok
                    if p["mode"] == mode and p["variant"] == variant
                ]
                cpu = [
                    p["batches"][str(batch)]["cpu_ms_per_token"]
                    for p in ok
                    if p["mode"] == mode and p["variant"] == variant
                ]
                cell[variant] = {
                    "processes": len(values),
                    "median_ms_per_token": statistics.median(values) if values else None,
                    "median_cpu_ms_per_token": statistics.median(cpu) if cpu else None,
                    "min_ms_per_token": min(values, default=None),
                    "max_ms_per_token": max(values, default=None),
                    "median_first_generate_s": statistics.median(firsts) if firsts else None,
                }
            bare, watched = cell["bare"]["median_ms_per_token"], cell["watched"]["median_ms_per_token"]
            cell["ratio"] = watched / bare if bare and watched else None
            bare_cpu, watched_cpu = (
                cell["bare"]["median_cpu_ms_per_token"],
                cell["watched"]["median_cpu_ms_per_token"],
            )
            cell["cpu_ratio"] = watched_cpu / bare_cpu if bare_cpu and watched_cpu else None
            cell["paired_ratios"] = paired_ratios(ok, mode, batch)
            rows.append(cell)
            if cell["ratio"]:
                per_batch.append(cell["ratio"])
        ratios[mode] = math.exp(statistics.fmean(math.log(r) for r in per_batch)) if per_batch else None
    return {
        "cells": rows,
        "ratios": ratios,
        "pool_check": pool_check(ok),
        "failed": len(processes) - len(ok),
        "startup_s": startup(ok),
    }


def paired_ratios(processes: list[dict[str, Any]], mode: str, batch: int) -> list[float]:
    """watched/bare of the two processes of one round: neighbours in time share the machine's drift."""
    by_round: dict[int, dict[str, float]] = defaultdict(dict)
    for p in processes:
        if p["mode"] == mode:
            by_round[p["round"]][p["variant"]] = p["batches"][str(batch)]["ms_per_token"]
    return [pair["watched"] / pair["bare"] for _, pair in sorted(by_round.items()) if len(pair) == 2]


def pool_check(processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per watched process: the graphs' pool bytes against the pools' reserved bytes and the total."""
    checks = []
    bare = {
        p["mode"]: sum((p.get("memory") or {}).get("pool_reserved_bytes", {}).values())
        for p in processes
        if p["variant"] == "bare"
    }  # the last bare process of each mode: what the same program's graph pools hold unwatched
    for p in processes:
        watch, memory = p.get("watch"), p.get("memory") or {}
        if not watch or not memory:
            continue
        recorded = sum(watch["graph_pool_bytes"].values())
        held = sum(memory["pool_reserved_bytes"].get(pool, 0) for pool in watch["graph_pool_bytes"])
        checks.append(
            {
                "mode": p["mode"],
                "round": p["round"],
                "graphs": watch["graphs"],
                "recorded_pool_bytes": recorded,
                "pools_reserved_bytes": held,
                "allocator_reserved_bytes": memory["reserved_bytes"],
                "bare_pools_reserved_bytes": bare.get(p["mode"]),
                "recorded_over_held": recorded / held if held else None,
            }
        )
    return checks


def startup(processes: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median seconds from launch to the child's first line of its own: interpreter, imports and,
    watched, the watch's start-up hook and `graph-inspector watch` itself."""
    return {
        variant: statistics.median(values)
        if (
            values := [
                p["startup_s"]
                for p in processes
                if p["variant"] == variant and p.get("startup_s") is not None
            ]
        )
        else None
        for variant in VARIANTS
    }


def make_targets(results: dict[str, Any], modes: Sequence[str], *, applies: bool) -> list[dict[str, Any]]:
    targets = [
        target(
            f"{mode}: watched/bare, seconds per token (geometric mean over batch sizes)",
            results["ratios"][mode],
            TARGET_RATIO[mode],
            applies=applies,
        )
        for mode in modes
    ]
    mismatched = sum(not cell["tokens_identical"] for cell in results["cells"])
    targets.append(target("batch sizes whose tokens differ between processes", mismatched, 1))
    targets.append(target("processes that failed", results["failed"], 1))
    compiled = [c for c in results["pool_check"] if c["mode"] == "compiled"]
    if compiled:
        worst = max(abs(1 - (c["recorded_over_held"] or 0)) for c in compiled)
        targets.append(
            target(
                "watched graphs' pool bytes vs what their pools hold, |1 - ratio| (worst process)",
                worst,
                0.1,
                applies=applies,
            )
        )
    return targets


def report(results: dict[str, Any], modes: Sequence[str], targets: list, notes: list[str]) -> None:
    rows = []
    for cell in results["cells"]:
        bare, watched = cell["bare"], cell["watched"]
        paired = cell["paired_ratios"]
        rows.append(
            (
                cell["mode"],
                cell["batch"],
                bare["median_ms_per_token"],
                f"{_num(bare['min_ms_per_token'])}..{_num(bare['max_ms_per_token'])}",
                watched["median_ms_per_token"],
                f"{_num(watched['min_ms_per_token'])}..{_num(watched['max_ms_per_token'])}",
                cell["ratio"],
                f"{_num(min(paired, default=None))}..{_num(max(paired, default=None))}",
                cell["cpu_ratio"],
                bare["processes"] + watched["processes"],
                cell["tokens_identical"],
            )
        )
    print_table(
        f"transformers generate(cache_implementation='static'): ms per generated token, "
        f"{results['rounds']} round(s), {results['seconds']:.0f} s",
        (
            "mode",
            "batch",
            "bare",
            "bare range",
            "watched",
            "watched range",
            "watched/bare",
            "paired range",
            "CPU time w/b",
            "processes",
            "same tokens",
        ),
        rows,
    )
    for mode in modes:
        print(f"{mode}: watched/bare (geometric mean over batch sizes) = {_num(results['ratios'][mode])}")
    print(f"start-up (launch to child): {results['startup_s']}")
    for check in results["pool_check"]:
        print(
            f"pool bytes, {check['mode']} r{check['round']}: {check['graphs']} graphs recorded "
            f"{check['recorded_pool_bytes'] / 2**20:.1f} MiB; their pools hold "
            f"{check['pools_reserved_bytes'] / 2**20:.1f} MiB; the allocator reserved "
            f"{check['allocator_reserved_bytes'] / 2**20:.1f} MiB; unwatched, the graph pools held "
            f"{(check['bare_pools_reserved_bytes'] or 0) / 2**20:.1f} MiB"
        )
    watched = [p for p in results["processes"] if p.get("watch")]
    if watched:
        last = watched[-1]["watch"]
        print(
            f"watch ({last['hooks']}): functions {last['functions']}; {last['rerecords']} re-records "
            f"{last['rerecord_reasons']}; skips {last['skips']}; contained errors {last['watch_errors']}"
        )
    for p in results["processes"]:
        if "failed" in p:
            print(f"FAILED {p['mode']} {p['variant']} r{p['round']} (exit {p['failed']}):\n{p['log_tail']}")
    for note in notes:
        print(f"note: {note}")
    print_targets(targets)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# ------------------------------------------------------------------------------ the command line


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.split("\n\n")[0], default_out="bench/results/gpu_transformers.json", default_budget_s=420
    )
    parser.add_argument(
        "--db",
        default=None,
        help="SQLite file the watched processes record into "
        "(default: the --out path with .db; replaced each run)",
    )
    parser.add_argument(
        "--model", default="small", choices=sorted(MODELS), help="the Llama config (default small)"
    )
    parser.add_argument(
        "--modes", type=lambda s: s.split(","), default=list(MODES), help="eager,compiled (default both)"
    )
    parser.add_argument(
        "--batches",
        type=lambda s: [int(b) for b in s.split(",")],
        default=[1, 4, 8, 32],
        help="batch sizes, in the order one process runs them (default 1,4,8,32)",
    )
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument(
        "--new-tokens", type=int, default=48, help="generated tokens per sequence (default 48)"
    )
    parser.add_argument(
        "--reps", type=int, default=5, help="timed generates per batch size and process (default 5)"
    )
    parser.add_argument(
        "--min-rounds", type=int, default=2, help="rounds run whatever the budget (default 2)"
    )
    parser.add_argument("--max-rounds", type=int, default=12, help="most rounds (default 12)")
    parser.add_argument(
        "--child-timeout-s", type=float, default=420, help="limit for one process (default 420)"
    )
    parser.add_argument(
        "--trees-debug-log",
        action="store_true",
        help="in the child: lower the cudagraph trees' logger to DEBUG (the old watch's behaviour)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = run_child(args)
        if args.child_out is None:
            print(json.dumps(result))
        else:
            args.child_out.write_text(json.dumps(result))
        return 0
    if args.quick:
        args.model, args.batches, args.reps, args.new_tokens = "tiny", [1, 2], 2, 8
        args.min_rounds = args.max_rounds = 1
    run_parent(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
