"""Divergences located and recorded: a planted baked value in one layer, through a real Recorder into
the database, shown beside its replay_mismatch on the violations page, its JSON twin, a graph's
page and ``report``; clean traffic records none."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select
from workers import fetch_rows

from dashboard.app import create_app
from inspector.gating.report import build_report, render_json, render_text
from inspector.recording.recorder import Recorder
from inspector.storage.models import Divergence
from inspector.storage.store import open_store
from tests.support.divergence import BAKED_LAYER, BakedGraph

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture
def single_thread_torch():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def record(url: str, planted: bool) -> int:
    with Recorder(url, label="baked", flush_interval=0.05) as recorder:
        graph = BakedGraph.build(recorder)
        graph.step()
        if planted:
            with graph.runtime.injected_faults():
                graph.step(layer_scale=2.0)
        graph.step()
    assert recorder.run_id is not None
    return recorder.run_id


def test_a_located_divergence_is_recorded_and_shown_beside_its_violation(db_url: str) -> None:
    run_id = record(db_url, planted=True)
    rows = fetch_rows(db_url, select(Divergence.module, Divergence.reproduced, Divergence.injected,
                                     Divergence.agreeing, Divergence.descriptor_key))
    assert rows == [(f"layers.{BAKED_LAYER}", True, True,
                     json.dumps(["embed", "layers.0", "layers.1", f"layers.{BAKED_LAYER}.layer"]),
                     "tokens=8,reqs=8,uniform=1")]
    client = create_app(db_url).test_client()
    listed = client.get(f"/api/violations?run={run_id}&kind=replay_mismatch").get_json()["data"]
    (violation,) = listed["items"]
    located = violation["divergence"]
    assert located["module"] == f"layers.{BAKED_LAYER}" and located["agreeing"][0] == "embed"
    assert located["max_rel_error"] == pytest.approx(0.5) and located["reproduced"]
    page = client.get("/violations").get_data(as_text=True)
    assert "Where it goes wrong" in page and f"layers.{BAKED_LAYER}" in page
    store = open_store(db_url, upgrade=False)
    try:
        report = build_report(store)
    finally:
        store.dispose()
    text = render_text(report)
    assert f"located: first differs at module 'layers.{BAKED_LAYER}'" in text
    (finding,) = [f for f in json.loads(render_json(report))["violations"] if f["kind"] == "replay_mismatch"]
    assert finding["located"].startswith(f"first differs at module 'layers.{BAKED_LAYER}'")


def test_clean_traffic_locates_nothing(db_url: str) -> None:
    run_id = record(db_url, planted=False)
    assert fetch_rows(db_url, select(Divergence.id)) == []
    client = create_app(db_url).test_client()
    assert client.get(f"/api/violations?run={run_id}").get_json()["data"]["items"] == []
