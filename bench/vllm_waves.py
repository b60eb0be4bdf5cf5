"""``bench/vllm_serve.py --waves N``: the same work served at each level, so that 1% can be seen.

Segments of one continuous serve (``--alternate``) compare neighbouring steps, but neighbouring steps
are not the same work: one segment prefills more prompts than the next, and in runs 6 to 8 two
levels that add no checks at all landed 1-2% from ``off``. Here each cycle takes one window of the
trace (its arrivals over ``--wave-steps`` engine steps at full speed, re-based to step 0) and serves
it once at every level, in an order rotated by one each cycle: every wave of a cycle is the same
requests (the same prompts, lengths and arrival steps, so the same scheduler decisions and batches),
with vLLM's prefix cache emptied before each so that none finds the last one's prompts cached.
What a level costs is then its wave's time against ``off``'s on identical work, cycle by cycle; and
since greedy decoding of the same batches gives the same tokens, each cycle's waves must also agree
token for token and step for step (said per cycle in the result: a check that the work was the same
and that no level changed what vLLM computed).
"""

from __future__ import annotations

import collections
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

Request = tuple[int, list[int], int]
"""(arrival step within the wave, prompt token ids, output tokens)."""


def windows(requests: Sequence[Request], start: int, width: int, count: int) -> list[list[Request]]:
    """``count`` windows of ``width`` arrival steps from ``start`` on, each re-based to step 0."""
    out: list[list[Request]] = [[] for _ in range(count)]
    for step, prompt, output in requests:
        index, offset = divmod(step - start, width)
        if step >= start and index < count:
            out[index].append((offset, prompt, output))
    return out


def serve_requests(engine: Any, requests: Sequence[Request], prefix: str, params: Callable[[int], Any],
                   on_step: Callable[[int], None] = lambda _: None) -> tuple[dict[str, list[int]], int, int]:
    """Serve ``requests`` through vLLM's ``LLMEngine`` to the end, each added at its arrival step (an
    idle engine skips to the next arrival), as ``<prefix><i>``: the tokens of each (in the order added),
    the engine steps run and the arrival clock's last step. ``on_step(i)`` is told each step before it
    runs (``i`` counts from 0)."""
    pending = collections.deque(requests)
    clock = ran = 0
    made: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            clock = max(clock, pending[0][0])  # idle until the next arrival: no step to run
        while pending and pending[0][0] <= clock:
            _, prompt, output = pending.popleft()
            request = f"{prefix}{len(made)}"
            engine.add_request(request, {"prompt_token_ids": prompt}, params(output))
            made[request] = []
        on_step(ran)
        for result in engine.step():
            if result.finished:
                made[result.request_id] = list(result.outputs[0].token_ids)
        clock += 1
        ran += 1
    return made, ran, clock


class Waves:
    """Serves each window once per level (``levels.apply`` between waves; None: nothing to apply)."""

    def __init__(self, windows: list[list[Request]], levels: Any = None,
                 order: tuple[str, ...] = ("on", "off")) -> None:
        self.windows, self.levels, self.order = windows, levels, order
        self.done: list[dict[str, Any]] = []
        self.tokens: dict[str, list[int]] = {}
        self.steps = 0

    def level(self, cycle: int, position: int) -> str:
        return self.order[(position + cycle) % len(self.order)]

    def run(self, engine: Any, params: Callable[[int], Any], on_step: Callable[[int], None] = lambda _: None,
            ) -> None:
        """Every cycle's waves; ``params(n)``: vLLM's sampling parameters for ``n`` output tokens;
        ``on_step(n)``: told the engine step about to run (counted over every wave)."""
        for cycle, window in enumerate(self.windows):
            for position in range(len(self.order)):
                level = self.level(cycle, position)
                if self.levels is not None:
                    self.levels.apply(level)
                emptied = engine.reset_prefix_cache()
                wave = self._serve(engine, window, f"c{cycle}-{level}-", params, on_step)
                self.done.append({"cycle": cycle, "level": level, "cache_emptied": bool(emptied), **wave})
        if self.levels is not None:
            self.levels.apply("on")

    def _serve(self, engine: Any, window: list[Request], prefix: str, params: Callable[[int], Any],
               on_step: Callable[[int], None]) -> dict[str, Any]:
        cpu, began = time.process_time(), time.perf_counter()

        def stepping(_: int) -> None:
            on_step(self.steps)
            self.steps += 1

        made, ran, _ = serve_requests(engine, window, prefix, params, stepping)
        seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
        self.tokens.update(made)
        ordered = list(made.values())
        return {"requests": len(made), "steps": ran, "tokens": sum(map(len, ordered)),
                "seconds": round(seconds, 6), "cpu_seconds": round(cpu_seconds, 6),
                "tokens_sha256": hashlib.sha256(json.dumps(ordered).encode()).hexdigest()}

    def result(self) -> dict[str, Any]:
        """Per level: tokens/s over all its waves; within each cycle its tokens/s over ``off``'s (wall
        time) and ``off``'s CPU seconds over its own (the process's CPU time, every thread), the
        medians over cycles; whether every cycle's waves agreed in tokens and steps."""
        by_cycle: dict[int, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
        for wave in self.done:
            by_cycle[wave["cycle"]][wave["level"]] = wave
        levels: dict[str, Any] = {}
        for level in self.order:
            waves = [w for w in self.done if w["level"] == level]
            seconds = sum(w["seconds"] for w in waves)
            wall, cpu = [], []
            for cycle in by_cycle.values():
                off, own = cycle.get("off"), cycle.get(level)
                if off and own and own["tokens"] and own["seconds"]:
                    wall.append(round(off["seconds"] / own["seconds"], 4))  # the same tokens: a time ratio
                if off and own and own["tokens"] and own["cpu_seconds"]:
                    cpu.append(round(off["cpu_seconds"] / own["cpu_seconds"], 4))
            levels[level] = {
                "tok_per_s": round(sum(w["tokens"] for w in waves) / seconds, 1) if seconds else None,
                "cycle_ratios": wall, "median_cycle_ratio": statistics.median(wall) if wall else None,
                "cpu_cycle_ratios": cpu, "median_cpu_ratio": statistics.median(cpu) if cpu else None,
            }
        same = [len({(w["tokens_sha256"], w["steps"]) for w in c.values()}) == 1 for c in by_cycle.values()]
        return {"order": list(self.order), "cycles": len(by_cycle), "waves": self.done, "levels": levels,
                "cycles_identical": sum(same), "every_cycle_identical": all(same)}
