"""`graph-inspector report`: what was recorded, every violation, and the regression gate against a
baseline; the exit code fails CI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inspector.gating.gate import Thresholds
    from inspector.gating.report import Report
    from inspector.storage.store import Store

FORMATS = ("text", "json", "junit")


def run(args: argparse.Namespace) -> int:
    from inspector.errors import UsageError
    from inspector.gating.gate import Thresholds
    from inspector.gating.report import build_report, render
    from inspector.storage.store import open_store

    if args.baseline_run is not None and args.baseline is None:
        raise UsageError("--baseline-run needs --baseline URL")
    if args.baseline is None and (args.thresholds or args.threshold):
        raise UsageError("--thresholds and --threshold set the regression gate: give --baseline too")
    thresholds = Thresholds.load(Path(args.thresholds) if args.thresholds else None, args.threshold)
    store = open_store(args.db, upgrade=False)
    try:
        store.require_head()
        report = build_report(store, args.run)
        if report.runs and (args.baseline is not None or args.save_baseline):
            _gate(args, store, report, thresholds)
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
        print(f"graph-inspector report: {_outcome(report)}; {args.format} report written to {path}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return report.exit_code


def _gate(args: argparse.Namespace, store: Store, report: Report, thresholds: Thresholds) -> None:
    """The candidate run against the baseline (``report.gate``), and the candidate saved as one."""
    from inspector.gating.baseline import newest_run, read_baseline, run_figures, save_baseline
    from inspector.gating.gate import compare

    baseline = read_baseline(args.baseline, store, args.baseline_run) if args.baseline else None
    # A baseline run of this database is not its own candidate.
    same_db = baseline is not None and baseline.source.get("database") == store.display_url
    with store.session() as session:
        candidate_id = args.run
        if candidate_id is None:
            excluding = baseline.source.get("run") if baseline is not None and same_db else None
            candidate_id = newest_run(session, store.display_url, excluding=excluding)
        candidate = run_figures(session, candidate_id, store.display_url)
    if baseline is not None:
        report.gate = compare(baseline, candidate, thresholds)
    if args.save_baseline:
        save_baseline(candidate, Path(args.save_baseline))
        print(f"graph-inspector report: baseline of {candidate.described} written to {args.save_baseline}",
              file=sys.stderr)


def _outcome(report: Report) -> str:
    parts = []
    if report.findings:
        parts.append(f"{len(report.findings)} violation(s)")
    if report.gate is not None and report.gate.regressions:
        parts.append(f"{len(report.gate.regressions)} regression(s)")
    return ", ".join(parts) or "clean"
