"""Each comparison of the regression gate, proven both ways (just within its limits: pass; just
beyond: a regression), its thresholds (defaults, files, overrides) and the baseline file's checks."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from inspector.errors import UsageError
from inspector.gating.baseline import Figures, GraphFigures, figures_from_json, load_baseline, merge
from inspector.gating.gate import DEFAULTS, MIB, REGRESSION, SKIPPED, Thresholds, compare
from inspector.reading.traffic import TrafficTotals


def figures(**graphs: tuple[int, int, float, int]) -> Figures:
    """Figures of FULL graphs ``name=(captured size, pool bytes, capture seconds, replays)``, with
    traffic of 1000 batches (the replays, the rest eager above the largest size) and no padding."""
    found = Figures(source={"what": "test"})
    replays = 0
    for name, (size, pool, seconds, count) in graphs.items():
        found.graphs[("full", name)] = GraphFigures("full", name, size, 1, pool, seconds, count)
        replays += count
    found.traffic = TrafficTotals(replays=replays, num_real_tokens=replays, eager_batches=1000 - replays)
    found.eager = {"above_max_capture_size": 1000 - replays} if replays < 1000 else {}
    return found


BASE = figures(a=(8, 100 * MIB, 1.0, 600), b=(4, 20 * MIB, 0.5, 300), c=(2, 1 * MIB, 0.1, 0))


def verdict(candidate: Figures, name: str, **thresholds: object) -> str:
    limits = dict(DEFAULTS) | {key.replace("__", "."): value for key, value in thresholds.items()}
    (found,) = [c for c in compare(BASE, candidate, limits).comparisons if c.name == name]
    return found.verdict


def changed(**graphs: dict) -> Figures:
    """BASE with some graphs' fields changed (None: the graph removed)."""
    candidate = copy.deepcopy(BASE)
    for name, fields in graphs.items():
        if fields is None:
            del candidate.graphs[("full", name)]
        else:
            for field, value in fields.items():
                setattr(candidate.graphs[("full", name)], field, value)
    return candidate


def test_an_identical_candidate_passes_every_comparison() -> None:
    result = compare(BASE, copy.deepcopy(BASE))
    assert result.ok and [c.verdict for c in result.comparisons] == ["pass"] * 8
    assert [c.name for c in result.comparisons] == [
        "captured_graphs", "graph_count", "pool_memory", "capture_time", "padding_waste", "hit_ratio",
        "eager_fallbacks", "never_replayed",
    ]


def test_captured_graphs_fail_on_a_missing_graph_and_on_added_ones_only_when_told() -> None:
    assert verdict(changed(c=None), "captured_graphs") == REGRESSION
    added = copy.deepcopy(BASE)
    added.graphs[("full", "d")] = GraphFigures("full", "d", 16, 1)
    assert verdict(added, "captured_graphs") == "pass"
    assert verdict(added, "captured_graphs", captured_graphs__allow_added=False) == REGRESSION
    # A graph seen replaying whose capture went unrecorded is not a captured graph.
    assert verdict(changed(c={"captures": 0}), "captured_graphs") == REGRESSION


def test_graph_count_fails_beyond_both_its_limits() -> None:
    more = copy.deepcopy(BASE)
    for name in "defg":
        more.graphs[("full", name)] = GraphFigures("full", name, 1, 1)
    assert verdict(more, "graph_count") == REGRESSION  # 3 -> 7: more than 10% and more than 2
    assert verdict(more, "graph_count", graph_count__absolute=4) == "pass"
    assert verdict(changed(c=None), "graph_count") == "pass"  # fewer graphs: the missing one fails


@pytest.mark.parametrize(
    ("name", "field", "unit", "total_limit", "per_graph_limit"),
    [("pool_memory", "pool_bytes", "bytes", 32 * MIB, 8 * MIB),
     ("capture_time", "capture_seconds", "seconds", 2.0, 0.5)],
)
def test_pool_memory_and_capture_time_fail_on_the_total_or_one_graph(
    name: str, field: str, unit: str, total_limit: float, per_graph_limit: float
) -> None:
    base_a = getattr(BASE.graphs[("full", "a")], field)
    base_c = getattr(BASE.graphs[("full", "c")], field)
    kind = type(base_a)
    # One small graph grows a lot, but by less than the absolute floor: passes.
    assert verdict(changed(c={field: kind(base_c + per_graph_limit * 0.9)}), name) == "pass"
    # ... and just beyond it: that graph fails, the total does not.
    assert verdict(changed(c={field: kind(base_c + per_graph_limit * 1.1)}), name) == REGRESSION
    # The largest graph grows by more than the floor but less than its relative limit: passes ...
    grown = changed(a={field: kind(base_a + per_graph_limit * 1.1)})
    assert verdict(grown, name) == "pass"
    # ... unless that limit is lowered.
    assert verdict(grown, name, **{f"{name}__per_graph_relative": 0.01}) == REGRESSION
    # Every graph grows a little, the total by more than its limits: fails on the total alone.
    spread = changed(**{g: {field: kind(getattr(BASE.graphs[("full", g)], field) * 1.45)} for g in "abc"})
    relaxed = {f"{name}__per_graph_relative": 1.0, f"{name}__relative": 0.0,
               f"{name}__absolute_{unit}": total_limit * 0.1}
    assert verdict(spread, name, **relaxed) == REGRESSION
    assert verdict(spread, name, **relaxed | {f"{name}__relative": 0.5}) == "pass"


def test_capture_time_is_not_judged_where_either_side_ran_on_the_eager_backend() -> None:
    # On the eager backend a capture is the model run eagerly: its time is the CPU's, which swings by
    # seconds a graph on a busy runner. Five seconds more for one graph fails on CUDA, not there.
    slower = changed(c={"capture_seconds": 5.0})
    on_cuda = copy.deepcopy(BASE)
    on_cuda.source["backend"] = slower.source["backend"] = "cuda"
    [judged] = [c for c in compare(on_cuda, slower).comparisons if c.name == "capture_time"]
    assert judged.verdict == REGRESSION
    for eager_side, summary in (("baseline", "the baseline ran"), ("candidate", "this run ran"),
                                ("both", "the baseline and this run ran")):
        baseline, candidate = copy.deepcopy(on_cuda), copy.deepcopy(slower)
        for side in (baseline, candidate):
            if eager_side in ("both", "baseline" if side is baseline else "candidate"):
                side.source["backend"] = "eager"
        result = compare(baseline, candidate)
        [skipped] = [c for c in result.comparisons if c.name == "capture_time"]
        assert skipped.verdict == SKIPPED and result.ok
        assert skipped.summary == (f"not compared: {summary} on the eager backend (no CUDA graphs), where a "
                                   "capture is the model run eagerly: its time is the CPU's, not a graph's")


def test_a_test_sessions_figures_name_the_eager_backend_when_any_test_captured_on_it() -> None:
    parts = [Figures(source={"backend": "cuda"}), Figures(source={"backend": "eager"}), Figures()]
    assert merge(parts, {"what": "s"}).source == {"what": "s", "backend": "eager"}
    assert merge(parts[:1], {"what": "s"}).source["backend"] == "cuda"
    assert "backend" not in merge(parts[2:], {"what": "s"}).source


def _traffic(replays: int, real: int, padding: int, eager: int) -> Figures:
    candidate = copy.deepcopy(BASE)
    candidate.traffic = TrafficTotals(replays=replays, num_real_tokens=real, padding_tokens=padding,
                                      eager_batches=eager)
    candidate.eager = {"above_max_capture_size": eager} if eager else {}
    return candidate


def test_padding_waste_and_hit_ratio_fail_beyond_their_points_and_skip_without_traffic() -> None:
    assert verdict(_traffic(900, 890, 10, 100), "padding_waste") == "pass"  # 1.1 points
    assert verdict(_traffic(900, 870, 30, 100), "padding_waste") == REGRESSION  # 3.3 points
    assert verdict(_traffic(895, 895, 0, 105), "hit_ratio") == "pass"  # 0.5 points down
    assert verdict(_traffic(880, 880, 0, 120), "hit_ratio") == REGRESSION  # 2 points down
    assert verdict(_traffic(0, 0, 0, 0), "hit_ratio") == SKIPPED
    assert verdict(_traffic(0, 0, 0, 10), "padding_waste") == SKIPPED


def test_eager_fallbacks_fail_when_a_reasons_share_rises() -> None:
    assert verdict(_traffic(895, 895, 0, 105), "eager_fallbacks") == "pass"
    assert verdict(_traffic(880, 880, 0, 120), "eager_fallbacks") == REGRESSION
    new_reason = _traffic(900, 900, 0, 100)
    new_reason.eager = {"above_max_capture_size": 80, "no_graph_for_mixed_batch": 20}
    assert verdict(new_reason, "eager_fallbacks") == REGRESSION  # a reason from 0% to 2%
    assert verdict(_traffic(0, 0, 0, 0), "eager_fallbacks") == SKIPPED


def test_graphs_never_replayed_fail_when_more_go_unused() -> None:
    assert verdict(changed(b={"replays": 0}), "never_replayed") == REGRESSION
    assert verdict(changed(b={"replays": 0}), "never_replayed", never_replayed__max_increase=1) == "pass"
    assert verdict(changed(c={"replays": 5}), "never_replayed") == "pass"  # one fewer: better


def test_thresholds_come_from_a_json_or_toml_file_then_flags(tmp_path: Path) -> None:
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps({"pool_memory": {"relative": 0.2},
                                   "captured_graphs": {"allow_added": False}}))
    loaded = Thresholds.load(as_json, ["pool_memory.relative=0.3", "graph_count.absolute=5"])
    assert loaded["pool_memory.relative"] == 0.3 and loaded["graph_count.absolute"] == 5
    assert loaded["captured_graphs.allow_added"] is False
    assert loaded["hit_ratio.max_decrease"] == DEFAULTS["hit_ratio.max_decrease"]
    as_toml = tmp_path / "t.toml"
    as_toml.write_text("[hit_ratio]\nmax_decrease = 0.05\n")
    assert Thresholds.load(as_toml)["hit_ratio.max_decrease"] == 0.05
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"hit_ratio": 0.05}))
    with pytest.raises(UsageError, match=r"'hit_ratio' must be a section of thresholds"):
        Thresholds.load(flat)


def test_toml_on_python_3_10_needs_tomli_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.toml"
    path.write_text("[hit_ratio]\nmax_decrease = 0.05\n")
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    monkeypatch.setitem(sys.modules, "tomli", None)  # not installed
    with pytest.raises(UsageError, match=r"needs Python 3.11 or the 'tomli' package"):
        Thresholds.load(path)


def test_a_baseline_file_round_trips_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(BASE.to_json())
    again = load_baseline(path)
    assert again.graphs == BASE.graphs and again.traffic == BASE.traffic and again.eager == BASE.eager
    assert again.source["file"] == str(path) and compare(BASE, again).ok
    good = json.loads(BASE.to_json())
    for broken, message in [
        ({**good, "format": "something else"}, "format"),
        ({**good, "version": 0}, "is not a positive integer"),
        ({**good, "graphs": [{**good["graphs"][0], "pool_bytes": -1}]}, r"graphs\[0\].pool_bytes must be"),
        ({**good, "graphs": [{"mode": "full"}]}, r"graphs\[0\] must have exactly the fields"),
        ({**good, "traffic": {"replays": 1.5}}, "traffic.replays must be an int"),
        ({**good, "eager_fallbacks": []}, "eager_fallbacks"),
    ]:
        with pytest.raises(ValueError, match=message):
            figures_from_json(broken)
