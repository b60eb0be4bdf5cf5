"""The regression gate: a candidate run's graph cache against a baseline, one verdict per comparison.

The one comparison module: ``graph-inspector report --baseline``, the pytest plugin's
``--graph-baseline`` and the dashboard's compare page all call ``compare``, so they cannot disagree.

Each comparison passes, fails (a regression) or is skipped (nothing to compare: no traffic, say);
a regression is something worse by more than its threshold. Thresholds have defaults
(``THRESHOLDS``, explained in ``docs/regression-gate.md``) and are set by a TOML or JSON file and
by ``NAME=VALUE`` overrides. Sizes that grow are judged against a relative AND an absolute limit,
both of which must be exceeded: the relative one keeps big caches from failing on noise, the
absolute one keeps small ones from failing on a few bytes or milliseconds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inspector.errors import UsageError
from inspector.gating.baseline import EAGER_BACKEND, Figures, GraphFigures, by_size
from inspector.reading.traffic import never_captured_line

MIB = 1 << 20

PASS, REGRESSION, SKIPPED = "pass", "regression", "skipped"


@dataclass(frozen=True)
class Threshold:
    name: str
    default: float | int | bool
    help: str


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold("captured_graphs.allow_added", True,
              "graphs captured that the baseline did not capture pass (false: they are a regression)"),
    Threshold("graph_count.relative", 0.10, "graphs captured may grow by this share of the baseline's ..."),
    Threshold("graph_count.absolute", 2, "... or by this many graphs, whichever is more"),
    Threshold("pool_memory.relative", 0.05, "total pool memory may grow by this share ..."),
    Threshold("pool_memory.absolute_bytes", 32 * MIB, "... or by this many bytes, whichever is more"),
    Threshold("pool_memory.per_graph_relative", 0.10, "one graph's pool memory may grow by this share ..."),
    Threshold("pool_memory.per_graph_absolute_bytes", 8 * MIB, "... or by this many bytes, whichever more"),
    Threshold("capture_time.relative", 0.50, "total capture time may grow by this share ..."),
    Threshold("capture_time.absolute_seconds", 2.0, "... or by this many seconds, whichever is more"),
    Threshold("capture_time.per_graph_relative", 1.00, "one graph's capture time may grow by this share ..."),
    Threshold("capture_time.per_graph_absolute_seconds", 0.5, "... or by this many seconds, whichever more"),
    Threshold("padding_waste.max_increase", 0.02, "padding waste may rise by this much (0.02: 2 points)"),
    Threshold("hit_ratio.max_decrease", 0.01, "hit ratio may fall by this much (0..1)"),
    Threshold("eager_fallbacks.max_share_increase", 0.01,
              "the share of batches run eagerly for one reason may rise by this much (0..1)"),
    Threshold("never_replayed.max_increase", 0, "this many more graphs may go without a replay"),
)
DEFAULTS = {t.name: t.default for t in THRESHOLDS}


class Thresholds(dict):
    """Threshold name -> value: the defaults, then a file's, then overrides (later wins)."""

    @classmethod
    def load(cls, path: Path | None = None, overrides: Iterable[str] = ()) -> Thresholds:
        thresholds = cls(DEFAULTS)
        if path is not None:
            for name, value in _read_file(path).items():
                thresholds.set(name, value, f"{path}")
        for override in overrides:
            name, sep, text = override.partition("=")
            if not sep:
                raise UsageError(
                    f"--threshold takes NAME=VALUE (e.g. pool_memory.relative=0.1), got {override!r}"
                )
            thresholds.set(name.strip(), _parse_value(text.strip()), "--threshold")
        return thresholds

    def set(self, name: str, value: Any, where: str) -> None:
        if name not in DEFAULTS:
            known = ", ".join(DEFAULTS)
            raise UsageError(f"{where}: unknown threshold {name!r}; the thresholds are: {known}")
        default = DEFAULTS[name]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise UsageError(f"{where}: {name} must be true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UsageError(f"{where}: {name} must be a number >= 0, got {value!r}")
        self[name] = value


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return text


def _read_file(path: Path) -> dict[str, Any]:
    """A thresholds file: TOML (``[pool_memory]`` then ``relative = 0.1``) or JSON (the same shape,
    ``{"pool_memory": {"relative": 0.1}}``), by extension; flattened to dotted names."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"cannot read the thresholds file {path}: {error.strerror or error}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise UsageError(f"{path} is not valid JSON: {error}") from None
    elif path.suffix == ".toml":
        data = _parse_toml(path, text)
    else:
        raise UsageError(f"{path}: a thresholds file is TOML (.toml) or JSON (.json)")
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected sections of thresholds, e.g. [pool_memory] relative = 0.1")
    flat = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise UsageError(f"{path}: {section!r} must be a section of thresholds, e.g. [{section}]")
        flat.update({f"{section}.{name}": value for name, value in values.items()})
    return flat


def _parse_toml(path: Path, text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: tomllib's forerunner, if it is installed
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError(f"{path}: reading TOML needs Python 3.11 or the 'tomli' package on "
                             "Python 3.10 (pip install tomli); or write the thresholds as JSON") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path} is not valid TOML: {error}") from None


# ------------------------------------------------------------------------------ the comparisons


@dataclass(frozen=True)
class Comparison:
    """One verdict: a JUnit test case, a line of the report, a row of the compare page."""

    name: str
    """Stable id: ``pool_memory``."""
    title: str
    verdict: str
    summary: str
    """One line: both values and the limit."""
    details: tuple[str, ...] = ()
    """The graphs or reasons behind it, one a line."""

    @property
    def failed(self) -> bool:
        return self.verdict == REGRESSION

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "verdict": self.verdict, "summary": self.summary,
                "details": list(self.details)}


Check = Callable[[Figures, Figures, dict], Comparison]
"""One comparison: (baseline, candidate, thresholds) -> its verdict."""


@dataclass
class GateResult:
    """A candidate against a baseline: every comparison's verdict."""

    baseline: str
    candidate: str
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def regressions(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.failed]

    @property
    def ok(self) -> bool:
        return not self.regressions

    def as_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "candidate": self.candidate, "ok": self.ok,
                "regressions": len(self.regressions), "comparisons": [c.as_dict() for c in self.comparisons]}


def compare(baseline: Figures, candidate: Figures, thresholds: Mapping[str, Any] | None = None) -> GateResult:
    """Every comparison of ``candidate`` against ``baseline``, in a fixed order."""
    limits = dict(DEFAULTS if thresholds is None else thresholds)
    result = GateResult(baseline.described, candidate.described)
    for check in COMPARISONS:
        result.comparisons.append(check(baseline, candidate, limits))
    return result


def _grew(before: float, after: float, relative: float, absolute: float) -> bool:
    """Grown by more than both limits."""
    return after - before > max(relative * before, absolute)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if abs(s) < 10 else f"{s:.1f} s"


def _percent(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.1%}"


def _change(before: float, after: float, show: Callable[[float], str]) -> str:
    delta = after - before
    sign = "+" if delta >= 0 else "-"
    share = f", {sign}{abs(delta) / before:.1%}" if before else ""
    return f"{show(before)} -> {show(after)} ({sign}{show(abs(delta))}{share})"


def _captured_graphs(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
    """Fails on a graph key of the baseline not captured, and on a candidate that captured nothing at
    all while its batches waited for a capture phase (against any baseline, one as empty too)."""
    before, after = baseline.captured, candidate.captured
    missing = by_size(before[k] for k in before.keys() - after.keys())
    added = by_size(after[k] for k in after.keys() - before.keys())
    allow_added = limits["captured_graphs.allow_added"]
    never_captured = not after and candidate.batches_before_capture > 0
    failed = bool(missing) or (bool(added) and not allow_added) or never_captured
    summary = (f"{len(before)} graph keys in the baseline, {len(after)} now: "
               f"{len(missing)} missing, {len(added)} added"
               f"{'' if allow_added else ' (added graphs fail: captured_graphs.allow_added = false)'}")
    details = tuple(f"missing: {g.name}" for g in missing) + tuple(f"added: {g.name}" for g in added)
    if never_captured:
        summary = f"{candidate.described} {never_captured_line(candidate.batches_before_capture)}; " + summary
    return Comparison("captured_graphs", "Captured graphs", REGRESSION if failed else PASS, summary, details)


def _graph_count(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
    before, after = baseline.graph_count, candidate.graph_count
    relative, absolute = limits["graph_count.relative"], limits["graph_count.absolute"]
    failed = _grew(before, after, relative, absolute)
    summary = (f"{_change(before, after, lambda n: str(int(n)))}; may grow by {relative:.0%} or "
               f"{absolute} graph(s), whichever is more")
    return Comparison("graph_count", "Graph count", REGRESSION if failed else PASS, summary)


def _sized(name: str, title: str, unit: str, value: Callable[[GraphFigures], float],
           show: Callable[[float], str]) -> Check:
    """A total-and-per-graph comparison (pool memory, capture time): fails when the total or any
    graph present in both grows by more than its limits."""

    def comparison(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
        relative, absolute = limits[f"{name}.relative"], limits[f"{name}.absolute_{unit}"]
        per_relative = limits[f"{name}.per_graph_relative"]
        per_absolute = limits[f"{name}.per_graph_absolute_{unit}"]
        before = sum(value(g) for g in baseline.graphs.values())
        after = sum(value(g) for g in candidate.graphs.values())
        total_failed = _grew(before, after, relative, absolute)
        common = by_size(candidate.graphs[key] for key in baseline.graphs.keys() & candidate.graphs.keys())
        grown = [
            (g.key, value(baseline.graphs[g.key]), value(g))
            for g in common
            if _grew(value(baseline.graphs[g.key]), value(g), per_relative, per_absolute)
        ]
        summary = (f"total {_change(before, after, show)}; may grow by {relative:.0%} or {show(absolute)}, "
                   f"one graph by {per_relative:.0%} or {show(per_absolute)}, whichever is more")
        if total_failed:
            summary = "total grew too much: " + summary
        details = tuple(
            f"{candidate.graphs[key].name}: {_change(b, a, show)}" for key, b, a in grown
        )
        failed = total_failed or bool(grown)
        return Comparison(name, title, REGRESSION if failed else PASS, summary, details)

    return comparison


def _ratio(name: str, title: str, limit_name: str, worse: int) -> Check:
    """A 0..1 figure of the traffic (padding waste, hit ratio) that must not move by more than its
    limit in the ``worse`` direction (+1: up, -1: down)."""
    verb = "rise" if worse > 0 else "fall"

    def comparison(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
        before, after = getattr(baseline.traffic, name), getattr(candidate.traffic, name)
        moved = f"{_percent(before)} -> {_percent(after)}"
        if before is None or after is None:
            return Comparison(name, title, SKIPPED, f"{moved}: no traffic on one side, nothing to compare")
        limit = limits[limit_name]
        summary = f"{moved}; may {verb} by {limit * 100:g} point(s)"
        return Comparison(name, title, REGRESSION if (after - before) * worse > limit else PASS, summary)

    return comparison


def _eager_fallbacks(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
    limit = limits["eager_fallbacks.max_share_increase"]
    b_batches, c_batches = baseline.traffic.batches, candidate.traffic.batches
    if not b_batches or not c_batches:
        return Comparison("eager_fallbacks", "Eager fallbacks", SKIPPED,
                          "no batches on one side, nothing to compare")
    details, failed = [], False
    for reason in sorted(baseline.eager.keys() | candidate.eager.keys()):
        before = baseline.eager.get(reason, 0) / b_batches
        after = candidate.eager.get(reason, 0) / c_batches
        worse = after - before > limit
        failed |= worse
        details.append(f"{reason}: {_percent(before)} -> {_percent(after)} of batches"
                       f"{' (too many)' if worse else ''}")
    summary = (f"{baseline.traffic.eager_batches} of {b_batches} batches eager -> "
               f"{candidate.traffic.eager_batches} of {c_batches}; each reason's share may rise by "
               f"{limit * 100:g} point(s)")
    return Comparison("eager_fallbacks", "Eager fallbacks", REGRESSION if failed else PASS, summary,
                      tuple(details))


def _never_replayed(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
    limit = limits["never_replayed.max_increase"]
    if not baseline.traffic.batches or not candidate.traffic.batches:
        return Comparison("never_replayed", "Graphs never replayed", SKIPPED,
                          "no batches on one side, nothing to compare")
    before, after = baseline.never_replayed, candidate.never_replayed
    known = {g.key for g in before}
    summary = f"{len(before)} -> {len(after)} graph(s) with no replay; may grow by {limit}"
    details = tuple(f"never replayed now: {g.name}" for g in after if g.key not in known)
    return Comparison("never_replayed", "Graphs never replayed",
                      REGRESSION if len(after) - len(before) > limit else PASS, summary, details)


def _on_graphs(check: Check) -> Check:
    """Capture time, judged only where a capture is a graph's. On the eager backend (no GPU) a
    capture runs the callable eagerly (its warm-ups and one call more), so its time is the model's
    CPU time under whatever else the machine runs: a second a graph on a busy CI runner, between runs
    of the same code."""

    def comparison(baseline: Figures, candidate: Figures, limits: dict) -> Comparison:
        eager = [side for side, figures in (("the baseline", baseline), ("this run", candidate))
                 if figures.source.get("backend") == EAGER_BACKEND]
        if not eager:
            return check(baseline, candidate, limits)
        return Comparison("capture_time", "Capture time", SKIPPED,
                          f"not compared: {' and '.join(eager)} ran on the eager backend (no CUDA graphs), "
                          "where a capture is the model run eagerly: its time is the CPU's, not a graph's")

    return comparison


COMPARISONS: tuple[Check, ...] = (
    _captured_graphs,
    _graph_count,
    _sized("pool_memory", "Pool memory", "bytes", lambda g: g.pool_bytes, _bytes),
    _on_graphs(_sized("capture_time", "Capture time", "seconds", lambda g: g.capture_seconds, _seconds)),
    _ratio("padding_waste", "Padding waste", "padding_waste.max_increase", +1),
    _ratio("hit_ratio", "Hit ratio", "hit_ratio.max_decrease", -1),
    _eager_fallbacks,
    _never_replayed,
)
