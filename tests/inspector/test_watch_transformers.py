"""Hugging Face transformers' generate() with a static cache, bare and under `graph-inspector watch`.

Each run is a real process of ``bench/gpu_transformers.py --child`` (a Llama built from a config,
greedy, ``cache_implementation="static"``), as a user would start it. On a CPU (CI) the watch must
be transparent: the same tokens, a clean exit, and nothing recorded, because a CPU captures no CUDA
graph. On a GPU (``-m cuda``) torch.compile's cudagraph trees capture graphs at batch 1, 8 and 32
in one process: the watched run must finish with the bare run's tokens (the old watch, which
lowered the trees' logger to DEBUG, made torch 2.11 fail at batch 32) and record every graph under
its compiled function, with its batch and pool memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from inspector.storage.models import CompileRecord, Graph
from inspector.storage.store import open_store

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu_transformers.py"


def generate(
    tmp_path: Path, name: str, *options: str, watched: bool = False, db: str = "", device: str = "cpu"
) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / f"{name}.json"
    child = [sys.executable, str(BENCH), "--child", "--device", device, "--child-out", str(out), *options]
    command = [sys.executable, "-m", "dashboard.cli", "watch", "--db", db, "--", *child] if watched else child
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    return done, json.loads(out.read_text()) if out.exists() else None


def tokens(result: dict) -> dict[str, str]:
    return {batch: run["tokens"] for batch, run in result["batches"].items()}


@pytest.mark.slow
def test_generate_on_a_cpu_is_the_same_watched_and_records_nothing(tmp_path: Path) -> None:
    options = ("--mode", "eager", "--model", "tiny", "--batches", "1,3", "--reps", "1", "--new-tokens", "6")
    bare, bare_result = generate(tmp_path, "bare", *options)
    assert bare.returncode == 0, bare.stderr
    db = f"sqlite:///{tmp_path / 'watch.db'}"
    watched, watched_result = generate(tmp_path, "watched", *options, watched=True, db=db)
    assert watched.returncode == 0, watched.stderr
    assert bare_result is not None and watched_result is not None
    assert tokens(watched_result) == tokens(bare_result)
    assert all(run["tokens_stable"] for run in watched_result["batches"].values())
    watch = watched_result["watch"]  # the watch was live in the program, and found nothing to record
    assert watch is not None and bare_result["watch"] is None
    assert (watch["graphs"], watch["watch_errors"], watch["sink_errors"]) == (0, 0, 0)
    assert watch["hooks"] in ("patched", "torch hooks")
    assert "0 watched process(es), 0 graph(s)" in watched.stderr
    assert "not watching this process" not in watched.stderr and "Traceback" not in watched.stderr


CUDA_OPTIONS = (
    "--mode",
    "compiled",
    "--model",
    "tiny",
    "--batches",
    "1,8,32",
    "--reps",
    "2",
    "--new-tokens",
    "48",
)


@pytest.mark.cuda
@pytest.mark.slow
def test_compiled_generate_at_batch_1_8_and_32_in_one_process_is_the_same_watched(tmp_path: Path) -> None:
    bare, bare_result = generate(tmp_path, "bare", *CUDA_OPTIONS, device="cuda")
    assert bare.returncode == 0, bare.stderr[-4000:]
    db = f"sqlite:///{tmp_path / 'watch.db'}"
    watched, watched_result = generate(tmp_path, "watched", *CUDA_OPTIONS, watched=True, db=db, device="cuda")
    assert watched.returncode == 0, watched.stderr[-4000:]
    assert bare_result is not None and watched_result is not None
    assert tokens(watched_result) == tokens(bare_result)
    watch = watched_result["watch"]
    assert watch["graphs"] > 0 and watch["watch_errors"] == 0 and watch["sink_errors"] == 0
    assert watch["functions"] == ["LlamaForCausalLM.forward"]  # its pool keep-alive too, not a wrapper
    memory = watched_result["memory"]
    recorded = sum(watch["graph_pool_bytes"].values())
    held = sum(memory["pool_reserved_bytes"][pool] for pool in watch["graph_pool_bytes"])
    assert 0 < recorded <= held <= memory["reserved_bytes"]  # what the pools hold, no more
    store = open_store(db, upgrade=False)
    try:
        with store.session() as session:
            rows = [g for g in session.scalars(select(Graph)) if "LlamaForCausalLM.forward" in g.wrapper]
            keep_alive = [g for g in rows if "pool keep-alive" in g.descriptor_key]
            heads = [g.descriptor_key.split(" #")[0] for g in keep_alive]
            assert heads == ["LlamaForCausalLM.forward pool keep-alive"]
            graphs = [g for g in rows if g not in keep_alive]
            # torch.compile may skip some sizes (the static cache's in-place updates): each graph
            # it did capture is one of the batches, keyed by it
            assert graphs and {g.num_reqs for g in graphs} <= {1, 8, 32}
            assert all(f"batch {g.num_reqs} · seq 1" in g.descriptor_key for g in graphs)
            assert all("modeling_llama.py:" in g.wrapper for g in graphs)  # where forward is defined
            assert all(g.wrapper.endswith("via torch.compile") for g in graphs)
            assert sum(g.pool_bytes for g in graphs) > 0
            events = list(session.scalars(select(CompileRecord)))  # skips and re-records, with reasons
            assert all(e.reason and e.reason != "unknown" for e in events)
    finally:
        store.dispose()


@pytest.mark.cuda
@pytest.mark.slow
def test_the_old_watchs_debug_logger_level_made_torch_fail_where_the_watch_now_does_not(
    tmp_path: Path,
) -> None:
    """What the watch did before: lower the cudagraph trees' logger to DEBUG. torch 2.11 then builds
    its debug-only re-record message, which asserts; the same program unwatched, or watched now,
    runs to the end (the test above)."""
    old, _ = generate(tmp_path, "old", *CUDA_OPTIONS, "--trees-debug-log", device="cuda")
    if old.returncode == 0:
        pytest.skip("this torch builds its debug re-record message without failing: nothing to reproduce")
    assert "length mismatch between inputs, recorded_data_ptr, and placeholders" in old.stderr
