"""Storage: the database and the one path that writes it.

``store.py`` (``Store``: opening, upgrading and guarding a database at any SQLAlchemy URL),
``sqlite_file.py`` (what goes wrong with a SQLite file under a running process), ``schema.py`` (the
Alembic revision, migrations in ``migrations/``), ``models.py`` (the tables), ``writer.py`` (every
row of every table), ``text.py`` (every string made storable, once), ``retention.py`` (old traffic
windows folded into coarser ones).
"""

from capture_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "inspector.storage.store": (
        "DEFAULT_URL", "ENV_VAR", "Reader", "Store", "StoreCorrupt", "StoreUnavailable", "StoreVanished",
        "open_store", "resolve_url",
    ),
    "inspector.storage.schema": ("head_revision",),
    "inspector.storage.models": (
        "Base", "BatchSizeCount", "CompileRecord", "EagerFallback", "EagerTotal", "Graph", "ReplayTotal",
        "ReplayWindow", "Run", "StepSequence", "Violation", "WindowFold",
    ),
    "inspector.storage.writer": (
        "KnownTotals", "RunInfo", "RunWriter", "add_to_violation", "append_traffic", "graph_ids",
        "insert_violations", "record_compile_event", "update_run",
    ),
    "inspector.storage.text": ("column_limits", "storable", "storable_json"),
    "inspector.storage.retention": ("Policy", "Pruner", "Tier", "parse_duration", "prune", "time_bucket"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
