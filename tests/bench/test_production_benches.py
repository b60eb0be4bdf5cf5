"""bench/daemon_bench.py and bench/fork_bench.py run as documented (their quick forms), and their
figures hang together: every probe answered, every request in flight answered through a SIGTERM,
every event a forked or spawned child reported accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(script: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, script, "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads(out.read_text())
    assert payload["config"]["quick"] is True and "Targets" in done.stdout
    assert all(t["met"] is True for t in payload["targets"]), payload["targets"]
    return payload


def test_the_daemon_benchmark_probes_through_slow_clients_and_stops_gracefully(tmp_path: Path) -> None:
    payload = _run("bench/daemon_bench.py", tmp_path / "daemon.json")
    [slow] = payload["results"]["slow_connections"]["150"]
    assert slow["held"] == 150
    assert slow["/healthz"]["answered"] == slow["/healthz"]["probes"] == 5
    assert slow["/metrics"]["answered"] == 5
    [stop] = payload["results"]["sigterm"]
    assert (stop["answered"], stop["exit_status"]) == (50, 0)
    assert stop["daemon_said"] and "stopped on SIGTERM" in stop["daemon_said"][0]


def test_the_fork_benchmark_accounts_for_every_event_of_every_child(tmp_path: Path) -> None:
    payload = _run("bench/fork_bench.py", tmp_path / "fork.json")
    for method, inherited in (("fork", True), ("spawn", False)):
        [run] = payload["results"][method]
        assert run["exitcodes"] == [0, 0, 0]
        assert len(run["children"]) == 3
        for child in run["children"]:
            assert child["unaccounted"] == 0 and child["recorded"] == child["reported"], child
            expected = {"parent": 1, "child's own": 1} if inherited else {"child's own": 1}
            assert child["runs"] == expected
        parent = run["parent"]
        assert parent["recorded"] == parent["reported"] > 0
