"""Wrapper overhead floor: what ``CUDAGraphWrapper`` adds to a bare ``CUDAGraph.replay()``.

A one-kernel graph is the worst case for a wrapper: the GPU work is negligible, so every host
nanosecond the wrapper spends (forward-context read, dictionary lookup, replay guard, observer
call) shows. This measures host microseconds per call over short bursts of back-to-back calls
(short enough that the launch queue never fills, so the figure is the host's cost of issuing the
call and not the GPU's pace), all variants interleaved burst by burst in one run:

* ``bare replay()``: the limit, ``torch.cuda.CUDAGraph.replay`` called directly; and (on CUDA) the C
  method under it, past torch's Python frame, as the wrapper calls it
  (``capture_core.backends.direct_replay``): what is added is given against the former;
* the wrapper with the checks off, with the always-on checks of its one tensor input (address,
  layout; the default), then with each further always-on check: the wrapped module's state (the
  kernel as an ``nn.Module`` with a buffer), a declared per-step input (its version counter; the
  variant also sets the guard's version cell back, three list stores standing for the step's
  write), and in debug mode (every check and the canary on every replay; no per-step input, whose
  debug check needs a real write);
* the default wrapper with a real inspector ``Recorder`` as observer (writing into SQLite in a temp
  dir), and with ``set_forward_context`` entered per call, as the decode runner does once per step.

What a variant adds (``added_us``) is the median over rounds of its burst less the bare burst of
the same round: the host's pace drifts between rounds by more than the differences measured (run 5
on the H200: bare bursts 2.8-5.4 us a call, p10-p90), and a round's bursts run back to back. The
difference of the two medians is kept beside it (``added_of_medians_us``).

Target: the wrapper (always-on checks) adds under 1 us per call to a bare replay.

On a host without CUDA (``--quick`` for the tests) the eager backend stands in and the "bare"
variant is a direct call of the kernel function; those figures exercise the code, they are not
graph figures.

    python3 bench/gpu_overhead.py --out bench/results/gpu_overhead.json
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.check_cost import lagging
from bench.common import (
    Budget,
    Stats,
    base_parser,
    command_line,
    host_us_per_call,
    print_table,
    print_targets,
    resolve_device,
    target,
    temporary_recorder,
    write_results,
)
from capture_core.backends import EagerBackend, direct_replay
from capture_core.checks import AddressCheckMode
from capture_core.descriptor import BatchDescriptor
from capture_core.events import GraphObserver
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper

DESCRIPTOR = BatchDescriptor(num_tokens=1, num_reqs=1, uniform=True)
BARE = "bare replay()"
BARE_C = "bare replay(), torch's C method"
TARGET_VARIANT = "wrapper, always-on check"
TARGET_ADDED_US = 1.0


def one_kernel(x: torch.Tensor) -> torch.Tensor:
    """The graph's whole work: one elementwise kernel on a small tensor."""
    return x.mul(2.0)


def bare_graph(x: torch.Tensor) -> torch.cuda.CUDAGraph | None:
    """A bare CUDA graph of ``one_kernel`` (warmed up on a side stream first); None off CUDA."""
    if x.device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one_kernel(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_kernel(x)
    graph.replay()
    torch.cuda.synchronize()
    return graph


class OneKernel(torch.nn.Module):
    """``one_kernel`` with a scale held as a buffer: a wrapped module, whose state is checked."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((), 2.0, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul(self.scale)


def captured_wrapper(
    x: torch.Tensor,
    check: AddressCheckMode,
    observer: GraphObserver | None,
    *,
    runnable: Callable[[torch.Tensor], torch.Tensor] = one_kernel,
    per_step: bool = False,
) -> CUDAGraphWrapper:
    """A wrapper around ``runnable`` with its one graph captured, capture then locked."""
    backend: Any = "cuda" if x.device.type == "cuda" else EagerBackend()
    runtime = GraphRuntime(backend, address_check=check, observer=observer, progress=False)
    wrapper = CUDAGraphWrapper(
        runnable, runtime, CUDAGraphMode.FULL, name="one_kernel", per_step_inputs=["x"] if per_step else ()
    )
    with runtime.capture_phase(), set_forward_context(CUDAGraphMode.FULL, DESCRIPTOR):
        wrapper(x)
    return wrapper


def written_each_call(wrapper: CUDAGraphWrapper, x: torch.Tensor) -> Callable[[], object]:
    """The wrapper called after its per-step input's version cell is set back (the step's write)."""
    entry = next(iter(wrapper.graphs.values()))
    written = lagging(entry.checks.per_step)

    def call() -> object:
        written()
        return wrapper(x)

    return call


def with_context_per_call(wrapper: CUDAGraphWrapper, x: torch.Tensor) -> Callable[[], object]:
    def call() -> object:
        with set_forward_context(CUDAGraphMode.FULL, DESCRIPTOR, 1):
            return wrapper(x)

    return call


def run(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    budget = Budget(args.budget_s)
    calls = 20 if args.quick else args.calls
    notes: list[str] = []
    if device.type != "cuda":
        notes.append(
            "no CUDA here: the eager backend stands in and 'bare replay()' is a direct call of the "
            "kernel function; these figures exercise the code paths, they are not graph figures"
        )
    x = torch.ones(1024, device=device)

    with ExitStack() as stack:
        recorder = stack.enter_context(temporary_recorder("bench gpu_overhead"))
        on = AddressCheckMode.ALWAYS_ON
        wrapped = {
            "wrapper, check off": captured_wrapper(x, AddressCheckMode.OFF, None),
            TARGET_VARIANT: captured_wrapper(x, on, None),
            "wrapper, always-on + module state": captured_wrapper(x, on, None, runnable=OneKernel(x.device)),
            "wrapper, always-on + recorder": captured_wrapper(x, on, recorder),
        }
        graph = bare_graph(x)
        variants: dict[str, Callable[[], object]] = {
            BARE: (lambda: one_kernel(x)) if graph is None else (lambda: graph.replay())
        }
        if graph is not None:  # what the wrapper calls: the C method, past torch's Python frame
            variants[BARE_C] = direct_replay(graph)
        for name, wrapper in wrapped.items():
            variants[name] = lambda w=wrapper: w(x)
        stale = captured_wrapper(x, on, None, runnable=OneKernel(x.device), per_step=True)
        variants["wrapper, always-on + module state + stale input"] = written_each_call(stale, x)
        debug = captured_wrapper(x, AddressCheckMode.DEBUG, None, runnable=OneKernel(x.device))
        variants["wrapper, debug mode (every check, the canary)"] = lambda: debug(x)
        variants["wrapper + forward context per call"] = with_context_per_call(wrapped[TARGET_VARIANT], x)

        # The forward context every wrapper variant reads, set once as an engine sets it per step.
        stack.enter_context(set_forward_context(CUDAGraphMode.FULL, DESCRIPTOR, 1))
        probe = {
            name: Stats.of(host_us_per_call(fn, calls=calls, repeats=3, device=device)).median
            for name, fn in variants.items()
        }
        per_burst_s = sum(probe.values()) * calls / 1e6
        repeats = (
            5
            if args.quick
            else Budget.reps_for(budget.left * 0.8, per_burst_s, floor=20, ceiling=args.repeats)
        )
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                samples[name].extend(host_us_per_call(fn, calls=calls, repeats=1, device=device))

    bare = Stats.of(samples[BARE]).median
    rows = []
    for name, values in samples.items():
        stats = Stats.of(values)
        paired = [v - b for v, b in zip(values, samples[BARE], strict=True)]
        rows.append(
            {
                "variant": name,
                **stats.as_dict("us"),
                "added_us": Stats.of(paired).median,
                "added_of_medians_us": stats.median - bare,
                "ratio_to_bare": stats.median / bare,
            }
        )
    added = next(r["added_us"] for r in rows if r["variant"] == TARGET_VARIANT)
    targets = [
        target(
            f"{TARGET_VARIANT}: host us added per call",
            added,
            TARGET_ADDED_US,
            unit=" us",
            applies=device.type == "cuda",
        )
    ]
    config = {
        "device": str(device),
        "backend": "cuda" if device.type == "cuda" else "eager",
        "calls_per_burst": calls,
        "bursts_per_variant": repeats,
        "kernel": "x.mul(2.0) on 1024 float32",
        "quick": args.quick,
    }
    payload = write_results(
        args.out,
        benchmark="gpu_overhead",
        command=command_line(),
        device=device,
        config=config,
        results=rows,
        targets=targets,
        notes=notes,
    )
    print_table(
        f"Wrapper overhead floor ({device}, {calls} calls a burst, {repeats} bursts each; host us per call)",
        ("variant", "median us", "p10 us", "p90 us", "added us", "x bare"),
        [
            (r["variant"], r["median_us"], r["p10_us"], r["p90_us"], r["added_us"], r["ratio_to_bare"])
            for r in rows
        ],
    )
    for note in notes:
        print(f"note: {note}")
    print_targets(targets)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        __doc__.split("\n\n")[0], default_out="bench/results/gpu_overhead.json", default_budget_s=30
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=200,
        help="calls per timed burst: short enough that the launch queue never fills",
    )
    parser.add_argument("--repeats", type=int, default=400, help="most bursts per variant")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
