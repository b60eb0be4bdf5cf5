"""The vLLM plugin where vLLM is not: it is declared where vLLM looks for it, stays silent until
``GRAPH_INSPECTOR_VLLM`` names a database, and then refuses in one line, never raising into vLLM; and
the mapping of vLLM's vocabulary onto graph-inspector's (read by attribute, so no vLLM is needed).

The integration itself runs against the real vLLM 0.25.1 on the GPU machine (``bench/gpu_vllm.py``,
BENCHMARKS.md "vLLM"); ``test_vllm_hooks.py`` drives its hooks through vLLM's own classes where vLLM
is importable.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from importlib import metadata
from types import SimpleNamespace

import pytest

from capture_core import BatchDescriptor, CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.engines.vllm import ENV, register
from inspector.engines.vllm.mapping import descriptor_of, descriptor_of_execution, eager_reason, mode_of
from inspector.engines.vllm.version import SUPPORTED, support_problem

# What vLLM's load_general_plugins does: every entry point of the group, loaded and called.
LOAD_LIKE_VLLM = (
    "from importlib.metadata import entry_points\n"
    "for ep in entry_points(group='vllm.general_plugins'):\n"
    "    ep.load()()\n"
    "print('vllm went on')\n"
)


def _vllm_missing() -> bool:
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return True
    return False


def test_the_plugin_is_declared_where_vllm_looks_for_it() -> None:
    group = metadata.entry_points(group="vllm.general_plugins")
    points = [ep for ep in group if ep.name == "graph_inspector"]
    assert [ep.value for ep in points] == ["inspector.engines.vllm:register"]


def test_without_the_variable_the_plugin_does_nothing(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(ENV, raising=False)
    register()
    assert capsys.readouterr() == ("", "")


@pytest.mark.skipif(not _vllm_missing(), reason="vLLM is installed here")
def test_without_vllm_the_plugin_refuses_in_one_line_and_vllm_goes_on(tmp_path) -> None:
    env = {"PATH": "/usr/bin:/bin", ENV: f"sqlite:///{tmp_path / 'v.db'}"}
    done = subprocess.run([sys.executable, "-c", LOAD_LIKE_VLLM], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0
    assert done.stdout == "vllm went on\n"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "vLLM is not installed" in lines[0] and "0.25" in lines[0]
    assert not (tmp_path / "v.db").exists()  # nothing recorded, nothing created


@pytest.mark.parametrize("version", ["0.25.0", "0.25.1", "0.25.2rc1", "0.25.1+cu130"])
def test_the_supported_series_attaches(version: str) -> None:
    assert support_problem(version) is None


@pytest.mark.parametrize("version", ["0.24.2", "0.26.0", "1.0.0", "0.9.2", "nightly"])
def test_any_other_release_is_refused_naming_what_is_supported_and_watch(version: str) -> None:
    problem = support_problem(version)
    assert problem is not None and "\n" not in problem
    assert f"vLLM {version} is not supported" in problem
    assert SUPPORTED in problem and "graph-inspector watch -- <your command>" in problem


def test_modes_map_by_name() -> None:
    for name in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        assert mode_of(SimpleNamespace(name=name)) is CUDAGraphMode[name]
    with pytest.raises(ValueError, match="not a vLLM CUDA-graph mode"):
        mode_of(SimpleNamespace(name="FULL_AND_FULL"))


def test_an_enum_member_is_remembered_and_other_objects_are_read_each_time() -> None:
    import enum

    class VllmLike(enum.Enum):  # stands in for vLLM's CUDAGraphMode: members live with their class
        FULL = 2
        PIECEWISE = 1

    assert mode_of(VllmLike.FULL) is CUDAGraphMode.FULL and mode_of(VllmLike.FULL) is CUDAGraphMode.FULL
    assert mode_of(VllmLike.PIECEWISE) is CUDAGraphMode.PIECEWISE
    changing = SimpleNamespace(name="FULL")  # not a member: its id is not kept, its name is read again
    assert mode_of(changing) is CUDAGraphMode.FULL
    changing.name = "NONE"
    assert mode_of(changing) is CUDAGraphMode.NONE


def test_vllms_batch_descriptor_is_the_same_key() -> None:
    full = SimpleNamespace(num_tokens=8, num_reqs=8, uniform=True, has_lora=False, num_active_loras=0)
    piecewise = SimpleNamespace(num_tokens=32, num_reqs=None, uniform=False, has_lora=False,
                                num_active_loras=0)
    lora = SimpleNamespace(num_tokens=16, num_reqs=None, uniform=False, has_lora=True, num_active_loras=2)
    assert descriptor_of(full) == BatchDescriptor(8, 8, uniform=True)
    assert descriptor_of(piecewise) == BatchDescriptor(32)
    assert descriptor_of(lora) == BatchDescriptor(16, has_lora=True, num_active_loras=2)


def test_the_v2_runners_execution_descriptor_maps_onto_the_same_key() -> None:
    decode = SimpleNamespace(num_tokens=8, num_reqs=8, uniform_token_count=1, num_active_loras=0)
    mixed = SimpleNamespace(num_tokens=48, num_reqs=None, uniform_token_count=None, num_active_loras=0)
    assert descriptor_of_execution(decode) == BatchDescriptor(8, 8, uniform=True)
    assert descriptor_of_execution(mixed) == BatchDescriptor(48)


@pytest.mark.parametrize(
    ("tokens", "uniform", "configured", "forced", "expected"),
    [
        (8, True, CUDAGraphMode.NONE, False, (EagerReason.MODE_NONE, CUDAGraphMode.NONE)),
        (300, False, CUDAGraphMode.FULL_AND_PIECEWISE, False,
         (EagerReason.ABOVE_MAX_CAPTURE_SIZE, CUDAGraphMode.PIECEWISE)),
        (300, True, CUDAGraphMode.FULL_AND_PIECEWISE, False,
         (EagerReason.ABOVE_MAX_CAPTURE_SIZE, CUDAGraphMode.FULL)),
        (24, False, CUDAGraphMode.FULL_DECODE_ONLY, False,
         (EagerReason.NO_GRAPH_FOR_MIXED_BATCH, CUDAGraphMode.FULL)),
        (24, False, CUDAGraphMode.FULL_AND_PIECEWISE, True,
         (EagerReason.ENGINE_FORCED, CUDAGraphMode.PIECEWISE)),
        (24, True, CUDAGraphMode.FULL_AND_PIECEWISE, False,
         (EagerReason.NO_MATCHING_GRAPH, CUDAGraphMode.FULL)),
    ],
)
def test_an_eager_step_is_given_vllms_reason(tokens, uniform, configured, forced, expected) -> None:
    assert eager_reason(tokens, uniform, configured, 256, forced=forced) == expected


@pytest.mark.parametrize(("value", "expected"), [(None, "always_on"), ("", "always_on"), ("OFF", "off"),
                                                 (" always_on ", "always_on"), ("Debug", "debug")])
def test_the_checks_are_always_on_unless_turned_off(value, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    from inspector.engines.vllm.session import CHECKS_ENV, _checks

    if value is None:
        monkeypatch.delenv(CHECKS_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECKS_ENV, value)
    assert _checks() == expected


def test_an_unknown_checks_value_is_said_and_the_checks_stay_on(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from inspector.engines.vllm.session import CHECKS_ENV, _checks

    monkeypatch.setenv(CHECKS_ENV, "sometimes")
    logger = logging.getLogger("graph_inspector.vllm")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="graph_inspector.vllm"):
        assert _checks() == "always_on"
    assert "GRAPH_INSPECTOR_CHECKS='sometimes' is none of always_on, off, debug" in caplog.text


@pytest.mark.parametrize(("value", "expected"), [(None, 7.0), ("", 7.0), ("2.5", 2.5), (" 30 ", 30.0)])
def test_the_replay_window_is_vllms_stats_interval_unless_set(value, expected,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from inspector.engines.vllm import session

    monkeypatch.setattr(session, "_vllm_stats_interval", lambda: 7.0)
    if value is None:
        monkeypatch.delenv(session.WINDOW_ENV, raising=False)
    else:
        monkeypatch.setenv(session.WINDOW_ENV, value)
    assert session._window() == expected


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf", "31"])
def test_a_replay_window_that_is_no_positive_number_is_said_and_the_default_kept(
        value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from inspector.engines.vllm import session

    monkeypatch.setattr(session, "_vllm_stats_interval", lambda: 7.0)
    monkeypatch.setenv(session.WINDOW_ENV, value)
    logger = logging.getLogger("graph_inspector.vllm")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="graph_inspector.vllm"):
        assert session._window() == 7.0
    assert f"GRAPH_INSPECTOR_WINDOW={value!r} is not a number of seconds in (0, 30]" in caplog.text


def test_the_replay_window_never_outlasts_what_the_dashboard_calls_live(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run is live while it wrote within ``LIVE_AFTER_S``: a window of half that at most, whatever
    vLLM's stats interval."""
    from inspector.engines.vllm import session
    from inspector.reading.metrics import LIVE_AFTER_S

    assert session.MAX_WINDOW_S <= LIVE_AFTER_S / 2
    monkeypatch.delenv(session.WINDOW_ENV, raising=False)
    monkeypatch.setattr(session, "_vllm_stats_interval", lambda: 600.0)
    assert session._window() == session.MAX_WINDOW_S


def test_vllms_stats_interval_is_read_as_vllm_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from inspector.engines.vllm import session

    if importlib.util.find_spec("vllm") is None:  # CPU CI: no vLLM, vLLM's own default
        assert session._vllm_stats_interval() == session.VLLM_STATS_INTERVAL == 10.0
        return
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "3")
    assert session._vllm_stats_interval() == 3.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0")  # vLLM's own reading: not positive, 10 s
    assert session._vllm_stats_interval() == 10.0


def piece_graph(returns_tuple: bool = True):
    """An FX graph shaped as vLLM's piece before an attention op: a matmul it computes, and the
    attention output it only allocates (``torch.empty`` then a view) for the op to fill."""
    import torch
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    query = graph.call_function(torch.matmul, (x, w))
    buffer = graph.call_function(torch.empty, (8, 4))
    output = graph.call_method("view", (buffer, -1, 2, 2))
    graph.output((query, output) if returns_tuple else output)
    return SimpleNamespace(graph=graph)


def test_an_output_the_piece_only_allocates_is_found_through_its_views() -> None:
    from inspector.engines.vllm.twins import allocated_outputs

    assert allocated_outputs(SimpleNamespace(graph=piece_graph())) == {"output[1]"}
    assert allocated_outputs(SimpleNamespace(graph=piece_graph(returns_tuple=False))) == {"output"}
    assert allocated_outputs(SimpleNamespace()) == frozenset()  # no FX graph (V1's FULL model): none


def test_the_canary_compares_real_rows_and_nothing_of_an_allocated_output() -> None:
    import torch

    from capture_core.forward_context import ForwardContext
    from inspector.engines.vllm.twins import ComparedPart

    part = ComparedPart(frozenset({"output[1]"}))
    context = ForwardContext(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=8), 5)
    assert part("output[0]", torch.ones(8, 4), context).shape == (5, 4)  # the padding rows left out
    assert part("output[0]", torch.ones(3, 4), context).shape == (3, 4)  # not per token: all of it
    assert part("output[1]", torch.ones(8, 2, 2), context).numel() == 0
