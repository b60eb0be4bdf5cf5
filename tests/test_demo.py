"""`graph-inspector demo` end to end, as a user runs it: a real subprocess into a real SQLite file."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_demo(*args: str, timeout: float = 240, debug: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAPH_INSPECTOR_DEBUG": "1" if debug else ""}
    return subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "demo", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    db = tmp_path_factory.mktemp("demo") / "demo.db"
    result = run_demo("--no-serve", "--steps", "60", "--backend", "eager", "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    return db, result


@pytest.mark.slow
def test_demo_records_graphs_replays_and_the_two_injected_faults(faulted_run) -> None:
    db, _ = faulted_run
    graphs = rows(db, "SELECT num_tokens, unexpected, backend FROM graphs")
    captured = sorted(n for n, unexpected, _ in graphs if not unexpected)
    assert captured == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {backend for _, _, backend in graphs} == {"eager"}
    totals = "SELECT SUM(replays), SUM(real_tokens), SUM(padded_tokens) FROM replay_windows"
    replays, real, padded = rows(db, totals)[0]
    assert replays >= 60
    assert real > 0 and padded > 0
    violations = rows(db, "SELECT kind, injected FROM violations ORDER BY kind")
    assert violations == [("address_drift", 1), ("unexpected_capture", 1)]
    run = rows(db, "SELECT backend, ended_at FROM runs")
    assert len(run) == 1 and run[0][0] == "eager" and run[0][1] is not None


@pytest.mark.slow
def test_demo_says_which_backend_and_prints_a_summary(faulted_run) -> None:
    _, result = faulted_run
    out = result.stdout
    assert "eager backend" in out
    for word in ("graphs", "hit ratio", "padding waste", "fallbacks", "violations", "injected faults"):
        assert word in out, f"summary lacks {word!r}:\n{out}"
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_demo_without_faults_records_no_violations_and_same_seed_same_traffic(tmp_path: Path) -> None:
    histograms = []
    for name in ("a", "b"):
        db = tmp_path / f"{name}.db"
        result = run_demo("--no-serve", "--no-faults", "--steps", "20", "--seed", "5", "--backend", "eager",
                          "--capture-sizes", "vllm", "--max-batch", "64", "--speedup", "40",
                          "--db", f"sqlite:///{db}")
        assert result.returncode == 0, explain(result)
        assert rows(db, "SELECT COUNT(*) FROM violations") == [(0,)]
        assert rows(db, "SELECT COUNT(*) FROM graphs WHERE unexpected") == [(0,)]
        sizes = [n for (n,) in rows(db, "SELECT num_tokens FROM graphs ORDER BY num_tokens")]
        assert sizes == [1, 2, 4, *range(8, 65, 8)]
        histograms.append(rows(db, "SELECT num_tokens, SUM(batches) FROM batch_size_counts "
                                   "GROUP BY num_tokens ORDER BY num_tokens"))
    assert histograms[0] == histograms[1]
    assert len(histograms[0]) > 3, "the batch size should change from step to step"
    assert "injected" not in result.stdout


@pytest.mark.slow
def test_debug_checks_raise_on_the_injected_drift_and_the_demo_still_finishes(tmp_path: Path) -> None:
    db = tmp_path / "debug.db"
    result = run_demo("--no-serve", "--steps", "12", "--backend", "eager", "--max-batch", "16",
                      "--speedup", "40", "--db", f"sqlite:///{db}", debug=True)
    assert result.returncode == 0, explain(result)
    assert "debug address checks are on" in result.stdout
    assert rows(db, "SELECT kind, injected FROM violations ORDER BY kind") == [
        ("address_drift", 1), ("unexpected_capture", 1)]
    assert rows(db, "SELECT config LIKE '%\"address_check\": \"debug\"%' FROM runs") == [(1,)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "many"], "--steps"),
        (["--speedup", "-1"], "--speedup"),
        (["--speedup", "1e9"], "--speedup"),
        (["--max-batch", "0"], "--max-batch"),
        (["--port", "70000"], "--port"),
    ],
)
def test_bad_arguments_exit_2_without_a_traceback(args: list[str], message: str) -> None:
    result = run_demo("--no-serve", *args, timeout=60)
    assert result.returncode == 2, explain(result)
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unwritable_database_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    result = run_demo("--no-serve", "--steps", "5", "--db", f"sqlite:///{blocker}/demo.db", timeout=60)
    assert result.returncode == 2, explain(result)
    assert "Traceback" not in result.stderr
    assert "demo.db" in result.stderr


def test_a_malformed_trace_exits_2_naming_the_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "mine.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.5,12,many\n")
    db = tmp_path / "t.db"
    result = run_demo("--no-serve", "--trace", str(trace), "--db", f"sqlite:///{db}", timeout=120)
    assert result.returncode == 2, explain(result)
    assert f"--trace: {trace}: line 2: GeneratedTokens must be an integer" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_your_own_trace_drives_the_demo(tmp_path: Path) -> None:
    trace = tmp_path / "mine.csv"
    lines = [f"2024-01-01 00:00:{i // 10:02d}.{i % 10}000000,100,{5 + i % 7}" for i in range(200)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
    db = tmp_path / "own.db"
    result = run_demo("--no-serve", "--no-faults", "--trace", str(trace), "--steps", "30",
                      "--max-batch", "16", "--speedup", "1", "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    assert "200 real requests (mine.csv)" in result.stdout
    assert rows(db, "SELECT SUM(replays) FROM replay_windows")[0][0] == 30


def test_a_busy_port_is_refused_before_any_work(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_demo("--port", str(port), "--db", f"sqlite:///{tmp_path / 'busy.db'}", timeout=60)
    assert result.returncode == 2, explain(result)
    assert f"127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Decoding" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "busy.db").exists()


@pytest.mark.slow
def test_ctrl_c_mid_run_keeps_what_was_recorded_and_ends_the_run(tmp_path: Path) -> None:
    db = tmp_path / "interrupted.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "demo", "--no-serve", "--steps", "100000",
         "--backend", "eager", "--max-batch", "32", "--db", f"sqlite:///{db}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if rows(db, "SELECT COUNT(*) FROM replay_windows")[0][0] > 0:
                    break
            except sqlite3.Error:
                pass  # not created or not migrated yet
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert "interrupted" in err and "Traceback" not in err
    (ended,) = rows(db, "SELECT ended_at FROM runs")[0]
    assert ended is not None
    assert rows(db, "SELECT SUM(replays) FROM replay_windows")[0][0] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_demo_serves_the_dashboard_until_interrupted(tmp_path: Path) -> None:
    db = tmp_path / "served.db"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "demo", "--steps", "5", "--backend", "eager",
         "--max-batch", "32", "--db", f"sqlite:///{db}", "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        body = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/api/summary", timeout=5) as response:
                    body = response.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert body is not None, "the dashboard never answered"
        assert '"ok": true' in body.replace('"ok":true', '"ok": true')
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert url in out
    assert "Traceback" not in err
