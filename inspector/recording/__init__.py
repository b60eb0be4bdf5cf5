"""Recording: what an engine's graph cache does, counted on the engine's thread and written by a
flush thread.

``recorder.py`` (``Recorder``, the observer and its thread's loop), ``flusher.py`` (what that
thread holds and writes), ``outage.py`` (its trouble with the database: backoff, a corrupt file
refused), ``batch.py`` (what one flush writes, as plain data), ``losses.py`` (what could not be
kept, and where that is written), ``process.py`` (what a run row says of its process),
``forks.py`` (what a fork does to recorders, and what they do about it).
"""

from capture_core.lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "inspector.recording.recorder": ("Recorder",),
    "inspector.recording.batch": (
        "FlushBatch", "GraphKey", "PendingViolation", "ReplayDelta", "TrafficWindow", "ViolationKey",
        "graph_key", "stored_key", "violation_key",
    ),
    "inspector.recording.losses": ("Losses", "Sidecar", "run_losses"),
    "inspector.recording.process": ("JOB_ENV",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
