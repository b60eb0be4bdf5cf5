"""What each replay check costs on the host, measured without a graph in the way.

Timing replays would bury sub-microsecond checks under the replay itself, so this times the checks
on the inputs a captured ``DecodeRunner`` graph really has (input_ids, positions, slot_ids,
kv_cache; the reference decoder's parameters and buffers), and on the inputs other engines pass (a
``kv_caches`` list of 32 and 80 layers; an attention-metadata dataclass and a dict):

* the replay guard that runs on every always-on replay, built up check by check: the identity of
  every tensor input (with each captured object's address, its shape and strides when its counter
  moved; nested inputs), then the module state (the registration count and every parameter's and
  buffer's address), then the per-step inputs (version counters, padding rows, the comparison
  waiting); and, for a call that passes Python values, the baked values (arguments and module
  attributes compared);
* the closer looks the guard hands over to: a fresh view at the captured address (shallow), a
  sampled replay's deep checks (inputs re-read, parameters and buffers re-read), the module walk
  after a registration, and the per-step inputs compared with their shadows (what a replay pays
  when a counter did not move: a writer torch does not see; on CUDA the comparison's ops and its
  read-back, at the next replay);
* one wrapper call with the replay stubbed, checks OFF against ALWAYS_ON: the checks as a step pays.

Nanoseconds per call: the median over bursts of back-to-back calls, every variant of a table
interleaved burst by burst (so a busy host slows them alike), an empty call's time subtracted.
Host time only: the checks never wait for the device (but for the per-step comparison's row, where
each call reads the previous call's result back, as the next replay does), so ``--device cuda`` on
a GPU host gives the figure a replay pays there.

    python3 bench/check_cost.py --out bench/results/check_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import command_line, print_table, resolve_device, write_results
from capture_core.baked import BakedValues
from capture_core.canary import Sampling
from capture_core.checks import AddressCheckMode, ParameterNames
from capture_core.forward_context import ForwardContext, use_forward_context
from capture_core.guard import ReplayChecks
from capture_core.inputs import InputLayout
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.runner import DecodeRunner
from capture_core.runtime import GraphRuntime
from capture_core.stale import PerStepInputs
from capture_core.state import REGISTRATIONS, ModuleState

NEVER = Sampling(first=0, every=0)
"""No sampled replays: the guard alone is timed."""


def interleaved(variants: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Median ns per call of each variant, bursts interleaved, the empty call's median subtracted."""
    variants = {"(empty call)": lambda: None, **variants}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            started = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter_ns() - started) / calls)
    empty = statistics.median(samples.pop("(empty call)"))
    return {name: statistics.median(values) - empty for name, values in samples.items()}


def per_layer_step(input_ids, positions, slot_ids, kv_caches):
    """Stands for an engine whose model takes one KV cache tensor per layer."""


@dataclass
class AttentionMetadata:
    """Stands for an engine's attention metadata: tensors as fields of a dataclass."""

    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int


def metadata_step(input_ids, positions, metadata, *, extras):
    """Stands for a model called with nested inputs."""


class Sampler(torch.nn.Module):
    """Stands for a model called with Python values (a temperature, a flag, a top-k) that reads three
    plain attributes of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.scaling, self.adapter, self.greedy_default = 1.0, "base", False

    def forward(self, x, temperature, greedy, *, top_k, bias):
        return x / temperature + bias


def guard_of(layout: InputLayout, **parts: Any) -> Callable[[tuple[Any, ...], dict[str, Any], int], bool]:
    """The replay guard of a graph with these inputs and these of the other checks."""
    options = {"check_inputs": True, "state": None, "per_step": None, "mutated": None, "sampling": NEVER}
    return ReplayChecks(layout, **{**options, **parts}).clean


def lagging(per_step: PerStepInputs | None) -> Callable[[], None]:
    """Stands for a step's copy_ into its per-step inputs: the guard's version cells are set back,
    so the stale terms pass (three list stores, timed on their own and subtracted)."""
    cells = [cell for _, cell in per_step.versioned] if per_step is not None else []

    def written() -> None:
        for cell in cells:
            cell[0] = -1

    return written


Timed = Callable[[], object]


class Tables:
    """Rows of ns per call; each table's variants timed interleaved against each other."""

    def __init__(self, calls: int, repeats: int) -> None:
        self.calls, self.repeats = calls, repeats
        self.rows: list[dict[str, Any]] = []

    def add(self, section: str, variants: dict[str, tuple[int, Timed]], base: str = "") -> None:
        timed = interleaved({name: fn for name, (_, fn) in variants.items()}, self.calls, self.repeats)
        for name, (inputs, _) in variants.items():
            if name != base:
                ns = timed[name] - (timed[base] if base else 0.0)
                self.rows.append({"section": section, "what": name, "inputs": inputs, "ns_per_call": ns})


def measure(device: torch.device, calls: int, repeats: int) -> list[dict[str, Any]]:
    config = ModelConfig.tiny(max_num_seqs=8, max_seq_len=16, device=str(device))
    runtime = GraphRuntime("eager", progress=False, sampling=NEVER)
    runner = DecodeRunner(ReferenceDecoder(config), runtime, [8])
    runner.capture()
    descriptor = runner.route(8).descriptor
    entry = runner.graphs[descriptor]
    views = runner.buffers.views(8)
    args = (views["input_ids"], views["positions"], views["slot_ids"], runner.kv_cache)
    kw: dict[str, Any] = {}
    layout, checks = entry.checks.layout, entry.checks
    state = ModuleState(runner.model)
    runner.step(*(torch.arange(8, device=device) for _ in range(3)))  # a step: its rows' status is known
    per_step = checks.per_step
    written = lagging(per_step)
    tables = Tables(calls, repeats)

    addresses = guard_of(layout)
    with_state = guard_of(layout, state=state)
    everything = guard_of(layout, state=state, per_step=per_step)
    stores = "stores standing for the step's writes"
    real = 8  # the step's real tokens: the bucket's size, no padding row

    def after_write(guard: Callable[..., bool]) -> Timed:
        return lambda: (written(), guard(args, kw, real))

    tables.add("replay guard, runner graph", {
        stores: (0, written),
        "addresses + layouts (identity of every tensor input)": (4, after_write(addresses)),
        "+ module state (registration count, every parameter's address)": (4, after_write(with_state)),
        "+ stale inputs (3 version counters, padding rows): the runner's": (4, after_write(everything)),
    }, base=stores)

    module = Sampler().to(device)
    call_args = (torch.ones(8, device=device), 0.7, False)
    call_kwargs: dict[str, Any] = {"top_k": 5, "bias": torch.zeros(8, device=device)}
    names = ParameterNames.of(module)
    sampler_layout = InputLayout.record(names, call_args, call_kwargs)
    baked = BakedValues(names, (call_args, call_kwargs), module, ())
    without, with_baked = guard_of(sampler_layout), guard_of(sampler_layout, baked=baked)
    tables.add("baked values (3 Python arguments, 3 module attributes)", {
        "replay guard, tensor inputs only": (2, lambda: without(call_args, call_kwargs, 8)),
        "replay guard with the baked values": (2, lambda: with_baked(call_args, call_kwargs, 8)),
    })

    for layers in (32, 80):
        layer_args = (*args[:3], [torch.zeros(4, device=device) for _ in range(layers)])
        layer_layout = InputLayout.record(ParameterNames.of(per_layer_step), layer_args, {})
        guard, count = guard_of(layer_layout), len(layer_layout.inputs)
        tables.add(f"kv_caches list of {layers} layers", {
            "replay guard": (count, lambda g=guard, a=layer_args: g(a, kw, 8)),
            "closer look": (count, lambda la=layer_layout, a=layer_args: la.find_changes(a, kw)),
        })

    metadata = AttentionMetadata(*(torch.zeros(8, dtype=torch.long, device=device) for _ in range(4)), 8)
    nested_args = (args[0], args[1], metadata)
    nested_kwargs = {"extras": {"bias": torch.zeros(8, device=device), "scale": torch.ones(1, device=device)}}
    nested = InputLayout.record(ParameterNames.of(metadata_step), nested_args, nested_kwargs)
    nested_guard = guard_of(nested)
    tables.add("nested inputs (a dataclass of 4 tensors, a dict of 2)", {
        "replay guard": (len(nested.inputs), lambda: nested_guard(nested_args, nested_kwargs, 8)),
    })

    fresh = (views["input_ids"][:8], *args[1:])  # a new view object at the captured layout
    inspect = checks.inspect

    def after_registration() -> object:
        REGISTRATIONS[0] += 1  # as one assignment of a parameter anywhere in the process would
        return state.find_changes()

    held = len(state.tensors)
    written_runner = lagging(checks.per_step)
    tables.add("closer looks (runner graph)", {
        "a fresh view at the captured layout (shallow)": (4, lambda: layout.find_changes(fresh, kw)),
        "sampled replay: inputs re-read (deep)": (4, lambda: layout.find_changes(args, kw, deep=True)),
        f"sampled replay: {held} parameters and buffers re-read": (held, state.find_changes),
        "after a registration: the module walked by name": (held, after_registration),
        "one whole inspect (inputs, state, stale)": (
            4, lambda: (written_runner(), inspect(args, kw, real, False))
        ),
        "per-step inputs compared with their shadows (no counter moved)": (
            3, lambda: checks.per_step.inspect(args, kw, real, False, 1)
        ),
    })
    runtime.settle_checks()

    graph = entry.graph
    real_replay = graph.replay
    graph.replay = lambda: None

    def call_with(mode: AddressCheckMode) -> Callable[[], object]:
        def call() -> object:
            runtime.address_check = mode
            written_runner()
            return runner.graphed(*args)

        return call

    wrapper = "wrapper call, replay stubbed (runner graph)"
    try:
        with use_forward_context(ForwardContext(CUDAGraphMode.FULL, descriptor, 8)):
            tables.add(wrapper, {
                "check OFF": (4, call_with(AddressCheckMode.OFF)),
                "check ALWAYS_ON": (4, call_with(AddressCheckMode.ALWAYS_ON)),
            })
    finally:
        graph.replay = real_replay
        runtime.address_check = AddressCheckMode.ALWAYS_ON
    paid = {r["what"]: r["ns_per_call"] for r in tables.rows if r["section"] == wrapper}
    tables.rows.append({
        "section": wrapper, "what": "ALWAYS_ON - OFF: every check as a step pays", "inputs": 4,
        "ns_per_call": paid["check ALWAYS_ON"] - paid["check OFF"],
    })
    return tables.rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/check_cost.json"))
    parser.add_argument("--device", default="cpu", help="where the runner's tensors live: cpu, cuda or auto")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed burst (default 2000)")
    parser.add_argument("--repeats", type=int, default=60, help="bursts per variant (default 60)")
    parser.add_argument("--quick", action="store_true", help="200 calls, 3 bursts: a check that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.repeats = 200, 3
    device = resolve_device(args.device)
    torch.set_num_threads(1)
    results = measure(device, args.calls, args.repeats)
    print_table(
        f"Replay checks on the host ({device}; median ns per call, interleaved, empty call subtracted)",
        ("section", "what", "inputs", "ns"),
        [(r["section"], r["what"], r["inputs"], r["ns_per_call"]) for r in results],
    )
    write_results(
        args.out, benchmark="check_cost", command=command_line(), device=device,
        config={"calls": args.calls, "repeats": args.repeats}, results=results,
        notes=["host time: the checks never wait for the device, so this is what a replay pays on this host"],
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
