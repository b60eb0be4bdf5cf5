"""Micro-batching (DBO): two ubatches captured into one graph, their comm hidden under compute.

The workload is the reference decoder with an exchange after every layer (``CommOverlapDecoder``:
the hidden states pass through a receive buffer, plus either a device-to-device payload copy, the
bandwidth-bound stand-in, or a one-block spin kernel, the stand-in for a collective waiting on its
peers). For each comm case it captures, in one capture phase, five graphs of the same step:

* ``ubatched, overlapped``: 2 ubatches in ONE graph through ``UBatchWrapper``, each exchange on
  the comm stream (ubatch 0's exchange runs while ubatch 1's layer computes): DBO;
* ``ubatched, in line``: the same split and the same turns, every exchange on the compute stream:
  the no-overlap baseline for exactly the same work;
* ``ubatched, compute only``: the same split without exchanges;
* ``whole, in line`` and ``whole, compute only``: the step not micro-batched at all.

It checks that both ubatched graphs' logits equal the non-ubatched eager decoder's, times every
graph interleaved (CUDA events, medians), and reports the comm hidden by the second stream two ways:
from step times, ``(in line - overlapped) / (in line - compute only)`` over the ubatched graphs;
and, for the spin cases, from a profiler trace of replays: the share of the spin kernels' device
time that ran while a compute kernel was running (the in-line graph is profiled too: there it must
be about zero).

    python3 bench/gpu_ubatch.py --out bench/results/h200/gpu_ubatch.json

``--nproc N`` also runs ``coordinate_batch_across_dp`` in N processes (NCCL by default, one GPU
per rank: the two-GPU run is ``--nproc 2``; ``--dp-backend gloo`` runs the ranks on CPU), checks
that every rank agreed on every scenario and times one coordination. ``--quick`` is a CPU-sized
dry run (tiny model, eager backend); its figures are not results.
"""

from __future__ import annotations

import datetime
import gzip
import json
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import (
    Budget,
    CallTimer,
    Stats,
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
from bench.timeline import Activity, breakdown, overlap_seen, read_chrome_trace
from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.reference.overlap import SPIN_KERNEL_NAME, CommOverlapDecoder
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.dp import coordinate_batch_across_dp
from capture_core.ubatch.slices import UBatchConfig, maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper
from capture_core.wrapper import CUDAGraphWrapper

FULL, NONE = CUDAGraphMode.FULL, CUDAGraphMode.NONE
MIB = 2**20
NUM_UBATCHES = 2
OVERLAPPED, IN_LINE, UB_COMPUTE = "ubatched, overlapped", "ubatched, in line", "ubatched, compute only"
WHOLE_IN_LINE, WHOLE_COMPUTE = "whole, in line", "whole, compute only"
GRAPHS = (OVERLAPPED, IN_LINE, UB_COMPUTE, WHOLE_IN_LINE, WHOLE_COMPUTE)
MIN_JUDGED_COMM = 0.05
"""Exchanges adding less than this share of the ubatched compute are too small to judge overlap by."""


def parse_args() -> Any:
    parser = base_parser(
        "Micro-batching: 2 ubatches in one graph, equality with eager, step time and comm overlap.",
        default_out="bench/results/gpu_ubatch.json",
        default_budget_s=120,
    )
    parser.add_argument("--model", choices=("small", "large"), default="small", help="reference model size")
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per step (default 256)")
    parser.add_argument(
        "--payload-mib",
        default="0,32",
        help="comma-separated payload sizes copied on the comm stream per exchange, MiB (default 0,32)",
    )
    parser.add_argument(
        "--wait-us",
        default="50,100,200,400",
        help="comma-separated spin times per exchange, microseconds: a collective waiting on its peers "
        "(CUDA only; default 50,100,200,400)",
    )
    parser.add_argument(
        "--profile-replays", type=int, default=5, help="replays per profiled graph (default 5; 0: no profile)"
    )
    parser.add_argument(
        "--trace-dir",
        type=Path,
        help="keep the profiler traces there, gzipped (chrome://tracing or ui.perfetto.dev open them)",
    )
    parser.add_argument("--max-seq-len", type=int, default=512, help="KV row length (default 512)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--nproc", type=int, default=0, help="DP ranks for the coordination run (0: skip)")
    parser.add_argument("--dp-backend", choices=("nccl", "gloo"), default="nccl")
    return parser.parse_args()


def parse_numbers(text: str, option: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"error: {option} takes comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise SystemExit(f"error: {option} values must be >= 0, got {text!r}")
    return values


# --------------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class CommCase:
    """What every exchange carries besides the receive copy: a payload copy, or a spin."""

    payload_mib: float = 0.0
    wait_us: float = 0.0

    @property
    def label(self) -> str:
        if self.wait_us:
            return f"wait {self.wait_us:g} us"
        if self.payload_mib:
            return f"copy {self.payload_mib:g} MiB"
        return "receive copy only"

    @property
    def payload_bytes(self) -> int:
        return int(self.payload_mib * MIB)

    @property
    def profiled(self) -> bool:
        """Whether a profile can tell this case's comm apart: only the spin kernel has its own name.

        Copies cannot be told apart: inside a graph the driver may run a copy as a ``memcpy128``
        kernel with no byte count, and the step's own copies (the receive copy, joining the
        ubatches' logits) look the same.
        """
        return self.wait_us > 0

    @staticmethod
    def is_comm(activity: Activity) -> bool:
        return SPIN_KERNEL_NAME in activity.name


class Workload:
    """Static decode inputs of ``tokens`` requests and their ubatch split."""

    def __init__(self, model: ReferenceDecoder, tokens: int, device: torch.device) -> None:
        self.model = model
        self.tokens = tokens
        cfg = model.config
        g = torch.Generator().manual_seed(1234)
        self.input_ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g).to(device)
        self.positions = torch.randint(0, cfg.max_seq_len, (tokens,), generator=g).to(device)
        self.slot_ids = torch.randperm(cfg.max_num_seqs, generator=g)[:tokens].to(device)
        self.kv_cache = model.new_kv_cache()
        self.kv_cache.normal_(0.0, 1.0, generator=torch.Generator(device=device).manual_seed(7))
        _, self.slices = maybe_create_ubatch_slices(True, [1] * tokens, tokens, tokens, NUM_UBATCHES)
        self.descriptor = BatchDescriptor(tokens, tokens, True)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slot_ids, self.kv_cache


def build(work: Workload, case: CommCase, backend: str) -> dict[str, Any]:
    """Capture the five graphs of one comm case in one capture phase; return callables."""
    model = work.model
    overlapped = CommOverlapDecoder(model, case.payload_bytes, wait_us=case.wait_us)
    in_line = CommOverlapDecoder(model, case.payload_bytes, wait_us=case.wait_us, overlap=False)
    runtime = GraphRuntime(backend, progress=False)
    wrappers: dict[str, Any] = {
        OVERLAPPED: UBatchWrapper(overlapped, runtime, name="overlapped", handover_timeout=120),
        IN_LINE: UBatchWrapper(in_line, runtime, name="in-line", handover_timeout=120),
        UB_COMPUTE: UBatchWrapper(model, runtime, name="ubatched-compute", handover_timeout=120),
        WHOLE_IN_LINE: CUDAGraphWrapper(in_line, runtime, FULL, name="whole-in-line"),
        WHOLE_COMPUTE: CUDAGraphWrapper(model, runtime, FULL, name="whole-compute"),
    }

    def call(name: str, mode: CUDAGraphMode = FULL) -> torch.Tensor:
        slices = work.slices if name.startswith("ubatched") else None
        with set_forward_context(mode, work.descriptor, work.tokens, ubatch_slices=slices):
            return wrappers[name](*work.inputs())

    graphs = {name: (lambda name=name: call(name)) for name in GRAPHS}
    started = time.perf_counter()
    with runtime.capture_phase():
        for fn in graphs.values():
            fn()
    capture_s = time.perf_counter() - started
    entry = wrappers[OVERLAPPED].graphs[work.descriptor]
    return {
        "graphs": graphs,
        "eager": {
            "eager": lambda: overlapped(*work.inputs()),
            "ubatched eager (threads)": lambda: call(OVERLAPPED, NONE),
        },
        "capture_s": capture_s,
        "num_ubatches": entry.num_ubatches,
        "ubatch_slices": [s.as_tuple() for s in entry.ubatch_slices],
        "pool_bytes": entry.pool_bytes,
    }


def check_equal(work: Workload, built: dict[str, Any]) -> dict[str, Any]:
    """Both ubatched graphs' logits against the plain eager decoder, with the noise of splitting.

    Running a batch as two halves changes GEMM shapes, so low-precision logits may differ in the
    last bits from the full batch even with no micro-batching machinery at all. That "split noise"
    (eager halves against eager full) is measured and allowed for; against the eager halves
    themselves the ubatched graphs should agree to rounding.
    """
    kv_before = work.kv_cache.clone()

    def fresh(fn: Any) -> torch.Tensor:
        work.kv_cache.copy_(kv_before)
        return fn().float().clone()

    reference = fresh(lambda: work.model(*work.inputs()))
    halves = fresh(
        lambda: torch.cat(
            [work.model(*(t[s.token_slice] for t in work.inputs()[:3]), work.kv_cache) for s in work.slices]
        )
    )
    threads = fresh(built["eager"]["ubatched eager (threads)"])
    overlapped = fresh(built["graphs"][OVERLAPPED])
    in_line = fresh(built["graphs"][IN_LINE])
    work.kv_cache.copy_(kv_before)
    scale = reference.abs().max().item()
    split_noise = (halves - reference).abs().max().item()
    err = max((overlapped - reference).abs().max().item(), (in_line - reference).abs().max().item())
    relative = 2e-2 if work.model.config.dtype == torch.bfloat16 else 1e-4
    allowed = max(relative * max(scale, 1.0), 2 * split_noise)
    return {
        "max_abs_err_vs_eager": err,
        "max_abs_err_vs_eager_halves": (overlapped - halves).abs().max().item(),
        "max_abs_err_vs_ubatched_threads": (overlapped - threads).abs().max().item(),
        "max_abs_err_overlapped_vs_in_line": (overlapped - in_line).abs().max().item(),
        "split_noise": split_noise,
        "max_abs_logit": scale,
        "allowed_abs_err": allowed,
        "equal_to_eager": err <= allowed,
    }


def overlap_from_step_times(medians: dict[str, float]) -> dict[str, float | None]:
    """How much of the comm the second stream hid, judged from the ubatched graphs' step times.

    The hidden share is left out (None) when the exchanges add less than ``MIN_JUDGED_COMM`` of the
    step: a difference of medians that small is timing noise, not overlap.
    """
    overlapped, in_line, compute = medians[OVERLAPPED], medians[IN_LINE], medians[UB_COMPUTE]
    comm = in_line - compute
    judged = comm > MIN_JUDGED_COMM * compute
    return {
        "comm_in_line_ms": comm,
        "comm_hidden_fraction": (in_line - overlapped) / comm if judged else None,
        "overlapped_vs_in_line": overlapped / in_line,
        "overlapped_vs_whole_in_line": overlapped / medians[WHOLE_IN_LINE],
    }


def profile_overlap(fn: Any, case: CommCase, replays: int, trace: Path) -> dict[str, Any]:
    """Profile ``replays`` calls of ``fn`` into ``trace``: how much comm device time ran under compute."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    activities = read_chrome_trace(trace)
    figures = overlap_seen(activities, case.is_comm).per(replays)
    figures["activities"] = breakdown(activities, replays)
    return figures


def profile_case(
    built: dict[str, Any], case: CommCase, replays: int, trace_dir: Path | None
) -> dict[str, Any]:
    """The overlapped and the in-line graph profiled; traces kept (gzipped) in ``trace_dir`` if given."""
    profiles = {}
    with tempfile.TemporaryDirectory(prefix="gpu-ubatch-trace-") as tmp:
        for name in (OVERLAPPED, IN_LINE):
            slug = f"{case.label}-{name}".replace(",", "").replace(" ", "-")
            trace = Path(tmp, f"{slug}.json")
            profiles[name] = profile_overlap(built["graphs"][name], case, replays, trace)
            if trace_dir is not None:
                trace_dir.mkdir(parents=True, exist_ok=True)
                with trace.open("rb") as src, gzip.open(trace_dir / f"{slug}.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    return profiles


# ------------------------------------------------------------------------- DP coordination (N ranks)

DP_SCENARIOS: dict[str, list[tuple[int, int, CUDAGraphMode]]] = {
    # name -> per-rank pattern (real tokens, padded tokens, mode); rank r uses entry r % len.
    "all_want_ubatch": [(200, 256, FULL), (240, 256, FULL), (150, 160, FULL), (190, 192, FULL)],
    "one_rank_small": [(200, 256, FULL), (6, 8, FULL)],
    "one_rank_piecewise": [(200, 256, FULL), (240, 256, CUDAGraphMode.PIECEWISE)],
    "all_eager": [(200, 200, NONE), (37, 37, NONE)],
}


def _dp_worker(rank: int, nproc: int, port: int, backend: str, out_dir: str, iters: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=nproc,
        timeout=datetime.timedelta(seconds=60),
    )
    config = UBatchConfig(enabled=True, num_ubatches=NUM_UBATCHES)
    answers: dict[str, Any] = {}
    for name, pattern in DP_SCENARIOS.items():
        real, padded, mode = pattern[rank % len(pattern)]
        agreed = coordinate_batch_across_dp(
            real, num_tokens_padded=padded, ubatch_config=config, uniform_decode=True, mode=mode
        )
        answers[name] = [agreed.should_ubatch, agreed.mode.name, list(agreed.num_tokens_across_dp)]
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        coordinate_batch_across_dp(
            200, num_tokens_padded=256, ubatch_config=config, uniform_decode=True, mode=FULL
        )
        samples.append((time.perf_counter_ns() - start) / 1e3)
    answers["latency_us"] = Stats.of(samples).as_dict("us")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(answers))
    dist.barrier()
    dist.destroy_process_group()


def run_dp(nproc: int, backend: str, iters: int) -> dict[str, Any]:
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise SystemExit(
            f"error: NCCL needs one GPU per rank: --nproc {nproc} but this host has "
            f"{torch.cuda.device_count()} GPU(s); use --dp-backend gloo to run the ranks on CPU"
        )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gpu-ubatch-dp-") as tmp:
        mp.spawn(_dp_worker, args=(nproc, port, backend, tmp, iters), nprocs=nproc, join=True)
        answers = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)]
    agreed = {name: all(a[name] == answers[0][name] for a in answers) for name in DP_SCENARIOS}
    return {
        "nproc": nproc,
        "backend": backend,
        "scenarios": {name: answers[0][name] for name in DP_SCENARIOS},
        "all_ranks_agree": agreed,
        "latency_us_per_rank": [a["latency_us"] for a in answers],
    }


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    args = parse_args()
    device = resolve_device(args.device)
    on_gpu = device.type == "cuda"
    budget = Budget(args.budget_s)
    notes: list[str] = []
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    payloads = parse_numbers(args.payload_mib, "--payload-mib")
    waits = parse_numbers(args.wait_us, "--wait-us")
    if args.profile_replays < 0:
        raise SystemExit(f"error: --profile-replays must be >= 0, got {args.profile_replays}")
    if args.quick:
        config = ModelConfig.tiny(max_seq_len=64, max_num_seqs=64, dtype=torch.float32, device=device)
        tokens, payloads, rounds, iters = 16, [0.0, 0.25], 2, 3
        waits = [10.0] if on_gpu else []
    else:
        make = ModelConfig.small if args.model == "small" else ModelConfig.large
        config = make(max_seq_len=args.max_seq_len, dtype=dtype, device=device)
        tokens, rounds, iters = args.tokens, 5, 20
    if tokens > config.max_num_seqs:
        raise SystemExit(f"error: --tokens {tokens} exceeds the model's {config.max_num_seqs} request slots")
    if not on_gpu:
        notes.append(needs_cuda("graph capture, comm stream and overlap figures (eager backend used)"))
        if any(w > 0 for w in waits):
            notes.append(needs_cuda("the spin (--wait-us) cases"))
        waits = []
    cases = [CommCase(payload_mib=p) for p in payloads] + [CommCase(wait_us=w) for w in waits if w > 0]
    if not cases:
        raise SystemExit("error: no comm case to run: give --payload-mib or (on CUDA) --wait-us values")
    backend = "cuda" if on_gpu else "eager"
    model = ReferenceDecoder(config, seed=0)
    model_name = "tiny" if args.quick else args.model
    print(
        f"model: {model_name}, {model.param_count() / 1e6:.1f}M params, {config.num_layers} layers, "
        f"{config.dtype}, {tokens} tokens in {NUM_UBATCHES} ubatches, device {device}"
    )

    timer = CallTimer(device)
    work = Workload(model, tokens, device)
    results: list[dict[str, Any]] = []
    for index, case in enumerate(cases):
        built = build(work, case, backend)
        equality = check_equal(work, built)
        share = budget.share(len(cases) - index)
        variants = dict(built["graphs"])
        variants["eager"] = built["eager"]["eager"]
        per_round = max(1, iters // 2) if share < 10 else iters
        samples = time_interleaved(variants, timer, rounds=rounds, iters=per_round)
        stats = {name: Stats.of(s) for name, s in samples.items()}
        medians = {name: s.median for name, s in stats.items()}
        entry: dict[str, Any] = {
            "case": case.label,
            "payload_mib": case.payload_mib,
            "wait_us": case.wait_us,
            "num_ubatches": built["num_ubatches"],
            "ubatch_slices": built["ubatch_slices"],
            "ubatch_graph_pool_bytes": built["pool_bytes"],
            "capture_s": built["capture_s"],
            "equality": equality,
            "step_ms": {name: s.as_dict("ms") for name, s in stats.items()},
        }
        rows = [(name, s.median, s.p10, s.p90) for name, s in stats.items()]
        print_table(f"{case.label} per exchange: step time (ms)", ("variant", "median", "p10", "p90"), rows)
        print(
            f"ubatched graphs vs eager decoder: max abs err {equality['max_abs_err_vs_eager']:.3g} "
            f"(allowed {equality['allowed_abs_err']:.3g}; logits up to {equality['max_abs_logit']:.3g}) -> "
            f"{'EQUAL' if equality['equal_to_eager'] else 'NOT EQUAL'}; overlapped vs in line "
            f"{equality['max_abs_err_overlapped_vs_in_line']:.3g}, vs ubatched threads "
            f"{equality['max_abs_err_vs_ubatched_threads']:.3g}"
        )
        if on_gpu:
            entry["overlap"] = o = overlap_from_step_times(medians)
            hidden = "-" if o["comm_hidden_fraction"] is None else f"{o['comm_hidden_fraction']:.2f}"
            print(
                f"step times: the exchanges add {o['comm_in_line_ms']:.3f} ms in line; overlapped "
                f"{medians[OVERLAPPED]:.3f} ms vs in line {medians[IN_LINE]:.3f} ms -> comm hidden {hidden}"
            )
            if args.profile_replays and case.profiled:
                entry["profile"] = profile_case(built, case, args.profile_replays, args.trace_dir)
                seen = entry["profile"][OVERLAPPED]
                if seen["activities_per_replay"] == 0:
                    notes.append(f"{case.label}: the profiler reported no device activity in graph replays")
                else:
                    _print_profile(seen, entry["profile"][IN_LINE])
        results.append(entry)

    summary = [
        (
            r["case"],
            r["step_ms"][WHOLE_IN_LINE]["median_ms"],
            r["step_ms"][IN_LINE]["median_ms"],
            r["step_ms"][OVERLAPPED]["median_ms"],
            r.get("overlap", {}).get("comm_hidden_fraction"),
            r.get("profile", {}).get(OVERLAPPED, {}).get("comm_hidden_fraction"),
            r["equality"]["equal_to_eager"],
        )
        for r in results
    ]
    print_table(
        "Summary (medians, ms; comm hidden: from step times / seen in the profiler)",
        ("comm per exchange", "whole", "ubatched in line", "ubatched overlapped", "hidden", "seen", "equal"),
        summary,
    )

    targets = [
        target(
            f"ubatched graphs max abs err vs eager ({r['case']})",
            r["equality"]["max_abs_err_vs_eager"],
            r["equality"]["allowed_abs_err"],
        )
        for r in results
    ]
    for r in results:
        if on_gpu and (r["payload_mib"] > 0 or r["wait_us"] > 0):
            # Below 1: putting the exchanges on the comm stream made the same ubatched step faster.
            name = f"ubatched overlapped / in line ({r['case']})"
            targets.append(target(name, r["overlap"]["overlapped_vs_in_line"], 1.0))

    dp: dict[str, Any] | None = None
    if args.nproc > 0:
        dp = run_dp(args.nproc, args.dp_backend, iters=20 if args.quick else 200)
        rows = [(name, str(v), dp["all_ranks_agree"][name]) for name, v in dp["scenarios"].items()]
        title = f"DP coordination over {args.dp_backend}, {args.nproc} ranks"
        print_table(title, ("scenario", "agreed", "all ranks"), rows)
        medians = [lat["median_us"] for lat in dp["latency_us_per_rank"]]
        print(f"coordination latency per rank (median us): {', '.join(f'{m:.1f}' for m in medians)}")
    else:
        notes.append("DP coordination over NCCL not run (pass --nproc N, one GPU per rank)")

    write_results(
        args.out,
        benchmark="gpu_ubatch",
        command=command_line(),
        device=device,
        config={
            "model": model_name,
            "params": model.param_count(),
            "dtype": str(config.dtype),
            "tokens": tokens,
            "max_seq_len": config.max_seq_len,
            "num_ubatches": NUM_UBATCHES,
            "cases": [case.label for case in cases],
            "profile_replays": args.profile_replays,
            "backend": backend,
            "quick": args.quick,
        },
        results={"cases": results, "dp": dp},
        targets=targets,
        notes=notes,
    )
    print(f"\nwrote {args.out}")
    print_targets(targets)
    failed = [r["case"] for r in results if not r["equality"]["equal_to_eager"]]
    if dp is not None and not all(dp["all_ranks_agree"].values()):
        print("error: the DP ranks did not all agree", file=sys.stderr)
        return 1
    if failed:
        print(f"error: a ubatched graph differs from eager with {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _print_profile(seen: dict[str, Any], control: dict[str, Any]) -> None:
    print(
        f"profiler, per replay: {seen['comm_activities_per_replay']:g} comm kernels, "
        f"{seen['comm_us']:.1f} us of comm, {seen['comm_under_compute_us']:.1f} us of it under compute "
        f"({_fraction(seen['comm_hidden_fraction'])}); in the in-line graph "
        f"{control['comm_under_compute_us']:.1f} us ({_fraction(control['comm_hidden_fraction'])})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
