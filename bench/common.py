"""Shared helpers for the benchmarks: timing, time budgets, the machine record, tables and JSON.

Every benchmark in this folder answers the same questions the same way, so that figures from
different scripts can sit in one table (BENCHMARKS.md):

* step times are medians (with p10/p90) of many timed calls, and variants that are compared are
  timed *interleaved* in rounds within one run, so clock and thermal drift hit them alike and a
  ratio is never taken between two runs;
* on CUDA a timed call is bracketed by CUDA events and ends with a synchronize, so the figure is the
  latency of one call including the host work that feeds the GPU (a decode loop that samples on
  the host waits for exactly that); on a CPU the same timer falls back to ``perf_counter``;
* a ``Budget`` scales repetitions down (never the sizes measured) so the whole GPU set fits its
  time slot on the H200;
* every JSON result carries the machine, the software versions, the git commit and the date.

Scripts are run as ``python3 bench/<name>.py``; they put the repository root on ``sys.path``
themselves and import this module as ``bench.common``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------- devices


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for ``cuda`` without one is a clear error."""
    if choice == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if choice == "cuda" and not cuda_available():
        raise SystemExit("error: --device cuda was asked for, but torch sees no CUDA device")
    if choice not in ("cuda", "cpu"):
        raise SystemExit(f"error: unknown device {choice!r}; choose auto, cuda or cpu")
    return torch.device(choice)


def needs_cuda(what: str) -> str:
    """The note a CPU run prints (and records) where a CUDA-only measurement is skipped."""
    return f"{what}: skipped, it needs a CUDA device and this host has none"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ timing


@dataclass(frozen=True)
class Stats:
    """A summary of timed samples (milliseconds, or whatever unit the samples were in)."""

    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("no samples to summarise")
        ordered = sorted(samples)
        return cls(statistics.median(ordered), _quantile(ordered, 0.1), _quantile(ordered, 0.9), len(ordered))

    def as_dict(self, unit: str = "ms") -> dict[str, float | int]:
        return {
            f"median_{unit}": self.median,
            f"p10_{unit}": self.p10,
            f"p90_{unit}": self.p90,
            "samples": self.n,
        }


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted samples (statistics.quantiles needs n >= 2)."""
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class CallTimer:
    """Times single calls: CUDA events plus a synchronize on a GPU, ``perf_counter`` on a CPU.

    Each call is synchronized, so one call's figure is its whole latency (host work included) and
    never overlaps the next call's. Events are created up front so the loop allocates nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_cuda_events = device.type == "cuda"

    def time_calls(self, fn: Callable[[], object], iters: int) -> list[float]:
        """Milliseconds of each of ``iters`` calls of ``fn``."""
        if iters <= 0:
            raise ValueError(f"iters must be positive, got {iters}")
        if not self.uses_cuda_events:
            samples = []
            for _ in range(iters):
                start = time.perf_counter_ns()
                fn()
                samples.append((time.perf_counter_ns() - start) / 1e6)
            return samples
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        torch.cuda.synchronize(self.device)
        for start, end in pairs:
            start.record()
            fn()
            end.record()
            end.synchronize()
        return [start.elapsed_time(end) for start, end in pairs]


def time_interleaved(
    variants: Mapping[str, Callable[[], object]],
    timer: CallTimer,
    *,
    rounds: int,
    iters: int | Mapping[str, int],
    warmup: int = 2,
    block_warmup: int = 0,
    rotate: bool = True,
) -> dict[str, list[float]]:
    """Time several variants side by side: ``rounds`` rounds, each running every variant in a block.

    ``iters`` is the block length, for all variants or per variant (slow peers need fewer samples
    than the figures a target is judged by). Every variant is warmed up ``warmup`` times first, and
    ``block_warmup`` untimed calls open each block, so no block pays for the switch from the one
    before. With ``rotate`` each round starts one variant later, so no variant always follows the
    same other one. Interleaving means a slow stretch of the machine (clocks, another process,
    a background flush) lands on all variants alike, so ratios between them stay honest.
    """
    names = list(variants)
    lengths = {name: iters if isinstance(iters, int) else iters[name] for name in names}
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    synchronize(timer.device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            fn = variants[name]
            for _ in range(block_warmup):
                fn()
            samples[name].extend(timer.time_calls(fn, lengths[name]))
    return samples


def host_us_per_call(
    fn: Callable[[], object],
    *,
    calls: int,
    repeats: int,
    device: torch.device,
) -> list[float]:
    """Host microseconds per call over ``calls`` back-to-back calls, once per repeat.

    No synchronize inside the loop: this is the host cost of issuing the call (what a wrapper adds
    on top of ``replay()``); the device is drained after each repeat so queues never back up into
    the next one.
    """
    per_call = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter_ns() - start
        synchronize(device)
        per_call.append(elapsed / calls / 1e3)
    return per_call


class Budget:
    """A time slot for one benchmark: scales repetitions to what is left, never the sizes measured."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"a time budget must be positive, got {seconds}")
        self.seconds = seconds
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def left(self) -> float:
        return max(0.0, self.seconds - self.elapsed)

    def share(self, parts_left: int) -> float:
        """Seconds each of the ``parts_left`` remaining parts may spend."""
        return self.left / max(1, parts_left)

    @staticmethod
    def reps_for(seconds: float, per_rep_s: float, *, floor: int, ceiling: int) -> int:
        """How many repetitions of ``per_rep_s`` seconds fit in ``seconds``, clamped to [floor, ceiling]."""
        if per_rep_s <= 0:
            return ceiling
        return max(floor, min(ceiling, int(seconds / per_rep_s)))


# ------------------------------------------------------------------------------------- the recorder


@contextmanager
def temporary_recorder(label: str, **options: Any) -> Iterator[Any]:
    """A real inspector ``Recorder`` writing into a fresh SQLite file, removed afterwards.

    The benchmarks measure the cache as users run it: recording, with the flush thread writing
    replay windows every second while the steps are being timed. ``options`` go to the Recorder.
    """
    from inspector.recording.recorder import Recorder

    with tempfile.TemporaryDirectory(prefix="graph-inspector-bench-") as tmp:
        recorder = Recorder(f"sqlite:///{tmp}/bench.db", label=label, **options)
        recorder.start()
        try:
            yield recorder
        finally:
            recorder.close()


# ---------------------------------------------------------------------------------- results & text


def git_commit() -> str:
    """The commit the benchmark ran at, with ``-dirty`` when the tree had local changes."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def cpu_model() -> str:
    """The CPU's model name (host time figures depend on it), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where and with what a figure was measured: enough to tell two runs' machines apart."""
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "device": str(device),
        "git_commit": git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            driver_gpus=torch.cuda.device_count(),
        )
    else:
        info["gpu"] = None
    return info


def target(
    name: str, value: float | None, limit: float, *, unit: str = "", applies: bool = True
) -> dict[str, Any]:
    """A target check as recorded in JSON.

    ``met`` is None when the value could not be measured, or when it was measured where the target
    does not apply (a CPU stand-in for a GPU figure): such a run neither meets nor misses it.
    """
    met = None if value is None or not applies else bool(value < limit)
    return {"name": name, "value": value, "limit": limit, "unit": unit, "met": met}


def write_results(
    path: Path,
    *,
    benchmark: str,
    command: str,
    device: torch.device,
    config: Mapping[str, Any],
    results: Any,
    targets: Sequence[Mapping[str, Any]] = (),
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Write one benchmark's JSON (machine, config, raw results, targets, notes) and return it."""
    payload = {
        "benchmark": benchmark,
        "command": command,
        "machine": machine_info(device),
        "config": dict(config),
        "results": results,
        "targets": [dict(t) for t in targets],
        "notes": list(notes),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return payload


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table: numbers right-aligned, text left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells for {len(headers)} columns: {row}")
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        all(_is_number(row[i]) for row in rows if row[i] is not None) and bool(rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule, *(line(r) for r in cells)])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.3f}"
        return f"{value:.4f}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(f"\n{title}\n{format_table(headers, rows)}", flush=True)


def print_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    rows = [
        (
            t["name"],
            t["value"],
            f"< {t['limit']}{t.get('unit', '')}",
            "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED"),
        )
        for t in targets
    ]
    print_table("Targets", ("target", "value", "limit", "result"), rows)


def base_parser(description: str, *, default_out: str, default_budget_s: float) -> argparse.ArgumentParser:
    """The options every benchmark shares: --out, --quick, --device, --budget-s."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default_out),
        help=f"where to write the JSON results (default {default_out})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a reduced run (tiny model, few sizes, few repetitions) that exercises "
        "every code path in seconds, on a CPU too; its figures are not results",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="where to run (default: cuda when present, else cpu)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=default_budget_s,
        help=f"time budget in seconds; repetitions shrink to fit it, sizes never "
        f"(default {default_budget_s:g})",
    )
    return parser


def before_after_parser(description: str, *, runs: str, quick: str) -> argparse.ArgumentParser:
    """The options of a benchmark that measures another checkout too (the before figures): --out,
    --repeats, --code DIR (the checkout whose ``runs`` is run; default this one) and --quick."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every scenario (default 3)")
    parser.add_argument("--code", type=Path, default=REPO_ROOT,
                        help=f"the checkout whose {runs} is run (default: this one)")
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def write_before_after(args: argparse.Namespace, benchmark: str, config: Mapping[str, Any], results: Any,
                       targets: Sequence[Mapping[str, Any]]) -> int:
    """Write a ``before_after_parser`` benchmark's JSON, say where, and return its exit status (1 when
    a target was missed)."""
    code = args.code.resolve()
    write_results(args.out, benchmark=benchmark, command=command_line(), device=torch.device("cpu"),
                  config={**config, "repeats": args.repeats, "quick": args.quick, "code": str(code),
                          "code_commit": checkout_commit(code)},
                  results=results, targets=targets,
                  notes=["figures from --quick are a smoke run"] if args.quick else [])
    print(f"\nwrote {args.out}")
    return 0 if all(t["met"] is not False for t in targets) else 1


def checkout_commit(folder: Path) -> str:
    done = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True)
    return done.stdout.strip() or "unknown"


def command_line() -> str:
    """The command that produced a result, as a user would retype it."""
    script = Path(sys.argv[0])
    with suppress(ValueError):  # a script outside the repository keeps its path as given
        script = script.resolve().relative_to(REPO_ROOT)
    return " ".join(["python3", str(script), *sys.argv[1:]])
