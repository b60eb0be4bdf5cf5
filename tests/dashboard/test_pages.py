"""The HTML pages: each renders its data, escapes what the engine wrote, and says plainly when the
chart library is missing."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from dashboard.app import create_app
from tests.support.sample import touch_run


def page(client: FlaskClient, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.get_data(as_text=True)[:2000]
    assert response.mimetype == "text/html"
    return response.get_data(as_text=True)


def test_overview_shows_the_totals_in_human_units(client: FlaskClient) -> None:
    html = page(client, "/")
    assert "Graphs captured" in html and ">77<" in html
    assert re.search(r"\d+\.\d MiB", html)
    assert re.search(r"\d+\.\d %", html)
    assert 'id="summary-data"' in html and 'id="chart-batches"' in html
    assert "above max capture size" in html
    assert "Some of these runs used the <strong>eager backend</strong>" in html


def test_overview_of_an_eager_run_says_so(client: FlaskClient, seeded: dict[str, int]) -> None:
    assert "Recorded on the <strong>eager backend</strong>" in page(client, f"/?run={seeded['eager_run']}")
    cuda = page(client, f"/?run={seeded['cuda_run']}")
    assert "badge eager-backend" not in cuda and "Recorded on the" not in cuda


def test_graphs_table_links_every_graph_and_labels_the_eager_backend(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    html = page(client, f"/graphs?run={seeded['eager_run']}")
    assert f'href="/graphs/{seeded["eager_graph"]}"' in html
    assert "eager backend" in html
    assert page(client, "/graphs?sort=pool_bytes&order=desc").count("<tr>") == 51  # header + 50 rows
    # The sample's FULL graphs of 128 tokens and more are micro-batched: the list says so.
    big = page(client, f"/graphs?run={seeded['cuda_run']}&mode=full&sort=size&order=desc&per_page=3")
    assert big.count('class="badge ubatch"') == 3 and ">2 ubatches<" in big
    assert 'class="badge ubatch"' not in page(client, f"/graphs?run={seeded['cuda_run']}&mode=piecewise")


def test_graph_pages_show_what_each_graph_is_worth_and_mark_the_one_slower_than_eager(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    run = seeded["cuda_run"]
    (paying,) = client.get(f"/api/graphs?run={run}&mode=full&size=128").get_json()["data"]["items"]
    html = page(client, f"/graphs/{paying['id']}")
    assert 'id="step-time"' in html and "x3.83" in html and "556.0 us" in html  # 2.128 ms / 0.556 ms
    assert "mean of 3 timed replays" in html and "mean of 2 canary steps" in html
    assert 'data-mark="' not in html
    (slow,) = client.get(f"/api/graphs?run={run}&mode=full&size=152").get_json()["data"]["items"]
    assert [m["mark"] for m in slow["step_time"]["marks"]] == ["not_faster", "capture_not_repaid"]
    assert 'data-mark="not_faster"' in page(client, f"/graphs/{slow['id']}")
    listed = page(client, f"/graphs?run={run}&mode=full&sort=size&order=asc&per_page=100")
    assert "x0.83" in listed and "its replay is not faster" in listed  # 0.504 ms eager / 0.604 ms
    assert "Not timed yet" in page(client, f"/graphs/{seeded['eager_graph']}")


def test_graph_page_shows_inputs_in_hex_and_its_violation(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    html = page(client, f"/graphs/{seeded['eager_graph']}")
    assert "0x7f3a2c" in html and "input_ids" in html
    assert "Recorded on the <strong>eager backend</strong>" in html
    assert "injected" in html and "moved since capture" in html


def test_violations_page_escapes_untrusted_text(client: FlaskClient, seeded: dict[str, int]) -> None:
    response = client.get("/violations")
    assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    html = page(client, "/violations")
    assert " on" + "change=" not in html and "<script>" not in html.replace("<script src=", "")
    assert "<script>window.__pwned" not in html and "<img src=x" not in html
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
    assert html.count('class="badge injected"') == 2
    assert "0x7f3a2c9f0400" in html


def test_compile_page_shows_reasons_escaped_and_the_overview_links_to_it(
    client: FlaskClient, seeded: dict[str, int]
) -> None:
    html = page(client, "/compile")
    assert html.count('<tr id="compile-') == 3
    assert "mutated inputs (1 instances)" in html and "<code>forward</code>" in html
    assert "&lt;script&gt;window.__pwned = 3&lt;/script&gt; changed" in html
    assert "<script>window.__pwned" not in html
    assert 'class="active">torch.compile</a>' in html
    overview = page(client, "/")
    assert "/compile?kind=compile_skip" in overview and "9 skips" in overview and "5 re-records" in overview
    assert 'id="compile-note"' not in page(client, f"/?run={seeded['eager_run']}")
    empty = page(client, f"/compile?run={seeded['eager_run']}")
    assert "Nothing matches these filters." in empty


def test_runs_and_compare_pages(client: FlaskClient, seeded: dict[str, int]) -> None:
    runs = page(client, "/runs")
    assert "llama-1b decode (H200)" in runs and "ci smoke (eager backend)" in runs
    compare = page(client, f"/runs/compare?a={seeded['cuda_run']}&b={seeded['eager_run']}")
    assert "Run #1 vs #2" in compare and "Per capture size" in compare


def test_live_run_makes_pages_refresh_themselves(
    app: Flask, client: FlaskClient, seeded: dict[str, int]
) -> None:
    store = app.extensions["graph_inspector"].store
    touch_run(store, seeded["eager_run"])
    assert 'data-live="true"' in page(client, "/")
    for run_id in (seeded["cuda_run"], seeded["eager_run"]):
        touch_run(store, run_id, at=time.time() - 3600)
    assert 'data-live="false"' in page(client, "/")
    assert "refreshing every" not in page(client, "/violations")


@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("/graphs/999999", 404),
        ("/graphs/abc", 400),
        ("/violations?kind=nope", 400),
        ("/compile?kind=nope", 400),
        ("/nowhere", 404),
    ],
)
def test_bad_page_requests_render_a_readable_error(client: FlaskClient, url: str, status: int) -> None:
    response = client.get(url)
    assert response.status_code == status
    html = response.get_data(as_text=True)
    assert f"<h1>{status}" in html and "Traceback" not in html


def test_chart_library_is_served_under_its_content_hash(client: FlaskClient) -> None:
    html = page(client, "/")
    url = re.search(r'<script src="(/assets/chart\.[0-9a-f]{16}\.umd\.js)"', html).group(1)
    response = client.get(url)
    assert response.status_code == 200 and b"Chart" in response.data
    assert "immutable" in response.headers["Cache-Control"]
    assert client.get("/assets/chart.0000000000000000.umd.js").status_code == 404


def test_missing_chart_library_is_said_plainly(db_url: str, seeded: dict[str, int], tmp_path: Path) -> None:
    app: Flask = create_app(db_url, test_config={"CHART_JS": tmp_path / "absent" / "chart.umd.js"})
    client = app.test_client()
    html = page(client, "/")
    assert "Charts unavailable" in html and "npm ci" in html and "/assets/chart." not in html
    app.extensions["graph_inspector"].store.dispose()
