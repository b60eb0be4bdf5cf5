"""The waves of several ``gpu_vllm.py`` runs of one tree taken together: each level's ratio to ``off``.

One ``--plan long`` serves 150 cycles, each one window of the trace at ``on`` and at ``off``; its
median ratio places the cost within about 1.3% (run 17: 0.989, interval 0.975-1.002). Runs of the
same tree on the same kind of card measure the same thing, so their cycles can be pooled: this prints,
for each level of each process tag, every run's median (wall time, and the serving process's CPU
time) with its 95% bootstrap interval (``gpu_vllm.median_interval``), then all runs' cycles together.
Only pool runs of one tree: the script cannot tell which tree a run measured.

    python3 bench/pool_waves.py bench/results/h100/run17/long/vllm_long.json \\
        bench/results/h100/run18/long/vllm_long.json [--tag v2-long-waves] [--out pooled.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_vllm import median_interval


class NoWaves(ValueError):
    """A summary that holds no process with waves (or not the tag asked for)."""


def cycles(summary: dict[str, Any], tag: str | None) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per process tag (every one with waves, or ``tag``), per level, the cycle ratios to ``off``:
    ``{"wall": [...], "cpu": [...]}``."""
    found: dict[str, dict[str, dict[str, list[float]]]] = {}
    for process in summary.get("processes", []):
        levels = (process.get("waves") or {}).get("levels")
        if not levels or (tag is not None and process.get("tag") != tag):
            continue
        found[process["tag"]] = {
            level: {"wall": list(got["cycle_ratios"]), "cpu": list(got["cpu_cycle_ratios"])}
            for level, got in levels.items() if level != "off"
        }
    if not found:
        raise NoWaves("no process with waves" + (f" tagged {tag!r}" if tag else ""))
    return found


def figures(wall: Sequence[float], cpu: Sequence[float]) -> dict[str, Any]:
    return {"cycles": len(wall), "median": round(statistics.median(wall), 4),
            "interval": median_interval(list(wall)), "cpu_median": round(statistics.median(cpu), 4)}


def pool(paths: Sequence[Path], tag: str | None = None) -> dict[str, Any]:
    """Each run's figures and the pooled ones, per process tag and level."""
    runs: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for path in paths:
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise NoWaves(f"{path}: not a readable summary ({exc})") from exc
        try:
            runs[str(path)] = cycles(summary, tag)
        except NoWaves as exc:
            raise NoWaves(f"{path}: {exc}") from exc
    out: dict[str, Any] = {"runs": {}, "pooled": {}}
    together: dict[tuple[str, str], dict[str, list[float]]] = {}
    for path, processes in runs.items():
        for process, levels in processes.items():
            for level, got in levels.items():
                per_run = out["runs"].setdefault(path, {}).setdefault(process, {})
                per_run[level] = figures(got["wall"], got["cpu"])
                pooled = together.setdefault((process, level), {"wall": [], "cpu": [], "runs": []})
                pooled["wall"] += got["wall"]
                pooled["cpu"] += got["cpu"]
                pooled["runs"].append(path)
    for (process, level), got in together.items():
        figured = figures(got["wall"], got["cpu"])
        out["pooled"].setdefault(process, {})[level] = dict(figured, runs=len(got["runs"]))
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| run | process | level | cycles | median / off | 95% interval | CPU time |",
             "|---|---|---|---|---|---|---|"]
    rows = [*result["runs"].items(), ("all runs pooled", result["pooled"])]
    for path, processes in rows:
        for process, levels in processes.items():
            for level, got in levels.items():
                low, high = got["interval"] or (float("nan"), float("nan"))
                lines.append(f"| {path} | {process} | {level} | {got['cycles']} | {got['median']:.4f} | "
                             f"{low:.4f}-{high:.4f} | {got['cpu_median']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="+", type=Path, help="gpu_vllm.py summaries (vllm_long.json, ...)")
    parser.add_argument("--tag", help="only this process (default: every process with waves)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    try:
        result = pool(args.summaries, args.tag)
    except NoWaves as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
