"""The watch on real CUDA graphs: torch.cuda.graph, make_graphed_callables, torch.compile's trees.

Skipped without a GPU (see tests/conftest.py). Run on the H200 with:
    python3 -m pytest tests/inspector/test_watch_cuda.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import select
from test_watch_hooks import Collector

from inspector import watch
from inspector.storage.models import CompileRecord, Graph, ReplayTotal, Violation
from inspector.storage.store import open_store
from inspector.watch.compile_log import SKIP_LOGGER
from inspector.watch.watcher import CompileEventKind

pytestmark = pytest.mark.cuda


@pytest.fixture
def collector() -> Iterator[Collector]:
    sink = Collector()
    yield sink
    watch.uninstall()


def warm_up(fn: object, *args: torch.Tensor) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(side)


def test_torch_cuda_graph_is_watched_with_pool_memory_and_replays(collector: Collector) -> None:
    model = torch.nn.Linear(256, 256).cuda()
    static = torch.randn(64, 256, device="cuda")
    warm_up(model, static)
    watcher = watch.install(collector)
    graphs, outputs = [], []
    pool = None
    for rows in (64, 16):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs.append(model(static[:rows]))
        pool = graph.pool()
        graphs.append(graph)
    static.copy_(torch.randn(64, 256, device="cuda"))
    graphs[0].replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outputs[0], model(static))
    big, small = collector.captures
    assert "test_watch_cuda.py:" in big.wrapper and "in test_torch_cuda_graph_is_watched" in big.wrapper
    assert (big.descriptor.num_tokens, small.descriptor.num_tokens) == (64, 16)
    assert big.pool_bytes > 0  # the first graph's private pool got segments
    assert watcher.graphs[0].pool == watcher.graphs[1].pool  # the second graph shares it
    assert [g.replays for g in watcher.graphs] == [1, 0]
    watch.uninstall()
    graphs[0].replay()  # the original replay again, nothing counted
    assert watcher.graphs[0].replays == 1


def test_make_graphed_callables_labels_each_capture_of_the_call(collector: Collector) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()).cuda()
    sample = torch.randn(8, 32, device="cuda", requires_grad=True)
    watch.install(collector)
    graphed = torch.cuda.make_graphed_callables(module, (sample,))
    graphed(torch.randn(8, 32, device="cuda", requires_grad=True)).sum().backward()
    keys = [c.descriptor.key for c in collector.captures]
    assert len(keys) == 2 and len(set(keys)) == 2  # forward and backward graphs, told apart
    assert all("graphed capture" in key for key in keys)
    assert all("in test_make_graphed_callables" in c.wrapper for c in collector.captures)
    assert all(c.wrapper.endswith("via torch.cuda.make_graphed_callables") for c in collector.captures)
    assert not collector.violations  # two captures of one call are not a re-record


def test_torch_compile_trees_are_watched_and_a_mutated_input_skip_is_recorded(tmp_path: Path) -> None:
    torch._dynamo.reset()
    db = f"sqlite:///{tmp_path / 'compile.db'}"
    watch.install(db, label="compile")
    try:

        def step(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ x.T)

        def mutating_step(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            cache.add_(1)
            return x * cache

        compiled = torch.compile(step, mode="reduce-overhead")
        x = torch.randn(32, 32, device="cuda")
        for _ in range(6):
            compiled(x)
        compiled_mutating = torch.compile(mutating_step, mode="reduce-overhead")
        cache = torch.zeros(32, 32, device="cuda")
        for _ in range(3):
            compiled_mutating(x, cache)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
        torch._dynamo.reset()
    store = open_store(db, upgrade=False)
    with store.session() as session:
        graphs = [g for g in session.scalars(select(Graph)) if "pool keep-alive" not in g.descriptor_key]
        assert graphs and all(g.wrapper.endswith("step via torch.compile") for g in graphs)
        assert all("test_watch_cuda.py:" in g.wrapper for g in graphs)  # where step is defined
        assert any(g.descriptor_key.startswith(("test_torch_compile", "step")) for g in graphs)
        assert sum(g.pool_bytes for g in graphs) > 0  # the trees' warm-up and capture in their pool
        replays = sum(t.replays for t in session.scalars(select(ReplayTotal)))
        assert replays >= 3  # warm-up, record, then replays
        skips = [e for e in session.scalars(select(CompileRecord)) if e.kind == CompileEventKind.SKIP.value]
        assert any("mutated inputs" in e.reason for e in skips)
        kinds = {v.kind for v in session.scalars(select(Violation))}
        assert "compile_skip" in kinds
    store.dispose()
    assert logging.getLogger(SKIP_LOGGER).filters == []
