"""The Jobs and ranks pages and their JSON twins, and the compare page's regression-gate verdicts,
on a job of two ranks recorded by their own Recorders (tests/support/sample.py: ``seed_job``)."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from test_api import get_error, get_ok
from test_pages import page

from dashboard.app import create_app
from tests.support.cli import cli
from tests.support.sample import seed_job

JOB = "torchrun:sample-job"
EIGHT, SIXTEEN = "tokens=8,reqs=8,uniform=1", "tokens=16,reqs=16,uniform=1"


@pytest.fixture(scope="module")
def job_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, int]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('job') / 'job.db'}"
    return url, seed_job(url, JOB)


@pytest.fixture
def job_client(job_db: tuple[str, dict[str, int]]) -> Iterator[FlaskClient]:
    app: Flask = create_app(job_db[0])
    yield app.test_client()
    app.extensions["graph_inspector"].store.dispose()


def test_the_jobs_listing_counts_the_ranks_and_their_divergences(job_client: FlaskClient) -> None:
    (listed,) = get_ok(job_client, "/api/jobs")["data"]["items"]
    assert (listed["job"], listed["ranks"], listed["world_size"], listed["divergences"]) == (JOB, 2, 2, 3)
    html = page(job_client, "/jobs")
    assert f'href="/ranks?job={JOB}"' in html and ">3</a>" in html


def test_the_ranks_view_marks_what_diverged_on_which_rank(job_client: FlaskClient) -> None:
    data = get_ok(job_client, f"/api/ranks?job={urllib.parse.quote(JOB)}")["data"]
    assert [(r["run"]["rank"], r["divergences"]) for r in data["ranks"]] == [(0, 0), (1, 3)]
    rows = {row["key"]: row for row in data["graphs"]}
    assert [row["captured_size"] for row in rows.values()] == [1, 2, 4, 8, 16]
    cell = {key: [(c["captured"], c["replays"], c["diverged"]) for c in row["cells"]]
            for key, row in rows.items()}
    assert cell[EIGHT] == [(True, 0, False), (False, 0, True)]  # rank 1 lacks the 8-token graph
    assert cell[SIXTEEN] == [(False, 0, False), (True, 0, True)]  # and has a 16-token one instead
    assert cell["tokens=4,reqs=4,uniform=1"] == [(True, 2, False), (True, 3, True)]  # it replayed 4 at step 3
    assert cell["tokens=1,reqs=1,uniform=1"] == [(True, 2, False), (True, 2, False)]
    messages = sorted(d["violation"]["message"] for d in data["divergences"])
    assert messages[2] == ("step 3: rank 1 ran full tokens=4,reqs=4,uniform=1, where rank 0 ran full "
                           "tokens=2,reqs=2,uniform=1")
    assert {d["rank"] for d in data["divergences"]} == {1}

    html = page(job_client, f"/ranks?job={urllib.parse.quote(JOB)}")
    assert "3 rank divergence(s)" in html and html.count('<span class="badge bad">diverged</span>') == 3
    assert "not captured" in html and "step 3: rank 1 ran full tokens=4" in html


def test_the_ranks_view_shows_the_newest_job_and_refuses_an_unknown_one(
    job_client: FlaskClient, client: FlaskClient
) -> None:
    assert get_ok(job_client, "/api/ranks")["data"]["job"] == JOB
    empty = get_ok(client, "/api/ranks")["data"]  # the sample: two runs of no job
    assert empty == {"job": None, "world_size": None, "ranks": [], "graphs": [], "divergences": []}
    assert "No jobs recorded yet" in page(client, "/ranks")
    assert "no run of job 'nobody'" in get_error(job_client, "/api/ranks?job=nobody", 404)
    assert "at most 200 characters" in get_error(job_client, f"/api/ranks?job={'x' * 201}", 400)
    assert job_client.get("/ranks?job=nobody").status_code == 404


def test_the_compare_page_gives_the_reports_verdicts(
    job_client: FlaskClient, job_db: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    url, ids = job_db
    a, b = ids["rank0_run"], ids["rank1_run"]
    gate = get_ok(job_client, f"/api/runs/compare?a={a}&b={b}")["data"]["gate"]
    report = cli("report", "--db", url, "--run", str(b), "--baseline", str(a), "--format", "json")
    assert report.returncode == 1
    assert json.loads(report.stdout)["gate"] == gate
    assert {c["name"]: c["verdict"] for c in gate["comparisons"]}["captured_graphs"] == "regression"
    html = page(job_client, f"/runs/compare?a={a}&b={b}")
    assert "Regression gate: B against A" in html and 'class="verdict-regression"' in html
    assert f"missing: full {EIGHT} (captured size 8)" in html
