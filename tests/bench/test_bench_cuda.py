"""The benchmarks' CUDA-only machinery on a real GPU: the bare limit and the torch.compile watch.

If the bare loop computed something else, every ratio to it would be void; if the watch missed
cudagraph trees' captures, the decode benchmark would report that torch.compile never graphs.
Skipped without CUDA (run them on the H200: ``python3 -m pytest tests/bench -m cuda``).
"""

from __future__ import annotations

import pytest
import torch

from bench.bare_graphs import BareGraphLoop
from bench.gpu_decode import decode_inputs, watch_graph_trees
from capture_core.backends import pool_reserved_bytes
from capture_core.reference import ModelConfig, ReferenceDecoder

pytestmark = pytest.mark.cuda


def test_bare_graph_loop_replays_what_eager_computes() -> None:
    config = ModelConfig.tiny(dtype=torch.bfloat16, device="cuda")
    model = ReferenceDecoder(config)
    graphs_cache, eager_cache = model.new_kv_cache(), model.new_kv_cache()
    loop = BareGraphLoop(model, graphs_cache, [1, 2, 4], padding_slot=config.padding_slot)
    assert list(loop.graphs) == [4, 2, 1]  # captured largest first
    assert len({tuple(p) for p in loop.pools.values()}) == 1  # one shared pool
    assert pool_reserved_bytes(loop.pools[4]) > 0
    for batch in (1, 2, 4):
        inputs = decode_inputs(batch, config, torch.device("cuda"))
        replayed = loop.step(*inputs)
        with torch.no_grad():
            expected = model(*inputs, eager_cache)
        assert replayed.shape == expected.shape
        torch.testing.assert_close(replayed, expected, rtol=0.02, atol=0.05)
        # The step hands back its own tensor: the next replay does not overwrite it.
        kept = replayed.clone()
        loop.step(*inputs)
        assert torch.equal(replayed, kept)


def test_separate_pools_hold_more_than_one_shared_pool() -> None:
    config = ModelConfig.tiny(dtype=torch.bfloat16, device="cuda")
    model = ReferenceDecoder(config)
    cache = model.new_kv_cache()
    shared = BareGraphLoop(model, cache, [1, 64, 256], padding_slot=config.padding_slot)
    separate = BareGraphLoop(model, cache, [1, 64, 256], padding_slot=config.padding_slot, shared_pool=False)
    shared_bytes = pool_reserved_bytes(shared.pools[256])
    separate_bytes = sum(pool_reserved_bytes(p) for p in separate.pools.values())
    assert len(set(separate.pools.values())) == 3
    assert separate_bytes > shared_bytes > 0


def test_watch_counts_cudagraph_tree_captures_of_a_graphable_function() -> None:
    def double_plus_one(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    compiled = torch.compile(double_plus_one, mode="reduce-overhead")
    x = torch.ones(16, device="cuda")
    with watch_graph_trees() as watch:
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).clone()
    torch.testing.assert_close(out, x * 2 + 1)
    assert watch.captures >= 1
    assert watch.skips == 0


def test_watch_reports_the_skip_of_a_function_that_mutates_its_input() -> None:
    def bump_and_double(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    compiled = torch.compile(bump_and_double, mode="reduce-overhead")
    x = torch.zeros(16, device="cuda")
    with watch_graph_trees() as watch:
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            compiled(x).clone()
    assert watch.skips >= 1
    assert watch.captures == 0
    assert any("mutated" in reason for reason in watch.reasons), watch.reasons
