"""Where the watch hears captures and replays: PyTorch's own CUDA-graph hooks, or patches.

A torch whose ``torch.cuda.graphs`` has the global lifecycle hooks (``register_graph_capture_start_hook``,
``register_graph_capture_end_hook``, ``register_graph_replay_end_hook``: PyTorch's main branch since
August 2026) is watched through them, and nothing of torch is replaced. Older torch (2.13 and
before, among them 2.11) has no such hooks, so the watch patches ``capture_begin``, ``capture_end``
and ``replay`` on ``torch.cuda.CUDAGraph``. ``Hooks.path`` says which ("torch hooks" or "patched").

The methods are patched on the class, not replaced in the module, so every graph sees them:
vLLM's and SGLang's ``torch.cuda.CUDAGraph()``, ``torch.cuda.graph(...)`` (which calls
``capture_begin``/``capture_end`` on the graph it is given; its own frames are skipped so the call
site is the engine's ``with`` line), torch.compile's cudagraph trees, and code that imported the
class by name before the watch started. ``uninstall`` puts back exactly the attributes that were
there (or removes ours where the class only inherited the method). ``make_graphed_callables`` is
wrapped on both paths: torch has no hook that says a capture belongs to one of its calls.

The replay hook is the hot path: one attribute read, one counter bump and, for sinks that want
it, the sink's ``on_replay`` (itself a counter bump). Everything else happens at capture time, and
everything the watch runs inside the program is guarded: a failure of its own is counted and said
once (``Watcher.contained_error``), never raised into the program.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from capture_core.modes import CUDAGraphMode
from inspector.watch.frames import capture_frames, find_call_site, named_tensors
from inspector.watch.identity import CallSite, CapturedInputs
from inspector.watch.pools import PoolId, pool_id
from inspector.watch.watcher import PendingCapture, Watcher

WATCHED_ATTR = "_graph_inspector_watched"
PENDING_ATTR = "_graph_inspector_pending"
_MISSING = object()
TORCH_HOOKS = "torch hooks"
PATCHED = "patched"
TORCH_HOOK_NAMES = (
    "register_graph_capture_start_hook",
    "register_graph_capture_end_hook",
    "register_graph_replay_end_hook",
)
"""PyTorch's global CUDA-graph lifecycle hooks (each called with the graph, returning a
``RemovableHandle``); the watch takes that path only where torch has all three."""


def has_torch_hooks(graphs_module: object) -> bool:
    return all(callable(getattr(graphs_module, name, None)) for name in TORCH_HOOK_NAMES)


@dataclass
class _GraphedCall:
    """One ``make_graphed_callables`` call in progress: its caller and sample inputs."""

    site: CallSite
    inputs: CapturedInputs
    captures: int = 0


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any


@dataclass
class Hooks:
    """Installs and removes the patches that feed one ``Watcher``."""

    watcher: Watcher
    graph_class: type = field(default_factory=lambda: torch.cuda.CUDAGraph)
    graphs_module: Any = field(default_factory=lambda: sys.modules["torch.cuda.graphs"])
    """Where torch's own CUDA-graph hooks would be (``torch.cuda.graphs``)."""
    _patches: list[_Patch] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    """The removable handles of torch's own hooks, on the TORCH_HOOKS path."""
    _local: threading.local = field(default_factory=threading.local)
    _watched_graphs: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def installed(self) -> bool:
        return bool(self._patches or self._handles)

    def install(self) -> None:
        if self._patches or self._handles:
            raise RuntimeError("graph-inspector watch hooks are already installed")
        cls = self.graph_class
        self._patch(cls, WATCHED_ATTR, None)  # what a graph captured before the watch reads
        if self.path == TORCH_HOOKS:
            module = self.graphs_module
            self._handles = [
                module.register_graph_capture_start_hook(self._on_capture_start),
                module.register_graph_capture_end_hook(self._on_capture_end),
                module.register_graph_replay_end_hook(self._counter()),
            ]
        else:
            self._patch(cls, "capture_begin", self._wrap_capture_begin(cls.capture_begin))
            self._patch(cls, "capture_end", self._wrap_capture_end(cls.capture_end))
            self._patch(cls, "replay", self._wrap_replay(cls.replay))
        graphs_module = sys.modules["torch.cuda.graphs"]
        original = graphs_module.make_graphed_callables
        wrapped = self._wrap_make_graphed_callables(original)
        for owner in (torch.cuda, graphs_module):
            if getattr(owner, "make_graphed_callables", None) is original:
                self._patch(owner, "make_graphed_callables", wrapped)

    @property
    def path(self) -> str:
        """How this torch is watched: through its own CUDA-graph hooks, or by patching the class."""
        if self.graph_class is torch.cuda.CUDAGraph and has_torch_hooks(self.graphs_module):
            return TORCH_HOOKS
        return PATCHED

    def uninstall(self) -> None:
        """Remove every hook and patch, last first, and forget the graphs' records."""
        for graph in list(self._watched_graphs):
            graph.__dict__.pop(WATCHED_ATTR, None)
        self._watched_graphs.clear()
        while self._handles:
            self._handles.pop().remove()
        while self._patches:
            patch = self._patches.pop()
            if patch.original is _MISSING:
                if vars(patch.owner).get(patch.name) is patch.replacement:
                    delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._patches.append(_Patch(owner, name, vars(owner).get(name, _MISSING), replacement))
        setattr(owner, name, replacement)

    # -- capture ---------------------------------------------------------------------------------

    def _wrap_capture_begin(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            if PENDING_ATTR in graph.__dict__:  # already capturing: torch refuses it, we keep the first
                return original(graph, *args, **kwargs)
            self._start(graph, pool_id(kwargs.get("pool", args[0] if args else None)), module_hook=True)
            try:
                return original(graph, *args, **kwargs)
            except BaseException:
                self._abandon(graph)
                raise

        return capture_begin

    def _wrap_capture_end(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = original(graph, *args, **kwargs)
            except BaseException:
                self._abandon(graph)
                raise
            self._finish(graph)
            return result

        return capture_end

    def _on_capture_start(self, graph: Any) -> None:
        """torch's capture-start hook: the capture is live, so nothing here may issue CUDA work
        (reading frames and the allocator's bookkeeping does not). No module pre-hook on this path:
        a capture that fails never reaches the end hook that would remove it."""
        if PENDING_ATTR not in graph.__dict__:
            self._start(graph, _graph_pool(graph), module_hook=False)

    def _on_capture_end(self, graph: Any) -> None:
        self._finish(graph)

    def _start(self, graph: Any, pool: PoolId | None, *, module_hook: bool) -> None:
        """Note the capture that is starting; never raises (a failure only loses this graph's record)."""
        began = time.perf_counter()
        try:
            frames = capture_frames(sys._getframe(1))
            while frames and frames[0].f_locals.get("self") is graph:
                del frames[0]  # the graph's own methods (where torch runs its hooks) are not the engine
            call: _GraphedCall | None = getattr(self._local, "graphed", None)
            if call is not None:
                label = f"graphed capture {call.captures}"
                call.captures += 1
                pending = self.watcher.capture_started(
                    frames, pool, site=call.site, inputs=call.inputs, label=label
                )
            else:
                pending = self.watcher.capture_started(frames, pool)
            del frames  # frames reference every local of the engine's stack: do not keep them
            if module_hook and not pending.inputs and not pending.inputless:
                pending.module_hook = self._watch_first_module_call(pending)
            graph.__dict__[PENDING_ATTR] = pending
        except Exception:
            self.watcher.contained_error("noting a capture")
        finally:
            self.watcher.hook_seconds += time.perf_counter() - began

    def _finish(self, graph: Any) -> None:
        """Record the capture that ended; never raises."""
        began = time.perf_counter()
        try:
            pending = self._abandon(graph)
            if pending is not None:
                graph.__dict__[WATCHED_ATTR] = self.watcher.capture_finished(pending, _graph_pool(graph))
                self._watched_graphs.add(graph)
        except Exception:
            self.watcher.contained_error("recording a capture")
        finally:
            self.watcher.hook_seconds += time.perf_counter() - began

    def _abandon(self, graph: Any) -> PendingCapture | None:
        """Forget a capture in progress (it ended or failed) and remove its module pre-hook."""
        pending: PendingCapture | None = graph.__dict__.pop(PENDING_ATTR, None)
        if pending is not None and pending.module_hook is not None:
            handle, pending.module_hook = pending.module_hook, None
            try:
                handle.remove()  # type: ignore[attr-defined]
            except Exception:
                self.watcher.contained_error("removing the capture's module pre-hook")
        return pending

    def _watch_first_module_call(self, pending: PendingCapture) -> object:
        """Inputs unseen in the frames (a loop at module level): take the first module call's.

        Only between capture_begin and capture_end, only on the capturing thread; the first module
        called is the outermost, whose arguments are what the captured code was called with.
        """
        watcher = self.watcher

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if pending.module_inputs or threading.get_ident() != pending.thread:
                return
            try:
                named = [item for i, arg in enumerate(args) for item in named_tensors(f"args[{i}]", arg)]
                if named:
                    prefix = type(module).__name__
                    pending.module_inputs = CapturedInputs.from_named((f"{prefix}.{n}", t) for n, t in named)
            except Exception:
                watcher.contained_error("reading a captured module's inputs")

        return torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)

    # -- replay (hot path) ---------------------------------------------------------------------

    def _counter(self) -> Callable[[Any], None]:
        """``count(graph)``: one replay of ``graph``. Every name in it is a local (global lookups
        cost here); the watched record is a plain attribute, a class-level None for graphs the
        watch did not see captured. A failing sink's ``on_replay`` is counted, never raised."""
        full = CUDAGraphMode.FULL
        watcher = self.watcher

        def count(graph: Any) -> None:
            watched = graph._graph_inspector_watched  # WATCHED_ATTR
            if watched is not None:
                watched.replays += 1
                on_replay = watched.on_replay
                if on_replay is not None:
                    try:
                        on_replay(full, watched.descriptor, watched.num_tokens)
                    except Exception:
                        watcher.sink_errors += 1

        return count

    def _wrap_replay(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """torch's ``replay(self)`` is called without argument packing when it takes no arguments."""
        count = self._counter()
        if _takes_only_self(original):

            @functools.wraps(original)
            def replay(graph: Any) -> Any:
                result = original(graph)
                count(graph)
                return result

            return replay

        @functools.wraps(original)
        def replay_with_arguments(graph: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(graph, *args, **kwargs)
            count(graph)
            return result

        return replay_with_arguments

    # -- make_graphed_callables --------------------------------------------------------------------

    def _wrap_make_graphed_callables(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def make_graphed_callables(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(self._local, "graphed", None)
            self._local.graphed = self._graphed_call(sys._getframe(1), sample_args) or outer
            try:
                return original(callables, sample_args, *args, **kwargs)
            finally:
                self._local.graphed = outer

        return make_graphed_callables

    def _graphed_call(self, caller: types.FrameType, sample_args: Any) -> _GraphedCall | None:
        """The caller and sample inputs of a ``make_graphed_callables`` call; None if unreadable."""
        try:
            frames = capture_frames(caller)
            site = dataclasses.replace(find_call_site(frames), via="torch.cuda.make_graphed_callables")
            del frames
            leaves = torch.utils._pytree.tree_leaves(sample_args)
            named = [(f"sample_args[{i}]", t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
            return _GraphedCall(site, CapturedInputs.from_named(named))
        except Exception:
            self.watcher.contained_error("reading a make_graphed_callables call")
            return None


def _takes_only_self(function: Callable[..., Any]) -> bool:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def _graph_pool(graph: Any) -> tuple[int, int] | None:
    try:
        return pool_id(graph.pool())
    except Exception:  # a graph class without pools (or a failed capture) has none to report
        return None
