"""The daemon's HTTP server: waitress, set up for an endpoint that probes and scrapers must always
reach, and stopped gracefully.

What waitress gives by itself: one thread reads and writes every connection (a request is handed to
a worker thread only once it has arrived whole, and an answer is buffered, so a slow client never
holds a worker), eight workers, and at most 100 open connections: beyond those it stops accepting,
so a hundred idle or trickling connections (made before any token is checked) shut every probe out.
What this module adds:

- **Room for new connections.** Up to ``CONNECTION_LIMIT`` connections (poll(), not select(), so
  past 1,024 descriptors; the process's descriptor limit raised to fit). At the limit, the
  connections that wait on their client (idle, or part of a request sent) longest are closed to make
  room for each new one: slow clients can hold the daemon's connections, but never all of them
  against a newcomer. Only when every connection has an answer being made does it stop accepting.
- **Deadlines.** A connection idle ``IDLE_TIMEOUT_S`` is closed, and so is one whose request has not
  arrived whole ``REQUEST_TIMEOUT_S`` after its first byte (a trickle of header lines).
- **A lane for probes.** ``/healthz`` and ``/metrics`` are answered by ``PROBE_THREADS`` threads of
  their own, so slow pages (a fleet's advice, a database lock) never queue a probe or a scrape.
- **A graceful stop.** On SIGTERM or SIGINT it stops listening (taking the connections already
  queued in the listen backlog first), answers every request that has arrived (or arrives whole
  within ``STOP_SETTLE_S``), each answer saying ``Connection: close``, closes idle connections, and
  returns once all are answered or its ``grace`` has passed; a request still trickling in is
  dropped. A second signal stops it at once.
"""

from __future__ import annotations

import heapq
import logging
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher, WSGITask

log = logging.getLogger("graph_inspector.server")

THREADS = 8
"""Workers for pages and the API."""
PROBE_THREADS = 2
PROBE_PATHS = frozenset({"/healthz", "/metrics"})
CONNECTION_LIMIT = 1000
"""Far more than a scraper, a load balancer and a team's browsers (6 connections each) need."""
RESERVED_DESCRIPTORS = 64
"""Descriptors kept for the database, logs and the listening sockets when the limit is lowered."""
IDLE_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 10.0
LOOP_TIMEOUT_S = 1.0
ACCEPT_BATCH = 64
"""Connections accepted per wake-up: a burst queued in the backlog is taken in a few loops."""
STOP_SETTLE_S = 0.25
"""At a stop, how long a request that has begun to arrive has to arrive whole, if no answer in
flight keeps the stop longer: a request is sent in one go; a client still trickling is dropped."""


@dataclass
class StopReport:
    """How a stop went: the signal, the answers it made meanwhile, those cut at the deadline, and the
    requests that had not arrived whole (trickling clients) that were dropped."""

    signal: str
    answered: int
    cut: int
    dropped: int
    seconds: float

    def line(self) -> str:
        done = f"{self.answered - self.cut} answer(s) in flight finished"
        if self.cut:
            done += f", {self.cut} cut at the deadline"
        if self.dropped:
            done += f", {self.dropped} request(s) still arriving dropped"
        return f"stopped on {self.signal}: {done} in {self.seconds:.2f} s"


class _Task(WSGITask):
    def build_response_header(self) -> bytes:
        if self.channel.server.stopping:  # the client should not send another request here
            self.set_close_on_finish()
        return super().build_response_header()


class _Channel(HTTPChannel):
    """A connection that knows when its current request began to arrive."""

    task_class = _Task
    request_started = 0.0

    def received(self, data: bytes) -> bool:
        if self.request is None and data:
            self.request_started = time.time()
        return super().received(data)

    @property
    def answering(self) -> bool:
        """A request arrived whole and its answer is being made (or waits for a worker)."""
        return bool(self.requests)

    @property
    def owes(self) -> bool:
        """An answer is being made, or not yet all sent."""
        return bool(self.requests or self.total_outbufs_len)

    @property
    def waiting_on_client(self) -> bool:
        """Nothing being made for it: idle, part of a request sent, or an answer it does not read."""
        return not self.requests and not self.will_close


class _Listener(TcpWSGIServer):
    """One listening socket and its connections (``active_channels``), with the policy above."""

    channel_class = _Channel
    stopping = False

    def __init__(self, *args: Any, probes: ThreadedTaskDispatcher, **kwargs: Any) -> None:
        self.probes = probes
        self._full = False
        super().__init__(*args, **kwargs)

    def add_task(self, channel: _Channel) -> None:
        lane = self.probes if channel.requests[0].path in PROBE_PATHS else self.task_dispatcher
        lane.add_task(channel)

    def readable(self) -> bool:
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        if not self.accepting:
            return False
        if len(self._map) < self.adj.connection_limit or self._open() < self.adj.connection_limit:
            self._full = False
            return True
        # Full: accept only while some connection can make room (one that waits on its client).
        return any(channel.waiting_on_client for channel in self.active_channels.values())

    def maintenance(self, now: float) -> None:
        idle_before, request_before = now - self.adj.channel_timeout, now - REQUEST_TIMEOUT_S
        for channel in self.active_channels.values():
            if not channel.waiting_on_client:
                continue
            if channel.request is not None:
                late = channel.request_started < request_before
            else:
                late = channel.last_activity < idle_before
            if late:
                channel.will_close = True

    def handle_accept(self) -> None:
        """Accept what the kernel has queued (up to ``ACCEPT_BATCH``), then make room for it."""
        for _ in range(ACCEPT_BATCH):
            before = len(self._map)
            super().handle_accept()
            if len(self._map) == before:
                break
        self._make_room()

    def _open(self) -> int:
        """Descriptors in use that are not about to be closed."""
        return len(self._map) - sum(1 for channel in self.active_channels.values() if channel.will_close)

    def _make_room(self) -> None:
        """Past the limit, close the connections that have waited on their client longest."""
        excess = self._open() - self.adj.connection_limit
        if excess <= 0:
            return
        waiting = (channel for channel in self.active_channels.values() if channel.waiting_on_client)
        for channel in heapq.nsmallest(excess, waiting, key=lambda c: c.last_activity):
            channel.will_close = True
        if not self._full:
            self._full = True
            log.warning("graph-inspector dashboard: %d connections open (its limit): those waiting longest "
                        "on their clients are closed to make room for new ones", self.adj.connection_limit)

    def take_backlog(self) -> None:
        """Accept every connection the kernel has queued (its client may have sent a request)."""
        self.socket.setblocking(False)
        while True:
            try:
                conn, addr = self.socket.accept()
            except OSError:
                return
            conn.setblocking(False)
            self.set_socket_options(conn)
            self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)


class Server:
    """The daemon's server for a WSGI ``app`` on ``host:port`` (port 0: a free one); a stop waits
    ``grace`` seconds at most for the answers in flight."""

    def __init__(self, app: Callable, host: str, port: int, grace: float) -> None:
        self.grace = grace
        self._handling = False
        adj = Adjustments(
            host=host, port=port, threads=THREADS, ident="graph-inspector",
            connection_limit=_connection_limit(), channel_timeout=IDLE_TIMEOUT_S, cleanup_interval=1,
            asyncore_use_poll=True, asyncore_loop_timeout=LOOP_TIMEOUT_S,
        )
        self.adj = adj
        self.map: dict[int, Any] = {}
        self.workers = ThreadedTaskDispatcher()
        self.workers.set_thread_count(THREADS)
        self.probes = ThreadedTaskDispatcher()
        self.probes.set_thread_count(PROBE_THREADS)
        self.listeners = [
            _Listener(app, self.map, dispatcher=self.workers, adj=adj, sockinfo=info, probes=self.probes)
            for info in adj.listen
        ]
        self._signal: str | None = None
        self._forced = False

    @property
    def port(self) -> int:
        return int(self.listeners[0].effective_port)

    @property
    def connection_limit(self) -> int:
        return int(self.adj.connection_limit)

    def run(self) -> StopReport:
        """Serve until SIGTERM or SIGINT (or ``stop()``), then stop gracefully."""
        with self.stop_signals():
            while self._signal is None:
                wasyncore.loop(timeout=LOOP_TIMEOUT_S, map=self.map, use_poll=True, count=1)
            return self._drain()

    def stop(self, why: str = "request") -> None:
        """Ask ``run`` to stop (from a signal handler or another thread); a second call forces it."""
        if self._signal is not None:
            self._forced = True
        else:
            self._signal = why
        self.listeners[0].pull_trigger()

    def close(self) -> None:
        """Close every socket and stop the workers (after ``run``, or instead of it)."""
        for pool in (self.workers, self.probes):
            pool.shutdown(cancel_pending=True, timeout=1.0)
        wasyncore.close_all(self.map)

    def _drain(self) -> StopReport:
        """Stop listening, answer what has arrived (for ``grace`` at most), close the rest."""
        started = time.monotonic()
        for listener in self.listeners:
            listener.stopping = True
            listener.take_backlog()
            listener.accepting = False
            wasyncore.dispatcher.close(listener)  # the socket alone: its trigger still wakes the loop
        answered: set[int] = set()
        stopped_at = time.time()
        settled, deadline = started + STOP_SETTLE_S, started + self.grace
        while not self._forced:
            wasyncore.loop(timeout=0.05, map=self.map, use_poll=True, count=1)
            now = time.monotonic()
            answering = [channel for channel in self._channels() if channel.owes]
            answered.update(id(channel) for channel in answering)
            if now >= deadline or (not answering and now >= settled):
                break
            for channel in self._channels():
                if channel.request is None and not channel.owes and (
                        now >= settled or channel.last_activity < stopped_at):
                    channel.will_close = True  # nothing asked, nothing owed
        left = self._channels()
        cut = sum(1 for channel in left if channel.owes)
        dropped = sum(1 for channel in left if channel.request is not None and not channel.answering)
        for channel in left:
            channel.handle_close()
        assert self._signal is not None
        return StopReport(self._signal, len(answered), cut, dropped, time.monotonic() - started)

    def _channels(self) -> list[_Channel]:
        return [channel for listener in self.listeners for channel in listener.active_channels.values()]

    @contextmanager
    def stop_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT stop this server gracefully inside the block. Enter it before telling
        anyone the server is up (the URL printed): a signal that arrives after that, even before
        ``run``, is a graceful stop, never the default death. ``run`` enters it too (a no-op inside)."""
        if self._handling or threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: whoever runs this elsewhere calls stop()
            return

        def handler(signum: int, frame: object) -> None:
            self.stop(signal.Signals(signum).name)

        # A signal the daemon was started ignoring (SIGINT in a background job) stays ignored.
        stops = [sig for sig in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(sig) != signal.SIG_IGN]
        previous = {sig: signal.signal(sig, handler) for sig in stops}
        self._handling = True
        try:
            yield
        finally:
            self._handling = False
            for sig, old in previous.items():
                signal.signal(sig, old)


def _connection_limit() -> int:
    """``CONNECTION_LIMIT``, after raising the soft descriptor limit as far as the hard one allows
    (systemd's default soft limit is 1,024); lower if even that leaves no room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CONNECTION_LIMIT + RESERVED_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return CONNECTION_LIMIT
    return max(8, min(CONNECTION_LIMIT, soft - RESERVED_DESCRIPTORS))
