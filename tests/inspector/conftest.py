"""Inspector test setup: every store test runs against a real SQLite file and a real PostgreSQL.

The PostgreSQL server is Debian's (``tests.support.postgres``): one cluster per test session, one
fresh database per test, stopped at the end. Without the binaries the postgres cases skip and say
why; CI installs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import PostgresServer, throwaway_cluster


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        with throwaway_cluster() as server:
            yield server
    except FileNotFoundError as missing:
        pytest.skip(f"{missing}; CI installs them")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty database: a SQLite file, or a fresh database on the session's server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'inspector.db'}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.new_database()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'inspector.db'}"
