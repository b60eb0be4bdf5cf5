"""A piecewise graph as the inspector records it: one graph row with its segments, and its replays."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from capture_core.mixed_runner import MixedBatchRunner
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder, flatten_requests
from capture_core.runtime import GraphRuntime
from inspector.recording.recorder import Recorder
from inspector.storage.models import Graph, ReplayWindow


def test_the_recorder_stores_piecewise_graphs_with_segments_and_counts_their_replays(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'inspector.db'}"
    config = ModelConfig.tiny(num_layers=3, max_num_seqs=8, max_seq_len=32)
    with Recorder(url, label="piecewise test", flush_interval=0.2) as recorder:
        runtime = GraphRuntime("eager", observer=recorder, progress=False, warmup_iters=1)
        runner = MixedBatchRunner(ReferenceDecoder(config), runtime, [4, 8], CUDAGraphMode.FULL_AND_PIECEWISE)
        runner.capture()
        mixed = flatten_requests([[1, 2, 3], [4], [5]], [0, 2, 6], [0, 1, 2])
        decode = flatten_requests([[7], [8]], [3, 1], [0, 1])
        for batch in (mixed, mixed, decode):
            runner.step(batch.input_ids, batch.positions, batch.slot_ids, batch.attn_metadata)
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        graphs = connection.execute(
            sa.select(Graph.mode, Graph.captured_size, Graph.num_reqs, Graph.num_segments, Graph.wrapper)
        ).all()
        replays = connection.execute(
            sa.select(ReplayWindow.mode, ReplayWindow.captured_size, sa.func.sum(ReplayWindow.replays))
            .group_by(ReplayWindow.mode, ReplayWindow.captured_size)
        ).all()
    engine.dispose()
    assert sorted(graphs) == sorted(
        [
            ("full", 8, 8, 1, "model.full"),
            ("full", 4, 4, 1, "model.full"),
            ("piecewise", 8, None, config.num_layers + 1, "model.piecewise"),
            ("piecewise", 4, None, config.num_layers + 1, "model.piecewise"),
        ]
    )
    # One replay per step, not one per segment: 2 mixed steps of 5 tokens (padded to 8), 1 decode.
    assert sorted(replays) == [("full", 4, 1), ("piecewise", 8, 2)]
