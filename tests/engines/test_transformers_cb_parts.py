"""The transformers integration's own parts, without transformers: which releases it reads and the
line that refuses the others, transformers' graph key mapped onto the inspector's, the ledger's
records and arithmetic, and the flusher writing its graphs' replays by real tokens (a real Recorder
into a real database)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.engines.transformers_cb.keys import CBKey
from inspector.engines.transformers_cb.ledger import Ledger
from inspector.engines.transformers_cb.version import SUPPORTED, refusal, release_line
from inspector.recording.recorder import Recorder
from inspector.storage.models import BatchSizeCount, Graph, ReplayTotal, ReplayWindow
from inspector.watch.flush import WatchFlusher
from inspector.watch.identity import CapturedInputs
from tests.inspector.workers import fetch_rows


@pytest.mark.parametrize("version", ["5.17.0", "5.17.3", "5.24.0", "5.24.0.dev0", "5.25.0"])
def test_the_release_lines_read_are_attached_to(version: str) -> None:
    assert refusal(version) is None


@pytest.mark.parametrize("version", ["5.16.2", "5.18.0", "5.23.1", "5.26.0", "6.0.0", "4.57.1", "main"])
def test_another_release_is_refused_in_one_line_naming_the_supported_ones_and_the_watch(version: str) -> None:
    line = refusal(version)
    assert line is not None and "\n" not in line
    assert f"transformers {version} is not a release" in line
    assert all(supported in line for supported in SUPPORTED)
    assert "graph-inspector watch" in line


def test_transformers_missing_is_refused_in_one_line() -> None:
    line = refusal(None)
    assert line is not None and "\n" not in line and "transformers is not installed" in line


@pytest.mark.parametrize(("version", "line"), [("5.17.0", "5.17"), ("05.024.1", "5.24"), ("5", None),
                                               ("x.17", None), ("", None)])
def test_release_line(version: str, line: str | None) -> None:
    assert release_line(version) == line


def test_a_varlen_key_names_transformers_tuple_and_maps_onto_the_descriptor() -> None:
    key = CBKey((256, 8192, 2048), decode=False, num_sequences=64)
    assert key.text == "varlen q=256 kv=8192 k=2048" and key.path == "varlen"
    descriptor = key.descriptor()
    assert (descriptor.captured_size, descriptor.num_reqs, descriptor.uniform) == (256, 64, False)
    assert descriptor.key == key.text


def test_a_hybrid_models_key_has_a_key_length_per_attention_type() -> None:
    key = CBKey((64, 4096, 1024, 2048), decode=False, num_sequences=64)
    assert key.text == "varlen q=64 kv=4096 k=1024/2048"


def test_a_decode_key_is_a_uniform_batch_and_async_pairs_and_later_runners_are_told_apart() -> None:
    key = CBKey((8,), decode=True, num_sequences=8, pair=1, runner=2)
    assert key.text == "decode q=8 io 1 runner 2" and key.engine_text == "(IO 1) (8,)"
    descriptor = key.descriptor()
    assert (descriptor.captured_size, descriptor.num_reqs, descriptor.uniform) == (8, 8, True)
    first = CBKey((8,), decode=True, num_sequences=8, pair=0).descriptor()
    assert first != descriptor and hash(first) != hash(descriptor)


@pytest.mark.parametrize(("key", "decode"), [((), False), ((0, 4096, 1024), False), ((8, 4096), True),
                                             ((8,), False), ((8, -1, 1024), False)])
def test_a_key_that_transformers_would_not_make_is_refused(key: tuple[int, ...], decode: bool) -> None:
    with pytest.raises(ValueError, match="key"):
        CBKey(key, decode=decode, num_sequences=1)


def test_a_late_capture_is_recorded_as_captured_after_start_up_with_its_cost_and_inputs() -> None:
    ledger = Ledger()
    inputs = CapturedInputs(("input_ids", "write_index[0]"), ((1, 64), (64,)), (4096, 8192))
    start_up, first = ledger.captured(CBKey((64, 4096, 1024), False, 16), seconds=0.5, pool_bytes=1 << 20,
                                      late=False, inputs=inputs)
    late, event = ledger.captured(CBKey((128, 4096, 1024), False, 16), seconds=0.25, pool_bytes=4096,
                                  late=True, inputs=inputs)
    assert (first.unexpected, event.unexpected) == (False, True)
    assert (event.capture_seconds, event.pool_bytes, event.warmup_iters) == (0.25, 4096, 1)
    assert (event.input_names, event.input_addresses) == (inputs.names, inputs.addresses)
    assert event.mode is CUDAGraphMode.FULL and event.backend == "cuda"
    assert event.wrapper == "transformers ModelRunner varlen path"
    assert (first.engine_key, event.engine_key) == ("(64, 4096, 1024)", "(128, 4096, 1024)")
    assert ledger.graph((1, None, (128, 4096, 1024))) is late
    summary = ledger.summary()
    assert (summary["graphs"], summary["start_up_graphs"], summary["late_captures"]) == (2, 1, 1)
    assert (summary["late_capture_seconds"], summary["pool_bytes"]) == (0.25, (1 << 20) + 4096)
    assert start_up.late is False


def test_a_graph_met_replaying_before_the_integration_attached_says_its_cost_was_not_seen() -> None:
    graph, event = Ledger().captured(CBKey((8,), True, 8), seconds=0.0, pool_bytes=0, late=False,
                                     inputs=CapturedInputs(), seen_capture=False)
    assert "captured before graph-inspector attached" in event.wrapper and event.warmup_iters == 0
    assert graph.wrapper == event.wrapper


def test_replays_by_real_tokens_give_real_and_padding_tokens() -> None:
    ledger = Ledger()
    graph, _ = ledger.captured(CBKey((64, 4096, 1024), False, 16), seconds=0.1, pool_bytes=0, late=True,
                               inputs=CapturedInputs())
    graph.replays_by_real_tokens.update({25: 3, 64: 1})
    ledger.count_eager(EagerReason.UNEXPECTED_CAPTURE, 40)
    assert (graph.replays, graph.num_real_tokens, graph.padding_tokens) == (4, 139, 4 * 64 - 139)
    summary = ledger.summary()
    assert summary["eager"] == {"unexpected_capture": {"batches": 1, "num_real_tokens": 40}}
    assert summary["by_graph"][0]["transformers_key"] == [64, 4096, 1024]


def test_the_flusher_writes_replays_by_real_tokens_as_real_and_padding_tokens(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'cb.db'}"
    ledger = Ledger()
    graphs = []
    recorder = Recorder(db_url, flush_interval=60).start()
    flusher = WatchFlusher(recorder, ledger.graphs, interval=60)
    try:
        for key in ((64, 4096, 1024), (64, 8192, 1024)):  # one captured size, two graphs
            graph, event = ledger.captured(CBKey(key, False, 16), seconds=0.1, pool_bytes=0, late=False,
                                           inputs=CapturedInputs())
            flusher.add_record(event)
            graphs.append(graph)
        graphs[0].replays_by_real_tokens.update({25: 2, 30: 1})
        graphs[1].replays_by_real_tokens.update({25: 1})
        assert flusher.flush_once()
        graphs[0].replays_by_real_tokens[25] += 1
        assert flusher.flush_once()
    finally:
        flusher.close()
        recorder.close()

    ids = dict(fetch_rows(db_url, select(Graph.descriptor_key, Graph.id)))
    assert set(ids) == {"varlen q=64 kv=4096 k=1024", "varlen q=64 kv=8192 k=1024"}
    totals = fetch_rows(db_url, select(ReplayTotal.graph_id, ReplayTotal.replays, ReplayTotal.num_real_tokens,
                                       ReplayTotal.padding_tokens).order_by(ReplayTotal.graph_id))
    assert totals == [(ids["varlen q=64 kv=4096 k=1024"], 4, 105, 4 * 64 - 105),
                      (ids["varlen q=64 kv=8192 k=1024"], 1, 25, 64 - 25)]
    windows = fetch_rows(db_url, select(ReplayWindow.replays).order_by(ReplayWindow.id))
    assert [w for (w,) in windows] == [3, 1, 1]
    sizes: dict[int, int] = {}
    for real, batches in fetch_rows(db_url, select(BatchSizeCount.num_real_tokens, BatchSizeCount.batches)):
        sizes[real] = sizes.get(real, 0) + batches
    assert sizes == {25: 4, 30: 1}
