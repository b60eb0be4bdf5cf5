"""The one write path: every row of every table is written by this module.

The recorder (through ``RunWriter``), ``graph-inspector watch`` (its flusher), the test fixtures and
the benchmarks write only through these functions, so each table has one writer and each row one
shape: a graph's descriptor columns are spelled out once (``descriptor_values``), the running
totals are bumped once (``append_traffic``), whoever records.

The functions take a connection whose transaction the caller holds. Those that create rows return
what they created (ids, running-total keys) instead of remembering it, so a caller adopts it only
once the transaction commits and can retry a failed one whole. ``RunWriter`` does exactly that for
one run: it keeps the ids of the rows it made (the run, each graph, each violation, each running
total) and updates them in place without reading first; a repeated violation is an
``UPDATE ... SET count = count + n``, never a search.
"""

from __future__ import annotations

import json
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from sqlalchemy import Connection, bindparam, insert, select, tuple_, update

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, DivergenceEvent
from capture_core.modes import CUDAGraphMode
from inspector.ranks.steps import StepSegment
from inspector.recording.batch import (
    FlushBatch,
    GraphKey,
    PendingViolation,
    TrafficWindow,
    ViolationKey,
    graph_key,
    stored_key,
)
from inspector.recording.losses import Losses
from inspector.storage import models
from inspector.storage.store import Store
from inspector.storage.text import storable_json, storable_row

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
    job: str | None = None
    """The distributed job this run is a rank of (see ``inspector.recording.process.detect_job``)."""


def descriptor_values(mode: CUDAGraphMode, descriptor: BatchDescriptor) -> dict[str, object]:
    """The descriptor columns of every table keyed by a graph."""
    return {
        "mode": mode.label,
        "captured_size": descriptor.captured_size,
        "num_reqs": descriptor.num_reqs,
        "uniform": descriptor.uniform,
        "has_lora": descriptor.has_lora,
        "num_active_loras": descriptor.num_active_loras,
        "descriptor_key": stored_key(descriptor),
    }


# ------------------------------------------------------------------------------------------ runs


def insert_run(conn: Connection, info: RunInfo, now: float, backend: str | None = None) -> int:
    values = asdict(info) | {"backend": backend or UNKNOWN_BACKEND, "last_seen_at": now, "dropped_events": 0}
    # ``config`` is JSON built from storable parts (``describe_process``): cutting it would break it.
    row = storable_row(models.Run, values, json_columns=frozenset({"config"}))
    return conn.execute(insert(models.Run).values(row).returning(models.Run.id)).scalar_one()


def update_run(
    conn: Connection,
    run_id: int,
    now: float,
    *,
    backend: str | None = None,
    losses: Losses | None = None,
    ended_at: float | None = None,
) -> None:
    """What every flush does to its run: ``last_seen_at`` moves to ``now`` (the run is live), and
    the backend, what the recorder dropped so far and the end are set when given."""
    values: dict[str, object] = {"last_seen_at": now}
    if backend:
        values["backend"] = backend
    if losses is not None:
        values.update(losses.columns())
    if ended_at is not None:
        values["ended_at"] = ended_at
    conn.execute(update(models.Run).where(models.Run.id == run_id).values(storable_row(models.Run, values)))


# ---------------------------------------------------------------------------------------- graphs


GRAPH_JSON_COLUMNS = frozenset({"input_names", "input_addresses", "ubatch_slices"})


def capture_values(run_id: int, event: CaptureEvent) -> dict[str, object]:
    return storable_row(models.Graph, {
        "run_id": run_id,
        "wrapper": event.wrapper,
        "backend": event.backend,
        "input_names": storable_json(list(event.input_names)),
        "input_addresses": json.dumps([int(a) for a in event.input_addresses]),
        "capture_seconds": float(event.capture_seconds),
        "pool_bytes": int(event.pool_bytes),
        "warmup_iters": int(event.warmup_iters),
        "num_segments": int(event.num_segments),
        "num_ubatches": int(event.num_ubatches),
        "ubatch_slices": json.dumps([list(s) for s in event.ubatch_slices]),
        "unexpected": bool(event.unexpected),
        "captured_at": float(event.captured_at),
        "engine_key": event.engine_key,
        "discarded": bool(event.discarded),
        **descriptor_values(event.mode, event.descriptor),
    }, json_columns=GRAPH_JSON_COLUMNS)


def insert_graphs(conn: Connection, run_id: int, events: Sequence[CaptureEvent]) -> dict[GraphKey, int]:
    """One row per capture; graph key -> id of the graph that serves it (a key captured twice: the
    later graph; never a discarded one, which serves nothing)."""
    ids = _insert_returning_ids(conn, models.Graph, [capture_values(run_id, event) for event in events])
    return {graph_key(e.mode, e.descriptor): graph_id
            for e, graph_id in zip(events, ids, strict=True) if not e.discarded}


def graph_ids(conn: Connection, run_id: int, keys: Iterable[GraphKey]) -> dict[GraphKey, int]:
    """The ids of ``run_id``'s graphs with these keys (a key captured twice: the later graph; never a
    discarded one)."""
    g = models.Graph
    wanted = list(keys)
    if not wanted:
        return {}
    rows = conn.execute(
        select(g.mode, g.descriptor_key, g.id)
        .where(g.run_id == run_id, tuple_(g.mode, g.descriptor_key).in_(wanted), g.discarded.is_(False))
        .order_by(g.id)
    )
    return {(mode, key): graph_id for mode, key, graph_id in rows}


# ------------------------------------------------------------------------------------ violations


def violation_values(run_id: int, pending: PendingViolation) -> dict[str, object]:
    event = pending.event
    return storable_row(models.Violation, {
        "run_id": run_id,
        "kind": event.kind.value,
        "wrapper": event.wrapper,
        "input_name": event.input_name,
        "expected_address": event.expected_address,
        "actual_address": event.actual_address,
        "message": event.message,
        "stack": event.stack,
        "injected": bool(event.injected),
        "count": pending.count,
        "first_seen_at": pending.first_seen_at,
        "last_seen_at": pending.last_seen_at,
        **descriptor_values(event.mode, event.descriptor),
    })


def insert_violations(
    conn: Connection, run_id: int, pending: Mapping[ViolationKey, PendingViolation]
) -> dict[ViolationKey, int]:
    """One row per new finding; finding key -> id."""
    rows = [violation_values(run_id, p) for p in pending.values()]
    return dict(zip(pending, _insert_returning_ids(conn, models.Violation, rows), strict=True))


def insert_divergences(conn: Connection, run_id: int, events: Sequence[DivergenceEvent]) -> None:
    """One row per divergence located."""
    if not events:
        return
    conn.execute(insert(models.Divergence), [storable_row(models.Divergence, {
        "run_id": run_id,
        "wrapper": event.wrapper,
        "module": event.module,
        "max_abs_error": _finite(event.max_abs_error),
        "max_rel_error": _finite(event.max_rel_error),
        "agreeing": storable_json(list(event.agreeing)),
        "modules_compared": int(event.modules_compared),
        "reproduced": bool(event.reproduced),
        "probe": event.probe,
        "message": event.message,
        "injected": bool(event.injected),
        "seen_at": float(event.seen_at),
        **descriptor_values(event.mode, event.descriptor),
    }, json_columns=frozenset({"agreeing"})) for event in events])


def _finite(value: float | None) -> float | None:
    """An error as a column holds it: an infinite one (the runs went through other modules) is None."""
    return None if value is None or value != value or value in (float("inf"), float("-inf")) else float(value)


def add_to_violation(conn: Connection, violation_id: int, count: int, last_seen_at: float) -> None:
    """More occurrences of a finding already written."""
    v = models.Violation
    conn.execute(
        update(v).where(v.id == violation_id).values(count=v.count + count, last_seen_at=last_seen_at)
    )


# --------------------------------------------------------------------------------------- traffic


@dataclass
class KnownTotals:
    """The running-total rows that exist for one run: a new key is inserted, a known one bumped."""

    replays: set[GraphKey] = field(default_factory=set)
    eager: set[tuple[str, str]] = field(default_factory=set)
    """(reason, mode label)."""
    step_times: set[GraphKey] = field(default_factory=set)

    def update(self, other: KnownTotals) -> None:
        self.replays |= other.replays
        self.eager |= other.eager
        self.step_times |= other.step_times

    @classmethod
    def of_run(cls, conn: Connection, run_id: int) -> KnownTotals:
        """The running totals ``run_id`` has now (for a writer that takes over an existing run)."""
        r, e, t = models.ReplayTotal, models.EagerTotal, models.StepTime
        replays = conn.execute(select(r.mode, r.descriptor_key).where(r.run_id == run_id))
        eager = conn.execute(select(e.reason, e.mode).where(e.run_id == run_id))
        timed = conn.execute(select(t.mode, t.descriptor_key).where(t.run_id == run_id))
        return cls(*({tuple(row) for row in rows} for rows in (replays, eager, timed)))


@dataclass(frozen=True)
class _TotalsTable:
    """A running-totals table: one row per run and ``key``; a bump adds ``counts``, sets ``latest``."""

    model: Any
    key: tuple[str, ...]
    counts: tuple[str, ...]
    latest: tuple[str, ...] = ()


REPLAY_TOTALS = _TotalsTable(
    models.ReplayTotal, ("mode", "descriptor_key"), ("replays", "num_real_tokens", "padding_tokens"),
    latest=("graph_id",),
)
EAGER_TOTALS = _TotalsTable(models.EagerTotal, ("reason", "mode"), ("batches", "num_real_tokens"))
STEP_TIMES = _TotalsTable(
    models.StepTime, ("mode", "descriptor_key"),
    ("graph_seconds", "graph_samples", "eager_seconds", "eager_samples"), latest=("graph_id", "clock"),
)


def append_traffic(
    conn: Connection,
    run_id: int,
    windows: Iterable[TrafficWindow],
    graph_ids: Mapping[GraphKey, int | None],
    known: KnownTotals,
    now: float,
) -> KnownTotals:
    """Append the windows' rows (replay windows, eager fallbacks, batch-size counts) and add them to
    the run's running totals (their step times too, which have totals only): a few executemany
    statements however many windows. Returns the running-total keys it created (known to exist once
    the transaction commits)."""
    replay_rows, eager_rows, size_rows = [], [], []
    replay_sums: dict[tuple, dict[str, Any]] = {}
    eager_sums: dict[tuple, dict[str, Any]] = {}
    step_sums: dict[tuple, dict[str, Any]] = {}
    described: dict[GraphKey, dict[str, Any]] = {}
    for window in windows:
        span = {"run_id": run_id, "window_start": window.window_start, "window_end": window.window_end}
        for key, delta in window.replays.items():
            columns = described.get(key)
            if columns is None:
                columns = described[key] = descriptor_values(delta.mode, delta.descriptor) | {
                    "graph_id": graph_ids.get(key)
                }
            counts = {
                "replays": delta.replays,
                "num_real_tokens": delta.num_real_tokens,
                "padding_tokens": delta.padding_tokens,
            }
            replay_rows.append(span | columns | counts)
            _add_counts(replay_sums, key, columns, counts)
        for (reason, mode), (batches, real) in window.eager.items():
            columns = {"reason": reason, "mode": mode}
            counts = {"batches": batches, "num_real_tokens": real}
            eager_rows.append(span | columns | counts)
            _add_counts(eager_sums, (reason, mode), columns, counts)
        decode = window.uniform_batch_sizes
        size_rows += [
            {"run_id": run_id, "window_start": window.window_start, "num_real_tokens": n, "batches": batches,
             "uniform_batches": None if decode is None else decode.get(n, 0)}
            for n, batches in sorted(window.batch_sizes.items())
        ]
        for key, timed in window.step_times.items():
            columns = descriptor_values(timed.mode, timed.descriptor) | {
                "graph_id": graph_ids.get(key), "clock": timed.clock,
            }
            _add_counts(step_sums, key, columns, {
                "graph_seconds": timed.graph_seconds, "graph_samples": timed.graph_samples,
                "eager_seconds": timed.eager_seconds, "eager_samples": timed.eager_samples,
            })
    for model, rows in (
        (models.ReplayWindow, replay_rows),
        (models.EagerFallback, eager_rows),
        (models.BatchSizeCount, size_rows),
    ):
        if rows:
            conn.execute(insert(model), rows)
    return KnownTotals(
        _add_to_totals(conn, REPLAY_TOTALS, run_id, replay_sums, known.replays, now),
        _add_to_totals(conn, EAGER_TOTALS, run_id, eager_sums, known.eager, now),
        _add_to_totals(conn, STEP_TIMES, run_id, step_sums, known.step_times, now),
    )


def _add_counts(
    sums: dict[tuple, dict[str, Any]], key: tuple, columns: dict, counts: dict[str, float]
) -> None:
    """Sum ``counts`` per key (a key's other columns are the same in every window of one call)."""
    found = sums.get(key)
    if found is None:
        sums[key] = columns | counts
        return
    for name, value in counts.items():
        found[name] += value


def _add_to_totals(
    conn: Connection, table: _TotalsTable, run_id: int, sums: dict[tuple, dict[str, Any]], known: set,
    now: float,
) -> set:
    """Insert the totals of new keys, bump the known ones in place; the keys inserted."""
    created, bumps, new = set(), [], []
    for key, row in sums.items():
        if key in known:
            bumps.append(
                {"k_run_id": run_id, "v_updated_at": now}
                | {f"k_{name}": row[name] for name in table.key}
                | {f"d_{name}": row[name] for name in table.counts}
                | {f"v_{name}": row[name] for name in table.latest}
            )
        else:
            new.append(row | {"run_id": run_id, "updated_at": now})
            created.add(key)
    if new:
        conn.execute(insert(table.model), new)
    if bumps:
        t = table.model.__table__
        key = [t.c[name] == bindparam(f"k_{name}") for name in ("run_id", *table.key)]
        conn.execute(
            update(t)
            .where(*key)
            .values(
                {name: t.c[name] + bindparam(f"d_{name}") for name in table.counts}
                | {name: bindparam(f"v_{name}") for name in (*table.latest, "updated_at")}
            ),
            bumps,
        )
    return created


def append_steps(conn: Connection, run_id: int, steps: StepSegment, window: TrafficWindow) -> None:
    """One rank's steps over one flush window (``inspector.ranks.steps``), for the ranks to be compared."""
    conn.execute(insert(models.StepSequence).values(
        run_id=run_id, first_step=steps.first_step, steps=steps.steps, window_start=window.window_start,
        window_end=window.window_end, sequence=steps.to_json(),
    ))


# -------------------------------------------------------------------------------- compile events


class CompileRecordable(Protocol):
    """A torch.compile skip or re-record, as ``graph-inspector watch`` hears one."""

    kind: Any
    """An enum whose value is the kind (``compile_skip``, ``compile_rerecord``)."""
    function: str
    reason: str
    message: str
    seen_at: float


def record_compile_event(conn: Connection, run_id: int, event: CompileRecordable) -> None:
    """Repeats of one kind, function and reason in a run bump the count."""
    c = models.CompileRecord
    key = storable_row(c, {"run_id": run_id, "kind": event.kind.value, "function": event.function,
                           "reason": event.reason})
    known = conn.execute(select(c.id).filter_by(**key)).scalar()
    if known is None:
        seen = {"first_seen_at": event.seen_at, "last_seen_at": event.seen_at}
        conn.execute(insert(c).values(**key, **storable_row(c, {"message": event.message}), count=1, **seen))
    else:
        conn.execute(update(c).where(c.id == known).values(count=c.count + 1, last_seen_at=event.seen_at))


def _insert_returning_ids(conn: Connection, model: Any, rows: list[dict[str, object]]) -> list[int]:
    """Insert ``rows`` in one executemany; their ids, in the order of ``rows``."""
    if not rows:
        return []
    statement = insert(model).returning(model.id, sort_by_parameter_order=True)
    return list(conn.execute(statement, rows).scalars())


# ------------------------------------------------------------------------------- one run's writer


class RunWriter:
    """Turns one recorder's flush batches into rows of its run, one transaction per batch."""

    def __init__(self, store: Store, info: RunInfo) -> None:
        self.store = store
        self.info = info
        self.run_id: int | None = None
        self.graph_ids: dict[GraphKey, int] = {}
        self.violation_ids: dict[ViolationKey, int] = {}
        self.violation_last_seen: dict[ViolationKey, float] = {}
        self.totals = KnownTotals()

    def create_run(self, now: float, backend: str | None) -> int:
        """Insert the run row now (start() does this so the run shows up before any traffic)."""
        if self.run_id is None:
            with self.store.writer() as conn:
                run_id = insert_run(conn, self.info, now, backend)
            self.run_id = run_id
        return self.run_id

    def write(self, batch: FlushBatch, now: float, *, holding: Callable[[], object] | None = None) -> None:
        """Write ``batch`` in one transaction; raises (with nothing adopted) if it fails. ``holding``
        is called once the transaction holds the write lock, before it writes; what it raises rolls
        the transaction back."""
        with self.store.writer() as conn:
            if holding is not None:
                holding()
            run_id = self.run_id
            if run_id is None:
                run_id = insert_run(conn, self.info, now, batch.backend)
            graphs = insert_graphs(conn, run_id, batch.captures)
            new = {key: p for key, p in batch.violations.items() if key not in self.violation_ids}
            violation_ids = insert_violations(conn, run_id, new)
            last_seen = {key: p.last_seen_at for key, p in new.items()}
            for key, pending in batch.violations.items():
                if key not in new:
                    last_seen[key] = max(self.violation_last_seen.get(key, 0.0), pending.last_seen_at)
                    add_to_violation(conn, self.violation_ids[key], pending.count, last_seen[key])
            insert_divergences(conn, run_id, batch.divergences)
            ids = ChainMap(graphs, self.graph_ids)
            totals = append_traffic(conn, run_id, [batch.traffic], ids, self.totals, now)
            if batch.steps is not None:
                append_steps(conn, run_id, batch.steps, batch.traffic)
            update_run(conn, run_id, now, backend=batch.backend, losses=batch.losses, ended_at=batch.ended_at)
        # Committed: adopt what the transaction made.
        self.run_id = run_id
        self.graph_ids.update(graphs)
        self.violation_ids.update(violation_ids)
        self.violation_last_seen.update(last_seen)
        self.totals.update(totals)
