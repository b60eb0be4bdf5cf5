"""The vLLM integration's host cost per step, on a CPU, with vLLM 0.25's own classes.

What the integration adds to a vLLM step is host work: the step's decision recorded, and on every
graph call the hook on vLLM's ``CUDAGraphWrapper.__call__``, the twin's lookup and replay guard, and
the call on to vLLM. This measures that work alone, side by side in one process:

* **off**: vLLM's wrappers called as vLLM calls them, with no hook installed;
* **on**: the same calls with the integration installed (recording into a real SQLite file, its
  flush thread running), the step's decision recorded as vLLM's runner hook records it.

vLLM's ``CUDAGraphWrapper`` objects, its ``ForwardContext`` and ``BatchDescriptor`` are the real
ones; the body of vLLM's ``__call__`` (its ``torch.cuda.graph`` replay, which needs a GPU) is stood
in for in both arms by the same function: find the graph entry for the descriptor and hand back its
static output, the host work vLLM's own replay path does besides ``graph.replay()``. A step is one
PIECEWISE forward: ``--pieces`` pieces of ``--inputs`` positional inputs each (the hidden states and
the weights torch.compile lifts into each piece), as vLLM's piecewise backend calls them.

``--runner v2`` measures the V2 model runner's decode step instead: vLLM's own
``dispatch_cg_and_sync_dp`` and ``ModelCudaGraphManager.run_fullgraph`` (the graph's ``replay()`` a
no-op), a model of ``--layers`` decoder layers whose weights are vLLM's own parameter class (a
``__torch_function__`` subclass, as the real model's), the runner's persistent input buffers, block
tables and one KV cache a layer. "off" there is the same calls with the hooks paused
(``hooks.paused``): exactly vLLM's own code.

Rounds alternate off and on (``--rounds``, each ``--steps`` steps after a warm-up); the figures are
the medians of the per-round microseconds per step and their difference, in CPU time of the process
(all its threads), so that other work on a shared host moves them less than wall time. Needs vLLM importable
(``pip install vllm==0.25.1 --no-deps`` and its Python dependencies suffice: no GPU is used).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

TREE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TREE))

from bench.common import command_line, write_results  # noqa: E402

SIZES = (8, 16, 32, 64)


class Piece:
    """A compiled piece as vLLM's piecewise backend presents it: its index among the pieces, its
    inputs (the hidden states, then weights), one static output."""

    def __init__(self, index: int, total: int, width: int) -> None:
        self.piecewise_compile_index, self.total_piecewise_compiles = index, total
        self.out = torch.zeros(max(SIZES), width)

    def __call__(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return self.out[: x.shape[0]]


def replay_body(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for the body of vLLM's ``CUDAGraphWrapper.__call__`` (both arms): the forward
    context read, the entry found by descriptor, its output handed back (the first call 'captures')."""
    from vllm.forward_context import get_forward_context

    forward = get_forward_context()
    entries = wrapper.concrete_cudagraph_entries
    entry = entries.get(forward.batch_descriptor)
    if entry is None:
        entry = entries[forward.batch_descriptor] = wrapper.runnable(*args, **kwargs)
    return entry


def build(pieces: int, inputs: int, width: int) -> tuple[list[Any], torch.nn.Module, list[torch.Tensor]]:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    model = torch.nn.Module()
    layers = pieces * (inputs - 1)
    model.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
    weights = [layer.weight for layer in model.layers]
    wrappers = []
    for index in range(pieces):
        wrapper = object.__new__(CUDAGraphWrapper)  # vLLM's own class; __init__ asks for a CUDA platform
        wrapper.__dict__.update(runnable=Piece(index, pieces, width), runtime_mode=CUDAGraphMode.PIECEWISE,
                                graph_pool=None, concrete_cudagraph_entries={})
        wrappers.append(wrapper)
    return wrappers, model, weights


def config(model: torch.nn.Module) -> SimpleNamespace:
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(
                cudagraph_mode=CUDAGraphMode.PIECEWISE, cudagraph_capture_sizes=list(SIZES),
                max_cudagraph_capture_size=max(SIZES), cudagraph_num_of_warmups=1, mode=3),
            scheduler_config=SimpleNamespace(max_num_seqs=max(SIZES), max_num_batched_tokens=256,
                                             enable_chunked_prefill=True),
            cache_config=SimpleNamespace(enable_prefix_caching=True, gpu_memory_utilization=0.1,
                                         kv_cache_memory_bytes=None),
            model_config=SimpleNamespace(model="host-cost", dtype="float32", max_model_len=256),
            parallel_config=SimpleNamespace(rank=0, world_size=1)),
        device="cpu", model=model)


def steps(wrappers: list[Any], x: torch.Tensor, weights: list[torch.Tensor], pieces: int, count: int,
          on: Any, cold: ColdCaches | None = None) -> float:
    """Seconds for ``count`` PIECEWISE forwards cycling through the sizes (``on``: the session, whose
    step is recorded and whose hooked ``__call__`` runs; None: vLLM's body called directly). Warm
    (``cold`` None): CPU seconds of this process (every thread: the recorder's flush thread's work
    counts, time spent waiting for a busy host's cores does not); cold: ``count`` times the median
    wall time of one forward, the caches evicted before each."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context

    per_piece = len(weights) // pieces
    args = [[None, *weights[i * per_piece:(i + 1) * per_piece]] for i in range(pieces)]
    descriptors = [BatchDescriptor(num_tokens=size) for size in SIZES]
    mode = CUDAGraphMode.PIECEWISE
    clock = time.perf_counter_ns
    timed: list[int] = []
    started = time.process_time()
    for step in range(count):
        descriptor = descriptors[step % len(descriptors)]
        if cold is not None:
            cold.evict()
        began = clock()
        if on is not None:
            on.step(mode, descriptor, descriptor.num_tokens - 1, False)
        context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                                 cudagraph_runtime_mode=mode, batch_descriptor=descriptor)
        with override_forward_context(context):
            y = x[: descriptor.num_tokens]
            for wrapper, piece_args in zip(wrappers, args, strict=True):
                piece_args[0] = y
                y = wrapper(*piece_args) if on is not None else replay_body(wrapper, *piece_args)
        timed.append(clock() - began)
    if cold is None:
        return time.process_time() - started
    return statistics.median(timed) / 1e9 * count


class NoReplay:
    """A V2 FULL graph whose replay does nothing (the GPU's part is not measured here)."""

    def replay(self) -> None:
        return None


def v2_runner(layers: int, width: int) -> tuple[SimpleNamespace, Any, dict[int, Any]]:
    """A V2 model runner as the hooks read it, its ``ModelCudaGraphManager`` (vLLM's class, its
    ``dispatch`` padding to the captured sizes) and the execution descriptor of each size."""
    from vllm.config import CUDAGraphMode
    from vllm.model_executor.parameter import ModelWeightParameter
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, ModelCudaGraphManager

    def weight(*shape: int) -> torch.Tensor:  # vLLM's parameter class, its TP-reading __init__ skipped
        return ModelWeightParameter.__new__(ModelWeightParameter, data=torch.zeros(*shape))

    model = torch.nn.Module()
    model.embed = torch.nn.Module()
    model.embed.weight = weight(64, width)
    model.layers = torch.nn.ModuleList()
    rotary = torch.nn.Module()  # one for every layer, as vLLM's get_rope hands out (its _ROPE_DICT)
    rotary.register_buffer("cos_sin_cache", torch.zeros(max(SIZES), width))
    for _ in range(layers):
        layer = torch.nn.Module()
        for name in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm"):
            setattr(layer, name, torch.nn.Module())
            getattr(layer, name).weight = weight(width, width)
        layer.rotary_emb = rotary
        model.layers.append(layer)
    model.norm = torch.nn.Module()
    model.norm.weight = weight(width)
    executions = {size: BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=size, num_reqs=size,
                                                 uniform_token_count=1) for size in SIZES}
    manager = object.__new__(ModelCudaGraphManager)
    manager.__dict__.update(
        graphs={execution: NoReplay() for execution in executions.values()}, decode_query_len=1,
        is_last_pp_rank=True, hidden_states=torch.zeros(max(SIZES), width),
        use_aux_hidden_state_outputs=False, intermediate_tensors=None,
        dispatch=lambda num_reqs, num_tokens, uniform, num_active_loras=0: executions[
            min(size for size in SIZES if size >= num_tokens)])
    n = max(SIZES)
    runner = config(model)
    runner.__dict__.update(
        cudagraph_manager=manager,
        input_buffers=SimpleNamespace(input_ids=torch.zeros(n, dtype=torch.int32),
                                      positions=torch.zeros(n, dtype=torch.int64),
                                      query_start_loc=torch.zeros(n + 1, dtype=torch.int32),
                                      seq_lens=torch.zeros(n, dtype=torch.int32)),
        block_tables=SimpleNamespace(slot_mappings=torch.zeros(1, n, dtype=torch.int64),
                                     input_block_tables=[torch.zeros(n, 16, dtype=torch.int32)]),
        kv_caches=[torch.zeros(2, 16, 16, width) for _ in range(layers)])
    runner.vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    return runner, manager, executions


def v2_steps(runner: SimpleNamespace, manager: Any, count: int, cold: ColdCaches | None = None) -> float:
    """Microseconds a V2 decode step, over ``count`` steps cycling through the sizes: vLLM's
    dispatch, then its FULL replay, as its ``execute_model`` calls them (the buffers written in
    place between, as the runner's ``prepare_inputs`` does). Warm (``cold`` None): the CPU time of
    the process over the loop; cold: the median wall time of the step itself, the caches evicted
    before each one."""
    from vllm.v1.worker.gpu import model_runner

    buffers = runner.input_buffers
    clock = time.perf_counter_ns
    timed: list[int] = []
    started = time.process_time()
    for step in range(count):
        size = SIZES[step % len(SIZES)]
        buffers.input_ids[:size].fill_(step)  # the step's write: its counter moves
        buffers.positions[:size].fill_(step)
        if cold is not None:
            cold.evict()
        began = clock()
        execution, _ = model_runner.dispatch_cg_and_sync_dp(manager, size, size - 1, 1, 1, 0)
        manager.run_fullgraph(execution)
        timed.append(clock() - began)
    if cold is None:
        return (time.process_time() - started) / count * 1e6
    return statistics.median(timed) / 1e3


class ColdCaches:
    """A working set of ``mib`` MiB of Python objects, walked before each timed step so that the
    step finds the CPU's caches and TLB as a host-bound engine's own step leaves them: inside vLLM
    on the H200 a guard that takes 5 us in a warm loop takes about 30 us once a step."""

    def __init__(self, mib: int) -> None:
        count = max(mib * 2**20 // 64, 1)  # about 64 bytes an object and its list slot
        self.objects = [object() for _ in range(count)]
        self.table = {i: i for i in range(count // 4)}

    def evict(self) -> int:
        touched = 0
        for held in self.objects:
            touched += id(held) & 1
        for key in self.table:
            touched += key & 1
        return touched


def run_v2(args: argparse.Namespace) -> dict[str, Any]:
    """The V2 decode step: on (hooked) against off (the same calls, the hooks paused), alternating."""
    from inspector.engines.vllm import hooks

    runner, manager, executions = v2_runner(args.layers, args.width)
    cold = ColdCaches(args.cold_mib) if args.cold_mib else None
    off, on = [], []
    with recording() as (session, db):
        session.attach(runner, "V2")
        for execution in executions.values():  # what the manager's capture hands over
            session.adopt_full(manager, execution, hooks._full_inputs(runner), 0.001, 0)
        session.capture_finished()
        v2_steps(runner, manager, args.steps)  # warm-up
        for _ in range(args.rounds):
            with hooks.paused():
                off.append(v2_steps(runner, manager, args.steps, cold))
            on.append(v2_steps(runner, manager, args.steps, cold))
    violations, replays = db
    added = statistics.median(b - a for a, b in zip(off, on, strict=True))
    return {"tree": str(TREE), "runner": "v2", "cold_mib": args.cold_mib,
            "off_us_per_step": statistics.median(off), "on_us_per_step": statistics.median(on),
            "added_us_per_step": added,
            "rounds": {"off": off, "on": on}, "violations": violations, "recorded_replays": replays}


@contextlib.contextmanager
def recording() -> Iterator[tuple[Any, list[int]]]:
    """The integration installed, recording into a real SQLite file for the block (one thread, as
    vLLM's worker runs it); the list yielded holds the violations and replays recorded, once out."""
    from inspector.engines.vllm import ENV, hooks, register

    torch.set_num_threads(1)
    found: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "host_cost.db"
        os.environ[ENV] = f"sqlite:///{db}"
        register()
        session = hooks.session()
        assert session is not None
        try:
            yield session, found
        finally:
            hooks.uninstall()
        found.extend(recorded(db))


def recorded(db: Path) -> tuple[int, int]:
    """The violations and the replays the run's database holds."""
    with sqlite3.connect(db) as conn:
        violations = conn.execute("SELECT COUNT(*) FROM violations").fetchone()[0]
        replays = conn.execute("SELECT COALESCE(SUM(replays), 0) FROM replay_totals").fetchone()[0]
    return violations, replays


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The PIECEWISE step: on (hooked) against off (vLLM's body called directly), alternating."""
    wrappers, model, weights = build(args.pieces, args.inputs, args.width)
    x = torch.zeros(max(SIZES), args.width)  # the hidden states' static buffer, as vLLM's
    cold = ColdCaches(args.cold_mib) if args.cold_mib else None
    off, on = [], []
    with recording() as (session, db):
        session.vllm_call = replay_body
        session.attach(config(model), "V1")
        steps(wrappers, x, weights, args.pieces, len(SIZES), session)  # the capture phase: every size
        session.capture_finished()
        steps(wrappers, x, weights, args.pieces, args.steps, session)  # warm-up
        steps(wrappers, x, weights, args.pieces, args.steps, None)
        for _ in range(args.rounds):
            off.append(steps(wrappers, x, weights, args.pieces, args.steps, None, cold) / args.steps * 1e6)
            on.append(steps(wrappers, x, weights, args.pieces, args.steps, session, cold) / args.steps * 1e6)
    violations, replays = db
    added = statistics.median(b - a for a, b in zip(off, on, strict=True))
    return {
        "tree": str(TREE), "cold_mib": args.cold_mib,
        "off_us_per_step": statistics.median(off), "on_us_per_step": statistics.median(on),
        "added_us_per_step": added,
        "added_us_per_piece_call": added / args.pieces,
        "rounds": {"off": off, "on": on}, "violations": violations, "recorded_replays": replays,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=None,
                        help="measure the integration of another checkout of the project (its inspector and "
                             "capture_core; default: this one), for a before and after")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1",
                        help="v1 (default): a PIECEWISE step through vLLM's CUDAGraphWrapper; v2: the V2 "
                             "runner's FULL decode step (dispatch and run_fullgraph)")
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers of the V2 model (default 4: 26 weights, as the tiny Llama's)")
    parser.add_argument("--cold-mib", type=int, default=0,
                        help="walk this many MiB of objects before each step and time each step alone "
                             "(its median), as an engine's own step leaves the caches; 0 (default): warm, "
                             "the CPU time of the whole loop")
    parser.add_argument("--pieces", type=int, default=5, help="pieces per forward (default 5: vLLM's Llama)")
    parser.add_argument("--inputs", type=int, default=10, help="positional inputs per piece (default 10)")
    parser.add_argument("--width", type=int, default=16, help="hidden width of the stand-in tensors")
    parser.add_argument("--steps", type=int, default=2000, help="steps per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating off/on rounds (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm_host_cost: vLLM is not importable here (pip install vllm==0.25.1 --no-deps)",
              file=sys.stderr)
        return 2
    if args.tree is not None:
        if not (args.tree / "inspector" / "engines" / "vllm").is_dir():
            print(f"vllm_host_cost: {args.tree} holds no vLLM integration (inspector/engines/vllm)",
                  file=sys.stderr)
            return 2
        global TREE
        TREE = args.tree.resolve()
        sys.path.insert(0, str(TREE))
    if args.runner == "v2":
        result = run_v2(args)
        how = f", caches evicted ({args.cold_mib} MiB walked) before each" if args.cold_mib else ""
        print(f"vLLM host cost per V2 FULL decode step ({args.layers} layers{how}), median of {args.rounds} "
              f"alternating rounds of {args.steps} steps:")
        print(f"  {TREE}: off {result['off_us_per_step']:.1f} us   on {result['on_us_per_step']:.1f} us   "
              f"added {result['added_us_per_step']:.1f} us")
    else:
        result = run(args)
        how = f", caches evicted ({args.cold_mib} MiB walked) before each" if args.cold_mib else ""
        print(f"vLLM host cost per PIECEWISE step ({args.pieces} pieces x {args.inputs} inputs{how}), "
              f"median of {args.rounds} alternating rounds of {args.steps} steps:")
        print(f"  {TREE}: off {result['off_us_per_step']:.1f} us   on {result['on_us_per_step']:.1f} us   "
              f"added {result['added_us_per_step']:.1f} us "
              f"({result['added_us_per_piece_call']:.1f} us a piece call)")
    if args.out is not None:
        config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        write_results(args.out, benchmark="vllm_host_cost", command=command_line(),
                      device=torch.device("cpu"), config=config, results=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
