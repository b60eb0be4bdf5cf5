"""``bench/gpu_piecewise.py --quick`` as a real process: every code path, its table and its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_quick_run_compares_every_mix_and_records_the_piecewise_graphs(tmp_path: Path) -> None:
    out = tmp_path / "gpu_piecewise.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_piecewise.py", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "gpu_piecewise" and payload["config"]["quick"] is True
    results = payload["results"]
    assert results["all_equal_to_eager"] is True
    graphs = results["piecewise_graphs"]
    assert [g["num_tokens"] for g in graphs] == [8, 4, 2, 1]
    assert all(g["segments"] == 3 for g in graphs)  # the tiny model: 2 attention calls, 3 segments
    on_cuda = torch.cuda.is_available()
    assert (graphs[0]["pool_bytes"] > 0) == on_cuda  # the eager backend holds no pool
    kinds = {r["uniform_decode"]: set(r["step_ms"]) for r in results["mixes"]}
    assert kinds == {True: {"eager", "piecewise", "full"}, False: {"eager", "piecewise"}}
    assert all(r["step_ms"]["piecewise"]["median_ms"] > 0 for r in results["mixes"])
    equality = payload["targets"][0]
    assert equality["name"].startswith("max |graph - eager|") and equality["met"] is True
    assert "Step time" in proc.stdout and proc.stdout.rstrip().endswith(("met", "n/a", "MISSED"))
