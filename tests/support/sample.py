"""Synthetic inspector databases: a small realistic one for page tests and screenshots, and a
bulk one (a million replay windows) for the dashboard benchmark.

Both are written with bulk Core inserts straight into the inspector's tables, so that they look
exactly like what the recorder leaves behind, without running a model.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select, update

from capture_core.descriptor import BatchDescriptor
from capture_core.reference import TrafficConfig, decode_batch_sizes, load_trace
from capture_core.sizes import SizeTable, power_of_two_sizes, vllm_default_sizes
from inspector.models import (
    BatchSizeCount,
    EagerFallback,
    EagerTotal,
    Graph,
    ReplayTotal,
    ReplayWindow,
    Run,
    Violation,
)

MIB = 1 << 20
HOSTILE_MESSAGE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> drift'
"""A violation message that would run script if any page rendered data as HTML (tests look for it)."""

INPUT_NAMES = ("input_ids", "positions", "kv_caches[0]", "kv_caches[1]", "attn_metadata.slot_mapping")


def seed_sample(engine: Engine, *, now: float, seed: int = 7) -> dict[str, int]:
    """Two runs: a finished CUDA run (FULL decode graphs plus piecewise mixed graphs) and a live
    eager-backend run with an injected address drift, an injected unexpected capture and a
    violation whose text is hostile HTML. Returns the ids tests look for."""
    rng = random.Random(seed)
    with engine.begin() as conn:
        cuda_run = _insert_run(
            conn, label="llama-1b decode (H200)", host="gpu-node-07", device="NVIDIA H200", backend="cuda",
            config={"mode": "full_and_piecewise", "sizes": "vllm", "max_size": 256, "checks": "cheap"},
            started_at=now - 3 * 3600, last_seen_at=now - 3600, ended_at=now - 3600,
        )
        eager_run = _insert_run(
            conn, label="ci smoke (eager backend)", host="ci-runner-3", device="cpu", backend="eager",
            config={"mode": "full", "sizes": "pow2", "max_size": 64, "checks": "debug"},
            started_at=now - 900, last_seen_at=now - 2, ended_at=None,
        )
        sizes = vllm_default_sizes(256)
        cuda_graphs = _insert_graphs(conn, cuda_run, "cuda", sizes, ("full", "piecewise"),
                                     captured_at=now - 3 * 3600 + 5, rng=rng)
        eager_sizes = power_of_two_sizes(64)
        eager_graphs = _insert_graphs(conn, eager_run, "eager", eager_sizes, ("full",),
                                      captured_at=now - 890, rng=rng)
        _insert_traffic(conn, cuda_run, cuda_graphs, sizes, start=now - 3 * 3600 + 60, end=now - 3600,
                        window=30.0, rng=rng, mean_batch=120)
        _insert_traffic(conn, eager_run, eager_graphs, eager_sizes, start=now - 860, end=now - 2,
                        window=5.0, rng=rng, mean_batch=64)
        drift = _insert_violation(
            conn, eager_run, "address_drift", eager_graphs[("full", 64)], input_name="positions",
            expected=0x7F3A2C000400, actual=0x7F3A2C9F0400, injected=True, count=12,
            message="input 'positions' moved since capture: the graph reads stale memory",
            first_seen_at=now - 600, last_seen_at=now - 30,
        )
        unexpected = _insert_violation(
            conn, eager_run, "unexpected_capture", eager_graphs[("full", 32)], input_name=None,
            expected=None, actual=None, injected=True, count=1,
            message="capture of tokens=32 after start-up was locked (policy: serve eagerly)",
            first_seen_at=now - 420, last_seen_at=now - 420,
        )
        hostile = _insert_violation(
            conn, cuda_run, "address_drift", cuda_graphs[("full", 8)], input_name="kv_caches[1]",
            expected=0x7F0000100000, actual=0x7F0000200000, injected=False, count=3,
            message=HOSTILE_MESSAGE, first_seen_at=now - 2 * 3600, last_seen_at=now - 2 * 3600 + 40,
        )
        derive_totals(conn)
    return {
        "cuda_run": cuda_run,
        "eager_run": eager_run,
        "cuda_graph": cuda_graphs[("full", 8)],
        "eager_graph": eager_graphs[("full", 64)],
        "drift": drift,
        "unexpected": unexpected,
        "hostile": hostile,
    }


def touch_run(engine: Engine, run_id: int, at: float | None = None) -> None:
    """What a recorder's flush does to its run: ``last_seen_at`` moves to now, so the run is live."""
    with engine.begin() as conn:
        seen = time.time() if at is None else at
        conn.execute(update(Run).where(Run.id == run_id).values(last_seen_at=seen))


def seed_bulk(
    engine: Engine,
    *,
    now: float,
    graphs: int = 1_000,
    windows: int = 1_000_000,
    violations: int = 100_000,
    runs: int = 10,
    chunk: int = 50_000,
) -> None:
    """A large database for the benchmark: ``graphs`` graphs over ``runs`` runs, ``windows`` replay
    windows spread over them (plus a tenth as many eager and batch-size windows), ``violations``."""
    sizes = vllm_default_sizes(512)
    per_run = -(-graphs // runs)
    span = 7 * 24 * 3600.0
    with engine.begin() as conn:
        run_ids = []
        for i in range(runs):
            start, end = now - span + i * span / runs, now - span + (i + 1) * span / runs
            run_ids.append(_insert_run(
                conn, label=f"bench run {i}", host=f"node-{i:02d}", device="NVIDIA H200", backend="cuda",
                config={"mode": "full_and_piecewise"}, started_at=start, last_seen_at=end, ended_at=end,
            ))
        graph_rows = []
        for n in range(graphs):
            run_id = run_ids[n // per_run]
            mode = "full" if (n // len(sizes)) % 2 == 0 else "piecewise"
            size = sizes[n % len(sizes)]
            graph_rows.append(
                _graph_row(run_id, "cuda", mode, size, captured_at=now - span, pool_bytes=size * MIB)
            )
        conn.execute(insert(Graph), graph_rows)
        keys = select(Graph.id, Graph.run_id, Graph.mode, Graph.captured_size, Graph.descriptor_key)
        graph_keys = [tuple(row) for row in conn.execute(keys.order_by(Graph.id))]
    for rows in _chunked(_bulk_windows(now, span, graph_keys, windows), chunk):
        with engine.begin() as conn:
            conn.execute(insert(ReplayWindow), rows)
    for rows in _chunked(_bulk_eager(now, span, run_ids, windows // 10), chunk):
        with engine.begin() as conn:
            conn.execute(insert(EagerFallback), rows)
    for rows in _chunked(_bulk_batch_sizes(now, span, run_ids, windows // 10), chunk):
        with engine.begin() as conn:
            conn.execute(insert(BatchSizeCount), rows)
    for rows in _chunked(_bulk_violations(now, span, graph_keys, violations), chunk):
        with engine.begin() as conn:
            conn.execute(insert(Violation), rows)
    with engine.begin() as conn:
        derive_totals(conn)


def derive_totals(conn: Connection) -> None:
    """Fill the running-totals tables from the windows, as the recorder keeps them while it writes."""
    w, e = ReplayWindow, EagerFallback
    key = (w.run_id, w.mode, w.captured_size, w.num_reqs, w.uniform, w.has_lora, w.num_active_loras,
           w.descriptor_key)
    conn.execute(insert(ReplayTotal).from_select(
        [column.key for column in key]
        + ["graph_id", "replays", "num_real_tokens", "padding_tokens", "updated_at"],
        select(*key, func.max(w.graph_id), func.sum(w.replays), func.sum(w.num_real_tokens),
               func.sum(w.padding_tokens), func.max(w.window_end)).group_by(*key),
    ))
    conn.execute(insert(EagerTotal).from_select(
        ["run_id", "reason", "mode", "batches", "num_real_tokens", "updated_at"],
        select(e.run_id, e.reason, e.mode, func.sum(e.batches), func.sum(e.num_real_tokens),
               func.max(e.window_end))
        .group_by(e.run_id, e.reason, e.mode),
    ))


def _insert_run(conn: Connection, *, label: str, host: str, device: str, backend: str, config: dict[str, Any],
                started_at: float, last_seen_at: float, ended_at: float | None) -> int:
    return conn.execute(
        insert(Run).returning(Run.id),
        {"label": label, "host": host, "pid": 4242, "process": "python3 -m serve_llm --cuda-graphs",
         "rank": 0, "world_size": 1, "device": device, "backend": backend, "config": json.dumps(config),
         "started_at": started_at, "last_seen_at": last_seen_at, "ended_at": ended_at, "dropped_events": 0},
    ).scalar_one()


def _descriptor(mode: str, size: int) -> BatchDescriptor:
    if mode == "full":
        return BatchDescriptor(size, size, True)
    return BatchDescriptor(size)


def _graph_row(run_id: int, backend: str, mode: str, size: int, *, captured_at: float, pool_bytes: int,
               rng: random.Random | None = None) -> dict[str, Any]:
    descriptor = _descriptor(mode, size)
    base = 0x7F3A2C000000 + size * 0x1000
    return {
        "run_id": run_id, "mode": mode, "captured_size": size, "num_reqs": descriptor.num_reqs,
        "uniform": descriptor.uniform, "has_lora": False, "num_active_loras": 0,
        "descriptor_key": descriptor.key, "wrapper": "LlamaForCausalLM.forward", "backend": backend,
        "input_names": json.dumps(INPUT_NAMES),
        "input_addresses": json.dumps([base + i * 0x200000 for i in range(len(INPUT_NAMES))]),
        "capture_seconds": 0.02 + size / 2000 + (rng.random() * 0.01 if rng else 0.0),
        "pool_bytes": pool_bytes, "warmup_iters": 2,
        "num_segments": 1 if mode == "full" else 17,
        "num_ubatches": 2 if mode == "full" and size >= 128 else 1,
        "ubatch_slices": json.dumps([[0, size // 2, 0, size // 2], [size // 2, size, size // 2, size]]
                                    if mode == "full" and size >= 128 else []),
        "unexpected": False, "captured_at": captured_at,
    }


def _insert_graphs(conn: Connection, run_id: int, backend: str, sizes: list[int], modes: tuple[str, ...], *,
                   captured_at: float, rng: random.Random) -> dict[tuple[str, int], int]:
    """Largest first, as the cache captures them: the first graph holds the pool, the rest reuse it."""
    ids: dict[tuple[str, int], int] = {}
    for mode in modes:
        # Piecewise graphs leave attention out, so each holds less of its own than a FULL graph.
        share = 1.0 if mode == "full" else 0.55
        for size in reversed(sizes):
            first = not ids
            pool = size * 1.5 * MIB if first else (0.25 + size / 64 + rng.random() * 0.5) * share * MIB
            row = _graph_row(run_id, backend, mode, size, captured_at=captured_at, pool_bytes=int(pool),
                             rng=rng)
            ids[(mode, size)] = conn.execute(insert(Graph).returning(Graph.id), row).scalar_one()
            captured_at += row["capture_seconds"]
    return ids


def _insert_traffic(conn: Connection, run_id: int, graphs: dict[tuple[str, int], int], sizes: list[int], *,
                    start: float, end: float, window: float, rng: random.Random, mean_batch: int) -> None:
    """Continuous-batching traffic from the packaged Azure trace (40 steps a window); ``mean_batch``
    sets how fast the trace is replayed, and a few steps exceed the largest capture size."""
    table = SizeTable(sizes)
    steps = _trace_batch_sizes(int((end - start) / window) * 40 + 40, mean_batch, max(sizes) + 32, rng)
    windows, eager, histogram = [], [], []
    t = start
    while t < end:
        batches = Counter(next(steps) for _ in range(40))
        per_graph: dict[tuple[str, int], list[int]] = {}
        for n, count in batches.items():
            histogram.append({"run_id": run_id, "window_start": t, "num_real_tokens": n, "batches": count})
            padded = table.pad(n)
            if padded is None:
                eager.append({"run_id": run_id, "window_start": t, "window_end": t + window,
                              "reason": "above_max_capture_size", "mode": "full", "batches": count,
                              "num_real_tokens": n * count})
                continue
            mode = "full" if rng.random() < 0.8 or ("piecewise", padded) not in graphs else "piecewise"
            entry = per_graph.setdefault((mode, padded), [0, 0, 0])
            entry[0] += count
            entry[1] += n * count
            entry[2] += (padded - n) * count
        for (mode, size), (replays, real, pad) in per_graph.items():
            descriptor = _descriptor(mode, size)
            windows.append({
                "run_id": run_id, "graph_id": graphs[(mode, size)], "mode": mode, "captured_size": size,
                "num_reqs": descriptor.num_reqs, "uniform": descriptor.uniform, "has_lora": False,
                "num_active_loras": 0, "descriptor_key": descriptor.key, "window_start": t,
                "window_end": t + window, "replays": replays, "num_real_tokens": real, "padding_tokens": pad,
            })
        t += window
    conn.execute(insert(ReplayWindow), windows)
    if eager:
        conn.execute(insert(EagerFallback), eager)
    conn.execute(insert(BatchSizeCount), histogram)


def _trace_batch_sizes(count: int, mean_batch: int, max_num_seqs: int, rng: random.Random) -> Iterator[int]:
    """Decode batch sizes of the real trace through the continuous-batching scheduler, replayed
    fast enough for batches around ``mean_batch`` (measured: ~28 running at 1x, 20 ms steps)."""
    config = TrafficConfig(
        max_num_seqs=max_num_seqs, speedup=max(1.0, mean_batch / 28.0), seed=rng.randrange(1 << 16),
        warmup_steps=500,
    )
    return iter(decode_batch_sizes(load_trace(), config, count))


def _insert_violation(conn: Connection, run_id: int, kind: str, graph_id: int, *, input_name: str | None,
                      expected: int | None, actual: int | None, injected: bool, count: int, message: str,
                      first_seen_at: float, last_seen_at: float) -> int:
    graph = conn.execute(Graph.__table__.select().where(Graph.id == graph_id)).one()
    return conn.execute(
        insert(Violation).returning(Violation.id),
        {"run_id": run_id, "kind": kind, "mode": graph.mode, "captured_size": graph.captured_size,
         "num_reqs": graph.num_reqs, "uniform": graph.uniform, "has_lora": False, "num_active_loras": 0,
         "descriptor_key": graph.descriptor_key, "wrapper": graph.wrapper, "input_name": input_name,
         "expected_address": expected, "actual_address": actual, "message": message,
         "stack": _stack(kind, message), "injected": injected, "count": count,
         "first_seen_at": first_seen_at, "last_seen_at": last_seen_at},
    ).scalar_one()


def _stack(kind: str, message: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "serve_llm/engine.py", line 412, in step\n    logits = self.runner.step(batch)\n'
        '  File "capture_core/runner.py", line 198, in step\n    return self.wrapper(**inputs)\n'
        f'  File "capture_core/wrapper.py", line 233, in __call__\n    self._check_addresses(inputs)\n'
        f"{kind}: {message}"
    )


def _chunked(rows: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _bulk_windows(now: float, span: float, graphs: list[tuple[int, int, str, int, str]], count: int
                  ) -> Iterator[dict[str, Any]]:
    step = span / (count / len(graphs))
    for i in range(count):
        graph_id, run_id, mode, size, key = graphs[i % len(graphs)]
        t = now - span + (i // len(graphs)) * step
        real = size * (5 + i % 7)
        yield {"run_id": run_id, "graph_id": graph_id, "mode": mode, "captured_size": size,
               "num_reqs": size if mode == "full" else None, "uniform": mode == "full", "has_lora": False,
               "num_active_loras": 0, "descriptor_key": key, "window_start": t, "window_end": t + step,
               "replays": 10, "num_real_tokens": real, "padding_tokens": size * 10 - real}


def _bulk_eager(now: float, span: float, run_ids: list[int], count: int) -> Iterator[dict[str, Any]]:
    reasons = ("above_max_capture_size", "no_graph_for_mixed_batch", "before_capture_phase")
    for i in range(count):
        t = now - span + i * span / count
        yield {"run_id": run_ids[i % len(run_ids)], "window_start": t, "window_end": t + 1.0,
               "reason": reasons[i % len(reasons)], "mode": "full", "batches": 1 + i % 3,
               "num_real_tokens": 600}


def _bulk_batch_sizes(now: float, span: float, run_ids: list[int], count: int) -> Iterator[dict[str, Any]]:
    for i in range(count):
        yield {"run_id": run_ids[i % len(run_ids)], "window_start": now - span + i * span / count,
               "num_real_tokens": 1 + (i * 37) % 600, "batches": 1 + i % 5}


def _bulk_violations(now: float, span: float, graphs: list[tuple[int, int, str, int, str]], count: int
                     ) -> Iterator[dict[str, Any]]:
    for i in range(count):
        _, run_id, mode, size, key = graphs[i % len(graphs)]
        t = now - span + i * span / count
        drift = i % 4 != 0
        yield {"run_id": run_id, "kind": "address_drift" if drift else "unexpected_capture", "mode": mode,
               "captured_size": size, "num_reqs": size if mode == "full" else None, "uniform": mode == "full",
               "has_lora": False, "num_active_loras": 0, "descriptor_key": key,
               "wrapper": "LlamaForCausalLM.forward", "input_name": "positions" if drift else None,
               "expected_address": 0x7F0000000000 + i if drift else None,
               "actual_address": 0x7F1000000000 + i if drift else None,
               "message": f"finding {i}", "stack": "", "injected": False, "count": 1 + i % 3,
               "first_seen_at": t, "last_seen_at": t + 5}
