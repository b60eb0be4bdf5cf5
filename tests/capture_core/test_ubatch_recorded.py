"""End to end: ubatch graphs reach the inspector's database with their ubatch count and slices."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from capture_core.descriptor import BatchDescriptor
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.reference import ModelConfig, ReferenceDecoder
from capture_core.reference.overlap import CommOverlapDecoder
from capture_core.runtime import GraphRuntime
from capture_core.ubatch.slices import maybe_create_ubatch_slices
from capture_core.ubatch.wrapper import UBatchWrapper
from inspector.recording.recorder import Recorder
from inspector.storage.models import EagerTotal, Graph


def test_ubatch_graph_and_its_eager_fallback_are_recorded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ubatch.db'}"
    recorder = Recorder(url, label="ubatch test").start()
    model = ReferenceDecoder(ModelConfig.tiny(max_seq_len=32, max_num_seqs=16), seed=1)
    runtime = GraphRuntime("eager", observer=recorder, progress=False, warmup_iters=0)
    wrapper = UBatchWrapper(CommOverlapDecoder(model), runtime, handover_timeout=20)
    ids, positions, slots = torch.arange(8) + 3, torch.arange(8), torch.arange(8)
    kv_cache = model.new_kv_cache()
    _, slices = maybe_create_ubatch_slices(True, [1] * 8, 8, 8, 2)
    descriptor = BatchDescriptor(8, 8, True)
    try:
        with runtime.capture_phase():
            with set_forward_context(CUDAGraphMode.FULL, descriptor, 8, ubatch_slices=slices):
                wrapper(ids, positions, slots, kv_cache)
            with set_forward_context(CUDAGraphMode.FULL, descriptor, 7):  # micro-batching called off
                wrapper(ids, positions, slots, kv_cache)
        assert recorder.flush(timeout=20)
    finally:
        recorder.close()

    with Session(create_engine(url)) as session:
        [graph] = session.scalars(select(Graph)).all()
        assert (graph.captured_size, graph.mode, graph.num_ubatches) == (8, "full", 2)
        assert json.loads(graph.ubatch_slices) == [[0, 4, 0, 4], [4, 8, 4, 8]]
        assert json.loads(graph.input_names) == ["input_ids", "positions", "slot_ids", "kv_cache"]
        [eager] = session.scalars(select(EagerTotal)).all()
        assert (eager.reason, eager.batches) == ("ubatch_graph_only", 1)
