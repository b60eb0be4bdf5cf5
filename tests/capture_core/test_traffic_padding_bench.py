"""bench/padding.py runs as documented and gets the arithmetic right (a short run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "padding.json"
    done = subprocess.run(
        [sys.executable, "bench/padding.py", "--out", str(out), "--steps", "150", "--warmup-steps", "100",
         "--speedups", "0.25", "4", "11", "--uniform-samples", "20000"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "uniform pow2: sampled" in done.stdout
    return json.loads(out.read_text())


def test_exact_uniform_expectation_for_powers_of_two(result: dict) -> None:
    # Sizes 1, 2, then 2^k serves 2^(k-1) batch sizes for k = 2..8: padded total 3 + sum 2^(2k-1).
    padded = 3 + sum(2 ** (2 * k - 1) for k in range(2, 9))
    real = 256 * 257 // 2
    exact = result["uniform"]["pow2"]["exact_padding_waste"]
    assert exact == pytest.approx((padded - real) / padded, abs=1e-6)
    assert 0.24 < result["uniform"]["pow2"]["exact_padding_waste"] < 0.25  # the "about 25%" rule of thumb
    for policy in ("pow2", "vllm"):
        assert result["uniform"][policy]["matches_exact"]


def test_trace_rows_cover_small_to_large_batches_and_vllm_wastes_less(result: dict) -> None:
    rows = result["trace"]
    assert [row["speedup"] for row in rows] == [0.25, 4.0, 11.0]
    assert rows[0]["batch"]["max"] < 16 < rows[-1]["batch"]["min"]
    combined = result["trace_combined"]
    assert combined["vllm"]["padding_waste"] < combined["pow2"]["padding_waste"]
    assert combined["pow2"]["hit_ratio"] == 1.0
    # Chunked prefill makes steps larger than the largest capture size: they run eagerly.
    assert result["mixed"]["pow2"]["hit_ratio"] < 1.0
    assert result["mixed"]["pow2"]["eager_steps"] > 0
    assert result["demo"]["steps"] == 300 and result["demo"]["batch"]["min"] == 1
