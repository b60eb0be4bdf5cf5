"""Real traffic for the graph cache: an Azure LLM trace replayed through continuous batching.

A graph cache is judged by the batch sizes it meets. Uniform or fixed batches flatter every
capture-size policy; production decode batches drift every step as requests arrive and finish. This
module replays the arrivals and generation lengths of a real conversation-service trace (see
``trace.py``) through a small vLLM-like scheduler, so the demo, the padding benchmark and any
capture-size advice are measured on the traffic a cache actually sees. Standard library only.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from capture_core.reference.trace import Trace, TraceRequest


@dataclass(frozen=True)
class TrafficConfig:
    """How the trace is replayed.

    Each scheduler step is ``step_seconds`` of engine time; arrivals are replayed ``speedup`` times
    faster than recorded, so one step covers ``step_seconds * speedup`` seconds of the trace. The
    steady-state batch is about arrival rate x mean generation length x that product, which is how
    a speedup reaches large batches from a modest trace. ``seed`` picks where in the trace the
    replay starts; ``warmup_steps`` are simulated but not yielded, so the first yielded step meets
    an already busy engine instead of an empty one. ``ramp_steps`` does the opposite: the replay
    speed climbs linearly from 0 to ``speedup`` over that many steps, so a cold engine meets a few
    requests first and then more, and its batches grow through every size on the way.
    """

    max_num_seqs: int = 256
    speedup: float = 1.0
    step_seconds: float = 0.02
    seed: int = 0
    warmup_steps: int = 0
    chunked_prefill: bool = False
    """Prefill prompts as chunks in the same steps as decodes (mixed batches)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes first, then prefill chunks); used with chunked_prefill."""
    ramp_steps: int = 0
    """Steps over which the replay speed climbs linearly from 0 to ``speedup`` (0: no ramp)."""

    def __post_init__(self) -> None:
        seqs = self.max_num_seqs
        if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if not (isinstance(self.speedup, int | float) and math.isfinite(self.speedup) and self.speedup > 0):
            raise ValueError(f"speedup must be a positive number, got {self.speedup!r}")
        if not (isinstance(self.step_seconds, int | float) and math.isfinite(self.step_seconds)
                and self.step_seconds > 0):
            raise ValueError(f"step_seconds must be a positive number, got {self.step_seconds!r}")
        for name in ("warmup_steps", "ramp_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}), so that every running request can decode in each step"
            )

    def trace_seconds(self, engine_s: float) -> float:
        """Seconds of the trace replayed in the first ``engine_s`` engine seconds (the speed's integral)."""
        ramp_s = self.ramp_steps * self.step_seconds
        if engine_s < ramp_s:
            return self.speedup * engine_s * engine_s / (2 * ramp_s)
        return self.speedup * (engine_s - ramp_s / 2)

    def engine_seconds(self, trace_s: float) -> float:
        """The engine time at which ``trace_s`` seconds of the trace have been replayed."""
        ramp_s = self.ramp_steps * self.step_seconds
        if trace_s < self.speedup * ramp_s / 2:
            return math.sqrt(2 * ramp_s * trace_s / self.speedup)
        return trace_s / self.speedup + ramp_s / 2


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Part of one request's prompt, prefilled in a mixed step."""

    request_id: int
    slot: int
    start: int
    """Position of the chunk's first prompt token."""
    num_tokens: int
    final: bool
    """True for the prompt's last chunk: it samples the request's first generated token."""


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: who decodes (and in which KV-cache slot), and which prompt chunks run."""

    index: int
    trace_time_s: float
    """Seconds into the trace (from its first arrival, modulo one pass) at the step's start."""
    decode_request_ids: tuple[int, ...]
    decode_slots: tuple[int, ...]
    decode_positions: tuple[int, ...]
    """Position of the token each decoding request feeds: its prompt length plus tokens so far."""
    prefill_chunks: tuple[PrefillChunk, ...] = ()
    finished_request_ids: tuple[int, ...] = ()
    """Requests whose last token was produced in this step; they leave after it."""
    num_waiting: int = 0
    """Arrived requests still queued for a free sequence slot after this step's admissions."""

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_request_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.prefill_chunks)

    @property
    def num_real_tokens(self) -> int:
        """Every token of the step (decodes and prompt chunks): what a graph is padded up from."""
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def uniform_decode(self) -> bool:
        """A pure decode step: what a FULL decode graph serves."""
        return not self.prefill_chunks


@dataclass(slots=True)
class _Running:
    request_id: int
    slot: int
    context_tokens: int
    generated_tokens: int
    prefilled: int
    decoded: int = 0


@dataclass(frozen=True, slots=True)
class _Arrival:
    engine_time_s: float
    request_id: int
    request: TraceRequest


_CLOCK_SLACK_S = 1e-9
"""Arrivals this close after a step's start count as arrived: float step times are not exact, and
the idle jump and the admission must agree on which step an arrival lands in."""


class _Engine:
    """The scheduler's moving parts: the queue, the running requests and the free KV slots."""

    def __init__(self, config: TrafficConfig, arrivals: Iterator[_Arrival]) -> None:
        self.config = config
        self.arrivals = arrivals
        self.upcoming = next(arrivals)
        self.waiting: deque[_Arrival] = deque()
        self.running: list[_Running] = []
        self.free_slots = list(range(config.max_num_seqs))  # a heap: the lowest free slot first

    def skip_idle(self, step_index: int) -> int:
        """With nothing running or queued, the step at which the next request will have arrived."""
        if self.running or self.waiting:
            return step_index
        arrival_step = math.ceil((self.upcoming.engine_time_s - _CLOCK_SLACK_S) / self.config.step_seconds)
        return max(step_index, arrival_step)

    def admit(self, now: float) -> None:
        """Queue what arrived by ``now``; admit from the queue head while sequence slots are free."""
        while self.upcoming.engine_time_s <= now + _CLOCK_SLACK_S:
            self.waiting.append(self.upcoming)
            self.upcoming = next(self.arrivals)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            arrival = self.waiting.popleft()
            request = arrival.request
            prefilled = 0 if self.config.chunked_prefill else request.context_tokens
            slot = heapq.heappop(self.free_slots)
            running = _Running(arrival.request_id, slot, request.context_tokens, request.generated_tokens,
                               prefilled)
            self.running.append(running)

    def decode(self) -> tuple[list[_Running], list[_Running]]:
        """Every request past its prompt decodes one token: (the decoders, those now finished)."""
        decoding = [r for r in self.running if r.prefilled == r.context_tokens]
        finished = []
        for r in decoding:
            r.decoded += 1
            if r.decoded == r.generated_tokens:
                finished.append(r)
        return decoding, finished

    def prefill(self, num_decoding: int, finished: list[_Running]) -> list[PrefillChunk]:
        """Prompt chunks, oldest request first, from the token budget the decodes left."""
        budget = self.config.max_num_batched_tokens - num_decoding
        chunks: list[PrefillChunk] = []
        for r in self.running:
            if budget <= 0:
                break
            remaining = r.context_tokens - r.prefilled
            if remaining <= 0:
                continue
            size = min(remaining, budget)
            final = size == remaining
            chunks.append(PrefillChunk(r.request_id, r.slot, r.prefilled, size, final))
            r.prefilled += size
            budget -= size
            if final:
                r.decoded = 1  # the last prompt chunk samples the first generated token
                if r.generated_tokens == 1:
                    finished.append(r)
        return chunks

    def retire(self, finished: list[_Running]) -> None:
        """Finished requests leave; their KV slots are free for the next admissions."""
        if not finished:
            return
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]
        for r in finished:
            heapq.heappush(self.free_slots, r.slot)


class ContinuousBatchScheduler:
    """Replays a trace through continuous batching: the per-step batches a graph cache meets.

    Every step: arrivals up to the step's start join a FIFO queue; queued requests are admitted
    while fewer than ``max_num_seqs`` run, each taking the lowest free KV-cache slot; every running
    request past its prompt decodes one token; with chunked prefill, prompts are prefilled in
    chunks from the token budget left after the decodes (the last chunk samples the first token);
    requests that produced all their generated tokens leave. When nothing runs or waits, the clock
    jumps to the next arrival, as an idle engine would wait for it, so every step has work.

    The trace is replayed in a loop from a seeded offset, so ``steps()`` never runs dry. Same trace,
    same config: the same steps.
    """

    def __init__(self, trace: Trace, config: TrafficConfig | None = None) -> None:
        self.trace = trace
        self.config = config or TrafficConfig()
        period = trace.period_s
        self.start_offset_s = random.Random(self.config.seed).random() * period
        arrivals = [r.arrival_s for r in trace.requests]
        self._first_index = bisect.bisect_left(arrivals, self.start_offset_s)

    def request(self, request_id: int) -> TraceRequest:
        """The trace row behind a request id (ids count arrivals from the seeded offset)."""
        return self.trace.requests[(self._first_index + request_id) % len(self.trace)]

    def _arrivals(self) -> Iterator[_Arrival]:
        """Trace requests from the seeded offset on, looping, in engine seconds since the start."""
        requests, period, offset = self.trace.requests, self.trace.period_s, self.start_offset_s
        request_id, lap, index = 0, 0, self._first_index
        while True:
            if index == len(requests):
                index, lap = 0, lap + 1
            request = requests[index]
            trace_s = request.arrival_s + lap * period - offset
            if trace_s < 0:  # before the offset on the first lap: comes round on the next lap
                trace_s += period
            yield _Arrival(self.config.engine_seconds(trace_s), request_id, request)
            request_id += 1
            index += 1

    def steps(self) -> Iterator[Step]:
        """Yield steps forever (use ``itertools.islice`` or ``take`` for a fixed number)."""
        cfg = self.config
        engine = _Engine(cfg, self._arrivals())
        period = self.trace.period_s
        step_index = simulated = 0
        while True:
            step_index = engine.skip_idle(step_index)
            now = step_index * cfg.step_seconds
            engine.admit(now)
            decoding, finished = engine.decode()
            chunks = engine.prefill(len(decoding), finished) if cfg.chunked_prefill else []
            step = Step(
                index=simulated - cfg.warmup_steps,
                trace_time_s=(self.start_offset_s + cfg.trace_seconds(now)) % period,
                decode_request_ids=tuple(r.request_id for r in decoding),
                decode_slots=tuple(r.slot for r in decoding),
                decode_positions=tuple(r.context_tokens + r.decoded - 1 for r in decoding),
                prefill_chunks=tuple(chunks),
                finished_request_ids=tuple(r.request_id for r in finished),
                num_waiting=len(engine.waiting),
            )
            engine.retire(finished)
            step_index += 1
            simulated += 1
            if simulated > cfg.warmup_steps:
                yield step

    def take(self, num_steps: int) -> list[Step]:
        """The first ``num_steps`` steps."""
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        return list(itertools.islice(self.steps(), num_steps))


def decode_batch_sizes(trace: Trace, config: TrafficConfig, num_steps: int) -> list[int]:
    """Tokens per step of ``num_steps`` steps: the batch sizes a decode graph cache meets."""
    return [step.num_real_tokens for step in ContinuousBatchScheduler(trace, config).take(num_steps)]

