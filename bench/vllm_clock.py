"""``bench/vllm_serve.py --time-integration``: the vLLM integration's own host time inside a real engine.

A level's cost seen from outside (its tokens/s against ``off``'s) says how much, not where. This
clock says where, from inside: the nanoseconds spent in each method of vLLM's the integration hooks
per step (the runner's decision, the graph calls) less the time inside vLLM's own method and replay
there, summed per level, which is all the integration does on the serving thread; and within that,
the twins' ``serve`` (lookup, replay guard, closer looks), each guard (run in the hook on the common
replay, which goes on to ``serve`` only when the guard says no) and the record of decisions not seen
before and of eager steps. Divided by a step's time at ``off`` it predicts the level's tokens/s
against ``off``'s (``gpu_vllm.py`` prints it beside the waves). Its own cost is a few
``perf_counter_ns`` calls per hooked call; it is for a process of its own, not for one whose
tokens/s are compared.
"""

from __future__ import annotations

import collections
import time
from typing import Any


class IntegrationClock:
    """Times the integration from inside: each of vLLM's per-step methods the hooks replace
    (``hooks._per_step``: the runner's decision, the wrapper's ``__call__``, V2's ``run_fullgraph``)
    less the time inside vLLM's own method and replay, which is the whole of the integration's work
    on the serving thread; and within it, capture_core's ``CUDAGraphWrapper.serve`` (the twins'
    lookup, replay guard and closer looks), each graph's guard, the closer looks and the session's
    ``step`` (the record of a decision not seen before). ``level`` says whose time it is."""

    def __init__(self, session: Any) -> None:
        from capture_core.wrapper import CUDAGraphWrapper
        from inspector.engines.vllm import hooks
        from inspector.engines.vllm.twins import EngineGraph

        self.level = "on"
        self.session = session
        self.own: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.steps: collections.Counter = collections.Counter()
        self.inner = [0]
        """Nanoseconds inside vLLM's own methods and replays, summed (what the hooks' times leave out)."""
        self._undo: list[tuple[Any, str, Any]] = []
        serve, run, step, eager = CUDAGraphWrapper.serve, EngineGraph.run, session.step, session.eager_step
        self._vllm_call = session.vllm_call
        look = CUDAGraphWrapper._replay_checked
        self._hooks = list(hooks._per_step)
        self._cells: list[tuple[Any, Any]] = []
        for index, (owner, name, original, replacement) in enumerate(self._hooks):
            timed = self._timed_hook(name, replacement, original)
            hooks._per_step[index] = (owner, name, original, timed)  # what resume() puts back
            if owner.__dict__.get(name) is replacement:  # not paused now
                setattr(owner, name, timed)
        self._undo += [(CUDAGraphWrapper, "serve", serve), (EngineGraph, "run", run),
                       (CUDAGraphWrapper, "_replay_checked", look)]
        CUDAGraphWrapper.serve, EngineGraph.run = self._own("serve", serve), self._inside(run)
        CUDAGraphWrapper._replay_checked = self._own("look", look)
        self.guards: dict[str, Any] = {}
        """Per twin, its first guarded graph: the guard's source and its time alone, inside a step."""
        session.step, session.eager_step = self._own("step", step), self._own("eager", eager)
        session.vllm_call = self._inside(session.vllm_call)  # vLLM's own wrapper call, from the hooks
        self._guards = [(entry, entry.guard) for twin in session.twins for entry in twin.graphs.values()]
        for twin in session.twins:  # every graph is held by now (the clock starts after capture)
            for entry in twin.graphs.values():
                entry.guard = self._timed_guard(twin.name, entry)
        self.probes = {"outside a step": host_probe(session)}

    def _inside(self, function: Any) -> Any:
        """``function`` (vLLM's own work) timed into ``inner``: what the times around it leave out."""
        clock, inner = time.perf_counter_ns, self.inner

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                return function(*args, **kwargs)
            finally:
                inner[0] += clock() - began
        return timed

    def _own(self, what: str, function: Any, decides: bool = False) -> Any:
        """``function`` timed as ``what`` at the current level, less the time inside vLLM's own work
        within it, its calls counted; ``decides``: its calls outside dummy runs are the level's steps."""
        clock, inner, session = time.perf_counter_ns, self.inner, self.session

        def timed(*args: Any, **kwargs: Any) -> Any:
            began, inside, dummy = clock(), inner[0], session.dummy_depth
            try:
                return function(*args, **kwargs)
            finally:
                self.own[self.level, what] += clock() - began - (inner[0] - inside)
                self.calls[self.level, what] += 1
                if decides and not dummy:
                    self.steps[self.level] += 1
        return timed

    def _timed_hook(self, name: str, replacement: Any, original: Any) -> Any:
        """``replacement`` (a hook) timed less the time in ``original`` (vLLM's method, called from the
        hook's closure, which is pointed at a timed copy) and in vLLM's replays; a decision hook's calls
        outside dummy runs are the level's steps."""
        function = getattr(replacement, "__func__", replacement)
        for cell in function.__closure__ or ():
            if cell.cell_contents is original:
                self._cells.append((cell, original))
                cell.cell_contents = self._inside(original)
        return self._own(name, function, decides=name in DECISIONS)

    def _timed_guard(self, name: str, entry: Any) -> Any:
        clock = time.perf_counter_ns
        guard = entry.guard

        def timed(args: Any, kwargs: Any, real: int) -> bool:
            if name not in self.guards:  # once per twin: probes, left out of every time around them
                probed = clock()
                if "inside a step" not in self.probes:
                    self.probes["inside a step"] = host_probe(self.session)
                self.guards[name] = guard_alone(entry.checks, args, kwargs, real)
                self.inner[0] += clock() - probed
            began = clock()
            try:
                return guard(args, kwargs, real)
            finally:
                self.own[self.level, "guard"] += clock() - began
                self.calls[self.level, "guard"] += 1
        return timed

    def close(self) -> None:
        from inspector.engines.vllm import hooks

        for owner, name, original in self._undo:
            setattr(owner, name, original)
        for entry, guard in self._guards:
            entry.guard = guard
        for cell, original in self._cells:
            cell.cell_contents = original
        for index, (owner, name, original, replacement) in enumerate(self._hooks):
            timed = hooks._per_step[index][3]
            hooks._per_step[index] = (owner, name, original, replacement)
            if owner.__dict__.get(name) is timed:
                setattr(owner, name, replacement)
        self.session.__dict__.pop("step", None)
        self.session.__dict__.pop("eager_step", None)
        self.session.vllm_call = self._vllm_call

    def _level(self, level: str, steps: int, hooked: list[str]) -> dict[str, Any]:
        def per_step(*what: str) -> float:
            return round(sum(self.own[level, w] for w in what) / steps / 1e3, 2)
        return {"steps": steps, "integration_us_per_step": per_step(*hooked),
                "hooks_us_per_step": {name: per_step(name) for name in hooked if self.calls[level, name]},
                "serve_us_per_step": per_step("serve"), "guard_us_per_step": per_step("guard"),
                "closer_look_us_per_step": per_step("look"), "closer_looks": self.calls[level, "look"],
                "new_decision_records": self.calls[level, "step"],
                "step_record_us_per_step": per_step("step"),
                "eager_steps": self.calls[level, "eager"], "eager_record_us_per_step": per_step("eager"),
                "serve_calls_per_step": round(self.calls[level, "serve"] / steps, 3),
                "guard_calls_per_step": round(self.calls[level, "guard"] / steps, 3)}

    def result(self) -> dict[str, Any]:
        """Per level: microseconds a step in the integration in all (``integration_us_per_step``: every
        per-step hook less vLLM's own methods and replays inside it) and in its parts (each hook; the
        twins' serve, the guards and the closer looks; the record of new decisions and of eager steps),
        the calls of serve and of the guards a step, over the steps the decision hook saw at that level."""
        out: dict[str, Any] = {}
        hooked = sorted({name for _, name, _, _ in self._hooks})
        for level, steps in self.steps.items():
            if steps:
                out[level] = self._level(level, steps, hooked)
        out["probes"] = self.probes
        out["guards"] = self.guards
        return out


DECISIONS = ("dispatch_cg_and_sync_dp", "_determine_batch_execution_and_padding")
"""The per-step hooks that see each step's decision once (V2, V1): their calls count the steps."""


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
