"""`advise` over a recorded database: every batch of the chosen runs (ranks pooled), the graphs
start-up captured as the current sizes and the cost model, clear errors for what cannot be advised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workers import FULL, PIECEWISE, capture

from capture_core.descriptor import BatchDescriptor
from capture_core.sizes import EagerReason
from inspector.advice.recorded import read_recorded
from inspector.reading.queries import Queries
from inspector.recording.batch import TrafficWindow
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store
from inspector.storage.writer import KnownTotals, append_traffic

REPO = Path(__file__).resolve().parents[2]


def record(url: str, replays: dict[int, int], eager: int = 0, rank: int = 0, config: dict | None = None
           ) -> int:
    """One rank's run: a graph per bucket of 4, 8 and 16, ``replays`` batches of each real size."""
    with Recorder(url, rank=rank, world_size=2, label=f"rank{rank}", config=config or {}) as recorder:
        for size in (4, 8, 16):
            recorder.on_capture(capture(BatchDescriptor(size, size, True)))
        for real, batches in replays.items():
            bucket = BatchDescriptor(next(s for s in (4, 8, 16) if s >= real), None, False)
            for _ in range(batches):
                recorder.on_replay(FULL, bucket, real)
        for _ in range(eager):
            recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 30, FULL)
    assert recorder.run_id is not None
    return recorder.run_id


@pytest.fixture
def two_ranks(db_url: str) -> tuple[str, int, int]:
    first = record(db_url, {3: 10, 7: 5}, eager=2, config={"max_num_seqs": 32})
    second = record(db_url, {3: 4, 12: 6}, rank=1)
    return db_url, first, second


def test_ranks_pool_their_batches_eager_ones_included(two_ranks) -> None:
    url, first, second = two_ranks
    store = open_store(url, upgrade=False)
    try:
        queries = Queries(store.engine)
        queries.rollup.warm()
        pooled = read_recorded(queries, None, "inspector.db")
        one = read_recorded(queries, [second], "inspector.db")
    finally:
        store.dispose()
    counts = dict(zip(pooled.histogram.sizes, pooled.histogram.batches, strict=True))
    assert counts == {3: 14, 7: 5, 12: 6, 30: 2}
    assert pooled.run_ids == (first, second) and pooled.source == "inspector.db (2 runs pooled)"
    assert pooled.capture_sizes == (4, 8, 16)
    assert pooled.costs is not None and pooled.costs.recorded_sizes == 3
    assert pooled.costs.seconds_per_size == pytest.approx(0.02), "one graph per size per run, 0.01 s each"
    assert pooled.engine_max == 32, "from the first run's configuration"
    assert dict(zip(one.histogram.sizes, one.histogram.batches, strict=True)) == {3: 4, 12: 6}
    assert one.source == f"inspector.db (run {second})" and one.engine_max is None


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GRAPH_INSPECTOR_DB", None)
    return subprocess.run([sys.executable, "-m", "dashboard.cli", "advise", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_advise_on_a_database_compares_with_what_start_up_captured(two_ranks) -> None:
    url, first, _ = two_ranks
    result = cli("--db", url, "--run", str(first), "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["current"]["capture_sizes"] == [4, 8, 16] and data["graphs"] == 3
    # Batches of 3 and 7 (and two of 30 that ran eagerly): 3 and 7 themselves pad nothing.
    assert data["advised"]["capture_sizes"] == [3, 7, 30]
    advised = data["advised"]["traffic"]
    assert advised["padding_tokens"] == 0 and advised["eager_batches"] == 0
    assert data["current"]["traffic"]["eager_batches"] == 2
    assert data["current"]["traffic"]["padding_tokens"] == 10 * 1 + 5 * 1
    assert data["cost_model"] and "per capture size" in data["cost_model"][0]
    budget = cli("--db", url, "--capture-time-budget", "0.045", "--format", "json")
    assert budget.returncode == 0, budget.stderr
    assert json.loads(budget.stdout)["graphs"] == 2, "0.045 s at 0.02 s a size: two sizes"


@pytest.mark.parametrize(("args", "message"), [
    (["--run", "99"], "has no run 99"),
    (["--max-size", "64"], "--max-size 64 is above the engine's largest batch (32, the runs' configuration)"),
    (["--memory-budget", "0.001"], "fits no graph: the largest size"),
])
def test_what_a_database_cannot_answer_is_one_clear_line(two_ranks, args: list[str], message: str) -> None:
    url, _, _ = two_ranks
    result = cli("--db", url, *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_database_with_no_traffic_or_no_graphs_says_so(sqlite_url: str) -> None:
    with Recorder(sqlite_url, label="idle"):
        pass
    empty = cli("--db", sqlite_url)
    assert empty.returncode == 2 and "no batches recorded, so there is nothing to advise on" in empty.stderr
    with Recorder(sqlite_url, label="eager only") as recorder:
        recorder.on_eager(EagerReason.MODE_NONE, 5, FULL)
    graphless = cli("--db", sqlite_url)
    assert graphless.returncode == 2 and "captured no graphs at start-up" in graphless.stderr
    compared = cli("--db", sqlite_url, "--current", "pow2", "--format", "json")
    assert compared.returncode == 0, compared.stderr
    assert json.loads(compared.stdout)["advised"]["capture_sizes"] == [5]
    missing = cli("--db", f"sqlite:///{Path(sqlite_url.removeprefix('sqlite:///')).parent / 'none.db'}")
    assert missing.returncode == 2 and "no database at" in missing.stderr


def test_a_long_histogram_shows_the_optimiser_s_progress(sqlite_url: str) -> None:
    with Recorder(sqlite_url, label="wide") as recorder:
        for size in range(1, 3001):
            recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, size, FULL)
    result = cli("--db", sqlite_url, "--current", "4096", "--max-graphs", "8")
    assert result.returncode == 0, result.stderr
    assert "Advising [" in result.stderr and "127/127" in result.stderr, result.stderr
    assert "graph-inspector advise: 8 capture sizes for 3,000 batches of 1..3000 tokens" in result.stdout


def two_sizes_of_traffic(recorder: Recorder) -> None:
    """Graphs of 8 and 16 tokens captured; 190 batches replayed: 100 of 3 tokens and 10 of 8 on the
    first, 40 of 12 and 40 of 16 on the second."""
    for size in (8, 16):
        recorder.on_capture(capture(BatchDescriptor(size, size, True)))
    for real, batches in {3: 100, 8: 10, 12: 40, 16: 40}.items():
        bucket = BatchDescriptor(8 if real <= 8 else 16, 8 if real <= 8 else 16, True)
        for _ in range(batches):
            recorder.on_replay(FULL, bucket, real)


def test_padding_is_weighed_by_the_step_times_the_runs_recorded_and_sizes_can_be_forced_in(db_url) -> None:
    # Launch-bound up to 8 tokens (one time), compute-bound above: 3-token batches pad to 8 for free.
    with Recorder(db_url, label="timed") as recorder:
        two_sizes_of_traffic(recorder)
        recorder.on_step_time(FULL, BatchDescriptor(8, 8, True), 0.001, 0.004, samples=2)
        recorder.on_step_time(FULL, BatchDescriptor(16, 16, True), 0.003, 0.006, samples=2)
        recorder.on_step_time(FULL, BatchDescriptor(4, 4, True), 0.001, None)  # timed, never captured here
    timed = json.loads(cli("--db", db_url, "--max-graphs", "3", "--format", "json").stdout)
    assert timed["weighed_by_step_time"]
    assert "graph replays timed at 3 sizes (5 timed replays" in timed["weighed_by"]
    # By tokens the hundred 3-token batches want a graph of their own; by time it is better spent at 12.
    assert timed["advised"]["capture_sizes"] == [8, 12, 16]
    assert timed["lone_request"]["over_best"] == 0 and timed["lone_request"]["padded_to"] == 8
    steps = timed["modelled_step_seconds"]
    assert steps["advised"] == pytest.approx(110 * 0.001 + 40 * 0.002 + 40 * 0.003)  # 12: halfway
    assert steps["current"] == pytest.approx(110 * 0.001 + 80 * 0.003)
    # Beside it, what counting tokens would have advised, timed the same way: what weighing by time saved.
    tokens = timed["by_tokens"]
    assert tokens["capture_sizes"] == [3, 12, 16] and not tokens["same_sizes"]
    assert tokens["modelled_step_seconds"] == pytest.approx(100 * 0.001 + 50 * 0.002 + 40 * 0.003)
    assert tokens["time_saved"] == pytest.approx(1 - 0.31 / 0.32)
    assert tokens["padding_waste"] < timed["advised"]["traffic"]["padding_waste"], "fewer tokens, more time"
    text = cli("--db", db_url, "--max-graphs", "3").stdout
    assert ("by tokens alone  3, 12, 16: 0.320 s modelled, padding waste 2.6%; weighing by time saves "
            "3.12%") in text
    # the current column's head is wider than its usual width: the columns stay apart, rows aligned
    assert "current (2 sizes, as recorded)  advised (3 sizes)" in text
    assert "  padding waste    30.6%                           25.0%" in text
    forced = cli("--db", db_url, "--max-graphs", "3", "--include", "3", "--format", "json")
    forced = json.loads(forced.stdout)
    assert forced["advised"]["capture_sizes"] == [3, 12, 16] and forced["included"] == [3]
    text = cli("--db", db_url, "--max-graphs", "3", "--include", "3").stdout
    assert "included         3 (--include)" in text
    assert "weighed by       padding weighed by the recorded" in text
    too_big = cli("--db", db_url, "--include", "40")
    assert too_big.returncode == 2
    assert "--include 40 is above the largest size advised (16)" in too_big.stderr
    assert "'x' is not a size" in cli("--db", db_url, "--include", "3,x").stderr


def test_the_eager_backends_host_clock_times_weigh_no_advice_and_are_left_out_beside_real_ones(db_url):
    """The eager backend's "replays" re-run the model on the host clock: no graph's time. Alone they
    weigh nothing (padding counted in tokens, saying why, so the demo's advice is the same in the
    console, the command and the page); beside CUDA-event times of real graphs they are left out."""
    from capture_core.step_time import CUDA_EVENTS, HOST_CLOCK
    from inspector.advice import weighing

    assert weighing.CUDA_EVENTS == CUDA_EVENTS  # named there so that reading needs no torch
    with Recorder(db_url, label="eager") as recorder:
        two_sizes_of_traffic(recorder)
        recorder.on_step_time(FULL, BatchDescriptor(8, 8, True), 0.001, 0.004, samples=2, clock=HOST_CLOCK)
        recorder.on_step_time(FULL, BatchDescriptor(16, 16, True), 0.003, 0.006, samples=2, clock=HOST_CLOCK)
    alone = json.loads(cli("--db", db_url, "--max-graphs", "3", "--format", "json").stdout)
    assert not alone["weighed_by_step_time"] and alone["by_tokens"] is None
    assert alone["weighed_by"] == (
        "padding counted in tokens: the only step times recorded are the eager backend's (its replays re-run "
        "the model on the host clock: no graph was timed)")
    assert alone["advised"]["capture_sizes"] == [3, 12, 16]  # fewest padding tokens
    with Recorder(db_url, label="cuda") as recorder:  # a real graph's times beside them
        recorder.on_capture(capture(BatchDescriptor(16, 16, True)))
        recorder.on_step_time(FULL, BatchDescriptor(8, 8, True), 0.002, None, samples=4)
        recorder.on_step_time(FULL, BatchDescriptor(16, 16, True), 0.002, None, samples=4)
    pooled = json.loads(cli("--db", db_url, "--max-graphs", "3", "--format", "json").stdout)
    assert pooled["weighed_by_step_time"]
    assert pooled["weighed_by"].startswith("padding weighed by the recorded step times: graph replays timed "
                                           "at 2 sizes (8 timed replays, cuda_events)")
    assert pooled["weighed_by"].endswith(
        "the eager backend's host-clock times left out (of the model re-run, not of a graph)")
    # The CUDA curve alone, flat at 2 ms a step (the host-clock 1 and 3 ms would bend it): every batch
    # costs 2 ms at any size.
    assert pooled["modelled_step_seconds"]["advised"] == pytest.approx(190 * 0.002)


def test_without_recorded_step_times_padding_is_counted_in_tokens_and_it_says_so(two_ranks) -> None:
    url, _, _ = two_ranks
    data = json.loads(cli("--db", url, "--format", "json").stdout)
    assert not data["weighed_by_step_time"] and data["lone_request"] is None and data["by_tokens"] is None
    assert data["weighed_by"].startswith("padding counted in tokens: no replay was timed in these runs")


def test_decode_steps_are_told_apart_so_each_engine_gets_its_own_list(db_url: str) -> None:
    """A FULL_AND_PIECEWISE run: decode steps replay uniform-decode graphs, prefill chunks piecewise
    ones. SGLang's --cuda-graph-bs gets the decode steps (in requests), never a chunk's tokens."""
    with Recorder(db_url, label="mixed") as recorder:
        for size in (4, 8):
            recorder.on_capture(capture(BatchDescriptor(size, size, True)))
        recorder.on_capture(capture(BatchDescriptor(64), mode=PIECEWISE))
        for real, batches in {3: 40, 7: 20}.items():
            bucket = BatchDescriptor(4 if real <= 4 else 8, 4 if real <= 4 else 8, True)
            for _ in range(batches):
                recorder.on_replay(FULL, bucket, real)
        for real in (50, 61, 61):
            recorder.on_replay(PIECEWISE, BatchDescriptor(64), real)
    run_id = recorder.run_id
    data = json.loads(cli("--db", db_url, "--max-graphs", "3", "--format", "json").stdout)
    config = data["config"]
    assert data["advised"]["capture_sizes"] == [3, 7, 61]
    assert config["sglang"] == "--cuda-graph-bs 3 7" and config["sglang_prefill"] == (
        "--piecewise-cuda-graph-tokens 50 61")
    assert "batch_sizes: [3, 7]" in config["tensorrt_llm"] and "capture_num_tokens: [50, 61]" in (
        config["tensorrt_llm_prefill"])
    # Rows that do not say which batches were decode steps (an older recorder's): the decode lines go.
    store = open_store(db_url, upgrade=False)
    try:
        with store.writer() as conn:
            window = TrafficWindow(1.0, 2.0, batch_sizes={5: 9})  # uniform_batch_sizes None: not told
            append_traffic(conn, run_id, [window], {}, KnownTotals.of_run(conn, run_id), 2.0)
    finally:
        store.dispose()
    untold = json.loads(cli("--db", db_url, "--max-graphs", "3", "--format", "json").stdout)
    assert untold["config"]["sglang"] is None and untold["config"]["tensorrt_llm"] is None
    assert "not told apart" in untold["config_notes"][0] and untold["config"]["vllm"]
