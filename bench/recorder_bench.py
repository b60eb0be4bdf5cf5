"""What recording costs the engine: the recorder's hot path against a bare dict bump, events per
second on one core, how fast the flush thread writes rows into SQLite, and what a scrape costs.

The hot path is timed as the engine calls it: one observer call per replayed batch, with the
descriptor objects a dispatcher makes (equal, not identical, to the captured ones), while the
recorder's flush thread is running and writing windows into a real SQLite file. The baseline is
an observer whose ``on_replay`` is one ``dict`` bump keyed by (mode, descriptor), the least any
per-graph counter can do; the variants are timed interleaved in rounds, pinned to one core. A
rank of a job also keeps its step sequence (one list append per batch, drained and written by
the flush thread), timed as its own variant.

    python3 bench/recorder_bench.py --out bench/results/recorder.json
    python3 bench/recorder_bench.py --quick --out /tmp/recorder.json     # seconds; not results
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common
from capture_core.descriptor import BatchDescriptor
from capture_core.events import NullObserver, ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import vllm_default_sizes

FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
RANK_VARIANT = "recorder.on_replay, rank of a job (step sequence)"


class BareCounter:
    """The baseline: one dict bump per replay, keyed by the graph."""

    def __init__(self) -> None:
        self.counts: dict[tuple[CUDAGraphMode, BatchDescriptor], int] = {}

    def on_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor, num_real_tokens: int) -> None:
        key = (mode, descriptor)
        self.counts[key] = self.counts.get(key, 0) + 1


def pin_to_one_core() -> int | None:
    """Run on one core (the flush thread shares it, as it would share the engine's)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def traffic(n: int, seed: int = 0) -> list[tuple[CUDAGraphMode, BatchDescriptor, int]]:
    """Replay events as a dispatcher produces them: vLLM's sizes, decode and mixed batches."""
    rng = random.Random(seed)
    sizes = vllm_default_sizes(256)
    events = []
    for _ in range(n):
        index = rng.randrange(len(sizes))
        size = sizes[index]
        real = rng.randint(sizes[index - 1] + 1 if index else 1, size)
        if rng.random() < 0.7:
            events.append((FULL, BatchDescriptor(size, size, True), real))
        else:
            events.append((PIECEWISE, BatchDescriptor(size, None), real))
    return events


def per_event_ns(fn: Callable[[CUDAGraphMode, BatchDescriptor, int], None], events: list) -> float:
    start = time.perf_counter_ns()
    for mode, descriptor, real in events:
        fn(mode, descriptor, real)
    return (time.perf_counter_ns() - start) / len(events)


def hot_path(recorder: Any, rank_recorder: Any, events: list, rounds: int) -> dict[str, Any]:
    variants: dict[str, Callable[..., None]] = {
        "null observer (call floor)": NullObserver().on_replay,
        "bare dict bump": BareCounter().on_replay,
        "recorder.on_replay": recorder.on_replay,
        RANK_VARIANT: rank_recorder.on_replay,
    }
    for fn in variants.values():  # warm up: fill the dicts, settle the caches
        per_event_ns(fn, events)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(per_event_ns(fn, events))
    return {
        name: {"median_ns": statistics.median(v), "min_ns": min(v), "rounds": len(v)}
        for name, v in samples.items()
    }


def flush_throughput(graphs: int, repeats: int) -> dict[str, Any]:
    """Rows per second the writer commits: one flush of ``graphs`` graph keys' windows and totals."""
    from inspector.recording.batch import FlushBatch, ReplayDelta, TrafficWindow, graph_key
    from inspector.recording.losses import Losses
    from inspector.storage.store import open_store
    from inspector.storage.writer import RunInfo, RunWriter

    results = []
    with tempfile.TemporaryDirectory(prefix="graph-inspector-bench-") as tmp:
        store = open_store(f"sqlite:///{tmp}/flush.db")
        info = RunInfo("bench", "host", os.getpid(), "bench", 0, 1, "cpu", "{}", time.time())
        writer = RunWriter(store, info)
        writer.create_run(time.time(), "eager")
        descriptors = [BatchDescriptor(t, t, True) for t in range(1, graphs + 1)]
        for repeat in range(repeats):
            now = time.time()
            batch_traffic = TrafficWindow(now - 1.0, now)
            for descriptor in descriptors:
                delta = ReplayDelta(
                    FULL, descriptor, replays=100, num_real_tokens=100 * descriptor.captured_size - 7
                )
                batch_traffic.replays[graph_key(FULL, descriptor)] = delta
                batch_traffic.batch_sizes[descriptor.num_tokens] = 100
            violations = {}
            batch = FlushBatch([], violations, batch_traffic, "eager", losses=Losses())
            start = time.perf_counter()
            writer.write(batch, now)
            seconds = time.perf_counter() - start
            # Windows, batch sizes and one running total per graph key (inserted on the first
            # flush, updated in place after).
            rows = len(batch_traffic.replays) * 2 + len(batch_traffic.batch_sizes)
            results.append({"repeat": repeat, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds})
        store.dispose()
    steady = [r["rows_per_s"] for r in results[1:]] or [results[0]["rows_per_s"]]
    return {"graphs": graphs, "runs": results, "rows_per_s_median": statistics.median(steady)}


def violation_throughput(count: int) -> dict[str, Any]:
    """A drift storm (the always-on check on every replay): events/s through the recorder to disk."""
    from inspector.recording.recorder import Recorder

    descriptor = BatchDescriptor(8, 8, True)
    event = ViolationEvent(ViolationKind.ADDRESS_DRIFT, descriptor, FULL, "bench", "drift", "x", 1, 2)
    with tempfile.TemporaryDirectory(prefix="graph-inspector-bench-") as tmp:
        recorder = Recorder(f"sqlite:///{tmp}/v.db", flush_interval=0.5).start()
        start = time.perf_counter()
        for _ in range(count):
            recorder.on_violation(event)
        recorder.flush(timeout=60)
        seconds = time.perf_counter() - start
        recorder.close()
    return {"events": count, "seconds": seconds, "events_per_s": count / seconds, "dropped": recorder.dropped}


def scrape_cost(windows: int) -> dict[str, Any]:
    """Seconds per scrape on a database holding ``windows`` replay-window rows (it never reads them)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from inspector.reading.metrics import InspectorCollector
    from inspector.recording.batch import ReplayDelta, TrafficWindow, graph_key
    from inspector.recording.recorder import Recorder
    from inspector.storage.store import open_store
    from inspector.storage.writer import KnownTotals, append_traffic

    with tempfile.TemporaryDirectory(prefix="graph-inspector-bench-") as tmp:
        url = f"sqlite:///{tmp}/scrape.db"
        with Recorder(url) as recorder:
            for mode, descriptor, real in traffic(2000):
                recorder.on_replay(mode, descriptor, real)
        store = open_store(url)
        descriptor, run_id = BatchDescriptor(8, 8, True), recorder.run_id
        key = graph_key(FULL, descriptor)
        for start in range(0, windows, 50_000):
            rows = [
                TrafficWindow(float(i), i + 1.0, replays={key: ReplayDelta(FULL, descriptor, 10, 70)})
                for i in range(start, min(windows, start + 50_000))
            ]
            with store.writer() as conn:
                append_traffic(conn, run_id, rows, {}, KnownTotals.of_run(conn, run_id), 1.0)
        registry = CollectorRegistry()
        registry.register(InspectorCollector(store))
        generate_latest(registry)
        timings = []
        for _ in range(10):
            started = time.perf_counter()
            generate_latest(registry)
            timings.append(time.perf_counter() - started)
        store.dispose()
    return {"windows": windows, "seconds_median": statistics.median(timings), "seconds_max": max(timings)}


def main() -> int:
    parser = common.base_parser(
        __doc__.splitlines()[0], default_out="bench/results/recorder.json", default_budget_s=120
    )
    args = parser.parse_args()
    core = pin_to_one_core()
    n_events = 20_000 if args.quick else 200_000
    rounds = 3 if args.quick else 15
    events = traffic(n_events)
    with (
        common.temporary_recorder("recorder-bench", job="") as recorder,
        common.temporary_recorder("recorder-bench rank", job="", step_sequence=True) as rank_recorder,
    ):
        hot = hot_path(recorder, rank_recorder, events, rounds)
    flush = flush_throughput(graphs=200 if args.quick else 2000, repeats=3 if args.quick else 10)
    storm = violation_throughput(20_000 if args.quick else 500_000)
    scrape = scrape_cost(20_000 if args.quick else 1_000_000)

    bare = hot["bare dict bump"]["median_ns"]
    ours = hot["recorder.on_replay"]["median_ns"]
    ratio = ours / bare
    rank_ratio = hot[RANK_VARIANT]["median_ns"] / bare
    events_per_s = 1e9 / ours
    targets = [
        common.target("recorder / bare dict bump, per replay event", ratio, 1.5, unit="x"),
        common.target("rank recorder (step sequence) / bare dict bump, per replay event", rank_ratio, 1.5,
                      unit="x"),
        common.target("recorder ns per replay event (> 1e6 events/s on one core)", ours, 1000.0, unit=" ns"),
    ]
    notes = [
        f"pinned to core {core}" if core is not None else "not pinned (no sched_setaffinity here)",
        "hot path timed while the recorder's flush thread writes a real SQLite file every second",
    ]
    if args.quick:
        notes.append("--quick: a dry run of every code path; its figures are not results")
    common.write_results(
        args.out,
        benchmark="recorder_bench",
        command=common.command_line(),
        device=torch.device("cpu"),
        config={"events": n_events, "rounds": rounds, "quick": args.quick},
        results={
            "hot_path": hot,
            "ratio_to_bare": ratio,
            "rank_ratio_to_bare": rank_ratio,
            "events_per_s": events_per_s,
            "flush": flush,
            "violation_storm": storm,
            "scrape": scrape,
        },
        targets=targets,
        notes=notes,
    )
    print(f"results written to {args.out}")
    common.print_table(
        "Hot path, ns per replay event (median of rounds)",
        ("variant", "median ns", "min ns", "x bare"),
        [(name, v["median_ns"], v["min_ns"], v["median_ns"] / bare) for name, v in hot.items()],
    )
    common.print_table(
        "Writes",
        ("what", "value"),
        [
            ("replay events/s on one core (recorder)", events_per_s),
            (
                f"flush rows/s into SQLite ({flush['graphs']} graph keys per flush)",
                flush["rows_per_s_median"],
            ),
            ("violation events/s to disk (one finding, de-duplicated)", storm["events_per_s"]),
            (f"scrape seconds with {scrape['windows']} window rows", scrape["seconds_median"]),
        ],
    )
    common.print_targets(targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
