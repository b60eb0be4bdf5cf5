"""The advice as a person reads it (text), as a program reads it (JSON), and as engines take it
(the lines of ``inspector.advice.engines``, each in the unit its engine means).
"""

from __future__ import annotations

from typing import Any

from inspector.advice.engines import ENGINES, EngineLists, config_lines
from inspector.advice.memory import MIB, vllm_gpu_memory_utilization
from inspector.advice.recommend import Advice
from inspector.advice.sizes import Projection


def _projection(p: Projection, advice: Advice) -> dict[str, Any]:
    costs = advice.costs
    return {
        "capture_sizes": list(p.capture_sizes),
        "graphs": len(p.capture_sizes),
        "traffic": p.traffic.as_dict(),
        "by_size": [{"captured_size": size, "traffic": t.as_dict()}
                    for size, t in zip(p.capture_sizes, p.by_size, strict=True)],
        "capture_seconds": None if costs is None else costs.capture_seconds(p.capture_sizes),
        "pool_bytes": None if costs is None else round(costs.pool_bytes(p.capture_sizes)),
    }


def as_dict(advice: Advice) -> dict[str, Any]:
    """The advice's JSON form (``advise --format json`` and ``/api/advice``)."""
    h = advice.histogram
    return {
        "source": advice.source,
        "histogram": {"batches": h.total, "distinct_sizes": len(h), "smallest": h.sizes[0],
                      "largest": h.largest},
        "max_size": advice.max_size,
        "graphs": advice.graphs,
        "bounded_by": advice.bounded_by,
        "weighed_by_step_time": advice.weighed_by_step_time,
        "weighed_by": advice.weighing.says,
        "included": list(advice.included),
        "current_recorded": advice.current_recorded,
        "modelled_step_seconds": None if advice.advised_seconds is None else {
            "current": advice.current_seconds, "advised": advice.advised_seconds},
        "by_tokens": None if advice.by_tokens is None else _by_tokens(advice),
        "lone_request": None if advice.lone_request is None else _lone_request(advice),
        "current": _projection(advice.current, advice),
        "advised": _projection(advice.advised, advice),
        "curve": [{"graphs": len(p.capture_sizes), "padding_tokens": p.traffic.padding_tokens,
                   "padding_waste": p.traffic.padding_waste} for p in advice.curve],
        "cost_model": advice.costs.describe() if advice.costs is not None else None,
        "config": config_lines(_lists(advice)),
        "config_notes": list(_lists(advice).notes),
        "memory": memory(advice),
    }


def memory(advice: Advice) -> dict[str, Any] | None:
    """The pool the current and advised sizes need (forecast), and vLLM's memory share that keeps its
    KV cache as it is (None where no pool was recorded)."""
    costs = advice.costs
    if costs is None or costs.pool is None:
        return None
    now, new = costs.pool_bytes(advice.current.capture_sizes), costs.pool_bytes(advice.sizes)
    share = None
    if advice.gpu_memory_utilization is not None and advice.gpu_memory_bytes:
        share = vllm_gpu_memory_utilization(advice.gpu_memory_utilization, now, new,
                                            advice.gpu_memory_bytes)
        line = (f"--gpu-memory-utilization {share:.4f} (was {advice.gpu_memory_utilization:g}: the graph "
                f"pool goes {now / MIB:.1f} -> {new / MIB:.1f} MiB and vLLM counts it in that share, so the "
                "KV cache stays as it was)")
    else:
        line = (f"the graph pool goes {now / MIB:.1f} -> {new / MIB:.1f} MiB: to keep vLLM's KV cache as it "
                f"is, move --gpu-memory-utilization by {(new - now) / MIB:+.1f} MiB over the GPU's memory "
                "(give --gpu-memory-utilization and --gpu-memory-gib for the figure)")
    return {"current_pool_bytes": round(now), "advised_pool_bytes": round(new),
            "vllm_gpu_memory_utilization": share, "vllm": line}


def _lists(advice: Advice) -> EngineLists:
    return advice.engines or EngineLists(advice.sizes, advice.sizes, None)


def _by_tokens(advice: Advice) -> dict[str, Any]:
    alternative = advice.by_tokens
    assert alternative is not None
    return {"capture_sizes": list(alternative.sizes), "same_sizes": alternative.sizes == advice.sizes,
            "modelled_step_seconds": alternative.seconds,
            "padding_waste": alternative.projection.traffic.padding_waste,
            "time_saved": alternative.saved(advice.advised_seconds)}


def by_tokens_line(advice: Advice) -> str | None:
    """What padding counted in tokens would have advised, and what weighing by time saved over it."""
    alternative = advice.by_tokens
    if alternative is None:
        return None
    saved = alternative.saved(advice.advised_seconds)
    if alternative.sizes == advice.sizes:
        return ("the same sizes: on this traffic the fewest padding tokens are also the least modelled step "
                "time")
    sizes = ", ".join(map(str, alternative.sizes))
    timed = "" if saved is None else f"; weighing by time saves {100 * saved:.2f}% of its modelled step time"
    seconds = "" if alternative.seconds is None else f": {alternative.seconds:,.3f} s modelled"
    return f"{sizes}{seconds}, padding waste {_percent(alternative.projection.traffic.padding_waste)}{timed}"


def _lone_request(advice: Advice) -> dict[str, Any]:
    lone = advice.lone_request
    assert lone is not None
    return {"padded_to": lone.advised_size, "step_seconds": lone.advised_seconds,
            "best_seconds": lone.best_seconds, "over_best": lone.over_best, "slack": lone.slack,
            "within_slack_up_to": lone.limit, "held": lone.held, "eager_seconds": lone.eager_seconds}


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


CURVE_POINTS = (1, 2, 4, 8, 16, 32, 64, 128)


def _recorded(advice: Advice) -> str:
    return ", as recorded" if advice.current_recorded else ""


def _change(before: float, after: float) -> str:
    return "no change" if before <= 0 else f"{100 * (after / before - 1):+.1f}%"


def render_text(advice: Advice) -> str:
    """The advice for a terminal: the sizes, current against advised, the curve, the lines to paste."""
    h, now, new = advice.histogram, advice.current.traffic, advice.advised.traffic
    current = f"current ({len(advice.current.capture_sizes)} sizes{_recorded(advice)})"
    width = max(26, len(current) + 2)  # the current column, never run into the advised one
    lines = [
        f"graph-inspector advise: {advice.graphs} capture sizes for {h.total:,} batches of "
        f"{h.sizes[0]}..{h.largest} tokens ({len(h):,} distinct sizes) from {advice.source}",
        f"  advised sizes    {', '.join(map(str, advice.sizes))}",
        f"  graph count      {advice.graphs}, set by {advice.bounded_by}; every batch up to "
        f"{advice.max_size} tokens replays",
        f"  {'':<17}{current:<{width}}advised ({advice.graphs} sizes)",
    ]
    rows = [
        ("padding waste", _percent(now.padding_waste), _percent(new.padding_waste)),
        ("padding tokens", f"{now.padding_tokens:,}", f"{new.padding_tokens:,}"),
        ("hit ratio", _percent(now.hit_ratio), _percent(new.hit_ratio)),
        ("eager batches", f"{now.eager_batches:,}", f"{new.eager_batches:,}"),
    ]
    if advice.advised_seconds is not None:
        now_s = advice.current_seconds
        change = "" if now_s is None else f" ({_change(now_s, advice.advised_seconds)})"
        rows.append(("step time", "n/a (eager, untimed)" if now_s is None else f"{now_s:,.3f} s",
                     f"{advice.advised_seconds:,.3f} s{change}, modelled"))
    if advice.costs is not None:
        costs = advice.costs
        current, advised = advice.current.capture_sizes, advice.sizes
        rows.append(("capture time", f"{costs.capture_seconds(current):.2f} s",
                     f"{costs.capture_seconds(advised):.2f} s"))
        rows.append(("pool memory", f"{costs.pool_bytes(current) / 2**20:.1f} MiB",
                     f"{costs.pool_bytes(advised) / 2**20:.1f} MiB"))
    lines += [f"  {name:<17}{old:<{width}}{advised}" for name, old, advised in rows]
    points = [p for p in advice.curve if len(p.capture_sizes) in CURVE_POINTS or p is advice.curve[-1]]
    curve = ", ".join(f"{len(p.capture_sizes)}: {_percent(p.traffic.padding_waste)}" for p in points)
    lines.append(f"  waste by graphs  {curve}")
    lines.append(f"  weighed by       {advice.weighing.says}")
    tokens_line = by_tokens_line(advice)
    if tokens_line is not None:
        lines.append(f"  by tokens alone  {tokens_line}")
    if advice.included:
        lines.append(f"  included         {', '.join(map(str, advice.included))} (--include)")
    if advice.lone_request is not None:
        lines.append(f"  lone request     {advice.lone_request.describe()}")
    if advice.costs is not None:
        lines += [f"  cost model       {line}" for line in advice.costs.describe()]
    held = memory(advice)
    if held is not None:
        lines.append(f"  memory           {held['vllm']}")
    lines.append("paste:")
    lists = _lists(advice)
    lines += [f"  {ENGINES[engine]:<22}{line}" for engine, line in config_lines(lists).items() if line]
    lines += [f"  (note: {note})" for note in lists.notes]
    return "\n".join(lines) + "\n"
