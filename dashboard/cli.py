"""The `graph-inspector` command line: every subcommand and every option, declared in this module.

Each subcommand's work lives in one module, named here as ``module:function`` and imported only
when that subcommand runs, so ``--help`` loads no torch, Flask or SQLAlchemy and answers at once.

Exit codes, for every subcommand: 0 clean; 1 findings (violations, a schema behind the newest);
2 usage or database errors, told in one line on stderr without a traceback; 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from dashboard.commands.serve import DEFAULT_HOST, DEFAULT_PORT, PRUNE_EVERY, STOP_GRACE_S, TOKEN_ENV
from dashboard.demo import options as demo
from inspector.commands.advise import PACKAGED_TRACE
from inspector.commands.report import FORMATS as REPORT_FORMATS

Number = TypeVar("Number", int, float)
DB_HELP = "database URL (default: $GRAPH_INSPECTOR_DB, else sqlite:///graph-inspector.db)"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line that names the command and where its help is, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="graph-inspector",
        description=(
            "A CUDA-graph cache for LLM decoding and the daemon that inspects it: what the graph "
            "cache holds, how traffic meets it, and when it is silently wrong."
        ),
        epilog="exit codes: 0 clean, 1 findings (violations), 2 usage or database errors",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the installed version and exit")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    _add_demo(commands)
    _add_serve(commands)
    _add_report(commands)
    _add_advise(commands)
    _add_watch(commands)
    _add_db(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from inspector.errors import InspectorError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    command = " ".join(filter(None, (args.subcommand, getattr(args, "action", None))))
    try:
        return int(_load(args.handler)(args) or 0)
    except InspectorError as exc:
        print(f"graph-inspector {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"graph-inspector {command}: interrupted", file=sys.stderr)
        return 130


def _load(target: str) -> Callable[[argparse.Namespace], int]:
    """The function a subcommand runs, from its ``module:function`` name."""
    module, _, function = target.partition(":")
    handler: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), function)
    return handler


def _command(
    commands: argparse._SubParsersAction, name: str, handler: str | None, help: str, description: str,
    **extra: str,
) -> argparse.ArgumentParser:
    """Add subcommand ``name``; ``handler`` (``module:function``) does its work, None for a group."""
    parser: argparse.ArgumentParser = commands.add_parser(name, help=help, description=description, **extra)
    if handler is not None:
        parser.set_defaults(handler=handler)
    return parser


# --------------------------------------------------------------------------------- subcommands


def _add_demo(commands: argparse._SubParsersAction) -> None:
    parser = _command(
        commands, "demo", "dashboard.demo.command:run",
        help="run the reference workload on real traffic, record it, and serve the dashboard",
        description=(
            "Run the reference decoder through the CUDA-graph cache on real LLM traffic (an hour of "
            "Azure conversation requests replayed through continuous batching), record every graph, "
            "replay and violation, plant one address drift and one unexpected capture (marked as "
            "injected), print a summary and serve the dashboard. Uses CUDA graphs when a GPU is "
            "present, else the eager backend (same bookkeeping and checks, no graphs)."
        ),
    )
    parser.add_argument("--db", metavar="URL", help=DB_HELP)
    parser.add_argument("--steps", type=whole_number(1, demo.MAX_STEPS), default=demo.DEFAULT_STEPS,
                        metavar="N", help=f"engine steps to run (default {demo.DEFAULT_STEPS})")
    parser.add_argument("--no-serve", action="store_true",
                        help="exit after the summary instead of serving the dashboard")
    parser.add_argument("--no-faults", action="store_true",
                        help="do not plant the injected address drift and unexpected capture")
    parser.add_argument("--seed", type=whole_number(0, demo.MAX_SEED), default=0,
                        help="seed: where in the trace the traffic starts, and the model's weights "
                             "(default 0)")
    parser.add_argument("--backend", choices=demo.BACKENDS, default="auto",
                        help="graph backend: cuda (real CUDA graphs), eager (no GPU needed), or auto "
                             "(default: cuda when a GPU is visible)")
    parser.add_argument("--model", choices=demo.MODELS, default="auto",
                        help="reference decoder size: tiny (CPU), small (~60M), large (~1.3B); auto picks "
                             "tiny on the eager backend and small on CUDA (default auto)")
    parser.add_argument("--mode", choices=demo.MODES, default=demo.DEFAULT_MODE,
                        help="CUDA-graph mode: full_and_piecewise (FULL graphs for pure-decode steps, "
                             "PIECEWISE for steps with prompt chunks), full_decode_only (the decode-only "
                             "demo: decode steps only, from a cold start), piecewise, full, or none (all "
                             f"eager) (default {demo.DEFAULT_MODE})")
    parser.add_argument("--ubatch", action="store_true",
                        help="micro-batching (DBO): capture every bucket of 32 tokens or more as one "
                             f"graph of 2 micro-batches, as vLLM does (with --mode {demo.DECODE_ONLY_MODE})")
    parser.add_argument("--capture-sizes", choices=demo.CAPTURE_POLICIES, default="pow2",
                        help="capture-size policy: powers of two, or vLLM's default list (default pow2)")
    parser.add_argument("--max-batch", type=whole_number(1, demo.MAX_BATCH_LIMIT),
                        default=demo.DEFAULT_MAX_BATCH, metavar="N",
                        help="largest capture size and most requests running at once "
                             f"(default {demo.DEFAULT_MAX_BATCH})")
    parser.add_argument("--speedup", type=speedup, default=None, metavar="X",
                        help="replay the trace X times faster than recorded: larger X, larger batches "
                             f"(default {demo.MIXED_SPEEDUP:g}; {demo.DEFAULT_SPEEDUP:g} with --mode "
                             f"{demo.DECODE_ONLY_MODE})")
    parser.add_argument("--trace", metavar="CSV",
                        help="your own traffic: a CSV of TIMESTAMP,ContextTokens,GeneratedTokens per request "
                             "(default: the packaged Azure conversation trace)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to serve the dashboard on (default {DEFAULT_HOST}; anything but "
                             "loopback needs a token)")
    parser.add_argument("--port", type=port, default=DEFAULT_PORT,
                        help=f"dashboard port (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--token",
                        help=f"dashboard access token (default: ${TOKEN_ENV}); needed off loopback")


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = _command(
        commands, "serve", "dashboard.commands.serve:run",
        help="serve the dashboard, its JSON API and /metrics",
        description="Serve the dashboard (pages, JSON API under /api, /metrics, /healthz) for a database. "
                    "SIGTERM or Ctrl-C stops it gracefully: it stops accepting, finishes the answers in "
                    f"flight (for up to {STOP_GRACE_S:g} s) and exits 0.",
    )
    parser.add_argument("--db", metavar="URL", help=DB_HELP)
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default {DEFAULT_HOST}; anything but loopback needs a token)")
    parser.add_argument("--port", type=port, default=DEFAULT_PORT,
                        help=f"port (default {DEFAULT_PORT}; 0 picks a free one and prints it)")
    parser.add_argument("--token",
                        help=f"access token for every page, API call and scrape (default: ${TOKEN_ENV})")
    parser.add_argument("--allow-host", metavar="NAME", action="append", default=[],
                        help="a name the dashboard is reached by besides loopback ones, e.g. the one a "
                             "reverse proxy forwards in its Host header; repeatable. Without a token, any "
                             "other name is refused (a guard against DNS rebinding); with a token, any name "
                             "is answered unless this lists them")
    parser.add_argument("--create", action="store_true",
                        help="create the SQLite file if it is not there (an empty database); without it, "
                             "a missing file is an error, as a mistyped path usually is")
    parser.add_argument("--get", metavar="PATH",
                        help="answer one request in-process, print the body and exit (non-zero for an error "
                             "status): a smoke test, e.g. --get /api/summary")
    parser.add_argument("--retain", metavar="AGE:GRAIN", action="append", default=[],
                        help="fold traffic windows that started more than AGE ago into windows GRAIN wide, "
                             "every total unchanged; repeat for coarser tiers, e.g. --retain 1h:1m --retain "
                             "1d:1h (default: keep every window)")
    parser.add_argument("--prune-every", metavar="DURATION", default=PRUNE_EVERY,
                        help=f"how often --retain folds (default {PRUNE_EVERY})")


def _add_report(commands: argparse._SubParsersAction) -> None:
    parser = _command(
        commands, "report", "inspector.commands.report:run",
        help="report recorded runs, violations and regressions (exit 0 clean, 1 findings, 2 errors)",
        description=(
            "Read the inspector's database and report every run and every violation (address drift, "
            "unexpected capture, rank divergence...). With --baseline, also compare a run's graph cache "
            "with a baseline (captured graphs, graph count, pool memory, capture time, padding waste, hit "
            "ratio, eager fallbacks, graphs never replayed). Exits 0 when clean, 1 on violations or "
            "regressions, 2 on usage or database errors, so a CI step fails on either."
        ),
        epilog="examples: graph-inspector report --save-baseline ci/graph-baseline.json; graph-inspector "
               "report --baseline ci/graph-baseline.json --format junit --output graph-report.xml",
    )
    parser.add_argument("--db", metavar="URL", help=DB_HELP)
    parser.add_argument("--run", metavar="ID", type=int,
                        help="report one run (default: every run); with --baseline or --save-baseline, the "
                             "run compared or saved (default: the newest)")
    parser.add_argument("--format", choices=REPORT_FORMATS, default="text",
                        help="output format (default: text)")
    parser.add_argument("--output", metavar="PATH", help="write the report to PATH instead of stdout")
    gate = parser.add_argument_group("regression gate (docs/regression-gate.md)")
    gate.add_argument("--baseline", metavar="B",
                      help="compare with B: a run id of --db, a database URL (its newest run, or "
                           "--baseline-run), or a baseline file written by --save-baseline")
    gate.add_argument("--baseline-run", metavar="ID", type=int, help="the run of a database URL baseline")
    gate.add_argument("--save-baseline", metavar="PATH",
                      help="write the run's figures to PATH as a baseline file (JSON, to commit beside "
                           "the code)")
    gate.add_argument("--thresholds", metavar="PATH",
                      help="thresholds file, TOML or JSON: sections such as [pool_memory] relative = 0.1")
    gate.add_argument("--threshold", metavar="NAME=VALUE", action="append", default=[],
                      help="set one threshold, e.g. capture_time.relative=1.0 (repeatable; wins over "
                           "the file)")


def _add_advise(commands: argparse._SubParsersAction) -> None:
    parser = _command(
        commands, "advise", "inspector.commands.advise:run",
        help="advise the capture sizes your traffic wants, and print the lines to paste into an engine",
        description=(
            "Find the capture sizes that minimise padding over your traffic's batch-size histogram "
            "(exactly: every batch, under a number of graphs or a capture-time or memory budget), "
            "compare them with the current sizes on the same histogram, and print the configuration "
            "for vLLM, SGLang, TensorRT-LLM and capture_core. The traffic is what a database recorded "
            "(default), or a trace of requests replayed through continuous batching (--trace)."
        ),
        epilog="examples: graph-inspector advise --db sqlite:///graph-inspector.db --max-graphs 16; "
               "graph-inspector advise --trace --speedup 8",
    )
    recorded = parser.add_argument_group("recorded traffic (the default)")
    recorded.add_argument("--db", metavar="URL", help=DB_HELP)
    recorded.add_argument("--run", metavar="ID", type=whole_number(1, 2**63 - 1), action="append",
                          help="advise on this run; repeat to pool several runs or ranks "
                               "(default: every run)")
    traffic = parser.add_argument_group("a trace instead")
    traffic.add_argument("--trace", nargs="?", const=PACKAGED_TRACE, metavar="CSV",
                         help="a CSV of TIMESTAMP,ContextTokens,GeneratedTokens per request, replayed "
                              "through continuous batching (no path: the packaged Azure conversation trace)")
    traffic.add_argument("--steps", type=whole_number(1, demo.MAX_STEPS), default=20_000, metavar="N",
                         help="scheduler steps to replay (default 20,000)")
    traffic.add_argument("--speedup", type=speedup, default=1.0, metavar="X",
                         help="replay the trace X times faster than recorded (default 1: as it came)")
    traffic.add_argument("--max-num-seqs", type=whole_number(1, demo.MAX_BATCH_LIMIT), default=256,
                         metavar="N",
                         help="most requests running at once, the engine's largest batch (default 256)")
    traffic.add_argument("--seed", type=whole_number(0, demo.MAX_SEED), default=0,
                         help="where in the trace the replay starts (default 0)")
    limits = parser.add_argument_group("what the advice may use")
    limits.add_argument("--max-graphs", type=whole_number(1, demo.MAX_BATCH_LIMIT), metavar="K",
                        help="at most K capture sizes (default: as many as --current has)")
    limits.add_argument("--capture-time-budget", type=bounded(float, "seconds", 0, 86_400, above_low=True),
                        metavar="SECONDS", help="at most this much capture time at start-up")
    limits.add_argument("--memory-budget", type=bounded(float, "MiB", 0, 2**30, above_low=True),
                        metavar="MIB", help="at most this much graph pool memory")
    limits.add_argument("--max-size", type=whole_number(1, demo.MAX_BATCH_LIMIT), metavar="N",
                        help="the largest size to capture (default: the largest batch observed, so nothing "
                             "runs eagerly that did not)")
    parser.add_argument("--current", metavar="SIZES",
                        help="the configuration to compare with: pow2, vllm (their lists up to the engine's "
                             "largest batch) or sizes such as 1,2,4,8 (default: the sizes the runs captured; "
                             "vllm with --trace)")
    parser.add_argument("--step-times", metavar="CSV",
                        help="weigh padding by these step times, a CSV of size,seconds rows, instead of "
                             "the ones the runs recorded (a trace has none: without this, padding is "
                             "counted in tokens)")
    limits.add_argument("--gpu-memory-utilization", type=bounded(float, "a share", 0, 1, above_low=True),
                        metavar="SHARE",
                        help="vLLM's --gpu-memory-utilization now: with --gpu-memory-gib the advice gives "
                             "the share that keeps its KV cache as it is, by the graph pool the advised "
                             "sizes need")
    limits.add_argument("--gpu-memory-gib", type=bounded(float, "GiB", 0, 1 << 20, above_low=True),
                        metavar="GIB", help="the GPU's memory, in GiB (for --gpu-memory-utilization)")
    limits.add_argument("--include", metavar="SIZES",
                        help="sizes every advised set must hold, such as 1,2 (they count towards "
                             "--max-graphs)")
    limits.add_argument("--lone-request-slack", type=bounded(float, "percent", 0, 1000), default=5.0,
                        metavar="PERCENT",
                        help="with step times: a lone request's step may be at most this much slower "
                             "than its best, a graph of size 1 (default 5); the smallest size is held "
                             "down to keep it so")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="output format (default text)")


def _add_watch(commands: argparse._SubParsersAction) -> None:
    parser = _command(
        commands, "watch", "inspector.commands.watch:run",
        help="run a command and record the CUDA graphs it captures and replays",
        description=(
            "Run COMMAND with hooks on torch.cuda.CUDAGraph (and torch.cuda.graph, "
            "make_graphed_callables, torch.compile's cudagraph trees) in every Python process it "
            "starts, and record its graphs, replays, unexpected captures, re-recording storms and "
            "torch.compile's skips and re-records (with their reasons) into the database. The "
            "program runs as it would unwatched: no logger level or setting of torch is changed. "
            "Put the command after '--'. Exits with the command's status."
        ),
        epilog="example: graph-inspector watch --ready-after 1000 -- python serve.py --model llama",
    )
    parser.add_argument("--db", metavar="URL", help=DB_HELP)
    parser.add_argument("--ready-after", type=int, metavar="N", default=None,
                        help="count a process as started up after N replays with no new capture; every "
                             "later capture is recorded as an unexpected capture, with its stack")
    parser.add_argument("--storm-threshold", type=int, metavar="K", default=3,
                        help="captures at one call site, once its graphs are in use, that make a "
                             "re-recording storm (default 3)")
    parser.add_argument("--storm-window", type=float, metavar="SECONDS", default=60.0,
                        help="the window those captures must fall in (default 60)")
    parser.add_argument("--label", default=None,
                        help="the runs' label on the dashboard (default: 'watch' and the script name)")
    parser.add_argument("--job", default=None,
                        help="the job id of the watched ranks, whose graphs are then checked against each "
                             "other (default: torchrun's rendezvous id or SLURM's job id, from the "
                             "environment)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command to run, e.g. -- python their_script.py --flag")


def _add_db(commands: argparse._SubParsersAction) -> None:
    parser = _command(
        commands, "db", None,
        help="create or upgrade the database, show its schema revision, or fold old windows",
        description="Manage the inspector's database: its schema (Alembic migrations, run in-process) "
                    "and its retention.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    upgrade = _command(actions, "upgrade", "inspector.commands.db:run_upgrade",
                       help="create the database or upgrade it to the newest schema",
                       description="Create the database, or upgrade it to the newest schema revision.")
    upgrade.add_argument("--db", metavar="URL", help=DB_HELP)
    current = _command(actions, "current", "inspector.commands.db:run_current",
                       help="show the database's schema revision and the newest one (exit 1 when behind)",
                       description="Show the database's schema revision and the newest; exit 1 when it is "
                                   "behind (run `graph-inspector db upgrade`).")
    current.add_argument("--db", metavar="URL", help=DB_HELP)
    prune = _command(actions, "prune", "inspector.commands.db:run_prune",
                     help="fold old replay, eager and batch-size windows into coarser ones, every total "
                          "unchanged",
                     description="Fold every traffic window that started more than --older-than ago into "
                                 "windows --grain wide: sums of the rows they replace, so every total, page "
                                 "and metric reads the same, in a fraction of the rows (the step sequences "
                                 "of ranks of a job too, every step kept). `graph-inspector serve --retain "
                                 "AGE:GRAIN` does this on a schedule.",
                     epilog="example: graph-inspector db prune --older-than 7d --grain 1h")
    prune.add_argument("--db", metavar="URL", help=DB_HELP)
    prune.add_argument("--older-than", metavar="AGE", required=True,
                       help="fold windows that started more than AGE ago: 90s, 30m, 12h, 7d, 2w")
    prune.add_argument("--grain", metavar="GRAIN", default="1h",
                       help="width of the folded windows (default 1h)")


# ---------------------------------------------------------------------------------- value types


def bounded(convert: Callable[[str], Number], noun: str, low: Number, high: int,
            *, above_low: bool = False) -> Callable[[str], Number]:
    """An argparse type: ``convert(text)`` (``int`` or ``float``) within ``low..high``.

    ``above_low`` excludes ``low`` itself; not-a-number and infinities are refused.
    """

    def parse(text: str) -> Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        inside = (low < value if above_low else low <= value) and value <= high  # NaN fails both
        if not inside:
            lowest = f"above {low:,}" if above_low else f"between {low:,}"
            raise argparse.ArgumentTypeError(f"must be {lowest} and {'at most ' if above_low else ''}"
                                             f"{high:,}, got {text}")
        return value

    return parse


def whole_number(low: int, high: int) -> Callable[[str], int]:
    return bounded(int, "a whole number", low, high)


port = bounded(int, "a port number", 0, 65535)
speedup = bounded(float, "a number", 0, demo.MAX_SPEEDUP, above_low=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graph-inspector")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
