"""Fuzzed requests against the real daemon: how many answer 5xx, break the connection or leave the
JSON envelope.

Seeds SQLite with the page tests' sample (two runs, their graphs, violations and torch.compile
events), starts `graph-inspector serve` (waitress, a child process) on a free loopback port and
sends N requests drawn from the property test's strategies (tests/support/fuzz.py: every route and
method, ids and numbers beyond 64 bits, Unicode, surrogates, NULs, repeated keys, url_for's
keywords, broken escapes), in sequence over one keep-alive connection, as a browser would: an
answer that corrupts the next one (a HEAD with a body) shows up as a broken response. Exceptions
the daemon logged are counted by their last line. Target: no 5xx, nothing broken.

    python3 bench/fuzz_requests.py --out bench/results/fuzz_requests.json
    python3 bench/fuzz_requests.py --quick      # 300 requests, a smoke run
"""

from __future__ import annotations

import argparse
import http.client
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from bench.common import command_line, print_table, print_targets, target, write_results
from dashboard.app import create_app
from inspector.storage.store import open_store
from tests.support.daemon import Daemon
from tests.support.fuzz import FuzzRequest, app_routes, problems, requests
from tests.support.sample import seed_sample

STRAY_WAIT_S = 0.05
LOGGED_ERROR = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception)): (.{0,120})", re.MULTILINE)


class Connection:
    """One keep-alive connection to the daemon, reopened (and counted) when an answer breaks or ends
    it."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port
        self.reopened = 0
        self._conn = self._open()

    def _open(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=60)

    def send(self, request: FuzzRequest) -> tuple[int, bytes]:
        """(status, body); status 0 when the answer could not be read as HTTP. The body of a HEAD
        answer is whatever the server sent after its headers (there should be nothing)."""
        try:
            self._conn.request(request.method, request.target)
            response = self._conn.getresponse()
            if request.method == "HEAD":
                return response.status, self._stray_bytes(response)
            return response.status, response.read()
        except (http.client.HTTPException, OSError) as error:
            self._reopen()
            return 0, repr(error).encode()

    def _stray_bytes(self, response: http.client.HTTPResponse) -> bytes:
        """Bytes that follow a HEAD answer's headers: http.client reads none of them for HEAD, so
        they would be parsed as the next answer. Read what arrives within a moment."""
        sock = self._conn.sock
        if sock is None or response.fp is None:  # the server closed the connection after it
            self._reopen()
            return b""
        sock.settimeout(STRAY_WAIT_S)
        try:
            stray = response.fp.peek(65536)
        except TimeoutError:
            stray = b""
        finally:
            sock.settimeout(self._conn.timeout)
        response.read()
        if stray:  # the next answer would start inside them: start afresh
            self._reopen()
        return stray

    def _reopen(self) -> None:
        self._conn.close()
        self._conn = self._open()
        self.reopened += 1

    def close(self) -> None:
        self._conn.close()


def fuzz(base_url: str, rules: list[str], known: dict[str, list[str]], count: int, seed_value: int
         ) -> dict[str, Any]:
    statuses: Counter[int] = Counter()
    methods: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    connection = Connection(base_url)

    @seed(seed_value)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(requests(rules, known))
    def probe(request: FuzzRequest) -> None:
        status, body = connection.send(request)
        statuses[status] += 1
        methods[request.method] += 1
        found = ["the answer broke the connection: " + body.decode()] if status == 0 else problems(
            request, status, body)
        if found:
            failures.append({"method": request.method, "target": request.target[:300], "status": status,
                             "problems": found})

    try:
        probe()
    finally:
        connection.close()
    return {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "methods": dict(methods.most_common()),
            "reconnects": connection.reopened, "failures": failures}


def route_of(target: str, rules: list[str]) -> str:
    """The rule a fuzzed target was drawn from (its longest literal prefix)."""
    path = target.split("?", 1)[0]
    literal = {rule: rule.split("<", 1)[0] for rule in rules}
    matches = [r for r in rules if (path == r) or ("<" in r and path.startswith(literal[r]))]
    return max(matches, key=lambda r: len(literal[r])) if matches else path


def _kind(problem: str) -> str:
    return re.sub(r"\d+-byte", "n-byte", problem.split(":")[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/fuzz_requests.json"))
    parser.add_argument("--requests", type=int, default=5_000, help="requests to send (default 5,000)")
    parser.add_argument("--seed", type=int, default=18, help="hypothesis seed (default 18)")
    parser.add_argument("--quick", action="store_true", help="300 requests: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.requests = 300

    scratch = tempfile.TemporaryDirectory()
    url = f"sqlite:///{Path(scratch.name) / 'fuzz.db'}"
    store = open_store(url, upgrade=True)
    seed_sample(store, now=time.time())
    store.dispose()
    probe_app = create_app(url)
    rules, known = app_routes(probe_app)
    probe_app.extensions["graph_inspector"].store.dispose()

    started = time.perf_counter()
    with Daemon(url) as daemon:
        result = fuzz(daemon.url, rules, known, args.requests, args.seed)
        logged = Counter(f"{kind}: {text}" for kind, text in LOGGED_ERROR.findall(daemon.output))
    seconds = time.perf_counter() - started
    scratch.cleanup()

    failures = result["failures"]
    server_errors = sum(n for status, n in result["statuses"].items() if status >= 500)
    broken = result["statuses"].get(0, 0)
    by_route = Counter((route_of(f["target"], rules), _kind(f["problems"][0])) for f in failures)
    print_table(f"Fuzzed requests ({result['requests']:,} in {seconds:.0f} s, seed {args.seed}, "
                f"{result['reconnects']} reconnects)",
                ("status", "answers"), [(s or "broken", n) for s, n in result["statuses"].items()])
    if by_route:
        print_table("Problems by route", ("route", "problem", "requests"),
                    [(*key, n) for key, n in by_route.most_common()])
    if logged:
        print_table("Exceptions the daemon logged", ("exception", "times"), logged.most_common(12))
    for failure in failures[:8]:
        print(f"  e.g. {failure['method']} {failure['target'][:160]} -> {failure['problems'][0][:160]}")
    targets = [
        target("5xx answers", server_errors, 1),
        target("broken responses", broken, 1),
        target("requests with any problem", len(failures), 1),
    ]
    print_targets(targets)
    write_results(
        args.out,
        benchmark="fuzz_requests",
        command=command_line(),
        device=torch.device("cpu"),
        config={"requests": args.requests, "seed": args.seed, "quick": args.quick, "database": "sqlite",
                "server": "waitress (graph-inspector serve)", "routes": rules},
        results={**result, "seconds": seconds, "server_errors": server_errors,
                 "logged_exceptions": dict(logged), "problems_by_route": [
                     {"route": r, "problem": p, "requests": n} for (r, p), n in by_route.most_common()]},
        targets=targets,
    )
    print(f"\nwrote {args.out}")
    return 0 if all(t["met"] is not False for t in targets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
