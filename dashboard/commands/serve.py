"""`graph-inspector serve`: the dashboard daemon on waitress, a production WSGI server
(``dashboard.server``: its limits, deadlines and graceful stop).

Loopback by default. Binding anywhere else exposes graph-cache internals and stack traces to the
network, so it needs an access token (``--token`` or $GRAPH_INSPECTOR_TOKEN). Without a token it
answers only to loopback names and those given with ``--allow-host`` (``dashboard.hosts``). It
serves an existing database: a SQLite file that is not there is created only with ``--create``.
With ``--retain`` it also folds old traffic windows on a schedule (``inspector.storage.retention``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dashboard.hosts import is_loopback

if TYPE_CHECKING:
    from flask import Flask

    from inspector.storage.retention import Policy

TOKEN_ENV = "GRAPH_INSPECTOR_TOKEN"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050
PRUNE_EVERY = "10m"
STOP_GRACE_S = 8.0
"""How long a stop waits for the answers in flight: inside the 10 s Docker waits before SIGKILL
(Kubernetes waits 30 s, systemd 90 s)."""


def run(args: argparse.Namespace) -> int:
    from inspector.errors import DatabaseError, UsageError
    from inspector.storage.store import missing_file

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.get and not is_loopback(args.host) and not token:
        raise UsageError(
            f"refusing to serve on {args.host} without an access token: the dashboard shows stack traces "
            f"and memory addresses. Pass --token (or set {TOKEN_ENV}), or bind to {DEFAULT_HOST}."
        )
    retention = _retention(args.retain, args.prune_every)
    missing = missing_file(args.db)
    if missing is not None and not args.create:
        raise DatabaseError(
            f"no database at {missing}: point --db (or $GRAPH_INSPECTOR_DB) at the one your engine's "
            "Recorder writes, or pass --create to serve a new, empty one"
        )
    if args.get:
        return get(args.db, args.get, token, args.allow_host)
    from dashboard.app import create_app

    app = create_app(args.db, token=token, allowed_hosts=args.allow_host)
    return serve(app, args.host, args.port, retention=retention)


def _retention(tiers: list[str], every: str) -> tuple[Policy, float] | None:
    """The ``--retain`` policy and how often it runs (None without ``--retain``)."""
    from inspector.errors import UsageError
    from inspector.storage.retention import Policy, Tier, parse_duration

    if not tiers:
        return None
    try:
        return Policy(tuple(Tier.parse(tier) for tier in tiers)), parse_duration(every)
    except ValueError as error:
        raise UsageError(f"--retain/--prune-every: {error}") from None


def get(db_url: str | None, path: str, token: str | None, allowed_hosts: Sequence[str] = ()) -> int:
    """One request through the whole app without binding a port; exit 1 on a 4xx/5xx answer."""
    from dashboard.app import create_app

    app = create_app(db_url, token=token, allowed_hosts=allowed_hosts)
    app.extensions["graph_inspector"].queries.rollup.warm()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = app.test_client().get(path if path.startswith("/") else "/" + path, headers=headers)
    sys.stdout.write(response.get_data(as_text=True))
    if response.status_code >= 400:
        print(f"graph-inspector serve --get {path}: HTTP {response.status_code}", file=sys.stderr)
        return 1
    return 0


def serve(app: Flask, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          retention: tuple[Policy, float] | None = None) -> int:
    """Serve ``app`` (from ``create_app``) until SIGTERM or SIGINT, after printing its URL; then stop
    gracefully (``dashboard.server``) and return 0.

    ``port=0`` binds a free port; the printed URL carries the real one. The daemon's time series
    are loaded before the URL is printed, so the first page is as fast as the rest. With
    ``retention`` (a policy and its period in seconds), a thread folds old windows meanwhile.
    """
    import logging

    from dashboard.resources import EXTENSION
    from dashboard.server import Server
    from inspector.errors import UsageError

    state = app.extensions[EXTENSION]
    state.queries.rollup.warm()
    try:
        server = Server(app, host, port, STOP_GRACE_S)
    except OSError as error:
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    with server.stop_signals():  # before the URL says it is up: a SIGTERM from then on stops it gently
        shown_host = f"[{host}]" if ":" in host else host
        url = f"http://{shown_host}:{server.port}/"
        print(f"graph-inspector dashboard: {url}  (database: {state.store.display_url})", flush=True)
        if state.token:
            print("  access token required: open the URL once with ?token=<token>, or send "
                  "'Authorization: Bearer <token>'", flush=True)
        pruner = None
        if retention is not None:
            from inspector.storage.retention import Pruner

            policy, every = retention
            print(f"  retention: every {every:g} s, windows {policy}", flush=True)
            pruner = Pruner(state.store, policy, every,
                            lambda line: print(f"graph-inspector retention: {line}", flush=True)).start()
        print(f"  Ctrl-C or SIGTERM stops it (answers in flight get {STOP_GRACE_S:g} s)", flush=True)
        logging.getLogger("waitress").setLevel(logging.WARNING)
        logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # a queue is how a burst is served
        try:
            report = server.run()
            print(f"graph-inspector dashboard: {report.line()}", file=sys.stderr, flush=True)
        finally:
            if pruner is not None:
                pruner.stop(timeout=1.0)  # a fold cut short rolls back, losing nothing
            server.close()
    return 0
