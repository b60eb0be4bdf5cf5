"""``bench/vllm_serve.py --waves``: each window of the trace served once at every level, the order
rotated each cycle, each level's time compared with ``off``'s on the same requests. vLLM itself is
not needed: a stand-in engine runs the scheduler's part that matters here (requests added by step,
each finishing after its output length, a token per step) and the levels are recorded or made slower;
what is under test is the windows, the order, the same work per cycle and the arithmetic (the real
serve runs on the GPU machine, BENCHMARKS.md)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from bench.vllm_waves import Waves, windows


class Engine:
    """A stand-in for vLLM's ``LLMEngine``: each request gains one token a step (its prompt's first
    token plus the step, ``shift`` added when set: a level that changed the computation)."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[list[int], int, list[int]]] = {}
        self.resets = 0
        self.shift = 0
        self.delay = 0.0

    def add_request(self, request_id: str, prompt: dict, params: SimpleNamespace) -> None:
        self.running[request_id] = (prompt["prompt_token_ids"], params.max_tokens, [])

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def step(self) -> list[SimpleNamespace]:
        time.sleep(self.delay)
        outputs = []
        for request_id, (prompt, wanted, made) in list(self.running.items()):
            made.append(prompt[0] + len(made) + self.shift)
            finished = len(made) == wanted
            if finished:
                del self.running[request_id]
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                           outputs=[SimpleNamespace(token_ids=list(made))]))
        return outputs


class Levels:
    """Stands in for ``vllm_serve.Levels``: records each level and makes the engine slower (or wrong)
    at the levels asked."""

    def __init__(self, engine: Engine, slower: dict[str, float] | None = None, wrong: str = "") -> None:
        self.engine, self.slower, self.wrong = engine, slower or {}, wrong
        self.applied: list[str] = []

    def apply(self, level: str) -> None:
        self.applied.append(level)
        self.engine.delay = self.slower.get(level, 0.0)
        self.engine.shift = 1 if level == self.wrong else 0


def params(n: int) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=n)


TRACE = [(step, [100 + step], 1 + step % 4) for step in range(0, 60, 2)]
"""(arrival step, prompt, output tokens): a request every other step, 1-4 tokens each."""


def test_windows_take_the_arrivals_of_each_span_rebased_to_step_zero() -> None:
    got = windows(TRACE, start=10, width=20, count=2)
    assert [r[0] for r in got[0]] == list(range(0, 20, 2))
    assert [r[1][0] for r in got[0]] == list(range(110, 130, 2))  # the arrivals of steps 10-29
    assert [r[1][0] for r in got[1]] == list(range(130, 150, 2))
    assert windows(TRACE, start=50, width=20, count=2)[1] == []  # past the trace: an empty window


def test_each_cycle_serves_its_window_at_every_level_in_rotated_order_with_the_cache_emptied() -> None:
    engine = Engine()
    levels = Levels(engine)
    order = ("on", "off", "recording")
    waves = Waves(windows(TRACE, 0, 20, 3), levels, order)
    waves.run(engine, params)
    result = waves.result()
    assert levels.applied == ["on", "off", "recording", "off", "recording", "on", "recording", "on", "off",
                              "on"]  # left as shipped after the serve
    assert engine.resets == 9  # one empty prefix cache per wave
    assert result["cycles"] == 3 and result["every_cycle_identical"] and result["cycles_identical"] == 3
    first = [w for w in result["waves"] if w["cycle"] == 0]
    assert {w["requests"] for w in first} == {10} and len({w["steps"] for w in first}) == 1
    assert {w["tokens"] for w in first} == {sum(1 + s % 4 for s in range(0, 20, 2))}
    assert waves.steps == sum(w["steps"] for w in result["waves"])


def test_a_slower_level_is_seen_against_off_on_the_same_work() -> None:
    engine = Engine()
    waves = Waves(windows(TRACE, 0, 15, 4), Levels(engine, slower={"on": 0.004}), ("on", "off"))
    waves.run(engine, params)
    levels = waves.result()["levels"]
    assert levels["off"]["median_cycle_ratio"] == 1.0
    assert len(levels["on"]["cycle_ratios"]) == 4
    assert levels["on"]["median_cycle_ratio"] < 0.8  # 4 ms a step more than a step that takes ~0
    assert levels["on"]["tok_per_s"] < levels["off"]["tok_per_s"]


def test_a_level_that_changes_the_tokens_is_said() -> None:
    engine = Engine()
    waves = Waves(windows(TRACE, 0, 20, 2), Levels(engine, wrong="on"), ("on", "off"))
    waves.run(engine, params)
    result = waves.result()
    assert not result["every_cycle_identical"] and result["cycles_identical"] == 0


def test_the_serve_takes_waves_and_checks_options() -> None:
    from bench.vllm_serve import parse_args, trace_windows

    args = parse_args(["--tag", "t", "--out", "/dev/null", "--waves", "3", "--wave-steps", "100",
                       "--checks", "debug"])
    assert (args.waves, args.wave_steps, args.checks) == (3, 100, "debug")
    got = trace_windows(args)
    assert len(got) == 3 and all(got)
    assert all(0 <= step < 100 for window in got for step, _, _ in window)
    assert len({tuple(w[0][1]) for w in got}) == 3  # three different stretches of the trace


def test_the_waves_plan_and_its_summary(monkeypatch) -> None:
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    sys.modules.pop("gpu_vllm", None)
    import gpu_vllm

    specs = gpu_vllm.plan("waves", 3000)
    assert [s["tag"] for s in sorted(specs, key=lambda s: s["serve"])] == [
        "v2-waves-1", "v2-waves-2", "v2-waves-3", "v1-waves-1", "v1-debug", "v2-debug"]
    assert [s["group"] for s in specs].count(0) == 1  # the first builds alone, the rest load its kernels
    assert all("--checks" in s["args"] for s in specs if "debug" in s["tag"])
    engine = Engine()
    runs = []
    for tag in ("a", "b"):
        waves = Waves(windows(TRACE, 0, 15, 3), Levels(engine, slower={"on": 0.002}), ("on", "off"))
        waves.run(engine, params)
        runs.append({"tag": tag, "waves": waves.result()})
    summary = gpu_vllm.waves_summary(runs)
    assert summary["cycles"] == 6 and summary["cycles_identical"] == 6
    assert summary["median_over_every_cycle"]["off"] == {"wall": 1.0, "cpu": 1.0}
    assert summary["median_over_every_cycle"]["on"]["wall"] < 0.9
    assert set(summary["per_process"]) == {"a", "b"}
    low, high = summary["median_95_interval"]["on"]
    assert low <= summary["median_over_every_cycle"]["on"]["wall"] <= high < 1.0
    # A process that timed the integration from inside: its clock's prediction, from off's step time.
    runs[0]["integration_clock"] = {"on": {"steps": 40, "integration_us_per_step": 50.0}, "probes": {},
                                    "guards": {}}
    off = [w for w in runs[0]["waves"]["waves"] if w["level"] == "off"]
    step_us = 1e6 * sum(w["seconds"] for w in off) / sum(w["steps"] for w in off)
    estimate = gpu_vllm.compare(runs)["clock_estimate"]
    assert set(estimate) == {"a"} and estimate["a"]["off_step_us"] == pytest.approx(step_us, abs=0.1)
    assert estimate["a"]["on"] == {"integration_us_per_step": 50.0,
                                   "ratio": round(step_us / (step_us + 50.0), 4)}


def test_the_interval_of_a_median_narrows_with_more_cycles_and_is_the_same_for_the_same_values(
        monkeypatch) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_vllm import median_interval

    spread = [0.9 + 0.01 * (i % 11) for i in range(22)]  # 0.90 .. 1.00, median 0.95
    narrow, wide = median_interval(spread * 10), median_interval(spread)
    assert narrow[0] <= 0.95 <= narrow[1] and wide[0] <= 0.95 <= wide[1]
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert median_interval(spread) == wide and median_interval([1.0]) is None


def test_the_warm_up_serves_every_request_to_the_end_on_the_arrival_clock() -> None:
    from bench.vllm_serve import serve

    engine = Engine()
    requests = [(0, [100], 2), (1, [101], 1), (10, [102], 3)]  # the engine idles from step 2 to 10
    got = serve(engine, requests, "w", lambda **params: SimpleNamespace(**params))
    assert got["requests"] == 3 and not engine.running
    assert got["steps"] == 13  # the arrival clock: the idle stretch skipped, not stepped through


def test_the_long_and_large_plans_build_one_process_first_and_serve_on_against_off(monkeypatch) -> None:
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    sys.modules.pop("gpu_vllm", None)
    import gpu_vllm

    from bench.vllm_serve import MODELS, parse_args

    for name, tags in (("long", ["v2-timed", "v2-long-waves"]), ("large", ["v2-8b-waves", "v2-8b-timed"])):
        specs = gpu_vllm.plan(name, 3000)
        assert [s["tag"] for s in sorted(specs, key=lambda s: s["serve"])] == tags
        assert sorted(s["group"] for s in specs) == [0, 1], "one builds alone, the other loads its kernels"
        assert sum("--time-integration" in s["args"] for s in specs) == 1
        for spec in specs:  # every process's options parse as vllm_serve.py's
            args = parse_args(["--tag", spec["tag"], "--out", "x.json", *spec["args"]])
            assert args.model == ("llama-8b" if name == "large" else "tiny") and args.waves > 0
    for name in ("long", "large"):  # the compared process: many short cycles of on against off
        waves = gpu_vllm.plan(name, 3000)[0]["args"]
        assert waves[waves.index("--levels") + 1] == "on,off"
        assert waves[waves.index("--waves") + 1] == str(gpu_vllm.LONG_WAVES)
    assert gpu_vllm.plan("long", 3000)[0]["serve_s"] > 150
    assert MODELS["llama-8b"]["num_hidden_layers"] == 32 and MODELS["tiny"]["hidden_size"] == 512
