"""``bench/vllm_serve.py --alternate``: the serve cut into segments, the integration on and paused in
turn (on, off, off, on, ...), and each on segment compared with its off neighbour. vLLM itself is not
needed: with no hooks installed ``pause``/``resume`` have nothing to swap, and what is under test is
the cutting, the order and the arithmetic (the real serve runs on the GPU machine, BENCHMARKS.md)."""

from __future__ import annotations

import time

import pytest

from bench.vllm_serve import Segments


def serve(segments: Segments, steps: int, tokens_per_step: int, pause_s: float = 0.0) -> None:
    """``steps`` engine steps, each giving every one of two requests ``tokens_per_step`` more tokens."""
    made = {"a": 0, "b": 0}
    for step in range(1, steps + 1):
        for request in made:
            made[request] += tokens_per_step
            segments.made(request, made[request])
        if pause_s:
            time.sleep(pause_s)
        segments.stepped(step)


def test_segments_alternate_on_off_off_on_and_count_only_new_tokens() -> None:
    segments = Segments(every=5)
    serve(segments, steps=42, tokens_per_step=3)
    done = segments.result()["segments"]
    assert [s["on"] for s in done] == [True, False, False, True, True, False, False, True]
    assert all(s["steps"] == 5 and s["tokens"] == 5 * 2 * 3 for s in done)  # steps 41-42: no segment


def test_pair_ratios_compare_each_on_segment_with_its_off_neighbour() -> None:
    segments = Segments(every=4)
    segments.done = [  # tokens/s 100, 50 | 40, 80 | 90, 90
        {"on": True, "steps": 4, "tokens": 100, "seconds": 1.0},
        {"on": False, "steps": 4, "tokens": 50, "seconds": 1.0},
        {"on": False, "steps": 4, "tokens": 40, "seconds": 1.0},
        {"on": True, "steps": 4, "tokens": 80, "seconds": 1.0},
        {"on": True, "steps": 4, "tokens": 90, "seconds": 1.0},
        {"on": False, "steps": 4, "tokens": 90, "seconds": 2.0},
    ]
    result = segments.result()
    assert result["pair_ratios"] == [2.0, 2.0, 2.0]
    assert result["median_pair_ratio"] == 2.0
    assert result["tok_per_s_on"] == pytest.approx(270 / 3, abs=0.1)
    assert result["tok_per_s_off"] == pytest.approx(180 / 4, abs=0.1)


def test_a_slower_on_side_shows_in_the_ratio() -> None:
    segments = Segments(every=3)
    original = segments.stepped

    def stepped(step: int) -> None:  # the on segments take longer per step
        if not segments.done or len(segments.done) % 4 in (0, 3):
            time.sleep(0.004)
        original(step)

    segments.stepped = stepped  # type: ignore[method-assign]
    serve(segments, steps=24, tokens_per_step=1)
    result = segments.result()
    assert len(result["pair_ratios"]) == 4
    assert result["median_pair_ratio"] < 0.9


def test_off_by_default() -> None:
    segments = Segments(every=0)
    serve(segments, steps=10, tokens_per_step=1)
    assert segments.done == []
