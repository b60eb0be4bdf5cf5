"""The demo's settings: defaults and limits, and the checks that combine options, all before any work.

Imports nothing heavy: the command line reads the defaults for its help text from here.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_STEPS = 300
DEFAULT_MAX_BATCH = 256
MODES = ("full_and_piecewise", "full_decode_only", "piecewise", "full", "none")
DEFAULT_MODE = "full_and_piecewise"
DECODE_ONLY_MODE = "full_decode_only"
CAPTURE_POLICIES = ("pow2", "vllm")
BACKENDS = ("auto", "cuda", "eager")
MODELS = ("auto", "tiny", "small", "large")
DEFAULT_SPEEDUP = 10.0
"""Decode-only (``--mode full_decode_only``): trace time runs 10x faster than recorded, so from a
cold start the batch climbs through most capture sizes within 300 steps (towards ~230 requests at
steady state, with max-batch 256)."""
MIXED_SPEEDUP = 6.0
"""Mixed modes: 6x keeps ~150 requests decoding with room for prompt chunks, so about half the steps
decode only (FULL), a third carry prompt chunks under the largest capture size (PIECEWISE) and a
few bursts go above it (eager). At 10x the decodes alone fill most of the 256 tokens and most mixed
steps run eagerly; measured on the packaged trace with seeds 0 and 1."""
RAMP_STEPS = 200
"""Mixed modes start cold and the trace's speed climbs from 0 to full over the first 200 steps, so
the batch grows from one request through every capture size before the steady state of the last
third of the default run (with seed 0 every one of the 9 sizes replays; without the ramp size 1 is
never met, and a busy start meets only 137..320 tokens: 2 of 19 graphs)."""
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
MAX_SPEEDUP = 1000
"""Far beyond saturation every step only lengthens the queue, by ~0.1 x speedup requests."""
MAX_BATCH_LIMIT = 4096
MAX_SEED = 2**32 - 1


def token_budget(max_batch: int) -> int:
    """Tokens one mixed step may hold: max-batch plus a quarter (see ``TOKEN_BUDGET_SHARE``)."""
    return max_batch + max_batch // TOKEN_BUDGET_SHARE


def is_decode_only(args: argparse.Namespace) -> bool:
    return bool(args.mode == DECODE_ONLY_MODE)


def check(args: argparse.Namespace) -> None:
    """Refuse what cannot work, before the database is touched; fill in the mode's default speedup."""
    from dashboard.commands.serve import TOKEN_ENV
    from dashboard.hosts import is_loopback
    from inspector.errors import UsageError

    args.token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.no_serve and not is_loopback(args.host) and not args.token:
        raise UsageError(
            f"refusing to serve on {args.host} without an access token: the dashboard shows stack traces "
            f"and memory addresses. Pass --token (or set {TOKEN_ENV}), or use the default host."
        )
    if args.ubatch and not is_decode_only(args):
        raise UsageError(f"--ubatch micro-batches decode steps; use it with --mode {DECODE_ONLY_MODE}")
    if not args.no_serve:
        check_can_listen(args.host, args.port)  # fail now, not after the whole run
    if args.speedup is None:
        args.speedup = DEFAULT_SPEEDUP if is_decode_only(args) else MIXED_SPEEDUP


def check_can_listen(host: str, port: int) -> None:
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
