"""``bench/vllm_serve.py --time-integration``: the vLLM integration's own host time inside a real engine.

A level's cost seen from outside (its tokens/s against ``off``'s) says how much, not where. This
clock says where, from inside: the nanoseconds spent in the twins' ``serve`` (the hook's lookup, the
replay guard, the closer look when it runs, the observer) less the time inside vLLM's own replay
that ``serve`` calls, and in the session's per-step record, each summed per level. Its own cost is
four ``perf_counter_ns`` calls per graph call; it is for a process of its own, not for one whose
tokens/s are compared.
"""

from __future__ import annotations

import collections
import time
from typing import Any


class IntegrationClock:
    """Patches capture_core's ``CUDAGraphWrapper.serve``, the vLLM twins' ``EngineGraph.run`` and the
    session's ``step`` with timed versions; ``level`` says whose time it is."""

    def __init__(self, session: Any) -> None:
        from capture_core.wrapper import CUDAGraphWrapper
        from inspector.engines.vllm.twins import EngineGraph

        self.level = "on"
        self.session = session
        self.own: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.steps: collections.Counter = collections.Counter()
        inner = [0]
        clock = time.perf_counter_ns
        serve, run, step = CUDAGraphWrapper.serve, EngineGraph.run, session.step
        look = CUDAGraphWrapper._replay_checked

        def timed_serve(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
            began, inside = clock(), inner[0]
            try:
                return serve(wrapper, *args, **kwargs)
            finally:
                self.own[self.level, "serve"] += clock() - began - (inner[0] - inside)
                self.calls[self.level, "serve"] += 1

        def timed_run(graph: Any, *args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                return run(graph, *args, **kwargs)
            finally:
                inner[0] += clock() - began

        def timed_look(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
            began, inside = clock(), inner[0]
            try:
                return look(wrapper, *args, **kwargs)
            finally:
                self.own[self.level, "look"] += clock() - began - (inner[0] - inside)
                self.calls[self.level, "look"] += 1

        def timed_step(*args: Any, **kwargs: Any) -> None:
            began = clock()
            try:
                step(*args, **kwargs)
            finally:
                self.own[self.level, "step"] += clock() - began
                self.steps[self.level] += 1

        self._undo = [(CUDAGraphWrapper, "serve", serve), (EngineGraph, "run", run),
                      (CUDAGraphWrapper, "_replay_checked", look)]
        CUDAGraphWrapper.serve, EngineGraph.run = timed_serve, timed_run
        CUDAGraphWrapper._replay_checked = timed_look
        self.guards: dict[str, Any] = {}
        """Per twin, its first guarded graph: the guard's source and its time alone, inside a step."""
        session.step = timed_step
        self._guards = [(entry, entry.guard) for twin in session.twins for entry in twin.graphs.values()]
        for twin in session.twins:  # every graph is held by now (the clock starts after capture)
            for entry in twin.graphs.values():
                entry.guard = self._timed_guard(twin.name, entry)
        self.probes = {"outside a step": host_probe(session)}

    def _timed_guard(self, name: str, entry: Any) -> Any:
        clock = time.perf_counter_ns
        guard = entry.guard

        def timed(args: Any, kwargs: Any, real: int) -> bool:
            if "inside a step" not in self.probes:
                self.probes["inside a step"] = host_probe(self.session)
            if name not in self.guards:
                self.guards[name] = guard_alone(entry.checks, args, kwargs, real)
            began = clock()
            try:
                return guard(args, kwargs, real)
            finally:
                self.own[self.level, "guard"] += clock() - began
        return timed

    def close(self) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)
        for entry, guard in self._guards:
            entry.guard = guard

    def result(self) -> dict[str, Any]:
        """Per level: microseconds a step in the twins' serve (vLLM's replay excluded) and in the step
        record, the graph calls a step, over the steps the integration recorded at that level."""
        out: dict[str, Any] = {}
        for level, steps in self.steps.items():
            if steps:
                out[level] = {"steps": steps,
                              "serve_us_per_step": round(self.own[level, "serve"] / steps / 1e3, 2),
                              "step_record_us_per_step": round(self.own[level, "step"] / steps / 1e3, 2),
                              "guard_us_per_step": round(self.own[level, "guard"] / steps / 1e3, 2),
                              "closer_look_us_per_step": round(self.own[level, "look"] / steps / 1e3, 2),
                              "closer_looks": self.calls[level, "look"],
                              "graph_calls_per_step": round(self.calls[level, "serve"] / steps, 3)}
        out["probes"] = self.probes
        out["guards"] = self.guards
        return out


def guard_alone(checks: Any, args: Any, kwargs: Any, real: int, repeats: int = 50) -> dict[str, Any]:
    """One graph's replay guard called ``repeats`` times on a step's own arguments (its countdown put
    back after: no replay is sampled or skipped for it), with its source."""
    clock = time.perf_counter_ns
    countdown = checks.countdown[0]
    checks.countdown[0] = 1 << 40
    try:
        began = clock()
        for _ in range(repeats):
            passed = checks.clean(args, kwargs, real)
        seconds = clock() - began
    finally:
        checks.countdown[0] = countdown
    source = checks.guard_source
    return {"us": round(seconds / repeats / 1e3, 2), "passed": passed, "terms": source.count(" and "),
            "chars": len(source), "source": source[:20000]}


def host_probe(session: Any, repeats: int = 200) -> dict[str, Any]:
    """What this host charges for what the integration does, where it runs: a clock read, a pure
    Python loop, every model weight's ``data_ptr()`` (with the subclass hooks off, as the guard reads
    them), and whether a torch function mode is on (every tensor method would go through it)."""
    import torch

    clock = time.perf_counter_ns
    model = getattr(session.runner, "model", None)
    model = getattr(model, "runnable", model)
    weights = list(model.parameters()) if isinstance(model, torch.nn.Module) else []

    def per_call(fn: Any) -> float:
        began = clock()
        for _ in range(repeats):
            fn()
        return round((clock() - began) / repeats / 1e3, 3)

    def addresses() -> None:
        with torch._C.DisableTorchFunctionSubclass():
            for weight in weights:
                weight.data_ptr()

    return {"clock_read_us": per_call(clock), "python_loop_1000_us": per_call(lambda: sum(range(1000))),
            "weights": len(weights), "weights_data_ptr_us": per_call(addresses),
            "torch_function_mode": bool(torch._C._is_torch_function_mode_enabled()),
            "subclass_weights": sum(bool(torch._C._has_torch_function_unary(w)) for w in weights)}
