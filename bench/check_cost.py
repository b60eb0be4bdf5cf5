"""What the always-on address check costs per replay, measured on a CPU.

Timing replays on the eager backend would bury a sub-microsecond check under a whole model run, so
this times the check itself - ``InputLayout.find_drift`` over the exact inputs a captured
``DecodeRunner`` graph baked in (input_ids, positions, slot_ids, kv_cache) - and, for engines that
pass one KV cache per layer, over a ``kv_caches`` list of 32 and 80 layers. It also times one
wrapper call with the replay stubbed out, check OFF against ALWAYS_ON, which is the check's cost
as a step pays it. The fastest of repeated batches of back-to-back calls, in nanoseconds per call,
with an empty call's time subtracted.

    python3 bench/check_cost.py --out bench/results/check_cost.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import command_line, print_table, write_results
from capture_core.checks import AddressCheckMode, InputLayout, ParameterNames
from capture_core.forward_context import ForwardContext, use_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime


def ns_per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """The fastest of ``repeats`` batches of ``calls`` back-to-back calls, per call.

    The minimum, not the median: on a shared host other processes only ever add time, so the
    fastest batch is the closest to what the check itself costs (the median is kept in the JSON
    of the GPU benchmark, where the host is quiet).
    """
    samples = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - started) / calls)
    return min(samples)


def per_layer_step(input_ids, positions, slot_ids, kv_caches):
    """Stands for an engine whose model takes one KV cache tensor per layer."""


def measure(calls: int, repeats: int) -> list[dict[str, Any]]:
    config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=16, num_layers=1)
    runner = DecodeRunner(ReferenceDecoder(config), GraphRuntime("eager", progress=False), [8])
    runner.capture()
    descriptor = runner.route(8).descriptor
    entry = runner.graphs[descriptor]
    views = runner.buffers.views(8)
    args = (views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)

    def baseline() -> None:
        return None

    rows = []
    empty_call = ns_per_call(baseline, calls, repeats)
    layout = entry.layout
    rows.append(("runner graph inputs", len(layout.inputs), ns_per_call(lambda: layout.find_drift(args, {}),
                                                                         calls, repeats) - empty_call))
    for layers in (32, 80):
        caches = [torch.zeros(4) for _ in range(layers)]
        layer_args = (*args[:3], caches)
        layer_layout = InputLayout.record(ParameterNames.of(per_layer_step), layer_args, {})
        rows.append((f"kv_caches list of {layers} layers", len(layer_layout.inputs),
                     ns_per_call(lambda la=layer_layout, a=layer_args: la.find_drift(a, {}), calls, repeats)
                     - empty_call))

    # The check as a step pays it: one wrapper call (replay stubbed), check OFF vs ALWAYS_ON.
    graph, runtime = entry.graph, runner.runtime
    real_replay = graph.replay
    graph.replay = baseline
    try:
        with use_forward_context(ForwardContext(CUDAGraphMode.FULL, descriptor, 8)):
            runtime.address_check = AddressCheckMode.OFF
            off = ns_per_call(lambda: runner.graphed(*args), calls, repeats)
            runtime.address_check = AddressCheckMode.ALWAYS_ON
            on = ns_per_call(lambda: runner.graphed(*args), calls, repeats)
    finally:
        graph.replay = real_replay
    results = [{"what": what, "inputs": n, "check_ns_per_call": ns} for what, n, ns in rows]
    results.append({"what": "wrapper call, check OFF (replay stubbed)", "inputs": len(layout.inputs),
                    "wrapper_ns_per_call": off - empty_call})
    results.append({"what": "wrapper call, check ALWAYS_ON (replay stubbed)", "inputs": len(layout.inputs),
                    "wrapper_ns_per_call": on - empty_call, "check_ns_per_call": on - off})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/check_cost.json"))
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed batch (default 20000)")
    parser.add_argument("--repeats", type=int, default=15, help="timed batches (default 15)")
    args = parser.parse_args(argv)
    results = measure(args.calls, args.repeats)
    print_table(
        "Always-on address check on a CPU (ns per call, empty-call time subtracted)",
        ("what", "inputs", "check ns", "wrapper ns"),
        [(r["what"], r["inputs"], r.get("check_ns_per_call"), r.get("wrapper_ns_per_call")) for r in results],
    )
    write_results(
        args.out, benchmark="check_cost", command=command_line(), device=torch.device("cpu"),
        config={"calls": args.calls, "repeats": args.repeats}, results=results,
        notes=["CPU host time: the check never touches the device, so this is its cost on a GPU host too "
               "(scaled by that host's single-thread speed)"],
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
