"""Alembic migrations of the inspector's database (run in-process by ``inspector.storage.schema``)."""
