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
    notes: list[str] = []
    with open_store(args.db, upgrade=False) as store:
        store.require_head()
        report = build_report(store, args.run)
        if report.runs and (args.baseline is not None or args.save_baseline):
            notes = _gate(args, store, report, thresholds)
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
    if args.save_baseline and not report.ok:
        found = " and ".join(what for what, there in (("violations", report.findings),
                                                     ("regressions", report.gate and report.gate.regressions))
                             if there)
        notes.append(f"the baseline was written to {args.save_baseline} all the same (it holds the graphs, "
                     f"not the {found}); the exit status {report.exit_code} is for the {found} above")
    for note in notes:
        print(f"graph-inspector report: {note}", file=sys.stderr)
    return report.exit_code


def _gate(args: argparse.Namespace, store: Store, report: Report, thresholds: Thresholds) -> list[str]:
    """The candidate run against the baseline (``report.gate``), and the candidate saved as one;
    what the user should know of the baseline written, a line each."""
    from inspector.gating.baseline import (
        baseline_run_in,
        newest_run,
        read_baseline,
        run_figures,
        save_baseline,
    )
    from inspector.gating.gate import compare
    from inspector.reading.traffic import never_captured_line

    baseline = read_baseline(args.baseline, store, args.baseline_run) if args.baseline else None
    with store.session() as session:
        candidate_id = args.run
        if candidate_id is None:
            # A baseline run of this database is not its own candidate.
            excluding = None if baseline is None else baseline_run_in(session, baseline, store.display_url)
            candidate_id = newest_run(session, store.display_url, excluding=excluding)
        candidate = run_figures(session, candidate_id, store.display_url)
    if baseline is not None:
        report.gate = compare(baseline, candidate, thresholds)
    if not args.save_baseline:
        return []
    save_baseline(candidate, Path(args.save_baseline))
    print(f"graph-inspector report: baseline of {candidate.described} written to {args.save_baseline}",
          file=sys.stderr)
    notes = []
    if candidate.unexpected:
        left_out = ", ".join(f"{g.mode} {g.descriptor_key}" for g in candidate.unexpected.values())
        notes.append(f"left out of the baseline: {len(candidate.unexpected)} graph(s) captured after "
                     f"start-up locked capture ({left_out}): unexpected captures are violations, not "
                     "graphs a later run must capture")
    if not candidate.captured and candidate.batches_before_capture:
        notes.append(f"the baseline holds no graph: {candidate.described} "
                     f"{never_captured_line(candidate.batches_before_capture)}")
    return notes


def _outcome(report: Report) -> str:
    parts = []
    if report.findings:
        parts.append(f"{len(report.findings)} violation(s)")
    if report.gate is not None and report.gate.regressions:
        parts.append(f"{len(report.gate.regressions)} regression(s)")
    return ", ".join(parts) or "clean"
