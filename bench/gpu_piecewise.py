"""Piecewise graphs on mixed prefill/decode batches: equality with eager, step time, pool memory.

The reference decoder (``ModelConfig.small()``, ~60M parameters, bf16) runs a few batch mixes -
uniform decode, and prefill chunks flattened together with decodes - three ways:

* ``eager``: the model called directly on the real (unpadded) tokens, with per-request attention;
* ``piecewise``: ``MixedBatchRunner`` in PIECEWISE mode: the step padded to its capture size, the
  graph segments between attention calls replayed, attention run eagerly between them;
* ``full`` (uniform decode only): ``MixedBatchRunner`` in FULL_AND_PIECEWISE mode, which serves
  uniform decode from one FULL graph per size (mixed batches go piecewise there too).

For each mix: the largest absolute difference between the piecewise (and full) logits and eager
on the same KV cache, and step times timed interleaved in rounds (CUDA events, each step
synchronized). Then the pool memory the piecewise graphs hold: per capture size, from the capture
events (growth of the shared pool's reserved segments), and the shared pool's total.

    python3 bench/gpu_piecewise.py --out bench/results/gpu_piecewise.json

``--quick`` runs the tiny model on a few small mixes in seconds (on a CPU too, where the eager
backend stands in for CUDA graphs: its times are not graph times and its pool bytes are 0).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    needs_cuda,
    print_table,
    print_targets,
    resolve_device,
    target,
    time_interleaved,
    write_results,
)
from capture_core.backends import pool_reserved_bytes
from capture_core.events import CaptureEvent, NullObserver
from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import FlatBatch, ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime
from capture_core.sizes import power_of_two_sizes

EAGER, PIECEWISE, FULL = "eager", "piecewise", "full"
SMALL_MAX_SEQ_LEN = 512
"""A FULL graph's attention reads each slot's whole row (fixed shapes), so its cost follows this."""


@dataclass(frozen=True)
class Mix:
    """A batch mix: decode requests (one token each) and prefill chunks, flattened into one step."""

    name: str
    decodes: int
    prefill_chunks: tuple[int, ...] = ()
    decode_context: int = 256
    """Tokens already cached for each decoding request."""

    @property
    def num_tokens(self) -> int:
        return self.decodes + sum(self.prefill_chunks)

    @property
    def uniform_decode(self) -> bool:
        return not self.prefill_chunks

    def batch(self, config: ModelConfig, device: torch.device) -> FlatBatch:
        generator = torch.Generator().manual_seed(self.num_tokens)
        lengths = [1] * self.decodes + list(self.prefill_chunks)
        contexts = [min(self.decode_context, config.max_seq_len - 1)] * self.decodes + [0] * len(
            self.prefill_chunks
        )
        tokens = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
        return flatten_requests(tokens, contexts, list(range(len(lengths))), device=device)


MIXES = (
    Mix("decode x32", 32),
    Mix("decode x128", 128),
    Mix("decode x16 + prefill 32", 16, (32,)),
    Mix("decode x32 + prefill 64", 32, (64,)),
    Mix("decode x64 + prefill 4x32", 64, (32, 32, 32, 32)),
    Mix("decode x8 + prefill 200", 8, (200,)),
)
QUICK_MIXES = (Mix("decode x4", 4, decode_context=8), Mix("decode x3 + prefill 5", 3, (5,), decode_context=8))


class CaptureLog(NullObserver):
    """Keeps the capture events (the graph's mode, size, segments, pool bytes, capture seconds)."""

    def __init__(self) -> None:
        self.captures: list[CaptureEvent] = []

    def on_capture(self, event: CaptureEvent) -> None:
        self.captures.append(event)


def build(
    model: ReferenceDecoder, mode: CUDAGraphMode, sizes: list[int], on_cuda: bool
) -> tuple[MixedBatchRunner, CaptureLog, float]:
    log = CaptureLog()
    backend = "cuda" if on_cuda else "eager"
    runtime = GraphRuntime(backend, address_check="always_on", observer=log, progress=False)
    runner = MixedBatchRunner(model, runtime, sizes, mode, name=mode.label)
    started = time.perf_counter()
    runner.capture()
    return runner, log, time.perf_counter() - started


def shared_pool_bytes(runner: MixedBatchRunner, on_cuda: bool) -> int:
    """What a runner's one shared graph pool reserves in all (0 for the eager backend)."""
    pool = getattr(runner.runtime.backend, "pool", None)
    return pool_reserved_bytes(pool) if on_cuda and pool is not None else 0


def max_error(runner: MixedBatchRunner, batch: FlatBatch, reference_kv: torch.Tensor) -> tuple[float, float]:
    """Largest |graph - eager| over the logits of one step on a copy of the same cache, and the scale."""
    saved = runner.kv_cache.clone()
    runner.kv_cache.copy_(reference_kv)
    logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)
    logits = logits.float().clone()
    runner.kv_cache.copy_(reference_kv)
    eager = runner.step_eager(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata).float()
    runner.kv_cache.copy_(saved)
    return (logits - eager).abs().max().item(), eager.abs().max().item()


def stepper(fn: Callable[..., torch.Tensor], batch: FlatBatch) -> Callable[[], Any]:
    def step() -> torch.Tensor:
        return fn(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)

    return step


def main() -> int:
    parser = base_parser(
        __doc__.splitlines()[0], default_out="bench/results/gpu_piecewise.json", default_budget_s=150
    )
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per mix (at most)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per variant per round")
    args = parser.parse_args()
    device = resolve_device(args.device)
    on_cuda = device.type == "cuda"
    budget = Budget(args.budget_s)
    notes: list[str] = [
        "eager and piecewise attention read each request's own context; a FULL graph's attention reads "
        "the slot's whole row (max_seq_len keys, masked), the price of fixed shapes"
    ]
    if not on_cuda:
        notes.append(
            needs_cuda("CUDA graphs (the eager backend stood in: not graph times; pool bytes are 0)")
        )

    quick = args.quick or not on_cuda
    config = (
        ModelConfig.tiny(max_num_seqs=16, max_seq_len=64)
        if quick
        else ModelConfig.small(dtype=torch.bfloat16, device=str(device), max_seq_len=SMALL_MAX_SEQ_LEN)
    )
    mixes = QUICK_MIXES if quick else MIXES
    sizes = power_of_two_sizes(8 if quick else 256)
    model = ReferenceDecoder(config)
    dtype = str(config.dtype).removeprefix("torch.")
    print(f"reference decoder: {model.param_count() / 1e6:.1f}M parameters, {dtype}, capture sizes {sizes}")

    piecewise, pw_log, pw_capture_s = build(model, CUDAGraphMode.PIECEWISE, sizes, on_cuda)
    full, full_log, full_capture_s = build(model, CUDAGraphMode.FULL_AND_PIECEWISE, sizes, on_cuda)
    pool_total = shared_pool_bytes(piecewise, on_cuda)
    full_and_pw_pool_total = shared_pool_bytes(full, on_cuda)
    # The FULL decode graph of each size, from the FULL_AND_PIECEWISE runner (its own shared pool).
    full_graphs = {e.descriptor.num_tokens: e for e in full_log.captures if e.mode is CUDAGraphMode.FULL}
    graphs = [
        {
            "num_tokens": e.descriptor.num_tokens,
            "segments": e.num_segments,
            "pool_bytes": e.pool_bytes,
            "capture_s": e.capture_seconds,
            "full_decode_pool_bytes": full_graphs[e.descriptor.num_tokens].pool_bytes,
            "full_decode_capture_s": full_graphs[e.descriptor.num_tokens].capture_seconds,
        }
        for e in pw_log.captures
    ]
    print_table(
        f"Graphs by size, largest first: piecewise (PIECEWISE runner, captured in {pw_capture_s:.1f}s) "
        "and FULL decode (FULL_AND_PIECEWISE runner)",
        ("tokens", "segments", "pw pool MiB", "pw capture s", "full pool MiB", "full capture s"),
        [
            (
                g["num_tokens"],
                g["segments"],
                g["pool_bytes"] / 2**20,
                g["capture_s"],
                g["full_decode_pool_bytes"] / 2**20,
                g["full_decode_capture_s"],
            )
            for g in graphs
        ],
    )
    print(
        f"shared pool reserved: piecewise graphs {pool_total / 2**20:.1f} MiB; "
        f"FULL + piecewise graphs {full_and_pw_pool_total / 2**20:.1f} MiB"
    )

    timer = CallTimer(device)
    results: list[dict[str, Any]] = []
    for index, mix in enumerate(mixes):
        batch = mix.batch(config, device)
        routed = piecewise.route(batch.attn_metadata)
        reference_kv = piecewise.kv_cache.clone()
        errors = {PIECEWISE: max_error(piecewise, batch, reference_kv)}
        variants = {EAGER: stepper(piecewise.step_eager, batch), PIECEWISE: stepper(piecewise.step, batch)}
        if mix.uniform_decode:
            errors[FULL] = max_error(full, batch, reference_kv)
            variants[FULL] = stepper(full.step, batch)
        probe = sum(Stats.of(timer.time_calls(fn, 3)).median for fn in variants.values()) / 1e3
        rounds = Budget.reps_for(
            budget.share(len(mixes) - index), probe * args.iters, floor=2, ceiling=2 if quick else args.rounds
        )
        iters = 3 if quick else args.iters
        samples = time_interleaved(variants, timer, rounds=rounds, iters=iters)
        stats = {name: Stats.of(values) for name, values in samples.items()}
        scale = errors[PIECEWISE][1]
        # bf16 keeps 8 bits of mantissa; padded and unpadded matmuls may pick different kernels.
        tolerance = (3e-2 if config.dtype == torch.bfloat16 else 1e-4) * max(1.0, scale)
        entry = {
            "mix": mix.name,
            "num_tokens": mix.num_tokens,
            "padded_to": routed.descriptor.num_tokens,
            "uniform_decode": mix.uniform_decode,
            "max_abs_error": {name: err for name, (err, _) in errors.items()},
            "logit_scale": scale,
            "tolerance": tolerance,
            "equal_to_eager": all(err <= tolerance for err, _ in errors.values()),
            "rounds": rounds,
            "steps_per_round": iters,
            "step_ms": {name: s.as_dict("ms") for name, s in stats.items()},
            "speedup_vs_eager": {name: stats[EAGER].median / s.median for name, s in stats.items()},
        }
        results.append(entry)
        print(f"  {mix.name}: done ({rounds} rounds x {iters} steps)", flush=True)

    print_table(
        "Step time (median ms; speed-up vs eager) and max |logits - eager|",
        (
            "mix", "tokens", "graph", "eager", "piecewise", "full",
            "pw x", "full x", "pw err", "full err", "equal",
        ),
        [
            (
                r["mix"],
                r["num_tokens"],
                r["padded_to"],
                r["step_ms"][EAGER]["median_ms"],
                r["step_ms"][PIECEWISE]["median_ms"],
                r["step_ms"].get(FULL, {}).get("median_ms"),
                r["speedup_vs_eager"][PIECEWISE],
                r["speedup_vs_eager"].get(FULL),
                r["max_abs_error"][PIECEWISE],
                r["max_abs_error"].get(FULL),
                r["equal_to_eager"],
            )
            for r in results
        ],
    )
    all_equal = all(r["equal_to_eager"] for r in results)
    print(f"\npiecewise replays equal eager on every mix: {'yes' if all_equal else 'NO'}")
    timed = on_cuda and not quick  # CPU and --quick figures are smoke, not results
    mixed = [r for r in results if not r["uniform_decode"]]
    decode = [r for r in results if r["uniform_decode"]]
    targets = [
        target(
            "max |graph - eager| / tolerance, every mix",
            max(max(r["max_abs_error"].values()) / r["tolerance"] for r in results),
            1.0,
        ),
        target(
            "piecewise / eager step time, mixed batches (worst mix)",
            max(1 / r["speedup_vs_eager"][PIECEWISE] for r in mixed) if mixed else None,
            1.0,
            unit="x",
            applies=timed,
        ),
        target(
            "FULL / eager step time, uniform decode (worst mix)",
            max(1 / r["speedup_vs_eager"][FULL] for r in decode) if decode else None,
            1.0,
            unit="x",
            applies=timed,
        ),
    ]
    write_results(
        args.out,
        benchmark="gpu_piecewise",
        command=command_line(),
        device=device,
        config={
            "model": "tiny" if quick else "small",
            "params": model.param_count(),
            "dtype": dtype,
            "max_seq_len": config.max_seq_len,
            "capture_sizes": sizes,
            "quick": quick,
            "address_check": "always_on",
        },
        results={
            "piecewise_graphs": graphs,
            "piecewise_pool_total_bytes": pool_total,
            "full_and_piecewise_pool_total_bytes": full_and_pw_pool_total,
            "piecewise_capture_s": pw_capture_s,
            "full_and_piecewise_capture_s": full_capture_s,
            "full_and_piecewise_graphs": len(full_log.captures),
            "mixes": results,
            "all_equal_to_eager": all_equal,
        },
        targets=targets,
        notes=notes,
    )
    print(f"results written to {args.out}")
    print_targets(targets)
    return 0 if all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
