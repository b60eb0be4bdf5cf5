"""`graph-inspector demo`: the main job. Real traffic through the graph cache, recorded, then served.

It runs the reference decoder on real LLM-serving traffic (the Azure conversation trace replayed
through continuous batching with chunked prefill, from an engine that is already busy, so the token
count moves on nearly every step as in production) through the mixed-batch runner under a chosen
CUDA-graph mode: by default FULL graphs for pure-decode steps, PIECEWISE graphs for steps that
carry prompt chunks, eager (with the reason) above the largest capture size. It captures the graphs
with a progress bar, records everything into the inspector's database, plants one address drift
and one unexpected capture (labelled as injected, so nobody mistakes them for real findings),
prints what happened and serves the dashboard over it. ``--mode full_decode_only`` keeps the
original decode-only demo (decode steps only, from a cold start, FULL graphs). On a host without
CUDA it says so and runs the eager backend, which keeps every capture, check and event identical.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from capture_core.mixed_runner import MixedBatchRunner
    from capture_core.reference import FlatBatch, ModelConfig, Step, Trace
    from capture_core.runner import DecodeRunner

    Runner = DecodeRunner | MixedBatchRunner

DEFAULT_STEPS = 300
DEFAULT_MAX_BATCH = 256
MODES = ("full_and_piecewise", "full_decode_only", "piecewise", "full", "none")
DEFAULT_MODE = "full_and_piecewise"
DECODE_ONLY_MODE = "full_decode_only"
DEFAULT_SPEEDUP = 10.0
"""Decode-only (``--mode full_decode_only``): trace time runs 10x faster than recorded, so from a
cold start the batch climbs through most capture sizes within 300 steps (towards ~230 requests at
steady state, with max-batch 256)."""
MIXED_SPEEDUP = 6.0
"""Mixed modes: 6x keeps ~150 requests decoding with room for prompt chunks, so about half the steps
decode only (FULL), a third carry prompt chunks under the largest capture size (PIECEWISE) and a
few bursts go above it (eager). At 10x the decodes alone fill most of the 256 tokens and most mixed
steps run eagerly; measured on the packaged trace with seeds 0 and 1."""
WARMUP_STEPS = 1000
"""Engine steps simulated (not run) before the first recorded one: long enough for the running set
to reach its steady state, so the first recorded step already looks like production."""
PROMPT_SCALE = 16
"""Mixed modes feed prompts 16x shorter than the trace's (mean ~1,150 tokens becomes ~72). At full
length prompt chunks fill every step's token budget, so each step would hold exactly the budget and
the token count would never move; the reference model's context rows are short as well."""
TOKEN_BUDGET_SHARE = 4
"""A step's token budget (``max_num_batched_tokens``) is max-batch plus a quarter: room for prompt
chunks next to a full decode batch, and bursts above the largest capture size that run eagerly."""
TINY_MAX_BATCH_MIXED = 1024
"""The tiny model's context rows grow with the token budget (a whole chunk must fit in one row);
beyond this the KV cache would take gigabytes of host memory."""
STEP_SECONDS = 0.02
"""Engine seconds per decode step, a typical decode step of a mid-sized model on one GPU."""
TINY_MAX_SEQ_LEN = 128
MAX_STEPS = 1_000_000
MAX_SPEEDUP = 1000.0
MAX_BATCH_LIMIT = 4096
MAX_LISTED_VIOLATIONS = 100


def _positive_int(limit: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"must be between 1 and {limit:,}, got {value}")
        return value

    return parse


def _speedup(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SPEEDUP):
        # Far beyond saturation every step only lengthens the queue, by ~0.1 x speedup requests.
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most {MAX_SPEEDUP:g}, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    from dashboard.commands.serve import DEFAULT_HOST, DEFAULT_PORT, TOKEN_ENV

    parser = subparsers.add_parser(
        "demo",
        help="run the reference workload on real traffic, record it, and serve the dashboard",
        description=(
            "Run the reference decoder through the CUDA-graph cache on real LLM traffic (an hour of "
            "Azure conversation requests replayed through continuous batching), record every graph, "
            "replay and violation, plant one address drift and one unexpected capture (marked as "
            "injected), print a summary and serve the dashboard. Uses CUDA graphs when a GPU is "
            "present, else the eager backend (same bookkeeping and checks, no graphs)."
        ),
    )
    parser.add_argument("--db", metavar="URL",
                        help="database URL (default: $GRAPH_INSPECTOR_DB, else sqlite:///graph-inspector.db)")
    parser.add_argument("--steps", type=_positive_int(MAX_STEPS), default=DEFAULT_STEPS, metavar="N",
                        help=f"decode steps to run (default {DEFAULT_STEPS})")
    parser.add_argument("--no-serve", action="store_true",
                        help="exit after the summary instead of serving the dashboard")
    parser.add_argument("--no-faults", action="store_true",
                        help="do not plant the injected address drift and unexpected capture")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed: where in the trace the traffic starts, and the model's weights "
                             "(default 0)")
    parser.add_argument("--backend", choices=("auto", "cuda", "eager"), default="auto",
                        help="graph backend: cuda (real CUDA graphs), eager (no GPU needed), or auto "
                             "(default: cuda when a GPU is visible)")
    parser.add_argument("--model", choices=("auto", "tiny", "small", "large"), default="auto",
                        help="reference decoder size: tiny (CPU), small (~60M), large (~1.3B); auto picks "
                             "tiny on the eager backend and small on CUDA (default auto)")
    parser.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                        help="CUDA-graph mode: full_and_piecewise (FULL graphs for pure-decode steps, "
                             "PIECEWISE for steps with prompt chunks), full_decode_only (the decode-only "
                             "demo: decode steps only, from a cold start), piecewise, full, or none (all "
                             f"eager) (default {DEFAULT_MODE})")
    parser.add_argument("--ubatch", action="store_true",
                        help="micro-batching (DBO): capture every bucket of 32 tokens or more as one "
                             f"graph of 2 micro-batches, as vLLM does (with --mode {DECODE_ONLY_MODE})")
    parser.add_argument("--capture-sizes", choices=("pow2", "vllm"), default="pow2",
                        help="capture-size policy: powers of two, or vLLM's default list (default pow2)")
    parser.add_argument("--max-batch", type=_positive_int(MAX_BATCH_LIMIT), default=DEFAULT_MAX_BATCH,
                        metavar="N", help=f"largest capture size and most requests running at once "
                                          f"(default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--speedup", type=_speedup, default=None, metavar="X",
                        help=f"replay the trace X times faster than recorded: larger X, larger batches "
                             f"(default {MIXED_SPEEDUP:g}; {DEFAULT_SPEEDUP:g} with --mode "
                             f"{DECODE_ONLY_MODE})")
    parser.add_argument("--trace", metavar="CSV",
                        help="your own traffic: a CSV of TIMESTAMP,ContextTokens,GeneratedTokens per request "
                             "(default: the packaged Azure conversation trace)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to serve the dashboard on (default {DEFAULT_HOST}; anything but "
                             "loopback needs a token)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help=f"dashboard port (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--token",
                        help=f"dashboard access token (default: ${TOKEN_ENV}); needed off loopback")
    parser.set_defaults(func=run)


@dataclass
class DemoResult:
    """What the run did, for the summary."""

    steps: int
    seconds: float
    batch_sizes: list[int]
    drift_step: int | None
    unexpected_step: int | None
    drift_raised: bool = False
    drift_skipped: str | None = None
    """Why no drift could be planted (mode none has no graph to drift)."""
    prefill_steps: int | None = None
    """Steps that carried prompt chunks (None for the decode-only demo)."""


def run(args: argparse.Namespace) -> int:
    from dashboard.commands.serve import TOKEN_ENV, is_loopback
    from inspector.errors import UsageError

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.no_serve and not is_loopback(args.host) and not token:
        raise UsageError(
            f"refusing to serve on {args.host} without an access token: the dashboard shows stack traces "
            f"and memory addresses. Pass --token (or set {TOKEN_ENV}), or use the default host."
        )

    if args.ubatch and args.mode != DECODE_ONLY_MODE:
        raise UsageError(f"--ubatch micro-batches decode steps; use it with --mode {DECODE_ONLY_MODE}")
    if not args.no_serve:
        _check_can_listen(args.host, args.port)  # fail now, not after the whole run
    if args.speedup is None:
        args.speedup = DEFAULT_SPEEDUP if args.mode == DECODE_ONLY_MODE else MIXED_SPEEDUP

    from inspector.store import open_store, resolve_url

    backend = _choose_backend(args.backend)
    model_config, model_name = _model_config(args, backend)  # fails before the database is touched
    url = resolve_url(args.db)
    store = open_store(url, upgrade=True)  # a bad or unwritable database fails here, before any work
    try:
        from inspector.recorder import Recorder

        trace = _load_trace(args.trace)
        if args.mode != DECODE_ONLY_MODE:
            trace = _shorter_prompts(trace)
        runner = _build_runner(args, backend, model_config)
        config = _run_config(args, backend, model_name, runner, trace.source)
        recorder = Recorder(url, label="demo", config=config)
        runner.runtime.observer = recorder
        _announce(backend, model_name, runner, trace, args)
        recorder.start()
        try:
            runner.capture()
            serve_steps = _decode if _decode_only(runner) else _serve_mixed
            result = serve_steps(runner, trace, args)
        finally:
            recorder.close()
        _print_summary(store, recorder, runner, result, url)
        if recorder.dropped:
            print(f"  warning: the recorder dropped {recorder.dropped} events ({recorder.last_error})")
    finally:
        store.engine.dispose()

    if args.no_serve:
        print(f"\nServe it later with: graph-inspector serve --db {url}")
        return 0
    from dashboard.app import create_app
    from dashboard.commands.serve import serve

    print()
    return serve(create_app(url, token=token), args.host, args.port)


def _check_can_listen(host: str, port: int) -> None:
    """Bind the dashboard's address for a moment, as waitress will (address reuse on)."""
    import socket

    from inspector.errors import UsageError

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:
        raise UsageError(
            f"cannot serve the dashboard on {host}:{port}: {error.strerror or error}. "
            "Pick another --port (0 picks a free one), or pass --no-serve"
        ) from None


def _choose_backend(choice: str) -> str:
    import torch

    from inspector.errors import UsageError

    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--backend cuda: no CUDA device is visible to torch here; "
                         "use --backend auto or eager")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "eager"
    return choice


def _load_trace(path: str | None) -> Any:
    from capture_core.reference import TraceError, load_trace
    from inspector.errors import UsageError

    try:
        return load_trace(path)
    except TraceError as error:
        what = "--trace" if path is not None else "the packaged trace is unusable (reinstall the package)"
        raise UsageError(f"{what}: {error}") from None


def _shorter_prompts(trace: Trace) -> Trace:
    """The same arrivals and answers with prompts ``PROMPT_SCALE`` times shorter (at least 1 token)."""
    from dataclasses import replace

    from capture_core.reference import Trace

    requests = tuple(replace(r, context_tokens=max(1, round(r.context_tokens / PROMPT_SCALE)))
                     for r in trace.requests)
    return Trace(requests, trace.source)


def _token_budget(max_batch: int) -> int:
    """Tokens one mixed step may hold: max-batch plus a quarter (see ``TOKEN_BUDGET_SHARE``)."""
    return max_batch + max_batch // TOKEN_BUDGET_SHARE


def _decode_only(runner: Runner) -> bool:
    from capture_core.runner import DecodeRunner

    return isinstance(runner, DecodeRunner)


def _capture_sizes(runner: Runner) -> tuple[int, ...]:
    return runner.dispatcher.sizes.sizes


def _model_config(args: argparse.Namespace, backend: str) -> tuple[ModelConfig, str]:
    """The reference decoder's shape for this run, and its name; a clear error if it cannot serve it."""
    import torch

    from capture_core.reference import ModelConfig
    from inspector.errors import UsageError

    model_name = args.model if args.model != "auto" else ("small" if backend == "cuda" else "tiny")
    device = "cuda" if backend == "cuda" else "cpu"
    dtype = torch.bfloat16 if backend == "cuda" else torch.float32
    overrides: dict[str, Any] = {"max_num_seqs": args.max_batch, "device": device, "dtype": dtype}
    decode_only = args.mode == DECODE_ONLY_MODE
    if model_name == "tiny":
        if not decode_only and args.max_batch > TINY_MAX_BATCH_MIXED:
            raise UsageError(f"--max-batch {args.max_batch} is too large for the tiny model with mixed "
                             f"steps (at most {TINY_MAX_BATCH_MIXED}); pick a smaller --max-batch or "
                             f"--mode {DECODE_ONLY_MODE}")
        # The decode graphs attend over each slot's whole KV row: a short row keeps 300 steps of up
        # to 256 requests well inside a minute on two CPU cores. With mixed steps a row must hold
        # the largest prompt chunk, which the token budget bounds.
        overrides["max_seq_len"] = TINY_MAX_SEQ_LEN if decode_only else max(
            TINY_MAX_SEQ_LEN, _token_budget(args.max_batch))
    config = getattr(ModelConfig, model_name)(**overrides)
    if not decode_only and _token_budget(args.max_batch) > config.max_seq_len:
        raise UsageError(f"--max-batch {args.max_batch} allows {_token_budget(args.max_batch)}-token steps, "
                         f"longer than the {model_name} model's context ({config.max_seq_len} tokens), so "
                         f"a prompt chunk might not fit one request's KV row; pick a smaller --max-batch "
                         f"or --mode {DECODE_ONLY_MODE}")
    return config, model_name


def _build_runner(args: argparse.Namespace, backend: str, config: ModelConfig) -> Runner:
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
    # captured anyway (and recorded as such): what a latency spike in production looks like.
    runtime = GraphRuntime(backend, unexpected_capture=UnexpectedCapturePolicy.CAPTURE)
    sizes = capture_sizes(args.capture_sizes, args.max_batch)
    mode = CUDAGraphMode[args.mode.upper()]
    if args.mode == DECODE_ONLY_MODE:
        # As vLLM's decode graphs: keyed by uniform-decode descriptors (one token per request).
        ubatch = UBatchConfig(enabled=args.ubatch)
        return DecodeRunner(model, runtime, sizes, mode=mode, max_num_seqs=args.max_batch, ubatch=ubatch)
    return MixedBatchRunner(model, runtime, sizes, mode)


def _run_config(
    args: argparse.Namespace, backend: str, model_name: str, runner: Runner, trace_source: str
) -> dict[str, Any]:
    config = runner.model.config
    traffic: dict[str, Any] = {"trace": os.path.basename(trace_source), "speedup": args.speedup,
                               "step_seconds": STEP_SECONDS, "faults_injected": not args.no_faults}
    if not _decode_only(runner):
        traffic.update(chunked_prefill=True, max_num_batched_tokens=_token_budget(args.max_batch),
                       warmup_steps=WARMUP_STEPS, prompt_scale=f"1/{PROMPT_SCALE}")
    return {
        "job": "demo",
        "backend": backend,
        "model": model_name,
        "parameters": runner.model.param_count(),
        "dtype": str(config.dtype).removeprefix("torch."),
        "mode": runner.mode.name,
        "capture_policy": args.capture_sizes,
        "capture_sizes": list(_capture_sizes(runner)),
        "ubatched_sizes": sorted(getattr(runner, "ubatch_slices", {})),
        "max_num_seqs": args.max_batch,
        "address_check": runner.runtime.address_check.value,
        "unexpected_capture": runner.runtime.unexpected_capture.value,
        "steps": args.steps,
        "seed": args.seed,
        "traffic": traffic,
    }


def _announce(
    backend: str, model_name: str, runner: Runner, trace: Any, args: argparse.Namespace
) -> None:
    if backend == "cuda":
        import torch

        print(f"graph-inspector demo: cuda backend: real CUDA graphs on {torch.cuda.get_device_name()}")
    else:
        print("graph-inspector demo: eager backend: no CUDA GPU here, so each 'replay' re-runs the model on "
              "the captured inputs. Captures, address checks and events are the same as on a GPU; "
              "timings are not graph timings.")
    config = runner.model.config
    sizes = _capture_sizes(runner)
    print(f"  model: reference decoder '{model_name}' ({runner.model.param_count():,} parameters, "
          f"{str(config.dtype).removeprefix('torch.')}), mode {args.mode}, {len(sizes)} capture sizes "
          f"({args.capture_sizes}: {_size_list(sizes)})")
    ubatched = sorted(getattr(runner, "ubatch_slices", {}))
    if ubatched:
        print(f"  micro-batching: {len(ubatched)} buckets ({_size_list(tuple(ubatched))}) captured as one "
              f"graph of {runner.ubatch.num_ubatches} micro-batches each (DBO)")
    source = "Azure LLM conversation trace, 2023" if args.trace is None else os.path.basename(trace.source)
    print(f"  traffic: {len(trace):,} real requests ({source}) through continuous batching, up to "
          f"{args.max_batch} running, {args.speedup:g}x speed, seed {args.seed}")
    if not _decode_only(runner):
        print(f"  chunked prefill: prompts 1/{PROMPT_SCALE} of their traced length, up to "
              f"{_token_budget(args.max_batch)} tokens a step, from an engine already "
              f"{WARMUP_STEPS} steps busy")


def _size_list(sizes: tuple[int, ...]) -> str:
    if len(sizes) <= 10:
        return ", ".join(map(str, sizes))
    return f"{sizes[0]}, {sizes[1]}, {sizes[2]} ... {sizes[-1]}"


class _Tokens:
    """Greedy decoding state per KV slot: each request feeds back its own last token.

    Prompts are not prefilled (the demo shows decode graphs), so a request's position counts its
    generated tokens, wrapping at the model's ``max_seq_len``; its first token is seeded from its id.
    """

    def __init__(self, runner: DecodeRunner) -> None:
        import torch

        config = runner.model.config
        self.vocab = config.vocab_size
        self.max_seq_len = config.max_seq_len
        self.owner: dict[int, int] = {}
        self.start: dict[int, int] = {}
        self.next_token = torch.zeros(runner.max_num_seqs + 1, dtype=torch.long, device=runner.device)
        self.device = runner.device

    def inputs(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch

        positions = []
        for rid, slot, position in zip(step.decode_request_ids, step.decode_slots, step.decode_positions,
                                       strict=True):
            if self.owner.get(slot) != rid:  # a new request took this slot
                self.owner[slot] = rid
                self.start[slot] = position
                # A stand-in for the last prompt token: any fixed token per request will do.
                self.next_token[slot] = (rid * 7919 + 1) % self.vocab
            positions.append((position - self.start[slot]) % self.max_seq_len)
        slots = torch.tensor(step.decode_slots, dtype=torch.long, device=self.device)
        return self.next_token[slots], torch.tensor(positions, dtype=torch.long, device=self.device), slots

    def update(self, slots: torch.Tensor, logits: torch.Tensor) -> None:
        self.next_token[slots] = logits.argmax(dim=-1)


def _decode(runner: DecodeRunner, trace: Any, args: argparse.Namespace) -> DemoResult:
    from tqdm import tqdm

    from capture_core.checks import AddressDriftError
    from capture_core.reference import ContinuousBatchScheduler, TrafficConfig

    traffic = TrafficConfig(max_num_seqs=args.max_batch, speedup=args.speedup, step_seconds=STEP_SECONDS,
                            seed=args.seed)
    scheduler = ContinuousBatchScheduler(trace, traffic)
    tokens = _Tokens(runner)
    drift_step = None if args.no_faults else args.steps // 3
    unexpected_step = None if args.no_faults else (2 * args.steps) // 3
    result = DemoResult(args.steps, 0.0, [], drift_step, unexpected_step)
    started = time.perf_counter()
    # On a terminal the bar redraws often; in a log (CI, kubectl logs) a line every few seconds is enough.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    with tqdm(total=args.steps, desc="Decoding", unit="step", file=sys.stderr, dynamic_ncols=True,
              mininterval=interval) as bar:
        for step in itertools.islice(scheduler.steps(), args.steps):
            input_ids, positions, slots = tokens.inputs(step)
            if step.index == drift_step:
                try:
                    logits = runner.inject_address_drift(input_ids, positions, slots)
                except AddressDriftError:  # GRAPH_INSPECTOR_DEBUG=1 makes drifts raise; recorded all the same
                    result.drift_raised = True
                    logits = runner.step(input_ids, positions, slots)
            else:
                logits = runner.step(input_ids, positions, slots)
            tokens.update(slots, logits)
            if step.index == unexpected_step:
                runner.inject_unexpected_capture()
            result.batch_sizes.append(step.num_real_tokens)
            bar.set_postfix(batch=step.num_real_tokens, queued=step.num_waiting, refresh=False)
            bar.update(1)
    result.seconds = time.perf_counter() - started
    return result


class _MixedInputs:
    """Token ids, positions and KV rows for mixed steps: greedy decoding per KV slot.

    A request joining mid-flight (the engine was busy before the first recorded step) or a new one
    starts its slot's row afresh. Prompt tokens are stand-ins derived from the request and position;
    the last prompt chunk's logits give the first generated token, each decode feeds back its own.
    A request whose context outgrows the model's row starts the row over (it keeps its later
    tokens' positions in range), as the decode-only demo wraps its positions.
    """

    def __init__(self, runner: MixedBatchRunner) -> None:
        config = runner.model.config
        self.vocab = config.vocab_size
        self.max_seq_len = config.max_seq_len
        self.device = runner.device
        self.owner: dict[int, int] = {}
        self.length: dict[int, int] = {}
        self.next_token: dict[int, int] = {}

    def _claim(self, request_id: int, slot: int, num_tokens: int) -> int:
        """The context already in ``slot`` for ``num_tokens`` new tokens of ``request_id``."""
        if self.owner.get(slot) != request_id:
            self.owner[slot] = request_id
            self.length[slot] = 0
            self.next_token[slot] = (request_id * 7919 + 1) % self.vocab
        if self.length[slot] + num_tokens > self.max_seq_len:
            self.length[slot] = 0
        context = self.length[slot]
        self.length[slot] = context + num_tokens
        return context

    def batch(self, step: Step) -> tuple[FlatBatch, list[int], list[int]]:
        """The flattened step, and which logits rows sample which slot's next token."""
        from capture_core.reference import flatten_requests

        tokens: list[list[int]] = []
        contexts: list[int] = []
        slots: list[int] = []
        for rid, slot in zip(step.decode_request_ids, step.decode_slots, strict=True):
            contexts.append(self._claim(rid, slot, 1))
            tokens.append([self.next_token[slot]])
            slots.append(slot)
        for chunk in step.prefill_chunks:
            contexts.append(self._claim(chunk.request_id, chunk.slot, chunk.num_tokens))
            first = chunk.start
            tokens.append([(chunk.request_id * 7919 + (first + i) * 104729) % self.vocab
                           for i in range(chunk.num_tokens)])
            slots.append(chunk.slot)
        rows, sampled = [], []
        row = 0
        for r, slot in enumerate(slots):
            row += len(tokens[r])
            if r < step.num_decode_tokens or step.prefill_chunks[r - step.num_decode_tokens].final:
                rows.append(row - 1)
                sampled.append(slot)
        return flatten_requests(tokens, contexts, slots, device=self.device), rows, sampled

    def update(self, logits: torch.Tensor, rows: list[int], sampled: list[int]) -> None:
        if rows:
            chosen = logits[rows].argmax(dim=-1).tolist()
            self.next_token.update(zip(sampled, chosen, strict=True))


def _serve_mixed(runner: MixedBatchRunner, trace: Trace, args: argparse.Namespace) -> DemoResult:
    """Continuous batching with chunked prefill, from a busy engine, through the mixed-batch runner."""
    from tqdm import tqdm

    from capture_core.checks import AddressDriftError
    from capture_core.reference import ContinuousBatchScheduler, TrafficConfig

    traffic = TrafficConfig(max_num_seqs=args.max_batch, speedup=args.speedup, step_seconds=STEP_SECONDS,
                            seed=args.seed, warmup_steps=WARMUP_STEPS, chunked_prefill=True,
                            max_num_batched_tokens=_token_budget(args.max_batch))
    scheduler = ContinuousBatchScheduler(trace, traffic)
    inputs = _MixedInputs(runner)
    drift_step = None if args.no_faults else args.steps // 3
    unexpected_step = None if args.no_faults else (2 * args.steps) // 3
    result = DemoResult(args.steps, 0.0, [], drift_step, None)
    prefill_steps = 0
    drift_due = drift_step is not None
    if drift_due and runner.mode.name == "NONE":
        drift_due, result.drift_step = False, None
        result.drift_skipped = "mode none captures no graphs, so there is no graph to drift"
    started = time.perf_counter()
    interval = 0.1 if sys.stderr.isatty() else 5.0
    with tqdm(total=args.steps, desc="Serving", unit="step", file=sys.stderr, dynamic_ncols=True,
              mininterval=interval) as bar:
        for step in itertools.islice(scheduler.steps(), args.steps):
            batch, rows, sampled = inputs.batch(step)
            # The drift goes into the first step at or after its turn that replays a graph.
            meta = batch.attn_metadata
            if drift_due and step.index >= drift_step and runner.route(meta).eager_reason is None:
                drift_due, result.drift_step = False, step.index
                try:
                    logits = _plant_drift(runner, batch)
                except AddressDriftError:  # GRAPH_INSPECTOR_DEBUG=1 makes drifts raise; recorded all the same
                    result.drift_raised = True
                    logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, meta)
            else:
                logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, meta)
            inputs.update(logits, rows, sampled)
            if step.index == unexpected_step:
                result.unexpected_step = step.index if _plant_unexpected_capture(runner) else None
            result.batch_sizes.append(step.num_real_tokens)
            prefill_steps += bool(step.prefill_chunks)
            bar.set_postfix(tokens=step.num_real_tokens, prefill=step.num_prefill_tokens, refresh=False)
            bar.update(1)
    result.seconds = time.perf_counter() - started
    result.prefill_steps = prefill_steps
    return result


def _graphed(runner: MixedBatchRunner) -> Any:
    """The outermost graph wrapper: FULL around piecewise, whichever the mode has."""
    return runner.full if runner.full is not None else runner.piecewise


def _plant_drift(runner: MixedBatchRunner, batch: FlatBatch) -> torch.Tensor:
    """A planted fault: the step builds a fresh ``input_ids`` tensor instead of copying it in.

    The graph still reads its static buffer, which holds the previous step's ids (stale logits, as
    the classic engine bug). The drift is reported as injected.
    """
    import torch

    from capture_core.forward_context import set_forward_context
    from capture_core.modes import CUDAGraphMode

    meta = batch.attn_metadata
    routed = runner.route(meta)
    num_tokens, padded = batch.num_tokens, routed.descriptor.num_tokens
    views = runner.buffers.load(padded, positions=batch.positions, slot_ids=batch.slot_ids)
    fresh_ids = torch.zeros(padded, dtype=torch.long, device=runner.device)
    fresh_ids[:num_tokens].copy_(batch.input_ids)
    extra = {"attn_metadata": meta} if routed.mode is CUDAGraphMode.PIECEWISE else {}
    with (
        runner.runtime.injected_faults(),
        torch.no_grad(),
        set_forward_context(routed.mode, routed.descriptor, num_tokens, attn_metadata=meta),
    ):
        logits = _graphed(runner)(fresh_ids, views["positions"], views["slot_ids"], runner.kv_cache, **extra)
    return logits[:num_tokens]


def _plant_unexpected_capture(runner: MixedBatchRunner) -> bool:
    """A planted fault: a pure-decode step asks for a graph of a size start-up never captured.

    Runs on dummy inputs that write only the spare KV slot; the event is marked injected and the
    runtime's policy decides what follows. False when every size up to the largest is captured or
    the mode has no graphs.
    """
    from dataclasses import replace

    import torch

    from capture_core.forward_context import set_forward_context

    table = runner.dispatcher.sizes
    size = next((n for n in range(1, table.max_size + 1) if n not in table), None)
    if size is None or runner.mode.name == "NONE":
        return False
    routed = runner.dispatcher.route(size, uniform_decode=True)  # the graph kind a decode of this size uses
    descriptor = replace(routed.descriptor, num_tokens=size,
                         num_reqs=None if routed.descriptor.num_reqs is None else size)
    views = runner.buffers.views(size)
    for name, value in {"input_ids": 0, "positions": 0, "slot_ids": runner.padding_slot}.items():
        views[name].fill_(value)
    context = set_forward_context(routed.mode, descriptor, size)
    with runner.runtime.injected_faults(), torch.no_grad(), context:
        _graphed(runner)(views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)
    return True


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _print_summary(store: Any, recorder: Any, runner: Runner, result: DemoResult, url: str) -> None:
    from capture_core.reference import batch_size_stats
    from inspector.queries import Queries

    summary = Queries(store.engine).summary(recorder.run_id)
    graphs, traffic = summary["graphs"], summary["traffic"]
    stats = batch_size_stats(result.batch_sizes)
    rate = result.steps / result.seconds if result.seconds else float("inf")
    print(f"\ngraph-inspector demo: {result.steps} steps on the {runner.runtime.backend_name} backend "
          f"in {result.seconds:.1f} s ({rate:.0f} steps/s)")
    unexpected = graphs.get("unexpected", 0)
    pool = graphs.get("pool_bytes", 0)
    memory = f"{pool / 2**20:.1f} MiB graph pool" if pool else "no graph pool (eager backend)"
    by_mode = ", ".join(f"{mode}: {n}" for mode, n in sorted(graphs.get("by_mode", {}).items()))
    print(f"  graphs captured   {graphs['count']}" + (f" ({by_mode})" if by_mode else "")
          + (f", of which {unexpected} unexpected" if unexpected else "") + f", {memory}")
    print(f"  batch sizes       {stats.min}..{stats.max}, mean {stats.mean:.0f}, changed on "
          f"{100 * stats.changed_share:.0f}% of steps ({stats.distinct} distinct sizes)")
    ubatched = getattr(runner, "ubatch_slices", {})
    if ubatched:
        split = sum(1 for n in result.batch_sizes if n <= runner.dispatcher.sizes.max_size
                    and runner.route(n).descriptor.num_tokens in ubatched)
        print(f"  micro-batched     {split} of {result.steps} steps ran as "
              f"{runner.ubatch.num_ubatches} micro-batches in one graph ({len(ubatched)} buckets)")
    if result.prefill_steps is not None:
        print(f"  step kinds        {result.steps - result.prefill_steps} decode only, "
              f"{result.prefill_steps} with prompt chunks")
    batches = traffic["replays"] + traffic["eager_batches"]
    print(f"  replay hit ratio  {_percent(traffic['hit_ratio'])} of {batches} batches")
    print(f"  padding waste     {_percent(traffic['padding_waste'])} of the tokens the graphs computed")
    fallbacks = sum(row["batches"] for row in summary["eager"])
    reasons = ", ".join(f"{row['reason']}: {row['batches']}" for row in summary["eager"])
    print(f"  eager fallbacks   {fallbacks}" + (f" ({reasons})" if reasons else ""))
    findings = Queries(store.engine).violations(run_id=recorder.run_id, per_page=MAX_LISTED_VIOLATIONS)
    kinds = Counter(v["kind"] for v in findings.items)
    injected = sum(1 for v in findings.items if v["injected"])
    listed = ", ".join(f"{kind}: {n}" for kind, n in sorted(kinds.items()))
    line = f"  violations        {findings.total}" + (f" ({listed})" if listed else "")
    if injected:
        line += f"; {injected} injected on purpose by the demo"
    print(line)
    planted = []
    if result.drift_step is not None:
        planted.append(f"an address drift at step {result.drift_step}")
    if result.unexpected_step is not None:
        planted.append(f"an unexpected capture at step {result.unexpected_step}")
    if planted:
        print(f"  injected faults   {' and '.join(planted)}, labelled 'injected' on every page")
    if result.drift_skipped:
        print(f"  (no drift planted: {result.drift_skipped})")
    if result.drift_raised:
        print("  (debug address checks are on: the injected drift raised, as it would in CI)")
    print(f"  database          {url}")
