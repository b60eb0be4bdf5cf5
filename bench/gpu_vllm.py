"""graph-inspector on the real vLLM 0.25.1 (the GPU machine): many vLLM processes started at once,
built one group after another, then served one at a time, each alone on the GPU.

vLLM takes a minute or more to start (imports, torch.compile, profiling, capture) and the device
time is short, so every process of the plan starts at once and waits; what is compared (tokens/s
with the integration on against off, interleaved: off, on, off, on, ...) is served one process at
a time while the others sleep. Building is gated in groups: the V1 runner's first process profiles
GPU memory (capturing the graphs vLLM throws away), which vLLM refuses to do while another process
frees GPU memory, so it is built alone; the rest name their KV-cache size (``kv_cache_memory_bytes``,
which skips that profiling) and are built together.

The ``full`` plan, in serving order: V2 off/on x3 (tokens/s, tokens identical, start-up), then
``graph-inspector advise`` on the first ``on`` run's database and a new V2 process built on the
advised sizes (while the rest serve): the V1 runner with vLLM's own ``--cudagraph-metrics``
(``CUDAGraphStat`` against what was recorded), each runner with the planted faults, the engine core
in its own process, and last the advised run (the padding the advice predicted, seen). The
``final`` plan: ``--pairs`` V2 off/on pairs, each runner with the planted faults, then one V2
process off and one on under cProfile (where an attached step's host time goes). The ``alternate``
plan: the pairs, then V2 x3 and V1 x1 processes that serve each of ``LEVELS`` in turn every
``ALTERNATE`` steps (``vllm_serve.py --alternate``: on and off, and the levels between, compared within
one process),
and one V2 process serving four times the steps (clean traffic for the checks, at length); the
``levels`` plan: those four alone. The ``waves`` plan: V2 x3 and V1 x1 processes that serve each trace
window once at each of ``WAVE_LEVELS`` (``vllm_serve.py --waves``: the same requests at every level,
so a level's cost is seen on identical work), then each runner serving the trace with the checks in
debug mode (every check on every replay, the canary's eager run too). The ``debug`` plan: those two,
and a V2 and a V1 process timing the integration's own host work per step at each level from inside
(``vllm_serve.py --time-integration``). The ``probe`` plan: the V2 one of those alone; the
``faults`` plan: each runner serving with the planted faults. The ``long`` plan: one V2 process serving
``LONG_WAVES`` cycles of shorter waves at ``on`` and ``off`` alone (the figure the issue asks for, as
closely as one process can place it), and the timed V2 process of ``probe`` (what the integration's
own clock predicts it to be). The ``large`` plan: both on Llama 3 8B's shape (``LARGE``), where a step
is the GPU's work rather than the host's (run 16 served it 12 cycles of three levels, too few to
place the median within 1%; now the ``long`` plan's many short cycles at ``on`` and ``off``).

All of a plan's processes share one compile cache (``SHARED_CACHE``; since run 5).
Every process builds and waits on the cores from 4 up and serves alone on cores 0-3 (``SERVE_CPUS``),
and the next serves only once the last has exited: no process is timed beside another's work.

Each process is ``bench/vllm_serve.py``. A deadline bounds the whole (a process that overruns its
serve is killed and the plan goes on); the summary JSON and one archive of every result, log and
database are written under ``--out`` whatever happens, and a table is printed last.

usage: python3 bench/gpu_vllm.py --plan full --out $OUT [--steps N] [vllm_serve.py options...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from vllm_serve import cpus  # this script's folder comes first on sys.path

HERE = Path(__file__).resolve().parent
SERVE = HERE / "vllm_serve.py"
KV = ["--kv-cache-gib", "2"]


SHARED_CACHE = True
"""Every process of a plan compiles into one vLLM cache (torch.compile's artefacts): in run 4 each
had its own and twelve compiled at once on one GPU, and identical processes served the same steps
in 12.8 to 18.4 s; with one cache the processes built after the first load its kernels instead of
choosing their own (the ``compare`` and ``final`` plans build their first process alone for it)."""
ALTERNATE = 10
"""Steps per segment of the ``alternate`` plan's processes (each level in turn within one process)."""
LEVELS = "on,off,hooks,recording"
"""What the ``alternate`` plan's segments serve with (``vllm_serve.py --levels``)."""
WAVES = 12
"""Cycles of the ``waves`` plan's processes (``vllm_serve.py --waves``: one trace window per cycle, served
once at each of ``WAVE_LEVELS``)."""
WAVE_LEVELS = "on,off,recording"
LONG_WAVES = 150
"""Cycles of the ``long`` plan's process: on and off alone, on waves of a quarter of the arrival steps
(``LONG_WAVE_STEPS``), so that each cycle's two waves run within about a second of each other (what
slows one wave of identical work against another came in bursts longer than that in runs 10 and 15)
and three times run 10's 48 cycles place the median."""
LONG_WAVE_STEPS = 50
LARGE = ["--model", "llama-8b", "--kv-cache-gib", "8", "--gpu-memory-utilization", "0.3"]
"""The ``large`` plan's model: Llama 3 8B's shape, random weights (what vLLM users serve on one GPU)."""
DEBUG_STEPS = 1500
"""Steps of the trace the ``waves`` plan serves with the checks in debug mode (each runner)."""
SERVE_CPUS = "0-3"
"""The cores every process serves on (each alone on them); the others build and wait elsewhere."""


def plan(name: str, steps: int, pairs: int = 3) -> list[dict[str, Any]]:
    """The processes of a plan: tag, build group, serving position, database or not, options."""
    shared = ["--steps", str(steps)]
    compare = [{"tag": f"v2-{'on' if i % 2 else 'off'}-{i // 2 + 1}", "group": 1, "serve": i,
                "db": bool(i % 2), "args": [*shared, "--runner", "v2", *KV]} for i in range(2 * pairs)]
    if name in ("compare", "final", "alternate"):  # the first compiles alone; the rest load its kernels
        compare[0]["group"] = 0
    if name == "compare":
        return compare
    faults = [
        {"tag": "v1-faults", "group": 1, "serve": 51, "db": True,
         "args": [*shared, "--runner", "v1", "--faults", *KV]},
        {"tag": "v2-faults", "group": 1, "serve": 52, "db": True,
         "args": [*shared, "--runner", "v2", "--faults", *KV]},
    ]
    if name == "faults":  # each runner with the planted faults, alone
        return faults
    alternating = [{"tag": f"v{runner}-alt-{i + 1}", "group": 1, "serve": 40 + 4 * (runner == 1) + i,
                    "db": True, "args": [*shared, "--runner", f"v{runner}", "--alternate", str(ALTERNATE),
                                         "--levels", LEVELS, *KV]}
                   for runner, count in ((2, 3), (1, 1)) for i in range(count)]
    if name == "levels":  # the levels within each process, alone
        alternating[0]["group"] = 0
        return alternating
    if name == "waves":  # the levels on identical work within each process; the checks in debug mode
        waves = [{"tag": f"v{runner}-waves-{i + 1}", "group": 1, "serve": 30 + 4 * (runner == 1) + i,
                  "db": True, "args": ["--runner", f"v{runner}", "--waves", str(WAVES), "--levels",
                                       WAVE_LEVELS, "--warmup-steps", "400", *KV]}
                 for runner, count in ((2, 3), (1, 1)) for i in range(count)]
        waves[0]["group"] = 0
        debug = [{"tag": f"v{runner}-debug", "group": 1, "serve": 36 + runner, "db": True,
                  "args": ["--steps", str(DEBUG_STEPS), "--runner", f"v{runner}", "--checks", "debug", *KV]}
                 for runner in (2, 1)]
        return [*waves, *debug]
    timed = [{"tag": f"v{runner}-timed", "group": int(runner == 1), "serve": 20 + runner, "db": True,
              "args": ["--runner", f"v{runner}", "--waves", "4", "--levels", WAVE_LEVELS,
                       "--time-integration", "--warmup-steps", "400", *KV]}
             for runner in (2, 1)]
    if name == "probe":  # where an attached V2 step's host time goes, alone on the machine
        return timed[:1]
    compared = ["--runner", "v2", "--waves", str(LONG_WAVES), "--wave-steps", str(LONG_WAVE_STEPS),
                "--levels", "on,off", "--warmup-steps", "400"]  # the long plan's many short cycles
    if name == "long":  # on against off on many identical waves, and the integration's own clock
        return [{"tag": "v2-long-waves", "group": 0, "serve": 30, "db": True, "serve_s": 420,
                 "args": [*compared, *KV]}, dict(timed[0], group=1)]
    if name == "large":  # the same on Llama 3 8B's shape: the waves, then the clock
        return [{"tag": "v2-8b-waves", "group": 0, "serve": 30, "db": True, "serve_s": 420,
                 "args": [*compared, *LARGE]},
                {"tag": "v2-8b-timed", "group": 1, "serve": 31, "db": True, "serve_s": 240,
                 "args": ["--runner", "v2", "--waves", "3", "--levels", WAVE_LEVELS, "--time-integration",
                          "--warmup-steps", "400", *LARGE]}]
    if name == "debug":  # the checks in debug mode, and where an attached step's host time goes
        debug = [{"tag": f"v{runner}-debug", "group": 1, "serve": 30 + runner, "db": True,
                  "args": ["--steps", str(DEBUG_STEPS), "--runner", f"v{runner}", "--checks", "debug", *KV]}
                 for runner in (2, 1)]
        return [*timed, *debug]
    if name == "alternate":  # on and off within each process too, and one long clean serve
        long = {"tag": "v2-long", "group": 1, "serve": 70, "db": True,
                "args": ["--steps", str(4 * steps), "--runner", "v2", *KV]}
        return [*compare, *alternating, long]
    if name == "final":  # the comparison, the faults, and where an attached step's host time goes
        profiles = [{"tag": f"v2-profile-{side}", "group": 1, "serve": 60 + i, "db": side == "on",
                     "args": [*shared, "--runner", "v2", "--profile", *KV]}
                    for i, side in enumerate(("off", "on"))]
        return [*compare, *faults, *profiles]
    full = [
        {"tag": "v1-on", "group": 0, "serve": 50, "db": True,
         "args": [*shared, "--runner", "v1", "--cudagraph-metrics", "--canary"]},
        *compare, *faults,
        {"tag": "v2-multiproc", "group": 1, "serve": 53, "db": True,
         "args": ["--steps", str(max(steps // 3, 300)), "--runner", "v2", "--multiproc", *KV]},
    ]
    if name == "checks":  # the comparison, the V1 runner with vLLM's metrics and the canary, the faults
        return [spec for spec in full if spec["tag"] != "v2-multiproc"]
    return full


class Plan:
    def __init__(self, work: Path, extra: list[str], deadline: float) -> None:
        self.work, self.extra, self.deadline = work, extra, deadline
        self.procs: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[gpu_vllm +{time.monotonic() - self.started:.0f}s] {text}", flush=True)

    def start(self, spec: dict[str, Any], gate: Path) -> None:
        tag, work = spec["tag"], self.work
        files = {name: work / f"{tag}.{name}" for name in ("ready", "go", "done")}
        db = f"sqlite:///{work / (tag + '.db')}" if spec["db"] else ""
        command = [sys.executable, str(SERVE), "--tag", tag, "--out", str(work / f"{tag}.json"), "--db", db,
                   "--init-gate", str(gate), "--ready-file", str(files["ready"]),
                   "--go-file", str(files["go"]), "--done-file", str(files["done"]),
                   "--serve-cpus", SERVE_CPUS, *spec["args"], *self.extra]
        cache = work / ("cache-shared" if SHARED_CACHE else f"cache-{tag}")
        env = dict(os.environ, VLLM_CACHE_ROOT=str(cache), PYTHONUNBUFFERED="1")
        log = open(work / f"{tag}.log", "w")  # noqa: SIM115 (closed in finish)
        self.procs[tag] = {"spec": spec, "files": files, "log": log,
                           "proc": subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    preexec_fn=self.off_serving_cores)}

    @staticmethod
    def off_serving_cores() -> None:
        """A process builds and waits on the cores no process serves on (it moves when served)."""
        rest = set(os.sched_getaffinity(0)) - cpus(SERVE_CPUS)
        if rest:
            os.sched_setaffinity(0, rest)

    def wait(self, tags: list[str], file: str, timeout_s: float) -> list[str]:
        """Wait until each process wrote ``file`` (or died); the tags that did not in time."""
        until = min(time.monotonic() + timeout_s, self.deadline)
        while True:
            late = [t for t in tags if not self.procs[t]["files"][file].exists()
                    and self.procs[t]["proc"].poll() is None]
            if not late or time.monotonic() > until:
                return late
            time.sleep(0.1)

    def serve(self, tag: str, timeout_s: float) -> None:
        self.procs[tag]["files"]["go"].write_text("go")
        late = self.wait([tag], "done", timeout_s)
        proc = self.procs[tag]["proc"]
        if late:
            proc.kill()
            self.say(f"{tag} overran its serve and was killed")
            return
        try:  # its exit (freeing the GPU, tearing down) overlaps no other serve
            proc.wait(timeout=max(1.0, min(30.0, self.deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
        self.say(f"{tag} served")

    def finish(self) -> list[dict[str, Any]]:
        results = []
        for tag, p in self.procs.items():
            try:
                p["proc"].wait(timeout=max(5.0, min(60.0, self.deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p["proc"].kill()
            p["log"].close()
            path = self.work / f"{tag}.json"
            found = json.loads(path.read_text()) if path.exists() else {"tag": tag, "traceback": "no result"}
            results.append(found)
        return results


def advised_sizes(db: Path, out: Path) -> list[int]:
    """``graph-inspector advise`` on a recorded run: the sizes it advises (its JSON kept)."""
    done = subprocess.run([sys.executable, "-m", "dashboard.cli", "advise", "--db", f"sqlite:///{db}",
                           "--format", "json"], capture_output=True, text=True, timeout=120)
    (out / "advice.json").write_text(done.stdout or done.stderr)
    return list(json.loads(done.stdout)["advised"]["capture_sizes"])


def run(name: str, steps: int, work: Path, out: Path, extra: list[str], deadline_s: float,
        quiet_file: Path | None = None, pairs: int = 3) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    runner = Plan(work, extra, time.monotonic() + deadline_s)
    specs = plan(name, steps, pairs)
    gates = {g: work / f"build-{g}" for g in sorted({s["group"] for s in specs})}
    summary: dict[str, Any] = {"plan": name, "steps": steps}
    try:
        for spec in specs:
            runner.start(spec, gates[spec["group"]])
        for group, gate in gates.items():
            gate.write_text("go")
            late = runner.wait([s["tag"] for s in specs if s["group"] == group], "ready", 400)
            runner.say(f"group {group} built" + (f" (late: {late})" if late else ""))
        if quiet_file is not None:  # something else used the GPU while vLLM was being built
            until = time.monotonic() + 240
            while not quiet_file.exists() and time.monotonic() < until:
                time.sleep(0.5)
            runner.say(f"{quiet_file} {'seen' if quiet_file.exists() else 'not seen in 240 s'}: serving")
        order = sorted(specs, key=lambda s: s["serve"])
        for spec in order:
            if name == "full" and spec["serve"] == 50:  # the V2 runs are served: advise, build on it
                try:
                    sizes = advised_sizes(work / "v2-on-1.db", out)
                    summary["advised_sizes"] = sizes
                    gate = work / "build-advised"
                    gate.write_text("go")
                    runner.start({"tag": "v2-advised", "group": 2, "serve": 54, "db": True,
                                  "args": ["--steps", str(steps), "--runner", "v2", "--sizes",
                                           ",".join(map(str, sizes)), *KV]}, gate)
                    runner.say(f"advised {sizes}: building v2-advised")
                except Exception as exc:  # the rest of the plan still runs
                    summary["advice_error"] = repr(exc)
            runner.serve(spec["tag"], spec.get("serve_s", 150))
        if "v2-advised" in runner.procs:
            runner.wait(["v2-advised"], "ready", 300)
            runner.serve("v2-advised", 150)
    except Exception as exc:
        summary["error"] = repr(exc)
        runner.say(f"plan stopped: {exc!r}")
    finally:
        results = runner.finish()
        summary.update(compare(results))
        summary["processes"] = results
        (out / f"vllm_{name}.json").write_text(json.dumps(summary, indent=1, default=str))
        with tarfile.open(out / f"vllm_{name}.tar.gz", "w:gz") as archive:
            for path in sorted(work.iterdir()):
                if path.suffix in (".db", ".log", ".json") or path.name.endswith((".db-wal", ".db-shm")):
                    archive.add(path, arcname=path.name)
    return summary


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """tokens/s and start-up of the V2 off/on pairs (medians, ratio on/off); the levels within the
    alternating processes; whether the V2 processes' tokens are identical."""
    pairs = [r for r in results
             if str(r.get("tag", "")).startswith(("v2-on-", "v2-off-")) and r.get("tok_per_s")]
    alternating = [r for r in results if r.get("segments")]
    waved = [r for r in results if r.get("waves")]
    within: dict[str, Any] = {r["tag"]: {level: {k: v for k, v in figures.items() if k != "cycle_ratios"}
                                         for level, figures in r["segments"]["levels"].items()}
                              for r in alternating}
    for level in sorted({level for r in alternating for level in r["segments"]["levels"]} - {"off"}):
        every_cycle = [x for r in alternating for x in r["segments"]["levels"][level]["cycle_ratios"]]
        if every_cycle:
            within[f"{level}: median over every cycle"] = statistics.median(every_cycle)
            within[f"{level}: cycles"] = len(every_cycle)
    v2 = pairs + [r for r in alternating if r.get("runner") == "v2"]
    summary: dict[str, Any] = {"within_process": within} if alternating else {}
    if waved:
        summary["waves"] = waves_summary(waved)
    timed = {r["tag"]: clock_estimate(r) for r in waved if r.get("integration_clock")}
    if timed:
        summary["clock_estimate"] = timed
    if v2:
        summary["tokens_identical"] = len({r.get("tokens_sha256") for r in v2}) == 1
    on = [r for r in pairs if r.get("integration")]
    off = [r for r in pairs if not r.get("integration")]
    if on and off:
        speed_on, speed_off = [r["tok_per_s"] for r in on], [r["tok_per_s"] for r in off]
        init_on, init_off = [r["init_s"] for r in on], [r["init_s"] for r in off]
        summary["tok_per_s"] = {"on": speed_on, "off": speed_off, "ratio_of_medians":
                                statistics.median(speed_on) / statistics.median(speed_off)}
        summary["init_s"] = {"on": init_on, "off": init_off, "ratio_of_medians":
                             statistics.median(init_on) / statistics.median(init_off)}
    return summary


def waves_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level, its time against off's on the same work: the median over every cycle of every
    process (wall and CPU) with a 95% interval of that median, per process; and how many cycles
    served the same tokens at every level."""
    summary: dict[str, Any] = {"per_process": {}, "cycles": 0, "cycles_identical": 0}
    every: dict[str, dict[str, list[float]]] = {}
    for r in results:
        waves = r["waves"]
        summary["cycles"] += waves["cycles"]
        summary["cycles_identical"] += waves["cycles_identical"]
        summary["per_process"][r["tag"]] = {level: {k: v for k, v in figures.items() if "ratios" not in k}
                                           for level, figures in waves["levels"].items()}
        for level, figures in waves["levels"].items():
            into = every.setdefault(level, {"wall": [], "cpu": []})
            into["wall"] += figures["cycle_ratios"]
            into["cpu"] += figures["cpu_cycle_ratios"]
    summary["median_over_every_cycle"] = {
        level: {kind: statistics.median(values) if values else None for kind, values in got.items()}
        for level, got in every.items()}
    summary["median_95_interval"] = {level: median_interval(got["wall"]) for level, got in every.items()}
    return summary


def clock_estimate(result: dict[str, Any]) -> dict[str, Any]:
    """What the integration's own clock predicts a level's tokens/s against ``off``'s to be: a step at
    ``off`` (the waves' seconds over their steps; nothing of the integration, nor of the clock, runs
    there) against the same step with the integration's microseconds a step added. A figure of the
    integration's time alone, free of what makes waves of identical work differ in time."""
    off = [w for w in result["waves"]["waves"] if w["level"] == "off"]
    step_us = 1e6 * sum(w["seconds"] for w in off) / max(sum(w["steps"] for w in off), 1)
    estimate: dict[str, Any] = {"off_step_us": round(step_us, 1)}
    for level, figures in result["integration_clock"].items():
        if isinstance(figures, dict) and "integration_us_per_step" in figures:
            added = figures["integration_us_per_step"]
            ratio = round(step_us / (step_us + added), 4)
            estimate[level] = {"integration_us_per_step": added, "ratio": ratio}
    return estimate


def median_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> list[float] | None:
    """A 95% bootstrap interval of the median of ``values`` (cycles resampled with replacement, a
    fixed seed so the same results give the same interval): how far the median could be from what
    more cycles would give."""
    import random

    if len(values) < 2:
        return None
    pick = random.Random(seed)
    medians = sorted(statistics.median(pick.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def stopped(result: dict[str, Any]) -> str:
    error = (result.get("stopped_by") or {}).get("error", "")[:60]
    return error or ("FAILED" if "traceback" in result else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="full",
                        choices=("full", "checks", "compare", "final", "alternate", "levels", "waves",
                                 "debug", "probe", "faults", "long", "large"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=3, help="off/on pairs of V2 processes compared")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="the whole plan's bound")
    parser.add_argument("--out", required=True, help="folder for the summary and the archive")
    parser.add_argument("--work", default="/tmp/gpu_vllm", help="scratch folder (databases, logs)")
    parser.add_argument("--quiet-file", type=Path, help="serve only once this file exists (up to 240 s): "
                        "other GPU work started beside the build has finished")
    args, extra = parser.parse_known_args()  # the rest goes to every vllm_serve.py process
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = run(args.plan, args.steps, Path(args.work), out, extra, args.deadline_s, args.quiet_file,
                  args.pairs)
    print("\n| process | runner | on | init s | steps | tok/s | violations | stopped by |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary["processes"]:
        print(f"| {r.get('tag')} | {r.get('runner')} | {r.get('integration')} | {r.get('init_s')} | "
              f"{r.get('steps')} | {r.get('tok_per_s')} | {len(r.get('violations') or [])} | {stopped(r)} |")
    for key in ("within_process", "waves", "clock_estimate", "tok_per_s", "init_s", "tokens_identical",
                "advised_sizes", "advice_error", "error"):
        if key in summary:
            print(key, summary[key])
    return 0


if __name__ == "__main__":
    sys.exit(main())
