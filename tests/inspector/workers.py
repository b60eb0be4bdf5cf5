"""What the recorder tests share: the recording workloads and events (``tests.support.recording``,
which spawned workers import), queries on a fresh engine, a child's environment, a held lock.

As a script it records until killed (the SIGKILL test runs it so).
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.recording import (
    FULL,
    PIECEWISE,
    SIZES,
    capture,
    drift,
    record_traffic,
    record_until_killed,
)

__all__ = ["FULL", "PIECEWISE", "REPO", "SIZES", "capture", "child_env", "drift", "fetch_rows", "locked",
           "record_traffic", "record_until_killed"]

if __name__ == "__main__":
    record_until_killed(sys.argv[1], sys.argv[2])


def fetch_rows(url: str, statement: Any) -> list:
    """Run one SELECT against the database at ``url`` on a fresh engine; every row."""
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(statement).all())
    finally:
        engine.dispose()


REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python that imports this checkout and this module."""
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(REPO), str(here), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Another process's exclusive lock on the SQLite file at ``path``, held for the block."""
    locker = sqlite3.connect(path, timeout=0, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        locker.execute("ROLLBACK")
        locker.close()
