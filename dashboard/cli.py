"""The `graph-inspector` command line: one module per subcommand, registered here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
# Modules import their heavy dependencies (torch, Flask, SQLAlchemy) inside `func`, so that
# `--help` stays instant.
COMMAND_MODULES = (
    "dashboard.commands.demo",
    "dashboard.commands.serve",
    "inspector.commands.report",
    "inspector.commands.db",
    "inspector.commands.watch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graph-inspector",
        description=(
            "A CUDA-graph cache for LLM decoding and the daemon that inspects it: what the graph "
            "cache holds, how traffic meets it, and when it is silently wrong."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from inspector.errors import InspectorError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except InspectorError as exc:
        print(f"graph-inspector {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"graph-inspector {args.command}: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graph-inspector")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
