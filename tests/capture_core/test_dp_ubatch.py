"""bench/gpu_dp_ubatch.py: micro-batching across data-parallel ranks, run as real processes.

On this host the ranks are CPU processes over gloo (eager backend: collectives, agreement,
equality and recording are real; nothing is captured). The CUDA-marked test runs the same script
over NCCL with one GPU per rank, where the collectives are captured inside the ubatch graphs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.gpu_dp_ubatch import STEPS, Job, LaunchError, find_failures, launch  # noqa: E402


def run_script(tmp_path: Path, *args: str, timeout: float = 280) -> tuple[dict[str, Any], str, Path]:
    db, out = tmp_path / "dp.db", tmp_path / "dp.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_dp_ubatch.py", *args, "--db", f"sqlite:///{db}", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"gpu_dp_ubatch failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout, db


def check_run(payload: dict[str, Any], stdout: str, db: Path, nproc: int, backend: str) -> None:
    results = payload["results"]
    assert results["ok"] is True and results["failures"] == []
    ranks = results["ranks"]
    assert [r["rank"] for r in ranks] == list(range(nproc))
    # The same weights everywhere, and every step agreed alike on every rank.
    assert len({r["weight_checksum"] for r in ranks}) == 1
    for index, name in enumerate(STEPS):
        steps = [r["steps"][index] for r in ranks]
        assert all(s["name"] == name for s in steps)
        agreed = {
            json.dumps([s["should_ubatch"], s["mode"], s["num_tokens_across_dp"], s["token_split"]])
            for s in steps
        }
        assert len(agreed) == 1, f"step {name!r}: ranks disagree: {agreed}"
        # The batches really differed per rank, yet every rank runs the same padded size.
        assert len({s["real_tokens"] for s in steps}) == min(nproc, 2)
        assert len(set(steps[0]["num_tokens_across_dp"])) == 1
        for step in steps:
            assert step["equal_to_eager"] and step["finite"], step
            assert step["max_abs_err_vs_eager"] <= step["allowed_abs_err"]
    first = ranks[0]["steps"]
    paths = {s["name"]: s["path"] for s in first}
    assert paths["uneven, one size"] == "ubatch graph replay"
    assert paths["one rank tiny"] == "eager (micro-batching called off)"
    assert all(s["token_split"] is None for s in first if not s["should_ubatch"])

    # Every rank recorded its own run into the one database, with its rank and the world size.
    with sqlite3.connect(db) as conn:
        runs = conn.execute(
            "SELECT id, rank, world_size, backend FROM runs WHERE label = 'dp-ubatch' ORDER BY rank"
        ).fetchall()
        assert [(rank, world) for _, rank, world, _ in runs] == [(r, nproc) for r in range(nproc)]
        assert {b for *_, b in runs} == {backend}
        for run_id, rank, _, _ in runs:
            ubatch_graphs = conn.execute(
                "SELECT captured_size FROM graphs WHERE run_id = ? AND num_ubatches = 2 "
                "ORDER BY captured_size",
                (run_id,),
            ).fetchall()
            assert ubatch_graphs, f"rank {rank} recorded no ubatch graph"
            (replays,) = conn.execute(
                "SELECT SUM(replays) FROM replay_totals WHERE run_id = ?", (run_id,)
            ).fetchone()
            assert replays and replays > 0
            (fallbacks,) = conn.execute(
                "SELECT SUM(batches) FROM eager_totals WHERE run_id = ? AND reason = 'ubatch_graph_only'",
                (run_id,),
            ).fetchone()
            assert fallbacks == 1, f"rank {rank}: the called-off step was not recorded as one eager batch"
    # The dashboard lists both ranks' runs (its JSON twin of the runs page, asked in-process).
    api = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "serve", "--db", f"sqlite:///{db}", "--get", "/api/runs"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert api.returncode == 0, api.stderr
    listed = [r for r in json.loads(api.stdout)["data"]["items"] if r["label"] == "dp-ubatch"]
    assert sorted((r["rank"], r["world_size"]) for r in listed) == [(r, nproc) for r in range(nproc)]
    assert all(r["graphs"] > 0 and r["traffic"]["replays"] > 0 for r in listed)
    # The summary table is the last table printed.
    tail = stdout[stdout.rindex("\nSummary:") :]
    rows = [line for line in tail.splitlines() if line.strip() and line.lstrip()[0].isdigit()]
    assert len(rows) == nproc * len(payload["config"]["payloads_mib"])


@pytest.mark.slow
def test_two_gloo_ranks_agree_replay_equals_eager_and_both_record(tmp_path: Path) -> None:
    payload, stdout, db = run_script(
        tmp_path, "--nproc", "2", "--backend", "gloo", "--device", "cpu", "--quick"
    )
    check_run(payload, stdout, db, nproc=2, backend="eager")
    # The eager backend's "replay" runs the step's Python, collectives included.
    replays = [
        s for r in payload["results"]["ranks"] for s in r["steps"] if s["path"] == "ubatch graph replay"
    ]
    assert replays and all(s["python_exchanges"] > 0 for s in replays)
    assert any("meaningless" in note for note in payload["notes"])
    assert payload["config"]["capture_sizes"] == [8, 16]


@pytest.mark.cuda
@pytest.mark.slow
def test_two_nccl_ranks_capture_collectives_in_ubatch_graphs(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (one NCCL rank each)")
    payload, stdout, db = run_script(tmp_path, "--nproc", "2", "--backend", "nccl", "--device", "cuda")
    check_run(payload, stdout, db, nproc=2, backend="cuda")
    replays = [
        s for r in payload["results"]["ranks"] for s in r["steps"] if s["path"] == "ubatch graph replay"
    ]
    assert replays and all(s["python_exchanges"] == 0 for s in replays)
    for rank in payload["results"]["ranks"]:
        assert {g["num_tokens"] for g in rank["graphs"] if g["wrapper"] == "dp-ubatched"} == {128, 256}
        for timing in rank["timing"]:
            assert timing["comm_hidden_fraction"] is not None
            assert timing["comm_hidden_fraction_halves"] is not None


def _job(tmp_path: Path, port: int) -> Job:
    return Job(
        nproc=2,
        port=port,
        backend="gloo",
        device_type="cpu",
        quick=True,
        db_url=f"sqlite:///{tmp_path / 'dp.db'}",
        work_dir=str(tmp_path),
        payloads_mib=(0.0,),
        capture_sizes=(8, 16),
        decode_threshold=4,
        budget_s=5,
        pg_timeout_s=30,
    )


@pytest.mark.slow
def test_a_failing_rank_is_named_with_its_stage_and_the_other_is_stopped(tmp_path: Path) -> None:
    # Rank 0 cannot host the rendezvous (the port is taken); rank 1 would wait for it for 30s.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = time.monotonic()
        with pytest.raises(LaunchError) as info:
            launch(_job(tmp_path, taken.getsockname()[1]), timeout_s=120)
    message = str(info.value)
    assert "rank 0 FAILED at stage 'init process group'" in message
    assert "address already in use" in message.lower() or "EADDRINUSE" in message
    # Rank 1 is stopped wherever it was (on a busy host it may still be importing torch).
    assert re.search(r"rank 1 was stopped (at stage 'init process group'|never started)", message), message
    assert time.monotonic() - started < 25, "the waiting rank was not stopped when rank 0 failed"


@pytest.mark.slow
def test_a_run_past_its_time_limit_is_stopped_and_says_where_each_rank_was(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_job(tmp_path, port), timeout_s=1)
    message = str(info.value)
    assert "did not finish within 1s" in message
    assert "rank 0 " in message and "rank 1 " in message
    assert time.monotonic() - started < 20


# ---------------------------------------------------------------- the parent's checks (no ranks)


def _rank(rank: int, **step_changes: Any) -> dict[str, Any]:
    step = {
        "name": "only",
        "should_ubatch": True,
        "mode": "FULL",
        "num_tokens_across_dp": [16, 16],
        "token_split": [[0, 8], [8, 16]],
        "path": "ubatch graph replay",
        "equal_to_eager": True,
        "finite": True,
        "max_abs_err_vs_eager": 0.0,
        "allowed_abs_err": 1e-4,
        "python_exchanges": 0,
    }
    step.update(step_changes)
    return {"rank": rank, "steps": [step] * len(STEPS)}


def _recorded(*ranks: int) -> list[dict[str, Any]]:
    return [{"found": True, "rank": r, "world_size": 2, "ubatch_graphs": 2} for r in ranks]


def test_the_parent_finds_nothing_wrong_with_agreeing_equal_recorded_ranks(tmp_path: Path) -> None:
    assert find_failures(_job(tmp_path, 0), [_rank(0), _rank(1)], _recorded(0, 1)) == []


def test_the_parent_names_a_disagreeing_rank_and_what_it_agreed(tmp_path: Path) -> None:
    failures = find_failures(
        _job(tmp_path, 0), [_rank(0), _rank(1, token_split=[[0, 4], [4, 16]])], _recorded(0, 1)
    )
    assert failures and all("ranks disagree" in f for f in failures)
    assert "rank 1: [True, 'FULL', [16, 16], [[0, 4], [4, 16]]]" in failures[0]


def test_the_parent_names_the_rank_whose_replay_differs_from_eager(tmp_path: Path) -> None:
    bad = _rank(1, equal_to_eager=False, max_abs_err_vs_eager=0.5)
    failures = find_failures(_job(tmp_path, 0), [_rank(0), bad], _recorded(0, 1))
    assert len(failures) == len(STEPS)
    assert all("rank 1: replay differs from eager: max abs err 0.5 > allowed 0.0001" in f for f in failures)


def test_the_parent_flags_a_step_run_other_than_agreed_and_a_rank_missing_from_the_database(
    tmp_path: Path,
) -> None:
    wrong_path = _rank(0, path="eager (micro-batching called off)")
    failures = find_failures(_job(tmp_path, 0), [wrong_path, _rank(1)], _recorded(0))
    assert any("rank 0: ran as eager (micro-batching called off)" in f for f in failures)
    assert "the database holds runs for ranks [0], expected [0, 1]" in failures


def test_on_cuda_a_replay_that_ran_its_exchanges_in_python_is_a_failure(tmp_path: Path) -> None:
    on_cuda = dataclasses.replace(_job(tmp_path, 0), backend="nccl", device_type="cuda")
    ranks = [_rank(0, python_exchanges=4), _rank(1)]
    failures = find_failures(on_cuda, ranks, _recorded(0, 1))
    assert len(failures) == len(STEPS)
    assert all("rank 0: the ubatch graph replay ran 4 exchanges in Python" in f for f in failures)
    # The eager backend "replays" by running the step, so on a CPU the count says nothing.
    assert find_failures(_job(tmp_path, 0), ranks, _recorded(0, 1)) == []
