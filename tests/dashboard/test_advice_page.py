"""The Advice page and /api/advice: the same advice as `graph-inspector advise`, page and JSON alike."""

from __future__ import annotations

import json
import re

from flask.testing import FlaskClient

from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.advice.engines import EngineLists, config_lines
from inspector.advice.recommend import advise
from inspector.advice.recorded import read_recorded
from inspector.advice.render import as_dict
from inspector.reading.queries import Queries
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store


def api(client: FlaskClient, url: str, status: int = 200) -> dict:
    response = client.get(url)
    assert response.status_code == status, response.get_data(as_text=True)
    return response.get_json()


def test_the_json_twin_is_the_advice_the_command_gives(client: FlaskClient, db_url: str, seeded) -> None:
    data = api(client, f"/api/advice?run={seeded['cuda_run']}")["data"]
    store = open_store(db_url, upgrade=False)
    try:
        recorded = read_recorded(Queries(store.engine), [seeded["cuda_run"]], store.display_url)
    finally:
        store.dispose()
    expected = as_dict(advise(recorded.histogram, recorded.capture_sizes, source=recorded.source,
                              costs=recorded.costs, weighing=recorded.weighing, current=recorded.current,
                              decode=recorded.decode))
    assert data["advice"] == json.loads(json.dumps(expected)) and data["unavailable"] is None
    advice = data["advice"]
    assert advice["graphs"] == advice["current"]["graphs"] == len(recorded.capture_sizes)
    assert advice["advised"]["traffic"]["padding_tokens"] <= advice["current"]["traffic"]["padding_tokens"]
    assert advice["cost_model"] and advice["advised"]["pool_bytes"] > 0, "the CUDA run's pool"
    # The sample's CUDA run recorded step times: padding is weighed by them, and said so.
    weighed = advice["weighed_by"]
    assert advice["weighed_by_step_time"] and weighed.startswith("padding weighed by the recorded")
    assert advice["modelled_step_seconds"]["advised"] <= advice["modelled_step_seconds"]["current"]
    tokens = advice["by_tokens"]  # and what counting tokens would have advised, timed alike
    assert tokens["modelled_step_seconds"] >= advice["modelled_step_seconds"]["advised"]
    assert tokens["same_sizes"] == (tokens["capture_sizes"] == advice["advised"]["capture_sizes"])
    page = client.get(f"/advice?run={seeded['cuda_run']}").get_data(as_text=True)
    assert 'id="advice-by-tokens"' in page and "padding counted in tokens" in page
    graphs = [p["graphs"] for p in advice["curve"]]
    assert graphs == list(range(graphs[0], graphs[0] + len(graphs)))
    assert advice["config"]["vllm"] == config_lines(
        EngineLists(tuple(advice["advised"]["capture_sizes"]), None, None))["vllm"]


def test_the_page_shows_the_advice_its_charts_and_a_copy_button_per_engine(client: FlaskClient,
                                                                            seeded) -> None:
    response = client.get("/advice?max_graphs=4")
    assert response.status_code == 200
    html = response.get_data(as_text=True)
    embedded = json.loads(re.search(r'id="advice-data">(.*?)</script>', html, re.S).group(1))
    assert embedded == api(client, "/api/advice?max_graphs=4")["data"]
    advice = embedded["advice"]
    assert advice["graphs"] == 4 and advice["bounded_by"] == "--max-graphs 4"
    assert 'id="chart-advice-sizes"' in html and 'id="chart-advice-curve"' in html
    for engine in ("vllm", "sglang", "tensorrt_llm", "capture_core"):
        assert f'data-copy="config-{engine}"' in html and f'id="config-{engine}"' in html
    assert "cudagraph_capture_sizes" in html and "--cuda-graph-bs" in html
    assert 'href="/advice"' in html and ">Advice<" in html, "in the navigation of every page"
    assert 'href="/advice"' in client.get("/").get_data(as_text=True)


def test_bad_questions_are_4xx_and_an_empty_database_is_a_notice(client: FlaskClient, db_url: str, seeded,
                                                                   tmp_path) -> None:
    assert "max_graphs must be between 1 and 4096" in api(client, "/api/advice?max_graphs=0", 400)["error"]
    assert api(client, "/api/advice?run=999", 404)["error"] == "no run with id 999"
    from dashboard.app import create_app

    empty = create_app(f"sqlite:///{tmp_path / 'empty.db'}").test_client()
    data = api(empty, "/api/advice")["data"]
    assert data["advice"] is None and "no batches recorded" in data["unavailable"]
    page = empty.get("/advice").get_data(as_text=True)
    assert 'id="advice-unavailable"' in page and "no batches recorded" in page


def test_the_advice_follows_what_is_recorded_after_it_was_asked(client: FlaskClient, db_url: str,
                                                                 seeded) -> None:
    """The advice is kept for the traffic it was made from, and made again once more is recorded."""
    first = api(client, "/api/advice")["data"]["advice"]
    assert api(client, "/api/advice")["data"]["advice"] == first
    with Recorder(db_url, label="a new run", flush_interval=0.05) as recorder:
        for _ in range(5000):
            recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 3, CUDAGraphMode.FULL)
        assert recorder.flush(timeout=20), recorder.last_error
    again = api(client, "/api/advice")["data"]["advice"]
    store = open_store(db_url, upgrade=False)
    try:
        recorded = read_recorded(Queries(store.engine), None, store.display_url)
    finally:
        store.dispose()
    expected = as_dict(advise(recorded.histogram, recorded.capture_sizes, source=recorded.source,
                              costs=recorded.costs, weighing=recorded.weighing, current=recorded.current,
                              decode=recorded.decode))
    assert again == json.loads(json.dumps(expected)) and again != first


def test_current_is_what_the_overview_shows_for_the_same_runs(client: FlaskClient, seeded) -> None:
    for scope in ("", f"?run={seeded['cuda_run']}", f"?run={seeded['eager_run']}"):
        advice = api(client, f"/api/advice{scope}")["data"]["advice"]
        overview = api(client, f"/api/summary{scope}")["data"]
        assert advice["current_recorded"] and advice["current"]["traffic"] == overview["traffic"], scope
        per_size = {}
        for row in overview["charts"]["waste_by_size"]:
            per_size[row["captured_size"]] = per_size.get(row["captured_size"], 0) + row["replays"]
        by_size = {s["captured_size"]: s["traffic"]["replays"] for s in advice["current"]["by_size"]}
        assert {size: n for size, n in by_size.items() if n} == per_size, scope
