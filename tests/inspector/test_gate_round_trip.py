"""The regression gate end to end: real runs of the reference decoder recorded by the Recorder, a
baseline saved by `graph-inspector report --save-baseline`, and candidates judged by `report
--baseline`, as CI runs them.

Pool memory: the eager backend has no graph pool (0 bytes), so every run here is recorded through
``SharedPoolBackend`` (tests/support/engine.py), the eager backend reporting pool bytes the way one
shared CUDA graph pool grows, deterministically. The candidate's backend needs 30% more bytes per
token (what a heavier engine release would): everything else about the runs is real.
"""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from capture_core.runtime import UnexpectedCapturePolicy
from tests.support.cli import cli
from tests.support.engine import MIB, decode_run

SIZES = [1, 2, 4, 8, 16]
WITHOUT_8 = [1, 2, 4, 16]
# Decode traffic that never needs the 8-token graph (nothing between 5 and 8 tokens), so removing
# it changes nothing about padding: the regressions must be the missing graph and the memory only.
BATCHES = [1, 2, 3, 4, 12, 16, 9, 14, 2, 1] * 6
BYTES_PER_TOKEN = 8 * MIB
EIGHT = "full tokens=8,reqs=any,uniform=0"
"""The 8-token graph: the decode runner captures FULL graphs for any request count."""


def against(url: str, baseline: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("report", "--db", url, "--baseline", str(baseline), *args)


def _failed_cases(path: Path) -> dict[str, str]:
    """JUnit test case name -> failure text, for the gate's cases."""
    cases = ET.parse(path).getroot().iter("testcase")
    return {
        case.get("name", ""): (case.find("failure").text or "")  # type: ignore[union-attr]
        for case in cases
        if case.get("classname") == "graph-inspector.baseline" and case.find("failure") is not None
    }


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A run saved as a baseline file: its database URL and the file."""
    root = tmp_path_factory.mktemp("gate")
    url = f"sqlite:///{root / 'baseline.db'}"
    run_id = decode_run(url, SIZES, BATCHES, bytes_per_token=BYTES_PER_TOKEN, label="release 1")
    saved = cli("report", "--db", url, "--run", str(run_id), "--save-baseline", str(root / "baseline.json"))
    assert saved.returncode == 0, saved.stderr
    assert f"baseline of run {run_id} 'release 1' ({url}) written to {root / 'baseline.json'}" in saved.stderr
    return url, root / "baseline.json"


def test_the_baseline_file_holds_the_runs_figures(baseline: tuple[str, Path]) -> None:
    payload = json.loads(baseline[1].read_text())
    assert (payload["format"], payload["version"]) == ("graph-inspector baseline", 1)
    assert [g["captured_size"] for g in payload["graphs"]] == SIZES
    assert payload["summary"]["graphs"] == 5
    # The shared pool: the 16-token graph reserves 16 tokens' worth, the rest reuse it.
    assert payload["summary"]["pool_bytes"] == 16 * BYTES_PER_TOKEN + 5 * (64 << 10)
    assert payload["summary"]["never_replayed"] == [EIGHT]
    assert payload["traffic"]["replays"] == len(BATCHES) and payload["eager_fallbacks"] == {}


def test_a_run_missing_a_size_with_30_percent_more_pool_memory_fails_with_exactly_those_two(
    baseline: tuple[str, Path], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'candidate.db'}"
    decode_run(url, WITHOUT_8, BATCHES, bytes_per_token=int(BYTES_PER_TOKEN * 1.3), label="release 2")
    report = tmp_path / "graph-report.xml"
    result = against(url, baseline[1], "--format", "junit", "--output", str(report))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 regression(s)" in result.stderr
    failed = _failed_cases(report)
    assert set(failed) == {"Captured graphs", "Pool memory"}
    assert f"missing: {EIGHT} (captured size 8)" in failed["Captured graphs"]
    assert "+30.0%" in failed["Pool memory"] or "+29.9%" in failed["Pool memory"]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "2"

    text = against(url, baseline[1])
    assert text.returncode == 1
    assert "FAILED: 2 regression(s) against " in text.stdout
    assert text.stdout.splitlines()[-1].endswith(": captured graphs, pool memory")
    assert "OK: no violations in 1 run(s)" in text.stdout  # a regression is not a violation

    payload = json.loads(against(url, baseline[1], "--format", "json").stdout)
    verdicts = {c["name"]: c["verdict"] for c in payload["gate"]["comparisons"]}
    assert verdicts == {
        "captured_graphs": "regression", "graph_count": "pass", "pool_memory": "regression",
        "capture_time": "skipped", "padding_waste": "pass", "hit_ratio": "pass", "eager_fallbacks": "pass",
        "never_replayed": "pass",
    }
    assert payload["ok"] is False and payload["gate"]["regressions"] == 2


def test_an_identical_run_passes_against_the_file_the_database_and_the_run(
    baseline: tuple[str, Path], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'candidate.db'}"
    decode_run(url, SIZES, BATCHES, bytes_per_token=BYTES_PER_TOKEN, label="release 1 again")
    report = tmp_path / "graph-report.xml"
    for spec in (str(baseline[1]), baseline[0]):
        result = against(url, spec, "--format", "junit", "--output", str(report))
        assert result.returncode == 0, result.stdout + result.stderr
        assert _failed_cases(report) == {}
        names = [c.get("name") for c in ET.parse(report).getroot().iter("testcase")
                 if c.get("classname") == "graph-inspector.baseline"]
        assert names == ["Captured graphs", "Graph count", "Pool memory", "Capture time", "Padding waste",
                         "Hit ratio", "Eager fallbacks", "Graphs never replayed"]
    # A run of the same database as the baseline: the newest other run is the candidate.
    decode_run(baseline[0], SIZES, BATCHES, bytes_per_token=BYTES_PER_TOKEN, label="same database")
    same = against(baseline[0], "1")
    assert same.returncode == 0, same.stdout
    assert "Regression gate: run 2 'same database'" in same.stdout
    assert "against run 1 'release 1'" in same.stdout


def test_thresholds_from_a_file_and_flags_decide(baseline: tuple[str, Path], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'candidate.db'}"
    decode_run(url, SIZES, BATCHES, bytes_per_token=int(BYTES_PER_TOKEN * 1.3), label="heavier")
    assert against(url, baseline[1]).returncode == 1
    loose = tmp_path / "thresholds.toml"
    loose.write_text("[pool_memory]\nrelative = 0.5\nper_graph_relative = 0.5\n")
    assert against(url, baseline[1], "--thresholds", str(loose)).returncode == 0
    tight = against(url, baseline[1], "--thresholds", str(loose), "--threshold", "pool_memory.relative=0.2")
    assert tight.returncode == 1 and "total grew too much" in tight.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--baseline", "{tmp}/nothing.json"], "no such file"),
        (["--baseline", "{tmp}"], "is a directory, not a baseline file"),
        (["--baseline", "{tmp}/garbage.json"], "is not a graph-inspector baseline"),
        (["--baseline", "{tmp}/future.json"], "newer than this graph-inspector reads"),
        (["--baseline", "sqlite:///{tmp}/none.db"], "no database at"),
        (["--baseline", "424242"], "no run 424242"),
        (["--baseline", "{tmp}/garbage.json", "--baseline-run", "1"], "--baseline-run picks a run of a"),
        (["--baseline-run", "1"], "--baseline-run needs --baseline"),
        (["--threshold", "pool_memory.relative=1"], "give --baseline too"),
        (["--baseline", "1", "--threshold", "pool_memory.relativ=1"], "unknown threshold 'pool_memory.rel"),
        (["--baseline", "1", "--threshold", "hit_ratio.max_decrease=-1"], "must be a number >= 0"),
        (["--baseline", "1", "--threshold", "captured_graphs.allow_added=1"], "must be true or false"),
        (["--baseline", "1", "--threshold", "hit_ratio"], "takes NAME=VALUE"),
        (["--baseline", "1", "--thresholds", "{tmp}/t.yaml"], "TOML (.toml) or JSON (.json)"),
        (["--baseline", "1", "--thresholds", "{tmp}/bad.toml"], "is not valid TOML"),
        (["--baseline", "1", "--save-baseline", "{tmp}"], "cannot write the baseline"),
    ],
)
def test_gate_usage_errors_are_clear_and_exit_2(
    baseline: tuple[str, Path], tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "future.json").write_text(json.dumps({"format": "graph-inspector baseline", "version": 99}))
    (tmp_path / "t.yaml").write_text("pool_memory: {}\n")
    (tmp_path / "bad.toml").write_text("[pool_memory\n")
    result = cli("report", "--db", baseline[0], "--run", "1", *[a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr



def _remove_database(url: str) -> None:
    path = Path(url.removeprefix("sqlite:///"))
    for suffix in ("", "-wal", "-shm", ".losses"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def test_each_ci_run_records_a_fresh_database_at_the_baselines_url_and_is_judged(tmp_path: Path) -> None:
    # docs/regression-gate.md's flow: the baseline saved once from ci.db, then every CI run records
    # into a new ci.db (a fresh checkout) and gates it. Its run 1 is not the baseline's run 1.
    url = f"sqlite:///{tmp_path / 'ci.db'}"
    decode_run(url, SIZES, BATCHES, label="release 1")
    saved = cli("report", "--db", url, "--save-baseline", str(tmp_path / "base.json"))
    assert saved.returncode == 0, saved.stderr
    only_the_baseline = against(url, tmp_path / "base.json")
    assert only_the_baseline.returncode == 2, "the same database with no other run: nothing to judge"
    assert f"no runs recorded in {url} besides the baseline run" in only_the_baseline.stderr

    _remove_database(url)
    decode_run(url, SIZES, BATCHES, label="next CI run")
    same = against(url, tmp_path / "base.json")
    assert same.returncode == 0, same.stdout + same.stderr
    assert f"Regression gate: run 1 'next CI run' ({url}) against {tmp_path / 'base.json'}" in same.stdout

    _remove_database(url)
    decode_run(url, WITHOUT_8, BATCHES, label="a CI run that lost a size")
    report = tmp_path / "graph-report.xml"
    lost = against(url, tmp_path / "base.json", "--format", "junit", "--output", str(report))
    assert lost.returncode == 1, lost.stdout + lost.stderr
    assert set(_failed_cases(report)) == {"Captured graphs"}
    assert f"missing: {EIGHT} (captured size 8)" in _failed_cases(report)["Captured graphs"]


def _run_with_an_unexpected_capture(url: str) -> None:
    from inspector import Recorder
    from tests.support.engine import decode_engine, decode_step

    with Recorder(url, label="demo-like", job="") as recorder:
        runner = decode_engine(SIZES, recorder)
        runner.runtime.unexpected_capture = UnexpectedCapturePolicy.CAPTURE
        for num_tokens in BATCHES:
            decode_step(runner, num_tokens)
        planted = runner.inject_unexpected_capture()
    assert planted.captured_size not in SIZES


def test_a_baseline_saved_from_a_run_with_an_unexpected_capture_does_not_require_that_graph(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'faulty.db'}"
    _run_with_an_unexpected_capture(url)
    saved = cli("report", "--db", url, "--save-baseline", str(tmp_path / "base.json"))
    assert saved.returncode == 1, "the unexpected capture is a violation"
    assert "left out of the baseline: 1 graph(s) captured after start-up locked capture (full tokens=" in (
        saved.stderr)
    assert (f"the baseline was written to {tmp_path / 'base.json'} all the same (it holds the graphs, "
            "not the violations); the exit status 1 is for the violations above") in saved.stderr
    payload = json.loads((tmp_path / "base.json").read_text())
    assert [g["captured_size"] for g in payload["graphs"]] == SIZES

    clean = f"sqlite:///{tmp_path / 'clean.db'}"
    decode_run(clean, SIZES, BATCHES, label="the same engine, no fault")
    judged = against(clean, tmp_path / "base.json")
    assert judged.returncode == 0, judged.stdout
    assert "PASS captured graphs: 5 graph keys in the baseline, 5 now: 0 missing, 0 added" in judged.stdout


def _run_that_never_captured(url: str) -> None:
    """What the README's wrapper example did before it opened a capture phase: a runtime configured
    to capture FULL graphs, five batches, no capture phase."""
    from capture_core import BatchDescriptor, CUDAGraphMode, CUDAGraphWrapper, GraphRuntime
    from capture_core.forward_context import set_forward_context
    from inspector import Recorder

    with Recorder(url, label="no capture phase", job="") as recorder:
        runtime = GraphRuntime("eager", observer=recorder, progress=False)
        wrapped = CUDAGraphWrapper(lambda x: x * 2, runtime)
        static = torch.zeros(8)
        for size in (1, 2, 4, 8, 8):
            with set_forward_context(CUDAGraphMode.FULL, BatchDescriptor(size)):
                wrapped(static[:size])


NEVER_CAPTURED = ("captured no graph: its 5 batch(es) ran eagerly, before any capture phase. Graphs are "
                  "captured only inside `with runtime.capture_phase():` (a runner's capture() opens one)")


def test_a_run_that_captured_no_graph_is_warned_about_and_fails_the_gate(
    baseline: tuple[str, Path], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'eager.db'}"
    _run_that_never_captured(url)
    text = cli("report", "--db", url)
    assert text.returncode == 0, "a warning, not a violation"
    assert f"    warning: {NEVER_CAPTURED}" in text.stdout
    assert "no graph backend (nothing captured) on cpu" in text.stdout  # not 'unknown on cpu'
    payload = json.loads(cli("report", "--db", url, "--format", "json").stdout)
    assert payload["runs"][0]["warnings"] == [NEVER_CAPTURED]
    cli("report", "--db", url, "--format", "junit", "--output", str(tmp_path / "r.xml"))
    [case] = ET.parse(tmp_path / "r.xml").getroot().iter("testcase")
    assert case.findtext("system-out") == f"warning: {NEVER_CAPTURED}"

    # A baseline saved from such a run requires no graph; the next run like it fails all the same.
    saved = cli("report", "--db", url, "--save-baseline", str(tmp_path / "empty.json"))
    assert saved.returncode == 0
    assert f"the baseline holds no graph: run 1 'no capture phase' ({url}) {NEVER_CAPTURED}" in saved.stderr
    next_run = f"sqlite:///{tmp_path / 'next.db'}"
    _run_that_never_captured(next_run)
    for against_what in (baseline[1], tmp_path / "empty.json"):
        judged = against(next_run, against_what, "--format", "junit", "--output", str(tmp_path / "gate.xml"))
        assert judged.returncode == 1, judged.stderr
        failed = _failed_cases(tmp_path / "gate.xml")
        assert f"run 1 'no capture phase' ({next_run}) {NEVER_CAPTURED}" in failed["Captured graphs"]
