"""The SQLite file going wrong under running processes: deleted while a flush waits for the lock,
made immutable (``chattr +i``, as root), corrupted in one page. Nothing is committed into a deleted
file, the engine never dies, and a corrupt file is refused by every consumer and left byte for byte
as it was. A path that is no file at all (a symlink loop, a directory, a FIFO, a socket, a device)
is refused by every command in one line, with nothing made beside it; `serve` refuses a missing
file unless asked to create it. Real files, real locks, real processes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from workers import FULL, REPO, capture, child_env, drift, fetch_rows, locked

from capture_core.descriptor import BatchDescriptor
from dashboard.cli import main
from inspector.errors import DatabaseError
from inspector.recording.losses import sidecar_path
from inspector.recording.recorder import Recorder
from inspector.storage.models import Graph, ReplayWindow, Run, Violation
from inspector.storage.store import StoreVanished, open_store
from inspector.storage.writer import RunInfo, insert_run
from tests.support.installed import Program
from tests.support.sample import seed_bulk


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------ deleted files


@pytest.mark.parametrize("replaced", [False, True], ids=["deleted", "replaced"])
def test_a_file_deleted_while_a_flush_waits_for_the_lock_is_written_again(
    tmp_path: Path, replaced: bool
) -> None:
    path = tmp_path / "deleted.db"
    url = f"sqlite:///{path}"
    descriptor = BatchDescriptor(4, 4, True)
    recorder = Recorder(url, flush_interval=3600).start()
    recorder.on_capture(capture(descriptor))
    assert recorder.flush(timeout=20)
    with locked(path):
        for _ in range(1000):
            recorder.on_replay(FULL, descriptor, 3)
        recorder.on_violation(drift(descriptor, actual=0x9000))
        assert recorder.flush(timeout=0.5) is False, "the flush waits on the lock (busy timeout)"
        for leftover in tmp_path.glob("deleted.db*"):
            leftover.unlink()
        if replaced:  # another process made a new database at the path meanwhile
            open_store(url).dispose()
    assert recorder.flush(timeout=30)
    recorder.close()
    assert recorder.dropped == 0
    assert fetch_rows(url, select(func.sum(ReplayWindow.replays)))[0][0] == 1000
    assert fetch_rows(url, select(Violation.actual_address)) == [(0x9000,)]
    graphs = fetch_rows(url, select(func.count()).select_from(Graph))[0][0]
    assert graphs == 1, "the known graph is sent again into the new file"


def test_a_commit_into_a_file_deleted_meanwhile_is_not_taken_as_written(tmp_path: Path) -> None:
    path = tmp_path / "gone-at-commit.db"
    store = open_store(f"sqlite:///{path}")
    try:
        with pytest.raises(StoreVanished, match="while a transaction committed"), store.writer() as conn:
            insert_run(conn, RunInfo("lost", "h", 1, "p", 0, 1, "cpu", "{}", 1.0), now=1.0)
            for leftover in tmp_path.glob("gone-at-commit.db*"):
                leftover.unlink()
    finally:
        store.dispose()


# ---------------------------------------------------------------------------------- immutable files


IMMUTABLE_CHILD = """
import json, logging, os, subprocess, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from workers import FULL, capture, drift
from capture_core.descriptor import BatchDescriptor
from inspector.recording.recorder import Recorder
path = sys.argv[1]
d = BatchDescriptor(4, 4, True)
recorder = Recorder(f"sqlite:///{path}", flush_interval=0.05, close_timeout=1.0).start()
recorder.on_capture(capture(d))
for _ in range(100):
    recorder.on_replay(FULL, d, 3)
assert recorder.flush(timeout=20), recorder.last_error
files = [p for p in (path, path + "-wal", path + "-shm") if os.path.exists(p)]
subprocess.run(["chattr", "+i", *files], check=True)
for i in range(50):
    for _ in range(100):
        recorder.on_replay(FULL, d, 3)
    recorder.on_violation(drift(d, actual=0x1000 + i))
    time.sleep(0.01)
flushed = recorder.flush(timeout=2)
recorder.close()
print(json.dumps({"flushed": flushed, "losses": recorder.losses.as_dict(), "files": files}))
"""


def _chattr_works(probe: Path) -> str | None:
    """Why ``chattr +i`` cannot be tested here (None when it can)."""
    if os.geteuid() != 0:
        return "making a file immutable (chattr +i) needs root (CI runs as root)"
    if shutil.which("chattr") is None:
        return "no chattr (e2fsprogs) on this machine"
    probe.write_text("probe")
    result = subprocess.run(["chattr", "+i", str(probe)], capture_output=True, text=True)
    if result.returncode != 0:
        return f"this filesystem has no immutable flag: {result.stderr.strip()}"
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    return None


def test_immutable_database_files_never_kill_the_engine(tmp_path: Path) -> None:
    """Database, WAL and shared-memory index made immutable mid-run, through close() and exit: the
    index is written through a memory mapping, and a write there would be SIGBUS. The process
    lives, and counts the events it could not keep."""
    reason = _chattr_works(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    path = tmp_path / "immutable.db"
    try:
        result = subprocess.run([sys.executable, "-c", IMMUTABLE_CHILD, str(path)], capture_output=True,
                                text=True, timeout=300, env=child_env(), cwd=REPO)
    finally:
        subprocess.run(["chattr", "-i", *map(str, tmp_path.glob("immutable.db*"))], check=False)
    died = signal.Signals(-result.returncode).name if result.returncode < 0 else ""
    assert result.returncode == 0, f"{died}\n{result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["flushed"] is False
    assert report["losses"] == {"events": 5050, "captures": 0, "violations": 50, "replays": 5000,
                                "eager_batches": 0, "real_tokens": 15000, "unclassified": 0}
    assert "cannot be written (read-only, or immutable)" in result.stderr
    line = json.loads(sidecar_path(path).read_text().splitlines()[-1])
    assert line["losses"]["replays"] == 5000 and line["run_id"] == 1
    assert fetch_rows(f"sqlite:///{path}", select(func.sum(ReplayWindow.replays)))[0][0] == 100


# ------------------------------------------------------------------------------------ corrupt files


def _corrupt_database(path: Path) -> str:
    """A real database (a few thousand windows, graphs and violations, in WAL mode as recorders
    leave it) with garbage written over one leaf page of the replay windows; its digest."""
    store = open_store(f"sqlite:///{path}")
    seed_bulk(store, now=time.time(), graphs=50, windows=20_000, violations=500, runs=5)
    store.dispose()
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        try:
            (page,) = conn.execute(
                "SELECT pageno FROM dbstat WHERE name = 'replay_windows' AND pagetype = 'leaf' "
                "LIMIT 1 OFFSET 10"
            ).fetchone()
        except sqlite3.OperationalError as error:
            pytest.skip(f"this SQLite has no dbstat table to find a leaf page with ({error})")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()
    with open(path, "r+b") as f:
        f.seek((page - 1) * page_size + 8)  # past the page header: the cell pointers and cells
        f.write(b"\xde\xad\xbe\xef" * 64)
    return _digest(path)


@pytest.fixture(scope="module")
def corrupt_copy(tmp_path_factory: pytest.TempPathFactory):
    """A fresh copy of one corrupt database for each test."""
    original = tmp_path_factory.mktemp("corrupt") / "original.db"
    digest = _corrupt_database(original)
    counter = iter(range(1000))

    def copy() -> tuple[Path, str]:
        target = original.with_name(f"copy-{next(counter)}.db")
        shutil.copyfile(original, target)
        return target, digest

    return copy


@pytest.mark.parametrize(
    "command",
    [["db", "upgrade"], ["report"], ["report", "--format", "json"], ["serve", "--port", "0"],
     ["demo", "--no-serve", "--backend", "eager", "--steps", "5"], ["db", "prune", "--older-than", "1h"],
     ["db", "current"], ["advise"]],
    ids=["db upgrade", "report", "report json", "serve", "demo", "db prune", "db current", "advise"],
)
def test_every_command_refuses_a_corrupt_file_in_one_line_and_leaves_it_untouched(
    corrupt_copy, command: list[str]
) -> None:
    path, digest = corrupt_copy()
    program = Program.under_test()
    result = subprocess.run([*program.argv, *command, "--db", f"sqlite:///{path}"], capture_output=True,
                            text=True, timeout=300, env=program.env, cwd=program.cwd)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is corrupt: SQLite's quick_check found" in lines[0], result.stderr
    assert "left untouched" in lines[0] and result.stdout == ""
    assert _digest(path) == digest


def test_a_recorder_on_a_corrupt_file_logs_counts_and_never_writes(
    corrupt_copy, caplog: pytest.LogCaptureFixture
) -> None:
    path, digest = corrupt_copy()
    descriptor = BatchDescriptor(4, 4, True)
    with caplog.at_level(logging.ERROR, logger="graph_inspector.recorder"):
        recorder = Recorder(f"sqlite:///{path}", flush_interval=0.05, close_timeout=0.5).start()
        recorder.on_capture(capture(descriptor))
        for _ in range(300):
            recorder.on_replay(FULL, descriptor, 3)
        recorder.on_violation(drift(descriptor, actual=0x1234))
        assert recorder.flush(timeout=1) is False
        recorder.close()
    assert recorder.losses.as_dict() == {"events": 302, "captures": 1, "violations": 1, "replays": 300,
                                         "eager_batches": 0, "real_tokens": 900, "unclassified": 0}
    corrupt_lines = [r.getMessage() for r in caplog.records if "quick_check found" in r.getMessage()]
    assert len(corrupt_lines) == 1 and "nothing more is written to it" in corrupt_lines[0], caplog.text
    assert _digest(path) == digest
    assert json.loads(sidecar_path(path).read_text().splitlines()[-1])["losses"]["replays"] == 300


def test_a_sound_file_still_opens_after_the_check(tmp_path: Path) -> None:
    path = tmp_path / "sound.db"
    store = open_store(f"sqlite:///{path}")
    seed_bulk(store, now=time.time(), graphs=10, windows=1_000, violations=10, runs=2)
    store.dispose()
    assert len(fetch_rows(f"sqlite:///{path}", select(Run.id))) == 2
    open_store(f"sqlite:///{path}", upgrade=False).dispose()


# ------------------------------------------------------------------- paths that are not database files


def _not_a_file(tmp_path: Path, kind: str) -> Path:
    """A path in ``tmp_path`` that is ``kind``: a symlink loop, a directory, a FIFO, a socket or a
    character device (the null device's numbers, made with mknod: root only)."""
    path = tmp_path / "inspector.db"
    if kind == "symlink loop":
        os.symlink(tmp_path / "other.db", path)
        os.symlink(path, tmp_path / "other.db")
    elif kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    elif kind == "character device":
        if os.geteuid() != 0:
            pytest.skip("making a character device (mknod) needs root (CI runs as root)")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    return path


NOT_FILES = ["symlink loop", "directory", "FIFO", "socket", "character device"]
PATH_COMMANDS = {
    "db upgrade": ["db", "upgrade"], "db current": ["db", "current"],
    "db prune": ["db", "prune", "--older-than", "1h"], "report": ["report"], "advise": ["advise"],
    "serve": ["serve", "--port", "0"], "serve --create": ["serve", "--create", "--port", "0"],
    "serve --get": ["serve", "--get", "/healthz"],
    "demo": ["demo", "--no-serve", "--backend", "eager", "--steps", "5"],
    "watch": ["watch", "--", sys.executable, "-c", "pass"],
}


@pytest.mark.parametrize("kind", NOT_FILES)
def test_every_command_refuses_a_path_that_is_not_a_file_in_one_line_and_makes_nothing_beside_it(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _not_a_file(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    for name, command in PATH_COMMANDS.items():
        at = command.index("--") if "--" in command else len(command)  # watch's command follows '--'
        assert main([*command[:at], "--db", f"sqlite:///{path}", *command[at:]]) == 2, name
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and kind in lines[0] and "not a database file" in lines[0], (name, err)
        assert out == "" or name == "demo", (name, out)
        assert sorted(os.listdir(tmp_path)) == before, f"{name} made {sorted(os.listdir(tmp_path))}"


@pytest.mark.parametrize("kind", NOT_FILES)
def test_a_recorder_refuses_a_path_that_is_not_a_file(tmp_path: Path, kind: str) -> None:
    path = _not_a_file(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(DatabaseError, match=f"is an? {kind}.*, not a database file"):
        Recorder(f"sqlite:///{path}").start()
    assert sorted(os.listdir(tmp_path)) == before


def test_serve_refuses_a_missing_file_unless_asked_to_create_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mistyped.db"
    for command in (["serve", "--port", "0"], ["serve", "--get", "/healthz"]):
        assert main([*command, "--db", f"sqlite:///{path}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"no database at {path}" in lines[0] and "--create" in lines[0], lines
        assert os.listdir(tmp_path) == []
    assert main(["serve", "--create", "--get", "/healthz", "--db", f"sqlite:///{path}"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["schema"]["revision"] is not None
    assert path.is_file()
