"""The trace loader and the continuous-batching scheduler, on the real Azure trace."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest

from capture_core.reference import (
    DEFAULT_TRACE_PATH,
    ContinuousBatchScheduler,
    Trace,
    TraceError,
    TraceRequest,
    TrafficConfig,
    batch_size_histogram,
    batch_size_stats,
    decode_batch_sizes,
    load_trace,
    padding_stats,
)
from capture_core.sizes import SizeTable, power_of_two_sizes


@pytest.fixture(scope="module")
def trace() -> Trace:
    return load_trace()


def test_packaged_trace_loads_in_arrival_order(trace: Trace) -> None:
    assert len(trace) > 19_000
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    # One hour of traffic; 7-digit fractions are parsed, not truncated to whole seconds.
    assert 3_500 < arrivals[-1] < 3_600
    assert trace.requests[1].arrival_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert trace.requests[0] == TraceRequest(0.0, 374, 44)
    assert trace.source == str(DEFAULT_TRACE_PATH)


def test_same_seed_same_steps_other_seed_other_steps(trace: Trace) -> None:
    config = TrafficConfig(speedup=4, seed=7, warmup_steps=200)
    first = ContinuousBatchScheduler(trace, config).take(150)
    again = ContinuousBatchScheduler(trace, config).take(150)
    assert first == again
    other = ContinuousBatchScheduler(trace, TrafficConfig(speedup=4, seed=8, warmup_steps=200)).take(150)
    assert [s.num_real_tokens for s in other] != [s.num_real_tokens for s in first]


def test_batch_size_varies_and_is_bounded_by_max_num_seqs(trace: Trace) -> None:
    sizes = decode_batch_sizes(trace, TrafficConfig(max_num_seqs=100, speedup=4, warmup_steps=300), 500)
    stats = batch_size_stats(sizes)
    assert stats.max <= 100
    assert stats.min >= 1
    assert stats.distinct > 1
    assert stats.changed_share > 0.1

    free = decode_batch_sizes(trace, TrafficConfig(max_num_seqs=256, speedup=8, warmup_steps=300), 500)
    assert batch_size_stats(free).distinct > 20
    assert batch_size_stats(free).max > 100


def test_full_engine_queues_arrivals_and_reuses_slots(trace: Trace) -> None:
    config = TrafficConfig(max_num_seqs=8, speedup=20, warmup_steps=100)
    steps = ContinuousBatchScheduler(trace, config).take(300)
    assert all(s.num_decode_tokens == 8 for s in steps)
    assert all(s.num_waiting > 0 for s in steps)
    for s in steps:
        assert len(set(s.decode_slots)) == len(s.decode_slots)
        assert set(s.decode_slots) <= set(range(8))


def test_requests_decode_exactly_their_generated_tokens_then_leave(trace: Trace) -> None:
    config = TrafficConfig(speedup=2, seed=3)
    scheduler = ContinuousBatchScheduler(trace, config)
    steps = scheduler.take(3_000)
    decoded: Counter[int] = Counter()
    positions: dict[int, list[int]] = {}
    slot_of: dict[int, int] = {}
    finished_at: dict[int, int] = {}
    for s in steps:
        for rid, slot, pos in zip(s.decode_request_ids, s.decode_slots, s.decode_positions, strict=True):
            assert rid not in finished_at, "a finished request decoded again"
            decoded[rid] += 1
            positions.setdefault(rid, []).append(pos)
            assert slot_of.setdefault(rid, slot) == slot, "a request changed KV slot"
        for rid in s.finished_request_ids:
            finished_at[rid] = s.index
    assert len(finished_at) > 100
    # Request ids count arrivals from the seeded offset, so the trace row of id i is known.
    for rid in finished_at:
        row = scheduler.request(rid)
        assert decoded[rid] == row.generated_tokens
        start = row.context_tokens
        assert positions[rid] == list(range(start, start + row.generated_tokens))


def test_chunked_prefill_mixes_prompt_chunks_within_the_token_budget(trace: Trace) -> None:
    config = TrafficConfig(speedup=8, chunked_prefill=True, max_num_batched_tokens=512)
    scheduler = ContinuousBatchScheduler(trace, config)
    steps = scheduler.take(1_500)
    assert any(not s.uniform_decode for s in steps)
    assert any(s.uniform_decode for s in steps)
    prefilled: Counter[int] = Counter()
    decoded: Counter[int] = Counter()
    prompt_done: set[int] = set()
    finished = 0
    for s in steps:
        assert s.num_real_tokens <= 512
        for chunk in s.prefill_chunks:
            row = scheduler.request(chunk.request_id)
            assert chunk.request_id not in prompt_done
            assert chunk.start == prefilled[chunk.request_id], "chunks must continue where the last one ended"
            prefilled[chunk.request_id] += chunk.num_tokens
            assert chunk.final == (prefilled[chunk.request_id] == row.context_tokens)
        for rid in s.decode_request_ids:
            assert rid in prompt_done, "decoded before its prompt was prefilled"
            decoded[rid] += 1
        prompt_done |= {c.request_id for c in s.prefill_chunks if c.final}
        for rid in s.finished_request_ids:
            # the last prompt chunk sampled the first token; decodes produced the rest
            assert decoded[rid] == scheduler.request(rid).generated_tokens - 1
            finished += 1
    assert finished > 50


def test_idle_engine_jumps_to_the_next_arrival(trace: Trace) -> None:
    # Very slow replay: mostly idle, but every yielded step has work to do.
    steps = ContinuousBatchScheduler(trace, TrafficConfig(speedup=0.05)).take(200)
    assert all(s.num_real_tokens >= 1 for s in steps)
    assert [s.index for s in steps] == list(range(200))


def test_a_ramp_speeds_the_replay_up_from_zero_to_full_speed_and_stays_there() -> None:
    config = TrafficConfig(speedup=6, step_seconds=0.02, ramp_steps=200)  # a 4-second ramp
    speed = [(config.trace_seconds(t + 1e-6) - config.trace_seconds(t)) / 1e-6 for t in (0, 2, 4, 8)]
    assert speed == pytest.approx([0, 3, 6, 6], abs=1e-3)
    for engine_s in (0.0, 0.3, 3.99, 4.0, 4.01, 100.0):
        assert config.engine_seconds(config.trace_seconds(engine_s)) == pytest.approx(engine_s, abs=1e-9)
    assert config.trace_seconds(100) == pytest.approx(6 * 98)  # half the ramp's time is lost once
    flat = TrafficConfig(speedup=6)
    assert [flat.engine_seconds(t) for t in (0, 6, 60)] == [0, 1, 10]  # no ramp: the plain speedup


def test_a_ramped_cold_start_meets_the_same_requests_later_and_then_the_full_rate(trace: Trace) -> None:
    base = {"speedup": 6.0, "chunked_prefill": True, "max_num_batched_tokens": 320}
    ramped = ContinuousBatchScheduler(trace, TrafficConfig(**base, ramp_steps=200)).take(400)
    flat = ContinuousBatchScheduler(trace, TrafficConfig(**base)).take(400)
    admitted = [dict.fromkeys(c.request_id for s in steps for c in s.prefill_chunks)
                for steps in (ramped, flat)]
    assert list(admitted[0]) == list(admitted[1])[: len(admitted[0])], "the same requests, in order"
    assert len(admitted[0]) < len(admitted[1])
    early = [sum(s.num_real_tokens for s in steps[:100]) / 100 for steps in (ramped, flat)]
    assert early[0] < early[1] / 2, early
    first = ramped[0]
    assert len(first.prefill_chunks) == 1 and not first.decode_request_ids, "a cold start: one request"
    after = [b.trace_time_s - a.trace_time_s for a, b in itertools.pairwise(ramped[250:])]
    assert after == pytest.approx([6 * 0.02] * len(after)), "past the ramp, the full speed"


def test_replay_loops_past_the_end_of_the_trace() -> None:
    tiny = Trace((TraceRequest(0.0, 4, 2), TraceRequest(1.0, 4, 3)), "tiny")
    steps = ContinuousBatchScheduler(tiny, TrafficConfig(step_seconds=0.25)).take(50)
    ids = {rid for s in steps for rid in s.decode_request_ids}
    assert len(ids) > 2


def test_a_trace_squeezed_into_an_instant_loops_once_a_second_not_endlessly() -> None:
    burst = Trace(tuple(TraceRequest(i * 1e-300, 4, 2) for i in range(3)), "burst")
    assert burst.period_s == 1.0
    steps = ContinuousBatchScheduler(burst, TrafficConfig(step_seconds=0.25)).take(20)
    assert max(s.num_waiting + s.num_real_tokens for s in steps) <= 6
    assert len({rid for s in steps for rid in s.decode_request_ids}) > 3


def test_stats_helpers() -> None:
    stats = batch_size_stats([1, 1, 2, 4, 4, 4, 8, 100])
    assert (stats.min, stats.max, stats.p50, stats.distinct) == (1, 100, 4, 5)
    assert stats.mean == pytest.approx(124 / 8)
    assert stats.changed_share == pytest.approx(4 / 7)
    assert batch_size_histogram([3, 1, 3]) == {1: 1, 3: 2}
    with pytest.raises(ValueError):
        batch_size_stats([])


def test_padding_stats_counts_waste_replays_and_eager_batches() -> None:
    table = SizeTable(power_of_two_sizes(8))
    stats = padding_stats([3, 8, 5, 9], table)
    assert stats.steps == 4 and stats.replayed_steps == 3
    assert stats.captured_tokens == 4 + 8 + 8
    assert stats.padding_tokens == 1 + 0 + 3
    assert stats.padding_waste == pytest.approx(4 / 20)
    assert stats.hit_ratio == pytest.approx(0.75)
    assert stats.eager_tokens == 9


def test_padding_stats_read_as_the_glossary_says_before_any_replay() -> None:
    table = SizeTable(power_of_two_sizes(8))
    nothing, all_eager = padding_stats([], table), padding_stats([9, 12], table)
    assert (nothing.padding_waste, nothing.hit_ratio) == (None, None)
    assert (all_eager.padding_waste, all_eager.hit_ratio) == (None, 0.0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty"),
        ("TIMESTAMP,Context,GeneratedTokens\n", "expected the header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10\n", "line 2: expected 3 fields"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n", "line 2: bad TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n2023-11-16 18:15:47,x,5\n",
         "line 3: ContextTokens must be an integer"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,0\n",
         "GeneratedTokens must be positive"),
    ],
)
def test_malformed_trace_files_get_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_missing_and_binary_trace_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "absent.csv")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(TraceError):
        load_trace(binary)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"speedup": 0},
        {"speedup": float("nan")},
        {"step_seconds": -1},
        {"warmup_steps": -1},
        {"ramp_steps": -1},
        {"ramp_steps": 2.5},
        {"chunked_prefill": True, "max_num_seqs": 256, "max_num_batched_tokens": 100},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TrafficConfig(**kwargs)  # type: ignore[arg-type]
