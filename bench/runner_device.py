"""Where a runner step's time goes on the device: its graph against the bare loop's, replay by replay.

``gpu_decode`` found the decode runner with its checks off slower than the bare graph loop on the
H200 while its host path had not grown (``runner_host``), so the extra time is in what its graphs
run. Each graph of the runner carries the checks' own work: the copy of its per-step inputs into
their shadows (``PerStepInputs.snapshot``, the stale-input check's previous values), captured as a
prologue. It was forked onto a side stream and joined inside the graph, which this benchmark found
to cost 1-2.5% of a step; it now runs in line. It captures the same model three ways and times,
interleaved, at each batch size:

* ``bare`` / ``bare replay``: the hand-written loop (copy in, replay, clone out) and its graph's
  replay alone;
* ``runner`` / ``runner replay``: ``DecodeRunner`` as shipped (checks off, recorder on: the prologue
  in line with the model's kernels) and the replay of its graph alone (no host path at all: only
  what the graph runs);
* ``side`` / ``side replay``: a runner whose backend forks the prologue onto a side stream and
  joins it at the end of the graph (as the runner did before);
* ``none`` / ``none replay``: a runner captured without the prologue (no shadows: what the graph
  cost before the content-based stale check).

Every figure is the median of per-round medians of synchronised steps (CUDA events), every ratio is
to ``bare`` (or ``bare replay``) of the same round. Needs CUDA.

    python3 bench/runner_device.py --models small large --batches 1 8 64 --out $OUT/runner_device.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.bare_graphs import BareGraphLoop
from bench.common import CallTimer, command_line, temporary_recorder, time_interleaved, write_results
from bench.gpu_decode import decode_inputs, model_config
from capture_core.backends import CudaGraphBackend
from capture_core.checks import AddressCheckMode
from capture_core.events import GraphObserver
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.sizes import power_of_two_sizes


class SidePrologue(CudaGraphBackend):
    """The CUDA backend with the checks' prologue forked onto a side stream, joined at the end."""

    def with_prologue(self, fn: Callable[..., Any], prologue: Callable[[], None]) -> Callable[..., Any]:
        side = torch.cuda.Stream()

        def run(*args: Any, **kwargs: Any) -> Any:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prologue()
            outputs = fn(*args, **kwargs)
            main.wait_stream(side)
            return outputs

        return run


class NoPrologue(CudaGraphBackend):
    """The CUDA backend capturing the step alone: no per-step snapshot in the graph."""

    def with_prologue(self, fn: Callable[..., Any], prologue: Callable[[], None]) -> Callable[..., Any]:
        return fn


SIZES = power_of_two_sizes(256)
"""The capture sizes of every runner and of the bare loop, as ``gpu_decode`` captures them."""
BACKENDS: dict[str, type[CudaGraphBackend]] = {
    "runner": CudaGraphBackend, "side": SidePrologue, "none": NoPrologue,
}


def build(model: ReferenceDecoder, backend: CudaGraphBackend, observer: GraphObserver) -> DecodeRunner:
    runtime = GraphRuntime(backend, address_check=AddressCheckMode.OFF, observer=observer, progress=False)
    runner = DecodeRunner(model, runtime, SIZES, mode=CUDAGraphMode.FULL)
    runner.capture()
    return runner


def replay_of(runner: DecodeRunner, batch: int) -> Callable[[], None]:
    (entry,) = [e for d, e in runner.graphs.items() if d.num_tokens == batch]
    return entry.graph.graph.replay


def measure(name: str, batches: list[int], rounds: int, iters: int) -> dict[str, Any]:
    device = torch.device("cuda")
    config = model_config(name, device)
    model = ReferenceDecoder(config)
    timer = CallTimer(device)
    result: dict[str, Any] = {"model": name, "params": model.param_count(), "batches": []}
    with temporary_recorder(f"bench runner_device {name}") as recorder:
        runners = {label: build(model, backend(), recorder) for label, backend in BACKENDS.items()}
        bare = BareGraphLoop(model, model.new_kv_cache(), SIZES, padding_slot=config.padding_slot)
        for batch in batches:
            inputs = decode_inputs(batch, config, device)
            variants: dict[str, Callable[[], Any]] = {
                "bare": lambda b=bare, i=inputs: b.step(*i),
                "bare replay": bare.graphs[batch].replay,
            }
            for label, runner in runners.items():
                variants[label] = lambda r=runner, i=inputs: r.step(*i).clone()
                variants[f"{label} replay"] = replay_of(runner, batch)
            samples = time_interleaved(variants, timer, rounds=rounds, iters=iters, block_warmup=2)
            per_round = {label: [statistics.median(samples[label][r * iters:(r + 1) * iters])
                                 for r in range(rounds)] for label in variants}
            entry: dict[str, Any] = {"batch": batch, "median_ms": {}, "ratio": {}}
            for label, medians in per_round.items():
                base = per_round["bare replay" if label.endswith("replay") else "bare"]
                entry["median_ms"][label] = statistics.median(medians)
                entry["ratio"][label] = statistics.median(m / b for m, b in zip(medians, base, strict=True))
            result["batches"].append(entry)
            shown = "  ".join(f"{label} {entry['median_ms'][label] * 1e3:.0f}us x{entry['ratio'][label]:.3f}"
                              for label in variants)
            print(f"{name} batch {batch}: {shown}", flush=True)
        del runners, bare
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "large"], choices=("tiny", "small", "large"))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=40, help="synchronised steps per variant per round")
    parser.add_argument("--out", default="bench/results/runner_device.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("runner_device needs CUDA: it times what the runner's CUDA graphs run", file=sys.stderr)
        return 2
    wrong = [b for b in args.batches if b not in SIZES]
    if wrong:
        parser.error(f"--batches must be capture sizes (powers of two up to 256), got {wrong}")
    device = torch.device("cuda")
    results = [measure(name, args.batches, args.rounds, args.iters) for name in args.models]
    write_results(args.out, benchmark="runner_device", command=command_line(), device=device,
                  config=vars(args), results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
