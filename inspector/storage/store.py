"""Where the inspector keeps its records: any SQLAlchemy URL, a SQLite file by default.

SQLite is tuned for one database shared by several recording processes and a reading daemon: WAL
(readers never block the writer), a busy timeout (writers queue instead of failing at once), and
write transactions that take the write lock up front (``BEGIN IMMEDIATE``), because a deferred
transaction that reads first and then writes fails at once, without waiting, when another process
committed in between.

Opening never overwrites a file it does not understand: a malformed URL, a corrupt or non-SQLite
file, another application's database or one written by a newer schema is refused with a clear
``DatabaseError`` and left as it was. A SQLite file is checked whole (``PRAGMA quick_check``)
before anything writes to it or reports from it, and every write transaction checks that the file
is still the one opened, and writable, before and after it commits (``inspector.storage.sqlite_file``).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, exc, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from inspector.errors import DatabaseError
from inspector.storage import schema
from inspector.storage.sqlite_file import (
    FileIdentity,
    GuardedConnection,
    identity,
    not_a_file,
    quick_check,
    unwritable_files,
)

ENV_VAR = "GRAPH_INSPECTOR_DB"
DEFAULT_URL = "sqlite:///graph-inspector.db"
BUSY_TIMEOUT_MS = 5000
MIGRATION_LOCK_KEY = 0x6772_6170_6869_6E73 & 0x7FFF_FFFF_FFFF_FFFF
"""PostgreSQL advisory-lock key that serialises concurrent upgrades."""


Reader = Connection | Session
"""What the read functions take: a connection, or a session of the dashboard's."""
DATABASE_ERRORS = (exc.SQLAlchemyError, sqlite3.Error, DatabaseError)
"""What a read raises when the database cannot answer (gone, locked, corrupt, behind the schema), as
opposed to a bug in the reader, which must not pass for an outage."""


class StoreUnavailable(DatabaseError):
    """The database exists (or could) but cannot be used right now: locked, unwritable, missing.

    The recorder treats this as transient and retries; commands report it and exit.
    """


class StoreVanished(StoreUnavailable):
    """The SQLite file was deleted or replaced under an open store: what a transaction wrote into
    it is gone with it. A writer opens the path again and writes again."""


class StoreCorrupt(DatabaseError):
    """The database file is damaged. Nothing writes to it or reports from it; it is left as it was."""


def resolve_url(url: str | None) -> str:
    """The database URL to use: the argument, else $GRAPH_INSPECTOR_DB, else the default file."""
    if url:
        return url
    return os.environ.get(ENV_VAR) or DEFAULT_URL


class Store:
    """An open database: an engine, sessions for readers, write transactions for the recorder. A
    context manager: a command that opens one for its own use writes ``with open_store(...) as
    store:``."""

    def __init__(self, url: str, engine: Engine) -> None:
        self.url = url
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._writer_engine = engine.execution_options(sqlite_begin="IMMEDIATE") if self.is_sqlite else engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self.sqlite_path = sqlite_file(engine.url)
        self._identity = self.file_identity()

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    @property
    def display_url(self) -> str:
        return self.engine.url.render_as_string(hide_password=True)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """An ORM session that commits on success and rolls back on error."""
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def writer(self) -> Iterator[Connection]:
        """A write transaction that holds the write lock from its first statement (SQLite).

        On a SQLite file it also checks, before the transaction and again once it holds the lock,
        that the file is still the one opened and writable (``StoreVanished``, ``StoreUnavailable``),
        and after the commit that the file is still there: a commit into a file deleted meanwhile
        raises ``StoreVanished``, for the caller to write again into the file at the path.
        """
        if self.sqlite_path is None:
            with self._writer_engine.begin() as conn:
                yield conn
            return
        self.check_file()
        with self._writer_engine.begin() as conn:
            self.check_file()
            yield conn
        if self.vanished():
            raise StoreVanished(
                f"{self.sqlite_path} was deleted or replaced while a transaction committed into it; "
                "what it wrote went with the old file"
            )

    def check_file(self) -> None:
        """Raise unless the SQLite file is the one opened and its files can be written."""
        assert self.sqlite_path is not None
        if self.vanished():
            raise StoreVanished(f"{self.sqlite_path} was deleted or replaced since it was opened")
        blocked = unwritable_files(self.sqlite_path)
        if blocked:
            names = ", ".join(path.name for path in blocked)
            raise StoreUnavailable(
                f"cannot write {self.display_url}: {names} cannot be written (read-only, or immutable)"
            )

    def upgrade(self) -> None:
        """Upgrade to the newest schema, one process at a time, refusing foreign or newer databases."""
        try:
            with self.engine.connect() as conn:
                schema.check_compatible(conn, self.display_url)
                if schema.current_revisions(conn) == (schema.head_revision(),):
                    return
            with self._writer_engine.connect() as conn:
                # A batch migration rebuilds a SQLite table by copy, drop and rename; with foreign
                # keys on, the drop would cascade into every child row. The pragma only takes
                # effect outside a transaction, hence on the driver connection, before BEGIN.
                self._sqlite_foreign_keys(conn, on=False)
                try:
                    with conn.begin():
                        if conn.dialect.name == "postgresql":
                            conn.execute(
                                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                            )
                        # Another process may have migrated while this one waited for the lock.
                        schema.check_compatible(conn, self.display_url)
                        schema.upgrade(conn)
                        if self.is_sqlite:
                            broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                            if broken:
                                raise DatabaseError(
                                    f"upgrading {self.display_url} would break {len(broken)} foreign "
                                    "key(s); the upgrade was rolled back"
                                )
                finally:
                    self._sqlite_foreign_keys(conn, on=True)
        except exc.DBAPIError as error:
            raise translate_error(error, self.display_url) from None

    def _sqlite_foreign_keys(self, conn: Connection, *, on: bool) -> None:
        if self.is_sqlite:
            conn.connection.driver_connection.execute(f"PRAGMA foreign_keys = {'ON' if on else 'OFF'}")

    def require_head(self) -> None:
        """Readers call this: a database behind this version's schema must be upgraded first."""
        current = self.current_revision()
        head = schema.head_revision()
        if current != head:
            raise DatabaseError(
                f"{self.display_url} is at schema revision {current or 'none (empty database)'} but this "
                f"version reads {head}: run `graph-inspector db upgrade --db URL` first"
            )

    def current_revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                revisions = schema.current_revisions(conn)
        except exc.DBAPIError as error:
            raise translate_error(error, self.display_url) from None
        return ",".join(revisions) or None

    def file_identity(self) -> FileIdentity | None:
        """The SQLite file's (device, inode), None when it does not exist (or is not a file DB)."""
        return None if self.sqlite_path is None else identity(self.sqlite_path)

    def remember_identity(self) -> None:
        """Note which file this store opened (SQLite creates it on the first connection)."""
        self._identity = self.file_identity()

    def vanished(self) -> bool:
        """True when the SQLite file was deleted or replaced since it was opened.

        An open SQLite connection keeps writing into a deleted file without error, so writers check
        this before they trust a commit.
        """
        return self.sqlite_path is not None and self.file_identity() != self._identity

    def dispose(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with open_store(url) as store:`` disposes of its engine however the block ends."""
        self.dispose()

    def let_go_after_fork(self) -> None:
        """In a forked child, with none of the parent's connections in use: let go of them. A SQLite
        file's are closed: SQLite keeps one record per process of a file's locks, and the copy a child
        inherits says the parent's locks are its own, so a connection the child opens would take no
        lock of its own (the parent's last close then deletes the write-ahead log under it) or wait
        for ever on a write lock the parent held; closing the copies clears that record and touches
        nothing of the parent's. Any other database's are dropped unclosed: closing would end the
        parent's session on the socket they share."""
        self.engine.dispose(close=self.is_sqlite)


def open_store(
    url: str | None = None, upgrade: bool = True, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS
) -> Store:
    """Open (and by default create or upgrade to head) the database at ``url``.

    With ``upgrade=False`` the database must already exist: readers (reports, the daemon) never
    create an empty file by accident.
    """
    resolved = resolve_url(url)
    parsed = _parse(resolved)
    path = sqlite_file(parsed)
    shown = parsed.render_as_string(hide_password=True)
    if path is not None:
        kind = not_a_file(path)
        if kind is not None:
            raise DatabaseError(f"cannot open {shown}: {path} is {kind}, not a database file")
        if not path.parent.is_dir():
            raise StoreUnavailable(f"cannot open {shown}: the directory {path.parent} does not exist")
        if not upgrade and not path.exists():
            raise DatabaseError(f"no database at {path} (record a run first, or pass --db / set {ENV_VAR})")
    if path is not None and upgrade and unwritable_files(path):
        names = ", ".join(p.name for p in unwritable_files(path))
        raise StoreUnavailable(f"cannot write {shown}: {names} cannot be written (read-only, or immutable)")
    engine = _create_engine(parsed, shown, busy_timeout_ms)
    store = Store(resolved, engine)
    try:
        with engine.connect() as conn:
            if path is not None and path.exists():
                # Before anything writes to the file (the WAL switch, a migration) or reads it for a
                # report: a damaged page would be written around or reported as if whole.
                _refuse_corrupt(conn, shown)
            # Reading the schema makes SQLite read the header: a non-database file fails here,
            # before anything has written to it.
            schema.check_compatible(conn, shown)
        if path is not None and upgrade:
            # Persistent in the file, so readers need not (and must not: they may lack write access).
            raw = engine.raw_connection()
            try:
                raw.cursor().execute("PRAGMA journal_mode = WAL")
            finally:
                raw.close()
    except (exc.DBAPIError, sqlite3.Error) as error:
        engine.dispose()
        raise translate_error(error, shown) from None
    except DatabaseError:
        engine.dispose()
        raise
    if upgrade:
        try:
            store.upgrade()
        except DatabaseError:
            engine.dispose()
            raise
    store.remember_identity()
    return store


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (exc.ArgumentError, ValueError) as error:
        raise DatabaseError(
            f"malformed database URL {url!r} ({error}); expected e.g. sqlite:///graph-inspector.db "
            "or postgresql+psycopg://user:password@host/dbname"
        ) from None
    return parsed


def _refuse_corrupt(conn: Connection, shown: str) -> None:
    problems = quick_check(conn)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise StoreCorrupt(
            f"{shown} is corrupt: SQLite's quick_check found {problems[0]!r}{more}; it was left untouched. "
            "Restore it from a backup, or point --db at a new file"
        )


def sqlite_file(url: URL | str) -> Path | None:
    """The file of a SQLite URL (None for another database, an in-memory one or a malformed URL)."""
    if isinstance(url, str):
        try:
            url = make_url(url)
        except (exc.ArgumentError, ValueError):
            return None
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or url.query.get("mode") == "memory":
        return None
    # os.path.realpath, not Path.resolve: resolve raises on a symlink loop, which open_store refuses.
    return Path(os.path.realpath(os.path.expanduser(database)))


def missing_file(url: str | None) -> Path | None:
    """The SQLite file ``url`` names (``resolve_url``'s) when nothing is there (a dangling symlink
    included); None otherwise: it exists, it is something ``open_store`` refuses, or the URL is not
    a SQLite file's."""
    path = sqlite_file(resolve_url(url))
    if path is None or not_a_file(path) is not None or path.exists():
        return None
    return path


def _create_engine(url: URL, shown: str, busy_timeout_ms: int) -> Engine:
    sqlite = url.get_backend_name() == "sqlite"
    try:
        # GuardedConnection: a connection to files that cannot be written is never closed (closing
        # writes to them: a SIGBUS for an immutable index; see inspector.storage.sqlite_file).
        engine = create_engine(url, connect_args={"factory": GuardedConnection} if sqlite else {})
    except exc.NoSuchModuleError:
        raise DatabaseError(
            f"unsupported database URL {shown}: no SQLAlchemy dialect {url.drivername!r} "
            "(use sqlite:///path.db or postgresql+psycopg://...)"
        ) from None
    except ImportError as error:
        raise DatabaseError(f"cannot use {shown}: its database driver is not installed ({error})") from None
    except exc.ArgumentError as error:
        raise DatabaseError(f"malformed database URL {shown}: {error}") from None
    if engine.dialect.name == "sqlite":
        _tune_sqlite(engine, busy_timeout_ms)
        # Many rows in one INSERT ... VALUES (...), (...) per batch (SQLAlchemy's "insertmanyvalues",
        # which its PostgreSQL psycopg2 dialect does by default) instead of an executemany: Python's
        # sqlite3 runs an executemany a row at a time, letting go of the GIL and taking it back for
        # each row, so a flush of a few hundred rows handed the GIL to and from the engine's serving
        # thread a few hundred times (bench/window_cost.py).
        engine.dialect.use_insertmanyvalues_wo_returning = engine.dialect.supports_multivalues_insert
    return engine


def _tune_sqlite(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        # Transactions are begun explicitly below (pysqlite's implicit BEGIN is always DEFERRED).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            # Per connection, writes nothing: WAL makes a commit durable against a process crash
            # without an fsync per transaction. (WAL itself is switched on once, by open_store.)
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


def translate_error(error: Exception, shown: str) -> DatabaseError:
    """A driver error as a message a user can act on."""
    original = getattr(error, "orig", None) or error
    message = (str(original).strip().splitlines() or [type(original).__name__])[0]
    lowered = message.lower()
    if "not a database" in lowered or "malformed" in lowered or "disk image" in lowered:
        return StoreCorrupt(f"{shown} is not a readable SQLite database ({message}); it was left untouched")
    if "locked" in lowered or "busy" in lowered:
        return StoreUnavailable(f"{shown} is locked by another process ({message})")
    if "readonly" in lowered or "read-only" in lowered or "unable to open" in lowered:
        return StoreUnavailable(f"cannot write {shown} ({message}): check the file's permissions")
    if isinstance(error, (exc.OperationalError, sqlite3.OperationalError)):
        return StoreUnavailable(f"cannot use {shown}: {message}")
    return DatabaseError(f"database error on {shown}: {message}")
