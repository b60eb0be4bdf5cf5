"""A run's graph cache as figures, and the baseline file that keeps them beside the code.

``Figures`` is what the regression gate (``inspector.gating.gate``) compares: each captured graph (mode,
descriptor key, captured size, captures, pool bytes, capture seconds, replays), the traffic as
``TrafficTotals`` (so hit ratio and padding waste come from the one formula) and the eager batches
by reason. A graph captured after start-up locked capture is an ``unexpected_capture`` violation,
not part of the cache: it is kept apart (``Figures.unexpected``), so a baseline saved from a run
with one (the demo plants one) never requires it. They are read from a recorded run
(``run_figures``), gathered from observer events by the pytest plugin (``FiguresCollector``), or
loaded from a baseline file.

The file is small, sorted JSON meant to be committed (``docs/regression-gate.md`` describes it):

    {"format": "graph-inspector baseline", "version": 1, "source": {...},
     "graphs": [{"mode": "full", "descriptor_key": "tokens=8,reqs=8,uniform=1", "captured_size": 8,
                 "captures": 1, "pool_bytes": 8388608, "capture_seconds": 0.012, "replays": 420}],
     "traffic": {"replays": ..., "eager_batches": ..., "num_real_tokens": ..., "padding_tokens": ...},
     "eager_fallbacks": {"above_max_capture_size": 12},
     "summary": {...}}

``summary`` (totals, hit ratio, padding waste, graphs never replayed) is written for people reading
the file or its diff; loading recomputes it from the rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from capture_core.sizes import EagerReason
from inspector.errors import UsageError
from inspector.reading.traffic import TrafficTotals, eager_totals, integer_sum, replay_totals, run_traffic
from inspector.storage.models import EagerTotal, Graph, ReplayTotal, Run
from inspector.storage.sqlite_file import not_a_file
from inspector.storage.store import Store, open_store

FORMAT = "graph-inspector baseline"
VERSION = 1
"""Bumped when the file's meaning changes; a newer file is refused with a clear error."""
EAGER_BACKEND = "eager"
"""The backend of a run without CUDA graphs (``capture_core.backends.EagerBackend.name``), as a
source's ``backend`` names it: its capture time is the model run eagerly, not a graph's capture."""

GraphKey = tuple[str, str]
"""(mode label, descriptor key)."""


@dataclass
class GraphFigures:
    """One graph key of a run: how often it was captured, what that cost, how often it replayed."""

    mode: str
    descriptor_key: str
    captured_size: int
    captures: int = 0
    pool_bytes: int = 0
    capture_seconds: float = 0.0
    replays: int = 0

    @property
    def key(self) -> GraphKey:
        return (self.mode, self.descriptor_key)

    @property
    def name(self) -> str:
        return f"{self.mode} {self.descriptor_key} (captured size {self.captured_size})"


@dataclass
class Figures:
    """A graph cache and the traffic it served."""

    graphs: dict[GraphKey, GraphFigures] = field(default_factory=dict)
    traffic: TrafficTotals = field(default_factory=TrafficTotals)
    eager: dict[str, int] = field(default_factory=dict)
    """eager-fallback reason -> batches."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where the figures come from: database, run, label, host, backend, device, saved_at."""
    unexpected: dict[GraphKey, GraphFigures] = field(default_factory=dict)
    """Graphs captured after start-up locked capture (violations): never compared, never saved."""

    @property
    def graph_count(self) -> int:
        """Graphs captured (a key captured twice counts twice)."""
        return sum(g.captures for g in self.graphs.values())

    @property
    def pool_bytes(self) -> int:
        return sum(g.pool_bytes for g in self.graphs.values())

    @property
    def capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in self.graphs.values())

    @property
    def never_replayed(self) -> list[GraphFigures]:
        return [g for g in by_size(self.graphs.values()) if g.replays == 0]

    @property
    def captured(self) -> dict[GraphKey, GraphFigures]:
        """The graphs captured (not those only seen replaying, whose capture went unrecorded)."""
        return {key: g for key, g in self.graphs.items() if g.captures}

    @property
    def batches_before_capture(self) -> int:
        """Batches that ran eagerly because no capture phase had begun: with no graph captured, a
        runtime configured to capture that never captured anything."""
        return self.eager.get(EagerReason.BEFORE_CAPTURE_PHASE.value, 0)

    @property
    def described(self) -> str:
        """The source in a few words: ``run 3 'label' (sqlite:///ci.db)``, a baseline file (and the
        run it was saved from), or what gathered the figures (``the test session``)."""
        source = self.source
        run = ""
        if "run" in source:
            label = f" {source['label']!r}" if source.get("label") else ""
            run = f"run {source['run']}{label} ({source.get('database', '?')})"
        if "file" in source:
            return f"{source['file']}" + (f", saved from {run}" if run else "")
        return run or str(source.get("what") or "the baseline")

    def to_json(self) -> str:
        graphs = [asdict(g) | {"capture_seconds": round(g.capture_seconds, 6)}
                  for g in by_size(self.graphs.values())]
        traffic = self.traffic.as_dict()
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "graphs": graphs,
            "traffic": {name: traffic[name] for name in TRAFFIC_FIELDS},
            "eager_fallbacks": dict(sorted(self.eager.items())),
            "summary": {
                "graphs": self.graph_count,
                "pool_bytes": self.pool_bytes,
                "capture_seconds": round(self.capture_seconds, 6),
                "hit_ratio": traffic["hit_ratio"],
                "padding_waste": traffic["padding_waste"],
                "never_replayed": [f"{g.mode} {g.descriptor_key}" for g in self.never_replayed],
            },
        }
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def by_size(graphs: Iterable[GraphFigures]) -> list[GraphFigures]:
    """Graphs in the order people read them: by mode, then captured size."""
    return sorted(graphs, key=lambda g: (g.mode, g.captured_size, g.descriptor_key))


TRAFFIC_FIELDS = ("replays", "eager_batches", "num_real_tokens", "padding_tokens")
GRAPH_FIELDS = {"mode": str, "descriptor_key": str, "captured_size": int, "captures": int, "pool_bytes": int,
                "capture_seconds": float, "replays": int}


# ---------------------------------------------------------------------------------- from a run


def run_figures(session: Session, run_id: int, database: str) -> Figures:
    """The figures of one recorded run (``UsageError`` when there is no such run)."""
    run = session.get(Run, run_id)
    if run is None:
        raise UsageError(f"no run {run_id} in {database}")
    figures = Figures(source={
        "database": database, "run": run.id, "label": run.label, "host": run.host, "rank": run.rank,
        "job": run.job, "backend": run.backend, "device": run.device, "started_at": run.started_at,
    })
    g = Graph
    for mode, key, unexpected, size, count, pool, seconds in session.execute(
        select(g.mode, g.descriptor_key, g.unexpected, func.max(g.captured_size), func.count(g.id),
               integer_sum(g.pool_bytes), func.sum(g.capture_seconds))
        .where(g.run_id == run_id, g.discarded.is_(False))
        .group_by(g.mode, g.descriptor_key, g.unexpected)
    ):
        into = figures.unexpected if unexpected else figures.graphs
        into[(mode, key)] = GraphFigures(mode, key, size, count, pool or 0, seconds or 0.0)
    for (mode, key, size), traffic in replay_totals(
        session, ReplayTotal.mode, ReplayTotal.descriptor_key, ReplayTotal.captured_size, run_ids=[run_id]
    ).items():
        graph = figures.graphs.get((mode, key)) or figures.unexpected.get((mode, key))
        if graph is None:  # replays of a graph whose capture was not recorded (a vanished file)
            graph = figures.graphs[(mode, key)] = GraphFigures(mode, key, size)
        graph.replays += traffic.replays
    figures.traffic = run_traffic(session, [run_id])
    figures.eager = {
        reason: batches
        for (reason,), (batches, _) in eager_totals(session, EagerTotal.reason, run_ids=[run_id]).items()
    }
    return figures


def baseline_run_in(session: Session, baseline: Figures, database: str) -> int | None:
    """The run of ``database`` that ``baseline`` was taken from, if it is still there: the same id
    and the same process (host, start). Another database at the same URL (each CI run records into
    a fresh ``ci.db``) has its own run 1, which is not the baseline's."""
    source = baseline.source
    if source.get("database") != database or not isinstance(source.get("run"), int):
        return None
    run = session.get(Run, source["run"])
    if run is None or (run.host, run.started_at) != (source.get("host"), source.get("started_at")):
        return None
    return run.id


def newest_run(session: Session, database: str, excluding: int | None = None) -> int:
    query = select(func.max(Run.id))
    if excluding is not None:
        query = query.where(Run.id != excluding)
    run_id = session.scalar(query)
    if run_id is None:
        besides = " besides the baseline run" if excluding is not None else ""
        raise UsageError(f"no runs recorded in {database}{besides}")
    return run_id


# ------------------------------------------------------------------------------ from events


class FiguresCollector:
    """Figures gathered from graph observer events (the pytest plugin's, over a test session)."""

    def __init__(self) -> None:
        self.figures = Figures()
        self._replays: dict[GraphKey, list[int]] = {}
        """key -> [replays, real tokens]."""

    def on_capture(self, event: Any) -> None:
        graph = self._graph(event.mode.label, event.descriptor, unexpected=event.unexpected)
        self.figures.source["backend"] = event.backend
        graph.captures += 1
        graph.pool_bytes += int(event.pool_bytes)
        graph.capture_seconds += float(event.capture_seconds)

    def on_replay(self, mode: Any, descriptor: Any, num_real_tokens: int) -> None:
        graph = self._graph(mode.label, descriptor)
        graph.replays += 1
        traffic = self.figures.traffic
        traffic.replays += 1
        traffic.num_real_tokens += num_real_tokens
        traffic.padding_tokens += descriptor.captured_size - num_real_tokens

    def on_eager(self, reason: Any, num_real_tokens: int, mode: Any) -> None:
        self.figures.traffic.eager_batches += 1
        self.figures.eager[reason.value] = self.figures.eager.get(reason.value, 0) + 1

    def _graph(self, mode: str, descriptor: Any, unexpected: bool = False) -> GraphFigures:
        key = (mode, descriptor.key)
        graph = self.figures.graphs.get(key)
        if graph is None and not unexpected:
            graph = self.figures.unexpected.get(key)  # replays of a graph captured unexpectedly
        if graph is None:
            into = self.figures.unexpected if unexpected else self.figures.graphs
            graph = into[key] = GraphFigures(mode, descriptor.key, descriptor.captured_size)
        return graph


def merge(parts: list[Figures], source: Mapping[str, Any]) -> Figures:
    """Figures of several parts (the tests of a session) summed into one; their backend is the
    eager one when any part's is (its capture time is then no graph's)."""
    merged = Figures(source=dict(source))
    backends = sorted({part.source["backend"] for part in parts if "backend" in part.source},
                      key=lambda name: name != EAGER_BACKEND)
    if backends:
        merged.source["backend"] = backends[0]
    for part in parts:
        for graphs, merged_graphs in ((part.graphs, merged.graphs), (part.unexpected, merged.unexpected)):
            for key, graph in graphs.items():
                into = merged_graphs.setdefault(key, GraphFigures(graph.mode, graph.descriptor_key,
                                                                  graph.captured_size))
                into.captures += graph.captures
                into.pool_bytes += graph.pool_bytes
                into.capture_seconds += graph.capture_seconds
                into.replays += graph.replays
        merged.traffic.add(part.traffic)
        for reason, batches in part.eager.items():
            merged.eager[reason] = merged.eager.get(reason, 0) + batches
    return merged


# ------------------------------------------------------------------------------------- files


def save_baseline(figures: Figures, path: Path) -> None:
    figures = Figures(figures.graphs, figures.traffic, figures.eager,
                      figures.source | {"saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(figures.to_json())
    except OSError as error:
        raise UsageError(f"cannot write the baseline to {path}: {error.strerror or error}") from None


def load_baseline(path: Path) -> Figures:
    """Read a baseline file; ``UsageError`` naming the file and what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"cannot read the baseline {path}: {error.strerror or error}") from None
    try:
        return figures_from_json(json.loads(text), source_file=str(path))
    except ValueError as error:  # json.JSONDecodeError included
        raise UsageError(f"{path} is not a graph-inspector baseline: {error}") from None


def figures_from_json(payload: Any, source_file: str = "") -> Figures:
    """Figures from a baseline's JSON (or the pytest plugin's per-test part); ValueError if malformed."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f'expected a JSON object with "format": "{FORMAT}"')
    version = payload.get("version")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"its version {version!r} is not a positive integer")
    if version > VERSION:
        raise ValueError(f"it is version {version}, newer than this graph-inspector reads ({VERSION}): "
                         "upgrade graph-inspector, or save the baseline again with this one")
    figures = Figures(source=dict(payload.get("source") or {}))
    if source_file:
        figures.source["file"] = source_file
    for index, row in enumerate(_list(payload, "graphs")):
        if not isinstance(row, dict) or set(row) != set(GRAPH_FIELDS):
            raise ValueError(f"graphs[{index}] must have exactly the fields {', '.join(GRAPH_FIELDS)}")
        graph = GraphFigures(**{
            name: _typed(f"graphs[{index}].{name}", row[name], kind) for name, kind in GRAPH_FIELDS.items()
        })
        figures.graphs[graph.key] = graph
    traffic = payload.get("traffic")
    if not isinstance(traffic, dict):
        raise ValueError('"traffic" must be an object')
    figures.traffic = TrafficTotals(**{name: _typed(f"traffic.{name}", traffic.get(name), int)
                                       for name in ("replays", "num_real_tokens", "padding_tokens",
                                                    "eager_batches")})
    eager = payload.get("eager_fallbacks")
    if not isinstance(eager, dict):
        raise ValueError('"eager_fallbacks" must be an object of reason -> batches')
    figures.eager = {str(reason): _typed(f"eager_fallbacks.{reason}", n, int) for reason, n in eager.items()}
    return figures


def _list(payload: dict, name: str) -> list:
    value = payload.get(name)
    if not isinstance(value, list):
        raise ValueError(f'"{name}" must be a list')
    return value


def _typed(where: str, value: Any, kind: type) -> Any:
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where} must be a{'n' if kind is int else ''} {kind.__name__} >= 0, got {value!r}")
    return value


# ---------------------------------------------------------------------------- --baseline B


def read_baseline(spec: str, store: Store, run: int | None = None) -> Figures:
    """What ``--baseline`` names: a run id of ``store``'s database, a database URL (its run ``run``,
    else its newest), or a baseline file."""
    if spec.isdigit():
        _no_run(run, spec)
        with store.session() as session:
            return run_figures(session, int(spec), store.display_url)
    if "://" in spec:
        with open_store(spec, upgrade=False) as other:
            other.require_head()
            with other.session() as session:
                chosen = run if run is not None else newest_run(session, other.display_url)
                return run_figures(session, chosen, other.display_url)
    _no_run(run, spec)
    path = Path(spec)
    if not path.is_file():
        kind = not_a_file(path)
        found = "no such file" if kind is None else f"{spec} is {kind}, not a baseline file"
        raise UsageError(f"--baseline {spec}: {found}; a baseline is a run id of --db, a database "
                         "URL (sqlite:///path.db) or a file written by --save-baseline")
    return load_baseline(path)


def _no_run(run: int | None, spec: str) -> None:
    if run is not None:
        raise UsageError(f"--baseline-run picks a run of a database URL baseline, not of {spec!r}")
