"""bench/gpu_watch.py as a real process: on a host without CUDA it says so and still writes JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the benchmark itself")
def test_gpu_watch_on_a_cpu_host_records_why_nothing_was_measured(tmp_path: Path) -> None:
    out = tmp_path / "gpu_watch.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_watch.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "gpu_watch" and payload["targets"] == []
    skipped = [note.split(":")[0] for note in payload["notes"]]
    assert skipped == ["decode loop", "torch.compile", "replay overhead"]
    assert "needs a CUDA device" in result.stdout
