"""The in-process API behind ``inspector.watch``: install, uninstall, mark_ready, current."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from capture_core.events import GraphObserver
from inspector.watch.compile_log import CompileLogTap
from inspector.watch.hooks import Hooks
from inspector.watch.sink import RecorderSink
from inspector.watch.watcher import Watcher


@dataclass
class _Installation:
    watcher: Watcher
    hooks: Hooks
    tap: CompileLogTap | None
    owned_sink: RecorderSink | None


_lock = threading.Lock()
_active: _Installation | None = None


def install(
    sink: GraphObserver | str | None = None,
    *,
    ready_after: int | None = None,
    storm_threshold: int = 3,
    storm_window_s: float = 60.0,
    label: str = "watch",
    compile_logs: bool = True,
    graph_class: type | None = None,
) -> Watcher:
    """Start watching every CUDA graph this process captures and replays.

    ``sink`` is a database URL (None: $GRAPH_INSPECTOR_DB, else the default SQLite file) recorded
    through the inspector's Recorder, started at the first capture so that processes which never
    capture leave no trace; or a Recorder you started (it is left running at ``uninstall``); or
    any other ``GraphObserver``, which then gets ``on_replay`` once per replay.
    ``ready_after``: after this many replays with no new capture, the process counts as ready and
    every later capture is an unexpected capture (``mark_ready()`` does it by hand).
    A re-recording storm is ``storm_threshold`` late captures at one call site within
    ``storm_window_s`` seconds. ``graph_class`` defaults to ``torch.cuda.CUDAGraph``.
    """
    global _active
    with _lock:
        if _active is not None:
            raise RuntimeError("graph-inspector watch is already installed here; call uninstall() first")
        owned = _recorder_sink(sink, label)
        watcher = Watcher(
            owned if owned is not None else sink,  # type: ignore[arg-type]
            ready_after=ready_after,
            storm_threshold=storm_threshold,
            storm_window_s=storm_window_s,
        )
        if owned is not None:
            owned.bind(watcher.graphs)
        hooks = Hooks(watcher) if graph_class is None else Hooks(watcher, graph_class)
        hooks.install()
        tap = None
        if compile_logs:
            tap = CompileLogTap(watcher.compile_event)
            tap.install()
        _active = _Installation(watcher, hooks, tap, owned)
        return watcher


def _recorder_sink(sink: object, label: str) -> RecorderSink | None:
    """A RecorderSink for a URL (its own Recorder) or an inspector Recorder; None for other sinks."""
    if sink is None or isinstance(sink, str):
        return RecorderSink(sink, label=label)
    from inspector.recording.recorder import Recorder

    if isinstance(sink, Recorder):
        return RecorderSink(recorder=sink, label=label)
    return None


def uninstall() -> None:
    """Remove every hook, restore the originals exactly, and flush records the watch owns."""
    global _active
    with _lock:
        installation, _active = _active, None
    if installation is None:
        return
    installation.hooks.uninstall()
    if installation.tap is not None:
        installation.tap.remove()
    if installation.owned_sink is not None:
        installation.owned_sink.close()


def mark_ready() -> None:
    """Start-up is over: every capture from now on is recorded as an unexpected capture."""
    installation = _active
    if installation is None:
        raise RuntimeError("graph-inspector watch is not installed; call install() first")
    installation.watcher.mark_ready()


def hooks_path() -> str | None:
    """How the active watch hears graphs: "torch hooks" (PyTorch's own) or "patched"; None if none."""
    installation = _active
    return None if installation is None else installation.hooks.path


def current() -> Watcher | None:
    """The active watch's state, or None."""
    installation = _active
    return None if installation is None else installation.watcher
