"""inspector: records what the graph cache does into a database, and reads it back.

``from inspector import Recorder`` is the observer an engine attaches to its ``GraphRuntime``; the
rest (queries, metrics, reports, the pytest plugin, ``watch``) is what the daemon and CI use. The
name resolves on first use, so ``import inspector.store`` does not start SQLAlchemy's ORM twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inspector.recorder import Recorder

__all__ = ["Recorder"]


def __getattr__(name: str) -> Any:
    if name == "Recorder":
        from inspector.recorder import Recorder

        globals()["Recorder"] = Recorder
        return Recorder
    raise AttributeError(f"module 'inspector' has no attribute {name!r}")
