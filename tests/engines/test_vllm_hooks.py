"""The vLLM integration's hooks on vLLM's own classes (skipped where vLLM is not importable: CI has
none; a machine with vLLM 0.25 runs it, the GPU machine among them).

vLLM's ``CUDAGraphWrapper`` objects, its forward context and its ``BatchDescriptor`` are the real
ones; the one thing stood in for is the body of vLLM's ``CUDAGraphWrapper.__call__`` (its
``torch.cuda.graph`` capture and replay, which needs a GPU): a call that runs the piece and counts
its captures and replays per descriptor. What vLLM itself does with its graphs is measured on the
H200 (``bench/gpu_vllm.py``, BENCHMARKS.md "vLLM").
"""

from __future__ import annotations

import collections
import importlib.util
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")

PIECES = 3


@pytest.fixture
def attached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from attach(tmp_path, monkeypatch)


@pytest.fixture
def attached_in_debug_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from inspector.engines.vllm.session import CHECKS_ENV

    monkeypatch.setenv(CHECKS_ENV, "debug")
    yield from attach(tmp_path, monkeypatch)


@pytest.fixture
def attached_recording_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from inspector.engines.vllm.session import CHECKS_ENV

    monkeypatch.setenv(CHECKS_ENV, "off")
    yield from attach(tmp_path, monkeypatch)


def attach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The integration installed and attached to a stand-in V1 runner; uninstalled afterwards."""
    from vllm.config import CUDAGraphMode

    from inspector.engines.vllm import ENV, hooks, register

    db = tmp_path / "vllm.db"
    monkeypatch.setenv(ENV, f"sqlite:///{db}")
    register()
    session = hooks.session()
    assert session is not None
    calls: collections.Counter = collections.Counter()

    def vllm_call(wrapper, *args, **kwargs):  # stands in for vLLM's capture-or-replay body
        from vllm.forward_context import get_forward_context

        key = (id(wrapper), get_forward_context().batch_descriptor)
        calls["replay" if key in calls else "capture"] += 1
        calls[key] += 1
        return wrapper.runnable(*args, **kwargs)

    session.vllm_call = vllm_call
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(4, 4)
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=[2, 4, 8],
            max_cudagraph_capture_size=8, cudagraph_num_of_warmups=1, mode=3),
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64,
                                         enable_chunked_prefill=True),
        cache_config=SimpleNamespace(enable_prefix_caching=True, gpu_memory_utilization=0.1,
                                     kv_cache_memory_bytes=None),
        model_config=SimpleNamespace(model="tiny", dtype="bfloat16", max_model_len=64),
        parallel_config=SimpleNamespace(rank=0, world_size=1))
    session.attach(SimpleNamespace(vllm_config=config, device="cpu", model=model), "V1")
    yield SimpleNamespace(session=session, db=db, model=model, calls=calls)
    hooks.uninstall()


class Piece:
    """A compiled piece as vLLM's PiecewiseBackend presents it: its index among the pieces, and the
    model's weight among its positional inputs (torch.compile lifts parameters into the graph)."""

    def __init__(self, index: int) -> None:
        self.piecewise_compile_index, self.total_piecewise_compiles = index, PIECES
        self.out = torch.zeros(8, 4)
        self.runs = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        n = x.shape[0]
        self.out[:n] = x @ weight  # a static output, as a replayed graph's
        return self.out[:n]


def pieces():
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    made = []
    for index in range(PIECES):
        wrapper = object.__new__(CUDAGraphWrapper)  # vLLM's own class; __init__ asks for a CUDA platform
        wrapper.__dict__.update(runnable=Piece(index), runtime_mode=CUDAGraphMode.PIECEWISE, graph_pool=None,
                                concrete_cudagraph_entries={})
        made.append(wrapper)
    return made


def forward(wrappers, x: torch.Tensor, weight: torch.Tensor, tokens: int) -> torch.Tensor:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context

    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                             cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                             batch_descriptor=BatchDescriptor(num_tokens=tokens))
    with override_forward_context(context):
        y = x[:tokens]
        for wrapper in wrappers:
            y = wrapper(y, weight)
    return y


def rows(db: Path, query: str) -> list:
    with sqlite3.connect(db) as conn:
        return conn.execute(query).fetchall()


def test_pieces_are_captured_as_one_graph_per_descriptor_and_steps_counted_once(attached) -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    session, weight = attached.session, attached.model.proj.weight
    wrappers, x = pieces(), torch.ones(8, 4)
    for tokens in (8, 4, 2):
        forward(wrappers, x, weight, tokens)
    session.capture_finished()
    for _ in range(5):
        session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=4), 3, False)
        forward(wrappers, x, weight, 4)
    session.step(CUDAGraphMode.NONE, BatchDescriptor(num_tokens=20), 20, False)
    session.close()
    assert attached.calls["capture"] == 3 * PIECES and attached.calls["replay"] == 5 * PIECES
    graphs = rows(attached.db, "SELECT captured_size, wrapper, num_segments, engine_key FROM graphs")
    assert [(size, wrapper, segments) for size, wrapper, segments, _ in graphs] == [
        (size, "vLLM PIECEWISE (3 pieces)", 3) for size in (8, 4, 2)]
    assert graphs[0][3].startswith("BatchDescriptor(num_tokens=8")
    names = rows(attached.db, "SELECT input_names FROM graphs")[0][0]
    assert "piece1.proj.weight" in names  # a weight among a piece's inputs is named as a parameter
    totals = "SELECT mode, captured_size, replays, num_real_tokens, padding_tokens FROM replay_totals"
    assert rows(attached.db, totals) == [("piecewise", 4, 5, 15, 5)]
    assert rows(attached.db, "SELECT reason, batches FROM eager_totals") == [("above_max_capture_size", 1)]
    assert rows(attached.db, "SELECT kind FROM violations") == []


def test_a_reassigned_weight_and_a_late_descriptor_are_caught_at_their_step(attached) -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    session, model = attached.session, attached.model
    wrappers, x = pieces(), torch.ones(8, 4)
    forward(wrappers, x, model.proj.weight, 4)
    session.capture_finished()
    forward(wrappers, x, model.proj.weight, 4)
    assert rows(attached.db, "SELECT kind FROM violations") == []
    model.proj.weight = torch.nn.Parameter(model.proj.weight.detach().clone())  # a weight sync by assignment
    session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=4), 4, False)
    forward(wrappers, x, model.proj.weight, 4)
    session.recorder.flush(timeout=10)
    drifts = rows(attached.db, "SELECT kind, input_name FROM violations")
    assert set(drifts) == {("address_drift", "proj.weight")}
    forward(wrappers, x, model.proj.weight, 3)  # a size never captured reaches the pieces while serving
    session.close()
    late = rows(attached.db, "SELECT kind, wrapper FROM violations WHERE kind = 'unexpected_capture'")
    assert late and all(wrapper.startswith("vLLM PIECEWISE piece") for _, wrapper in late)
    assert rows(attached.db, "SELECT unexpected FROM graphs WHERE captured_size = 3") == [(1,)]


def test_recording_only_a_captured_step_goes_straight_to_vllm_and_a_late_one_through_the_twins(
        attached_recording_only: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the checks off, a step that replays graphs vLLM captured (or runs eagerly) needs nothing
    of the twins: its pieces' calls go straight to vLLM's. A descriptor never captured still goes
    through them, and is recorded as an unexpected capture; graphs vLLM throws away are forgotten."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from capture_core.wrapper import CUDAGraphWrapper

    session, weight = attached_recording_only.session, attached_recording_only.model.proj.weight
    wrappers, x = pieces(), torch.ones(8, 4)
    forward(wrappers, x, weight, 4)
    session.capture_finished()
    served = collections.Counter()
    serve = CUDAGraphWrapper.serve

    def counted_serve(self, *args, **kwargs):
        served[self.name] += 1
        return serve(self, *args, **kwargs)

    monkeypatch.setattr(CUDAGraphWrapper, "serve", counted_serve)
    for _ in range(3):
        session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=4), 3, False)
        assert session.plain
        forward(wrappers, x, weight, 4)
    for _ in range(4):
        session.step(CUDAGraphMode.NONE, BatchDescriptor(num_tokens=20), 20, False)
        assert session.plain
    assert served == {} and attached_recording_only.calls["replay"] == 3 * PIECES
    session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=2), 2, False)
    assert not session.plain  # never captured: the twins see it
    forward(wrappers, x, weight, 2)
    assert sum(served.values()) == PIECES
    wrappers[0].clear_graphs()  # vLLM throws its graphs away: every step goes through the twins again
    session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=4), 3, False)
    assert not session.plain
    session.close()
    db = attached_recording_only.db
    assert rows(db, "SELECT kind FROM violations") == [("unexpected_capture",)]
    totals = "SELECT captured_size, replays FROM replay_totals WHERE mode = 'piecewise' ORDER BY 1"
    assert rows(db, totals) == [(2, 1), (4, 4)]
    assert rows(db, "SELECT reason, batches FROM eager_totals") == [("above_max_capture_size", 4)]


def test_the_host_cost_benchmark_records_every_step_and_no_violation(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "host_cost.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "vllm_host_cost.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "40", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "a piece call" in done.stdout
    result = json.loads(out.read_text())["results"]
    assert result["violations"] == 0
    assert result["recorded_replays"] == 4 + 40 * 3  # the capture phase's 4 sizes, the warm-up, 2 rounds
    assert len(result["rounds"]["on"]) == len(result["rounds"]["off"]) == 2


def test_paused_puts_vllm_methods_back_and_the_checks_resume_where_they_stopped(attached) -> None:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from inspector.engines.vllm import hooks

    session, model = attached.session, attached.model
    wrappers, x = pieces(), torch.ones(8, 4)
    forward(wrappers, x, model.proj.weight, 4)
    session.capture_finished()
    hooked = CUDAGraphWrapper.__call__
    assert hasattr(hooked, "__wrapped__")
    with hooks.paused():
        assert not hasattr(CUDAGraphWrapper.__call__, "__wrapped__")  # vLLM's own method, nothing between
        model.proj.weight = torch.nn.Parameter(model.proj.weight.detach().clone())  # a sync while paused
    assert CUDAGraphWrapper.__call__ is hooked
    session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=4), 4, False)
    forward(wrappers, x, model.proj.weight, 4)  # the first graph call after resuming
    session.close()
    violations = rows(attached.db, "SELECT kind, input_name FROM violations")
    assert set(violations) == {("address_drift", "proj.weight")}
    assert rows(attached.db, "SELECT replays FROM replay_totals") == [(1,)]


def test_debug_mode_checks_every_replay_silently_and_raises_at_the_faulty_step(
        attached_in_debug_mode: SimpleNamespace) -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from capture_core.errors import GraphCheckError

    attached = attached_in_debug_mode
    session, model, db = attached.session, attached.model, attached.db
    wrappers, x = pieces(), torch.randn(8, 4)
    for size in (2, 4, 8):
        forward(wrappers, x, model.proj.weight, size)
    session.capture_finished()
    for step in range(60):  # clean traffic: every replay inspected, every piece run again eagerly
        size = (2, 4, 8)[step % 3]
        session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=size), size - 1, False)
        out = forward(wrappers, x, model.proj.weight, size)
        assert torch.equal(out, x[:size] @ model.proj.weight @ model.proj.weight @ model.proj.weight)
    session.recorder.flush(timeout=10)
    assert rows(db, "SELECT kind FROM violations") == []
    assert rows(db, "SELECT SUM(replays) FROM replay_totals") == [(60,)]
    assert attached.calls["replay"] == 60 * PIECES
    assert [w.runnable.runs for w in wrappers] == [3 + 2 * 60] * PIECES  # each replay run again eagerly
    model.proj.weight = torch.nn.Parameter(model.proj.weight.detach().clone())  # a weight sync
    session.step(CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=4), 4, False)
    with pytest.raises(GraphCheckError, match=r"proj\.weight"):
        forward(wrappers, x, model.proj.weight, 4)  # raised at the first piece that reads it
    session.close()
    assert rows(db, "SELECT DISTINCT kind FROM violations") == [("address_drift",)]


class AllocatingPiece(Piece):
    """A piece whose second output it only allocates, as vLLM's piece before an attention op allocates
    the attention's output: what that holds differs from one run to the next (here: the run's number;
    not random numbers, which the canary draws again from the replay's generator state)."""

    def __init__(self, index: int, with_graph: bool) -> None:
        import torch.fx

        super().__init__(index)
        if with_graph:  # vLLM's PiecewiseBackend keeps the piece's FX graph as .graph
            graph = torch.fx.Graph()
            x, weight = graph.placeholder("x"), graph.placeholder("weight")
            buffer = graph.call_function(torch.empty, (8, 4))
            computed = graph.call_function(torch.matmul, (x, weight))
            graph.output((computed, graph.call_method("view", (buffer, -1, 4))))
            self.graph = SimpleNamespace(graph=graph)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        computed = super().__call__(x, weight)
        return computed, torch.full((x.shape[0], 4), float(self.runs))


@pytest.mark.parametrize("with_graph", [True, False])
def test_the_canary_leaves_out_what_a_piece_only_allocates(attached_in_debug_mode: SimpleNamespace,
                                                           with_graph: bool) -> None:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context

    from capture_core.errors import ReplayMismatchError

    session, weight = attached_in_debug_mode.session, attached_in_debug_mode.model.proj.weight
    wrapper = object.__new__(CUDAGraphWrapper)
    wrapper.__dict__.update(runnable=AllocatingPiece(0, with_graph), runtime_mode=CUDAGraphMode.PIECEWISE,
                            graph_pool=None, concrete_cudagraph_entries={})
    x = torch.randn(8, 4)

    def step() -> None:
        context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                                 cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                                 batch_descriptor=BatchDescriptor(num_tokens=4))
        with override_forward_context(context):
            wrapper(x[:4], weight)

    step()
    session.capture_finished()
    if not with_graph:  # the allocated output compared: its garbage differs, a false alarm
        with pytest.raises(ReplayMismatchError, match=r"output\[1\]"):
            step()
        return
    for _ in range(30):
        step()
    session.close()
    assert rows(attached_in_debug_mode.db, "SELECT kind FROM violations") == []
    assert wrapper.runnable.runs == 1 + 2 * 30  # the capture, then every replay and its eager run


@pytest.fixture(params=["always_on", "off"])
def attached_v2(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stand-in V2 runner (``bench.vllm_host_cost.v2_runner``: vLLM's own ``ModelCudaGraphManager``
    and parameter class), its FULL graphs handed over as its manager's capture hands them."""
    from bench.vllm_host_cost import v2_runner
    from inspector.engines.vllm import ENV, hooks, register
    from inspector.engines.vllm.session import CHECKS_ENV

    db = tmp_path / "v2.db"
    monkeypatch.setenv(ENV, f"sqlite:///{db}")
    monkeypatch.setenv(CHECKS_ENV, request.param)
    register()
    session = hooks.session()
    runner, manager, executions = v2_runner(layers=2, width=8)
    session.attach(runner, "V2")
    for execution in executions.values():
        session.adopt_full(manager, execution, hooks._full_inputs(runner), 0.001, 0)
    session.capture_finished()
    yield SimpleNamespace(session=session, db=db, runner=runner, manager=manager, checks=request.param)
    hooks.uninstall()


def v2_step(attached_v2: SimpleNamespace, size: int, tokens: int, need_eager: bool = False) -> None:
    """One V2 step as its ``execute_model`` makes it: vLLM's dispatch, then its FULL replay."""
    from vllm.v1.worker.gpu import model_runner

    execution, _ = model_runner.dispatch_cg_and_sync_dp(attached_v2.manager, tokens, tokens, 1, 1, 0,
                                                        need_eager=need_eager)
    if execution.num_tokens != size and not need_eager:  # the stand-in dispatch pads by size
        raise AssertionError(f"dispatched {execution.num_tokens}, expected {size}")
    if not need_eager:
        attached_v2.manager.run_fullgraph(execution)


def test_v2_steps_are_recorded_from_vllms_dispatch_and_a_weight_swap_is_caught_at_its_step(attached_v2):
    session, runner = attached_v2.session, attached_v2.runner
    for _ in range(3):
        v2_step(attached_v2, 8, 7)  # padded to 8: the second and third are counted by the hook alone
        v2_step(attached_v2, 16, 16)
    assert sorted(key[1] for key in session.v2_steps) == [7, 16]  # each decision kept, once
    for _ in range(3):  # a new descriptor object every eager step: counted by its figures, once worked out
        v2_step(attached_v2, 16, 16, need_eager=True)
        assert session.plain and session.last_v2_step is None
    weight = runner.model.layers[1].down.weight
    weight.data = torch.ones_like(weight)  # a weight sync that swaps the parameter's memory
    v2_step(attached_v2, 8, 8)
    runner.input_buffers.positions = torch.zeros_like(runner.input_buffers.positions)  # replaced, not written
    v2_step(attached_v2, 16, 16)
    session.close()
    replays = rows(attached_v2.db, "SELECT captured_size, SUM(replays), SUM(num_real_tokens) "
                                   "FROM replay_totals GROUP BY captured_size")
    assert replays == [(8, 4, 3 * 7 + 8), (16, 4, 4 * 16)]
    eager = rows(attached_v2.db, "SELECT reason, SUM(batches) FROM eager_totals GROUP BY reason")
    assert eager == [("engine_forced", 3)]
    found = rows(attached_v2.db, "SELECT kind, input_name, captured_size FROM violations ORDER BY id")
    if attached_v2.checks == "off":
        assert found == []  # recording only: vLLM's own replay, nothing checked
    else:
        assert ("address_drift", "self.layers.1.down.weight", 8) in found
        assert ("address_drift", "positions", 16) in found


def test_checks_switched_on_between_steps_apply_to_decisions_seen_while_they_were_off(attached_v2) -> None:
    """A decision seen while the checks were off (its graph calls then went straight to vLLM) is
    checked once they are on again (as ``bench/vllm_serve.py``'s levels switch them between steps)."""
    from capture_core.checks import AddressCheckMode

    session, runner = attached_v2.session, attached_v2.runner
    runtime = session.runtime
    runtime.address_check = AddressCheckMode.OFF
    for _ in range(3):
        v2_step(attached_v2, 8, 7)
        assert session.plain
    runtime.address_check = AddressCheckMode.ALWAYS_ON
    v2_step(attached_v2, 8, 7)
    assert not session.plain
    runner.input_buffers.positions = torch.zeros_like(runner.input_buffers.positions)  # replaced, not written
    v2_step(attached_v2, 8, 7)
    session.close()
    found = rows(attached_v2.db, "SELECT kind, input_name, captured_size FROM violations")
    assert found == [("address_drift", "positions", 8)]


class CountedReplay:
    """A FULL graph that counts its replays (whose graph was replayed is what is under test)."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_a_speculators_full_graphs_are_replayed_by_vllm_untouched(attached_v2) -> None:
    """A speculator's own ``CudaGraphManager`` (EAGLE's decode drafts) replays its FULL graphs through
    the same ``run_fullgraph`` the hook replaces, for descriptors equal to the model's: each replay is
    its own graph's, never the model's, and none is checked or taken for a late capture."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
    from vllm.v1.worker.gpu.spec_decode.autoregressive.cudagraph_utils import DecodeSpeculatorCudaGraphManager

    manager = attached_v2.manager
    model_graphs = {execution: CountedReplay() for execution in manager.graphs}
    manager.graphs = model_graphs
    drafts = object.__new__(DecodeSpeculatorCudaGraphManager)
    draft_execution = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8,
                                               uniform_token_count=1)
    drafts.graphs = {draft_execution: CountedReplay()}
    steps = 3
    for _ in range(steps):
        v2_step(attached_v2, 8, 8)  # the model's replay, then the speculator's, as execute_model runs them
        drafts.run_fullgraph(draft_execution)
    attached_v2.session.close()
    assert drafts.graphs[draft_execution].replays == steps
    assert [graph.replays for graph in model_graphs.values() if graph.replays] == [steps]
    assert rows(attached_v2.db, "SELECT kind FROM violations") == []


def test_with_nothing_recorded_the_hooks_pass_every_step_on(attached_v2) -> None:
    """``bench/vllm_serve.py``'s ``hooks`` level: the hooks in place with no runtime and no recorder;
    replays and eager steps, seen before or not, go straight on to vLLM."""
    session = attached_v2.session
    v2_step(attached_v2, 8, 7)
    recorder, runtime = session.recorder, session.runtime
    session.recorder = session.runtime = None
    for tokens in (7, 5):
        v2_step(attached_v2, 8, tokens)
    for tokens in (16, 12):
        v2_step(attached_v2, 16, tokens, need_eager=True)
        assert session.plain
    session.recorder, session.runtime = recorder, runtime
    session.close()
    assert rows(attached_v2.db, "SELECT kind FROM violations") == []


def test_the_integration_clock_times_every_hook_less_vllms_own_work_per_step(attached_v2) -> None:
    """``bench/vllm_clock.py`` inside vLLM's own V2 dispatch and FULL replay: every step counted once
    (those the dispatch hook counts alone too), the integration's time split as it is spent, the levels
    kept apart (paused: nothing timed), and every method put back as it was."""
    from vllm.v1.worker.gpu import model_runner

    from bench.vllm_clock import IntegrationClock
    from inspector.engines.vllm import hooks

    session, manager = attached_v2.session, attached_v2.manager
    v2_step(attached_v2, 8, 8)
    installed = (model_runner.dispatch_cg_and_sync_dp, type(manager).run_fullgraph)
    own_call = session.vllm_call
    clock = IntegrationClock(session)
    try:
        for _ in range(10):
            v2_step(attached_v2, 8, 7)
            v2_step(attached_v2, 16, 16)
        clock.level = "off"
        with hooks.paused():
            for _ in range(5):
                v2_step(attached_v2, 8, 7)
        clock.level = "on"
        v2_step(attached_v2, 16, 16, need_eager=True)
    finally:
        clock.close()
    result = clock.result()
    got = result["on"]
    assert set(result) == {"on", "probes", "guards"}, "paused, the hooks are vLLM's own: nothing timed"
    assert got["steps"] == 21 and got["new_decision_records"] == 2 and got["eager_steps"] == 1
    parts = got["hooks_us_per_step"]
    assert set(parts) == {"dispatch_cg_and_sync_dp", "run_fullgraph"}
    assert got["integration_us_per_step"] == pytest.approx(sum(parts.values()), abs=0.02)
    assert all(value > 0 for value in parts.values())
    if attached_v2.checks == "off":  # recording only: the replay goes straight on to vLLM's
        assert got["serve_us_per_step"] == got["guard_us_per_step"] == 0
    else:
        assert 0 < got["guard_us_per_step"] < parts["run_fullgraph"]
        # every replay's guard in the hook; serve only for the new graph's first (sampled) replay
        assert got["serve_calls_per_step"] == pytest.approx(1 / 21, abs=1e-3)
        assert got["guard_calls_per_step"] == pytest.approx(21 / 21, abs=1e-3)
        alone = result["guards"][session.full_twin.name]
        assert alone["passed"] is True and alone["us"] > 0 and "def clean" in alone["source"]
        weights = list(attached_v2.runner.model.parameters())
        assert result["probes"]["inside a step"]["weights"] == len(weights)
        assert all(entry.guard is entry.checks.clean for entry in session.full_twin.graphs.values())
    assert (model_runner.dispatch_cg_and_sync_dp, type(manager).run_fullgraph) == installed
    assert "step" not in session.__dict__ and session.vllm_call is own_call
    v2_step(attached_v2, 8, 7)  # the hooks work on as before, untimed
    assert clock.result()["on"]["steps"] == 21
