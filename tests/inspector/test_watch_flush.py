"""The watch's flusher writes through the one write path: each watched graph's replays land under
the graph's own mode, linked to its graph row, in the same windows and running totals the Recorder
keeps."""

from __future__ import annotations

import time

from sqlalchemy import Engine, event, select
from workers import fetch_rows

from capture_core.events import CaptureEvent
from capture_core.modes import CUDAGraphMode
from inspector.recording.recorder import Recorder
from inspector.storage.models import Graph, ReplayTotal, ReplayWindow
from inspector.watch.flush import WatchFlusher
from inspector.watch.identity import CallSite, CapturedInputs, GraphIdentity
from inspector.watch.watcher import WatchedGraph


def _watched(line: int, shape: tuple[int, ...], mode: CUDAGraphMode) -> WatchedGraph:
    identity = GraphIdentity(CallSite("engine.py", line, "step"), (shape,))
    return WatchedGraph(identity=identity, descriptor=identity.descriptor(), inputs=CapturedInputs(),
                        pool=None, pool_bytes=0, capture_seconds=0.01, captured_at=time.time(),
                        unexpected=False, repeat=0, mode=mode)


def _captured(graph: WatchedGraph) -> CaptureEvent:
    return CaptureEvent(descriptor=graph.descriptor, mode=graph.mode, backend="cuda",
                        wrapper=graph.identity.site.text, input_names=(), input_addresses=(),
                        capture_seconds=graph.capture_seconds, pool_bytes=0, warmup_iters=0)


def test_replays_land_under_each_graphs_own_mode_and_graph_row(db_url: str) -> None:
    plain = _watched(10, (8, 4), CUDAGraphMode.FULL)
    trees = _watched(20, (16, 4), CUDAGraphMode.PIECEWISE)
    recorder = Recorder(db_url, flush_interval=60).start()
    flusher = WatchFlusher(recorder, [plain, trees], interval=60)
    try:
        for graph in (plain, trees):
            flusher.add_record(_captured(graph))  # handed to the Recorder before the windows link to them
        plain.replays, trees.replays = 5, 3
        assert flusher.flush_once()
        plain.replays, trees.replays = 7, 4
        assert flusher.flush_once()
    finally:
        flusher.close()
        recorder.close()

    graphs = dict(fetch_rows(db_url, select(Graph.mode, Graph.id)))
    assert set(graphs) == {"full", "piecewise"}
    windows = fetch_rows(db_url, select(ReplayWindow.mode, ReplayWindow.graph_id, ReplayWindow.replays)
                         .order_by(ReplayWindow.id))
    assert windows == [("full", graphs["full"], 5), ("piecewise", graphs["piecewise"], 3),
                       ("full", graphs["full"], 2), ("piecewise", graphs["piecewise"], 1)]
    totals = fetch_rows(db_url, select(ReplayTotal.mode, ReplayTotal.graph_id, ReplayTotal.replays,
                                       ReplayTotal.num_real_tokens, ReplayTotal.padding_tokens)
                        .order_by(ReplayTotal.mode))
    assert totals == [("full", graphs["full"], 7, 7 * 8, 0), ("piecewise", graphs["piecewise"], 4, 4 * 16, 0)]


def test_an_interval_with_nothing_new_writes_nothing_and_records_cost_one_recorder_write(db_url: str) -> None:
    """The flusher runs every interval for as long as the program does: idle, it opens no
    transaction; new replays are one (its own); captures handed over add the Recorder's one."""
    graph = _watched(10, (8, 4), CUDAGraphMode.FULL)
    recorder = Recorder(db_url, flush_interval=60).start()
    flusher = WatchFlusher(recorder, [graph], interval=60)
    begun: list[object] = []

    def count(conn: object) -> None:
        begun.append(conn)

    flusher.add_record(_captured(graph))
    graph.replays = 3
    assert flusher.flush_once()  # the first write also opens the flusher's store
    event.listen(Engine, "begin", count)
    try:
        assert flusher.flush_once() and len(begun) == 0  # idle
        graph.replays = 4
        assert flusher.flush_once() and len(begun) == 1  # the window alone
        second = _watched(20, (4, 4), CUDAGraphMode.FULL)
        flusher.graphs = [graph, second]
        flusher.add_record(_captured(second))
        second.replays = 1
        assert flusher.flush_once() and len(begun) == 3  # the Recorder's graph row, then the window
    finally:
        event.remove(Engine, "begin", count)
        flusher.close()
        recorder.close()
    assert sorted(fetch_rows(db_url, select(ReplayTotal.replays))) == [(1,), (4,)]
