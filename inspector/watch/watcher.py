"""What the watch knows about the graphs of one process, and the records it sends for them.

The hooks (``hooks.py``) see raw capture and replay calls; the ``Watcher`` turns them into the
inspector's events: a ``CaptureEvent`` per graph (keyed by a ``WatchedDescriptor`` that carries the
graph's identity), a replay per ``replay()``, and violations for unexpected captures (after
``mark_ready()`` or after N replays with no new capture) and re-recording storms (a call site that
keeps capturing once its graphs are in use). torch.compile's skips (from its log line) and
re-records (read off the cudagraph trees' frames at the capture, see ``trees.py``) are
``CompileEvent``s. Everything goes to one sink: a ``GraphObserver`` such as the inspector's Recorder,
which may also take compile events. A failing sink never breaks the engine, and neither does a
failure in the watch's own code: both are caught, counted and said once.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, GraphObserver, ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from inspector.watch.frames import find_call_site, find_inputs, find_local_inputs, format_stack
from inspector.watch.identity import (
    KEY_LIMIT,
    WRAPPER_LIMIT,
    CallSite,
    CapturedInputs,
    GraphIdentity,
    WatchedDescriptor,
    digest,
)
from inspector.watch.pools import PoolId, PoolMeter, allocator_pool_bytes
from inspector.watch.trees import Rerecord, TreeCapture, tree_capture

log = logging.getLogger(__name__)

WATCH_BACKEND = "cuda"
"""Watched graphs are the engine's own torch.cuda.CUDAGraph objects."""


class CompileEventKind(str, enum.Enum):
    """What torch.compile's cudagraph trees did instead of (or besides) replaying a graph."""

    SKIP = "compile_skip"
    RERECORD = "compile_rerecord"


@dataclass(frozen=True)
class CompileEvent:
    """One skip ("skipping cudagraphs due to ...") or re-record, with the compiler's reason."""

    kind: CompileEventKind
    reason: str
    message: str
    function: str = ""
    seen_at: float = field(default_factory=time.time)


@runtime_checkable
class CompileEventSink(Protocol):
    def on_compile_event(self, event: CompileEvent) -> None: ...


@dataclass(eq=False)
class WatchedGraph:
    """One captured graph as the watch saw it. ``replays`` is bumped on every replay."""

    identity: GraphIdentity
    descriptor: WatchedDescriptor
    inputs: CapturedInputs
    pool: PoolId | None
    pool_bytes: int
    capture_seconds: float
    captured_at: float
    unexpected: bool
    repeat: int
    """How many captures of the same code and shapes came before this one (0: the first)."""
    mode: CUDAGraphMode = CUDAGraphMode.FULL
    """The runtime mode its capture, violations and replays are recorded under."""
    function: str = ""
    """The function whose graph this is: the compiled function for torch.compile's graphs (one
    ``wrapper`` per function, which the graphs page groups by), else the capturing code's function."""
    replays: int = 0
    replays_by_real_tokens: ClassVar[None] = None
    """The watch cannot see a batch's real tokens (see ``inspector.watch.flush``)."""
    on_replay: Callable[[CUDAGraphMode, BatchDescriptor, int], None] | None = None
    """The sink's per-replay call, bound once the capture was sent; None for sinks that read
    ``replays`` themselves (the Recorder sink), so a replay costs one integer bump."""
    num_tokens: int = field(init=False)
    """The descriptor's, as a plain attribute: the replay hook reads it every call."""

    def __post_init__(self) -> None:
        self.num_tokens = self.descriptor.num_tokens


@dataclass(eq=False)
class PendingCapture:
    """A capture between ``capture_begin`` and ``capture_end``."""

    site: CallSite
    inputs: CapturedInputs
    label: str
    stack: str
    pool_arg: PoolId | None
    pool_bytes_before: int
    unexpected_reason: str
    started: float
    started_at: float
    thread: int = field(default_factory=threading.get_ident)
    inputless: bool = False
    """An empty graph by design (the trees' pool keep-alive): no inputs to look for."""
    module_inputs: CapturedInputs = field(default_factory=CapturedInputs)
    local_inputs: CapturedInputs = field(default_factory=CapturedInputs)
    module_hook: object = None
    """The removable handle of the module pre-hook that looks for inputs when no frame showed any."""
    tree: TreeCapture | None = None
    """What torch.compile's cudagraph trees knew of this capture, when they made it."""


@dataclass
class _SiteHistory:
    graphs: list[WatchedGraph] = field(default_factory=list)
    late_captures: deque[float] = field(default_factory=deque)
    in_use: bool = False
    """Some graph of the site was replayed (once true, for good: no scan of its graphs again)."""


class Watcher:
    """The state of one watched process; thread-safe for captures, lock-free for replays."""

    def __init__(
        self,
        observer: GraphObserver,
        *,
        ready_after: int | None = None,
        storm_threshold: int = 3,
        storm_window_s: float = 60.0,
        pool_meter: PoolMeter = allocator_pool_bytes,
    ) -> None:
        if ready_after is not None and ready_after <= 0:
            raise ValueError(f"ready_after must be a positive number of replays, got {ready_after}")
        if storm_threshold < 1:
            raise ValueError(f"storm_threshold must be >= 1, got {storm_threshold}")
        self.observer = observer
        self._takes_compile_events = isinstance(observer, CompileEventSink)  # a slow check: once
        self.ready_after = ready_after
        self.storm_threshold = storm_threshold
        self.storm_window_s = storm_window_s
        self.pool_meter = pool_meter
        self.graphs: list[WatchedGraph] = []
        self.ready_reason = ""
        self.sink_errors = 0
        self.watch_errors = 0
        """Failures inside the watch's own hooks, caught before they reached the program."""
        self.hook_seconds = 0.0
        """What the watch's capture hooks took on the program's threads, in all (its replay
        counter is not timed: timing it would cost more than it does)."""
        self.compile_events: list[CompileEvent] = []
        self._lock = threading.Lock()
        self._sites: dict[str, _SiteHistory] = {}
        self._identity_counts: dict[str, int] = {}
        self._replays_at_last_capture = 0
        self._pool_marks: dict[PoolId, int] = {}
        """Reserved bytes of each pool right after the last watched capture into it."""

    @property
    def ready(self) -> bool:
        return bool(self.ready_reason)

    def mark_ready(self, reason: str = "mark_ready() was called") -> None:
        """From now on every capture is unexpected: start-up is over."""
        with self._lock:
            if not self.ready_reason:
                self.ready_reason = reason

    def replay_total(self) -> int:
        return sum(graph.replays for graph in self.graphs)

    def never_replayed(self) -> list[WatchedGraph]:
        return [graph for graph in self.graphs if graph.replays == 0]

    # -- capture -------------------------------------------------------------------------------

    def capture_started(
        self,
        frames: list[types.FrameType],
        pool_arg: PoolId | None,
        *,
        site: CallSite | None = None,
        inputs: CapturedInputs | None = None,
        label: str = "",
    ) -> PendingCapture:
        """Called before the engine's ``capture_begin`` runs: note where, what, and the pool before."""
        with self._lock:
            if not self.ready_reason and self.ready_after is not None:
                quiet = self.replay_total() - self._replays_at_last_capture
                if quiet >= self.ready_after:
                    self.ready_reason = f"{quiet} replays and no new capture (ready_after={self.ready_after})"
            unexpected_reason = self.ready_reason
        tree = None
        if inputs is None:
            named = find_inputs(frames)
            tree = self._read_trees(frames, [tensor for _, tensor in named])
            inputs = CapturedInputs.from_named(() if tree and tree.keeps_pool_alive else named)
        inputless = tree is not None and tree.keeps_pool_alive
        if tree is not None:
            site = site or tree.site
            label = label or ("pool keep-alive" if inputless else "")
        return PendingCapture(
            site=site or find_call_site(frames),
            inputs=inputs,
            inputless=inputless,
            local_inputs=CapturedInputs() if inputs or inputless else find_local_inputs(frames),
            label=label,
            stack=format_stack(frames) if unexpected_reason else "",
            pool_arg=pool_arg,
            pool_bytes_before=self._pool_mark(pool_arg),
            unexpected_reason=unexpected_reason,
            started=time.perf_counter(),
            started_at=time.time(),
            tree=tree,
        )

    def _read_trees(self, frames: list[types.FrameType], graph_inputs: list) -> TreeCapture | None:
        try:
            return tree_capture(frames, graph_inputs)
        except Exception:  # torch's frames read defensively: the capture goes on without them
            self.contained_error("reading torch.compile's cudagraph trees")
            return None

    def capture_finished(self, pending: PendingCapture, pool: PoolId | None) -> WatchedGraph:
        """Called after the engine's ``capture_end``: build the graph's record and send it."""
        seconds = time.perf_counter() - pending.started
        pool = pool or pending.pool_arg
        # A graph holds what its pool grew by since the pool's last capture: the capture itself
        # and, for torch.compile's trees, whose warm-up runs inside the pool, the warm-up's segments.
        # A graph in a new private pool starts from nothing.
        before = pending.pool_bytes_before if pool == pending.pool_arg else 0
        after = self._measure(pool)
        pool_bytes = max(after - before, 0)
        inputs = pending.inputs or pending.module_inputs or pending.local_inputs
        tree = pending.tree
        with self._lock:
            if pool is not None:
                self._pool_marks[pool] = after
            # The same code and shapes captured again gets the next ordinal: vLLM's piecewise
            # wrapper captures every layer slice from one line with one shape, and torch's own
            # captures repeat in a fixed order, so ordinals keep identities apart and stable.
            base = GraphIdentity(pending.site, inputs.shapes, pending.label).key
            repeat = self._identity_counts.get(base, 0)
            self._identity_counts[base] = repeat + 1
            label = f"{pending.label} capture {repeat + 1}".strip() if repeat else pending.label
            identity = GraphIdentity(pending.site, inputs.shapes, label, tree.shape if tree else None)
            history = self._sites.setdefault(identity.site.key, _SiteHistory())
            in_use = history.in_use = history.in_use or any(graph.replays for graph in history.graphs)
            graph = WatchedGraph(
                identity=identity,
                descriptor=identity.descriptor(),
                inputs=inputs,
                pool=pool,
                pool_bytes=pool_bytes,
                capture_seconds=seconds,
                captured_at=pending.started_at,
                unexpected=bool(pending.unexpected_reason),
                repeat=repeat,
                function=(tree.function if tree else "") or pending.site.function,
            )
            history.graphs.append(graph)
            self.graphs.append(graph)
            if self.ready_after is not None:  # a sum over every graph: only when it is used
                self._replays_at_last_capture = self.replay_total()
            storm = self._late_capture_count(history, pending.started_at) if in_use else 0

        self._send_capture(graph, pending)
        if not getattr(self.observer, "counts_replays_itself", False):
            graph.on_replay = self.observer.on_replay
        if pending.unexpected_reason:
            self._send_unexpected(graph, pending)
        if storm >= self.storm_threshold:
            self._send_storm(graph, storm)
        if tree is not None and tree.rerecord is not None:
            self._send_rerecord(graph, tree.rerecord)
        return graph

    def _late_capture_count(self, history: _SiteHistory, now: float) -> int:
        late = history.late_captures
        late.append(now)
        while late and now - late[0] > self.storm_window_s:
            late.popleft()
        return len(late)

    def _pool_mark(self, pool: PoolId | None) -> int:
        """The pool's reserved bytes as the last capture into it left them, else measured now."""
        with self._lock:
            mark = self._pool_marks.get(pool) if pool is not None else None
        return self._measure(pool) if mark is None else mark

    def _measure(self, pool: PoolId | None) -> int:
        if pool is None:
            return 0
        try:
            return int(self.pool_meter(pool))
        except Exception:  # a meter failure must not fail the engine's capture
            self.contained_error("measuring a graph pool")
            return 0

    def contained_error(self, doing: str) -> None:
        """A failure inside the watch's own code, caught where it happened: counted, said once."""
        self.watch_errors += 1
        if self.watch_errors == 1:
            log.warning(
                "graph-inspector watch: an error while %s was contained; the program goes on",
                doing,
                exc_info=True,
            )

    # -- records ---------------------------------------------------------------------------------

    def _send_capture(self, graph: WatchedGraph, pending: PendingCapture) -> None:
        event = CaptureEvent(
            descriptor=graph.descriptor,
            mode=graph.mode,
            backend=WATCH_BACKEND,
            wrapper=pending.site.text,
            input_names=graph.inputs.names,
            input_addresses=graph.inputs.addresses,
            capture_seconds=graph.capture_seconds,
            pool_bytes=graph.pool_bytes,
            warmup_iters=0,
            unexpected=graph.unexpected,
            captured_at=graph.captured_at,
        )
        self._deliver(self.observer.on_capture, event)

    def _send_unexpected(self, graph: WatchedGraph, pending: PendingCapture) -> None:
        event = ViolationEvent(
            kind=ViolationKind.UNEXPECTED_CAPTURE,
            descriptor=graph.descriptor,
            mode=graph.mode,
            wrapper=pending.site.text,
            message=(
                f"graph {graph.identity.key} was captured at {pending.site.text} after the process "
                f"was ready ({pending.unexpected_reason}): a capture on the serving path is a "
                "latency spike and new pool memory"
            ),
            stack=pending.stack,
            seen_at=graph.captured_at,
        )
        self._deliver(self.observer.on_violation, event)

    def _send_storm(self, graph: WatchedGraph, count: int) -> None:
        site = graph.identity.site
        what = "a shape it had captured before" if graph.repeat else "a new shape"
        event = ViolationEvent(
            kind=ViolationKind.RERECORD_STORM,
            descriptor=WatchedDescriptor(num_tokens=1, identity=site.key),
            mode=CUDAGraphMode.FULL,
            wrapper=site.text,
            message=(
                f"{site.text} captured {count} graphs within {self.storm_window_s:g} s after its "
                f"graphs were in use (re-recording instead of replaying); the latest was "
                f"{what}: {graph.identity.shapes_text}"
            ),
            seen_at=graph.captured_at,
        )
        self._deliver(self.observer.on_violation, event)

    def _send_rerecord(self, graph: WatchedGraph, rerecord: Rerecord) -> None:
        where = f"[{rerecord.compile_id}] " if rerecord.compile_id else ""
        shape = f" ({graph.identity.batch.text})" if graph.identity.batch else ""
        detail = f"; {rerecord.detail}" if rerecord.detail else ""
        message = f"{where}torch.compile re-recorded {graph.function}{shape}: {rerecord.reason}{detail}"
        self.compile_event(
            CompileEvent(
                kind=CompileEventKind.RERECORD,
                reason=rerecord.reason,
                message=message,
                function=graph.function,
                seen_at=graph.captured_at,
            )
        )

    def compile_event(self, event: CompileEvent) -> None:
        """A skip or re-record reported by torch.compile's cudagraph trees.

        A skip is also a violation: the compiler silently gave up on graphs for a function, which
        is what a user of ``mode="reduce-overhead"`` must be told (on every page and report that
        lists violations). Re-records are counted in ``compile_events`` and, when they pile up at
        one call site, show up as a re-recording storm.
        """
        self.compile_events.append(event)
        if self._takes_compile_events:
            self._deliver(self.observer.on_compile_event, event)  # type: ignore[attr-defined]
        if event.kind is CompileEventKind.SKIP:
            where = f"torch.compile {event.function}".strip()
            identity = _clip_key(f"torch.compile skip: {event.reason}", digest_of=event.reason)
            violation = ViolationEvent(
                kind=ViolationKind.COMPILE_SKIP,
                descriptor=WatchedDescriptor(num_tokens=1, identity=identity),
                mode=CUDAGraphMode.FULL,
                wrapper=where[:WRAPPER_LIMIT],
                message=event.message,
                seen_at=event.seen_at,
            )
            self._deliver(self.observer.on_violation, violation)

    def _deliver(self, method: object, event: object) -> None:
        try:
            method(event)  # type: ignore[operator]
        except Exception:
            self.sink_errors += 1
            if self.sink_errors == 1:
                log.warning("graph-inspector watch: the recorder failed; the engine goes on", exc_info=True)


def _clip_key(text: str, *, digest_of: str) -> str:
    tail = f" #{digest(digest_of)}"
    head = text if len(text) + len(tail) <= KEY_LIMIT else text[: KEY_LIMIT - len(tail) - 3] + "..."
    return head + tail
