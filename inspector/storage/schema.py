"""The database schema's version: Alembic, driven in code so an installed package migrates itself.

No alembic.ini is needed: the ``Config`` is built here and points at the migrations' folder.
Upgrades run on a connection whose transaction the caller holds (see ``Store.upgrade``), which is
how concurrent starters (four ranks at once) serialise on one database.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, inspect

from inspector.errors import DatabaseError

VERSION_TABLE = "alembic_version"


def migrations_dir() -> Path:
    """The Alembic revisions, found by path from this package, never imported by name (a project with
    a ``migrations`` package of its own would shadow them): ``inspector/migrations`` in an installed
    wheel (``setup.py`` puts them there, so the wheel installs nothing named ``migrations``), else the
    checkout's top-level ``migrations`` folder beside ``inspector``."""
    import inspector

    package = Path(inspector.__file__).resolve().parent
    folders = (package / "migrations", package.parent / "migrations")
    for folder in folders:
        if (folder / "env.py").is_file():
            return folder
    raise DatabaseError(f"graph-inspector's database migrations are missing (no env.py in {folders[0]} nor "
                        f"in {folders[1]}); reinstall graph-inspector")


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """An Alembic Config for this package's migrations, bound to ``connection`` when given."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        # ConfigParser treats % as interpolation; URLs may hold percent-encoded passwords.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@lru_cache(maxsize=1)
def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    head = script_directory().get_current_head()
    assert head is not None, f"no migration revisions in {migrations_dir()}"
    return head


def current_revisions(connection: Connection) -> tuple[str, ...]:
    """The revisions recorded in the database (empty for a database never migrated)."""
    return tuple(MigrationContext.configure(connection).get_current_heads())


def check_compatible(connection: Connection, where: str) -> None:
    """Refuse a database this version must not touch, before anything writes to it.

    - tables but no ``alembic_version``: another application's database;
    - a revision this package does not know: written by a newer graph-inspector.
    """
    tables = set(inspect(connection).get_table_names())
    if tables and VERSION_TABLE not in tables:
        listed = ", ".join(sorted(tables)[:5])
        raise DatabaseError(
            f"{where} is not a graph-inspector database: it holds other tables ({listed}) and no "
            f"{VERSION_TABLE} table; it was left untouched. Point --db at a new file instead."
        )
    script = script_directory()
    for revision in current_revisions(connection):
        try:
            known = script.get_revision(revision)
        except CommandError:
            known = None
        if known is None:
            raise DatabaseError(
                f"{where} was written by a newer graph-inspector (schema revision {revision!r}; this "
                f"version knows up to {head_revision()!r}). Upgrade graph-inspector to read it; the "
                "database was left untouched."
            )


def upgrade(connection: Connection) -> None:
    """Upgrade to head on ``connection``, inside the transaction the caller has begun."""
    command.upgrade(alembic_config(connection), "head")
