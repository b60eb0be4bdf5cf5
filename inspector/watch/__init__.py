"""Watch any engine's CUDA graphs: hooks on ``torch.cuda.CUDAGraph`` for code that does not use
capture_core (vLLM, SGLang, torch.compile's cudagraph trees, a hand-written decode loop).

    from inspector.watch import install, mark_ready, uninstall
    install("sqlite:///graphs.db", ready_after=1000)   # or install(recorder) with any GraphObserver
    ...                                                 # the engine captures and replays as before
    mark_ready()                                        # start-up is over: later captures are flagged
    uninstall()                                         # originals restored, records flushed

``graph-inspector watch -- python script.py`` does the same for a whole script without editing it.

What is recorded, per process (one run per rank): every graph as a ``graphs`` row (mode "full",
backend "cuda", ``wrapper`` = the capture call site, or for torch.compile's graphs the compiled
function and where it is defined, ``... in LlamaForCausalLM.forward via torch.compile``;
``descriptor_key`` = call site + input shapes + a digest, or for compiled functions the function and
its batch, sequence and cache sizes where the inputs show them; ``captured_size`` = the first input's
leading dimension, or batch x sequence, with the batch as ``num_reqs``; ``pool_bytes`` = what the
graph's pool grew by since its previous capture); replays per graph in
``replay_windows``/``replay_totals``; unexpected captures, re-recording storms and torch.compile
skips in ``violations`` (``unexpected_capture``, ``rerecord_storm``, ``compile_skip``); skips and
re-records with the compiler's reason in ``compile_events``. Graphs never replayed are those with
no replays (``watch_summary`` lists them).

Limits: Python started with ``-I``, ``-S`` or ``-E`` skips the start-up hook, so the command cannot
watch it (call ``install()`` in the program instead); a process forked after the first capture
does not inherit a working recorder; torch.compile's cudagraph trees capture one empty graph per
device to keep their pool alive, which is recorded under the compiled function whose first run made
the trees (labelled "pool keep-alive", never replayed).

What it costs the program: nothing where no graph is captured (no code of the watch runs per step);
a counter bump per replay; the capture work at each capture (``Watcher.hook_seconds`` totals it);
and writes once per interval on its own thread, never woken by a capture.

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
