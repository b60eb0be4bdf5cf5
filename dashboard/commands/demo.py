"""`graph-inspector demo`: the main job. Real traffic through the graph cache, recorded, then served.

It runs the reference decoder through the decode runner on real LLM-serving traffic (the Azure
conversation trace replayed through continuous batching, so the batch size moves from step to step
as in production), captures one graph per capture size with a progress bar, records everything
into the inspector's database, plants one address drift and one unexpected capture (labelled as
injected, so nobody mistakes them for real findings), prints what happened and serves the
dashboard over it. On a host without CUDA it says so and runs the eager backend, which keeps every
capture, check and event identical.
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

    from capture_core.runner import DecodeRunner
    from capture_core.traffic import Step

DEFAULT_STEPS = 300
DEFAULT_MAX_BATCH = 256
DEFAULT_SPEEDUP = 10.0
"""Trace time runs 10x faster than recorded: from a cold start the batch climbs through most
capture sizes within 300 steps (towards ~230 requests at steady state, with max-batch 256)."""
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
    parser.add_argument("--capture-sizes", choices=("pow2", "vllm"), default="pow2",
                        help="capture-size policy: powers of two, or vLLM's default list (default pow2)")
    parser.add_argument("--max-batch", type=_positive_int(MAX_BATCH_LIMIT), default=DEFAULT_MAX_BATCH,
                        metavar="N", help=f"largest capture size and most requests running at once "
                                          f"(default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--speedup", type=_speedup, default=DEFAULT_SPEEDUP, metavar="X",
                        help=f"replay the trace X times faster than recorded: larger X, larger batches "
                             f"(default {DEFAULT_SPEEDUP:g})")
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


def run(args: argparse.Namespace) -> int:
    from dashboard.commands.serve import TOKEN_ENV, is_loopback
    from inspector.errors import UsageError

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.no_serve and not is_loopback(args.host) and not token:
        raise UsageError(
            f"refusing to serve on {args.host} without an access token: the dashboard shows stack traces "
            f"and memory addresses. Pass --token (or set {TOKEN_ENV}), or use the default host."
        )

    if not args.no_serve:
        _check_can_listen(args.host, args.port)  # fail now, not after the whole run

    from inspector.store import open_store, resolve_url

    url = resolve_url(args.db)
    store = open_store(url, upgrade=True)  # a bad or unwritable database fails here, before any work
    try:
        from inspector.recorder import Recorder

        backend = _choose_backend(args.backend)
        trace = _load_trace(args.trace)
        runner, model_name = _build_runner(args, backend)
        config = _run_config(args, backend, model_name, runner, trace.source)
        recorder = Recorder(url, label="demo", config=config)
        runner.runtime.observer = recorder
        _announce(backend, model_name, runner, trace, args)
        recorder.start()
        try:
            runner.capture()
            result = _decode(runner, trace, args)
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
    from capture_core.traffic import TraceError, load_trace
    from inspector.errors import UsageError

    try:
        return load_trace(path)
    except TraceError as error:
        what = "--trace" if path is not None else "the packaged trace is unusable (reinstall the package)"
        raise UsageError(f"{what}: {error}") from None


def _build_runner(args: argparse.Namespace, backend: str) -> tuple[DecodeRunner, str]:
    import torch

    from capture_core.model import ModelConfig, ReferenceDecoder
    from capture_core.modes import CUDAGraphMode
    from capture_core.runner import DecodeRunner
    from capture_core.runtime import GraphRuntime, UnexpectedCapturePolicy
    from capture_core.sizes import capture_sizes

    model_name = args.model if args.model != "auto" else ("small" if backend == "cuda" else "tiny")
    device = "cuda" if backend == "cuda" else "cpu"
    dtype = torch.bfloat16 if backend == "cuda" else torch.float32
    overrides: dict[str, Any] = {"max_num_seqs": args.max_batch, "device": device, "dtype": dtype}
    if model_name == "tiny":
        # The decode graphs attend over each slot's whole KV row: a shorter row keeps 300 steps of
        # up to 256 requests well inside a minute on two CPU cores.
        overrides["max_seq_len"] = TINY_MAX_SEQ_LEN
    config = getattr(ModelConfig, model_name)(**overrides)
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
    # FULL_DECODE_ONLY, as vLLM's decode graphs: keyed by uniform-decode descriptors (one token per request).
    mode = CUDAGraphMode.FULL_DECODE_ONLY
    runner = DecodeRunner(model, runtime, sizes, mode=mode, max_num_seqs=args.max_batch)
    return runner, model_name


def _run_config(
    args: argparse.Namespace, backend: str, model_name: str, runner: DecodeRunner, trace_source: str
) -> dict[str, Any]:
    config = runner.model.config
    return {
        "job": "demo",
        "backend": backend,
        "model": model_name,
        "parameters": runner.model.param_count(),
        "dtype": str(config.dtype).removeprefix("torch."),
        "mode": runner.mode.name,
        "capture_policy": args.capture_sizes,
        "capture_sizes": list(runner.capture_sizes),
        "max_num_seqs": args.max_batch,
        "address_check": runner.runtime.address_check.value,
        "unexpected_capture": runner.runtime.unexpected_capture.value,
        "steps": args.steps,
        "seed": args.seed,
        "traffic": {"trace": os.path.basename(trace_source), "speedup": args.speedup,
                    "step_seconds": STEP_SECONDS, "faults_injected": not args.no_faults},
    }


def _announce(
    backend: str, model_name: str, runner: DecodeRunner, trace: Any, args: argparse.Namespace
) -> None:
    if backend == "cuda":
        import torch

        print(f"graph-inspector demo: cuda backend: real CUDA graphs on {torch.cuda.get_device_name()}")
    else:
        print("graph-inspector demo: eager backend: no CUDA GPU here, so each 'replay' re-runs the model on "
              "the captured inputs. Captures, address checks and events are the same as on a GPU; "
              "timings are not graph timings.")
    config = runner.model.config
    print(f"  model: reference decoder '{model_name}' ({runner.model.param_count():,} parameters, "
          f"{str(config.dtype).removeprefix('torch.')}), {len(runner.capture_sizes)} capture sizes "
          f"({args.capture_sizes}: {_size_list(runner.capture_sizes)})")
    source = "Azure LLM conversation trace, 2023" if args.trace is None else os.path.basename(trace.source)
    print(f"  traffic: {len(trace):,} real requests ({source}) through continuous batching, up to "
          f"{args.max_batch} running, {args.speedup:g}x speed, seed {args.seed}")


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
    from capture_core.traffic import ContinuousBatchScheduler, TrafficConfig

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
            result.batch_sizes.append(step.num_tokens)
            bar.set_postfix(batch=step.num_tokens, queued=step.num_waiting, refresh=False)
            bar.update(1)
    result.seconds = time.perf_counter() - started
    return result


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _print_summary(store: Any, recorder: Any, runner: DecodeRunner, result: DemoResult, url: str) -> None:
    from capture_core.traffic import batch_size_stats
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
    print(f"  graphs captured   {graphs['count']}"
          + (f" (of which {unexpected} unexpected)" if unexpected else "") + f", {memory}")
    print(f"  batch sizes       {stats.min}..{stats.max}, mean {stats.mean:.0f}, changed on "
          f"{100 * stats.changed_share:.0f}% of steps ({stats.distinct} distinct sizes)")
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
    if result.drift_step is not None:
        print(f"  injected faults   an address drift at step {result.drift_step} and an unexpected capture "
              f"at step {result.unexpected_step}, labelled 'injected' on every page")
    if result.drift_raised:
        print("  (debug address checks are on: the injected drift raised, as it would in CI)")
    print(f"  database          {url}")
