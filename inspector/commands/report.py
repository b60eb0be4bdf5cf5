"""`graph-inspector report`: what was recorded, and every violation; the exit code fails CI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = ("text", "json", "junit")


def run(args: argparse.Namespace) -> int:
    from inspector.errors import UsageError
    from inspector.report import build_report, render
    from inspector.store import open_store

    store = open_store(args.db, upgrade=False)
    try:
        store.require_head()
        report = build_report(store, args.run)
    finally:
        store.dispose()
    if not report.runs:
        # A clean report of nothing would pass CI while the engine records somewhere else.
        raise UsageError(
            f"no runs recorded in {report.source}: nothing to report. Point --db (or $GRAPH_INSPECTOR_DB) "
            "at the database your engine's Recorder writes"
        )
    text = render(report, args.format)
    if args.output:
        path = Path(args.output)
        try:
            path.write_text(text)
        except OSError as error:
            raise UsageError(f"cannot write the report to {path}: {error.strerror or error}") from None
        summary = "clean" if report.ok else f"{len(report.findings)} violation(s)"
        print(f"graph-inspector report: {summary}; {args.format} report written to {path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return report.exit_code
