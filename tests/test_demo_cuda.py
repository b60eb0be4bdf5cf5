"""`graph-inspector demo` on a GPU: real CUDA graphs, pool memory measured, the faults recorded."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.cuda
def test_demo_on_cuda_records_real_graphs_with_pool_memory(tmp_path: Path) -> None:
    db = tmp_path / "cuda.db"
    result = subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "demo", "--no-serve", "--steps", "300", "--backend", "cuda",
         "--db", f"sqlite:///{db}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cuda backend" in result.stdout
    with sqlite3.connect(db) as conn:
        graphs = conn.execute("SELECT num_tokens, backend, pool_bytes, unexpected FROM graphs").fetchall()
        violations = conn.execute("SELECT kind, injected FROM violations ORDER BY kind").fetchall()
        replays = conn.execute("SELECT SUM(replays) FROM replay_windows").fetchone()[0]
    captured = {n: pool for n, _, pool, unexpected in graphs if not unexpected}
    assert sorted(captured) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {backend for _, backend, _, _ in graphs} == {"cuda"}
    assert captured[256] > 0, "the largest graph, captured first, must hold pool memory"
    assert violations == [("address_drift", 1), ("unexpected_capture", 1)]
    assert replays >= 300
