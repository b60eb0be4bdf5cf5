"""The replay checks on real graphs: what a sampled replay and the canary cost a step, and how many
false alarms clean traffic raises through each runner.

* Sampled replays, on the ~60M-parameter reference decoder (bf16) at three buckets: the median step
  time of the decode runner when no replay is sampled, when every replay is sampled (the closer
  look: every input and every parameter and buffer re-read), and when every replay is sampled with
  the canary on (the KV cache copied, the step run again eagerly, outputs and cache compared),
  three runners on one model timed interleaved. What a sampled replay costs is the difference; at
  the default schedule (one in 1,000 after the first) it is paid once per 1,000 replays.
* Clean traffic through the decode runner, the mixed-batch runner (FULL decode graphs and PIECEWISE
  mixed graphs) and the micro-batched decode runner, on the tiny reference decoder: at least
  ``--replays`` replays each (10,000 by default) with every check always on and the canary on one
  replay in 100, then a shorter run in debug mode (every check, the sentinel and the canary on
  every replay). Every violation would be a false alarm: the target is none.

    python3 bench/gpu_checks.py --out bench/results/gpu_checks.json

``--quick`` runs the tiny model and a few hundred replays (on a CPU through the eager backend): a
check that the script works, not a result.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    Budget,
    CallTimer,
    base_parser,
    command_line,
    print_table,
    print_targets,
    resolve_device,
    target,
    time_interleaved,
    write_results,
)
from capture_core.canary import Sampling
from capture_core.events import CaptureEvent, ViolationEvent
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.slices import UBatchConfig

RUNNERS = ("decode", "mixed piecewise", "micro-batched decode")


class Tally:
    """An observer that counts replays and eager steps and keeps every violation."""

    def __init__(self) -> None:
        self.replays = 0
        self.eager = 0
        self.violations: list[ViolationEvent] = []

    def on_capture(self, event: CaptureEvent) -> None:
        pass

    def on_replay(self, mode: CUDAGraphMode, descriptor: Any, num_real_tokens: int) -> None:
        self.replays += 1

    def on_eager(self, reason: Any, num_real_tokens: int, mode: CUDAGraphMode) -> None:
        self.eager += 1

    def on_violation(self, event: ViolationEvent) -> None:
        self.violations.append(event)


def decode_inputs(config: ModelConfig, batch: int, rng: random.Random) -> tuple[torch.Tensor, ...]:
    slots = rng.sample(range(config.max_num_seqs), batch)
    ids = [rng.randrange(config.vocab_size) for _ in range(batch)]
    positions = [rng.randrange(config.max_seq_len) for _ in range(batch)]
    return tuple(torch.tensor(v, dtype=torch.long, device=config.device) for v in (ids, positions, slots))


def sampled_step_cost(device: torch.device, quick: bool, budget: Budget) -> list[dict[str, Any]]:
    """Median step ms with no replay sampled, every replay sampled, and sampled with the canary."""
    if quick:
        config, sizes = ModelConfig.tiny(max_num_seqs=8, max_seq_len=32, device=str(device)), [1, 4, 8]
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config, sizes = ModelConfig.small(dtype=dtype, device=str(device), max_num_seqs=256), [1, 16, 256]
    model = ReferenceDecoder(config)
    schedules = {
        "no replay sampled": (Sampling(first=0, every=0), False),
        "every replay sampled": (Sampling(first=0, every=1), False),
        "every replay sampled, canary on": (Sampling(first=0, every=1), True),
    }
    runners, tally = {}, Tally()
    for name, (sampling, canary) in schedules.items():
        runtime = GraphRuntime("auto", observer=tally, progress=False, sampling=sampling, canary=canary)
        runner = DecodeRunner(model, runtime, sizes)
        runner.capture()
        runners[name] = runner
    timer = CallTimer(device)
    rng = random.Random(0)
    rows = []
    for size in sizes:
        inputs = decode_inputs(config, size, rng)
        variants = {name: (lambda r=runner, i=inputs: r.step(*i)) for name, runner in runners.items()}
        iters = 5 if quick else Budget.reps_for(budget.share(len(sizes) + 1), 0.02, floor=10, ceiling=80)
        samples = time_interleaved(variants, timer, rounds=3 if quick else 6, iters=iters)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        base = medians["no replay sampled"]
        for name, median in medians.items():
            rows.append({
                "bucket": size, "variant": name, "step_ms": median, "added_ms": median - base,
                "samples": len(samples[name]),
            })
    if tally.violations:  # the three runners share one model and one input: nothing may differ
        raise RuntimeError(f"the timed steps raised violations: {tally.violations[0].message}")
    return rows


Runner = DecodeRunner | MixedBatchRunner


def make_runner(kind: str, runtime: GraphRuntime, config: ModelConfig) -> Runner:
    model = ReferenceDecoder(config, seed=1)
    sizes = [1, 2, 4, 8, 16, 32]
    if kind == "mixed piecewise":
        return MixedBatchRunner(model, runtime, sizes, CUDAGraphMode.FULL_AND_PIECEWISE)
    ubatch = UBatchConfig(enabled=True, decode_token_threshold=8) if kind == "micro-batched decode" else None
    return DecodeRunner(model, runtime, sizes, ubatch=ubatch)


def serve(runner: Runner, tally: Tally, replays: int, seconds: float, seed: int) -> int:
    """Random traffic until ``replays`` replays (or ``seconds`` are spent); the steps served."""
    rng = random.Random(seed)
    config = runner.model.config
    deadline = time.perf_counter() + seconds
    steps = 0
    while tally.replays < replays and time.perf_counter() < deadline:
        if isinstance(runner, MixedBatchRunner):
            count = rng.randint(1, 6)
            tokens = [[rng.randrange(config.vocab_size)] * rng.choice((1, 1, 1, 2, 5)) for _ in range(count)]
            contexts = [rng.randrange(config.max_seq_len - 8) for _ in range(count)]
            slots = rng.sample(range(config.max_num_seqs), count)
            batch = flatten_requests(tokens, contexts, slots, device=config.device)
            runner.step(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)
        else:
            runner.step(*decode_inputs(config, rng.randint(1, 32), rng))
        steps += 1
    return steps


def clean_traffic(
    device: torch.device, replays: int, debug_replays: int, budget: Budget
) -> list[dict[str, Any]]:
    config = ModelConfig.tiny(max_num_seqs=32, max_seq_len=64, device=str(device))
    rows = []
    for mode, wanted, sampling in (
        ("always_on", replays, Sampling(first=1, every=100)),
        ("debug", debug_replays, Sampling()),
    ):
        for index, kind in enumerate(RUNNERS):
            tally = Tally()
            runtime = GraphRuntime(
                "auto", observer=tally, progress=False, address_check=mode, sampling=sampling, canary=True
            )
            runner = make_runner(kind, runtime, config)
            runner.capture()
            parts_left = 2 * len(RUNNERS) - len(rows)
            steps = serve(runner, tally, wanted, budget.share(parts_left), seed=index)
            if device.type == "cuda":
                torch.cuda.synchronize()
            kinds = Counter(v.kind.value for v in tally.violations)
            rows.append({
                "runner": kind, "mode": mode, "steps": steps, "replays": tally.replays,
                "eager": tally.eager,
                "violations": len(tally.violations), "by_kind": dict(kinds),
                "first_violation": tally.violations[0].message if tally.violations else None,
            })
    return rows


def run(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    budget = Budget(args.budget_s)
    torch.manual_seed(0)
    notes = []
    if device.type != "cuda":
        notes.append("no CUDA here: the eager backend stands in; step times are not graph timings")
    replays, debug_replays = (100, 30) if args.quick else (args.replays, args.debug_replays)
    sampled = sampled_step_cost(device, args.quick, budget)
    traffic = clean_traffic(device, replays, debug_replays, budget)
    always_on = [r for r in traffic if r["mode"] == "always_on"]
    debug = [r for r in traffic if r["mode"] == "debug"]
    targets = [
        target("false alarms, clean always-on replays", sum(r["violations"] for r in always_on), 1),
        target("false alarms, clean debug replays", sum(r["violations"] for r in debug), 1),
    ]
    short = [r for r in always_on if r["replays"] < replays]
    if short:
        names = ", ".join(r["runner"] for r in short)
        notes.append(f"the budget ran out before {replays} replays of: {names}")
    config = {
        "device": str(device), "backend": "cuda" if device.type == "cuda" else "eager",
        "quick": args.quick,
        "replays_wanted": replays, "debug_replays_wanted": debug_replays, "budget_s": args.budget_s,
        "elapsed_s": budget.elapsed,
    }
    payload = write_results(
        args.out, benchmark="gpu_checks", command=command_line(), device=device, config=config,
        results={"sampled_step": sampled, "clean_traffic": traffic}, targets=targets, notes=notes,
    )
    print_table(
        "A sampled replay's cost to a decode step (median ms, three runners interleaved)",
        ("bucket", "variant", "step ms", "added ms", "samples"),
        [(r["bucket"], r["variant"], r["step_ms"], r["added_ms"], r["samples"]) for r in sampled],
    )
    print_table(
        "Clean traffic with every check on (any violation is a false alarm)",
        ("runner", "mode", "steps", "replays", "eager", "violations"),
        [(r["runner"], r["mode"], r["steps"], r["replays"], r["eager"], r["violations"]) for r in traffic],
    )
    for row in traffic:
        if row["first_violation"]:
            print(f"first violation ({row['runner']}, {row['mode']}): {row['first_violation']}")
    print_targets(targets)
    for note in notes:
        print(f"note: {note}")
    print(f"\nwrote {args.out}")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.splitlines()[0], default_out="bench/results/gpu_checks.json", default_budget_s=150
    )
    parser.add_argument(
        "--replays", type=int, default=10_000, help="always-on replays a runner (default 10000)"
    )
    parser.add_argument(
        "--debug-replays", type=int, default=1_000, help="debug-mode replays a runner (default 1000)"
    )
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
