"""The pytest plugin, driven through ``pytester`` on a real graph wrapper (eager backend)."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import pytest
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

FULL = CUDAGraphMode.FULL


def double(x, *, scale):
    return x * scale


def serve(observer, drift):
    runtime = GraphRuntime("eager", observer=observer, progress=False)
    wrapper = CUDAGraphWrapper(double, runtime, name="double")
    x, scale = torch.ones(4), torch.tensor(2.0)
    descriptor = BatchDescriptor(4, 4, True)
    with runtime.capture_phase(), set_forward_context(FULL, descriptor):
        wrapper(x, scale=scale)
    with set_forward_context(FULL, descriptor):
        wrapper(x, scale=scale.clone() if drift else scale)


def test_clean(graph_observer):
    serve(graph_observer, drift=False)


def test_drifts(graph_observer):
    serve(graph_observer, drift=True)


@pytest.mark.graph_violations_expected
def test_planted(graph_observer):
    serve(graph_observer, drift=True)
    assert len(graph_observer.violations) == 1


def test_without_the_fixture():
    serve(None, drift=True)
"""


@pytest.fixture
def plugin_args(pytestconfig: pytest.Config) -> list[str]:
    """Load the plugin in the inner run unless the installed entry point already does."""
    if pytestconfig.pluginmanager.has_plugin("graph_inspector"):
        return []
    return ["-p", "inspector.gating.pytest_plugin"]


def test_a_recorded_violation_fails_the_test_it_happened_in(pytester: pytest.Pytester, plugin_args) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_suite.py::test_drifts*"])
    output = result.stdout.str()
    assert "graph-inspector: 1 violation(s) during call of this test" in output
    assert "input 'scale'" in output and "tokens=4,reqs=4,uniform=1" in output
    assert "captured at 0x" in output and "replayed at 0x" in output


def test_graph_debug_raises_in_every_drifting_test_and_reports_json(
    pytester: pytest.Pytester, plugin_args
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    report = pytester.path / "out" / "graph.json"
    before = os.environ.get("GRAPH_INSPECTOR_DEBUG")
    result = pytester.runpytest(
        *plugin_args, "-p", "no:cacheprovider", "--graph-debug", f"--graph-report={report}"
    )
    assert os.environ.get("GRAPH_INSPECTOR_DEBUG") == before, "the session's setting is undone"
    # In DEBUG mode the drift raises inside the test, with or without the fixture; the planted
    # one raises too (the marker only spares recorded violations, not exceptions).
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(["*AddressDriftError*", "*graph-inspector*", "*DEBUG mode*", f"*{report}*"])
    payload = json.loads(report.read_text())
    assert payload["ok"] is False and payload["tests"] == 4
    where = sorted(v["where"] for v in payload["violations"])
    assert where == ["test_suite.py::test_drifts", "test_suite.py::test_without_the_fixture"]
    by_test = {v["where"]: v for v in payload["violations"]}
    assert by_test["test_suite.py::test_drifts"]["input_name"] == "scale"
    assert by_test["test_suite.py::test_without_the_fixture"]["kind"] == "address_drift"


def test_junit_report_has_a_failing_case_per_violation(pytester: pytest.Pytester, plugin_args) -> None:
    pytester.makepyfile(test_suite=SUITE)
    report = pytester.path / "graph.xml"
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-report={report}")
    result.assert_outcomes(passed=3, failed=1)
    root = ET.parse(report).getroot()
    assert root.get("failures") == "1"
    case = next(root.iter("testcase"))
    assert "test_drifts" in (case.get("name") or "")
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "address_drift"
    assert "input 'scale'" in (failure.text or "")


def test_clean_session_writes_a_passing_report(pytester: pytest.Pytester, plugin_args) -> None:
    pytester.makepyfile(test_clean=SUITE.split("def test_drifts")[0])
    report = pytester.path / "graph.xml"
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-report={report}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*no graph violations in 1 test(s)*"])
    root = ET.parse(report).getroot()
    assert root.get("failures") == "0" and root.get("tests") == "1"


def test_unwritable_report_path_fails_the_run_with_a_message(pytester: pytest.Pytester, plugin_args) -> None:
    pytester.makepyfile(test_clean=SUITE.split("def test_drifts")[0])
    blocker = pytester.path / "file"
    blocker.write_text("a file, not a folder")
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-report={blocker}/graph.xml")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*graph report NOT written*"])


def test_xdist_workers_write_nothing(pytester: pytest.Pytester, plugin_args) -> None:
    pytester.makeconftest(
        """
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.workerinput = {"workerid": "gw0"}  # what pytest-xdist sets on a worker
"""
    )
    pytester.makepyfile(test_suite=SUITE)
    report = pytester.path / "graph.xml"
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-report={report}")
    result.assert_outcomes(passed=3, failed=1)  # the worker still fails the drifting test
    assert not report.exists()
    assert not re.search(r"-+ graph-inspector -+", result.stdout.str()), "no summary section on a worker"


def test_options_are_in_the_reporting_group(pytester: pytest.Pytester, plugin_args) -> None:
    result = pytester.runpytest(*plugin_args, "--help")
    reporting = result.stdout.str().lower().split("reporting:")[1].split("\n\n")[0]
    assert "--graph-debug" in reporting and "--graph-report=path" in reporting
    assert "--graph-baseline=path" in reporting and "--graph-save-baseline=path" in reporting


STALE_SUITE = """
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper


def test_forgets_to_write():
    runtime = GraphRuntime("eager", progress=False)
    wrapper = CUDAGraphWrapper(lambda x: x * 2, runtime, name="double", per_step_inputs=["x"])
    x = torch.ones(4)
    descriptor = BatchDescriptor(4)
    with runtime.capture_phase(), set_forward_context(CUDAGraphMode.FULL, descriptor):
        wrapper(x)
    for _ in range(2):  # no copy_ into x before either replay
        with set_forward_context(CUDAGraphMode.FULL, descriptor):
            wrapper(x)
"""


def test_graph_debug_reports_each_check_s_error_under_its_violation_kind(
    pytester: pytest.Pytester, plugin_args
) -> None:
    pytester.makepyfile(test_suite=STALE_SUITE)
    report = pytester.path / "graph.json"
    options = ("-p", "no:cacheprovider", "--graph-debug", f"--graph-report={report}")
    result = pytester.runpytest(*plugin_args, *options)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*StaleInputError*"])
    [violation] = json.loads(report.read_text())["violations"]
    assert violation["kind"] == "stale_input"


GATE_SUITE = """
import torch

from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

SIZES = {sizes}


def test_serves_every_size(graph_observer):
    runtime = GraphRuntime("eager", observer=graph_observer, progress=False)
    wrapper = CUDAGraphWrapper(lambda x: x * 2, runtime, name="double")
    static = {{size: torch.ones(size) for size in SIZES}}
    with runtime.capture_phase():
        for size in SIZES:
            with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(size, size, True)):
                wrapper(static[size])
    for size in SIZES * 3:
        with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(size, size, True)):
            wrapper(static[size])


def test_without_graphs():
    pass
"""


def test_a_session_saved_as_baseline_passes_again_and_fails_without_a_size(
    pytester: pytest.Pytester, plugin_args
) -> None:
    baseline = pytester.path / "ci" / "graph-baseline.json"
    pytester.makepyfile(test_session_graphs=GATE_SUITE.format(sizes=[1, 2, 4]))
    saved = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-save-baseline={baseline}")
    saved.assert_outcomes(passed=2)
    saved.stdout.fnmatch_lines([f"*graph baseline written to {baseline}*"])
    figures = json.loads(baseline.read_text())
    assert [(g["captured_size"], g["replays"]) for g in figures["graphs"]] == [(1, 3), (2, 3), (4, 3)]
    assert figures["source"] == {"what": "the test session (2 tests)", "backend": "eager",
                                 "saved_at": figures["source"]["saved_at"]}

    same = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-baseline={baseline}")
    assert same.ret == pytest.ExitCode.OK
    same.stdout.fnmatch_lines(["*SKIP capture time: not compared: the baseline and this run ran on the*",
                               "*OK: no regressions against*graph-baseline.json*"])

    pytester.makepyfile(test_session_graphs=GATE_SUITE.format(sizes=[1, 4]))
    report = pytester.path / "graph.xml"
    fewer = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-baseline={baseline}",
                               f"--graph-report={report}")
    fewer.assert_outcomes(passed=2)  # every test passed; the session fails on the regression
    assert fewer.ret == pytest.ExitCode.TESTS_FAILED
    fewer.stdout.fnmatch_lines(["*FAIL captured graphs*", "*missing: full tokens=2,reqs=2,uniform=1*",
                                "*FAILED: 1 regression(s) against*: captured graphs*"])
    cases = ET.parse(report).getroot().iter("testcase")
    assert [c.get("name") for c in cases if c.find("failure") is not None] == ["Captured graphs"]


def test_a_failing_session_writes_no_baseline(pytester: pytest.Pytester, plugin_args) -> None:
    baseline = pytester.path / "graph-baseline.json"
    broken = "\n\ndef test_broken():\n    assert False\n"
    pytester.makepyfile(test_session_graphs=GATE_SUITE.format(sizes=[1]) + broken)
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-save-baseline={baseline}")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*graph baseline NOT written: the session failed*"])
    assert not baseline.exists()


def test_an_unreadable_baseline_fails_the_session_with_a_message(
    pytester: pytest.Pytester, plugin_args
) -> None:
    pytester.makepyfile(test_session_graphs=GATE_SUITE.format(sizes=[1]))
    result = pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", "--graph-baseline=missing.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*graph baseline: cannot read the baseline*missing.json*"])


def test_a_violation_is_named_by_its_graph_and_its_stack_starts_at_the_test(
    pytester: pytest.Pytester, plugin_args
) -> None:
    # Recorded through the fixture (test_drifts) or raised in debug mode with no observer at all
    # (test_without_the_fixture): the same JUnit case, named by graph and input, and its stack
    # from the test function on, without the thirty frames of pytest and pluggy that called it.
    pytester.makepyfile(test_suite=SUITE)
    for options in ((), ("--graph-debug",)):
        report = pytester.path / "graph.xml"
        pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", *options, f"--graph-report={report}")
        cases = {case.get("name"): case.findtext("failure") or ""
                 for case in ET.parse(report).getroot().iter("testcase") if case.find("failure") is not None}
        tests = ["test_drifts", "test_without_the_fixture"] if options else ["test_drifts"]
        assert sorted(cases) == [
            f"test_suite.py::{test} address_drift: tokens=4,reqs=4,uniform=1 (full) in double, input scale"
            for test in tests
        ]
        for text in cases.values():
            stack = text.split("stack (most recent call last):\n", 1)[1]
            frames = re.findall(r'^  File "([^"]+)", line \d+, in (\S+)', stack, re.M)
            assert frames[0][0].endswith("test_suite.py") and frames[0][1].startswith("test_"), frames
            assert not [f for f, _ in frames if "_pytest" in f or "pluggy" in f], frames


def test_an_error_raised_for_no_violation_is_named_by_its_message(
    pytester: pytest.Pytester, plugin_args
) -> None:
    pytester.makepyfile(test_misuse="""
        import torch
        from capture_core.errors import GraphCacheError

        def test_misuse():
            raise GraphCacheError("wrapper 'double': the static buffers are too small for 64 tokens")
    """)
    report = pytester.path / "graph.xml"
    pytester.runpytest(*plugin_args, "-p", "no:cacheprovider", f"--graph-report={report}")
    [case] = [c for c in ET.parse(report).getroot().iter("testcase") if c.find("failure") is not None]
    assert case.get("name") == ("test_misuse.py::test_misuse graph_cache_error: wrapper 'double': the static "
                                "buffers are too small for 64 tokens")
