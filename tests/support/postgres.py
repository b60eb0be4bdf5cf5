"""A throwaway PostgreSQL cluster from Debian's binaries, for the tests and the benchmarks.

One cluster: ``initdb`` in a temporary directory, started with ``pg_ctl`` on a free loopback port
(as the ``postgres`` user when run as root, since PostgreSQL refuses to run as root), stopped and
removed at the end; ``new_database()`` makes a fresh database in it.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

PG_BIN_GLOB = "/usr/lib/postgresql/*/bin/initdb"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def postgres_binaries() -> Path | None:
    """The newest installed server's ``bin`` folder, None without one."""
    found = sorted(glob.glob(PG_BIN_GLOB))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """A throwaway PostgreSQL cluster on loopback; ``new_database()`` gives each test its own.

    ``settings`` are ``-c name=value`` server settings beside the defaults (fsync off: nothing
    here needs to survive a power cut)."""

    def __init__(self, bindir: Path, root: Path, settings: Sequence[str] = ()) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.port = _free_port()
        self.settings = ("fsync=off", *settings)
        self._names = itertools.count()

    def _run(self, *argv: str) -> None:
        result = subprocess.run(_as_postgres(list(argv)), capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}")

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8")
        options = " ".join([f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1",
                            *(f"-c {setting}" for setting in self.settings)])
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                  str(self.root / "server.log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg

        name = f"inspector_test_{next(self._names)}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@contextmanager
def throwaway_cluster(parent: Path | None = None, settings: Sequence[str] = ()) -> Iterator[PostgresServer]:
    """A started cluster in a new folder under ``parent`` (default: the temporary folder), stopped
    and removed on exit. Raises ``FileNotFoundError`` without the server binaries."""
    bindir = postgres_binaries()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin)")
    root = Path(tempfile.mkdtemp(prefix="inspector-pg-", dir=parent))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    server = PostgresServer(bindir, root, settings)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
