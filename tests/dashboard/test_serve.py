"""`graph-inspector serve`: refuses to expose the dashboard without a token, and says why."""

from __future__ import annotations

import json
import socket

import pytest

from dashboard.cli import main


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "::", "example.org"])
def test_non_loopback_host_without_token_is_refused(
    host: str, db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRAPH_INSPECTOR_TOKEN", raising=False)
    assert main(["serve", "--db", db_url, "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"refusing to serve on {host} without an access token" in err
    assert "--token" in err and "GRAPH_INSPECTOR_TOKEN" in err and "Traceback" not in err


def test_a_port_in_use_is_a_clear_error(db_url: str, store, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--db", db_url, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


def test_an_unreadable_database_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "notes.db"
    bogus.write_text("these are my notes, not a database\n" * 100)
    assert main(["serve", "--db", f"sqlite:///{bogus}"]) == 2
    err = capsys.readouterr().err
    assert "not a readable SQLite database" in err and "Traceback" not in err
    assert bogus.read_text().startswith("these are my notes")


def test_get_answers_one_request_in_process(
    db_url: str, seeded: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--db", db_url, "--get", "/api/summary"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] is True and body["data"]["graphs"]["count"] == 77
    assert main(["serve", "--db", db_url, "--get", "/api/graphs/999999"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == 404 and "HTTP 404" in captured.err


def test_get_sends_the_token(db_url: str, seeded: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--db", db_url, "--token", "t0k", "--get", "healthz"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["serve", "--db", db_url, "--token", "t0k", "--get", "/api/runs"]) == 0
