"""What a recorded database says for the advice: the batch-size histogram of one or more runs (ranks
pooled), the graphs start-up captured (their sizes are the current configuration; their capture
time and pool memory feed the cost model), the traffic they met as the Overview shows it (the
current sizes' figures), the step times they recorded (what padding is weighed by) and, where a
run's configuration says, the engine's largest batch. Read through ``inspector.reading.queries`` only, as
the dashboard reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inspector.advice.costs import CostModel
from inspector.advice.engines import DecodeTraffic
from inspector.advice.sizes import Histogram, Projection
from inspector.advice.weighing import RecordedStepTime, Weighing, recorded_weighing
from inspector.errors import UsageError
from inspector.reading.queries import Queries
from inspector.reading.traffic import TrafficTotals

EVERY = 1_000_000
"""A page size that holds every run or graph of one database."""
ENGINE_LIMITS = ("max_num_batched_tokens", "max_num_seqs")
"""Run-configuration keys that bound a batch (the first found, at the top or under ``traffic``)."""


@dataclass(frozen=True)
class RecordedTraffic:
    """The advice's inputs: a histogram, where it came from, the current sizes and what costs are known."""

    run_ids: tuple[int, ...]
    source: str
    histogram: Histogram
    capture_sizes: tuple[int, ...]
    costs: CostModel | None
    engine_max: int | None
    weighing: Weighing | None = None
    """Padding weighed by the recorded step times (or by tokens, saying why); None for a trace."""
    current: Projection | None = None
    """The current sizes' traffic as recorded (the Overview's figures for the same runs)."""
    decode: DecodeTraffic | None = None
    """The decode steps apart (for the engines that keep decode graphs apart); None: not told."""


def read_recorded(queries: Queries, run_ids: Sequence[int] | None, source: str) -> RecordedTraffic:
    """The pooled traffic of ``run_ids`` (every run when None); ``UsageError`` for an unknown run.

    The batch sizes come from the queries' rollup as it stands: a one-shot reader warms it first
    (``queries.rollup.warm()``), the daemon's is warm already.
    """
    runs = {run["id"]: run for run in queries.runs(per_page=EVERY).items}
    if run_ids is None:
        chosen = sorted(runs)
    else:
        unknown = [run_id for run_id in run_ids if run_id not in runs]
        if unknown:
            missing = ", ".join(map(str, unknown))
            raise UsageError(f"{source} has no run {missing} (graph-inspector report lists the runs)")
        chosen = sorted(set(run_ids))
    queries.rollup.refresh()
    histogram = Histogram.from_counts(queries.rollup.batch_sizes(chosen)) if chosen else Histogram((), ())
    # One query for every run's graphs, their three columns (64 ranks' graphs page by page, with
    # their traffic, took most of a fleet's advice page).
    recorded = queries.start_up_graphs(None if run_ids is None else chosen)
    limits = [limit for run_id in chosen if (limit := _engine_limit(runs[run_id]["config"])) is not None]
    what = f"run {chosen[0]}" if len(chosen) == 1 else f"{len(chosen)} runs pooled"
    scope = None if run_ids is None else chosen
    points, clocks = queries.step_times_by_size(scope)
    traffic, by_size = queries.recorded_traffic(scope)
    sizes = tuple(sorted({g.captured_size for g in recorded}))
    replayed = tuple(sorted(set(sizes) | set(by_size)))
    decode_sizes, untold = queries.rollup.decode_batch_sizes(chosen)
    query_lens = queries.decode_query_lens(scope)
    decode = None
    if not untold and len(query_lens) <= 1:  # every batch told, one decode query length
        decode = DecodeTraffic(Histogram.from_counts(decode_sizes), query_lens[0] if query_lens else 1)
    return RecordedTraffic(
        run_ids=tuple(chosen),
        source=f"{source} ({what})" if chosen else source,
        histogram=histogram,
        capture_sizes=sizes,
        costs=CostModel.fit(recorded) if recorded else None,
        engine_max=max(limits) if limits else None,
        weighing=recorded_weighing([RecordedStepTime(*point) for point in points], clocks),
        current=Projection(replayed, traffic, tuple(by_size.get(size, TrafficTotals()) for size in replayed)),
        decode=decode,
    )


def _engine_limit(config: dict[str, Any]) -> int | None:
    for scope in (config.get("traffic") or {}, config):
        for key in ENGINE_LIMITS:
            value = scope.get(key) if isinstance(scope, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
