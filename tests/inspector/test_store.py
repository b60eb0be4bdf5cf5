"""The store: URL resolution, creation and upgrade to head, and refusing what it must not touch."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from inspector.errors import DatabaseError
from inspector.storage import schema
from inspector.storage.models import Base, Run
from inspector.storage.store import DEFAULT_URL, ENV_VAR, Store, StoreUnavailable, open_store, resolve_url
from inspector.storage.writer import RunInfo, insert_run


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resolve_url_prefers_argument_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_url(None) == DEFAULT_URL
    monkeypatch.setenv(ENV_VAR, "sqlite:///from-env.db")
    assert resolve_url(None) == "sqlite:///from-env.db"
    assert resolve_url("sqlite:///from-arg.db") == "sqlite:///from-arg.db"


def test_empty_database_upgrades_to_head_without_drift(db_url: str) -> None:
    store = open_store(db_url)
    try:
        assert store.current_revision() == schema.head_revision()
        with store.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            tables = set(inspect(conn).get_table_names())
        assert diff == [], f"models and migrations disagree: {diff}"
        assert set(Base.metadata.tables) <= tables
    finally:
        store.dispose()


def test_reopening_keeps_rows_and_revision(db_url: str) -> None:
    store = open_store(db_url)
    with store.writer() as conn:
        insert_run(conn, RunInfo("kept", "h", 1, "p", 0, 1, "cpu", "{}", 1.0), now=1.0)
    store.dispose()
    again = open_store(db_url)
    try:
        with again.session() as session:
            assert session.scalars(select(Run.label)).all() == ["kept"]
        assert again.current_revision() == schema.head_revision()
    finally:
        again.dispose()


def test_a_store_used_as_a_context_manager_is_disposed_however_the_block_ends(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    disposed = []
    monkeypatch.setattr(Store, "dispose", lambda self: disposed.append(self))
    with open_store(sqlite_url) as store:
        assert store.current_revision() == schema.head_revision()
    assert disposed == [store]
    with pytest.raises(KeyError), open_store(sqlite_url) as failing:
        raise KeyError("the block failed")
    assert disposed == [store, failing]


def test_session_rolls_back_on_error(sqlite_url: str) -> None:
    store = open_store(sqlite_url)
    with pytest.raises(RuntimeError), store.session() as session:
        session.add(_run("lost"))
        session.flush()
        raise RuntimeError("boom")
    with store.session() as session:
        assert session.scalars(select(Run)).all() == []


def test_sqlite_store_uses_wal_and_a_busy_timeout(sqlite_url: str) -> None:
    store = open_store(sqlite_url, busy_timeout_ms=1234)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


@pytest.mark.parametrize("url", ["not a url", "sqlite//missing-colon.db", "nosuchdialect://x/y"])
def test_malformed_url_is_a_clear_error(url: str) -> None:
    with pytest.raises(DatabaseError, match=r"(?i)malformed|unsupported"):
        open_store(url)


def test_missing_directory_is_reported_as_unavailable(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="does not exist"):
        open_store(f"sqlite:///{tmp_path / 'nope' / 'x.db'}")


def test_reader_does_not_create_a_missing_database(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    with pytest.raises(DatabaseError, match="no database"):
        open_store(f"sqlite:///{path}", upgrade=False)
    assert not path.exists()


def test_non_sqlite_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 200)
    before = _digest(path)
    with pytest.raises(DatabaseError, match="not a readable SQLite database"):
        open_store(f"sqlite:///{path}")
    assert _digest(path) == before
    assert not Path(f"{path}-wal").exists()


def test_corrupt_sqlite_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.executemany("INSERT INTO t VALUES (?)", [("x" * 500,)] * 50)
    conn.commit()
    conn.close()
    data = bytearray(path.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)  # keep the header, wreck the schema page
    path.write_bytes(bytes(data))
    before = _digest(path)
    with pytest.raises(DatabaseError, match="not a readable SQLite database"):
        open_store(f"sqlite:///{path}")
    assert _digest(path) == before


def test_another_applications_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.commit()
    conn.close()
    before = _digest(path)
    with pytest.raises(DatabaseError, match="not a graph-inspector database"):
        open_store(f"sqlite:///{path}")
    assert _digest(path) == before


def test_database_from_a_newer_schema_is_refused_and_left_untouched(db_url: str, tmp_path: Path) -> None:
    store = open_store(db_url)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    store.dispose()
    with pytest.raises(DatabaseError, match="newer graph-inspector"):
        open_store(db_url)
    with pytest.raises(DatabaseError, match="newer graph-inspector"):
        open_store(db_url, upgrade=False)
    assert _raw_revision(db_url) == "ffff_from_the_future"


def _raw_revision(url: str) -> str:
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
    finally:
        engine.dispose()


def test_older_schema_upgrades_step_by_step_keeping_rows(db_url: str) -> None:
    from alembic import command
    from sqlalchemy import create_engine

    engine = create_engine(db_url)
    with engine.begin() as conn:
        command.upgrade(schema.alembic_config(conn), "0001")
        conn.execute(
            text(
                "INSERT INTO runs (label, host, pid, process, rank, world_size, device, backend, config, "
                "started_at, last_seen_at, dropped_events) "
                "VALUES ('old', 'h', 1, 'p', 0, 1, 'cpu', 'eager', '{}', 1.0, 1.0, 0)"
            )
        )
    engine.dispose()
    assert _raw_revision(db_url) == "0001"
    store = open_store(db_url)
    try:
        assert store.current_revision() == schema.head_revision()
        with store.session() as session:
            assert session.scalars(select(Run.label)).all() == ["old"]
        assert "replay_totals" in inspect(store.engine).get_table_names()
    finally:
        store.dispose()


def test_a_migration_that_rebuilds_a_parent_table_keeps_the_child_rows(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlalchemy as sa
    from alembic import command
    from alembic.operations import Operations

    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        command.upgrade(schema.alembic_config(conn), "0001")
        conn.execute(
            text(
                "INSERT INTO runs (id, label, host, pid, process, rank, world_size, device, backend, config, "
                "started_at, last_seen_at, dropped_events) "
                "VALUES (1, 'r', 'h', 1, 'p', 0, 1, 'cpu', 'eager', '{}', 1.0, 1.0, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO graphs (run_id, wrapper, backend, input_names, input_addresses, "
                "capture_seconds, pool_bytes, warmup_iters, num_segments, num_ubatches, ubatch_slices, "
                "unexpected, captured_at, mode, num_tokens, num_reqs, uniform, has_lora, num_active_loras, "
                "descriptor_key) "
                "VALUES (1, 'w', 'eager', '[]', '[]', 0.1, 0, 1, 1, 1, '[]', 0, 1.0, "
                "'full', 4, 4, 1, 0, 0, 'k')"
            )
        )
    engine.dispose()
    real_upgrade = schema.upgrade

    def upgrade_and_rebuild_runs(conn) -> None:
        # What a future batch migration of `runs` does on SQLite: copy, drop, rename.
        real_upgrade(conn)
        operations = Operations(MigrationContext.configure(conn))
        with operations.batch_alter_table("runs", recreate="always") as batch:
            batch.alter_column("label", existing_type=sa.String(200), existing_nullable=False)

    monkeypatch.setattr(schema, "upgrade", upgrade_and_rebuild_runs)
    store = open_store(sqlite_url)
    try:
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM graphs")).scalar() == 1
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        store.dispose()


def _run(label: str) -> Run:
    """A minimal runs row as an ORM object (what a session's rollback must discard)."""
    return Run(
        label=label, host="h", pid=1, process="p", rank=0, world_size=1, device="cpu",
        backend="eager", config="{}", started_at=1.0, last_seen_at=1.0, dropped_events=0,
    )
