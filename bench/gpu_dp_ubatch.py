"""Micro-batching across data-parallel ranks: real collectives hidden under the other ubatch's compute.

The single-process bench (``gpu_ubatch.py``) stands in for communication with a local copy. Here
N processes (one GPU each under NCCL, or CPU processes under gloo) run the reference decoder with
a REAL collective after every layer: the hidden states are all-reduced (averaged) across the
ranks, so a peer's data reaches every rank's logits and a collective paired with the wrong peer
ubatch, or read before it landed, shows as wrong logits. ``--payload-mib`` adds an all-gather of
that many MiB per layer (split among the tokens) to make the traffic bandwidth-bound.

Every rank, in lockstep:

1. runs steps with DIFFERENT batches per rank through ``coordinate_batch_across_dp`` and checks
   that all ranks agreed on micro-batching, the padded size, the mode and the token split;
2. builds the decoder (same seed everywhere, checked by a weight checksum) with the collective on
   the comm stream (``CollectiveOverlapDecoder``);
3. captures, in one capture phase of a ``GraphRuntime`` whose observer is an inspector
   ``Recorder(label="dp-ubatch", rank=r, world_size=N)`` (all ranks write one database): the
   ubatched graphs (2 ubatches, FULL, one per capture size, collectives inside), and for timing
   the same step unsplit ("sequential"), the plain decoder ("compute only") and the collectives
   alone ("comm only");
4. replays each step and checks it against the non-ubatched eager decoder (same collectives);
5. times the four variants with CUDA events, interleaved and barrier-aligned across ranks, and
   reports the overlap ``(compute + comm - ubatched) / comm``.

The parent process gathers every rank's results, checks them, reads back what each rank recorded,
prints the tables (the summary last) and writes the JSON. A rank that fails is named with its
stage and error; a stuck run is stopped after ``--timeout-s`` with every rank's last stage.

    python3 bench/gpu_dp_ubatch.py --nproc 2 --backend nccl --device cuda \\
        --db sqlite:///$OUT/dp.db --out $OUT/gpu_dp_ubatch.json
    python3 bench/gpu_dp_ubatch.py --backend gloo --device cpu --quick   # CPU: eager backend

On a CPU (gloo, eager backend) every step runs for real but nothing is captured and there is no
comm stream, so the timings and overlap figures mean nothing there; the JSON says so.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
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
    print_table,
    print_targets,
    target,
    write_results,
)
from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.reference.overlap import CommOverlapDecoder
from capture_core.runtime import GraphRuntime
from capture_core.sizes import SizeTable
from capture_core.ubatch.context import (
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from capture_core.ubatch.dp import DPCoordination, coordinate_batch_across_dp
from capture_core.ubatch.slices import UBatchConfig, UBatchSlices, maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; the H200 has 2.11.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MIB = 2**20
NUM_UBATCHES = 2
LABEL = "dp-ubatch"
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off on the lent machines; set before spawning so every rank inherits it."""

# Step name -> each rank's real decode tokens as a share of the largest capture size (rank r takes
# entry r % len). They differ per rank on purpose: the ranks must still agree on one plan.
STEPS: dict[str, tuple[float, ...]] = {
    "full vs almost full": (1.0, 0.94),
    "uneven, one size": (0.94, 0.6),
    "both small": (0.45, 0.3),
    "one rank tiny": (0.8, 0.12),
}


def parse_args() -> Any:
    parser = base_parser(
        "Micro-batching across N data-parallel ranks: agreement, ubatch graphs with real "
        "collectives, equality with eager, step time and overlap.",
        default_out="bench/results/gpu_dp_ubatch.json",
        default_budget_s=60,
    )
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="process-group backend")
    parser.add_argument(
        "--db",
        default=None,
        help="inspector database every rank records into (default: a temporary SQLite file, removed)",
    )
    parser.add_argument("--tokens", type=int, default=256, help="largest decode step, tokens (default 256)")
    parser.add_argument(
        "--payload-mib",
        default="0,8",
        help="comma-separated all-gather payloads per layer per step, MiB (default 0,8)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=170.0,
        help="stop every rank and fail after this many seconds (default 170)",
    )
    return parser.parse_args()


# ------------------------------------------------------------------------------- the workload


class CollectiveOverlapDecoder(CommOverlapDecoder):
    """``CommOverlapDecoder`` whose per-layer exchange is a real collective between the ranks.

    The hidden states are all-reduced and divided by the world size (every rank's token ``t``
    becomes the ranks' mean), on the comm stream while the other ubatch computes. A positive
    ``payload_bytes_per_token`` adds an all-gather of that many bytes per token of the ubatch, so
    both ubatches together move what the unsplit step moves.
    """

    def __init__(
        self,
        model: ReferenceDecoder,
        *,
        max_tokens: int,
        payload_bytes_per_token: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(model)
        self.group = group
        self.world = dist.get_world_size(group)
        self.scale = 1.0 / self.world
        self.bytes_per_token = payload_bytes_per_token
        self.python_exchanges = 0
        """Exchanges run by Python: a CUDA graph replay runs its captured collectives without any."""
        device = model.config.device
        rank = dist.get_rank(group)
        self.gather_src = torch.full(
            (max_tokens * payload_bytes_per_token,), rank + 1, dtype=torch.uint8, device=device
        )
        self.gather_dst = torch.empty(self.world * self.gather_src.numel(), dtype=torch.uint8, device=device)

    def exchange(self, hidden: torch.Tensor) -> torch.Tensor:
        """All-reduce ``hidden`` into a fresh buffer on the comm stream; compute resumes on it."""
        self.python_exchanges += 1
        # Allocated on the compute stream, so its memory is never recycled while comm writes it.
        received = torch.empty_like(hidden)
        dbo_yield_and_switch_from_compute_to_comm()
        received.copy_(hidden)
        dist.all_reduce(received, group=self.group)
        received.mul_(self.scale)
        if self.bytes_per_token:
            size = hidden.shape[0] * self.bytes_per_token
            _all_gather(self.gather_dst[: self.world * size], self.gather_src[:size], group=self.group)
        dbo_yield_and_switch_from_comm_to_compute()
        return received

    def comm_only(self, hidden: torch.Tensor) -> torch.Tensor:
        """One step's exchanges without the layers between them: the "comm alone" variant."""
        for _ in range(self.model.config.num_layers):
            hidden = self.exchange(hidden)
        return hidden

    def comm_only_halves(self, hidden: torch.Tensor) -> torch.Tensor:
        """The exchanges a 2-ubatch step makes (two half-size collectives per layer), in line.

        Small collectives are latency-bound, so two halves cost more than one whole: this, not
        ``comm_only``, is the communication the ubatched step actually has to hide.
        """
        half = hidden.shape[0] // NUM_UBATCHES
        first, second = hidden[:half], hidden[half:]
        for _ in range(self.model.config.num_layers):
            first = self.exchange(first)
            second = self.exchange(second)
        return torch.cat([first, second])


class StaticInputs:
    """Decode inputs at the largest size; every step and graph uses prefix views of them."""

    def __init__(self, config: ModelConfig, max_tokens: int) -> None:
        device = config.device
        self.config = config
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)

    def load(self, real: int, padded: int, seed: int) -> None:
        """``real`` random decode tokens, then padding up to ``padded``.

        Padded rows take distinct spare slots instead of the shared padding slot: the all-reduce
        mixes a peer's padded rows into this rank's real rows, so they must be deterministic, and
        many rows writing one KV entry in the same step are not.
        """
        g = torch.Generator().manual_seed(seed)
        cfg = self.config
        ids = torch.zeros(padded, dtype=torch.long)
        positions = torch.zeros(padded, dtype=torch.long)
        ids[:real] = torch.randint(0, cfg.vocab_size, (real,), generator=g)
        positions[:real] = torch.randint(1, cfg.max_seq_len, (real,), generator=g)
        slots = torch.randperm(cfg.max_num_seqs, generator=g)[:padded]
        self.input_ids[:padded].copy_(ids)
        self.positions[:padded].copy_(positions)
        self.slot_ids[:padded].copy_(slots)

    def views(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids[:tokens], self.positions[:tokens], self.slot_ids[:tokens]


@dataclass(frozen=True)
class Job:
    """Everything a rank needs (pickled to the spawned processes)."""

    nproc: int
    port: int
    backend: str
    device_type: str
    quick: bool
    db_url: str
    work_dir: str
    payloads_mib: tuple[float, ...]
    capture_sizes: tuple[int, ...]
    decode_threshold: int
    budget_s: float
    pg_timeout_s: float

    @property
    def max_tokens(self) -> int:
        return max(self.capture_sizes)


def real_tokens(job: Job, rank: int, shares: tuple[float, ...]) -> int:
    return max(1, min(job.max_tokens, round(job.max_tokens * shares[rank % len(shares)])))


class Stage:
    """The rank's current stage, in a file the parent reads to say where a failed or stuck rank was."""

    def __init__(self, work_dir: str, rank: int) -> None:
        self.path = Path(work_dir, f"rank{rank}.stage.json")
        self.name = "starting"

    def __call__(self, name: str) -> None:
        self.name = name
        self.path.write_text(json.dumps({"stage": name, "since": time.time()}))


class RankError(RuntimeError):
    """A check inside a rank failed (the message says what differed)."""


# --------------------------------------------------------------------------------- one rank


def _worker(rank: int, job: Job) -> None:
    stage = Stage(job.work_dir, rank)
    try:
        result = _run_rank(rank, job, stage)
    except BaseException as exc:
        error = {
            "stage": stage.name,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        Path(job.work_dir, f"rank{rank}.error.json").write_text(json.dumps(error))
        raise
    Path(job.work_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))


def _run_rank(rank: int, job: Job, stage: Stage) -> dict[str, Any]:
    from inspector.recording.recorder import Recorder

    on_gpu = job.device_type == "cuda"
    stage("init process group")
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(
        job.backend,
        init_method=f"tcp://127.0.0.1:{job.port}",
        rank=rank,
        world_size=job.nproc,
        timeout=datetime.timedelta(seconds=job.pg_timeout_s),
        device_id=device if on_gpu else None,
    )
    recorder: Recorder | None = None
    try:
        stage("coordinate steps")
        plans = coordinate_steps(job, rank)

        stage("build model")
        if job.quick or not on_gpu:
            slots = max(64, job.max_tokens)
            config = ModelConfig.tiny(max_seq_len=64, max_num_seqs=slots, dtype=torch.float32, device=device)
        else:
            config = ModelConfig.small(max_seq_len=512, dtype=torch.bfloat16, device=device)
        if config.max_num_seqs < job.max_tokens:
            raise RankError(
                f"--tokens {job.max_tokens} exceeds the model's {config.max_num_seqs} request slots"
            )
        model = ReferenceDecoder(config, seed=0)
        checksum = _all_equal(
            "weight checksum", float(sum(p.double().sum().item() for p in model.parameters()))
        )

        recorder = Recorder(
            job.db_url,
            label=LABEL,
            rank=rank,
            world_size=job.nproc,
            config={"nproc": job.nproc, "backend": job.backend, "payload_mib": list(job.payloads_mib)},
        ).start()
        runtime = GraphRuntime("cuda" if on_gpu else "eager", observer=recorder, progress=False)
        bench = DPBench(job, rank, model, runtime, device)

        stage("warm up collectives")
        bench.warm_up()
        stage("capture")
        bench.capture()
        results: dict[str, Any] = {"rank": rank, "weight_checksum": checksum, "steps": []}
        for index, (name, plan) in enumerate(plans.items()):
            stage(f"step {name!r}")
            results["steps"].append({"name": name, **plan.as_dict(), **bench.check_step(index, plan)})
        results["timing"] = []
        budget = Budget(job.budget_s)
        for index, payload in enumerate(job.payloads_mib):
            stage(f"time payload {payload:g} MiB")
            results["timing"].append(bench.time_payload(payload, budget.share(len(job.payloads_mib) - index)))
        stage("flush recorder")
        recorder.flush(timeout=30)
        results["run_id"] = recorder.run_id
        results["recorder_dropped"] = recorder.dropped
        results["graphs"] = bench.graph_summary()
        stage("done")
        dist.barrier()
    finally:
        # On failure the process group is left alone: tearing it down may wait on a peer that is
        # stuck in a collective, and the parent stops every rank anyway.
        if recorder is not None:
            recorder.close()
    dist.destroy_process_group()
    return results


@dataclass(frozen=True)
class StepPlan:
    """One step as this rank sees it, and as every rank agreed (checked identical on all ranks)."""

    real: int
    own_padded: int
    agreed: DPCoordination
    padded_slices: UBatchSlices | None

    @property
    def padded(self) -> int:
        return self.agreed.num_tokens_after_padding

    def agreement(self) -> list[Any]:
        """What must be identical on every rank: the plan, the padded sizes, the token split."""
        split = (
            None
            if self.padded_slices is None
            else [[s.token_slice.start, s.token_slice.stop] for s in self.padded_slices]
        )
        return [
            self.agreed.should_ubatch,
            self.agreed.mode.name,
            list(self.agreed.num_tokens_across_dp),
            split,
        ]

    def as_dict(self) -> dict[str, Any]:
        should, mode, across, split = self.agreement()
        return {
            "real_tokens": self.real,
            "own_padded": self.own_padded,
            "should_ubatch": should,
            "mode": mode,
            "num_tokens_across_dp": across,
            "token_split": split,
        }


def coordinate_steps(job: Job, rank: int) -> dict[str, StepPlan]:
    """Step 1: agree on every step with the other ranks, and check that they all agreed alike."""
    sizes = SizeTable(job.capture_sizes)
    ubatch = UBatchConfig(
        enabled=True, num_ubatches=NUM_UBATCHES, decode_token_threshold=job.decode_threshold
    )
    plans = {}
    for name, shares in STEPS.items():
        real = real_tokens(job, rank, shares)
        own = sizes.pad(real)
        if own is None:
            raise RankError(
                f"step {name!r}: {real} tokens exceed the capture sizes {list(job.capture_sizes)}"
            )
        agreed = coordinate_batch_across_dp(
            real, num_tokens_padded=own, ubatch_config=ubatch, uniform_decode=True, mode=FULL
        )
        padded = agreed.num_tokens_after_padding
        _, slices = maybe_create_ubatch_slices(agreed.should_ubatch, [1] * real, padded, padded, NUM_UBATCHES)
        plan = StepPlan(real, own, agreed, slices)
        _all_equal(
            f"step {name!r} agreement [should_ubatch, mode, tokens per rank, token split]", plan.agreement()
        )
        plans[name] = plan
    return plans


def _all_equal(what: str, value: Any) -> Any:
    """Gather ``value`` from every rank; raise, naming the ranks and values, unless all are equal."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if any(v != values[0] for v in values):
        shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise RankError(f"the ranks differ on {what}: {shown}")
    return value


def _wrapper_names(payload: float) -> dict[str, str]:
    suffix = f" +{payload:g}MiB" if payload else ""
    return {
        "ubatched": f"dp-ubatched{suffix}",
        "sequential": f"dp-sequential{suffix}",
        "comm": f"dp-comm-only{suffix}",
        "comm halves": f"dp-comm-only-halves{suffix}",
    }


class DPBench:
    """One rank's decoders, wrappers and checks; every public method runs in lockstep on all ranks."""

    def __init__(
        self, job: Job, rank: int, model: ReferenceDecoder, runtime: GraphRuntime, device: torch.device
    ) -> None:
        self.job = job
        self.rank = rank
        self.model = model
        self.runtime = runtime
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.inputs = StaticInputs(model.config, job.max_tokens)
        self.kv_cache = model.new_kv_cache()
        self.kv_cache.normal_(0.0, 1.0, generator=torch.Generator(device=device).manual_seed(7 + rank))
        self.hidden = torch.zeros(
            job.max_tokens, model.config.hidden_size, dtype=model.config.dtype, device=device
        )
        self.decoders: dict[float, CollectiveOverlapDecoder] = {}
        self.wrappers: dict[float, dict[str, Any]] = {}
        for payload in job.payloads_mib:
            per_token = int(payload * MIB) // job.max_tokens
            decoder = CollectiveOverlapDecoder(
                model, max_tokens=job.max_tokens, payload_bytes_per_token=per_token
            )
            names = _wrapper_names(payload)
            self.decoders[payload] = decoder
            self.wrappers[payload] = {
                "ubatched": UBatchWrapper(decoder, runtime, name=names["ubatched"], handover_timeout=60),
                "sequential": CUDAGraphWrapper(decoder, runtime, FULL, name=names["sequential"]),
                "comm": CUDAGraphWrapper(decoder.comm_only, runtime, FULL, name=names["comm"]),
                "comm halves": CUDAGraphWrapper(
                    decoder.comm_only_halves, runtime, FULL, name=names["comm halves"]
                ),
            }
        self.compute = CUDAGraphWrapper(model, runtime, FULL, name="compute-only")
        self.compute_halves = CUDAGraphWrapper(self._model_halves, runtime, FULL, name="compute-only-halves")
        self.step_payload = job.payloads_mib[0]
        """The steps of the equality check run on the first payload's ubatched graphs."""

    # -- running ------------------------------------------------------------------------------
    def _args(self, tokens: int) -> tuple[torch.Tensor, ...]:
        return (*self.inputs.views(tokens), self.kv_cache)

    def _ubatched(self, payload: float, tokens: int, real: int, slices: UBatchSlices | None) -> torch.Tensor:
        descriptor = BatchDescriptor(tokens, tokens, True)
        with set_forward_context(FULL, descriptor, real, ubatch_slices=slices):
            return self.wrappers[payload]["ubatched"](*self._args(tokens))

    def _plain(self, wrapper: Any, *args: torch.Tensor) -> torch.Tensor:
        tokens = int(args[0].shape[0])
        with set_forward_context(FULL, BatchDescriptor(tokens, tokens, True), tokens):
            return wrapper(*args)

    def _full_slices(self, tokens: int) -> UBatchSlices:
        _, slices = maybe_create_ubatch_slices(True, [1] * tokens, tokens, tokens, NUM_UBATCHES)
        assert slices is not None
        return slices

    def _model_halves(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """The plain decoder on the two ubatches' token halves, one after the other (no comm)."""
        half = input_ids.shape[0] // NUM_UBATCHES
        parts = (slice(0, half), slice(half, input_ids.shape[0]))
        return torch.cat([self.model(input_ids[p], positions[p], slot_ids[p], kv_cache) for p in parts])

    def _sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def warm_up(self) -> None:
        """Run every collective once eagerly: NCCL communicators must exist before any capture."""
        self.inputs.load(self.job.max_tokens, self.job.max_tokens, seed=0)
        for decoder in self.decoders.values():
            decoder(*self._args(self.job.max_tokens))
            decoder.comm_only(self.hidden)
        self._sync()

    def capture(self) -> None:
        """Step 3: every graph, largest first, in one capture phase (same order on every rank)."""
        top = self.job.max_tokens
        with self.runtime.capture_phase():
            for tokens in sorted(self.job.capture_sizes, reverse=True):
                self.inputs.load(tokens, tokens, seed=0)
                self._ubatched(self.step_payload, tokens, tokens, self._full_slices(tokens))
            self.inputs.load(top, top, seed=0)
            for payload, wrappers in self.wrappers.items():
                if payload != self.step_payload:
                    self._ubatched(payload, top, top, self._full_slices(top))
                self._plain(wrappers["sequential"], *self._args(top))
                self._plain(wrappers["comm"], self.hidden)
                self._plain(wrappers["comm halves"], self.hidden)
            self._plain(self.compute, *self._args(top))
            self._plain(self.compute_halves, *self._args(top))
        self._sync()

    # -- step 4: replay equals eager ----------------------------------------------------------
    def check_step(self, index: int, plan: StepPlan) -> dict[str, Any]:
        """Replay the step's ubatched graph (or its eager fallback) against the eager decoder.

        Halving a batch changes GEMM shapes, so bf16 logits of two halves may differ from the whole
        batch's in the last bits with no micro-batching machinery at all; that split noise (eager
        halves against eager whole, collectives included) is measured and allowed for, as in
        ``gpu_ubatch.py``.
        """
        decoder = self.decoders[self.step_payload]
        self.inputs.load(plan.real, plan.padded, seed=1000 * self.rank + index + 1)
        args = self._args(plan.padded)
        kv_before = self.kv_cache.clone()
        graphs = self.wrappers[self.step_payload]["ubatched"]
        held = BatchDescriptor(plan.padded, plan.padded, True) in graphs.graphs
        replayed = held and plan.padded_slices is not None

        def fresh(fn: Any) -> torch.Tensor:
            self.kv_cache.copy_(kv_before)
            return fn()[: plan.real].float().clone()

        exchanges_before = decoder.python_exchanges
        got = fresh(lambda: self._ubatched(self.step_payload, plan.padded, plan.real, plan.padded_slices))
        python_exchanges = decoder.python_exchanges - exchanges_before
        reference = fresh(lambda: decoder(*args))
        if plan.padded_slices is not None:
            halves = fresh(
                lambda: torch.cat(
                    [
                        decoder(*(t[s.token_slice] for t in args[:3]), self.kv_cache)
                        for s in plan.padded_slices
                    ]
                )
            )
        else:
            halves = reference
        self.kv_cache.copy_(kv_before)
        self._sync()
        scale = reference.abs().max().item()
        split_noise = (halves - reference).abs().max().item()
        err = (got - reference).abs().max().item()
        relative = 2e-2 if self.model.config.dtype == torch.bfloat16 else 1e-4
        allowed = max(relative * max(scale, 1.0), 2 * split_noise)
        return {
            "path": "ubatch graph replay" if replayed else "eager (micro-batching called off)",
            "max_abs_err_vs_eager": err,
            "max_abs_err_vs_eager_halves": (got - halves).abs().max().item(),
            "split_noise": split_noise,
            "max_abs_logit": scale,
            "allowed_abs_err": allowed,
            "equal_to_eager": err <= allowed,
            "finite": bool(torch.isfinite(got).all().item()),
            "python_exchanges": python_exchanges,
        }

    # -- step 5: timing ------------------------------------------------------------------------
    def time_payload(self, payload: float, seconds: float) -> dict[str, Any]:
        """Time every variant at the largest size, interleaved, each batch of calls barrier-aligned.

        Two overlap figures: against compute and comm of the whole step (the brief's definition),
        and against compute and comm of the two halves run in line, which is the very work the
        ubatched step does, so the second says how much of its own communication it hid.
        """
        top = self.job.max_tokens
        self.inputs.load(top, top, seed=0)
        wrappers, slices = self.wrappers[payload], self._full_slices(top)
        variants = {
            "ubatched": lambda: self._ubatched(payload, top, top, slices),
            "sequential": lambda: self._plain(wrappers["sequential"], *self._args(top)),
            "compute only": lambda: self._plain(self.compute, *self._args(top)),
            "comm only": lambda: self._plain(wrappers["comm"], self.hidden),
            "compute only, halves": lambda: self._plain(self.compute_halves, *self._args(top)),
            "comm only, halves": lambda: self._plain(wrappers["comm halves"], self.hidden),
        }
        timer = CallTimer(self.device)
        for fn in variants.values():
            fn()
            fn()
        self._sync()
        probe = {name: Stats.of(timer.time_calls(fn, 2)).median for name, fn in variants.items()}
        per_call_s = sum(probe.values()) / 1e3
        rounds = 2 if self.job.quick else 5
        wanted = Budget.reps_for(seconds / rounds, per_call_s, floor=3, ceiling=3 if self.job.quick else 40)
        # Every rank must make the same calls (the collectives pair up): the smallest count wins.
        counts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(counts, wanted)
        iters = min(counts)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                self._sync()
                samples[name].extend(timer.time_calls(fn, iters))
        stats = {name: Stats.of(s) for name, s in samples.items()}
        medians = {name: s.median for name, s in stats.items()}
        ubatched = medians["ubatched"]
        compute, comm = medians["compute only"], medians["comm only"]
        compute_halves, comm_halves = medians["compute only, halves"], medians["comm only, halves"]
        return {
            "payload_mib": payload,
            "step_ms": {name: s.as_dict("ms") for name, s in stats.items()},
            "compute_plus_comm_ms": compute + comm,
            "comm_hidden_fraction": (compute + comm - ubatched) / comm if comm > 0 else None,
            "halves_compute_plus_comm_ms": compute_halves + comm_halves,
            "comm_hidden_fraction_halves": (
                (compute_halves + comm_halves - ubatched) / comm_halves if comm_halves > 0 else None
            ),
            "ubatched_speedup_vs_sequential": medians["sequential"] / ubatched,
        }

    def graph_summary(self) -> list[dict[str, Any]]:
        out = []
        for payload, wrappers in self.wrappers.items():
            held = wrappers["ubatched"].graphs.values()
            for entry in sorted(held, key=lambda e: e.descriptor.num_tokens):
                out.append(
                    {
                        "wrapper": _wrapper_names(payload)["ubatched"],
                        "num_tokens": entry.descriptor.num_tokens,
                        "num_ubatches": entry.num_ubatches,
                        "pool_bytes": entry.pool_bytes,
                        "capture_s": entry.capture_seconds,
                    }
                )
        return out


# --------------------------------------------------------------------------------- the parent


class LaunchError(RuntimeError):
    """A rank failed or the run got stuck; the message names the ranks, their stages and errors."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rank_states(job: Job) -> list[str]:
    lines = []
    now = time.time()
    for rank in range(job.nproc):
        error = _read_json(Path(job.work_dir, f"rank{rank}.error.json"))
        stage = _read_json(Path(job.work_dir, f"rank{rank}.stage.json"))
        where = (
            "never started"
            if stage is None
            else f"at stage {stage['stage']!r} for {now - stage['since']:.0f}s"
        )
        if error is not None:
            last = error["traceback"].strip().splitlines()[-6:]
            lines.append(
                f"rank {rank} FAILED at stage {error['stage']!r}: {error['error']}\n    "
                + "\n    ".join(last)
            )
        elif Path(job.work_dir, f"rank{rank}.json").exists():
            lines.append(f"rank {rank} finished")
        else:
            lines.append(f"rank {rank} was stopped {where}")
    return lines


def launch(job: Job, timeout_s: float) -> list[dict[str, Any]]:
    """Spawn the ranks and wait, never longer than ``timeout_s``; a failing rank stops the others."""
    context = mp.start_processes(_worker, args=(job,), nprocs=job.nproc, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                for process in context.processes:
                    process.join(5)
                    if process.is_alive():
                        process.kill()
                raise LaunchError(
                    f"the run did not finish within {timeout_s:g}s (--timeout-s); every rank was stopped:\n"
                    + "\n".join(_rank_states(job))
                )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        code = getattr(exc, "exit_code", None)
        how = f"exit code {code}" if code is not None else "an exception"
        raise LaunchError(
            f"rank {exc.error_index} stopped with {how}; every other rank was stopped too:\n"
            + "\n".join(_rank_states(job))
        ) from None
    results = [_read_json(Path(job.work_dir, f"rank{r}.json")) for r in range(job.nproc)]
    missing = [r for r, result in enumerate(results) if result is None]
    if missing:
        raise LaunchError(f"ranks {missing} exited without results:\n" + "\n".join(_rank_states(job)))
    return [r for r in results if r is not None]


def prepare_database(url: str) -> None:
    """Create or upgrade the database once, here, so the ranks do not race to migrate it."""
    from inspector.errors import DatabaseError
    from inspector.storage.store import open_store

    try:
        open_store(url).dispose()
    except DatabaseError as exc:
        raise SystemExit(f"error: --db {url}: {exc}") from None


def read_recorded(url: str, run_ids: list[int | None]) -> list[dict[str, Any]]:
    """What each rank's run left in the database: its rank, graphs, replays and eager batches."""
    from sqlalchemy import func, select

    from inspector.storage.models import EagerTotal, Graph, ReplayTotal, Run
    from inspector.storage.store import open_store

    store = open_store(url, upgrade=False)
    try:
        with store.session() as session:
            rows = []
            for run_id in run_ids:
                run = None if run_id is None else session.get(Run, run_id)
                if run is None:
                    rows.append({"run_id": run_id, "found": False})
                    continue
                graphs = session.scalars(select(Graph).where(Graph.run_id == run.id)).all()
                replays = session.scalar(
                    select(func.sum(ReplayTotal.replays)).where(ReplayTotal.run_id == run.id)
                )
                eager = session.scalar(
                    select(func.sum(EagerTotal.batches)).where(EagerTotal.run_id == run.id)
                )
                rows.append(
                    {
                        "run_id": run.id,
                        "found": True,
                        "label": run.label,
                        "rank": run.rank,
                        "world_size": run.world_size,
                        "backend": run.backend,
                        "device": run.device,
                        "graphs": len(graphs),
                        "ubatch_graphs": sum(1 for g in graphs if g.num_ubatches == NUM_UBATCHES),
                        "replays": int(replays or 0),
                        "eager_batches": int(eager or 0),
                        "ended": run.ended_at is not None,
                    }
                )
            return rows
    finally:
        store.dispose()


def find_failures(job: Job, ranks: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> list[str]:
    """Every check across ranks, each failure naming the rank and what differed."""
    failures = []
    for index, name in enumerate(STEPS):
        steps = [r["steps"][index] for r in ranks]
        keys = ("should_ubatch", "mode", "num_tokens_across_dp", "token_split")
        agreed = [[s[k] for k in keys] for s in steps]
        if any(a != agreed[0] for a in agreed):
            failures.append(
                f"step {name!r}: ranks disagree: " + "; ".join(f"rank {r}: {a}" for r, a in enumerate(agreed))
            )
        for rank, step in enumerate(steps):
            if not step["equal_to_eager"] or not step["finite"]:
                failures.append(
                    f"step {name!r} rank {rank}: replay differs from eager: max abs err "
                    f"{step['max_abs_err_vs_eager']:.4g} > allowed {step['allowed_abs_err']:.4g} "
                    f"(finite: {step['finite']})"
                )
            replayed = step["path"] == "ubatch graph replay"
            if replayed and job.device_type == "cuda" and step["python_exchanges"]:
                # A CUDA graph replay runs no Python: its all-reduces must be captured in the graph.
                failures.append(
                    f"step {name!r} rank {rank}: the ubatch graph replay ran {step['python_exchanges']} "
                    "exchanges in Python; its collectives were not captured in the graph"
                )
            if replayed != step["should_ubatch"]:
                failures.append(
                    f"step {name!r} rank {rank}: ran as {step['path']} but the ranks agreed "
                    f"should_ubatch={step['should_ubatch']}"
                )
    seen_ranks = sorted(r.get("rank", -1) for r in recorded if r["found"])
    if seen_ranks != list(range(job.nproc)):
        failures.append(f"the database holds runs for ranks {seen_ranks}, expected {list(range(job.nproc))}")
    for row in recorded:
        if row["found"] and (row["ubatch_graphs"] == 0 or row["world_size"] != job.nproc):
            failures.append(
                f"rank {row['rank']}: recorded {row['ubatch_graphs']} ubatch graphs and world size "
                f"{row['world_size']} (expected some, and {job.nproc})"
            )
    return failures


def print_report(job: Job, ranks: list[dict[str, Any]], recorded: list[dict[str, Any]], on_gpu: bool) -> None:
    rows = []
    for index, name in enumerate(STEPS):
        steps = [r["steps"][index] for r in ranks]
        first = steps[0]
        rows.append(
            (
                name,
                "/".join(str(s["real_tokens"]) for s in steps),
                "/".join(str(s["own_padded"]) for s in steps),
                first["num_tokens_across_dp"][0],
                first["should_ubatch"],
                first["mode"],
                str(first["token_split"]),
                all(
                    s["should_ubatch"] == first["should_ubatch"] and s["token_split"] == first["token_split"]
                    for s in steps
                ),
            )
        )
    print_table(
        f"DP agreement over {job.backend}, {job.nproc} ranks (per-rank values joined by /)",
        ("step", "real tokens", "own padded", "agreed padded", "ubatch", "mode", "token split", "all agree"),
        rows,
    )
    rows = [
        (
            s["name"],
            r["rank"],
            s["path"],
            s["max_abs_err_vs_eager"],
            s["split_noise"],
            s["allowed_abs_err"],
            s["equal_to_eager"],
            s["python_exchanges"],
        )
        for r in ranks
        for s in r["steps"]
    ]
    print_table(
        "Replay vs non-ubatched eager (real rows; collectives in both; a CUDA graph replay runs no Python)",
        ("step", "rank", "ran as", "max abs err", "split noise", "allowed", "equal", "exchanges in Python"),
        rows,
    )
    rows = [
        (
            row.get("rank"),
            row["run_id"],
            row.get("label"),
            row.get("backend"),
            row.get("graphs"),
            row.get("ubatch_graphs"),
            row.get("replays"),
            row.get("eager_batches"),
            row.get("ended"),
        )
        for row in recorded
    ]
    print_table(
        "Recorded in the inspector database (one run per rank)",
        (
            "rank",
            "run id",
            "label",
            "backend",
            "graphs",
            "ubatch graphs",
            "replays",
            "eager batches",
            "ended",
        ),
        rows,
    )
    rows = []
    for r in ranks:
        for t in r["timing"]:
            ms = {name: s["median_ms"] for name, s in t["step_ms"].items()}
            rows.append(
                (
                    t["payload_mib"],
                    r["rank"],
                    ms["sequential"],
                    ms["ubatched"],
                    ms["compute only"],
                    ms["comm only"],
                    ms["compute only, halves"],
                    ms["comm only, halves"],
                    t["comm_hidden_fraction"],
                    t["comm_hidden_fraction_halves"],
                    t["ubatched_speedup_vs_sequential"],
                )
            )
    title = (
        f"Summary: step time at {job.max_tokens} tokens (medians, ms). comm hidden = "
        "(compute + comm - ubatched) / comm, whole step;\n(halves): the same with compute and comm of "
        "the two half-size ubatches run in line, i.e. the ubatched step's own work"
    )
    if not on_gpu:
        title += "\n(CPU, eager backend, gloo: no graphs, no comm stream: these figures mean nothing)"
    print_table(
        title,
        (
            "payload MiB",
            "rank",
            "sequential",
            "ubatched",
            "compute only",
            "comm only",
            "compute (halves)",
            "comm (halves)",
            "comm hidden",
            "comm hidden (halves)",
            "speedup vs sequential",
        ),
        rows,
    )


def main() -> int:
    args = parse_args()
    os.environ.update(MULTICAST_OFF)
    device_type = args.device if args.device != "auto" else ("cuda" if args.backend == "nccl" else "cpu")
    if args.nproc < 1:
        raise SystemExit(f"error: --nproc must be at least 1, got {args.nproc}")
    if args.backend == "nccl" and device_type != "cuda":
        raise SystemExit(
            "error: --backend nccl runs one rank per GPU: use --device cuda (or --backend gloo on CPU)"
        )
    if args.backend == "gloo" and device_type != "cpu":
        raise SystemExit(
            "error: --backend gloo runs the ranks on CPU here: use --device cpu (or --backend nccl)"
        )
    if device_type == "cuda" and args.nproc > torch.cuda.device_count():
        raise SystemExit(
            f"error: NCCL needs one GPU per rank: --nproc {args.nproc} but torch sees "
            f"{torch.cuda.device_count()} GPU(s)"
        )
    try:
        payloads = tuple(dict.fromkeys(float(p) for p in args.payload_mib.split(",") if p.strip()))
    except ValueError:
        raise SystemExit(
            f"error: --payload-mib takes comma-separated numbers, got {args.payload_mib!r}"
        ) from None
    if not payloads or any(p < 0 for p in payloads):
        raise SystemExit(f"error: --payload-mib needs at least one size >= 0, got {args.payload_mib!r}")
    if args.quick:
        tokens, payloads, threshold = 16, (0.0, 0.0625), 4
    else:
        tokens, threshold = args.tokens, 32
    if tokens < 2 * NUM_UBATCHES or tokens % 2:
        raise SystemExit(f"error: --tokens must be an even number >= {2 * NUM_UBATCHES}, got {tokens}")
    on_gpu = device_type == "cuda"
    notes = [f"environment of every rank: {MULTICAST_OFF}"]
    if not on_gpu:
        notes.append(
            "CPU run: eager backend (nothing captured), gloo collectives, no comm stream: agreement, "
            "equality and recording are real; step times and overlap figures are meaningless"
        )

    with tempfile.TemporaryDirectory(prefix="gpu-dp-ubatch-") as work_dir:
        db_url = args.db or f"sqlite:///{work_dir}/dp.db"
        prepare_database(db_url)
        job = Job(
            nproc=args.nproc,
            port=_free_port(),
            backend=args.backend,
            device_type=device_type,
            quick=args.quick,
            db_url=db_url,
            work_dir=work_dir,
            payloads_mib=payloads,
            capture_sizes=(tokens // 2, tokens),
            decode_threshold=threshold,
            budget_s=args.budget_s,
            pg_timeout_s=min(60.0, args.timeout_s),
        )
        print(
            f"{job.nproc} ranks over {job.backend} on {device_type}; "
            f"capture sizes {list(job.capture_sizes)}; "
            f"payloads {list(payloads)} MiB; recording into {db_url if args.db else 'a temporary database'}",
            flush=True,
        )
        started = time.perf_counter()
        try:
            ranks = launch(job, args.timeout_s)
        except LaunchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            write_results(
                args.out,
                benchmark="gpu_dp_ubatch",
                command=command_line(),
                device=torch.device(device_type),
                config=asdict(job),
                results={"error": str(exc)},
                notes=notes,
            )
            return 1
        wall_s = time.perf_counter() - started
        recorded = read_recorded(db_url, [r["run_id"] for r in ranks])

    failures = find_failures(job, ranks, recorded)
    targets = []
    if on_gpu:
        for r in ranks:
            heaviest = r["timing"][-1]
            together = heaviest["step_ms"]["ubatched"]["median_ms"]
            # Below 1: the ubatched step took less than its own two halves' compute and comm one
            # after the other (the whole-batch sum would charge it for the cost of splitting).
            name = (
                f"rank {r['rank']}: ubatched / (compute + comm of its halves, in line) "
                f"({heaviest['payload_mib']:g} MiB)"
            )
            targets.append(target(name, together / heaviest["halves_compute_plus_comm_ms"], 1.0))
    write_results(
        args.out,
        benchmark="gpu_dp_ubatch",
        command=command_line(),
        device=torch.device(device_type),
        config={**asdict(job), "db": args.db or "temporary (removed after the run)", "wall_s": wall_s},
        results={"ranks": ranks, "recorded": recorded, "failures": failures, "ok": not failures},
        targets=targets,
        notes=notes,
    )
    if targets:
        print_targets(targets)
    print(f"\nwrote {args.out} ({wall_s:.1f}s for {job.nproc} ranks)")
    print_report(job, ranks, recorded, on_gpu)
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("\nOK: all ranks agreed, every replay equals eager, every rank recorded its run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
