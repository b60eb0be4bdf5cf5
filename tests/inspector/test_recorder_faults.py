"""The recorder when the database misbehaves: it never raises into the engine, and loses nothing it
could keep. Real locks, real permissions, real deleted files, real processes and a real SIGKILL."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import workers
from sqlalchemy import func, select
from workers import FULL, capture, child_env, drift, fetch_rows

from capture_core.descriptor import BatchDescriptor
from inspector.recording.recorder import Recorder
from inspector.storage.models import Graph, ReplayTotal, ReplayWindow, Run, Violation
from inspector.storage.store import open_store

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def test_locked_database_is_waited_out_without_loss(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    url = f"sqlite:///{path}"
    descriptor = BatchDescriptor(4, 4, True)
    recorder = Recorder(url, flush_interval=0.05).start()
    locker = sqlite3.connect(path, timeout=0, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        recorder.on_capture(capture(descriptor))
        recorder.on_violation(drift(descriptor, actual=0x9000))
        for _ in range(1000):
            recorder.on_replay(FULL, descriptor, 3)
        assert recorder.flush(timeout=0.5) is False, "nothing can commit while another process holds the lock"
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert recorder.flush(timeout=20)
    recorder.close()
    assert recorder.dropped == 0
    assert fetch_rows(url, select(func.sum(ReplayWindow.replays)))[0][0] == 1000
    assert fetch_rows(url, select(Violation.actual_address))[0][0] == 0x9000
    assert fetch_rows(url, select(func.count()).select_from(Graph))[0][0] == 1


def test_a_close_that_stops_waiting_counts_what_the_thread_held_and_the_thread_writes_none_of_it(
    tmp_path: Path,
) -> None:
    # The lock is held from before close() until after it returns, and close() waits 0.1 s for a
    # flush thread whose write waits up to SQLite's busy timeout (5 s) for the lock: close() gives
    # up on it, every time. What the thread held must be counted then, and never written after.
    path = tmp_path / "held.db"
    url = f"sqlite:///{path}"
    descriptor = BatchDescriptor(4, 4, True)
    recorder = Recorder(url, flush_interval=0.05, close_timeout=0.2).start()
    recorder.on_capture(capture(descriptor))
    for _ in range(100):
        recorder.on_replay(FULL, descriptor, 3)
    assert recorder.flush(timeout=20)
    locker = sqlite3.connect(path, timeout=0, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        for _ in range(1000):
            recorder.on_replay(FULL, descriptor, 3)
        recorder.on_violation(drift(descriptor, actual=0x9000))
        recorder.close(timeout=0.1)
        counted = recorder.losses
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert (counted.replays, counted.violations, counted.events) == (1000, 1, 1001)
    recorder._thread.join(timeout=30)  # the lock is free: the thread's write gets through, or would
    assert not recorder._thread.is_alive()
    assert fetch_rows(url, select(func.sum(ReplayTotal.replays)))[0][0] == 100, "written and counted"
    assert fetch_rows(url, select(func.count()).select_from(Violation))[0][0] == 0
    assert recorder.losses.events == 1001
    sidecar = [json.loads(line) for line in path.with_name("held.db.losses").read_text().splitlines()]
    assert sidecar[-1]["losses"]["replays"] == 1000 and sidecar[-1]["losses"]["violations"] == 1


def test_start_while_locked_returns_and_writes_the_run_once_unlocked(tmp_path: Path) -> None:
    path = tmp_path / "locked-at-start.db"
    url = f"sqlite:///{path}"
    open_store(url).dispose()
    locker = sqlite3.connect(path, timeout=0, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        recorder = Recorder(url, flush_interval=0.05).start()  # waits out the busy timeout, then goes on
        assert recorder.run_id is None and "locked" in (recorder.last_error or "")
        recorder.on_violation(drift(BatchDescriptor(1, 1, True), actual=0x1000))
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert recorder.flush(timeout=20)
    recorder.close()
    assert recorder.run_id is not None and recorder.dropped == 0
    assert fetch_rows(url, select(func.count()).select_from(Violation))[0][0] == 1


def test_events_beyond_the_pending_bound_are_counted_and_reported_once_writable(tmp_path: Path) -> None:
    path = tmp_path / "overflow.db"
    url = f"sqlite:///{path}"
    descriptor = BatchDescriptor(4, 4, True)
    recorder = Recorder(url, flush_interval=0.05, max_pending=2).start()
    locker = sqlite3.connect(path, timeout=0, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        for i in range(5):
            recorder.on_violation(drift(descriptor, actual=0x1000 * (i + 1)))
            time.sleep(0.05)  # let the flush thread drain the queue into its (bounded) pending set
        deadline = time.monotonic() + 10
        while recorder.dropped < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert recorder.flush(timeout=20)
    recorder.close()
    assert recorder.dropped == 3
    assert fetch_rows(url, select(func.count()).select_from(Violation))[0][0] == 2
    assert fetch_rows(url, select(Run.dropped_events))[0][0] == 3


UNWRITABLE_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from workers import FULL, capture, drift
from capture_core.descriptor import BatchDescriptor
from inspector.recording.recorder import Recorder
d = BatchDescriptor(4, 4, True)
recorder = Recorder(sys.argv[1], flush_interval=0.05, close_timeout=1.0).start()
recorder.on_capture(capture(d))
recorder.on_violation(drift(d, actual=0x7000))
for _ in range(100):
    recorder.on_replay(FULL, d, 3)
recorder.close()
print(json.dumps({"dropped": recorder.dropped, "error": recorder.last_error}))
"""


def _without_root_powers(argv: list[str]) -> list[str]:
    """Root ignores file permissions; drop the capabilities that let it (as CI runs as root)."""
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file permissions cannot be enforced")
    caps = "-dac_override,-dac_read_search,-fowner"
    return [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", "--", *argv]


def test_unwritable_database_never_raises_and_counts_what_it_dropped(tmp_path: Path) -> None:
    folder = tmp_path / "readonly"
    folder.mkdir()
    path = folder / "ro.db"
    open_store(f"sqlite:///{path}").dispose()
    for leftover in folder.glob("ro.db-*"):
        leftover.unlink()
    path.chmod(0o444)
    folder.chmod(0o555)
    try:
        result = subprocess.run(
            _without_root_powers([sys.executable, "-c", UNWRITABLE_CHILD, f"sqlite:///{path}"]),
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
            cwd=REPO,
        )
    finally:
        folder.chmod(0o755)
        path.chmod(0o644)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # Counted as the engine reported them: the capture, the violation and the 100 replays.
    assert report["dropped"] == 102, result.stderr
    assert "cannot write" in result.stderr and "dropped" in result.stderr
    assert fetch_rows(f"sqlite:///{path}", select(func.count()).select_from(Violation))[0][0] == 0


def test_vanished_database_file_is_recreated_and_recording_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "vanishing.db"
    url = f"sqlite:///{path}"
    descriptor = BatchDescriptor(8, 8, True)
    recorder = Recorder(url, flush_interval=0.05).start()
    recorder.on_capture(capture(descriptor))
    assert recorder.flush(timeout=10)
    for leftover in tmp_path.glob("vanishing.db*"):
        leftover.unlink()
    for _ in range(10):
        recorder.on_replay(FULL, descriptor, 8)
    recorder.on_violation(drift(descriptor, actual=0x4000))
    assert recorder.flush(timeout=20)
    recorder.close()
    assert "vanished" in caplog.text
    assert path.exists()
    assert fetch_rows(url, select(func.count()).select_from(Graph))[0][0] == 1, "known graphs are re-recorded"
    assert fetch_rows(url, select(ReplayWindow.replays, ReplayWindow.graph_id.is_not(None)))[0] == (10, True)
    assert fetch_rows(url, select(func.count()).select_from(Violation))[0][0] == 1
    assert recorder.dropped == 0


def test_vanished_directory_drops_with_a_count_and_never_raises(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    recorder = Recorder(f"sqlite:///{folder / 'x.db'}", flush_interval=0.05, close_timeout=0.5).start()
    assert recorder.flush(timeout=10)
    shutil.rmtree(folder)
    descriptor = BatchDescriptor(2, 2, True)
    recorder.on_violation(drift(descriptor, actual=0x3000))
    for _ in range(5):
        recorder.on_replay(FULL, descriptor, 1)
    assert recorder.flush(timeout=0.5) is False
    recorder.close()
    assert recorder.dropped == 6  # the violation and the 5 replays
    assert "does not exist" in (recorder.last_error or "")


def test_folder_that_comes_back_gets_a_new_database_with_the_known_graphs(tmp_path: Path) -> None:
    folder = tmp_path / "flaky"
    folder.mkdir()
    url = f"sqlite:///{folder / 'x.db'}"
    descriptor = BatchDescriptor(2, 2, True)
    recorder = Recorder(url, flush_interval=0.05).start()
    recorder.on_capture(capture(descriptor))
    assert recorder.flush(timeout=10)
    shutil.rmtree(folder)
    recorder.on_replay(FULL, descriptor, 1)
    assert recorder.flush(timeout=0.3) is False
    folder.mkdir()
    assert recorder.flush(timeout=20)
    recorder.close()
    assert recorder.dropped == 0
    assert fetch_rows(url, select(Graph.captured_size))[0][0] == 2
    assert fetch_rows(url, select(ReplayWindow.replays, ReplayWindow.graph_id.is_not(None)))[0] == (1, True)


def test_a_malformed_event_is_dropped_and_recording_goes_on(sqlite_url: str) -> None:
    descriptor = BatchDescriptor(2, 2, True)
    with Recorder(sqlite_url, flush_interval=0.05) as recorder:
        recorder.on_violation(object())  # type: ignore[arg-type]
        recorder.on_violation(drift(descriptor, actual=0x5000))
        assert recorder.flush(timeout=10)
    assert recorder.dropped == 1
    assert fetch_rows(sqlite_url, select(Violation.actual_address))[0][0] == 0x5000


EXITING_CHILD = """
import sys
from workers import FULL, capture, drift
from capture_core.descriptor import BatchDescriptor
from inspector.recording.recorder import Recorder
d = BatchDescriptor(4, 4, True)
recorder = Recorder(sys.argv[1], flush_interval=3600).start()
recorder.on_capture(capture(d))
for _ in range(100):
    recorder.on_replay(FULL, d, 3)
recorder.on_violation(drift(d, actual=0x7000))
sys.exit(0)  # no close(): the exit hook must flush
"""


def test_process_exit_without_close_flushes_the_last_window(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'exit.db'}"
    result = subprocess.run(
        [sys.executable, "-c", EXITING_CHILD, url],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert fetch_rows(url, select(func.sum(ReplayWindow.replays)))[0][0] == 100
    assert fetch_rows(url, select(func.count()).select_from(Violation))[0][0] == 1
    assert fetch_rows(url, select(Run.ended_at))[0][0] is not None


@pytest.mark.slow
def test_four_processes_recording_into_one_database_lose_nothing(db_url: str) -> None:
    context = multiprocessing.get_context("spawn")
    replays_per_size, violations = 400, 25
    with context.Pool(4) as pool:
        results = pool.starmap(
            workers.record_traffic, [(db_url, rank, replays_per_size, violations) for rank in range(4)]
        )
    assert [r["dropped"] for r in results] == [0, 0, 0, 0]
    runs = fetch_rows(db_url, select(Run.id, Run.rank, Run.ended_at).order_by(Run.rank))
    assert [r.rank for r in runs] == [0, 1, 2, 3] and all(r.ended_at for r in runs)
    for run in runs:
        replays = fetch_rows(
            db_url, select(func.sum(ReplayWindow.replays)).where(ReplayWindow.run_id == run.id)
        )
        totals = fetch_rows(db_url, select(func.sum(ReplayTotal.replays)).where(ReplayTotal.run_id == run.id))
        found = fetch_rows(
            db_url, select(func.count(), func.sum(Violation.count)).where(Violation.run_id == run.id)
        )
        graphs = fetch_rows(db_url, select(func.count()).select_from(Graph).where(Graph.run_id == run.id))
        assert replays[0][0] == totals[0][0] == replays_per_size * len(workers.SIZES)
        assert tuple(found[0]) == (violations, violations)
        assert graphs[0][0] == len(workers.SIZES)


@pytest.mark.slow
def test_sigkill_keeps_everything_flushed_before_it(db_url: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "workers.py"), db_url, str(ledger)],
        env=child_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            if ledger.exists() and len(ledger.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        assert child.poll() is None, child.stderr.read().decode()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    committed = json.loads(ledger.read_text().splitlines()[-1])
    store = open_store(db_url)  # the database still opens (and is still at head) after the kill
    store.dispose()
    violations = fetch_rows(db_url, select(func.count(), func.sum(Violation.count)))[0]
    replays = fetch_rows(db_url, select(func.sum(ReplayWindow.replays)))[0][0]
    totals = fetch_rows(db_url, select(func.sum(ReplayTotal.replays)))[0][0]
    assert violations[0] >= committed["violations"] and violations[0] == violations[1]
    assert replays >= committed["replays"]
    assert replays == totals, "windows and running totals are written in one transaction"
    assert fetch_rows(db_url, select(Run.ended_at))[0][0] is None, "a killed run never ended"
    if db_url.startswith("sqlite"):
        integrity = fetch_rows(db_url, select(func.count()).select_from(Run))
        assert integrity[0][0] == 1
