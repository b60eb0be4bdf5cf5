"""`graph-inspector demo` on a GPU: real FULL and PIECEWISE CUDA graphs, pool memory, the faults recorded."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
POW2_256 = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.cuda
def test_demo_on_cuda_records_full_and_piecewise_graphs_with_pool_memory(tmp_path: Path) -> None:
    db = tmp_path / "cuda.db"
    result = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "demo", "--no-serve", "--steps", "300", "--backend", "cuda",
         "--db", f"sqlite:///{db}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cuda backend" in result.stdout
    # The traffic does not depend on the backend: the same ramp meets every capture size as on CPU.
    assert "graphs replayed   13 of 18 captured at start-up, every capture size met" in result.stdout
    with sqlite3.connect(db) as conn:
        graphs = conn.execute(
            "SELECT mode, captured_size, backend, pool_bytes, num_segments FROM graphs WHERE NOT unexpected"
        ).fetchall()
        violations = conn.execute("SELECT kind, injected FROM violations ORDER BY kind").fetchall()
        replays = dict(conn.execute("SELECT mode, SUM(replays) FROM replay_windows GROUP BY mode").fetchall())
        eager = conn.execute("SELECT COALESCE(SUM(batches), 0) FROM eager_fallbacks").fetchone()[0]
    pools = {(mode, n): pool for mode, n, _, pool, _ in graphs}
    assert sorted(n for mode, n in pools if mode == "full") == POW2_256
    assert sorted(n for mode, n in pools if mode == "piecewise") == POW2_256
    assert {backend for _, _, backend, _, _ in graphs} == {"cuda"}
    assert {segments for mode, _, _, _, segments in graphs if mode == "piecewise"} == {11}, graphs
    # The largest FULL graph is captured first into the empty shared pool, so it must grow it. The
    # pool is shared, so later graphs (the piecewise ones included) may reuse its freed blocks and
    # add nothing: all of them together still hold memory, and no graph reports a negative growth.
    assert pools[("full", 256)] > 0, pools
    assert sum(pools.values()) >= pools[("full", 256)] and min(pools.values()) >= 0, pools
    assert violations == [("address_drift", 1), ("unexpected_capture", 1)]
    assert replays.get("full", 0) > 0 and replays.get("piecewise", 0) > 0, replays
    assert sum(replays.values()) + eager == 300


@pytest.mark.cuda
def test_demo_on_cuda_with_ubatch_captures_micro_batched_graphs(tmp_path: Path) -> None:
    db = tmp_path / "dbo.db"
    result = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "demo", "--no-serve", "--steps", "200", "--backend", "cuda",
         "--mode", "full_decode_only", "--ubatch", "--db", f"sqlite:///{db}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with sqlite3.connect(db) as conn:
        graphs = conn.execute(
            "SELECT captured_size, num_ubatches, backend, pool_bytes FROM graphs WHERE NOT unexpected"
        ).fetchall()
        split = conn.execute(
            "SELECT SUM(replays) FROM replay_windows WHERE captured_size >= 32"
        ).fetchone()[0]
    assert sorted(n for n, k, _, _ in graphs if k == 2) == [32, 64, 128, 256]
    assert {backend for _, _, backend, _ in graphs} == {"cuda"}
    assert max(pool for n, _, _, pool in graphs if n == 256) > 0
    assert split and f"micro-batched     {split} of 200 steps" in result.stdout
