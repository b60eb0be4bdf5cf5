"""One read model: the overview page, /api/summary, /metrics and `graph-inspector report` give the
same traffic figures for the same database (recorded by the real recorder into a real SQLite file,
read by the real app through Flask's test client and by the real report command in a subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families

from capture_core.descriptor import BatchDescriptor
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from dashboard.app import create_app
from dashboard.units import count, percent
from inspector.recording.recorder import Recorder

REPO = Path(__file__).resolve().parents[2]
COUNTS = ("replays", "eager_batches", "num_real_tokens", "padding_tokens")
KPI = re.compile(r'data-kpi="traffic\.(\w+)" data-format="(\w+)">([^<]*)<')


def _record(url: str) -> list[int]:
    """Two runs with different traffic: FULL and PIECEWISE replays with padding, eager batches."""
    full, mixed = BatchDescriptor(8, 8, True), BatchDescriptor(16)
    run_ids = []
    for rank, (real, eager) in enumerate(((5, 3), (7, 11))):
        with Recorder(url, rank=rank, label=f"rank {rank}") as recorder:
            for _ in range(40):
                recorder.on_replay(CUDAGraphMode.FULL, full, real)
            for _ in range(9):
                recorder.on_replay(CUDAGraphMode.PIECEWISE, mixed, 13)
            for _ in range(eager):
                recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 700, CUDAGraphMode.FULL)
        assert recorder.run_id is not None
        run_ids.append(recorder.run_id)
    return run_ids


def _report(url: str, fmt: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRAPH_INSPECTOR_DB"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "dashboard.cli", "report", "--db", url, "--format", fmt],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _metrics(client: FlaskClient) -> dict:
    """The traffic figures of a scrape, summed over their labels."""
    scrape = client.get("/metrics").get_data(as_text=True)
    samples = [s for family in text_string_to_metric_families(scrape) for s in family.samples]

    def total(name: str) -> float:
        return sum(s.value for s in samples if s.name == f"graph_inspector_{name}")

    return {
        "replays": total("replays_total"),
        "eager_batches": total("eager_fallbacks_total"),
        "num_real_tokens": total("real_tokens_total"),
        "padding_tokens": total("padding_tokens_total"),
        "hit_ratio": total("replay_hit_ratio"),
        "padding_waste": total("padding_waste_ratio"),
    }


def _summary(client: FlaskClient, run_id: int | None = None) -> dict:
    query = "" if run_id is None else f"?run={run_id}"
    return client.get(f"/api/summary{query}").get_json()["data"]["traffic"]


def _overview(client: FlaskClient, run_id: int | None = None) -> dict[str, str]:
    query = "" if run_id is None else f"?run={run_id}"
    page = client.get(f"/{query}").get_data(as_text=True)
    return {field: text for field, _, text in KPI.findall(page)}


def _shown(traffic: dict) -> dict[str, str]:
    """How the overview prints these figures."""
    return {field: percent(value) if field in ("hit_ratio", "padding_waste") else count(value)
            for field, value in traffic.items()}


def test_overview_api_metrics_and_report_agree_on_every_traffic_figure(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'inspector.db'}"
    run_ids = _record(url)
    report, text = json.loads(_report(url, "json")), _report(url, "text")
    app = create_app(url)
    try:
        client = app.test_client()
        overall = _summary(client)
        metrics = _metrics(client)
        per_run = {run_id: _summary(client, run_id) for run_id in run_ids}
        overview = _overview(client)
        run_overviews = {run_id: _overview(client, run_id) for run_id in run_ids}
    finally:
        app.extensions["graph_inspector"].store.dispose()

    # Both runs together: the page, its JSON twin and the scrape.
    assert 0 < overall["hit_ratio"] < 1 and 0 < overall["padding_waste"] < 1
    assert metrics == pytest.approx(overall, rel=0, abs=0)
    shown = _shown(overall)
    assert overview == {field: shown[field] for field in overview} and set(overview) == set(shown)

    # Each run: the report (JSON and text) against the page and its JSON twin.
    reported = {run["id"]: run["traffic"] for run in report["runs"]}
    assert reported == per_run
    assert per_run[run_ids[0]] != per_run[run_ids[1]]
    for run_id in run_ids:
        shown = _shown(per_run[run_id])
        assert run_overviews[run_id] == {field: shown[field] for field in run_overviews[run_id]}
        traffic = per_run[run_id]
        line = next(line for line in text.splitlines() if line.startswith(f"  run {run_id} "))
        assert (f"{traffic['replays']} replays, hit ratio {traffic['hit_ratio']:.1%}, "
                f"padding waste {traffic['padding_waste']:.1%}") in line
    assert {field: sum(t[field] for t in reported.values()) for field in COUNTS} == {
        field: overall[field] for field in COUNTS
    }
