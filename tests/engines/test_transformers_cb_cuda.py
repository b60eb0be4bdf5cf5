"""transformers' continuous batching with real CUDA graphs, attached to (the H200, transformers 5.17).

    python3 -m pytest -m cuda tests/engines/test_transformers_cb_cuda.py

The trace's first requests (``bench/gpu_transformers_cb.py``'s workload, tiny model and sizes)
served twice by one persistent manager, bare and then attached, in one process. What is checked is
read from transformers itself: the graphs in its own graph buffers, the tokens of the bare run, the
allocator's segments of its graph pool, and the real tokens every step must add up to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from tests.inspector.workers import fetch_rows

transformers = pytest.importorskip("transformers")

from bench.gpu_transformers_cb import (  # noqa: E402
    CB_CONFIGS,
    arrival_waves,
    build_model,
    cb_config,
    expected_real_tokens,
    generation_config,
    serve,
    trace_requests,
)
from inspector.engines.transformers_cb import attach, detach  # noqa: E402
from inspector.storage.models import EagerTotal, Graph, ReplayTotal, Run, Violation  # noqa: E402

pytestmark = pytest.mark.cuda
SIZE = "tiny"


@pytest.fixture(scope="module")
def model() -> object:
    return build_model(SIZE, torch.device("cuda"))


@pytest.fixture(scope="module")
def requests() -> list:
    return trace_requests(24, prompt_scale=32, output_scale=16, max_prompt=48, max_output=8, vocab=128)


@pytest.fixture
def detached() -> Iterator[None]:
    yield
    detach()


def test_graphs_by_transformers_key_late_captures_real_tokens_and_pool_with_the_bare_tokens(
    model: object, requests: list, tmp_path: Path, detached: None
) -> None:
    waves = arrival_waves(requests, 10.0)
    bare = serve(model, waves, SIZE)
    url = f"sqlite:///{tmp_path / 'cb.db'}"
    attachment = attach(url)
    assert attachment is not None
    attached = serve(model, waves, SIZE)
    run_id = attachment.run_id
    detach()

    assert [p.tokens for p in attached.passes] == [p.tokens for p in bare.passes]
    assert attachment.errors == 0 and not attachment.stopped
    graphs = attachment.ledger.graphs
    # one record per graph transformers holds, by its own key
    recorded = sorted(([g.key.pair, list(g.key.key)] for g in graphs), key=repr)
    assert recorded == attached.graph_keys and len(graphs) == len(attached.graph_keys)
    start_up = [g for g in graphs if not g.late]
    late = [g for g in graphs if g.late]
    largest = CB_CONFIGS[SIZE]["max_batch_tokens"]
    assert start_up and all(g.key.num_q_tokens == largest for g in start_up)  # warm-up: the largest batch
    assert late, "the trace met no padded shape beyond warm-up's: nothing captured lazily"
    assert all(g.capture_seconds > 0 for g in graphs)
    eager = attachment.ledger.eager
    assert set(eager) == {"unexpected_capture"} and eager["unexpected_capture"][0] == len(late)
    # every step: its real tokens within its graph's padded size, adding up to what the trace asked
    assert all(0 < real <= g.key.num_q_tokens for g in graphs for real in g.replays_by_real_tokens)
    real = sum(g.num_real_tokens for g in graphs) + eager["unexpected_capture"][1]
    assert real == expected_real_tokens(requests) * len(attached.passes)
    # the pool: what each capture added, summed, is what the allocator holds in transformers' pool
    assert attached.pool_reserved_bytes and sum(g.pool_bytes for g in graphs) == attached.pool_reserved_bytes

    rows = fetch_rows(url, select(Graph.descriptor_key, Graph.engine_key, Graph.captured_size,
                                  Graph.unexpected, Graph.capture_seconds, Graph.pool_bytes)
                      .where(Graph.run_id == run_id))
    assert sorted(rows) == sorted(
        (g.descriptor.key, repr(g.key.key), g.key.num_q_tokens, g.late, g.capture_seconds, g.pool_bytes)
        for g in graphs
    )
    totals = fetch_rows(url, select(ReplayTotal.descriptor_key, ReplayTotal.replays,
                                    ReplayTotal.num_real_tokens, ReplayTotal.padding_tokens)
                        .where(ReplayTotal.run_id == run_id))
    assert sorted(totals) == sorted((g.descriptor.key, g.replays, g.num_real_tokens, g.padding_tokens)
                                    for g in graphs if g.replays)
    assert fetch_rows(url, select(EagerTotal.reason, EagerTotal.batches).where(EagerTotal.run_id == run_id)) \
        == [("unexpected_capture", len(late))]
    assert fetch_rows(url, select(Violation.id)) == []
    ((config,),) = fetch_rows(url, select(Run.config).where(Run.id == run_id))
    config = json.loads(config)
    assert config["use_cuda_graph"] == [True, True] and config["transformers"] == transformers.__version__
    assert config["q_padding_interval_size"] == CB_CONFIGS[SIZE]["q_padding_interval_size"]


def test_generate_batch_with_cuda_graphs_is_recorded_as_users_call_it(
    model: object, requests: list, tmp_path: Path, detached: None
) -> None:
    """Twice, as a program calls it: each call makes a new manager (a new runner, pool and graphs),
    whose graphs are told apart from the first's."""
    prompts = [list(r.prompt) for r in requests]
    attachment = attach(f"sqlite:///{tmp_path / 'cb.db'}")
    assert attachment is not None
    for _ in range(2):
        out = model.generate_batch(prompts, generation_config=generation_config(),
                                   continuous_batching_config=cb_config(SIZE), max_new_tokens=4)
        assert len(out) == len(prompts) and all(len(o.generated_tokens) == 4 for o in out.values())
    detach()
    graphs = attachment.ledger.graphs
    assert {g.key.runner for g in graphs} == {1, 2}
    keys = [g.descriptor.key for g in graphs]
    assert len(set(keys)) == len(keys) and all(key.endswith(" runner 2") for key in keys if "runner" in key)
    for runner in (1, 2):
        mine = [g for g in graphs if g.key.runner == runner]
        assert any(not g.late for g in mine) and sum(g.replays for g in mine) > 0
    captured_late = attachment.ledger.eager.get("unexpected_capture", [0, 0])
    assert captured_late[0] == sum(g.late for g in graphs)
    # however generate_batch batched them: every prompt token and every fed-back answer token once
    assert sum(g.num_real_tokens for g in graphs) + captured_late[1] == 2 * sum(len(p) + 3 for p in prompts)
