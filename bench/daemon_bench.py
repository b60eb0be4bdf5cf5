"""The daemon beside production: probes through slow clients, and a SIGTERM with requests in flight.

Health checks and scrapes are answered while slow clients hold connections, and requests in flight
are answered through a SIGTERM.

Each run starts `graph-inspector serve` (waitress, a child process) on a copy of the page tests'
sample database, from ``--code DIR`` (default this checkout; another checkout, which also writes the
sample in its own schema, for the before figures):

* **slow connections**: N connections held open to it, half idle (connected, nothing sent), half
  trickling a request a header line a second (reconnecting when the daemon closes them, as an
  attacker would); meanwhile ``/healthz`` and ``/metrics`` are probed one after another, each on a
  fresh connection with a 5 s timeout. Figures: how many probes answered, their median and worst
  latency. Target: every ``/healthz`` probe answered within 1 s with 500 slow connections open.
* **SIGTERM in flight**: 50 connections each send ``GET /api/summary``, then the daemon gets
  SIGTERM at once; figures: the answers that arrived whole (200), the exit status and how long the
  stop took. Target: all 50 answered, exit 0.

Every scenario is repeated (``--repeats``); the tables show each run, the targets the worst.

    python3 bench/daemon_bench.py --out bench/results/daemon.json
    git worktree add --detach /tmp/before <commit> && \\
        python3 bench/daemon_bench.py --code /tmp/before --out bench/results/daemon_before_fix.json
    python3 bench/daemon_bench.py --quick --out /tmp/daemon.json     # 150 slow connections, one run
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import before_after_parser, print_table, print_targets, target, write_before_after
from tests.support.daemon import Daemon
from tests.support.installed import Program

SEED = ("import sys, time\nfrom inspector.storage.store import open_store\n"
        "from tests.support.sample import seed_sample\n"
        "store = open_store(sys.argv[1]); seed_sample(store, now=time.time()); store.dispose()")
"""The page tests' sample, written by the checkout under test (its schema)."""
PROBE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
TRICKLE_EVERY_S = 1.0


class SlowClients:
    """``count`` connections to ``port``: the first half idle, the rest trickling header lines. A
    connection the daemon does not take within ``CONNECT_TIMEOUT_S`` is counted, not retried."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.not_taken = 0
        self.reconnects = 0
        self.idle = [sock for sock in (self._connect() for _ in range(count // 2)) if sock is not None]
        self.trickling = [sock for sock in (self._start_request() for _ in range(count - count // 2))
                          if sock is not None]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _connect(self) -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", self.port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            self.not_taken += 1
            return None

    def _start_request(self) -> socket.socket | None:
        sock = self._connect()
        if sock is not None:
            try:
                sock.sendall(b"GET /api/summary HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                sock.close()
                return None
        return sock

    def _trickle(self) -> None:
        while not self._stop.wait(TRICKLE_EVERY_S):
            for i, sock in enumerate(self.trickling):
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:  # closed by the daemon: come back, as an attacker would
                    sock.close()
                    self.reconnects += 1
                    self.trickling[i] = self._start_request() or sock

    @property
    def held(self) -> int:
        return len(self.idle) + len(self.trickling)

    def closed_by_daemon(self) -> int:
        """Connections the daemon has closed (made room with, or timed out)."""
        closed = 0
        for sock in self.idle + self.trickling:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.idle + self.trickling:
            sock.close()


def probe(port: int, path: str) -> float | None:
    """Seconds until ``path`` answered 200 on a fresh connection; None when it did not in time."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return time.perf_counter() - started if response.status == 200 else None
    except OSError:
        return None
    finally:
        conn.close()


def slow_connections(database: str, program: Program, count: int, probes: int) -> dict[str, Any]:
    with Daemon(database, program=program) as daemon:
        clients = SlowClients(daemon.port, count)
        try:
            time.sleep(1.0)
            latencies: dict[str, list[float | None]] = {"/healthz": [], "/metrics": []}
            for _ in range(probes):
                for path, seen in latencies.items():
                    seen.append(probe(daemon.port, path))
                time.sleep(0.25)
            closed = clients.closed_by_daemon()
        finally:
            clients.close()
    result: dict[str, Any] = {"connections": count, "held": clients.held, "not_taken": clients.not_taken,
                              "closed_by_daemon": closed, "reconnects": clients.reconnects}
    for path, seen in latencies.items():
        answered = [s for s in seen if s is not None]
        result[path] = {"probes": len(seen), "answered": len(answered),
                        "median_s": statistics.median(answered) if answered else None,
                        "worst_s": max(answered) if len(answered) == len(seen) else None,
                        "latencies_s": seen}
    return result


def read_answer(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def sigterm_in_flight(database: str, program: Program, requests: int) -> dict[str, Any]:
    daemon = Daemon(database, program=program).start()
    try:
        sockets = [socket.create_connection(("127.0.0.1", daemon.port), timeout=30) for _ in range(requests)]
        for sock in sockets:
            sock.sendall(b"GET /api/summary HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        signalled = time.perf_counter()
        daemon.send_signal(signal.SIGTERM)
        answers = [read_answer(sock) for sock in sockets]
        status = daemon.wait(60)
        stopped_s = time.perf_counter() - signalled
    finally:
        daemon.stop()
    for sock in sockets:
        sock.close()
    whole = sum(a.startswith(b"HTTP/1.1 200") and a.rstrip().endswith(b"}") for a in answers)
    return {"requests": requests, "answered": whole, "exit_status": status, "stop_s": stopped_s,
            "daemon_said": [line for line in daemon.output.splitlines() if "stopped" in line]}


def main() -> int:
    parser = before_after_parser(__doc__.splitlines()[0], runs="daemon",
                                 quick="150 slow connections, 5 probes, one run")
    parser.add_argument("--connections", type=int, nargs="+", default=[500, 1500],
                        help="slow connections held open, a run each (default 500 and 1,500: past the "
                             "daemon's limit of 1,000)")
    parser.add_argument("--probes", type=int, default=20, help="probes of each path per run (default 20)")
    parser.add_argument("--in-flight", type=int, default=50,
                        help="requests in flight at SIGTERM (default 50)")
    args = parser.parse_args()
    if args.quick:
        args.connections, args.probes, args.repeats = [150], 5, 1
    code = args.code.resolve()
    program = Program((sys.executable, "-m", "dashboard.cli"), code,
                      {**os.environ, "PYTHONPATH": str(code)})
    scratch = Path(tempfile.mkdtemp(prefix="daemon-bench-"))
    try:
        template = scratch / "sample.db"
        subprocess.run([sys.executable, "-c", SEED, f"sqlite:///{template}"], check=True, cwd=code,
                       env=program.env)

        def database(name: str) -> str:
            copy = scratch / f"{name}.db"
            shutil.copyfile(template, copy)
            return f"sqlite:///{copy}"

        slow = {count: [] for count in args.connections}
        stops = []
        for repeat in range(args.repeats):
            for count in args.connections:
                print(f"{count} slow connections ({repeat + 1} of {args.repeats}) ...", flush=True)
                slow[count].append(slow_connections(database(f"slow-{count}-{repeat}"), program, count,
                                                    args.probes))
            print(f"SIGTERM with {args.in_flight} requests in flight ({repeat + 1} of {args.repeats}) ...",
                  flush=True)
            stops.append(sigterm_in_flight(database(f"stop-{repeat}"), program, args.in_flight))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows, targets = [], []
    for count, runs in slow.items():
        for repeat, run in enumerate(runs, 1):
            for path in ("/healthz", "/metrics"):
                p = run[path]
                rows.append((count, run["held"], repeat, path, f"{p['answered']} of {p['probes']}",
                             None if p["median_s"] is None else 1000 * p["median_s"],
                             None if p["worst_s"] is None else 1000 * p["worst_s"], run["closed_by_daemon"]))
        probes = [run["/healthz"] for run in runs]
        unanswered = sum(p["probes"] - p["answered"] for p in probes)
        targets.append(target(f"/healthz with {count} slow connections: probes of {len(runs)} x "
                              f"{args.probes} unanswered in {PROBE_TIMEOUT_S:g} s", unanswered, 1))
        answered = [latency for p in probes for latency in p["latencies_s"] if latency is not None]
        targets.append(target(f"/healthz with {count} slow connections: the slowest answer",
                              max(answered) if answered else None, 1.0, unit=" s"))
    print_table("Probes while slow clients hold connections (ms; a probe unanswered in 5 s counts as not "
                "answered)", ("connections", "held", "run", "path", "answered", "median ms", "worst ms",
                              "closed by the daemon"), rows)
    stop_rows = [(repeat, f"{run['answered']} of {run['requests']}", run["exit_status"], run["stop_s"])
                 for repeat, run in enumerate(stops, 1)]
    print_table(f"SIGTERM with {args.in_flight} requests in flight", ("run", "answered whole", "exit status",
                                                                       "stop s"), stop_rows)
    targets.append(target(f"SIGTERM: requests in flight not answered (worst of {len(stops)})",
                          max(run["requests"] - run["answered"] for run in stops), 1))
    targets.append(target("SIGTERM: runs that did not exit 0",
                          sum(run["exit_status"] != 0 for run in stops), 1))
    print_targets(targets)
    return write_before_after(args, "daemon", {"connections": args.connections, "probes": args.probes,
                                               "in_flight": args.in_flight,
                                               "load_average_at_end": os.getloadavg()},
                              {"slow_connections": {str(k): v for k, v in slow.items()}, "sigterm": stops},
                              targets)

if __name__ == "__main__":
    raise SystemExit(main())
