"""Watch any engine's CUDA graphs: hooks on ``torch.cuda.CUDAGraph`` for code that does not use
capture_core (vLLM, SGLang, torch.compile's cudagraph trees, a hand-written decode loop).

    from inspector.watch import install, mark_ready, uninstall
    install("sqlite:///graphs.db", ready_after=1000)   # or install(recorder) with any GraphObserver
    ...                                                 # the engine captures and replays as before
    mark_ready()                                        # start-up is over: later captures are flagged
    uninstall()                                         # originals restored, records flushed

``graph-inspector watch -- python script.py`` does the same for a whole script without editing it.

The names are loaded on first use: the start-up hook imports ``inspector.watch.launch`` in every
process of a watched command, and a process that never imports torch must not import it here.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "install": "inspector.watch.api",
    "uninstall": "inspector.watch.api",
    "mark_ready": "inspector.watch.api",
    "current": "inspector.watch.api",
    "Watcher": "inspector.watch.watcher",
    "WatchedGraph": "inspector.watch.watcher",
    "CompileEvent": "inspector.watch.watcher",
    "CompileEventKind": "inspector.watch.watcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inspector.watch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
