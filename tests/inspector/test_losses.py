"""Loss is counted honestly: what a recorder drops is counted as the events the engine reported
(replays, eager batches, violation occurrences, captures, real tokens), also when it is lost at or
after close(), and the run's page, /metrics and the report all say so. Real locks, a real full
filesystem (tmpfs, as root), real processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from workers import FULL, REPO, SIZES, capture, child_env, drift, fetch_rows, locked

from capture_core.descriptor import BatchDescriptor
from capture_core.sizes import EagerReason
from dashboard.app import create_app
from inspector.gating.report import build_report, render_text
from inspector.reading.metrics import PREFIX, InspectorCollector
from inspector.recording.losses import Losses, RunIdentity, Sidecar, record_unwritten, sidecar_path
from inspector.recording.recorder import Recorder
from inspector.storage.models import ReplayWindow, Run, Violation
from inspector.storage.store import open_store

LOST_REPLAYS = 42_600


def _engine_traffic(recorder: Recorder) -> Losses:
    """42,600 replays over five graphs, 100 eager batches and one finding seen 3 times."""
    descriptors = [BatchDescriptor(size, size, True) for size in SIZES]
    tokens = 0
    for i in range(LOST_REPLAYS):
        descriptor = descriptors[i % len(descriptors)]
        real = max(1, descriptor.num_tokens - i % 2)
        recorder.on_replay(FULL, descriptor, real)
        tokens += real
    for _ in range(100):
        recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 300, FULL)
    for _ in range(3):
        recorder.on_violation(drift(descriptors[0], actual=0x5000))
    return Losses(violations=3, replays=LOST_REPLAYS, eager_batches=100, real_tokens=tokens + 100 * 300)


def _dropped_metrics(store_url: str) -> dict[str, float | None]:
    store = open_store(store_url, upgrade=False)
    try:
        registry = CollectorRegistry()
        registry.register(InspectorCollector(store))
        value = registry.get_sample_value
        found = {kind: value(f"{PREFIX}recorder_dropped_events_total", {"kind": kind})
                 for kind in ("replay", "eager_batch", "violation", "capture")}
        found["real_tokens"] = value(f"{PREFIX}recorder_dropped_real_tokens_total")
        return found
    finally:
        store.dispose()


def test_a_window_lost_at_close_counts_its_replays_everywhere(tmp_path: Path) -> None:
    path = tmp_path / "locked-at-close.db"
    url = f"sqlite:///{path}"
    recorder = Recorder(url, flush_interval=3600, close_timeout=0.5).start()
    recorder.on_capture(capture(BatchDescriptor(8, 8, True)))
    assert recorder.flush(timeout=20)
    with locked(path):
        expected = _engine_traffic(recorder)
        recorder.close()  # the database stays locked past close_timeout: the last window is lost
    assert recorder.losses == expected
    assert recorder.dropped == LOST_REPLAYS + 100 + 3
    (row,) = fetch_rows(url, select(Run.dropped_events, Run.dropped_replays))
    assert tuple(row) == (0, 0), "the database took no write; the sidecar holds the loss"
    (line,) = sidecar_path(path).read_text().splitlines()
    assert json.loads(line)["losses"]["replays"] == LOST_REPLAYS

    assert _dropped_metrics(url) == {"replay": LOST_REPLAYS, "eager_batch": 100, "violation": 3, "capture": 0,
                                     "real_tokens": expected.real_tokens}
    store = open_store(url, upgrade=False)
    try:
        text = render_text(build_report(store))
    finally:
        store.dispose()
    dropped = f"the recorder dropped {expected.events:,} event(s) in this run: 42,600 replays and 100 eager"
    assert dropped in text
    client = create_app(url).test_client()
    (run,) = client.get("/api/runs").get_json()["data"]["items"]
    assert run["dropped"] == expected.as_dict() and run["dropped_events"] == expected.events
    page = client.get("/runs").get_data(as_text=True)
    said = f"{expected.events:,} events dropped: 42,600 replays, 100 eager batches, 3 violation occurrences"
    assert said in page


LATE_CHILD = """
import sys
from workers import FULL, drift
from capture_core.descriptor import BatchDescriptor
from inspector.recording.recorder import Recorder
d = BatchDescriptor(4, 4, True)
recorder = Recorder(sys.argv[1], flush_interval=0.05).start()
for _ in range(10):
    recorder.on_replay(FULL, d, 3)
recorder.close()
for _ in range(1000):  # an engine thread that outlives its recorder
    recorder.on_replay(FULL, d, 3)
recorder.on_violation(drift(d, actual=0x7000))
print(recorder.dropped)
"""


def test_events_after_close_are_counted_in_the_run_row_at_exit(db_url: str) -> None:
    result = subprocess.run([sys.executable, "-c", LATE_CHILD, db_url], capture_output=True, text=True,
                            timeout=120, env=child_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1001"]
    rows = fetch_rows(db_url, select(Run.dropped_replays, Run.dropped_violations, Run.dropped_real_tokens,
                                     Run.dropped_events, Run.ended_at.is_not(None)))
    assert [tuple(r) for r in rows] == [(1000, 1, 3000, 1001, True)]
    assert fetch_rows(db_url, select(ReplayWindow.replays)) == [(10,)]
    assert "reported after close() are lost" in result.stderr


def test_losses_the_database_never_took_are_in_the_log_and_the_sidecar(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    who = RunIdentity(None, "gpu-7", 4242, 1.5)
    lost = Losses(replays=5, real_tokens=40)
    with caplog.at_level(logging.ERROR):
        assert record_unwritten(None, who, lost, "PostgreSQL down") == "the log"
    assert "lost 5 events in all (5 replays (40 real tokens))" in caplog.text
    database = tmp_path / "x.db"
    assert record_unwritten(database, who, lost, "locked") == str(sidecar_path(database))
    with open(sidecar_path(database), "a") as torn:  # a recorder killed mid-line
        torn.write('{"run_id": 3, "host": ')
    later = Losses(replays=9, real_tokens=70)
    assert record_unwritten(database, who, later, "later") == str(sidecar_path(database))
    assert Sidecar(database).recorders() == [(who, later)]


FULL_DISK_CHILD = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from workers import FULL, capture, drift
from capture_core.descriptor import BatchDescriptor
from inspector.recording.recorder import Recorder
from tests.support.recording import fill_filesystem
url, filler = sys.argv[1], sys.argv[2]
fill = lambda: fill_filesystem(filler)
d = BatchDescriptor(4, 4, True)
recorder = Recorder(url, flush_interval=0.05, close_timeout=1.0).start()
recorder.on_capture(capture(d))
assert recorder.flush(timeout=20)
fill()
for _ in range(500):
    recorder.on_replay(FULL, d, 3)
recorder.on_violation(drift(d, actual=0x7000, name="x" * 200000))
full = recorder.flush(timeout=1.0)
os.unlink(filler)
freed = recorder.flush(timeout=20)
fill()
for _ in range(700):
    recorder.on_replay(FULL, d, 2)
recorder.close()
print(json.dumps({"full": full, "freed": freed, "losses": recorder.losses.as_dict()}))
"""


def test_a_full_filesystem_loses_only_what_it_could_not_hold_and_says_so(tmp_path: Path) -> None:
    """As root: a 4 MiB tmpfs holds the database. Full, the recorder waits; freed, it writes all it
    held; full again at close, it counts the last window as lost, and the log says so (no sidecar
    fits on a full disk either)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    small = tmp_path / "small"
    small.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        url = f"sqlite:///{small / 'full.db'}"
        result = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, url, str(small / "filler")],
                                capture_output=True, text=True, timeout=300, env=child_env(), cwd=REPO)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["full"] is False and report["freed"] is True
        assert report["losses"] == {"events": 700, "captures": 0, "violations": 0, "replays": 700,
                                    "eager_batches": 0, "real_tokens": 1400, "unclassified": 0}
        assert "recorded in the log" in result.stderr and "Traceback" not in result.stderr
        (small / "filler").unlink()
        assert fetch_rows(url, select(ReplayWindow.replays)) == [(500,)]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_value_the_database_refuses_is_dropped_and_counted_and_the_rest_gets_through(db_url: str) -> None:
    """An address past 64 bits in a violation, a graph of 2**63 tokens: the database refuses them
    whatever the retry, so they are given up (and counted) instead of holding every later window."""
    good, huge = BatchDescriptor(4, 4, True), BatchDescriptor(2**63, 1, True)
    with Recorder(db_url, flush_interval=0.05) as recorder:
        recorder.on_capture(capture(good))  # in the same transaction as the refused violation
        recorder.on_violation(drift(good, actual=2**64 + 5))
        assert recorder.flush(timeout=20)
        for _ in range(10):
            recorder.on_replay(FULL, huge, 3)
        assert recorder.flush(timeout=20)
        for _ in range(100):
            recorder.on_replay(FULL, good, 3)
        recorder.on_violation(drift(good, actual=0x5000))
        assert recorder.flush(timeout=20), recorder.last_error
    assert recorder.losses == Losses(captures=1, violations=1, replays=10, real_tokens=30)
    assert fetch_rows(db_url, select(ReplayWindow.replays)) == [(100,)]
    assert fetch_rows(db_url, select(Violation.actual_address)) == [(0x5000,)]
    assert tuple(fetch_rows(db_url, select(Run.dropped_events, Run.dropped_replays))[0]) == (12, 10)
