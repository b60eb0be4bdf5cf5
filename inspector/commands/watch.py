"""`graph-inspector watch -- python script.py ...`: record the CUDA graphs of any engine, unchanged.

The command runs as a child process with the watch armed in every Python process it starts (see
``inspector.watch.launch``), records into the database, and prints what was recorded once the
command ends. Its exit status is the command's.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import subprocess
import sys


def run(args: argparse.Namespace) -> int:
    from inspector.errors import UsageError
    from inspector.recording.process import JOB_ENV
    from inspector.storage.store import open_store, resolve_url
    from inspector.watch.launch import WatchSettings, child_environment
    from inspector.watch.summary import watch_summary

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command to watch; put it after '--', e.g. graph-inspector watch -- python x.py")
    if args.ready_after is not None and args.ready_after <= 0:
        raise UsageError(f"--ready-after must be a positive number of replays, got {args.ready_after}")
    if args.storm_threshold < 1:
        raise UsageError(f"--storm-threshold must be at least 1, got {args.storm_threshold}")
    if not args.storm_window > 0:
        raise UsageError(f"--storm-window must be positive, got {args.storm_window}")

    url = absolute_sqlite_url(resolve_url(args.db))
    # A bad URL or a foreign file is refused now, before the command runs.
    with open_store(url) as store:
        label = f"{args.label or default_label(command)} #{secrets.token_hex(3)}"
        settings = WatchSettings(
            db=url,
            label=label,
            ready_after=args.ready_after,
            storm_threshold=args.storm_threshold,
            storm_window_s=args.storm_window,
        )
        env = child_environment(settings)
        if args.job:
            env[JOB_ENV] = args.job
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as error:
            raise UsageError(f"cannot run {command[0]!r}: {error.strerror or error}") from None
        print(
            f"graph-inspector watch: recording {shlex.join(command)} into {store.display_url} as {label!r}",
            file=sys.stderr,
        )
        status = _wait(child, forward=(signal.SIGTERM, signal.SIGHUP))
        summary = watch_summary(store, label=label)
        print(summary.render(), file=sys.stderr)
        if not summary.runs:
            print(f"graph-inspector watch: nothing recorded: {why_nothing_was_captured()}", file=sys.stderr)
        return status


def why_nothing_was_captured() -> str:
    """Why a watched command left no run (a process is recorded from its first graph capture on)."""
    import torch

    if not torch.cuda.is_available():
        return ("torch here sees no CUDA device (torch.cuda.is_available() is False), so no process of the "
                "command could capture a CUDA graph; watch an engine on a GPU host")
    return ("no process of the command captured a CUDA graph (torch.cuda.CUDAGraph, torch.cuda.graph, "
            "make_graphed_callables or torch.compile's cudagraph trees); a process is recorded from its "
            "first capture on")


def default_label(command: list[str]) -> str:
    """'watch' and the script or module the command runs (its first argument ending in .py, or -m)."""
    for index, word in enumerate(command):
        if word.endswith(".py"):
            return f"watch {os.path.basename(word)}"
        if word == "-m" and index + 1 < len(command):
            return f"watch -m {command[index + 1]}"
    return f"watch {os.path.basename(command[0])}"


def absolute_sqlite_url(url: str) -> str:
    """A relative SQLite path made absolute: the watched program may change directory."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url  # open_store says what is wrong with it
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return url
    if database.startswith("file:") or os.path.isabs(database):
        return url
    return parsed.set(database=os.path.abspath(database)).render_as_string(hide_password=False)


def _wait(child: subprocess.Popen, forward: tuple[signal.Signals, ...]) -> int:
    """The child's exit status. Ctrl-C reaches it through the terminal, so keep waiting for it;
    a SIGTERM or SIGHUP sent to this command alone is passed on to it."""
    previous = {sig: signal.signal(sig, lambda number, _frame: child.send_signal(number)) for sig in forward}
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + -code if code < 0 and -code in signal.valid_signals() else code
