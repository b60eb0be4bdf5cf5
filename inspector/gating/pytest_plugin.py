"""pytest plugin (entry point ``pytest11``): run a test suite with the graph cache's checks on, fail
the test in which a violation happens, and write the findings as JUnit XML or JSON for CI.

- ``--graph-debug`` sets ``GRAPH_INSPECTOR_DEBUG=1`` for the session, which forces capture_core's
  address checks into DEBUG mode: a drift raises ``AddressDriftError`` in the test that caused it.
- The ``graph_observer`` fixture is an observer to give a ``GraphRuntime`` (or add to a
  ``FanOutObserver``). A violation it receives fails the test it happened in, with a message that
  names the input, the graph's descriptor and both addresses; mark a test
  ``graph_violations_expected`` when it plants one on purpose.
- ``--graph-report PATH`` writes every finding (recorded or raised) at the end of the session:
  JSON when PATH ends in ``.json``, JUnit XML otherwise.
- ``--graph-baseline PATH`` is the regression gate for the session: the graphs the
  ``graph_observer`` fixtures saw (captures, pool memory, capture time, replays, eager batches,
  summed over the tests) are compared with a baseline file (``inspector.gating.gate``); a regression fails
  the session, and each comparison is a case of the ``--graph-report``. ``--graph-save-baseline
  PATH`` writes the session's figures as that file; ``--graph-thresholds PATH`` sets thresholds.

Findings travel on each test's ``user_properties``, so under pytest-xdist they reach the controller,
which alone writes the report; workers only observe. State lives in ``config.stash``. This module
imports nothing heavy at start-up: an installed package loads it into every pytest run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Generator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

DEBUG_ENV = "GRAPH_INSPECTOR_DEBUG"
"""capture_core.checks reads it; kept here as text so this module does not import torch."""
MARKER = "graph_violations_expected"
FINDING_PROPERTY = "graph_inspector_finding"
FIGURES_PROPERTY = "graph_inspector_figures"
REPORTER_NAME = "graph-inspector-reporter"


@dataclass
class PluginState:
    report_path: Path | None
    debug: bool
    previous_debug_env: str | None = None
    findings: list[Any] = field(default_factory=list)
    tests: int = 0
    report_error: str | None = None
    baseline_path: Path | None = None
    save_baseline_path: Path | None = None
    thresholds_path: Path | None = None
    figures: list[Any] = field(default_factory=list)
    """Each test's ``Figures`` (gathered only when a baseline is compared or saved)."""
    gate: Any = None
    """The session against the baseline (an ``inspector.gating.gate.GateResult``)."""
    gate_error: str | None = None
    save_error: str | None = None

    @property
    def gathers_figures(self) -> bool:
        return self.baseline_path is not None or self.save_baseline_path is not None


STATE = pytest.StashKey[PluginState]()
OBSERVER = pytest.StashKey["TestObserver"]()


class TestObserver:
    """A graph observer that keeps the violations of one test (everything else it ignores)."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, figures: Any = None) -> None:
        self.violations: list[Any] = []
        self._taken = 0
        self.figures = figures
        """A ``FiguresCollector`` when the session is compared with a baseline, else None."""

    def on_capture(self, event: Any) -> None:
        if self.figures is not None:
            self.figures.on_capture(event)

    def on_replay(self, mode: Any, descriptor: Any, num_real_tokens: int) -> None:
        if self.figures is not None:
            self.figures.on_replay(mode, descriptor, num_real_tokens)

    def on_eager(self, reason: Any, num_real_tokens: int, mode: Any) -> None:
        if self.figures is not None:
            self.figures.on_eager(reason, num_real_tokens, mode)

    def on_violation(self, event: Any) -> None:
        self.violations.append(event)

    def take_new(self) -> list[Any]:
        """The violations received since the last call."""
        new = self.violations[self._taken :]
        self._taken = len(self.violations)
        return new


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("terminal reporting")
    group.addoption(
        "--graph-debug",
        action="store_true",
        default=False,
        help="graph-inspector: check graph input addresses in DEBUG mode (sets GRAPH_INSPECTOR_DEBUG=1), "
        "so an address drift raises in the test that caused it.",
    )
    group.addoption(
        "--graph-report",
        metavar="PATH",
        default=None,
        help="graph-inspector: write the graph violations found during the session to PATH "
        "(JUnit XML, or JSON when PATH ends in .json).",
    )
    group.addoption(
        "--graph-baseline",
        metavar="PATH",
        default=None,
        help="graph-inspector: compare the graphs the graph_observer fixtures saw with this baseline "
        "file (graph-inspector report --save-baseline, or --graph-save-baseline); a regression fails "
        "the session.",
    )
    group.addoption(
        "--graph-save-baseline",
        metavar="PATH",
        default=None,
        help="graph-inspector: write the graphs the graph_observer fixtures saw as a baseline file.",
    )
    group.addoption(
        "--graph-thresholds",
        metavar="PATH",
        default=None,
        help="graph-inspector: the regression gate's thresholds (TOML or JSON; see docs/regression-gate.md).",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: violations the graph_observer fixture receives do not fail this test"
    )
    path = config.getoption("graph_report")
    state = PluginState(
        report_path=_path(path), debug=config.getoption("graph_debug"),
        baseline_path=_path(config.getoption("graph_baseline")),
        save_baseline_path=_path(config.getoption("graph_save_baseline")),
        thresholds_path=_path(config.getoption("graph_thresholds")),
    )
    if state.debug:
        state.previous_debug_env = os.environ.get(DEBUG_ENV)
        os.environ[DEBUG_ENV] = "1"
    config.stash[STATE] = state
    if not _is_worker(config):
        config.pluginmanager.register(SessionReporter(state), REPORTER_NAME)


def _path(option: str | None) -> Path | None:
    return Path(option).resolve() if option else None


def pytest_unconfigure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin(REPORTER_NAME)
    if reporter is not None:
        config.pluginmanager.unregister(reporter)
    state = config.stash.get(STATE, None)
    if state is None or not state.debug:
        return
    if state.previous_debug_env is None:
        os.environ.pop(DEBUG_ENV, None)
    else:
        os.environ[DEBUG_ENV] = state.previous_debug_env


@pytest.fixture
def graph_observer(request: pytest.FixtureRequest) -> TestObserver:
    """An observer for the graph runtime under test: a violation it sees fails this test."""
    figures = None
    if request.config.stash[STATE].gathers_figures:
        from inspector.gating.baseline import FiguresCollector

        figures = FiguresCollector()
    observer = TestObserver(figures)
    request.node.stash[OBSERVER] = observer
    return observer


def _finding_from_event(event: Any, item: pytest.Item) -> Any:
    from inspector.gating.report import ReportedViolation

    return ReportedViolation(
        kind=event.kind.value,
        message=event.message,
        wrapper=event.wrapper,
        mode=event.mode.label,
        descriptor=event.descriptor.key,
        input_name=event.input_name,
        expected_address=event.expected_address,
        actual_address=event.actual_address,
        injected=event.injected,
        where=item.nodeid,
        first_seen_at=event.seen_at,
        last_seen_at=event.seen_at,
        stack=from_the_test(event.stack, str(item.path)),
    )


def _findings_from_exception(excinfo: pytest.ExceptionInfo[BaseException] | None, item: pytest.Item
                             ) -> list[Any]:
    """A graph-cache error raised through a test (a DEBUG-mode finding of a replay check, an
    unexpected capture): the violations it was raised for, as if an observer had seen them; an
    error raised for none, by its kind and message."""
    errors = sys.modules.get("capture_core.errors")
    if excinfo is None or errors is None or not excinfo.errisinstance(errors.GraphCacheError):
        return []
    events = getattr(excinfo.value, "events", ())
    if events:
        return [_finding_from_event(event, item) for event in events]
    from capture_core.events import ViolationKind
    from inspector.gating.report import ReportedViolation

    kinds = {kind.record.error: kind.value for kind in ViolationKind if kind.record.error is not None}
    kind = kinds.get(excinfo.type, "graph_cache_error")
    return [ReportedViolation(kind=kind, message=str(excinfo.value), where=item.nodeid)]


FRAME = '  File "'
"""How each frame of a formatted stack (``traceback.format_list``) begins."""
RUNNER_FILES = ("/_pytest/", "/pluggy/", "/runpy.py", "<frozen runpy>", "/pytest/__main__.py")


def from_the_test(stack: str, test_file: str) -> str:
    """A violation's stack from the test function on: the frames of pytest and pluggy that called it
    say nothing about the graph (a test's stack holds thirty of them). When no frame is the test's
    (a fixture, a thread), only the runner's frames are left out."""
    frames = [FRAME + frame for frame in stack.split(FRAME)[1:]]
    for index, frame in enumerate(frames):
        if frame.startswith(f'{FRAME}{test_file}"'):
            return "".join(frames[index:])
    return "".join(frame for frame in frames
                   if not any(part in frame.partition("\n")[0] for part in RUNNER_FILES))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    observer = item.stash.get(OBSERVER, None)
    expected = item.get_closest_marker(MARKER) is not None
    events = observer.take_new() if observer is not None else []
    if observer is not None and observer.figures is not None and call.when == "teardown":
        # The last phase's report is built by now (from a copy of the item's properties).
        report.user_properties.append((FIGURES_PROPERTY, observer.figures.figures.to_json()))
    if expected:
        return report
    findings = [_finding_from_event(event, item) for event in events]
    if not findings:
        findings = _findings_from_exception(call.excinfo, item)
    for finding in findings:
        item.user_properties.append((FINDING_PROPERTY, json.dumps(asdict(finding))))
    if events and report.passed:
        report.outcome = "failed"
        header = f"graph-inspector: {len(events)} violation(s) during {report.when} of this test"
        from inspector.gating.report import TEXT_STACK_FRAMES

        details = (finding.details(stack_frames=TEXT_STACK_FRAMES) for finding in findings)
        report.longrepr = "\n\n".join([header, *details])
    return report


class SessionReporter:
    """The controller's side (registered only where no xdist worker runs): gathers the findings of
    every test report, writes the report file, prints the summary."""

    def __init__(self, state: PluginState) -> None:
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Properties accumulate on the item across phases: read them once, from the last phase.
        if report.when != "teardown":
            return
        self.state.tests += 1
        for name, value in report.user_properties:
            if name == FINDING_PROPERTY:
                from inspector.gating.report import ReportedViolation

                self.state.findings.append(ReportedViolation(**json.loads(value)))
            elif name == FIGURES_PROPERTY:
                from inspector.gating.baseline import figures_from_json

                self.state.figures.append(figures_from_json(json.loads(value)))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        state = self.state
        if state.gathers_figures:
            self._gate(session)
        if state.report_path is None:
            return
        try:
            state.report_path.parent.mkdir(parents=True, exist_ok=True)
            state.report_path.write_text(_render(state))
        except OSError as error:
            state.report_error = f"cannot write {state.report_path}: {error.strerror or error}"
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _gate(self, session: pytest.Session) -> None:
        """The session's figures against the baseline, and saved as one; a regression (or a
        baseline that cannot be read) fails the session."""
        from inspector.errors import InspectorError
        from inspector.gating.baseline import load_baseline, merge, save_baseline
        from inspector.gating.gate import Thresholds, compare

        state = self.state
        tests = f"{state.tests} test" + ("" if state.tests == 1 else "s")
        figures = merge(state.figures, {"what": f"the test session ({tests})"})
        try:
            if state.save_baseline_path is not None:
                if session.exitstatus != pytest.ExitCode.OK:
                    # A session that failed (or collected nothing) would make a baseline of too little.
                    state.save_error = "the session failed"
                else:
                    save_baseline(figures, state.save_baseline_path)
            if state.baseline_path is not None:
                thresholds = Thresholds.load(state.thresholds_path)
                state.gate = compare(load_baseline(state.baseline_path), figures, thresholds)
        except InspectorError as error:
            state.gate_error = str(error)
        if (state.gate_error or (state.gate is not None and not state.gate.ok)) and (
            session.exitstatus == pytest.ExitCode.OK
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        state = self.state
        if not (state.findings or state.report_path or state.debug or state.gathers_figures):
            return
        terminalreporter.write_sep("-", "graph-inspector")
        if state.findings:
            tests = len({finding.where for finding in state.findings})
            terminalreporter.write_line(
                f"{len(state.findings)} graph violation(s) in {tests} test(s)", red=True
            )
        else:
            terminalreporter.write_line(f"no graph violations in {state.tests} test(s)", green=True)
        if state.debug:
            terminalreporter.write_line(f"address checks in DEBUG mode ({DEBUG_ENV}=1)")
        if state.gate_error:
            terminalreporter.write_line(f"graph baseline: {state.gate_error}", red=True)
        if state.gate is not None:
            from inspector.gating.report import gate_lines, gate_verdict

            for line in gate_lines(state.gate):
                terminalreporter.write_line(line)
            terminalreporter.write_line(gate_verdict(state.gate), red=not state.gate.ok, green=state.gate.ok)
        if state.save_error:
            terminalreporter.write_line(f"graph baseline NOT written: {state.save_error}", red=True)
        elif state.save_baseline_path is not None and not state.gate_error:
            terminalreporter.write_line(f"graph baseline written to {state.save_baseline_path}")
        if state.report_error:
            terminalreporter.write_line(f"graph report NOT written: {state.report_error}", red=True)
        elif state.report_path is not None:
            terminalreporter.write_line(f"graph report written to {state.report_path}")


def _render(state: PluginState) -> str:
    from inspector.gating.report import (
        SUITE,
        Case,
        ReportedViolation,
        finding_dict,
        gate_cases,
        render_junit_cases,
    )

    assert state.report_path is not None
    gate = state.gate
    if state.report_path.suffix == ".json":
        payload = {
            "ok": not state.findings and (gate is None or gate.ok),
            "tests": state.tests,
            "violations": [finding_dict(f) for f in state.findings],
            "gate": None if gate is None else gate.as_dict(),
        }
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"
    cases = [
        Case(finding.where.split("::")[0], f"{finding.where} {finding.title}", finding)
        for finding in state.findings
    ]
    if not cases:
        cases.append(Case(f"{SUITE}.session", f"no graph violations in {state.tests} test(s)"))
    if gate is not None:
        cases += gate_cases(gate)
    if state.gate_error:
        unread = ReportedViolation(kind="baseline_error", message=state.gate_error)
        cases.append(Case(f"{SUITE}.baseline", "baseline", unread))
    return render_junit_cases(cases, properties=[("tests", str(state.tests))])
