"""The replay checks on real graphs: no false alarm over clean traffic, every planted fault caught,
and what a sampled replay and the canary cost a step. In that order, so a short budget never cuts
the clean traffic:

* Clean traffic through the decode runner, the mixed-batch runner (FULL decode graphs and PIECEWISE
  mixed graphs) and the micro-batched decode runner, on the tiny reference decoder: ``--replays``
  replays each (10,000 by default) with every check always on and the canary on one replay in 100,
  then ``--debug-replays`` in debug mode (every check, the per-step comparison and the canary on
  every replay).
  Every violation would be a false alarm: the target is none. This part may spend 65% of the budget
  (the always-on runs three quarters of it); the others fit what is left.
* The planted faults of the test suite (``tests/support/faults.py``: a fresh input, another layout,
  an input moved to other storage in place, a reassigned weight, a weight swapped under its
  parameter, a forgotten copy_ (also under ``torch.inference_mode()``), padding rows not rewritten,
  a changed Python scalar, KV slot offset and module attribute, a late second model; on CUDA also a
  baked ``.item()``) in a plain, a micro-batched and a piecewise graph, always on with the default
  kind of schedule (the first replay sampled, then one in ``--fault-every``): each fault is planted
  step after step until it is recorded; the figure is after how many faulty steps (1 for what the
  guard sees, and for a per-step comparison read back at the next step on CUDA; up to the
  schedule's gap for what only the canary sees). Then the legitimate pattern beside each fault
  (writes no version counter sees, padding rewritten, weights loaded with copy_, outputs cloned...)
  and in-graph sampling (torch's generator) in each graph, both modes, every replay sampled: every
  violation is a false alarm.
* Sampled replays, on the ~60M-parameter reference decoder (bf16, a 5 GiB KV cache) at three
  buckets: the median step time of the decode runner when no replay is sampled, when every replay
  is sampled (the closer look: every input and every parameter and buffer re-read), and when every
  replay is sampled with the canary on (the real tokens' KV region kept aside, the step run again
  eagerly, outputs and region compared, the cache's checksum read three times), three runners on
  one model timed interleaved, with the eager step alone beside them. What a sampled replay costs
  is the difference; at the default schedule (one in 1,000 after the first) it is paid once per
  1,000 replays.

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
    Stats,
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
from capture_core.events import CaptureEvent, ViolationEvent, ViolationKind
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.slices import UBatchConfig
from tests.support.faults import BAKED_ON_CUDA, FAULTS, KINDS, LEGIT, GraphUnderTest, served

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


EAGER_STEP = "the eager step alone (for reference)"
CANARY_ON = "every replay sampled, canary on"


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
        CANARY_ON: (Sampling(first=0, every=1), True),
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
    for index, size in enumerate(sizes):
        inputs = decode_inputs(config, size, rng)
        variants = {name: (lambda r=runner, i=inputs: r.step(*i)) for name, runner in runners.items()}
        variants[EAGER_STEP] = lambda i=inputs: runners["no replay sampled"].step_eager(*i)
        # One iteration runs every variant once: two eager steps (one in the canary) and three replays.
        eager_s = Stats.of(timer.time_calls(variants[EAGER_STEP], 3)).median / 1e3
        share = budget.share(len(sizes) - index)
        iters = 5 if quick else Budget.reps_for(share / 6, 2 * eager_s + 0.005, floor=5, ceiling=60)
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
    device: torch.device, replays: int, debug_replays: int, budget: Budget, seconds: float
) -> list[dict[str, Any]]:
    """Every runner's clean traffic in at most ``seconds``: the always-on parts first, each with what
    is left of three quarters of it over the always-on parts left (a fast runner leaves more for the
    next); then the debug parts share what is left."""
    config = ModelConfig.tiny(max_num_seqs=32, max_seq_len=64, device=str(device))
    deadline = budget.elapsed + seconds
    rows: list[dict[str, Any]] = []
    for mode, wanted, sampling, share_of_time in (
        ("always_on", replays, Sampling(first=1, every=100), 0.75),
        ("debug", debug_replays, Sampling(), 1.0),
    ):
        until = budget.elapsed + share_of_time * (deadline - budget.elapsed)
        for index, kind in enumerate(RUNNERS):
            tally = Tally()
            runtime = GraphRuntime(
                "auto", observer=tally, progress=False, address_check=mode, sampling=sampling, canary=True
            )
            runner = make_runner(kind, runtime, config)
            runner.capture()
            started = time.perf_counter()
            part_s = max(1.0, (until - budget.elapsed) / (len(RUNNERS) - index))
            steps = serve(runner, tally, wanted, part_s, seed=index)
            if device.type == "cuda":
                torch.cuda.synchronize()
            kinds = Counter(v.kind.value for v in tally.violations)
            rows.append({
                "runner": kind, "mode": mode, "steps": steps, "replays": tally.replays,
                "eager": tally.eager, "seconds": time.perf_counter() - started,
                "violations": len(tally.violations), "by_kind": dict(kinds),
                "first_violation": tally.violations[0].message if tally.violations else None,
            })
    return rows


def planted_faults(device: torch.device, every: int) -> list[dict[str, Any]]:
    """Each planted fault in each kind of graph, planted step after step until it is recorded (a
    comparison on its way back from the device is read at the next step, as it is when serving)."""
    backend = "cuda" if device.type == "cuda" else "eager"
    faults = {name: (fault.kind, fault.name, fault.inference) for name, fault in FAULTS.items()
              if not fault.debug_only}
    if backend == "cuda":  # host values only a real graph bakes in
        faults.update(dict.fromkeys(BAKED_ON_CUDA, (ViolationKind.REPLAY_MISMATCH, "output", False)))
    rows = []
    for graph_kind in KINDS:
        for fault, (kind, where, inference) in faults.items():
            observer = Tally()
            runtime = GraphRuntime(
                backend, observer=observer, progress=False, warmup_iters=1 if backend == "eager" else 2,
                address_check="always_on", unexpected_capture="eager", canary=True,
                sampling=Sampling(first=1, every=every),
            )
            with served(inference):
                under_test = GraphUnderTest.build(graph_kind, runtime, device=str(device))
                for _ in range(2):  # clean steps: the first replay is sampled, the second is not
                    under_test.step()
                under_test.settle()
                clean = len(observer.violations)
                faulty = 0
                while len(observer.violations) == clean and faulty < 2 * every:
                    getattr(under_test, f"plant_{fault}")()
                    faulty += 1
                    if device.type == "cuda" and len(observer.violations) == clean:
                        under_test.step()  # the next step reads a comparison back from the device
                        under_test.settle()
            found = observer.violations[clean] if len(observer.violations) > clean else None
            rows.append({
                "graph": graph_kind, "fault": fault, "expected": kind.value, "expected_name": where,
                "caught": found is not None and (found.kind, found.input_name) == (kind, where),
                "faulty_steps": faulty, "false_alarms_before": clean,
                "recorded": None if found is None else f"{found.kind.value} {found.input_name}",
            })
    return rows


def legitimate_patterns(device: torch.device) -> list[dict[str, Any]]:
    """The legitimate pattern beside each fault (writes no version counter sees, padding rewritten,
    weights loaded with copy_, outputs cloned, ...) and in-graph sampling (noise drawn from torch's
    generator every step), in each kind of graph, in both modes, with every check and the canary on
    every replay: every violation is a false alarm."""
    backend = "cuda" if device.type == "cuda" else "eager"
    patterns = [(legit, inference, None) for legit, inference in LEGIT] + [("steps", False, "torch")]
    rows = []
    for graph_kind in KINDS:
        for legit, inference, noise in patterns:
            for mode in ("always_on", "debug"):
                observer = Tally()
                runtime = GraphRuntime(
                    backend, observer=observer, progress=False, warmup_iters=1 if backend == "eager" else 2,
                    address_check=mode, canary=True, sampling=Sampling(first=0, every=1),
                )
                with served(inference):
                    under_test = GraphUnderTest.build(graph_kind, runtime, device=str(device), noise=noise)
                    getattr(under_test, legit)()
                    under_test.settle()
                label = "in-graph sampling" if noise else legit + (" (inference mode)" if inference else "")
                rows.append({
                    "graph": graph_kind, "pattern": label, "mode": mode, "replays": observer.replays,
                    "violations": len(observer.violations),
                    "first_violation": observer.violations[0].message if observer.violations else None,
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
    every = 5 if args.quick else args.fault_every
    traffic = clean_traffic(device, replays, debug_replays, budget, seconds=0.65 * args.budget_s)
    faults = planted_faults(device, every)
    legit = legitimate_patterns(device)
    sampled = sampled_step_cost(device, args.quick, budget)
    always_on = [r for r in traffic if r["mode"] == "always_on"]
    debug = [r for r in traffic if r["mode"] == "debug"]
    canary = {r["bucket"]: r["added_ms"] for r in sampled if r["variant"] == CANARY_ON}
    targets = [
        target("false alarms, clean always-on replays", sum(r["violations"] for r in always_on), 1),
        target("false alarms, clean debug replays", sum(r["violations"] for r in debug), 1),
        target("planted faults not caught as planted", sum(not r["caught"] for r in faults), 1),
        target("false alarms, legitimate patterns", sum(r["violations"] for r in legit), 1),
        target(
            "clean always-on replays short of those wanted",
            sum(max(0, replays - r["replays"]) for r in always_on), 1,
        ),
        target(
            "sampled canary step, ms added at the largest bucket", canary[max(canary)], 20.0, unit="ms",
            applies=device.type == "cuda" and not args.quick,
        ),
    ]
    short = [r for r in always_on if r["replays"] < replays]
    if short:
        names = ", ".join(r["runner"] for r in short)
        notes.append(f"the budget ran out before {replays} replays of: {names}")
    config = {
        "device": str(device), "backend": "cuda" if device.type == "cuda" else "eager",
        "quick": args.quick,
        "replays_wanted": replays, "debug_replays_wanted": debug_replays, "fault_every": every,
        "budget_s": args.budget_s, "elapsed_s": budget.elapsed,
    }
    payload = write_results(
        args.out, benchmark="gpu_checks", command=command_line(), device=device, config=config,
        results={
            "clean_traffic": traffic, "planted_faults": faults, "legitimate_patterns": legit,
            "sampled_step": sampled,
        },
        targets=targets, notes=notes,
    )
    print_table(
        "Clean traffic with every check on (any violation is a false alarm)",
        ("runner", "mode", "steps", "replays", "eager", "seconds", "violations"),
        [(r["runner"], r["mode"], r["steps"], r["replays"], r["eager"], r["seconds"], r["violations"])
         for r in traffic],
    )
    for row in traffic:
        if row["first_violation"]:
            print(f"first violation ({row['runner']}, {row['mode']}): {row['first_violation']}")
    print_table(
        f"Planted faults, always on (first replay sampled, then 1 in {every}): faulty steps until recorded",
        ("graph", "fault", "expected", "recorded first", "faulty steps", "caught"),
        [(r["graph"], r["fault"], f"{r['expected']} {r['expected_name']}", r["recorded"], r["faulty_steps"],
          "yes" if r["caught"] else "NO") for r in faults],
    )
    print_table(
        "The legitimate pattern beside each fault, every check and the canary on every replay "
        "(any violation is a false alarm)",
        ("graph", "pattern", "mode", "replays", "violations"),
        [(r["graph"], r["pattern"], r["mode"], r["replays"], r["violations"]) for r in legit],
    )
    for row in legit:
        if row["first_violation"]:
            where = f"{row['graph']}, {row['pattern']}, {row['mode']}"
            print(f"first violation ({where}): {row['first_violation']}")
    print_table(
        "A sampled replay's cost to a decode step (median ms, three runners interleaved)",
        ("bucket", "variant", "step ms", "added ms", "samples"),
        [(r["bucket"], r["variant"], r["step_ms"], r["added_ms"], r["samples"]) for r in sampled],
    )
    print_targets(targets)
    for note in notes:
        print(f"note: {note}")
    print(f"\nwrote {args.out}")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.splitlines()[0], default_out="bench/results/gpu_checks.json", default_budget_s=100
    )
    parser.add_argument(
        "--replays", type=int, default=10_000, help="always-on replays a runner (default 10000)"
    )
    parser.add_argument(
        "--debug-replays", type=int, default=1_000, help="debug-mode replays a runner (default 1000)"
    )
    parser.add_argument(
        "--fault-every", type=int, default=50,
        help="the planted faults' schedule: the first replay sampled, then one in N (default 50)",
    )
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
