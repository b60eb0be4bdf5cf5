"""The patches: ``torch.cuda.CUDAGraph`` capture and replay, and ``make_graphed_callables``.

The methods are patched on the class, not replaced in the module, so every graph sees them:
vLLM's and SGLang's ``torch.cuda.CUDAGraph()``, ``torch.cuda.graph(...)`` (which calls
``capture_begin``/``capture_end`` on the graph it is given; its own frames are skipped so the call
site is the engine's ``with`` line), torch.compile's cudagraph trees, and code that imported the
class by name before the watch started. ``uninstall`` puts back exactly the attributes that were
there (or removes ours where the class only inherited the method).

The replay patch is the hot path: the original replay, one dict lookup, one counter bump and the
sink's ``on_replay`` (itself a counter bump). Everything else happens at capture time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from capture_core.modes import CUDAGraphMode
from inspector.watch.identity import CallSite, CapturedInputs, capture_frames, find_call_site, named_tensors
from inspector.watch.pools import pool_id
from inspector.watch.watcher import PendingCapture, Watcher

WATCHED_ATTR = "_graph_inspector_watched"
PENDING_ATTR = "_graph_inspector_pending"
_MISSING = object()


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
    _patches: list[_Patch] = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)
    _watched_graphs: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def install(self) -> None:
        if self._patches:
            raise RuntimeError("graph-inspector watch hooks are already installed")
        cls = self.graph_class
        self._patch(cls, WATCHED_ATTR, None)  # what a graph captured before the watch reads
        self._patch(cls, "capture_begin", self._wrap_capture_begin(cls.capture_begin))
        self._patch(cls, "capture_end", self._wrap_capture_end(cls.capture_end))
        self._patch(cls, "replay", self._wrap_replay(cls.replay))
        graphs_module = sys.modules["torch.cuda.graphs"]
        original = graphs_module.make_graphed_callables
        wrapped = self._wrap_make_graphed_callables(original)
        for owner in (torch.cuda, graphs_module):
            if getattr(owner, "make_graphed_callables", None) is original:
                self._patch(owner, "make_graphed_callables", wrapped)

    def uninstall(self) -> None:
        """Restore every patched attribute, last patched first, and forget the graphs' records."""
        for graph in list(self._watched_graphs):
            graph.__dict__.pop(WATCHED_ATTR, None)
        self._watched_graphs.clear()
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
            self._start(graph, args, kwargs)
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
            pending = self._abandon(graph)
            if pending is not None:
                graph.__dict__[WATCHED_ATTR] = self.watcher.capture_finished(pending, _graph_pool(graph))
                self._watched_graphs.add(graph)
            return result

        return capture_end

    def _start(self, graph: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        frames = capture_frames(sys._getframe(2))
        pool = pool_id(kwargs.get("pool", args[0] if args else None))
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
        if not pending.inputs:
            pending.module_hook = self._watch_first_module_call(pending)
        graph.__dict__[PENDING_ATTR] = pending

    def _abandon(self, graph: Any) -> PendingCapture | None:
        """Forget a capture in progress (it ended or failed) and remove its module pre-hook."""
        pending: PendingCapture | None = graph.__dict__.pop(PENDING_ATTR, None)
        if pending is not None and pending.module_hook is not None:
            pending.module_hook.remove()  # type: ignore[attr-defined]
            pending.module_hook = None
        return pending

    @staticmethod
    def _watch_first_module_call(pending: PendingCapture) -> object:
        """Inputs unseen in the frames (a loop at module level): take the first module call's.

        Only between capture_begin and capture_end, only on the capturing thread; the first module
        called is the outermost, whose arguments are what the captured code was called with.
        """

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if pending.module_inputs or threading.get_ident() != pending.thread:
                return
            named = [item for i, arg in enumerate(args) for item in named_tensors(f"args[{i}]", arg)]
            if named:
                prefix = type(module).__name__
                pending.module_inputs = CapturedInputs.from_named((f"{prefix}.{n}", t) for n, t in named)

        return torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)

    # -- replay (hot path) ---------------------------------------------------------------------

    def _wrap_replay(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The hot path. Every name in it is a local or an argument (global lookups cost here);
        the watched record is a plain attribute (a class-level None when the graph is unknown),
        and torch's ``replay(self)`` is called without argument packing when it takes none."""
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

        if _takes_only_self(original):

            @functools.wraps(original)
            def replay(graph: Any) -> Any:
                result = original(graph)
                watched = graph._graph_inspector_watched  # WATCHED_ATTR
                if watched is not None:
                    watched.replays += 1
                    on_replay = watched.on_replay
                    if on_replay is not None:
                        try:
                            on_replay(full, watched.descriptor, watched.num_tokens)
                        except Exception:
                            watcher.sink_errors += 1
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
            frames = capture_frames(sys._getframe(1))
            site = dataclasses.replace(find_call_site(frames), via="torch.cuda.make_graphed_callables")
            del frames
            leaves = torch.utils._pytree.tree_leaves(sample_args)
            named = [(f"sample_args[{i}]", t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
            outer = getattr(self._local, "graphed", None)
            self._local.graphed = _GraphedCall(site, CapturedInputs.from_named(named))
            try:
                return original(callables, sample_args, *args, **kwargs)
            finally:
                self._local.graphed = outer

        return make_graphed_callables


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
