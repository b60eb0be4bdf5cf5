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
        self.own: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.steps: collections.Counter = collections.Counter()
        inner = [0]
        clock = time.perf_counter_ns
        serve, run, step = CUDAGraphWrapper.serve, EngineGraph.run, session.step

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

        def timed_step(*args: Any, **kwargs: Any) -> None:
            began = clock()
            try:
                step(*args, **kwargs)
            finally:
                self.own[self.level, "step"] += clock() - began
                self.steps[self.level] += 1

        self._undo = [(CUDAGraphWrapper, "serve", serve), (EngineGraph, "run", run)]
        CUDAGraphWrapper.serve, EngineGraph.run = timed_serve, timed_run
        session.step = timed_step

    def close(self) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)

    def result(self) -> dict[str, Any]:
        """Per level: microseconds a step in the twins' serve (vLLM's replay excluded) and in the step
        record, the graph calls a step, over the steps the integration recorded at that level."""
        out: dict[str, Any] = {}
        for level, steps in self.steps.items():
            if steps:
                out[level] = {"steps": steps,
                              "serve_us_per_step": round(self.own[level, "serve"] / steps / 1e3, 2),
                              "step_record_us_per_step": round(self.own[level, "step"] / steps / 1e3, 2),
                              "graph_calls_per_step": round(self.calls[level, "serve"] / steps, 3)}
        return out
