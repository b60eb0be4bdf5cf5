"""inspector: records what the graph cache does into a database, and reads it back.

The records flow through stages, a folder each:

- ``recording/``: the engine's observer (``Recorder``) and its flush thread, what one flush writes,
  what a run row says of its process, and what could not be kept;
- ``storage/``: the database (``Store``), its tables and schema, the one write path, text made
  storable, and retention;
- ``ranks/``: a rank's step sequence, and the ranks of one job checked against each other;
- ``reading/``: every question the daemon and the CLI ask (``Queries``), traffic figures, the
  in-memory time series, and the Prometheus collector;
- ``gating/``: CI: reports, baselines and the regression gate, and the pytest plugin;

beside them ``advice/`` (capture-size advice), ``watch/`` (engines watched from outside) and
``commands/`` (the CLI's subcommands of this package). Recording and storage never import reading
or gating (``tests/test_import_direction.py``).

``from inspector import Recorder`` is the observer an engine attaches to its ``GraphRuntime``.
Every package here exports its public names lazily (``capture_core.lazy``), so importing one
module does not load the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capture_core.lazy import lazy_exports

if TYPE_CHECKING:
    from inspector.recording.recorder import Recorder as Recorder

_EXPORTS: dict[str, tuple[str, ...]] = {"inspector.recording.recorder": ("Recorder",)}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
