"""What the demo runs: the backend, the traffic trace, the reference decoder's shape, and the runner.

Each step refuses what it cannot serve with a ``UsageError`` that says what to change, and each runs
before the database is opened, so a mistake leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dashboard.demo.options import (
    DECODE_ONLY_MODE,
    PROMPT_SCALE,
    RAMP_STEPS,
    STEP_SECONDS,
    TINY_MAX_BATCH_MIXED,
    TINY_MAX_SEQ_LEN,
    is_decode_only,
    token_budget,
)

if TYPE_CHECKING:
    from capture_core.mixed_runner import MixedBatchRunner
    from capture_core.reference import ModelConfig, Trace
    from capture_core.runner import DecodeRunner

    Runner = DecodeRunner | MixedBatchRunner


def choose_backend(choice: str) -> str:
    """``cuda`` or ``eager``: what ``--backend`` asks for, where this host can give it."""
    import torch

    from inspector.errors import UsageError

    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--backend cuda: no CUDA device is visible to torch here; "
                         "use --backend auto or eager")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "eager"
    return choice


def load_traffic(args: argparse.Namespace) -> Trace:
    """The trace the demo replays (``--trace`` or the packaged one); shorter prompts for mixed modes."""
    from capture_core.reference import TraceError, load_trace
    from inspector.errors import UsageError

    try:
        trace = load_trace(args.trace)
    except TraceError as error:
        packaged = "the packaged trace is unusable (reinstall the package)"
        what = "--trace" if args.trace is not None else packaged
        raise UsageError(f"{what}: {error}") from None
    return trace if is_decode_only(args) else shorter_prompts(trace)


def shorter_prompts(trace: Trace) -> Trace:
    """The same arrivals and answers with prompts ``PROMPT_SCALE`` times shorter (at least 1 token)."""
    from capture_core.reference import Trace

    requests = tuple(replace(r, context_tokens=max(1, round(r.context_tokens / PROMPT_SCALE)))
                     for r in trace.requests)
    return Trace(requests, trace.source)


def model_config(args: argparse.Namespace, backend: str) -> tuple[ModelConfig, str]:
    """The reference decoder's shape for this run, and its name; a clear error if it cannot serve it."""
    import torch

    from capture_core.reference import ModelConfig
    from inspector.errors import UsageError

    model_name = args.model if args.model != "auto" else ("small" if backend == "cuda" else "tiny")
    device = "cuda" if backend == "cuda" else "cpu"
    dtype = torch.bfloat16 if backend == "cuda" else torch.float32
    overrides: dict[str, Any] = {"max_num_seqs": args.max_batch, "device": device, "dtype": dtype}
    decode_only = is_decode_only(args)
    budget = token_budget(args.max_batch)
    if model_name == "tiny":
        if not decode_only and args.max_batch > TINY_MAX_BATCH_MIXED:
            raise UsageError(f"--max-batch {args.max_batch} is too large for the tiny model with mixed "
                             f"steps (at most {TINY_MAX_BATCH_MIXED}); pick a smaller --max-batch or "
                             f"--mode {DECODE_ONLY_MODE}")
        # The decode graphs attend over each slot's whole KV row: a short row keeps 300 steps of up
        # to 256 requests well inside a minute on two CPU cores. With mixed steps a row must hold
        # the largest prompt chunk, which the token budget bounds.
        overrides["max_seq_len"] = TINY_MAX_SEQ_LEN if decode_only else max(TINY_MAX_SEQ_LEN, budget)
    config = getattr(ModelConfig, model_name)(**overrides)
    if not decode_only and budget > config.max_seq_len:
        raise UsageError(f"--max-batch {args.max_batch} allows {budget}-token steps, longer than the "
                         f"{model_name} model's context ({config.max_seq_len} tokens), so a prompt chunk "
                         f"might not fit one request's KV row; pick a smaller --max-batch or --mode "
                         f"{DECODE_ONLY_MODE}")
    return config, model_name


def build_runner(args: argparse.Namespace, backend: str, config: ModelConfig) -> Runner:
    """The reference decoder behind the runner of the chosen mode, on a fresh graph runtime."""
    import torch

    from capture_core.mixed_runner import MixedBatchRunner
    from capture_core.modes import CUDAGraphMode
    from capture_core.reference import ReferenceDecoder
    from capture_core.runner import DecodeRunner
    from capture_core.runtime import GraphRuntime, UnexpectedCapturePolicy
    from capture_core.sizes import capture_sizes
    from capture_core.ubatch.slices import UBatchConfig

    if backend == "eager":
        # The tiny model's kernels are too small to split across threads; on a small shared CPU,
        # intra-op threads spin against each other (measured here: 8x slower with two threads).
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = ReferenceDecoder(config, seed=args.seed)
    # Always-on address checks: a drift is recorded and the run goes on. An unexpected capture is
    # captured anyway (and recorded as such): what a latency spike in production looks like. The
    # canary runs on the sampled replays (the first of each graph, then one in a thousand): it checks
    # them, and its eager step is what each graph's speedup is measured against.
    runtime = GraphRuntime(backend, unexpected_capture=UnexpectedCapturePolicy.CAPTURE, canary=True)
    sizes = capture_sizes(args.capture_sizes, args.max_batch)
    mode = CUDAGraphMode[args.mode.upper()]
    if is_decode_only(args):
        # As vLLM's decode graphs: keyed by uniform-decode descriptors (one token per request).
        ubatch = UBatchConfig(enabled=args.ubatch)
        return DecodeRunner(model, runtime, sizes, mode=mode, max_num_seqs=args.max_batch, ubatch=ubatch)
    return MixedBatchRunner(model, runtime, sizes, mode)


def capture_sizes_of(runner: Runner) -> tuple[int, ...]:
    return runner.dispatcher.sizes.sizes


def run_config(args: argparse.Namespace, backend: str, model_name: str, runner: Runner,
               trace: Trace) -> dict[str, Any]:
    """The run's configuration as the dashboard shows it (``runs.config``)."""
    config = runner.model.config
    traffic: dict[str, Any] = {"trace": os.path.basename(trace.source), "speedup": args.speedup,
                               "step_seconds": STEP_SECONDS, "faults_injected": not args.no_faults}
    if not is_decode_only(args):
        traffic.update(chunked_prefill=True, max_num_batched_tokens=token_budget(args.max_batch),
                       ramp_steps=RAMP_STEPS, prompt_scale=f"1/{PROMPT_SCALE}")
    return {
        "job": "demo",
        "backend": backend,
        "model": model_name,
        "parameters": runner.model.param_count(),
        "dtype": str(config.dtype).removeprefix("torch."),
        "mode": runner.mode.name,
        "capture_policy": args.capture_sizes,
        "capture_sizes": list(capture_sizes_of(runner)),
        "ubatched_sizes": sorted(getattr(runner, "ubatch_slices", {})),
        "max_num_seqs": args.max_batch,
        "address_check": runner.runtime.address_check.value,
        "unexpected_capture": runner.runtime.unexpected_capture.value,
        "steps": args.steps,
        "seed": args.seed,
        "traffic": traffic,
    }
