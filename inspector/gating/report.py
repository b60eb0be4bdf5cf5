"""Reports for people and for CI: what was recorded, and every violation, as text, JSON or JUnit XML.

A CI system shows JUnit XML natively, so each violation becomes a failing test case (named after
the graph and input, with the full message and addresses) and each clean run a passing one; the
build fails on the exit code (0 clean, 1 violations or regressions). Against a baseline
(``inspector.gating.gate``) every comparison is a test case of its own, so a CI page lists exactly what
regressed. The pytest plugin renders its findings with the same functions, so both paths read the
same.
"""

from __future__ import annotations

import json
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from sqlalchemy import func, select

from inspector.errors import UsageError
from inspector.gating.gate import REGRESSION, SKIPPED, Comparison, GateResult
from inspector.reading.divergences import REPLAY_MISMATCH, newest_divergences
from inspector.reading.graph_worth import MARKS, GraphWorth, graph_worth
from inspector.reading.traffic import (
    TrafficTotals,
    never_captured,
    never_captured_line,
    replay_totals,
    traffic_per_run,
)
from inspector.recording.losses import Losses, Sidecar, run_losses
from inspector.storage.models import CompileRecord, Graph, ReplayTotal, Run, Violation
from inspector.storage.store import Store
from inspector.storage.writer import UNKNOWN_BACKEND

FORMATS = ("text", "json", "junit")
SUITE = "graph-inspector"
TITLE_CHARS = 160
"""How much of a message a finding with no graph is titled with."""
TEXT_STACK_FRAMES = 4
"""Frames of each violation's stack the text report shows (JSON and JUnit carry all of them)."""


@dataclass(frozen=True)
class ReportedViolation:
    """One violation as a report shows it (a database row, or an event seen by the pytest plugin)."""

    kind: str
    message: str
    wrapper: str = ""
    mode: str = ""
    descriptor: str = ""
    input_name: str | None = None
    expected_address: int | None = None
    actual_address: int | None = None
    count: int = 1
    injected: bool = False
    where: str = ""
    """Where it was seen: ``run 3 (host, rank 0)``, or a test's node id."""
    first_seen_at: float | None = None
    last_seen_at: float | None = None
    stack: str = ""
    located: str = ""
    """For a replay mismatch: where the graph and its eager step part (``capture_core.locate``)."""

    @property
    def title(self) -> str:
        """``kind: graph (mode) in wrapper, input name``; for a finding of no graph (an error raised
        for no violation), the kind and the first line of its message."""
        if not self.descriptor:
            line = (self.message.strip().splitlines() or [""])[0]
            return f"{self.kind}: {line[:TITLE_CHARS]}"
        text = f"{self.kind}: {self.descriptor} ({self.mode})"
        if self.wrapper:
            text += f" in {self.wrapper}"
        if self.input_name:
            text += f", input {self.input_name}"
        return text

    def addresses(self) -> str:
        if self.expected_address is None and self.actual_address is None:
            return ""
        actual = "gone" if self.actual_address is None else f"{self.actual_address:#x}"
        expected = "?" if self.expected_address is None else f"{self.expected_address:#x}"
        return f"captured at {expected}, replayed at {actual}"

    def details(self, stack_frames: int | None = None) -> str:
        """The text of a failure: what, where, both addresses, how often, and the stack (its last
        ``stack_frames`` frames, or all of it)."""
        lines = [self.message]
        if self.addresses():
            lines.append(f"input {self.input_name!r}: {self.addresses()}")
        lines.append(f"graph {self.descriptor} mode {self.mode} wrapper {self.wrapper!r}")
        if self.located:
            lines.append(f"located: {self.located}")
        lines.append(f"seen {self.count} time(s){' [injected on purpose]' if self.injected else ''}")
        if self.where:
            lines.append(f"in {self.where}")
        if self.stack:
            stack = self.stack.rstrip()
            if stack_frames is not None:
                # traceback.format_list gives two lines per frame: "File ..., line N, in f" and the code.
                frames = stack.split("\n  File ")
                if len(frames) > stack_frames:
                    stack = "  File " + "\n  File ".join(frames[-stack_frames:])
            lines += ["stack (most recent call last):", stack]
        return "\n".join(lines)


@dataclass
class RunSummary:
    id: int
    label: str
    host: str
    pid: int
    rank: int
    backend: str
    device: str
    started_at: float
    ended_at: float | None
    dropped: Losses = field(default_factory=Losses)
    """What its recorder could not keep (its row and its sidecar lines)."""
    job: str | None = None
    graphs: int = 0
    traffic: TrafficTotals = field(default_factory=TrafficTotals)
    violations: int = 0
    never_captured: int = 0
    """With no graph captured: the batches that ran eagerly because no capture phase had begun."""

    @property
    def warnings(self) -> list[str]:
        """What is wrong with the run though it broke no check: a report says it, CI passes it."""
        found = []
        if self.never_captured:
            found.append(never_captured_line(self.never_captured))
        if self.dropped:
            found.append(f"the recorder dropped {self.dropped.events:,} event(s) in this run: "
                         f"{self.dropped.describe()}")
        return found

    step_times: list[GraphTime] = field(default_factory=list)
    """Its timed graphs, by captured size."""

    def step_time_line(self) -> str | None:
        """The speedups of its timed graphs in a line (None when none has both times)."""
        timed = [(t.captured_size, t.worth.speedup) for t in self.step_times if t.worth.speedup is not None]
        if not timed:
            return None
        clock = self.step_times[0].worth.clock
        low, high = min(timed, key=lambda t: t[1]), max(timed, key=lambda t: t[1])
        return (f"step time ({clock}): {len(timed)} graph(s) timed against eager, speedup x{low[1]:.2f} "
                f"(size {low[0]}) to x{high[1]:.2f} (size {high[0]})")

    @property
    def name(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        job = f", job {self.job}" if self.job else ""
        return f"run {self.id}{label} ({self.host}, rank {self.rank}{job}, pid {self.pid})"


@dataclass(frozen=True)
class GraphTime:
    """One timed graph of a run, as the report shows it: what it is worth (``inspector.graph_worth``)."""

    graph_id: int
    mode: str
    descriptor: str
    captured_size: int
    worth: GraphWorth

    @property
    def name(self) -> str:
        return f"graph {self.graph_id} {self.descriptor} ({self.mode})"

    def advice(self) -> list[str]:
        """A line per mark: what is said of it, with the figures."""
        w = self.worth
        if not w.marks:  # a graph is marked only once both its times are known
            return []
        figures = (f"speedup x{w.speedup:.2f}: replay {_ms(w.graph.mean)}, eager {_ms(w.eager.mean)}; "
                   f"saved {w.saved_seconds:.3g} s over {w.replays:,} replays against "
                   f"{w.capture_seconds:.3g} s of capture")
        return [f"advice: {self.name}: {MARKS[mark]} ({figures})" for mark in w.marks]

    def as_dict(self) -> dict[str, object]:
        return {"graph_id": self.graph_id, "mode": self.mode, "descriptor": self.descriptor,
                "captured_size": self.captured_size, **self.worth.as_dict()}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f} ms"


@dataclass(frozen=True)
class CompileNote:
    """torch.compile skipping or re-recording CUDA graphs in a run: reported, never a failure by itself
    (a skip is also a ``compile_skip`` violation, and a re-record storm a ``rerecord_storm`` one)."""

    kind: str
    function: str
    reason: str
    count: int
    where: str

    @property
    def line(self) -> str:
        return compile_line(self.kind, self.function, self.count, self.reason)


def compile_line(kind: str, function: str, count: int, reason: str) -> str:
    """One torch.compile record as a line: ``torch.compile re-record in forward x4: <reason>``."""
    what = kind.removeprefix("compile_").replace("rerecord", "re-record")
    where = f" in {function}" if function else ""
    return f"torch.compile {what}{where} x{count}: {reason}"


@dataclass
class Report:
    source: str
    runs: list[RunSummary]
    findings: list[ReportedViolation]
    compile_notes: list[CompileNote] = field(default_factory=list)
    unattributed_losses: Losses = field(default_factory=Losses)
    """Lost by recorders whose run is not in the database (recorded only in its sidecar file)."""
    generated_at: float = field(default_factory=time.time)
    gate: GateResult | None = None
    """The candidate run against a baseline, when one was given."""

    @property
    def ok(self) -> bool:
        return not self.findings and (self.gate is None or self.gate.ok)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def build_report(store: Store, run_id: int | None = None) -> Report:
    """Read the runs (all, or one) and their violations."""
    with store.session() as session:
        query = select(Run).order_by(Run.id)
        if run_id is not None:
            query = query.where(Run.id == run_id)
        runs = {
            run.id: RunSummary(
                id=run.id,
                label=run.label,
                host=run.host,
                pid=run.pid,
                rank=run.rank,
                backend=run.backend,
                device=run.device,
                started_at=run.started_at,
                ended_at=run.ended_at,
                job=run.job,
            )
            for run in session.scalars(query)
        }
        if run_id is not None and not runs:
            raise UsageError(
                f"no run {run_id} in {store.display_url} (see `graph-inspector report` for all runs)"
            )
        selected = list(runs)
        for rid, count in session.execute(
            select(Graph.run_id, func.count())
            .where(Graph.run_id.in_(selected), Graph.discarded.is_(False))
            .group_by(Graph.run_id)
        ):
            runs[rid].graphs = count
        for rid, traffic in traffic_per_run(session, selected).items():
            runs[rid].traffic = traffic
        for rid, batches in never_captured(session, selected).items():
            runs[rid].never_captured = batches
        graphs = session.scalars(
            select(Graph)
            .where(Graph.run_id.in_(selected))
            .order_by(Graph.run_id, Graph.captured_size, Graph.id)
        ).all()
        replayed = replay_totals(session, ReplayTotal.graph_id, graph_ids=[g.id for g in graphs])
        worths = graph_worth(session, graphs, {gid: totals.replays for (gid,), totals in replayed.items()})
        for g in graphs:
            if g.id in worths:
                runs[g.run_id].step_times.append(
                    GraphTime(g.id, g.mode, g.descriptor_key, g.captured_size, worths[g.id]))
        losses = run_losses(session, Sidecar(store.sqlite_path), None if run_id is None else selected)
        for rid, dropped in losses.runs.items():
            runs[rid].dropped = dropped
        findings = []
        located = newest_divergences(session, selected)
        for v in session.scalars(
            select(Violation).where(Violation.run_id.in_(selected)).order_by(Violation.run_id, Violation.id)
        ):
            runs[v.run_id].violations += 1
            findings.append(
                ReportedViolation(
                    kind=v.kind,
                    message=v.message,
                    wrapper=v.wrapper,
                    mode=v.mode,
                    descriptor=v.descriptor_key,
                    input_name=v.input_name,
                    expected_address=v.expected_address,
                    actual_address=v.actual_address,
                    count=v.count,
                    injected=v.injected,
                    where=runs[v.run_id].name,
                    first_seen_at=v.first_seen_at,
                    last_seen_at=v.last_seen_at,
                    stack=v.stack,
                    located=located.get((v.run_id, v.mode, v.descriptor_key), "") if v.kind == REPLAY_MISMATCH
                    else "",
                )
            )
        notes = [
            CompileNote(r.kind, r.function, r.reason, r.count, runs[r.run_id].name)
            for r in session.scalars(
                select(CompileRecord)
                .where(CompileRecord.run_id.in_(selected))
                .order_by(CompileRecord.run_id, CompileRecord.count.desc(), CompileRecord.id)
            )
        ]
    return Report(source=store.display_url, runs=list(runs.values()), findings=findings, compile_notes=notes,
                  unattributed_losses=losses.unattributed)


# ---------------------------------------------------------------------------------------------- text


def _percent(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.1%}"


def render_text(report: Report) -> str:
    lines = [f"graph-inspector report: {report.source}"]
    if not report.runs:
        lines.append("no runs recorded")
    for run in report.runs:
        state = "ended" if run.ended_at is not None else "not ended (live, or killed)"
        traffic = run.traffic
        backend = "no graph backend (nothing captured)" if run.backend == UNKNOWN_BACKEND else run.backend
        lines.append(
            f"  {run.name}: {backend} on {run.device}, {state}; {run.graphs} graphs, "
            f"{traffic.replays} replays, hit ratio {_percent(traffic.hit_ratio)}, "
            f"padding waste {_percent(traffic.padding_waste)}, {run.violations} violation(s)"
        )
        lines.extend(f"    warning: {warning}" for warning in run.warnings)
        step_line = run.step_time_line()
        if step_line is not None:
            lines.append(f"    {step_line}")
        lines.extend(f"    {advice}" for timed in run.step_times for advice in timed.advice())
        lines.extend(f"    {note.line}" for note in report.compile_notes if note.where == run.name)
    if report.unattributed_losses:
        lost = report.unattributed_losses
        lines.append(f"  warning: recorders whose run is not in this database dropped {lost.events:,} "
                     f"event(s): {lost.describe()} (recorded in the database's .losses file)")
    for finding in report.findings:
        lines.append("")
        lines.append(f"FAIL {finding.title}")
        lines.extend(
            f"    {line}".rstrip() for line in finding.details(stack_frames=TEXT_STACK_FRAMES).splitlines()
        )
    if report.gate is not None:
        lines += ["", *gate_lines(report.gate)]
    lines.append("")
    if not report.findings:
        lines.append(f"OK: no violations in {len(report.runs)} run(s)")
    else:
        total = sum(f.count for f in report.findings)
        lines.append(
            f"FAILED: {len(report.findings)} violation(s) ({total} occurrence(s)) "
            f"in {len(report.runs)} run(s)"
        )
    if report.gate is not None:
        lines.append(gate_verdict(report.gate))
    return "\n".join(lines) + "\n"


VERDICT_WORDS = {REGRESSION: "FAIL", SKIPPED: "SKIP"}


def gate_lines(gate: GateResult) -> list[str]:
    """The gate's section of a text report: one line per comparison, its details under it."""
    lines = [f"Regression gate: {gate.candidate} against {gate.baseline}"]
    for comparison in gate.comparisons:
        word = VERDICT_WORDS.get(comparison.verdict, "PASS")
        lines.append(f"  {word} {comparison.title.lower()}: {comparison.summary}")
        lines.extend(f"      {detail}" for detail in comparison.details)
    return lines


def gate_verdict(gate: GateResult) -> str:
    if gate.ok:
        return f"OK: no regressions against {gate.baseline}"
    names = ", ".join(c.title.lower() for c in gate.regressions)
    return f"FAILED: {len(gate.regressions)} regression(s) against {gate.baseline}: {names}"


# ---------------------------------------------------------------------------------------------- JSON


def render_json(report: Report) -> str:
    payload = {
        "ok": report.ok,
        "source": report.source,
        "generated_at": report.generated_at,
        "runs": [
            asdict(run) | {"traffic": run.traffic.as_dict(), "dropped": run.dropped.as_dict(),
                           "dropped_events": run.dropped.events, "warnings": run.warnings,
                           "step_times": [timed.as_dict() for timed in run.step_times]}
            for run in report.runs
        ],
        "unattributed_dropped": report.unattributed_losses.as_dict(),
        "violations": [finding_dict(f) for f in report.findings],
        "compile_events": [asdict(note) for note in report.compile_notes],
        "gate": None if report.gate is None else report.gate.as_dict(),
    }
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def finding_dict(finding: ReportedViolation) -> dict[str, object]:
    data = asdict(finding)
    data["title"] = finding.title
    return data


# ---------------------------------------------------------------------------------------------- JUnit


@dataclass(frozen=True)
class Case:
    """One JUnit test case: failing for a ``finding`` or a failed ``comparison``, skipped for a
    skipped comparison, else passing."""

    classname: str
    name: str
    finding: ReportedViolation | None = None
    comparison: Comparison | None = None
    output: str = ""
    """Said beside a passing case (a run's warnings), as the case's system-out."""

    @property
    def failed(self) -> bool:
        return self.finding is not None or (self.comparison is not None and self.comparison.failed)

    @property
    def skipped(self) -> bool:
        return self.comparison is not None and self.comparison.verdict == SKIPPED


def report_cases(report: Report) -> list[Case]:
    """A failing case per violation, a passing case per clean run (or one when nothing ran), and a
    case per comparison against the baseline."""
    cases = [Case(f"{SUITE}.{f.kind}", f"{f.title} [{f.where}]", f) for f in report.findings]
    for run in report.runs:
        if run.violations == 0:
            warned = "\n".join(f"warning: {warning}" for warning in run.warnings)
            cases.append(Case(f"{SUITE}.run", f"{run.name}: no violations", output=warned))
    if not cases:
        cases.append(Case(f"{SUITE}.run", "no violations (no runs recorded)"))
    if report.gate is not None:
        cases += gate_cases(report.gate)
    return cases


def gate_cases(gate: GateResult) -> list[Case]:
    return [Case(f"{SUITE}.baseline", c.title, comparison=c) for c in gate.comparisons]


def render_junit_cases(
    cases: Sequence[Case], suite: str = SUITE, properties: Iterable[tuple[str, str]] = ()
) -> str:
    failures = sum(1 for c in cases if c.failed)
    skipped = sum(1 for c in cases if c.skipped)
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(failures), errors="0")
    suite_el = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        hostname=socket.gethostname(),
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()),
    )
    props = list(properties)
    if props:
        props_el = ET.SubElement(suite_el, "properties")
        for key, value in props:
            ET.SubElement(props_el, "property", name=key, value=value)
    for case in cases:
        case_el = ET.SubElement(suite_el, "testcase", classname=case.classname, name=case.name, time="0")
        if case.finding is not None:
            failure = ET.SubElement(case_el, "failure", type=case.finding.kind, message=case.finding.message)
            failure.text = case.finding.details()
        elif case.comparison is not None and case.comparison.verdict != "pass":
            comparison = case.comparison
            tag = "failure" if comparison.failed else "skipped"
            element = ET.SubElement(case_el, tag, message=comparison.summary)
            if comparison.failed:
                element.set("type", REGRESSION)
                element.text = "\n".join([comparison.summary, *comparison.details])
        if case.output:
            ET.SubElement(case_el, "system-out").text = case.output
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def render_junit(report: Report) -> str:
    return render_junit_cases(report_cases(report), properties=[("source", report.source)])


def render(report: Report, fmt: str) -> str:
    if fmt == "text":
        return render_text(report)
    if fmt == "json":
        return render_json(report)
    if fmt == "junit":
        return render_junit(report)
    raise UsageError(f"unknown report format {fmt!r}; choose one of {', '.join(FORMATS)}")
