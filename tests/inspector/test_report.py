"""Reports and the `report` / `db` commands, run as real processes against real databases."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from workers import FULL, capture, drift

from capture_core.descriptor import BatchDescriptor
from capture_core.events import ViolationEvent, ViolationKind
from inspector.gating.report import build_report, render_json, render_junit, render_text
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store
from inspector.storage.writer import record_compile_event
from inspector.watch.watcher import CompileEvent, CompileEventKind
from tests.support.cli import cli


def _record(url: str, violations: bool, label: str = "") -> int:
    descriptor = BatchDescriptor(4, 4, True)
    with Recorder(url, label=label) as recorder:
        recorder.on_capture(capture(descriptor))
        for _ in range(10):
            recorder.on_replay(FULL, descriptor, 3)
        if violations:
            recorder.on_violation(drift(descriptor, actual=0xBEEF000))
            recorder.on_violation(drift(descriptor, actual=0xBEEF000))
            recorder.on_violation(
                ViolationEvent(
                    kind=ViolationKind.UNEXPECTED_CAPTURE,
                    descriptor=BatchDescriptor(32, None),
                    mode=FULL,
                    wrapper="model.forward",
                    message="unexpected capture of tokens=32",
                    injected=True,
                )
            )
    assert recorder.run_id is not None
    return recorder.run_id


def test_clean_database_reports_ok(db_url: str) -> None:
    _record(db_url, violations=False, label="clean")
    store = open_store(db_url, upgrade=False)
    report = build_report(store)
    store.dispose()
    assert report.ok and report.exit_code == 0
    figures = [(r.graphs, r.traffic.replays, r.traffic.num_real_tokens, r.traffic.padding_tokens)
               for r in report.runs]
    assert figures == [(1, 10, 30, 10)]
    assert "OK: no violations in 1 run(s)" in render_text(report)
    suite = ET.fromstring(render_junit(report)).find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    names = [case.get("name") or "" for case in suite.iter("testcase")]
    assert len(names) == 1 and names[0].endswith("no violations")


def test_torch_compile_re_records_are_reported_per_run_without_failing_it(db_url: str) -> None:
    run_id = _record(db_url, violations=False, label="compiled")
    store = open_store(db_url, upgrade=False)
    rerecord = CompileEvent(CompileEventKind.RERECORD, "static input data pointer changed.", "m", "forward")
    with store.engine.begin() as conn:
        for _ in range(4):
            record_compile_event(conn, run_id, rerecord)
    report = build_report(store)
    store.dispose()
    assert report.ok and report.exit_code == 0
    text = render_text(report)
    run_line = next(i for i, line in enumerate(text.splitlines()) if "'compiled'" in line)
    note = text.splitlines()[run_line + 1]
    assert note == "    torch.compile re-record in forward x4: static input data pointer changed."
    assert "OK: no violations in 1 run(s)" in text
    (event,) = json.loads(render_json(report))["compile_events"]
    assert event == {
        "kind": "compile_rerecord",
        "function": "forward",
        "reason": "static input data pointer changed.",
        "count": 4,
        "where": report.runs[0].name,
    }


def test_violations_become_failing_cases_naming_input_graph_and_addresses(db_url: str) -> None:
    run_id = _record(db_url, violations=True)
    store = open_store(db_url, upgrade=False)
    report = build_report(store)
    store.dispose()
    assert report.exit_code == 1
    drift_finding, capture_finding = report.findings
    assert (drift_finding.kind, drift_finding.count, drift_finding.input_name) == (
        "address_drift",
        2,
        "input_ids",
    )
    assert capture_finding.injected and capture_finding.kind == "unexpected_capture"
    root = ET.fromstring(render_junit(report))
    failures = [case.find("failure") for case in root.iter("testcase")]
    assert len(failures) == 2 and all(f is not None for f in failures)
    assert failures[0].get("type") == "address_drift"
    text = failures[0].text or ""
    assert "input_ids" in text and "0x7f000000" in text and "0xbeef000" in text and "tokens=4,reqs=4" in text
    assert "injected on purpose" in (failures[1].text or "")
    payload = json.loads(render_json(report))
    assert payload["ok"] is False and payload["runs"][0]["id"] == run_id
    assert payload["violations"][0]["actual_address"] == 0xBEEF000


def test_report_command_exit_codes_and_formats(tmp_path: Path) -> None:
    clean = f"sqlite:///{tmp_path / 'clean.db'}"
    dirty = f"sqlite:///{tmp_path / 'dirty.db'}"
    _record(clean, violations=False)
    dirty_run = _record(dirty, violations=True)
    _record(dirty, violations=False)

    ok = cli("report", "--db", clean)
    assert ok.returncode == 0, ok.stderr
    assert "OK: no violations" in ok.stdout

    failed = cli("report", "--db", dirty, "--format", "json")
    assert failed.returncode == 1, failed.stderr
    assert len(json.loads(failed.stdout)["violations"]) == 2

    clean_run = cli("report", "--db", dirty, "--run", str(dirty_run + 1))
    assert clean_run.returncode == 0, clean_run.stdout

    out = tmp_path / "report.xml"
    junit = cli("report", "--db", dirty, "--format", "junit", "--output", str(out))
    assert junit.returncode == 1
    assert str(out) in junit.stderr
    assert ET.parse(out).getroot().get("failures") == "2"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--db", "sqlite:///{tmp}/missing.db"], "no database at"),
        (["--db", "nonsense://"], "unsupported database URL"),
        (["--db", "sqlite:///{tmp}/notes.db"], "not a readable SQLite database"),
        (["--db", "sqlite:///{tmp}/ok.db", "--run", "999"], "no run 999"),
        (["--db", "sqlite:///{tmp}/ok.db", "--output", "{tmp}/no/such/dir/r.xml"], "cannot write the report"),
    ],
)
def test_report_command_errors_are_clear_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "notes.db").write_text("not a database\n" * 100)
    _record(f"sqlite:///{tmp_path / 'ok.db'}", violations=False)
    result = cli("report", *[a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_report_on_a_database_with_no_runs_exits_2(tmp_path: Path) -> None:
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    assert cli("db", "upgrade", "--db", empty).returncode == 0
    result = cli("report", "--db", empty, "--format", "junit", "--output", str(tmp_path / "r.xml"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"no runs recorded in {empty}: nothing to report" in result.stderr
    assert "OK" not in result.stdout + result.stderr and not (tmp_path / "r.xml").exists()


def test_report_usage_error_exits_2() -> None:
    result = cli("report", "--format", "yaml")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_db_upgrade_then_current(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert cli("db", "current", "--db", url).returncode == 2, "current never creates a database"
    upgraded = cli("db", "upgrade", "--db", url)
    assert upgraded.returncode == 0 and "(newest)" in upgraded.stdout
    current = cli("db", "current", "--db", url)
    assert current.returncode == 0 and "(newest)" in current.stdout


def test_report_on_an_old_schema_asks_for_an_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    store = open_store(url)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0001'")
    store.dispose()
    result = cli("report", "--db", url)
    assert result.returncode == 2 and "db upgrade" in result.stderr
    assert cli("db", "current", "--db", url).returncode == 1
