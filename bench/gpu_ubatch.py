"""Micro-batching (DBO): two ubatches captured into one graph, their comm hidden under compute.

The workload is the reference decoder with an exchange after every layer (``CommOverlapDecoder``:
the hidden states pass through a receive buffer on the comm stream, plus a device-to-device payload
copy standing in for collective traffic). For each payload size it captures, in one capture phase:

* ``ubatched``: the step split into 2 ubatches, captured through ``UBatchWrapper`` into ONE graph
  (ubatch 1's compute is queued while ubatch 0's exchange runs on the comm stream);
* ``sequential``: the same step as one plain graph (compute and exchange in line, one stream);
* ``compute only``: the plain decoder's graph; ``comm only``: a graph of the exchanges alone.

It checks that the ubatched graph's logits equal the non-ubatched eager decoder's (and the
ubatched eager run on threads), then times every variant interleaved (CUDA events, medians) and
reports the overlap: of the comm-only time, how much the ubatched step hides, i.e.
``(compute + comm - ubatched) / comm``, next to ``sequential`` (what no overlap costs).

    python3 bench/gpu_ubatch.py --out bench/results/h200/gpu_ubatch.json

``--nproc N`` also runs ``coordinate_batch_across_dp`` in N processes (NCCL by default, one GPU
per rank: the two-GPU run is ``--nproc 2``; ``--dp-backend gloo`` runs the ranks on CPU), checks
that every rank agreed on every scenario and times one coordination. ``--quick`` is a CPU-sized
dry run (tiny model, eager backend); its figures are not results.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import tempfile
import time
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
from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.model import ModelConfig, ReferenceDecoder
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.dp import coordinate_batch_across_dp
from capture_core.ubatch.overlap import CommOverlapDecoder
from capture_core.ubatch.slices import UBatchConfig, maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper
from capture_core.wrapper import CUDAGraphWrapper

FULL, NONE = CUDAGraphMode.FULL, CUDAGraphMode.NONE
MIB = 2**20
NUM_UBATCHES = 2


def parse_args() -> Any:
    parser = base_parser(
        "Micro-batching: 2 ubatches in one graph, equality with eager, step time and overlap.",
        default_out="bench/results/gpu_ubatch.json",
        default_budget_s=120,
    )
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per step (default 256)")
    parser.add_argument(
        "--payload-mib",
        default="0,8,32",
        help="comma-separated payload sizes copied on the comm stream per layer, MiB (default 0,8,32)",
    )
    parser.add_argument("--max-seq-len", type=int, default=512, help="KV row length (default 512)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--nproc", type=int, default=0, help="DP ranks for the coordination run (0: skip)")
    parser.add_argument("--dp-backend", choices=("nccl", "gloo"), default="nccl")
    return parser.parse_args()


# --------------------------------------------------------------------------------- the workload


class Workload:
    """Static decode inputs of ``tokens`` requests, and the graphs of one payload size."""

    def __init__(
        self, model: ReferenceDecoder, tokens: int, payload_bytes: int, device: torch.device
    ) -> None:
        self.model = model
        self.tokens = tokens
        cfg = model.config
        g = torch.Generator().manual_seed(1234)
        self.input_ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g).to(device)
        self.positions = torch.randint(0, cfg.max_seq_len, (tokens,), generator=g).to(device)
        self.slot_ids = torch.randperm(cfg.max_num_seqs, generator=g)[:tokens].to(device)
        self.kv_cache = model.new_kv_cache()
        self.kv_cache.normal_(0.0, 1.0, generator=torch.Generator(device=device).manual_seed(7))
        self.overlap = CommOverlapDecoder(model, payload_bytes)
        self.hidden = torch.zeros(tokens, cfg.hidden_size, dtype=cfg.dtype, device=device)
        _, self.slices = maybe_create_ubatch_slices(True, [1] * tokens, tokens, tokens, NUM_UBATCHES)
        self.descriptor = BatchDescriptor(tokens, tokens, True)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slot_ids, self.kv_cache

    def comm_only(self, hidden: torch.Tensor) -> torch.Tensor:
        """The exchanges of one step without the layers between them."""
        for _ in range(self.model.config.num_layers):
            hidden = self.overlap.exchange(hidden)
        return hidden


def build(work: Workload, backend: str) -> dict[str, Any]:
    """Capture the four graphs of one payload size in one capture phase; return callables."""
    runtime = GraphRuntime(backend, progress=False)
    ubatched = UBatchWrapper(work.overlap, runtime, name="ubatched", handover_timeout=120)
    sequential = CUDAGraphWrapper(work.overlap, runtime, FULL, name="sequential")
    compute = CUDAGraphWrapper(work.model, runtime, FULL, name="compute-only")
    comm = CUDAGraphWrapper(work.comm_only, runtime, FULL, name="comm-only")

    def call(wrapper: Any, *args: Any, slices: Any = None, mode: CUDAGraphMode = FULL) -> torch.Tensor:
        with set_forward_context(mode, work.descriptor, work.tokens, ubatch_slices=slices):
            return wrapper(*args)

    variants = {
        "ubatched graph": lambda: call(ubatched, *work.inputs(), slices=work.slices),
        "sequential graph": lambda: call(sequential, *work.inputs()),
        "compute-only graph": lambda: call(compute, *work.inputs()),
        "comm-only graph": lambda: call(comm, work.hidden),
        "ubatched eager (threads)": lambda: call(ubatched, *work.inputs(), slices=work.slices, mode=NONE),
        "eager": lambda: work.overlap(*work.inputs()),
    }
    started = time.perf_counter()
    with runtime.capture_phase():
        for name in ("ubatched graph", "sequential graph", "compute-only graph", "comm-only graph"):
            variants[name]()
    capture_s = time.perf_counter() - started
    entry = ubatched.graphs[work.tokens]
    return {
        "variants": variants,
        "capture_s": capture_s,
        "num_ubatches": entry.num_ubatches,
        "ubatch_slices": [s.as_tuple() for s in entry.ubatch_slices],
        "pool_bytes": entry.pool_bytes,
    }


def check_equal(work: Workload, variants: dict[str, Any]) -> dict[str, Any]:
    """The ubatched graph's logits against the plain eager decoder, with the noise of splitting.

    Running a batch as two halves changes GEMM shapes, so low-precision logits may differ in the
    last bits from the full batch even with no micro-batching machinery at all. That "split noise"
    (eager halves against eager full) is measured and allowed for; against the eager halves
    themselves the ubatched graph should agree to rounding.
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
    threads = fresh(variants["ubatched eager (threads)"])
    graph = fresh(variants["ubatched graph"])
    scale = reference.abs().max().item()
    split_noise = (halves - reference).abs().max().item()
    err_eager = (graph - reference).abs().max().item()
    relative = 2e-2 if work.model.config.dtype == torch.bfloat16 else 1e-4
    allowed = max(relative * max(scale, 1.0), 2 * split_noise)
    return {
        "max_abs_err_vs_eager": err_eager,
        "max_abs_err_vs_eager_halves": (graph - halves).abs().max().item(),
        "max_abs_err_vs_ubatched_threads": (graph - threads).abs().max().item(),
        "split_noise": split_noise,
        "max_abs_logit": scale,
        "allowed_abs_err": allowed,
        "equal_to_eager": err_eager <= allowed,
    }


def overlap_figures(medians: dict[str, float]) -> dict[str, float | None]:
    compute, comm = medians["compute-only graph"], medians["comm-only graph"]
    ubatched, sequential = medians["ubatched graph"], medians["sequential graph"]
    hidden = (compute + comm - ubatched) / comm if comm > 0 else None
    return {
        "compute_plus_comm_ms": compute + comm,
        "comm_hidden_fraction": hidden,
        "ubatched_speedup_vs_sequential": sequential / ubatched if ubatched > 0 else None,
    }


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
    payloads = [float(p) for p in args.payload_mib.split(",") if p.strip()]
    if args.quick:
        config = ModelConfig.tiny(max_seq_len=64, max_num_seqs=64, dtype=torch.float32, device=device)
        tokens, payloads, rounds, iters = 16, [0.0, 0.25], 2, 3
    else:
        config = ModelConfig.small(max_seq_len=args.max_seq_len, dtype=dtype, device=device)
        tokens, rounds, iters = args.tokens, 5, 20
    if tokens > config.max_num_seqs:
        raise SystemExit(f"error: --tokens {tokens} exceeds the model's {config.max_num_seqs} request slots")
    if not on_gpu:
        notes.append(needs_cuda("graph capture, comm stream and overlap figures (eager backend used)"))
    backend = "cuda" if on_gpu else "eager"
    model = ReferenceDecoder(config, seed=0)
    print(f"model: {model.param_count() / 1e6:.1f}M params, {config.dtype}, {tokens} tokens, device {device}")

    timer = CallTimer(device)
    results: list[dict[str, Any]] = []
    for index, payload_mib in enumerate(payloads):
        work = Workload(model, tokens, int(payload_mib * MIB), device)
        built = build(work, backend)
        equality = check_equal(work, built["variants"])
        share = budget.share(len(payloads) - index)
        variants = built["variants"] if on_gpu else {
            k: v for k, v in built["variants"].items() if "graph" not in k or k == "ubatched graph"
        }
        per_round = max(1, iters // 2) if share < 10 else iters
        samples = time_interleaved(variants, timer, rounds=rounds, iters=per_round)
        stats = {name: Stats.of(s) for name, s in samples.items()}
        medians = {name: s.median for name, s in stats.items()}
        entry: dict[str, Any] = {
            "payload_mib": payload_mib,
            "num_ubatches": built["num_ubatches"],
            "ubatch_slices": built["ubatch_slices"],
            "ubatch_graph_pool_bytes": built["pool_bytes"],
            "capture_s": built["capture_s"],
            "equality": equality,
            "step_ms": {name: s.as_dict("ms") for name, s in stats.items()},
        }
        if on_gpu:
            entry["overlap"] = overlap_figures(medians)
        results.append(entry)
        rows = [(name, s.median, s.p10, s.p90) for name, s in stats.items()]
        title = f"payload {payload_mib:g} MiB per layer: step time (ms)"
        print_table(title, ("variant", "median", "p10", "p90"), rows)
        print(
            f"ubatched graph vs eager decoder: max abs err {equality['max_abs_err_vs_eager']:.3g} "
            f"(allowed {equality['allowed_abs_err']:.3g}; logits up to {equality['max_abs_logit']:.3g}) -> "
            f"{'equal' if equality['equal_to_eager'] else 'NOT EQUAL'}; vs eager halves "
            f"{equality['max_abs_err_vs_eager_halves']:.3g}, vs ubatched threads "
            f"{equality['max_abs_err_vs_ubatched_threads']:.3g}"
        )
        if on_gpu:
            o = entry["overlap"]
            hidden = "-" if o["comm_hidden_fraction"] is None else f"{o['comm_hidden_fraction']:.2f}"
            print(
                f"compute alone + comm alone = {o['compute_plus_comm_ms']:.3f} ms, ubatched together = "
                f"{medians['ubatched graph']:.3f} ms, sequential = {medians['sequential graph']:.3f} ms; "
                f"comm hidden: {hidden}"
            )

    summary = [
        (
            r["payload_mib"],
            r["step_ms"].get("sequential graph", {}).get("median_ms"),
            r["step_ms"]["ubatched graph"]["median_ms"],
            r.get("overlap", {}).get("compute_plus_comm_ms"),
            r.get("overlap", {}).get("comm_hidden_fraction"),
            r["equality"]["equal_to_eager"],
        )
        for r in results
    ]
    print_table(
        "Summary (medians, ms)",
        ("payload MiB", "sequential", "ubatched", "compute+comm alone", "comm hidden", "equal"),
        summary,
    )

    targets = [
        target(
            f"ubatched graph max abs err vs eager ({r['payload_mib']:g} MiB)",
            r["equality"]["max_abs_err_vs_eager"],
            r["equality"]["allowed_abs_err"],
        )
        for r in results
    ]
    heaviest = results[-1]
    if on_gpu and heaviest["payload_mib"] > 0:
        together = heaviest["step_ms"]["ubatched graph"]["median_ms"]
        alone = heaviest["overlap"]["compute_plus_comm_ms"]
        # Below 1: the ubatched step took less than compute and comm one after the other.
        name = f"ubatched / (compute + comm alone) ({heaviest['payload_mib']:g} MiB)"
        targets.append(target(name, together / alone, 1.0))
    print_targets(targets)

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
            "model": "tiny" if args.quick else "small",
            "params": model.param_count(),
            "dtype": str(config.dtype),
            "tokens": tokens,
            "max_seq_len": config.max_seq_len,
            "num_ubatches": NUM_UBATCHES,
            "payload_mib": payloads,
            "backend": backend,
            "quick": args.quick,
        },
        results={"payloads": results, "dp": dp},
        targets=targets,
        notes=notes,
    )
    print(f"\nwrote {args.out}")
    failed = [r["payload_mib"] for r in results if not r["equality"]["equal_to_eager"]]
    if dp is not None and not all(dp["all_ranks_agree"].values()):
        print("error: the DP ranks did not all agree", file=sys.stderr)
        return 1
    if failed:
        print(f"error: the ubatched graph differs from eager at payloads {failed} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
