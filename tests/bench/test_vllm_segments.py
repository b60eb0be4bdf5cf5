"""``bench/vllm_serve.py --alternate``: the serve cut into segments served at each level in turn (the
order rotated every cycle), and each level compared with ``off`` within the cycles. vLLM itself is not
needed: a stand-in records which level each segment was put at; what is under test is the cutting,
the order and the arithmetic (the real serve runs on the GPU machine, BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import time

import pytest

from bench.vllm_serve import Segments, levels_of


class Recorded:
    """Stands in for ``Levels``: the levels applied, in order."""

    def __init__(self) -> None:
        self.applied: list[str] = []

    def apply(self, level: str) -> None:
        self.applied.append(level)


def serve(segments: Segments, steps: int, tokens_per_step: int, slower: dict[str, float] | None = None
          ) -> None:
    """``steps`` engine steps, each giving two requests ``tokens_per_step`` more tokens; a level in
    ``slower`` sleeps that long a step."""
    made = {"a": 0, "b": 0}
    for step in range(1, steps + 1):
        for request in made:
            made[request] += tokens_per_step
            segments.made(request, made[request])
        if slower:
            time.sleep(slower.get(segments.level(len(segments.done)), 0.0))
        segments.stepped(step)


def test_two_levels_go_on_off_off_on_and_count_only_new_tokens() -> None:
    levels = Recorded()
    segments = Segments(every=5, levels=levels)
    serve(segments, steps=42, tokens_per_step=3)
    done = segments.result()["segments"]
    assert [s["level"] for s in done] == ["on", "off", "off", "on", "on", "off", "off", "on"]
    assert levels.applied[:9] == ["on", "off", "off", "on", "on", "off", "off", "on", "on"]
    assert levels.applied[-1] == "on"  # left as shipped after the serve
    assert all(s["steps"] == 5 and s["tokens"] == 5 * 2 * 3 for s in done)  # steps 41-42: no segment


def test_more_levels_rotate_so_each_serves_once_a_cycle_and_at_every_position() -> None:
    order = ("on", "off", "hooks", "recording")
    segments = Segments(every=1, order=order)
    levels = [segments.level(i) for i in range(16)]
    for cycle in range(4):
        assert sorted(levels[4 * cycle:4 * cycle + 4]) == sorted(order)
    for position in range(4):
        assert sorted(levels[position::4]) == sorted(order)


def test_each_level_is_compared_with_off_within_its_cycles_and_over_all() -> None:
    segments = Segments(every=4)
    segments.done = [  # tokens/s: on 100 off 50 | off 40 on 80 | on 90 off 45 (a partial cycle ignored)
        {"level": "on", "steps": 4, "tokens": 100, "seconds": 1.0},
        {"level": "off", "steps": 4, "tokens": 50, "seconds": 1.0},
        {"level": "off", "steps": 4, "tokens": 40, "seconds": 1.0},
        {"level": "on", "steps": 4, "tokens": 80, "seconds": 1.0},
        {"level": "on", "steps": 4, "tokens": 90, "seconds": 1.0},
        {"level": "off", "steps": 4, "tokens": 90, "seconds": 2.0},
        {"level": "off", "steps": 4, "tokens": 1, "seconds": 1.0},
    ]
    on = segments.result()["levels"]["on"]
    assert on["cycle_ratios"] == [2.0, 2.0, 2.0]
    assert on["median_cycle_ratio"] == 2.0
    assert on["tok_per_s"] == pytest.approx(270 / 3, abs=0.1)
    assert on["ratio_over_all"] == pytest.approx((270 / 3) / (181 / 5))


def test_a_slower_level_shows_in_its_ratio_and_the_others_do_not() -> None:
    segments = Segments(every=2, order=("on", "off", "hooks"))
    serve(segments, steps=36, tokens_per_step=1, slower={"on": 0.004})
    levels = segments.result()["levels"]
    assert len(levels["on"]["cycle_ratios"]) == 6
    assert levels["on"]["median_cycle_ratio"] < 0.9
    assert levels["hooks"]["median_cycle_ratio"] > levels["on"]["median_cycle_ratio"]


def test_off_by_default_and_levels_are_checked() -> None:
    segments = Segments(every=0)
    serve(segments, steps=10, tokens_per_step=1)
    assert segments.done == []
    assert levels_of("on,off,hooks") == "on,off,hooks"
    for bad in ("on,hooks", "on,off,on", "on,off,fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            levels_of(bad)
