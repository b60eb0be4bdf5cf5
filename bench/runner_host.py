"""What a decode runner's step costs on the host, the replay stubbed: this tree against another.

A step's host work is everything around the replay: the route, the ``copy_`` of the inputs into the
static buffers, the forward context, the graph wrapper (its lookup, the replay guard, the observer
call) and the logits' slice. On the eager backend with the replay made a no-op, a step of the tiny
reference decoder is only that work, so its time is the runner's host cost per step, checks off and
always on, at batch sizes 1, 4 and 16 (CPU, one thread).

``--against PATH`` times another checkout of the project too (``git worktree add /tmp/pre REV``):
each measurement runs in a fresh process whose ``PYTHONPATH`` is the tree measured, and the two
trees' processes alternate round by round, so a busy host slows both alike. Microseconds per step:
the median over every burst of back-to-back steps, with p10 and p90.

    python3 bench/runner_host.py --against /tmp/pre --out bench/results/runner_host.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 4, 16)
MODES = ("off", "always_on")
COLUMNS = ("tree", "mode", "batch", "median_us", "p10_us", "p90_us", "bursts")


def measure_here(mode: str, calls: int, repeats: int) -> dict[int, list[float]]:
    """Host us per step of bursts of ``calls`` steps, with whichever ``capture_core`` is importable
    (the child process's tree). Only API both old and new trees have is used."""
    import torch

    from capture_core.backends import EagerGraph
    from capture_core.reference import ModelConfig, ReferenceDecoder
    from capture_core.runner import DecodeRunner
    from capture_core.runtime import GraphRuntime

    class Silent:
        def on_capture(self, event: Any) -> None: ...
        def on_replay(self, mode: Any, descriptor: Any, num_real_tokens: int) -> None: ...
        def on_eager(self, *event: Any) -> None: ...
        def on_violation(self, event: Any) -> None: ...

    torch.set_num_threads(1)
    config = ModelConfig.tiny(max_num_seqs=16, max_seq_len=32)
    runtime = GraphRuntime("eager", observer=Silent(), progress=False, address_check=mode)
    runner = DecodeRunner(ReferenceDecoder(config), runtime, [1, 2, 4, 8, 16])
    runner.capture()
    # The graph's own time is not the runner's.
    EagerGraph.replay = lambda self: None  # type: ignore[method-assign]
    samples: dict[int, list[float]] = {}
    for batch in BATCHES:
        zeros = torch.zeros(batch, dtype=torch.long)
        inputs = (zeros, zeros.clone(), torch.arange(batch))
        step = runner.step
        for _ in range(200):
            step(*inputs)
        samples[batch] = []
        for _ in range(repeats):
            started = time.perf_counter_ns()
            for _ in range(calls):
                step(*inputs)
            samples[batch].append((time.perf_counter_ns() - started) / calls / 1e3)
    return samples


def measure_in(tree: Path, mode: str, calls: int, repeats: int) -> dict[int, list[float]]:
    """``measure_here`` in a fresh process importing ``tree``'s code."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(calls), str(repeats)],
        env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True, timeout=600,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"measuring {tree} ({mode}) failed:\n{done.stderr[-3000:]}")
    return {int(batch): values for batch, values in json.loads(done.stdout.splitlines()[-1]).items()}


def run(args: Any) -> dict[str, Any]:
    import torch

    from bench.common import command_line, print_table, write_results

    trees = {"this tree": REPO}
    if args.against is not None:
        trees[f"against {args.against}"] = args.against.resolve()
    samples: dict[tuple[str, str], dict[int, list[float]]] = {
        (name, mode): {batch: [] for batch in BATCHES} for name in trees for mode in MODES
    }
    for _ in range(args.rounds):
        for name, tree in trees.items():
            for mode in MODES:
                for batch, values in measure_in(tree, mode, args.calls, args.repeats).items():
                    samples[(name, mode)][batch] += values
    rows = []
    for (name, mode), by_batch in samples.items():
        for batch, values in by_batch.items():
            ordered = sorted(values)
            rows.append({
                "tree": name, "mode": mode, "batch": batch, "median_us": statistics.median(ordered),
                "p10_us": ordered[len(ordered) // 10], "p90_us": ordered[(9 * len(ordered)) // 10],
                "bursts": len(ordered),
            })
    config = {
        "trees": {name: str(tree) for name, tree in trees.items()}, "rounds": args.rounds,
        "calls": args.calls, "repeats": args.repeats, "batches": list(BATCHES), "quick": args.quick,
    }
    payload = write_results(
        args.out, benchmark="runner_host", command=command_line(), device=torch.device("cpu"), config=config,
        results=rows, targets=[], notes=[],
    )
    print_table(
        "A decode runner step's host cost, replay stubbed (us per step; CPU, one thread)",
        ("tree", "checks", "batch", "median us", "p10 us", "p90 us", "bursts"),
        [tuple(row[key] for key in COLUMNS) for row in rows],
    )
    print(f"\nwrote {args.out}")
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        mode, calls, repeats = argv[1], int(argv[2]), int(argv[3])
        print(json.dumps(measure_here(mode, calls, repeats)))
        return 0
    sys.path.insert(0, str(REPO))
    from bench.common import base_parser

    parser = base_parser(
        __doc__.splitlines()[0], default_out="bench/results/runner_host.json", default_budget_s=600
    )
    parser.add_argument(
        "--against", type=Path, default=None, help="another checkout of the project to time too"
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each timing every tree and mode once")
    parser.add_argument("--calls", type=int, default=2000, help="steps per burst")
    parser.add_argument("--repeats", type=int, default=5, help="bursts per batch size in one process")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.calls, args.repeats = 1, 100, 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
