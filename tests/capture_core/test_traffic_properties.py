"""Scheduler invariants on arbitrary small traces (hypothesis): what continuous batching promises."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from capture_core.reference import ContinuousBatchScheduler, Step, Trace, TraceRequest, TrafficConfig

requests = st.lists(
    st.tuples(st.floats(0.0, 0.5), st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=30
)


def build_trace(rows: list[tuple[float, int, int]]) -> Trace:
    arrival, built = 0.0, []
    for gap, context, generated in rows:
        arrival += gap
        built.append(TraceRequest(arrival, context, generated))
    return Trace(tuple(built), "generated")


configs = st.builds(
    TrafficConfig,
    max_num_seqs=st.integers(1, 8),
    speedup=st.floats(0.5, 8.0),
    step_seconds=st.sampled_from([0.01, 0.05, 0.2]),
    seed=st.integers(0, 1000),
    chunked_prefill=st.booleans(),
    max_num_batched_tokens=st.integers(8, 48),
    ramp_steps=st.sampled_from([0, 0, 7, 50]),
)


@settings(max_examples=60, deadline=None)
@given(rows=requests, config=configs)
def test_continuous_batching_invariants(rows: list[tuple[float, int, int]], config: TrafficConfig) -> None:
    trace = build_trace(rows)
    scheduler = ContinuousBatchScheduler(trace, config)
    steps: list[Step] = scheduler.take(120)

    decode_steps: dict[int, list[int]] = defaultdict(list)
    first_seen: dict[int, int] = {}
    prompt_done: set[int] = set()
    for s in steps:
        assert s.num_real_tokens >= 1, "an idle engine waits for the next arrival instead of stepping empty"
        assert s.num_decode_tokens <= config.max_num_seqs
        slots = set(s.decode_slots) | {c.slot for c in s.prefill_chunks}
        assert slots <= set(range(config.max_num_seqs))
        assert len(set(s.decode_slots)) == len(s.decode_slots)
        if config.chunked_prefill:
            assert s.num_real_tokens <= config.max_num_batched_tokens
        else:
            assert s.uniform_decode
        for rid in (*s.decode_request_ids, *(c.request_id for c in s.prefill_chunks)):
            first_seen.setdefault(rid, s.index)
        for rid, position in zip(s.decode_request_ids, s.decode_positions, strict=True):
            assert not config.chunked_prefill or rid in prompt_done
            decode_steps[rid].append(s.index)
            row = scheduler.request(rid)
            already = len(decode_steps[rid]) - 1 + (1 if config.chunked_prefill else 0)
            assert position == row.context_tokens + already
        prompt_done |= {c.request_id for c in s.prefill_chunks if c.final}
        for rid in s.finished_request_ids:
            row = scheduler.request(rid)
            expected = row.generated_tokens - (1 if config.chunked_prefill else 0)
            assert len(decode_steps.get(rid, [])) == expected

    # Without preemption, a request decodes in consecutive steps until it finishes.
    for indices in decode_steps.values():
        assert indices == list(range(indices[0], indices[0] + len(indices)))
    # FIFO: requests start in arrival order.
    starts = sorted(first_seen, key=lambda rid: (first_seen[rid], rid))
    assert starts == sorted(starts)


@settings(max_examples=80, deadline=None)
@given(
    step_seconds=st.floats(0.001, 0.5),
    gaps=st.lists(st.integers(0, 400), min_size=1, max_size=12),
    speedup=st.sampled_from([1.0, 3.0, 0.7]),
)
def test_arrivals_on_step_boundaries_after_idle_time_never_give_an_empty_step(
    step_seconds: float, gaps: list[int], speedup: float
) -> None:
    # Arrivals a whole number of steps apart, mostly after the engine went idle: the idle jump and
    # the admission must agree on the step an arrival lands in, despite float step times.
    arrival, rows = 0.0, []
    for gap in gaps:
        arrival += gap * step_seconds * speedup
        rows.append(TraceRequest(arrival, 4, 1))
    trace = Trace(tuple(rows), "boundaries")
    config = TrafficConfig(step_seconds=step_seconds, speedup=speedup)
    steps = ContinuousBatchScheduler(trace, config).take(40)
    assert all(s.num_real_tokens >= 1 for s in steps)
