"""Start `graph-inspector serve` as a child process and learn its URL: for the page tests, the
screenshots script and the benchmark, which all want the real daemon, not an in-process app.

The daemon binds port 0 (a free port, no race between picking and binding) and prints its URL;
everything it prints is kept, so a failing test can show the server's side of the story. It is the
checkout's daemon, or the wheel's install under $GRAPH_INSPECTOR_INSTALL (``tests.support.installed``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from tests.support.installed import Program

URL_LINE = re.compile(r"graph-inspector dashboard: (http://\S+/)")


def terminate(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a child process: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(grace)


def _ctrl_c_as_at_a_terminal() -> None:
    """In the daemon's process, before it starts: SIGINT as a terminal's foreground job has it (a
    test run in the background of a shell ignores SIGINT, and its children would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class DaemonError(RuntimeError):
    """The daemon exited or printed no URL in time; the message carries its output."""


class Daemon:
    """``with Daemon(db_url) as daemon: daemon.url`` -- a served dashboard, stopped on exit."""

    def __init__(self, db_url: str, *, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 start_timeout: float = 60.0, program: Program | None = None) -> None:
        self.program = program or Program.under_test()
        self.command = [*self.program.argv, "serve", "--db", db_url, "--port", "0", *extra_args]
        self.env = {**self.program.env, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start_timeout = start_timeout
        self.url = ""
        self._lines: list[str] = []
        self._process: subprocess.Popen[str] | None = None
        self._found = threading.Event()

    @property
    def output(self) -> str:
        """Everything the daemon printed so far (stdout and stderr, interleaved)."""
        return "".join(self._lines)

    def start(self) -> Daemon:
        self._process = subprocess.Popen(
            self.command, cwd=self.program.cwd, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, preexec_fn=_ctrl_c_as_at_a_terminal,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._found.wait(0.1):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                state = "exited" if self._process.returncode is not None else "printed no URL in time"
                raise DaemonError(f"graph-inspector serve {state}; its output:\n{self.output}")
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.append(line)
            match = URL_LINE.search(line)
            if match and not self._found.is_set():
                self.url = match.group(1)
                self._found.set()

    @property
    def port(self) -> int:
        return int(self.url.rstrip("/").rsplit(":", 1)[1])

    def send_signal(self, sig: int) -> None:
        assert self._process is not None
        self._process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The daemon's exit status, once it has exited (``subprocess.TimeoutExpired`` after
        ``timeout`` seconds); everything it printed is in ``output`` by then."""
        assert self._process is not None
        status = self._process.wait(timeout)
        assert self._process.stdout is not None
        self._reader.join(timeout)
        return status

    def stop(self) -> None:
        if self._process is not None:
            terminate(self._process)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
