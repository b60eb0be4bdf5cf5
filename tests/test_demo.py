"""`graph-inspector demo` end to end, as a user runs it: a real subprocess into a real SQLite file.

By default the demo serves mixed prefill/decode steps under FULL_AND_PIECEWISE, from a cold start
whose traffic ramps up, so every capture size is met; ``--mode full_decode_only`` is the original
decode-only demo, pinned here to what it printed before the mixed path existed.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
POW2_256 = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def run_demo(*args: str, timeout: float = 240, debug: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAPH_INSPECTOR_DEBUG": "1" if debug else ""}
    return subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "demo", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The default demo (300 steps), as `graph-inspector demo` runs it, but not served."""
    db = tmp_path_factory.mktemp("demo") / "demo.db"
    result = run_demo("--no-serve", "--backend", "eager", "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    return db, result


@pytest.mark.slow
def test_demo_records_full_and_piecewise_graphs_replays_and_the_two_injected_faults(faulted_run) -> None:
    db, _ = faulted_run
    graphs = rows(db, "SELECT mode, captured_size, num_reqs, num_segments, unexpected, backend FROM graphs")
    full = sorted(n for mode, n, reqs, _, unexpected, _ in graphs if mode == "full" and not unexpected)
    piecewise = sorted(n for mode, n, _, _, unexpected, _ in graphs if mode == "piecewise" and not unexpected)
    assert full == POW2_256 and piecewise == POW2_256
    # FULL graphs serve pure-decode steps (one token per request); piecewise graphs any request count.
    assert all(reqs == n and segments == 1 for mode, n, reqs, segments, _, _ in graphs if mode == "full")
    assert all(reqs is None and segments > 1
               for mode, _, reqs, segments, _, _ in graphs if mode == "piecewise")
    assert {backend for *_, backend in graphs} == {"eager"}
    replays = dict(rows(db, "SELECT mode, SUM(replays) FROM replay_windows GROUP BY mode"))
    assert replays["full"] > 0 and replays["piecewise"] > 0, replays
    real, padded = rows(db, "SELECT SUM(num_real_tokens), SUM(padding_tokens) FROM replay_windows")[0]
    assert real > 0 and padded > 0
    # Eager fallbacks only where the traffic went above the largest capture size, and every such step.
    above = rows(db, "SELECT COALESCE(SUM(batches), 0) FROM batch_size_counts "
                     "WHERE num_real_tokens > 256")[0][0]
    eager = rows(db, "SELECT reason, SUM(batches) FROM eager_fallbacks GROUP BY reason")
    assert eager == ([("above_max_capture_size", above)] if above else [])
    assert sum(replays.values()) + above == 300
    violations = rows(db, "SELECT kind, injected FROM violations ORDER BY kind")
    assert violations == [("address_drift", 1), ("unexpected_capture", 1)]
    run = rows(db, "SELECT backend, ended_at, config FROM runs")
    assert len(run) == 1 and run[0][0] == "eager" and run[0][1] is not None
    assert '"mode": "FULL_AND_PIECEWISE"' in run[0][2] and '"chunked_prefill": true' in run[0][2]


@pytest.mark.slow
def test_the_cold_start_ramps_through_every_capture_size_and_says_so(faulted_run) -> None:
    db, result = faulted_run
    sizes = rows(db, "SELECT num_real_tokens, batches FROM batch_size_counts")
    assert min(n for n, _ in sizes) == 1 and max(n for n, _ in sizes) > 256, "from one request to bursts"
    assert len(sizes) > 20, f"the token count should move from step to step: {sizes}"
    met = rows(db, "SELECT DISTINCT captured_size FROM replay_windows WHERE replays > 0 "
                   "ORDER BY captured_size")
    assert [n for (n,) in met] == POW2_256, "every capture size replays"
    replayed = rows(db, "SELECT COUNT(*) FROM (SELECT DISTINCT mode, captured_size FROM replay_windows "
                        "WHERE replays > 0)")[0][0]
    started = rows(db, "SELECT COUNT(*) FROM graphs WHERE NOT unexpected")[0][0]
    assert (replayed, started) == (13, 18)
    line = ("graphs replayed   13 of 18 captured at start-up, every capture size met "
            "(never replayed: full 256; piecewise 1, 2, 4, 8)")
    assert line in result.stdout, result.stdout
    # And it ends by pointing at the advice, with what that would change for this very run.
    advice = "advice            the same 9 graphs, sized for this traffic, would pad 13.6% instead of 29.7%"
    assert advice in result.stdout and "graph-inspector advise --db sqlite:///" in result.stdout


@pytest.mark.slow
def test_demo_says_which_backend_and_prints_a_summary(faulted_run) -> None:
    _, result = faulted_run
    out = result.stdout
    assert "eager backend" in out
    for word in ("graphs", "full: 10", "piecewise: 9", "hit ratio", "padding waste", "fallbacks",
                 "violations", "injected faults", "chunked prefill", "with prompt chunks", "a cold start",
                 "graphs replayed"):
        assert word in out, f"summary lacks {word!r}:\n{out}"
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_injected_faults_messages_are_lines_of_their_own_beside_the_progress_bar(faulted_run) -> None:
    # They were written onto the end of the bar's line ("...step/s][injected] address drift ...").
    _, result = faulted_run
    told = [line for line in result.stderr.splitlines() if "[injected]" in line]
    assert [line.partition(" in graph")[0].partition(":")[0] for line in told] == [
        "[injected] address drift", "[injected] unexpected capture"], told


@pytest.mark.slow
def test_demo_without_faults_records_no_violations_and_same_seed_same_traffic(tmp_path: Path) -> None:
    histograms = []
    for name in ("a", "b"):
        db = tmp_path / f"{name}.db"
        result = run_demo("--no-serve", "--no-faults", "--steps", "20", "--seed", "5", "--backend", "eager",
                          "--capture-sizes", "vllm", "--max-batch", "64", "--speedup", "40",
                          "--db", f"sqlite:///{db}")
        assert result.returncode == 0, explain(result)
        assert rows(db, "SELECT COUNT(*) FROM violations") == [(0,)]
        assert rows(db, "SELECT COUNT(*) FROM graphs WHERE unexpected") == [(0,)]
        for mode in ("full", "piecewise"):
            sizes = [n for (n,) in rows(db, f"SELECT captured_size FROM graphs WHERE mode = '{mode}' "
                                            "ORDER BY captured_size")]
            assert sizes == [1, 2, 4, *range(8, 65, 8)], mode
        histograms.append(rows(db, "SELECT num_real_tokens, SUM(batches) FROM batch_size_counts "
                                   "GROUP BY num_real_tokens ORDER BY num_real_tokens"))
    assert histograms[0] == histograms[1]
    assert len(histograms[0]) > 3, "the batch size should change from step to step"
    assert "injected" not in result.stdout


@pytest.mark.slow
def test_debug_checks_raise_on_the_injected_drift_and_the_demo_still_finishes(tmp_path: Path) -> None:
    db = tmp_path / "debug.db"
    result = run_demo("--no-serve", "--steps", "12", "--backend", "eager", "--max-batch", "16",
                      "--speedup", "40", "--db", f"sqlite:///{db}", debug=True)
    assert result.returncode == 0, explain(result)
    assert "debug address checks are on" in result.stdout
    assert rows(db, "SELECT kind, injected FROM violations ORDER BY kind") == [
        ("address_drift", 1), ("unexpected_capture", 1)]
    assert rows(db, "SELECT config LIKE '%\"address_check\": \"debug\"%' FROM runs") == [(1,)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "many"], "--steps"),
        (["--speedup", "-1"], "--speedup"),
        (["--speedup", "1e9"], "--speedup"),
        (["--max-batch", "0"], "--max-batch"),
        (["--port", "70000"], "--port"),
        (["--mode", "fastest"], "--mode"),
        (["--max-batch", "2000", "--steps", "1"], "--max-batch 2000"),
        (["--ubatch"], "--ubatch micro-batches decode steps; use it with --mode full_decode_only"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**64)], "--seed"),
        (["--trace", "missing.csv"], "--trace: missing.csv: trace file not found"),
        (["--trace", "."], "--trace: .: cannot read the trace"),
    ],
)
def test_bad_arguments_exit_2_in_one_line_before_the_database_is_created(
    tmp_path: Path, args: list[str], message: str
) -> None:
    db = tmp_path / "never.db"
    result = run_demo("--no-serve", *args, "--db", f"sqlite:///{db}", timeout=60)
    assert result.returncode == 2, explain(result)
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not db.exists(), "refused before the database is created"


@pytest.mark.slow
def test_full_decode_only_is_the_decode_only_demo_as_before(tmp_path: Path) -> None:
    db = tmp_path / "decode.db"
    result = run_demo("--no-serve", "--steps", "40", "--backend", "eager", "--mode", "full_decode_only",
                      "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    # Printed by the demo before the mixed path existed (commit 62df0f5), same seed and steps:
    # a cold start whose batch climbs from one request, decode steps only.
    assert "batch sizes       1..28, mean 15, changed on 56% of steps (22 distinct sizes)" in result.stdout
    assert "chunked prefill" not in result.stdout and "step kinds" not in result.stdout
    graphs = rows(db, "SELECT mode, captured_size, num_reqs, uniform FROM graphs WHERE NOT unexpected")
    assert sorted(graphs) == [("full", n, n, 1) for n in POW2_256]
    assert rows(db, "SELECT COUNT(*) FROM eager_fallbacks") == [(0,)]
    assert rows(db, "SELECT SUM(replays) FROM replay_windows") == [(40,)]
    assert rows(db, "SELECT kind, injected FROM violations ORDER BY kind") == [
        ("address_drift", 1), ("unexpected_capture", 1)]


@pytest.mark.slow
def test_ubatch_captures_the_big_buckets_as_micro_batched_graphs(tmp_path: Path) -> None:
    db = tmp_path / "dbo.db"
    result = run_demo("--no-serve", "--steps", "40", "--backend", "eager", "--mode", "full_decode_only",
                      "--ubatch", "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    announced = "micro-batching: 4 buckets (32, 64, 128, 256) captured as one graph of 2 micro-batches"
    assert announced in result.stdout
    graphs = rows(db, "SELECT captured_size, num_ubatches, ubatch_slices FROM graphs WHERE NOT unexpected")
    ubatched = {n: (k, slices) for n, k, slices in graphs if k > 1}
    assert sorted(ubatched) == [32, 64, 128, 256]
    assert ubatched[32] == (2, "[[0, 16, 0, 16], [16, 32, 16, 32]]")
    assert sorted(n for n, k, _ in graphs if k == 1) == [1, 2, 4, 8, 16]
    # The same traffic as without --ubatch (same seed): the steps of 17 tokens or more were split.
    assert "batch sizes       1..28, mean 15, changed on 56% of steps (22 distinct sizes)" in result.stdout
    split = rows(db, "SELECT SUM(replays) FROM replay_windows WHERE captured_size >= 32")[0][0]
    assert f"micro-batched     {split} of 40 steps ran as 2 micro-batches in one graph" in result.stdout
    assert rows(db, "SELECT kind, injected FROM violations ORDER BY kind") == [
        ("address_drift", 1), ("unexpected_capture", 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "graph_modes"), [("piecewise", ["piecewise"]), ("full", ["full"]),
                                                   ("none", [])])
def test_each_mode_captures_only_its_own_graphs(tmp_path: Path, mode: str, graph_modes: list[str]) -> None:
    db = tmp_path / f"{mode}.db"
    result = run_demo("--no-serve", "--steps", "15", "--backend", "eager", "--mode", mode,
                      "--max-batch", "32", "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    assert [m for (m,) in rows(db, "SELECT DISTINCT mode FROM graphs ORDER BY mode")] == graph_modes
    violations = rows(db, "SELECT kind, injected FROM violations ORDER BY kind")
    if mode == "none":
        eager = rows(db, "SELECT reason, SUM(batches) FROM eager_fallbacks GROUP BY reason")
        assert eager == [("mode_none", 15)]
        assert violations == []
        assert "no graph to drift" in result.stdout
    else:
        assert violations == [("address_drift", 1), ("unexpected_capture", 1)]


def test_unwritable_database_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    result = run_demo("--no-serve", "--steps", "5", "--db", f"sqlite:///{blocker}/demo.db", timeout=60)
    assert result.returncode == 2, explain(result)
    assert "Traceback" not in result.stderr
    assert "demo.db" in result.stderr


def test_a_malformed_trace_exits_2_naming_the_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "mine.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.5,12,many\n")
    db = tmp_path / "t.db"
    result = run_demo("--no-serve", "--trace", str(trace), "--db", f"sqlite:///{db}", timeout=120)
    assert result.returncode == 2, explain(result)
    assert f"--trace: {trace}: line 2: GeneratedTokens must be an integer" in result.stderr
    assert "Traceback" not in result.stderr
    assert not db.exists(), "an unusable trace leaves no empty database behind"


@pytest.mark.slow
def test_your_own_trace_drives_the_demo(tmp_path: Path) -> None:
    trace = tmp_path / "mine.csv"
    lines = [f"2024-01-01 00:00:{i // 10:02d}.{i % 10}000000,100,{5 + i % 7}" for i in range(200)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
    db = tmp_path / "own.db"
    result = run_demo("--no-serve", "--no-faults", "--trace", str(trace), "--steps", "30",
                      "--max-batch", "16", "--speedup", "1", "--db", f"sqlite:///{db}")
    assert result.returncode == 0, explain(result)
    assert "200 real requests (mine.csv)" in result.stdout
    replays = rows(db, "SELECT SUM(replays) FROM replay_windows")[0][0]
    eager = rows(db, "SELECT COALESCE(SUM(batches), 0) FROM eager_fallbacks")[0][0]
    assert replays + eager == 30
    assert rows(db, "SELECT COUNT(*) FROM replay_windows WHERE mode = 'piecewise'")[0][0] > 0, \
        "its 100-token prompts are prefilled in chunks, on piecewise graphs"


def test_a_busy_port_is_refused_before_any_work(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_demo("--port", str(port), "--db", f"sqlite:///{tmp_path / 'busy.db'}", timeout=60)
    assert result.returncode == 2, explain(result)
    assert f"127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Decoding" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "busy.db").exists()


@pytest.mark.slow
def test_ctrl_c_mid_run_keeps_what_was_recorded_and_ends_the_run(tmp_path: Path) -> None:
    db = tmp_path / "interrupted.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "demo", "--no-serve", "--steps", "100000",
         "--backend", "eager", "--max-batch", "32", "--db", f"sqlite:///{db}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if rows(db, "SELECT COUNT(*) FROM replay_windows")[0][0] > 0:
                    break
            except sqlite3.Error:
                pass  # not created or not migrated yet
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert "interrupted" in err and "Traceback" not in err
    (ended,) = rows(db, "SELECT ended_at FROM runs")[0]
    assert ended is not None
    assert rows(db, "SELECT SUM(replays) FROM replay_windows")[0][0] > 0


def _ctrl_c_as_at_a_terminal() -> None:
    """In the demo's process, before it starts: SIGINT as a terminal's foreground job has it.

    A test run started in the background of a shell without job control (``cmd &`` in a script,
    ``nohup``) ignores SIGINT, and a child inherits that, so Python installs no KeyboardInterrupt
    handler and the Ctrl-C these tests send would be lost: what is tested is the demo's answer to
    a user's Ctrl-C, not the disposition the test runner happened to inherit.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_demo_serves_the_dashboard_until_interrupted(tmp_path: Path) -> None:
    db = tmp_path / "served.db"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "demo", "--steps", "5", "--backend", "eager",
         "--max-batch", "32", "--db", f"sqlite:///{db}", "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        body = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/api/summary", timeout=5) as response:
                    body = response.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert body is not None, "the dashboard never answered"
        assert '"ok": true' in body.replace('"ok":true', '"ok": true')
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert url in out
    assert "Traceback" not in err


def test_the_demo_s_mixed_steps_give_the_eager_model_s_logits_step_after_step() -> None:
    """The demo's own step building (prompt stand-ins, fed-back tokens, rows that start over) fed
    through the mixed runner equals the eager model, over FULL, PIECEWISE and eager steps alike."""
    import torch

    from capture_core.mixed_runner import MixedBatchRunner
    from capture_core.modes import CUDAGraphMode
    from capture_core.reference import (
        ContinuousBatchScheduler,
        ModelConfig,
        ReferenceDecoder,
        TrafficConfig,
        load_trace,
    )
    from capture_core.runtime import GraphRuntime
    from dashboard.demo.options import token_budget
    from dashboard.demo.traffic import MixedFeed
    from dashboard.demo.workload import shorter_prompts

    budget = token_budget(16)
    config = ModelConfig.tiny(max_num_seqs=16, max_seq_len=budget)  # short rows: long requests start over
    model = ReferenceDecoder(config, seed=3)
    sizes = [1, 2, 4, 8, 12, 16, 18]  # 19 and 20 tokens run eagerly
    runner = MixedBatchRunner(model, GraphRuntime("eager", progress=False, warmup_iters=1), sizes)
    runner.capture()
    traffic = TrafficConfig(max_num_seqs=16, speedup=0.5, seed=2, warmup_steps=50, chunked_prefill=True,
                            max_num_batched_tokens=budget)
    inputs = MixedFeed(runner)
    served = set()
    for step in ContinuousBatchScheduler(shorter_prompts(load_trace()), traffic).take(60):
        prepared = inputs.prepare(step)
        batch, rows, sampled = prepared.batch, prepared.rows, prepared.sampled
        meta = batch.attn_metadata
        assert batch.num_tokens == step.num_real_tokens and int(batch.positions.max()) < config.max_seq_len
        assert len(rows) == step.num_decode_tokens + sum(chunk.final for chunk in step.prefill_chunks)
        reference_kv = runner.kv_cache.clone()
        expected = model(batch.input_ids, batch.positions, batch.slot_ids, reference_kv, meta)
        logits = runner.step(batch.input_ids, batch.positions, batch.slot_ids, meta)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        served.add(runner.route(meta).mode)
        inputs.update(prepared, logits)
        assert [inputs.next_token[slot] for slot in sampled] == expected[rows].argmax(-1).tolist()
    assert served == {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE}, served
