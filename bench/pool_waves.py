"""The waves of several ``gpu_vllm.py`` runs of one tree taken together: each level's ratio to ``off``.

One ``--plan long`` serves 150 cycles, each one window of the trace at ``on`` and at ``off``; its
median ratio places the cost within about 1.3% (run 17: 0.989, interval 0.977-1.002). Runs of the
same tree on the same kind of card measure the same thing, so their cycles can be pooled: this prints,
for each level of each process tag, every run's median (wall time, and the serving process's CPU
time) with its 95% bootstrap interval, then all runs' cycles together, each as
``gpu_vllm.waves_summary`` reads a plan's processes.
Only pool runs of one tree: the script cannot tell which tree a run measured.

    python3 bench/pool_waves.py bench/results/h100/run17/long/vllm_long.json \\
        bench/results/h100/run18/long/vllm_long.json [--tag v2-long-waves] [--out pooled.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_vllm import waves_summary


class NoWaves(ValueError):
    """A summary that holds no process with waves (or not the tag asked for)."""


def waved(summary: dict[str, Any], tag: str | None) -> list[dict[str, Any]]:
    """The processes of one summary that served waves (only ``tag``'s, when given)."""
    found = [process for process in summary.get("processes", [])
             if (process.get("waves") or {}).get("levels") and (tag is None or process.get("tag") == tag)]
    if not found:
        raise NoWaves("no process with waves" + (f" tagged {tag!r}" if tag else ""))
    return found


def figures(processes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per level but ``off``, the processes' cycles taken together (``gpu_vllm.waves_summary``)."""
    summary = waves_summary(processes)
    return {level: {"cycles": summary["cycles"], "median": round(medians["wall"], 4),
                    "interval": summary["median_95_interval"][level], "cpu_median": round(medians["cpu"], 4)}
            for level, medians in summary["median_over_every_cycle"].items() if level != "off"}


def pool(paths: Sequence[Path], tag: str | None = None) -> dict[str, Any]:
    """Each run's figures and the pooled ones, per process tag and level."""
    out: dict[str, Any] = {"runs": {}, "pooled": {}}
    by_tag: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise NoWaves(f"{path}: not a readable summary ({exc})") from exc
        try:
            processes = waved(summary, tag)
        except NoWaves as exc:
            raise NoWaves(f"{path}: {exc}") from exc
        out["runs"][str(path)] = {process["tag"]: figures([process]) for process in processes}
        for process in processes:
            by_tag.setdefault(process["tag"], []).append(process)
    for process_tag, processes in by_tag.items():
        out["pooled"][process_tag] = {level: dict(got, runs=len(processes))
                                      for level, got in figures(processes).items()}
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
