"""``bench/pool_waves.py``: the waves of several ``gpu_vllm.py`` runs taken together. Summaries are
written here as the plan writes them (a process's ``waves.levels``: per level the cycle ratios to
``off``, wall and CPU); the script runs as a real process, as it is used."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def summary(path: Path, on: list[float], tag: str = "v2-long-waves") -> Path:
    levels = {"on": {"cycle_ratios": on, "cpu_cycle_ratios": [r - 0.001 for r in on]},
              "off": {"cycle_ratios": [1.0] * len(on), "cpu_cycle_ratios": [1.0] * len(on)}}
    path.write_text(json.dumps({"plan": "long", "processes": [
        {"tag": tag, "waves": {"cycles": len(on), "cycles_identical": len(on), "levels": levels}},
        {"tag": "v2-faults", "violations": []},  # a process without waves is passed over
    ]}))
    return path


def pool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/pool_waves.py", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_each_run_and_all_runs_pooled(tmp_path: Path) -> None:
    first = [0.95, 0.97, 0.98, 0.99, 1.01]
    second = [0.99, 1.0, 1.0, 1.02, 1.03, 1.04]
    a, b = summary(tmp_path / "a.json", first), summary(tmp_path / "b.json", second)
    out = tmp_path / "pooled.json"
    proc = pool(a, b, "--out", out)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["runs"][str(a)]["v2-long-waves"]["on"]["median"] == 0.98
    assert result["runs"][str(b)]["v2-long-waves"]["on"]["median"] == 1.01
    pooled = result["pooled"]["v2-long-waves"]["on"]
    assert pooled["cycles"] == 11 and pooled["runs"] == 2
    assert pooled["median"] == statistics.median(first + second) == 1.0
    assert pooled["cpu_median"] == 0.999
    low, high = pooled["interval"]
    assert min(first + second) <= low <= 1.0 <= high <= max(first + second)
    assert "off" not in pooled and "v2-faults" not in result["pooled"]
    assert "| all runs pooled | v2-long-waves | on | 11 | 1.0000 |" in proc.stdout


def test_a_tag_picks_one_process(tmp_path: Path) -> None:
    a = summary(tmp_path / "a.json", [0.9, 1.0, 1.1], tag="v2-timed")
    assert pool(a, "--tag", "v2-timed").returncode == 0
    proc = pool(a, "--tag", "v2-long-waves")
    assert proc.returncode == 2
    assert "no process with waves tagged 'v2-long-waves'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_or_broken_summary_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path in (tmp_path / "missing.json", broken):
        proc = pool(path)
        assert proc.returncode == 2
        assert f"error: {path}: not a readable summary" in proc.stderr and "Traceback" not in proc.stderr
