"""The daemon's server (``dashboard.server``): slow and idle clients never shut a probe out, deadlines
close what waits on its client, probes have a lane of their own, and SIGTERM or SIGINT stops it
gracefully, with every request in flight answered.

The server's own behaviour is tested in-process with a WSGI app whose answers wait on the test (so
that "in flight" and "every worker busy" are states, not races), over real sockets on loopback;
the daemon's, as `graph-inspector serve` in a child process on a real database.
"""

from __future__ import annotations

import http.client
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from dashboard import server as server_module
from dashboard.server import THREADS, Server, StopReport
from tests.support.daemon import Daemon


class Gate:
    """A WSGI app: ``/slow`` answers once ``release()`` is called; anything else at once."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = threading.Semaphore(0)

    def release(self) -> None:
        self.released.set()

    def __call__(self, environ: dict, start_response: Callable) -> list[bytes]:
        if environ["PATH_INFO"] == "/slow":
            self.entered.release()
            self.released.wait(60)
        body = environ["PATH_INFO"].encode()
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    def wait_entered(self, count: int) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=30), "a request never reached the app"


@contextmanager
def serving(app: Callable, grace: float = 10.0) -> Iterator[tuple[Server, dict[str, StopReport]]]:
    """The server on a free loopback port, run on a thread (stopped with ``stop()``, as a signal
    would); the report of its stop lands in the dict."""
    server = Server(app, "127.0.0.1", 0, grace)
    result: dict[str, StopReport] = {}
    thread = threading.Thread(target=lambda: result.update(report=server.run()), daemon=True)
    thread.start()
    try:
        yield server, result
    finally:
        if thread.is_alive():
            server.stop("the test's end")
            server.stop("the test's end")  # a second time: at once
            thread.join(30)
        server.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def send(port: int, path: str) -> socket.socket:
    sock = connect(port)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock


def read_answer(sock: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def read_response(sock: socket.socket, timeout: float = 30) -> tuple[int, str | None, bytes]:
    """One answer on ``sock``: its status, its Connection header and its body."""
    sock.settimeout(timeout)
    response = http.client.HTTPResponse(sock)
    response.begin()
    try:
        return response.status, response.getheader("Connection"), response.read()
    finally:
        response.close()


def get(port: int, path: str, timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ----------------------------------------------------------------------- in-process: the server


def test_probes_are_answered_while_every_worker_is_busy() -> None:
    gate = Gate()
    with serving(gate) as (server, _), ExitStack() as sockets:
        slow = [sockets.enter_context(send(server.port, "/slow")) for _ in range(THREADS + 4)]
        gate.wait_entered(THREADS)
        assert get(server.port, "/healthz", timeout=10) == (200, b"/healthz")
        assert get(server.port, "/metrics", timeout=10) == (200, b"/metrics")
        gate.release()
        assert all(read_response(sock)[0] == 200 for sock in slow)


def test_past_the_limit_the_connections_waiting_longest_make_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "CONNECTION_LIMIT", 40)
    gate = Gate()
    with serving(gate) as (server, _), ExitStack() as sockets:
        assert server.connection_limit == 40
        busy = sockets.enter_context(send(server.port, "/slow"))
        gate.wait_entered(1)
        idle = []
        for _ in range(60):  # one at a time, so that "longest waiting" has an order
            idle.append(sockets.enter_context(connect(server.port)))
            time.sleep(0.01)
        assert get(server.port, "/healthz", timeout=10) == (200, b"/healthz")
        assert closed_by_server(idle[0], within=5), "the connection idle longest gave way"
        assert not closed_by_server(idle[-1], within=0.5), "the newest connection is kept"
        gate.release()
        assert read_response(busy) == (200, None, b"/slow"), "a connection being answered is never closed"


def test_an_idle_connection_and_a_trickling_request_are_closed_at_their_deadlines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "IDLE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(server_module, "REQUEST_TIMEOUT_S", 1.5)
    with serving(Gate()) as (server, _), connect(server.port) as idle, connect(server.port) as trickling:
        trickling.sendall(b"GET / HTTP/1.1\r\n")
        closed = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not closed:
            trickling.sendall(b"X-Slow: 1\r\n")  # always active, never whole
            closed = closed_by_server(trickling, within=0.3)
        assert closed, "a request that never arrives whole is closed"
        assert closed_by_server(idle, within=5)
        assert get(server.port, "/healthz") == (200, b"/healthz")


def test_a_stop_answers_the_requests_in_flight_and_closes_the_rest() -> None:
    gate = Gate()
    with serving(gate) as (server, result), ExitStack() as sockets:
        in_flight = [sockets.enter_context(send(server.port, "/slow")) for _ in range(THREADS + 2)]
        gate.wait_entered(THREADS)
        idle = sockets.enter_context(connect(server.port))
        trickling = sockets.enter_context(connect(server.port))
        trickling.sendall(b"GET / HTTP/1.1\r\n")
        time.sleep(0.2)
        server.stop("SIGTERM")
        assert closed_by_server(idle, within=5), "an idle connection is closed at once"
        with pytest.raises(OSError):
            get(server.port, "/healthz", timeout=5)  # no longer listening
        gate.release()
        answers = [read_response(sock) for sock in in_flight]
        assert answers == [(200, "close", b"/slow")] * len(in_flight)
        assert closed_by_server(trickling, within=5)
        for _ in range(100):
            if "report" in result:
                break
            time.sleep(0.1)
    report = result["report"]
    assert (report.signal, report.answered, report.cut, report.dropped) == ("SIGTERM", len(in_flight), 0, 1)
    assert "10 answer(s) in flight finished, 1 request(s) still arriving dropped" in report.line()


def test_a_stop_cuts_what_outlasts_its_grace() -> None:
    gate = Gate()
    with serving(gate, grace=1.0) as (server, result), send(server.port, "/slow") as stuck:
        gate.wait_entered(1)
        server.stop("SIGINT")
        for _ in range(100):
            if "report" in result:
                break
            time.sleep(0.1)
        gate.release()
        read_answer(stuck, timeout=5)
    report = result["report"]
    assert (report.answered, report.cut) == (1, 1) and 1.0 <= report.seconds < 5.0
    assert "0 answer(s) in flight finished, 1 cut at the deadline" in report.line()


# ----------------------------------------------------------------- the daemon (a child process)


@pytest.fixture
def served(seeded_template: tuple[Path, dict[str, int]], tmp_path: Path) -> Iterator[Daemon]:
    shutil.copyfile(seeded_template[0], tmp_path / "served.db")
    with Daemon(f"sqlite:///{tmp_path / 'served.db'}") as daemon:
        yield daemon


def test_slow_clients_never_shut_out_a_health_check_or_a_scrape(served: Daemon) -> None:
    """300 connections (three times waitress's default limit): half idle, half sending a request a
    header line at a time. The probes are answered meanwhile."""
    with ExitStack() as sockets:
        idle = [sockets.enter_context(connect(served.port)) for _ in range(150)]
        trickling = [sockets.enter_context(connect(served.port)) for _ in range(150)]
        for sock in trickling:
            sock.sendall(b"GET /api/summary HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert get(served.port, "/healthz", timeout=10)[0] == 200
        status, body = get(served.port, "/metrics", timeout=10)
        assert status == 200 and b"graph_inspector_runs" in body
        assert len(idle) == 150


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_daemon_after_answering_every_request_in_flight(served: Daemon, sig: int) -> None:
    with ExitStack() as sockets:
        requests = [sockets.enter_context(connect(served.port)) for _ in range(50)]
        for sock in requests:
            sock.sendall(b"GET /api/summary HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        idle = sockets.enter_context(connect(served.port))
        served.send_signal(sig)
        answers = [read_answer(sock) for sock in requests]
        assert closed_by_server(idle, within=10)
    assert sum(a.startswith(b"HTTP/1.1 200") and b'"ok":true' in a.replace(b" ", b"") for a in answers) == 50
    assert served.wait(timeout=30) == 0, served.output
    assert f"stopped on {signal.Signals(sig).name}" in served.output and "Traceback" not in served.output
    assert "cut" not in served.output


SIGNAL_AT_THE_URL = """
import os, signal, sys

class Signalling:
    '''stdout that sends this process SIGTERM the moment the daemon prints its URL (its readiness).'''
    def write(self, text):
        sys.__stdout__.write(text)
        if "graph-inspector dashboard: http" in text:
            os.kill(os.getpid(), signal.SIGTERM)
        return len(text)

    def flush(self):
        sys.__stdout__.flush()

sys.stdout = Signalling()
from dashboard.cli import main
sys.exit(main(["serve", "--db", sys.argv[1], "--port", "0"]))
"""


def test_a_sigterm_the_moment_the_url_is_printed_is_a_graceful_stop(
        seeded_template: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    """The printed URL says the daemon is up, so a supervisor may stop it at once: the handlers are in
    place before it (a SIGTERM between the URL and the serving loop used to kill it with -15)."""
    import subprocess
    import sys

    shutil.copyfile(seeded_template[0], tmp_path / "served.db")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT_THE_URL, f"sqlite:///{tmp_path / 'served.db'}"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert "stopped on SIGTERM" in done.stderr and "Traceback" not in done.stderr
