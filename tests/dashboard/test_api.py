"""The JSON API: one envelope for every answer, pagination, filters, and a clear 4xx for bad requests."""

from __future__ import annotations

import pytest
from flask import Flask
from flask.testing import FlaskClient

from dashboard.params import MAX_PER_PAGE
from tests.support.sample import touch_run


def get_ok(client: FlaskClient, url: str) -> dict:
    response = client.get(url)
    assert response.status_code == 200, response.get_data(as_text=True)
    body = response.get_json()
    assert body["ok"] is True and set(body) == {"ok", "data", "page"}
    return body


def get_error(client: FlaskClient, url: str, status: int, method: str = "GET") -> str:
    response = client.open(url, method=method)
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.is_json
    body = response.get_json()
    assert body == {"ok": False, "error": body["error"], "status": status}
    assert body["error"] and "Traceback" not in body["error"]
    return body["error"]


def test_summary_totals_match_the_seeded_traffic(
    app: Flask, client: FlaskClient, seeded: dict[str, int]
) -> None:
    touch_run(app.extensions["graph_inspector"].store, seeded["eager_run"])
    data = get_ok(client, "/api/summary")["data"]
    assert data["runs"]["total"] == 2
    assert data["runs"]["live"] == [seeded["eager_run"]]
    assert data["graphs"]["count"] == 77  # 35 vLLM sizes x 2 modes + 7 power-of-two sizes
    traffic = data["traffic"]
    assert traffic["replays"] > 0 and traffic["eager_batches"] > 0
    assert traffic["hit_ratio"] == pytest.approx(
        traffic["replays"] / (traffic["replays"] + traffic["eager_batches"])
    )
    assert traffic["padding_waste"] == pytest.approx(
        traffic["padding_tokens"] / (traffic["padding_tokens"] + traffic["num_real_tokens"])
    )
    assert data["violations"] == {"findings": 3, "by_kind": {"address_drift": 2, "unexpected_capture": 1},
                                  "injected": {"address_drift": 1, "unexpected_capture": 1}}
    assert [e["reason"] for e in data["eager"]] == ["above_max_capture_size"]
    charts = data["charts"]
    assert charts["series"] and charts["waste_by_size"] and charts["batch_sizes"]
    assert len(charts["graph_memory"]) == 77
    assert charts["capture_sizes"][0] == 1 and charts["capture_sizes"][-1] == 256


def test_summary_of_one_run_counts_only_that_run(client: FlaskClient, seeded: dict[str, int]) -> None:
    data = get_ok(client, f"/api/summary?run={seeded['eager_run']}")["data"]
    assert data["run"] == seeded["eager_run"]
    assert data["graphs"]["count"] == 7
    assert data["violations"]["findings"] == 2
    assert max(data["charts"]["capture_sizes"]) == 64


def test_graphs_paginate_filter_and_sort(client: FlaskClient, seeded: dict[str, int]) -> None:
    body = get_ok(client, "/api/graphs?per_page=10&page=2")
    assert body["page"] == {"page": 2, "per_page": 10, "total": 77, "pages": 8}
    assert len(body["data"]["items"]) == 10
    url = f"/api/graphs?run={seeded['cuda_run']}&mode=piecewise&per_page=100"
    full = get_ok(client, url)["data"]["items"]
    assert len(full) == 35 and {g["mode"] for g in full} == {"piecewise"}
    sized = get_ok(client, "/api/graphs?size=64")["data"]["items"]
    assert {g["descriptor"]["captured_size"] for g in sized} == {64} and len(sized) == 3
    by_memory = get_ok(client, "/api/graphs?sort=pool_bytes&order=desc&per_page=5")["data"]["items"]
    memory = [g["pool_bytes"] for g in by_memory]
    assert memory == sorted(memory, reverse=True)
    assert by_memory[0]["traffic"]["replays"] >= 0


def test_graph_detail_has_inputs_in_hex_history_and_its_violations(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    data = get_ok(client, f"/api/graphs/{seeded['eager_graph']}")["data"]
    assert data["backend"] == "eager" and data["run"]["backend"] == "eager"
    assert data["inputs"][0]["name"] == "input_ids"
    assert data["inputs"][0]["address_hex"] == hex(data["inputs"][0]["address"])
    assert data["history"] and data["traffic"]["replays"] == sum(w["replays"] for w in data["history"])
    assert [v["id"] for v in data["violations"]] == [seeded["drift"]]


def test_violations_filter_by_kind_and_run(client: FlaskClient, seeded: dict[str, int]) -> None:
    drift = get_ok(client, "/api/violations?kind=address_drift")["data"]["items"]
    assert {v["kind"] for v in drift} == {"address_drift"} and len(drift) == 2
    eager_run = get_ok(client, f"/api/violations?run={seeded['eager_run']}")["data"]["items"]
    assert {v["id"] for v in eager_run} == {seeded["drift"], seeded["unexpected"]}
    injected = get_ok(client, f"/api/violations/{seeded['drift']}")["data"]
    assert injected["injected"] is True
    assert injected["expected_address_hex"] == "0x7f3a2c000400"
    assert injected["actual_address_hex"] == "0x7f3a2c9f0400"
    assert "Traceback" in injected["stack"]


def test_compile_events_list_the_compilers_reasons_most_repeated_first(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    body = get_ok(client, "/api/compile")
    rows = body["data"]["items"]
    assert body["page"]["total"] == 3
    assert [(r["kind"], r["function"], r["count"]) for r in rows] == [
        ("compile_skip", "", 9),
        ("compile_rerecord", "forward", 4),
        ("compile_rerecord", "decode_step", 1),
    ]
    assert rows[0]["reason"] == "mutated inputs (1 instances). Found from : model.py:362"
    assert rows[1]["reason"] == "static input data pointer changed"
    assert rows[1]["message"].startswith("[0/0] torch.compile re-recorded forward: static input")
    assert rows[1]["last_seen_at"] - rows[1]["first_seen_at"] == pytest.approx(3)
    assert {r["run_id"] for r in rows} == {seeded["cuda_run"]}
    rerecords = get_ok(client, "/api/compile?kind=compile_rerecord")["data"]
    assert [r["function"] for r in rerecords["items"]] == ["forward", "decode_step"]
    assert get_ok(client, f"/api/compile?run={seeded['eager_run']}")["data"]["items"] == []
    paged = get_ok(client, "/api/compile?per_page=1&page=2")
    assert [r["function"] for r in paged["data"]["items"]] == ["forward"] and paged["page"]["pages"] == 3


def test_summary_counts_compile_events_per_kind_for_the_chosen_run(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    expected = {"compile_skip": 9, "compile_rerecord": 5}
    assert get_ok(client, "/api/summary")["data"]["compile"] == {"by_kind": expected}
    assert get_ok(client, f"/api/summary?run={seeded['cuda_run']}")["data"]["compile"]["by_kind"] == expected
    assert get_ok(client, f"/api/summary?run={seeded['eager_run']}")["data"]["compile"] == {"by_kind": {}}


def test_runs_list_and_compare(app: Flask, client: FlaskClient, seeded: dict[str, int]) -> None:
    touch_run(app.extensions["graph_inspector"].store, seeded["eager_run"])
    runs = get_ok(client, "/api/runs")["data"]["items"]
    assert [r["id"] for r in runs] == [seeded["eager_run"], seeded["cuda_run"]]  # newest first
    assert runs[0]["live"] is True and runs[1]["live"] is False
    assert runs[1]["graphs"] == 70 and runs[1]["config"]["mode"] == "full_and_piecewise"
    compare = get_ok(client, f"/api/runs/compare?a={seeded['cuda_run']}&b={seeded['eager_run']}")["data"]
    assert compare["a"]["id"] == seeded["cuda_run"] and compare["b"]["graphs"] == 7
    sixteen = next(r for r in compare["by_size"] if r["mode"] == "full" and r["captured_size"] == 16)
    assert sixteen["a_graphs"] == 1 and sixteen["b_graphs"] == 1


@pytest.mark.parametrize(
    ("url", "status", "fragment"),
    [
        ("/api/graphs/abc", 400, "graph id must be an integer"),
        ("/api/graphs/0", 400, "graph id must be between 1 and"),
        ("/api/graphs/999999", 404, "no graph with id 999999"),
        ("/api/violations/999999", 404, "no violation"),
        ("/api/runs/999999", 404, "no run"),
        (f"/api/graphs?per_page={MAX_PER_PAGE + 1}", 400, f"per_page must be between 1 and {MAX_PER_PAGE}"),
        ("/api/graphs?per_page=99999999999999999999", 400, "per_page must be between"),
        ("/api/violations?page=0", 400, "page must be between"),
        ("/api/violations?page=-3", 400, "page must be between"),
        ("/api/graphs?size=big", 400, "size must be an integer"),
        ("/api/graphs?mode=turbo", 400, "mode must be one of piecewise, full"),
        ("/api/graphs?sort=password", 400, "sort must be one of"),
        ("/api/graphs?order=sideways", 400, "order must be one of asc, desc"),
        ("/api/violations?kind=meltdown", 400, "kind must be one of address_drift"),
        ("/api/violations?run=424242", 404, "no run with id 424242"),
        ("/api/compile?kind=meltdown", 400, "kind must be one of compile_skip, compile_rerecord"),
        ("/api/compile?run=424242", 404, "no run with id 424242"),
        ("/api/summary?run=x", 400, "run must be an integer"),
        ("/api/runs/compare?a=1", 400, "compare needs two runs"),
        ("/api/runs/compare?a=1&b=424242", 404, "no run with id 424242"),
        ("/api/nothing-here", 404, "no API endpoint /api/nothing-here"),
    ],
)
def test_bad_requests_get_a_clear_4xx_in_the_envelope(
    client: FlaskClient, url: str, status: int, fragment: str
) -> None:
    assert fragment in get_error(client, url, status)


def test_writing_methods_are_refused_in_the_envelope(client: FlaskClient) -> None:
    assert "not allowed" in get_error(client, "/api/summary", 405, method="POST").lower()


def test_empty_database_answers_with_zeros_not_errors(db_url: str) -> None:
    from dashboard.app import create_app

    client = create_app(db_url).test_client()
    data = get_ok(client, "/api/summary")["data"]
    assert data["graphs"]["count"] == 0 and data["traffic"]["hit_ratio"] is None
    assert get_ok(client, "/api/graphs")["page"]["total"] == 0
    assert client.get("/").status_code == 200
