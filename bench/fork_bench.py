"""Recording across fork(): every event forked children report, recorded or counted as dropped.

12 children forked while the parent records each report 10,000 events to the recorder they inherited
and to one of their own; every event is recorded, counted as dropped, or lost without a count (the
target: none).

The parent reports replays without pause to a recorder flushing every 10 ms into a SQLite file, so
its flushes are under way when the children are forked (``multiprocessing``'s ``fork``, one after
another; each child ends as ``multiprocessing`` ends it, with ``os._exit``). Each child reports
10,000 replays, a capture and a violation to the recorder it inherited and the same to a recorder it
starts. Each scenario runs in a process of its own, importing the recorder from ``--code DIR``
(default this checkout; another checkout for the before figures) and the workload from this one
(``tests/support/forking.py``). ``spawn`` runs the same children spawned (no recorder inherited).
Also measured: how long the parent's ``Process.start()`` takes (the fork waits for a write under
way).

    python3 bench/fork_bench.py --out bench/results/fork.json
    git worktree add --detach /tmp/before <commit> && \\
        python3 bench/fork_bench.py --code /tmp/before --out bench/results/fork_before_fix.json
    python3 bench/fork_bench.py --quick --out /tmp/fork.json     # 3 children of 1,000 events, once
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import before_after_parser, print_table, print_targets, target, write_before_after
from bench.reliability import child_env

SCENARIO = ("import json, sys\nfrom forking import run_scenario\n"
            "print(json.dumps(run_scenario(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")


def scenario(folder: Path, method: str, children: int, events: int, code: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    url = f"sqlite:///{folder / 'fork.db'}"
    done = subprocess.run([sys.executable, "-c", SCENARIO, url, method, str(children), str(events)],
                          capture_output=True, text=True, timeout=1800, env=child_env(code), cwd=code)
    if done.returncode != 0:
        raise SystemExit(f"the {method} scenario failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    children_ = result["children"]
    result["totals"] = {key: sum(c[key] for c in children_) for key in ("reported", "recorded", "dropped",
                                                                         "unaccounted")}
    result["start_ms"] = {"median": 1000 * statistics.median(result["start_seconds"]),
                          "max": 1000 * max(result["start_seconds"])}
    return result


def main() -> int:
    parser = before_after_parser(__doc__.splitlines()[0], runs="recorder",
                                 quick="3 children of 1,000 events, once: a smoke run")
    parser.add_argument("--children", type=int, default=12)
    parser.add_argument("--events", type=int, default=10_000,
                        help="replays each child reports to each recorder (default 10,000)")
    args = parser.parse_args()
    if args.quick:
        args.children, args.events, args.repeats = 3, 1000, 1
    code = args.code.resolve()
    scratch = Path(tempfile.mkdtemp(prefix="fork-bench-"))
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for method in ("fork", "spawn"):
            results[method] = []
            for repeat in range(args.repeats):
                print(f"{method}: {args.children} children ({repeat + 1} of {args.repeats}) ...", flush=True)
                results[method].append(scenario(scratch / f"{method}-{repeat}", method, args.children,
                                                args.events, code))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows, targets = [], []
    for method, runs in results.items():
        for repeat, run in enumerate(runs, 1):
            totals, parent = run["totals"], run["parent"]
            rows.append((method, repeat, sum(code == 0 for code in run["exitcodes"]), totals["reported"],
                         totals["recorded"], totals["dropped"], totals["unaccounted"],
                         parent["reported"] - parent["recorded"] - parent["dropped"],
                         run["start_ms"]["median"], run["start_ms"]["max"]))
        worst = max(abs(run["totals"]["unaccounted"]) for run in runs)
        targets.append(target(f"{method}: events the children lost without a count (worst of {len(runs)})",
                              worst, 1))
        parent_worst = max(abs(r["parent"]["reported"] - r["parent"]["recorded"] - r["parent"]["dropped"])
                           for r in runs)
        targets.append(target(f"{method}: events the parent lost without a count", parent_worst, 1))
    print_table(f"{args.children} children x {args.events:,} events to each recorder (events: a child's "
                "reported to every recorder, recorded, counted as dropped, lost without a count)",
                ("start", "run", "children ok", "reported", "recorded", "dropped", "unaccounted",
                 "parent unaccounted", "start() ms median", "start() ms max"), rows)
    print_targets(targets)
    return write_before_after(args, "fork", {"children": args.children, "events": args.events,
                                             "load_average_at_end": os.getloadavg()}, results, targets)


if __name__ == "__main__":
    raise SystemExit(main())
