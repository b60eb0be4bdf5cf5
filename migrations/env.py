"""Alembic environment: migrates the connection that ``inspector.storage.schema`` hands over.

The inspector builds its Alembic ``Config`` in code (no alembic.ini needed, so an installed package
migrates its own database) and passes an open connection in ``config.attributes["connection"]``;
the caller owns that connection's transaction, which lets it serialise concurrent upgrades.
Batch mode is on because SQLite cannot ALTER most things in place.

A new revision, from a change to ``inspector/storage/models.py`` (the drift test fails until one exists):

    python3 -c "from alembic import command; from inspector.storage.schema import alembic_config; \\
        command.revision(alembic_config(url='sqlite:////tmp/dev.db'), 'what changed', autogenerate=True)"

(the URL is a scratch database at the current head; ``open_store`` creates one).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from inspector.storage.models import Base

target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("graph-inspector migrations run online only (against a connection or a URL)")
run_migrations_online()
