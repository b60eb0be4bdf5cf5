"""Recorders across fork() and spawn (``inspector.recording.forks``): a recorder a forked child
inherits records the child as a run of its own; a recorder the child starts always works, even
when the parent was mid-flush at the fork; one forked mid-write past the wait says once that it is
inert and counts what it drops; nothing a child reports is lost without a count, with children
started by ``multiprocessing`` (which end with ``os._exit``), forked and spawned. Real processes, a
real SQLite file and a real PostgreSQL."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading

import pytest
from sqlalchemy import func, select
from workers import fetch_rows

from inspector.recording import forks
from inspector.recording.recorder import Recorder
from inspector.storage.models import ReplayWindow, Run, StepTime
from tests.support import forking
from tests.support.forking import (
    DESCRIPTOR,
    OWN_LABEL,
    PARENT_LABEL,
    Busy,
    accounts,
    reported,
    slow_writes,
    start_children,
)
from tests.support.recording import FULL

EVENTS = 10_000


@pytest.fixture
def parent(db_url: str):
    """The parent's recorder, flushing every 10 ms while a thread reports to it, inherited by the
    children it forks."""
    recorder = Recorder(db_url, label=PARENT_LABEL, flush_interval=0.01).start()
    forking.inherited = recorder
    busy = Busy(recorder)
    yield recorder, busy
    forking.inherited = None
    busy.stop()
    recorder.close()


def _join(processes: list) -> dict[int, int]:
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0] * len(processes)
    return {p.pid: 2 * reported(EVENTS) for p in processes}


def test_a_recorder_a_forked_child_inherits_records_it_as_a_run_of_its_own(db_url: str, parent,
                                                                            caplog) -> None:
    recorder, busy = parent
    with caplog.at_level(logging.WARNING, logger="graph_inspector.recorder"):
        children = start_children("fork", 4, db_url, EVENTS)
        by_pid = _join(children)
        parent_replays = busy.stop()
        recorder.close()
    for pid, account in accounts(db_url, by_pid).items():
        assert account.runs == {PARENT_LABEL: 1, OWN_LABEL: 1}, pid
        assert (account.recorded, account.dropped) == (account.reported, 0), (pid, account)
    parent_run = select(func.sum(ReplayWindow.replays)).join(Run, Run.id == ReplayWindow.run_id)
    [(parent_run_replays,)] = fetch_rows(db_url, parent_run.where(Run.pid == os.getpid()))
    assert parent_run_replays == parent_replays, "the parent's run holds its own events, and no child's"
    assert recorder.dropped == 0
    troubles = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert not troubles, "the parent's connections survived its children"


def test_a_child_s_own_recorder_works_though_the_parent_was_mid_flush_at_the_fork(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'mid-flush.db'}"
    recorder = Recorder(url, label=PARENT_LABEL, flush_interval=0.05).start()
    forking.inherited = recorder
    armed, entered = threading.Event(), threading.Event()
    try:
        with slow_writes(1.0, armed, entered):
            busy = Busy(recorder)
            armed.set()
            assert entered.wait(30), "the parent's flush never wrote"
            children = start_children("fork", 2, url, EVENTS)  # forked while the write lock is held
            by_pid = _join(children)
            busy.stop()
    finally:
        forking.inherited = None
        recorder.close()
    for pid, account in accounts(url, by_pid).items():
        assert account.runs == {PARENT_LABEL: 1, OWN_LABEL: 1}, pid
        assert (account.recorded, account.dropped) == (account.reported, 0), (pid, account)


def test_a_recorder_forked_mid_write_past_the_wait_is_inert_in_the_child_and_counts_what_it_drops(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(forks, "FORK_WAIT_S", 0.2)
    url = f"sqlite:///{tmp_path / 'stuck.db'}"
    recorder = Recorder(url, label=PARENT_LABEL, flush_interval=0.05).start()
    forking.inherited = recorder
    armed, entered = threading.Event(), threading.Event()
    to_stderr = logging.StreamHandler(sys.stderr)  # the child's log, where capfd reads it
    logging.getLogger("graph_inspector.recorder").addHandler(to_stderr)
    try:
        with slow_writes(3.0, armed, entered):
            busy = Busy(recorder)
            armed.set()
            assert entered.wait(30)
            [child] = start_children("fork", 1, url, EVENTS, close_timeout=0.5)
            by_pid = _join([child])
            busy.stop()
    finally:
        logging.getLogger("graph_inspector.recorder").removeHandler(to_stderr)
        forking.inherited = None
        recorder.close()
    err = capfd.readouterr().err
    inert = [line for line in err.splitlines() if "records nothing in this process" in line]
    assert len(inert) == 1 and f"process {child.pid} was forked from {os.getpid()}" in inert[0], err
    [account] = accounts(url, by_pid).values()
    assert account.unaccounted == 0 and account.dropped >= reported(EVENTS), account
    assert account.runs.get(PARENT_LABEL) is None, "the inert recorder wrote nothing"


def test_a_recorder_closed_before_the_fork_counts_what_the_child_reports_to_it(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'closed.db'}"
    recorder = Recorder(url, label=PARENT_LABEL, flush_interval=0.05).start()
    forking.report(recorder, 100)
    recorder.close()
    forking.inherited = recorder
    try:
        by_pid = _join(start_children("fork", 2, url, EVENTS))
    finally:
        forking.inherited = None
    for pid, account in accounts(url, by_pid).items():
        assert account.runs == {OWN_LABEL: 1}, pid
        assert (account.recorded, account.dropped) == (reported(EVENTS), reported(EVENTS)), (pid, account)
    parent_run = select(func.sum(ReplayWindow.replays), func.max(Run.dropped_events)).join(
        Run, Run.id == ReplayWindow.run_id)
    [(replays, dropped)] = fetch_rows(url, parent_run.where(Run.pid == os.getpid()))
    assert (replays, dropped) == (100, 0), "the parent's run is as it closed it"


def test_spawned_children_record_with_recorders_of_their_own(db_url: str, parent) -> None:
    recorder, _ = parent
    with pytest.raises(TypeError, match="cannot be pickled into another: start one in the spawned process"):
        pickle.dumps(recorder)
    children = start_children("spawn", 2, db_url, EVENTS)
    for process in children:
        process.join(120)
    assert [p.exitcode for p in children] == [0, 0]
    for pid, account in accounts(db_url, {p.pid: reported(EVENTS) for p in children}).items():
        assert account.runs == {OWN_LABEL: 1}, pid
        assert (account.recorded, account.dropped) == (account.reported, 0), (pid, account)


def test_a_recorder_made_in_the_parent_and_started_in_the_child_is_the_child_s(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'made-before.db'}"
    made = Recorder(url, label="made before the fork", rank=3, world_size=4)
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            with made:
                forking.report(made, 10)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    runs = select(Run.pid, Run.rank, func.sum(ReplayWindow.replays)).join(
        ReplayWindow, ReplayWindow.run_id == Run.id).group_by(Run.id)
    [(run_pid, rank, replays)] = fetch_rows(url, runs)
    assert (run_pid, rank, replays) == (pid, 3, 10)


def test_a_forked_child_s_run_times_only_the_steps_it_timed(tmp_path) -> None:
    """Step times are sums too: the child's run counts from the fork, as its replays do."""
    url = f"sqlite:///{tmp_path / 'timed.db'}"
    recorder = Recorder(url, label=PARENT_LABEL, flush_interval=0.05).start()
    recorder.on_step_time(FULL, DESCRIPTOR, 0.001, 0.002, samples=2)
    assert recorder.flush(timeout=10)
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            recorder.on_step_time(FULL, DESCRIPTOR, 0.003, None)
            recorder.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    recorder.close()
    timed = select(Run.pid, StepTime.graph_seconds, StepTime.graph_samples, StepTime.eager_samples).join(
        Run, Run.id == StepTime.run_id)
    rows = {row[0]: tuple(row[1:]) for row in fetch_rows(url, timed)}
    assert rows == {os.getpid(): (pytest.approx(0.002), 2, 2), pid: (pytest.approx(0.003), 1, 0)}
