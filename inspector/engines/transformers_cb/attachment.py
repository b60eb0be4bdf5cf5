"""Attaching to transformers' continuous batching: ``attach()``, ``detach()``, ``current()``.

One attachment per process. It wraps ``ModelRunner``'s methods (``patches.py``), counts what each
step did in its ``Ledger`` and records through the inspector's Recorder: captures and eager batches
through the Recorder itself, each graph's replays (by real tokens) through the watch's flusher, which
keys them by graph (``inspector.watch.flush``). The Recorder starts at the first warm-up, step or
capture, so that the run's row carries transformers' resolved configuration and a process that
never batches leaves no empty run.

Nothing here raises into transformers once attached: a failure in the integration's own code is
caught where it happens, counted (``errors``) and logged once, and the step goes on unrecorded; a
database that cannot be opened at all stops the recording (``stopped``), said in one line.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason
from inspector.engines.transformers_cb.keys import CBKey
from inspector.engines.transformers_cb.ledger import CBGraph, Ledger
from inspector.engines.transformers_cb.patches import Patch, Transformers, graph_inputs, graphs_on, run_config
from inspector.engines.transformers_cb.version import refusal
from inspector.watch.identity import CapturedInputs
from inspector.watch.pools import PoolId, allocator_pool_bytes, pool_id
from inspector.watch.sink import RecorderSink, describe_device

log = logging.getLogger("graph_inspector.transformers")

DEFAULT_LABEL = "transformers continuous batching"

_lock = threading.Lock()
_active: Attachment | None = None


@dataclass
class RunnerState:
    """What the attachment knows of one ``ModelRunner`` (one manager's batch processor)."""

    index: int
    """1 for the first runner the attachment met, 2 for the next (a later ``generate_batch`` makes a
    new runner, with a new pool and new graphs)..."""
    in_warmup: bool = False


@dataclass
class _Step:
    """A step about to run: its real tokens and the graph it replays (None: it runs eagerly)."""

    num_real_tokens: int
    graph: CBGraph | None


@dataclass
class _Capture:
    """A capture about to run: its key, the step's real tokens, its pool and the pool's bytes."""

    state: RunnerState
    key: CBKey
    num_real_tokens: int
    pool: PoolId | None
    pool_bytes_before: int


class Attachment:
    """The integration attached in this process."""

    def __init__(
        self, transformers: Transformers, db: Any, *, label: str, flush_interval: float | None
    ) -> None:
        self.transformers = transformers
        self.db = db
        """A database URL (None: $GRAPH_INSPECTOR_DB, else the default file) or a Recorder."""
        self.label = label
        self.flush_interval = flush_interval
        self.ledger = Ledger()
        self.errors = 0
        """Failures inside the integration's own code, caught before they reached transformers."""
        self.stopped = ""
        """Why recording stopped (the database could not be opened), or "" while it goes on."""
        self.patch = Patch(transformers.model_runner, self)
        self._runners: weakref.WeakKeyDictionary[Any, RunnerState] = weakref.WeakKeyDictionary()
        self._runner_count = 0
        self._sink: RecorderSink | None = None
        self._recorder: Any = None
        self._owned_recorder: Any = None
        self._pool_marks: dict[PoolId, int] = {}
        """The reserved bytes of each graph pool as the last capture into it left them."""
        self._lock = threading.Lock()
        self._closed = False

    # -- the wrapped methods ------------------------------------------------------------------

    def warmup(self, runner: Any, model: Any, original: Callable[..., Any]) -> Any:
        state = self._contained(self._state, runner, model)
        if state is None:
            return original(runner, model)
        state.in_warmup = True
        try:
            return original(runner, model)
        finally:
            state.in_warmup = False

    def compute_batch(self, runner: Any, model: Any, batch_data: dict, original: Callable[..., Any]) -> Any:
        step = self._contained(self._before_step, runner, model)
        result = original(runner, model, batch_data)
        if step is not None:
            self._contained(self._after_step, step)
        return result

    def capture_graph(self, runner: Any, args: tuple[Any, ...], original: Callable[..., Any]) -> Any:
        capture = self._contained(self._before_capture, runner, args)
        began = time.perf_counter()
        result = original(runner, *args)
        seconds = time.perf_counter() - began
        if capture is not None:
            self._contained(self._after_capture, capture, seconds, args)
        return result

    # -- what they record ---------------------------------------------------------------------

    def _state(self, runner: Any, model: Any) -> RunnerState | None:
        if self.stopped:
            return None
        state = self._runners.get(runner)
        if state is None:
            if self._sink is None:
                self._start(runner, model)
                if self.stopped:
                    return None
            with self._lock:
                state = self._runners.get(runner)
                if state is None:  # numbered for good: a runner that is gone keeps its number
                    self._runner_count += 1
                    state = self._runners[runner] = RunnerState(index=self._runner_count)
        return state

    def _before_step(self, runner: Any, model: Any) -> _Step | None:
        state = self._state(runner, model)
        if state is None or state.in_warmup:
            return None  # warm-up's batches are made up: its captures are recorded, not its traffic
        io, pair = self.transformers.device_io(runner)
        real = io.total_seqlen_q
        if not graphs_on(runner, io):
            return _Step(real, None)
        key = io._get_graph_key()
        if io.graphs.get_graph(key) is None:
            return None  # transformers captures it in this step: the capture hook records it
        graph = self.ledger.graph((state.index, pair, key))
        if graph is None:  # captured before the integration was attached
            graph = self._adopt(CBKey(key, io.use_block_table, _sequences(io), pair, state.index))
        return _Step(real, graph)

    def _adopt(self, key: CBKey) -> CBGraph:
        graph, event = self.ledger.captured(key, seconds=0.0, pool_bytes=0, late=False,
                                            inputs=CapturedInputs(), seen_capture=False)
        self._sink.on_capture(event)  # type: ignore[union-attr]
        return graph

    def _after_step(self, step: _Step) -> None:
        graph = step.graph
        if graph is None:
            self._eager(EagerReason.MODE_NONE, step.num_real_tokens, CUDAGraphMode.NONE)
            return
        counts = graph.replays_by_real_tokens
        counts[step.num_real_tokens] = counts.get(step.num_real_tokens, 0) + 1

    def _before_capture(self, runner: Any, args: tuple[Any, ...]) -> _Capture | None:
        _forward_fn, _stream, model, *_ = args
        state = self._state(runner, model)
        if state is None:
            return None
        io, pair = self.transformers.device_io(runner)
        key = CBKey(io._get_graph_key(), io.use_block_table, _sequences(io), pair, state.index)
        pool = pool_id(runner.graph_pool_id)
        return _Capture(state, key, io.total_seqlen_q, pool, self._pool_mark(pool))

    def _after_capture(self, capture: _Capture, seconds: float, args: tuple[Any, ...]) -> None:
        pool_after = self._measure(capture.pool)
        if capture.pool is not None:
            self._pool_marks[capture.pool] = pool_after
        late = not capture.state.in_warmup
        _, event = self.ledger.captured(capture.key, seconds=seconds,
                                        pool_bytes=max(pool_after - capture.pool_bytes_before, 0),
                                        late=late, inputs=graph_inputs(args[2:]))
        self._sink.on_capture(event)  # type: ignore[union-attr]
        if late:  # this step's tokens came from transformers' eager forward before the capture
            self._eager(EagerReason.UNEXPECTED_CAPTURE, capture.num_real_tokens, CUDAGraphMode.FULL)

    def _eager(self, reason: EagerReason, num_real_tokens: int, mode: CUDAGraphMode) -> None:
        self.ledger.count_eager(reason, num_real_tokens)
        self._recorder.on_eager(reason, num_real_tokens, mode)

    def _pool_mark(self, pool: PoolId | None) -> int:
        mark = self._pool_marks.get(pool) if pool is not None else None
        return self._measure(pool) if mark is None else mark

    @staticmethod
    def _measure(pool: PoolId | None) -> int:
        return 0 if pool is None else allocator_pool_bytes(pool)

    # -- recording ----------------------------------------------------------------------------

    def _start(self, runner: Any, model: Any) -> None:
        """At the first runner: the Recorder (with transformers' configuration on the run) and the
        flusher of the graphs' replays."""
        with self._lock:
            if self._sink is not None or self.stopped:
                return
            try:
                recorder = self.db
                if recorder is None or isinstance(recorder, str):
                    from inspector.recording.recorder import Recorder

                    options = {} if self.flush_interval is None else {"flush_interval": self.flush_interval}
                    recorder = self._owned_recorder = Recorder(
                        recorder,
                        label=self.label,
                        config=run_config(runner, model, self.transformers.version),
                        device=describe_device(),
                        **options,
                    )
                sink = RecorderSink(recorder=recorder, label=self.label, flush_interval=self.flush_interval)
                sink.bind(self.ledger.graphs)
                sink.start()
            except Exception as error:  # a database that cannot be opened: generation goes on
                self.stopped = str(error) or type(error).__name__
                log.error("graph-inspector: not recording transformers' continuous batching: %s",
                          self.stopped)
                return
            self._recorder, self._sink = recorder, sink

    def _contained(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # the integration's own failure: the step goes on
            self.errors += 1
            if self.errors == 1:
                log.warning("graph-inspector: an error in the transformers integration was contained; "
                            "generation goes on", exc_info=True)
            return None

    @property
    def run_id(self) -> int | None:
        """The run's row id, once the Recorder has written it."""
        return None if self._recorder is None else self._recorder.run_id

    def summary(self) -> dict[str, Any]:
        return self.ledger.summary() | {"errors": self.errors, "stopped": self.stopped}

    def pause(self) -> None:
        """transformers' own methods back until ``resume``: its steps run exactly as unattached and
        are not recorded. Call it where no step runs (between ``generate_batch`` calls, or between a
        manager's ``stop`` and its next ``start``). A graph transformers captures while paused is
        taken up at its first replay after ``resume``, as one captured before ``attach``."""
        self.patch.uninstall()

    def resume(self) -> None:
        """Record again after ``pause`` (a no-op once detached)."""
        if not self._closed:
            self.patch.install()

    def close(self) -> None:
        """Put transformers' methods back, write what is left, end the run if the Recorder is ours."""
        self._closed = True
        self.patch.uninstall()
        if self._sink is not None:
            self._sink.close()
        if self._owned_recorder is not None:
            self._owned_recorder.close()
        summary = self.ledger.summary()
        log.info(
            "graph-inspector: transformers continuous batching: %d graphs (%d at warm-up, %d captured "
            "lazily after it in %.2f s), %d replays, %d eager batches, %d pool bytes",
            summary["graphs"], summary["start_up_graphs"], summary["late_captures"],
            summary["late_capture_seconds"], summary["replays"],
            sum(e["batches"] for e in summary["eager"].values()), summary["pool_bytes"],
        )


def _sequences(io: Any) -> int:
    """The request count a graph of this step is captured for: transformers' padded count."""
    return io._get_num_sequences(use_padding=True)


def attach(
    db: Any = None, *, label: str = DEFAULT_LABEL, flush_interval: float | None = None
) -> Attachment | None:
    """Record transformers' continuous batching in this process: every graph by transformers' own
    key, every step's real and padded tokens, late captures with their cost, pool memory.

    ``db``: a database URL (None: $GRAPH_INSPECTOR_DB, else ``sqlite:///graph-inspector.db``), or an
    inspector ``Recorder`` you started (left running at ``detach``). Call it before
    ``generate_batch`` (or before the manager is made); the steps after it are recorded.

    Returns None, having logged why in one line, where transformers is missing or is a release the
    integration does not read (``version.SUPPORTED``): the program runs on, unrecorded.
    """
    global _active
    try:
        transformers: Transformers | None = Transformers.load()
    except ImportError:
        transformers = None
    reason = refusal(None if transformers is None else transformers.version)
    if reason is None and transformers is not None and transformers.missing():
        reason = (f"graph-inspector: transformers {transformers.version} has no "
                  f"{', '.join(transformers.missing())}: not attached")
    if reason is not None or transformers is None:
        log.warning(reason)
        return None
    if isinstance(db, str):
        from inspector.storage.store import resolve_url

        resolve_url(db)  # a malformed URL is the caller's mistake: said here, not at the first step
    with _lock:
        if _active is not None:
            raise RuntimeError("graph-inspector is attached to transformers here already; detach() first")
        attachment = Attachment(transformers, db, label=label, flush_interval=flush_interval)
        attachment.patch.install()
        _active = attachment
    return attachment


def detach() -> None:
    """Undo ``attach()``: transformers' methods back, the last window written, the run ended."""
    global _active
    with _lock:
        attachment, _active = _active, None
    if attachment is not None:
        attachment.close()


def current() -> Attachment | None:
    return _active
