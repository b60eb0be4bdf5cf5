"""A watched process end to end into a real SQLite file: graphs, replays, violations, compile skips."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select
from test_watch_standin import eager_cuda_graphs
from workers import fetch_rows

from inspector import watch
from inspector.storage.models import CompileRecord, Graph, ReplayTotal, ReplayWindow, Run, Violation
from inspector.storage.store import open_store
from inspector.watch.compile_log import SKIP_LOGGER
from inspector.watch.summary import watch_summary

MODEL = torch.nn.Linear(4, 4)


def capture(x: torch.Tensor) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    MODEL(x)
    graph.capture_end()
    return graph


@pytest.fixture
def db(db_url: str) -> Iterator[str]:
    """A real SQLite file, and a real PostgreSQL database (see conftest.py)."""
    with eager_cuda_graphs():
        yield db_url
        watch.uninstall()


def test_a_watched_process_lands_in_the_database(db: str) -> None:
    watch.install(db, label="decode-loop", storm_threshold=1)
    graphs = {n: capture(torch.zeros(n, 4)) for n in (8, 4, 2)}
    for _ in range(5):
        graphs[8].replay()
    graphs[4].replay()
    watch.mark_ready()
    capture(torch.zeros(3, 4))  # unexpected, and a capture at a site in use: a storm at threshold 1
    logging.getLogger(SKIP_LOGGER).warning("skipping cudagraphs due to mutated inputs (2 instances)")
    logging.getLogger(SKIP_LOGGER).warning("skipping cudagraphs due to mutated inputs (2 instances)")
    watch.uninstall()

    store = open_store(db, upgrade=False)
    with store.session() as session:
        (run,) = session.scalars(select(Run))
        assert (run.label, run.backend, run.ended_at is not None) == ("decode-loop", "cuda", True)
        rows = list(session.scalars(select(Graph).order_by(Graph.id)))
        assert [g.captured_size for g in rows] == [8, 4, 2, 3]
        assert [g.unexpected for g in rows] == [False, False, False, True]
        assert all(g.mode == "full" and "test_watch_record.py:" in g.wrapper for g in rows)
        assert all(g.descriptor_key.startswith("test_watch_record.py:") for g in rows)
        assert len({g.descriptor_key for g in rows}) == 4
        replays = dict(
            session.execute(
                select(ReplayWindow.descriptor_key, func.sum(ReplayWindow.replays)).group_by(
                    ReplayWindow.descriptor_key
                )
            ).all()
        )
        assert replays == {rows[0].descriptor_key: 5, rows[1].descriptor_key: 1}
        kinds = {v.kind: v for v in session.scalars(select(Violation))}
        assert set(kinds) == {"unexpected_capture", "rerecord_storm", "compile_skip"}
        assert kinds["compile_skip"].count == 2  # one finding, seen twice
        assert kinds["unexpected_capture"].descriptor_key == rows[3].descriptor_key
        assert "capture(torch.zeros(3, 4))" in kinds["unexpected_capture"].stack
        (skip,) = session.scalars(select(CompileRecord))
        assert (skip.kind, skip.reason, skip.count) == ("compile_skip", "mutated inputs (2 instances)", 2)

    summary = watch_summary(store, label="decode-loop")
    assert [g.replays for g in summary.graphs] == [5, 1, 0, 0]
    assert [g.captured_size for g in summary.never_replayed] == [2, 3]
    assert summary.violations == {"unexpected_capture": 1, "rerecord_storm": 1, "compile_skip": 2}
    text = summary.render()
    assert "4 graph(s), 6 replay(s)" in text and "never replayed: 2 graph(s)" in text
    assert "torch.compile skip x2: mutated inputs (2 instances)" in text
    store.dispose()


def test_a_process_that_never_captures_leaves_no_run(tmp_path: Path) -> None:
    with eager_cuda_graphs():
        watch.install(f"sqlite:///{tmp_path / 'watch.db'}")
        MODEL(torch.zeros(2, 4))
        watch.uninstall()
    assert not (tmp_path / "watch.db").exists()


def test_records_wait_for_the_next_write_however_many_captures_arrive(db: str) -> None:
    """transformers' static cache makes torch.compile re-record on every generate(): a write woken
    per capture (its graph row, its storm, its re-record) would be database work taking the GIL
    from the decode loop several times a second. The watch hands everything over once per interval
    (here the Recorder's 60 s), so nothing is written before it, or before uninstall."""
    from inspector.recording.recorder import Recorder

    recorder = Recorder(db, label="one write per interval", flush_interval=60).start()
    watch.install(recorder, storm_threshold=1)
    for _ in range(4):
        capture(torch.zeros(8, 4)).replay()  # the same site again once in use: a storm each time
    logging.getLogger(SKIP_LOGGER).warning("skipping cudagraphs due to mutated inputs (1 instances)")
    time.sleep(0.5)  # a woken writer would have written by now

    def counts() -> tuple[int, ...]:
        tables = (Graph, Violation, CompileRecord, ReplayWindow)
        run = recorder.run_id
        return tuple(fetch_rows(db, select(func.count()).where(t.run_id == run))[0][0] for t in tables)

    assert counts() == (0, 0, 0, 0)
    watch.uninstall()
    assert counts() == (4, 2, 1, 4)  # the storm finding (seen 3 times), the skip; a row per graph
    spans = fetch_rows(db, select(ReplayWindow.window_start, ReplayWindow.window_end).distinct())
    assert len(spans) == 1  # in one window
    recorder.close()


def capture_elsewhere(x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A second engine component capturing graphs of the same sizes."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    MODEL(x)
    graph.capture_end()
    return graph


def test_same_sized_graphs_of_two_call_sites_keep_their_own_replays_in_a_recorder_you_own(db: str) -> None:
    from inspector.recording.recorder import Recorder

    recorder = Recorder(db, label="own recorder", flush_interval=0.2).start()
    watch.install(recorder)
    first, second = capture(torch.zeros(8, 4)), capture_elsewhere(torch.zeros(8, 4))
    for _ in range(3):
        first.replay()
    second.replay()
    watch.uninstall()
    assert recorder.flush(timeout=10)  # the recorder you own is left running
    store = open_store(db, upgrade=False)
    with store.session() as session:
        totals = {
            t.descriptor_key: (t.replays, t.graph_id)
            for t in session.scalars(select(ReplayTotal).where(ReplayTotal.run_id == recorder.run_id))
        }
        graphs = {g.descriptor_key: g.id for g in session.scalars(select(Graph))}
    assert sorted(replays for replays, _ in totals.values()) == [1, 3]
    assert {key: graph_id for key, (_, graph_id) in totals.items()} == graphs
    recorder.close()
    store.dispose()


def test_a_watch_installed_again_on_a_recorder_you_own_adds_to_the_same_totals(db: str) -> None:
    """Each installation writes through its own flusher into the one run: the second must bump the
    running totals the first made, not insert them again (which the database refuses)."""
    from inspector.recording.recorder import Recorder

    recorder = Recorder(db, label="installed twice", flush_interval=60).start()
    for replays in (2, 3):
        watch.install(recorder)
        graph = capture(torch.zeros(8, 4))
        for _ in range(replays):
            graph.replay()
        watch.uninstall()
    recorder.close()
    (total,) = fetch_rows(db, select(ReplayTotal.replays, ReplayTotal.descriptor_key))
    windows = fetch_rows(db, select(ReplayWindow.replays).order_by(ReplayWindow.id))
    assert total[0] == 5 and windows == [(2,), (3,)]
    assert fetch_rows(db, select(func.count()).where(Graph.descriptor_key == total[1])) == [(2,)]


def test_the_graphs_page_groups_a_watched_runs_graphs_by_the_function_that_captured_them(db: str) -> None:
    from dashboard.app import create_app

    watch.install(db, label="two engines")
    first = [capture(torch.zeros(n, 4)) for n in (8, 2)]
    second = capture_elsewhere(torch.zeros(4, 4))
    first[0].replay()
    second.replay()
    second.replay()
    watch.uninstall()

    app = create_app(db)
    try:
        client = app.test_client()
        body = client.get("/api/graphs?group=function&sort=size").get_json()
        items, functions = body["data"]["items"], body["data"]["functions"]
        wrappers = [g["wrapper"] for g in items]
        assert wrappers == sorted(wrappers) and len(set(wrappers)) == 2  # one function's graphs together
        (own,) = [w for w in functions if w.endswith("in capture")]
        (other,) = [w for w in functions if w.endswith("in capture_elsewhere")]
        assert functions[own] == {"graphs": 2, "pool_bytes": 0, "replays": 1}
        assert functions[other] == {"graphs": 1, "pool_bytes": 0, "replays": 2}
        assert [g["descriptor"]["captured_size"] for g in items if g["wrapper"] == own] == [2, 8]
        html = client.get("/graphs?group=function").get_data(as_text=True)
        assert html.count('class="group-head"') == 2 and "2 graphs" in html and "1 graph " in html
        assert 'class="group-head"' not in client.get("/graphs").get_data(as_text=True)
    finally:
        app.extensions["graph_inspector"].store.dispose()
