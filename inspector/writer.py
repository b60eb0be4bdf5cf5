"""Writes one run's records: one transaction per flush, ids remembered only once it commits.

A run has exactly one writer (its recorder), so the writer keeps the ids of the rows it made (the
run, each graph, each violation, each running total) and updates them in place without reading
first: a repeated violation is an ``UPDATE ... SET count = count + n``, never a search. The id maps
change only after a commit, so a failed transaction can be retried whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import Connection, bindparam, insert, update

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent
from capture_core.modes import CUDAGraphMode
from inspector.batch import FlushBatch, GraphKey, ViolationKey, graph_key
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
from inspector.store import Store

UNKNOWN_BACKEND = "unknown"


@dataclass(frozen=True)
class RunInfo:
    """What a run row says about the process that records it."""

    label: str
    host: str
    pid: int
    process: str
    rank: int
    world_size: int
    device: str
    config: str
    started_at: float


def descriptor_values(mode: CUDAGraphMode, descriptor: BatchDescriptor) -> dict[str, object]:
    return {
        "mode": mode.label,
        "captured_size": descriptor.captured_size,
        "num_reqs": descriptor.num_reqs,
        "uniform": descriptor.uniform,
        "has_lora": descriptor.has_lora,
        "num_active_loras": descriptor.num_active_loras,
        "descriptor_key": descriptor.key,
    }


def capture_values(run_id: int, event: CaptureEvent) -> dict[str, object]:
    return {
        "run_id": run_id,
        "wrapper": event.wrapper[:200],
        "backend": event.backend[:32],
        "input_names": json.dumps(list(event.input_names)),
        "input_addresses": json.dumps([int(a) for a in event.input_addresses]),
        "capture_seconds": float(event.capture_seconds),
        "pool_bytes": int(event.pool_bytes),
        "warmup_iters": int(event.warmup_iters),
        "num_segments": int(event.num_segments),
        "num_ubatches": int(event.num_ubatches),
        "ubatch_slices": json.dumps([list(s) for s in event.ubatch_slices]),
        "unexpected": bool(event.unexpected),
        "captured_at": float(event.captured_at),
        **descriptor_values(event.mode, event.descriptor),
    }


@dataclass
class _Staged:
    """Ids made inside the current transaction; adopted only if it commits."""

    run_id: int | None = None
    graph_ids: dict[GraphKey, int] = field(default_factory=dict)
    violation_ids: dict[ViolationKey, int] = field(default_factory=dict)
    violation_last_seen: dict[ViolationKey, float] = field(default_factory=dict)
    replay_totals: set[GraphKey] = field(default_factory=set)
    eager_totals: set[tuple[str, str]] = field(default_factory=set)


class RunWriter:
    """Turns flush batches into rows of one run."""

    def __init__(self, store: Store, info: RunInfo) -> None:
        self.store = store
        self.info = info
        self.run_id: int | None = None
        self.graph_ids: dict[GraphKey, int] = {}
        self.violation_ids: dict[ViolationKey, int] = {}
        self.violation_last_seen: dict[ViolationKey, float] = {}
        self.replay_totals: set[GraphKey] = set()
        """Graph keys whose running-total row exists (it is then bumped by its unique key)."""
        self.eager_totals: set[tuple[str, str]] = set()

    def create_run(self, now: float, backend: str | None) -> int:
        """Insert the run row now (start() does this so the run shows up before any traffic)."""
        staged = _Staged()
        with self.store.writer() as conn:
            self._ensure_run(conn, staged, now, backend)
        self._adopt(staged)
        assert self.run_id is not None
        return self.run_id

    def write(self, batch: FlushBatch, now: float) -> None:
        """Write ``batch`` in one transaction; raises (with nothing adopted) if it fails."""
        staged = _Staged()
        with self.store.writer() as conn:
            run_id = self._ensure_run(conn, staged, now, batch.backend)
            self._write_captures(conn, staged, run_id, batch)
            self._write_violations(conn, staged, run_id, batch)
            self._write_traffic(conn, staged, run_id, batch, now)
            values: dict[str, object] = {"last_seen_at": now, "dropped_events": batch.dropped_events}
            if batch.backend:
                values["backend"] = batch.backend[:32]
            if batch.ended_at is not None:
                values["ended_at"] = batch.ended_at
            conn.execute(update(Run).where(Run.id == run_id).values(**values))
        self._adopt(staged)

    def _adopt(self, staged: _Staged) -> None:
        if staged.run_id is not None:
            self.run_id = staged.run_id
        self.graph_ids.update(staged.graph_ids)
        self.violation_ids.update(staged.violation_ids)
        self.violation_last_seen.update(staged.violation_last_seen)
        self.replay_totals |= staged.replay_totals
        self.eager_totals |= staged.eager_totals

    def _ensure_run(self, conn: Connection, staged: _Staged, now: float, backend: str | None) -> int:
        if self.run_id is not None:
            return self.run_id
        info = self.info
        staged.run_id = conn.execute(
            insert(Run)
            .values(
                label=info.label[:200],
                host=info.host[:255],
                pid=info.pid,
                process=info.process[:500],
                rank=info.rank,
                world_size=info.world_size,
                device=info.device[:200],
                backend=(backend or UNKNOWN_BACKEND)[:32],
                config=info.config,
                started_at=info.started_at,
                last_seen_at=now,
                dropped_events=0,
            )
            .returning(Run.id)
        ).scalar_one()
        return staged.run_id

    def _write_captures(self, conn: Connection, staged: _Staged, run_id: int, batch: FlushBatch) -> None:
        for event in batch.captures:
            graph_id = conn.execute(insert(Graph).values(capture_values(run_id, event)).returning(Graph.id))
            staged.graph_ids[graph_key(event.mode, event.descriptor)] = graph_id.scalar_one()

    def _write_violations(self, conn: Connection, staged: _Staged, run_id: int, batch: FlushBatch) -> None:
        for key, pending in batch.violations.items():
            known = self.violation_ids.get(key)
            if known is not None:
                last = max(self.violation_last_seen.get(key, 0.0), pending.last_seen_at)
                conn.execute(
                    update(Violation)
                    .where(Violation.id == known)
                    .values(count=Violation.count + pending.count, last_seen_at=last)
                )
                staged.violation_last_seen[key] = last
                continue
            event = pending.event
            staged.violation_ids[key] = conn.execute(
                insert(Violation)
                .values(
                    run_id=run_id,
                    kind=event.kind.value,
                    wrapper=event.wrapper[:200],
                    input_name=None if event.input_name is None else event.input_name[:200],
                    expected_address=event.expected_address,
                    actual_address=event.actual_address,
                    message=event.message,
                    stack=event.stack,
                    injected=bool(event.injected),
                    count=pending.count,
                    first_seen_at=pending.first_seen_at,
                    last_seen_at=pending.last_seen_at,
                    **descriptor_values(event.mode, event.descriptor),
                )
                .returning(Violation.id)
            ).scalar_one()
            staged.violation_last_seen[key] = pending.last_seen_at

    def _graph_id(self, staged: _Staged, key: GraphKey) -> int | None:
        return staged.graph_ids.get(key, self.graph_ids.get(key))

    def _write_traffic(
        self, conn: Connection, staged: _Staged, run_id: int, batch: FlushBatch, now: float
    ) -> None:
        """Append this window's rows and bump the running totals: a few executemany statements."""
        traffic = batch.traffic
        start, end = traffic.window_start, traffic.window_end
        windows, new_totals, bumps = [], [], []
        for key, delta in traffic.replays.items():
            graph_id = self._graph_id(staged, key)
            counts = {
                "replays": delta.replays,
                "num_real_tokens": delta.num_real_tokens,
                "padding_tokens": delta.padding_tokens,
            }
            described = descriptor_values(delta.mode, delta.descriptor)
            windows.append(
                {"run_id": run_id, "graph_id": graph_id, "window_start": start, "window_end": end}
                | counts
                | described
            )
            if key in self.replay_totals or key in staged.replay_totals:
                bumps.append(
                    {"k_run": run_id, "k_mode": key[0], "k_key": key[1], "k_graph": graph_id, "k_now": now}
                    | {f"d_{name}": value for name, value in counts.items()}
                )
            else:
                new_totals.append(
                    {"run_id": run_id, "graph_id": graph_id, "updated_at": now} | counts | described
                )
                staged.replay_totals.add(key)
        if windows:
            conn.execute(insert(ReplayWindow), windows)
        if new_totals:
            conn.execute(insert(ReplayTotal), new_totals)
        if bumps:
            t = ReplayTotal
            conn.execute(
                update(t)
                .where(
                    t.run_id == bindparam("k_run"),
                    t.mode == bindparam("k_mode"),
                    t.descriptor_key == bindparam("k_key"),
                )
                .values(
                    graph_id=bindparam("k_graph"),
                    replays=t.replays + bindparam("d_replays"),
                    num_real_tokens=t.num_real_tokens + bindparam("d_num_real_tokens"),
                    padding_tokens=t.padding_tokens + bindparam("d_padding_tokens"),
                    updated_at=bindparam("k_now"),
                ),
                bumps,
            )

        fallbacks, new_eager, eager_bumps = [], [], []
        for (reason, mode), (batches, tokens) in traffic.eager.items():
            row = {"run_id": run_id, "reason": reason, "mode": mode, "batches": batches,
                   "num_real_tokens": tokens}
            fallbacks.append(row | {"window_start": start, "window_end": end})
            if (reason, mode) in self.eager_totals or (reason, mode) in staged.eager_totals:
                eager_bumps.append(
                    {"k_run": run_id, "k_reason": reason, "k_mode": mode, "k_now": now}
                    | {"d_batches": batches, "d_num_real_tokens": tokens}
                )
            else:
                new_eager.append(row | {"updated_at": now})
                staged.eager_totals.add((reason, mode))
        if fallbacks:
            conn.execute(insert(EagerFallback), fallbacks)
        if new_eager:
            conn.execute(insert(EagerTotal), new_eager)
        if eager_bumps:
            e = EagerTotal
            conn.execute(
                update(e)
                .where(
                    e.run_id == bindparam("k_run"),
                    e.reason == bindparam("k_reason"),
                    e.mode == bindparam("k_mode"),
                )
                .values(
                    batches=e.batches + bindparam("d_batches"),
                    num_real_tokens=e.num_real_tokens + bindparam("d_num_real_tokens"),
                    updated_at=bindparam("k_now"),
                ),
                eager_bumps,
            )

        sizes = [
            {"run_id": run_id, "window_start": start, "num_real_tokens": size, "batches": batches}
            for size, batches in sorted(traffic.batch_sizes.items())
        ]
        if sizes:
            conn.execute(insert(BatchSizeCount), sizes)
