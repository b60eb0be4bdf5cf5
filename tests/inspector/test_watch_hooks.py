"""The watch's hooks on the real ``torch.cuda.CUDAGraph`` class, run on the eager stand-in."""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from test_watch_standin import eager_cuda_graphs
from torch.utils.hooks import RemovableHandle

from capture_core.events import CaptureEvent, ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from inspector import watch
from inspector.watch.compile_log import OLDER_SKIP_LOGGER, SKIP_LOGGER
from inspector.watch.hooks import WATCHED_ATTR, Hooks
from inspector.watch.identity import KEY_LIMIT, WatchedDescriptor
from inspector.watch.watcher import CompileEvent, CompileEventKind, Watcher


class Collector:
    """A GraphObserver that keeps everything, as a test double for the Recorder."""

    def __init__(self) -> None:
        self.captures: list[CaptureEvent] = []
        self.replays: list[tuple[CUDAGraphMode, WatchedDescriptor, int]] = []
        self.violations: list[ViolationEvent] = []
        self.compile_events: list[CompileEvent] = []

    def on_capture(self, event: CaptureEvent) -> None:
        self.captures.append(event)

    def on_replay(self, mode: CUDAGraphMode, descriptor: WatchedDescriptor, num_real_tokens: int) -> None:
        self.replays.append((mode, descriptor, num_real_tokens))

    def on_eager(self, *args: object) -> None:
        raise AssertionError("a watch never reports eager batches")

    def on_violation(self, event: ViolationEvent) -> None:
        self.violations.append(event)

    def on_compile_event(self, event: CompileEvent) -> None:
        self.compile_events.append(event)

    def kinds(self) -> list[ViolationKind]:
        return [v.kind for v in self.violations]


@pytest.fixture
def collector() -> Iterator[Collector]:
    with eager_cuda_graphs():
        sink = Collector()
        yield sink
        watch.uninstall()


MODEL = torch.nn.Linear(4, 4)


def capture(x: torch.Tensor, pool: object = None) -> torch.cuda.CUDAGraph:
    """How vLLM-style code captures: a function called with the static inputs."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    MODEL(x)
    graph.capture_end()
    return graph


def test_uninstall_restores_every_original_exactly() -> None:
    cls = torch.cuda.CUDAGraph
    before = {name: cls.__dict__[name] for name in ("capture_begin", "capture_end", "replay")}
    mgc = (torch.cuda.make_graphed_callables, torch.cuda.graphs.make_graphed_callables)
    watch.install(Collector())
    try:
        assert all(cls.__dict__[name] is not fn for name, fn in before.items())
        assert torch.cuda.make_graphed_callables is not mgc[0]
        with pytest.raises(RuntimeError, match="already installed"):
            watch.install(Collector())
    finally:
        watch.uninstall()
    assert {name: cls.__dict__[name] for name in before} == before
    assert WATCHED_ATTR not in cls.__dict__
    assert all(cls.__dict__[name] is fn for name, fn in before.items())
    assert (torch.cuda.make_graphed_callables, torch.cuda.graphs.make_graphed_callables) == mgc
    assert logging.getLogger(SKIP_LOGGER).filters == [] and logging.getLogger(OLDER_SKIP_LOGGER).filters == []
    watch.uninstall()  # a second uninstall is a no-op


def test_uninstall_removes_patches_from_a_class_that_only_inherited_them(collector: Collector) -> None:
    class EngineGraph(torch.cuda.CUDAGraph):
        """An engine's subclass that defines no methods of its own."""

    watch.install(collector, graph_class=EngineGraph)
    assert "replay" in vars(EngineGraph)
    graph = EngineGraph()
    graph.capture_begin()
    graph.capture_end()
    graph.replay()
    assert len(collector.captures) == 1 and len(collector.replays) == 1
    watch.uninstall()
    assert not {"capture_begin", "capture_end", "replay", WATCHED_ATTR} & set(vars(EngineGraph))
    assert WATCHED_ATTR not in vars(graph)  # a later watch starts from a clean slate


def test_identity_is_call_site_and_shapes_and_stable_across_watches(collector: Collector) -> None:
    watch.install(collector)
    x8, x2 = torch.zeros(8, 4), torch.zeros(2, 4)
    capture(x8)
    capture(x2)
    watch.uninstall()
    watch.install(collector)
    capture(x8)
    first, second, again = collector.captures
    assert first.descriptor.key == again.descriptor.key != second.descriptor.key
    assert first.descriptor.key.startswith("test_watch_hooks.py:") and "[8x4]" in first.descriptor.key
    assert len(first.descriptor.key) <= KEY_LIMIT
    assert first.wrapper.endswith("in capture") and "test_watch_hooks.py:" in first.wrapper
    assert (first.descriptor.num_tokens, second.descriptor.num_tokens) == (8, 2)
    assert first.input_names == ("x",) and first.input_addresses == (x8.data_ptr(),)
    assert first.mode is CUDAGraphMode.FULL and first.backend == "cuda"
    assert isinstance(first.descriptor, WatchedDescriptor)


def test_the_same_code_and_shapes_captured_again_get_the_next_ordinal(collector: Collector) -> None:
    """vLLM's piecewise wrapper captures every layer slice from one line with one shape."""
    watch.install(collector)
    x = torch.zeros(8, 4)
    for _ in range(3):
        capture(x)
    keys = [c.descriptor.key for c in collector.captures]
    assert len(set(keys)) == 3
    assert " capture 2 #" in keys[1] and " capture 3 #" in keys[2] and " capture" not in keys[0]
    assert not collector.violations  # repeats at start-up are not a storm


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


@pytest.fixture
def cuda_api_on_cpu(collector: Collector, monkeypatch: pytest.MonkeyPatch) -> Collector:
    """torch.cuda's stream and sync calls as no-ops, so ``torch.cuda.graph`` and
    ``make_graphed_callables`` run their real Python code on the eager stand-in."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda.graphs, "graph_pool_handle", lambda: (0, 424242))
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    return collector


def test_torch_cuda_graph_names_the_with_line_not_torch(cuda_api_on_cpu: Collector) -> None:
    watch.install(cuda_api_on_cpu)
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(5, 4)
    with torch.cuda.graph(graph):
        MODEL(x)
    (event,) = cuda_api_on_cpu.captures
    assert "in test_torch_cuda_graph_names_the_with_line_not_torch" in event.wrapper
    assert "graphs.py" not in event.wrapper and "via" not in event.wrapper
    assert event.input_names == ("Linear.args[0]",) and event.descriptor.num_tokens == 5


def test_make_graphed_callables_captures_are_labelled_by_the_call(cuda_api_on_cpu: Collector) -> None:
    watch.install(cuda_api_on_cpu)
    module = torch.nn.Linear(4, 4)
    sample = torch.zeros(6, 4, requires_grad=True)
    torch.cuda.make_graphed_callables(module, (sample,), num_warmup_iters=1)
    forward, backward = cuda_api_on_cpu.captures
    assert "graphed capture 0" in forward.descriptor.key and "graphed capture 1" in backward.descriptor.key
    assert all("in test_make_graphed_callables_captures" in c.wrapper for c in (forward, backward))
    assert forward.wrapper.endswith("via torch.cuda.make_graphed_callables")
    assert forward.input_names == ("sample_args[0]",) and forward.input_addresses == (sample.data_ptr(),)
    assert forward.descriptor.num_tokens == 6 and not cuda_api_on_cpu.violations


class SlicingRunner:
    """How SGLang-style runners capture: slice static buffers into locals, call forward directly."""

    def __init__(self) -> None:
        self.input_ids = torch.zeros(64, dtype=torch.long)
        self.hidden = torch.zeros(64, 4)

    def capture_one_batch_size(self, bs: int) -> torch.cuda.CUDAGraph:
        input_ids = self.input_ids[:bs]
        hidden = self.hidden[:bs]
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        MODEL.forward(hidden + input_ids[:, None])  # .forward(): no module hook fires
        graph.capture_end()
        return graph


def test_inputs_of_a_runner_without_tensor_arguments_come_from_its_locals(collector: Collector) -> None:
    watch.install(collector)
    runner = SlicingRunner()
    runner.capture_one_batch_size(16)
    runner.capture_one_batch_size(8)
    first, second = collector.captures
    assert first.input_names == ("input_ids", "hidden")
    assert "[16, 16x4]" in first.descriptor.key and "[8, 8x4]" in second.descriptor.key
    assert (first.descriptor.num_tokens, second.descriptor.num_tokens) == (16, 8)


MODULE_LEVEL_LOOP = """
for rows in (16, 4):
    x = torch.zeros(rows, 4)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    MODEL(x)
    graph.capture_end()
    kept.append(x)
"""


def test_module_level_captures_take_their_inputs_from_the_first_module_call(collector: Collector) -> None:
    watch.install(collector)
    kept: list[torch.Tensor] = []
    exec(compile(MODULE_LEVEL_LOOP, "engine_loop.py", "exec"), {"torch": torch, "MODEL": MODEL, "kept": kept})
    first, second = collector.captures
    assert first.input_names == ("Linear.args[0]",) and first.input_addresses == (kept[0].data_ptr(),)
    assert (first.descriptor.num_tokens, second.descriptor.num_tokens) == (16, 4)
    assert first.wrapper == "engine_loop.py:5 in <module>"  # the capture_begin line
    assert not torch.nn.modules.module._global_forward_pre_hooks  # removed at capture_end


def test_replays_are_counted_per_graph_and_never_replayed_graphs_listed(collector: Collector) -> None:
    watcher = watch.install(collector)
    big, small = capture(torch.zeros(8, 4)), capture(torch.zeros(2, 4))
    for _ in range(3):
        big.replay()
    assert big.eager_replays == 3  # the original replay ran every time
    descriptor = collector.captures[0].descriptor
    assert collector.replays == [(CUDAGraphMode.FULL, descriptor, 8)] * 3
    assert [g.replays for g in watcher.graphs] == [3, 0]
    assert [g.identity.key for g in watcher.never_replayed()] == [collector.captures[1].descriptor.key]
    assert small.eager_replays == 0


def test_ready_after_n_quiet_replays_makes_the_next_capture_unexpected_with_its_stack(
    collector: Collector,
) -> None:
    watch.install(collector, ready_after=5)
    graph = capture(torch.zeros(8, 4))
    for _ in range(4):
        graph.replay()
    capture(torch.zeros(4, 4))  # 4 quiet replays: still start-up
    assert not collector.violations
    for _ in range(5):
        graph.replay()
    capture(torch.zeros(2, 4))
    assert [c.unexpected for c in collector.captures] == [False, False, True]
    (violation,) = collector.violations
    assert violation.kind is ViolationKind.UNEXPECTED_CAPTURE
    assert violation.descriptor == collector.captures[2].descriptor
    assert "ready_after=5" in violation.message
    assert "in capture" in violation.stack and "test_ready_after_n_quiet_replays" in violation.stack
    assert "graph.capture_begin(pool=pool)" in violation.stack


def test_mark_ready_makes_every_later_capture_unexpected(collector: Collector) -> None:
    watch.install(collector)
    capture(torch.zeros(8, 4))
    watch.mark_ready()
    capture(torch.zeros(8, 4))
    capture(torch.zeros(1, 4))
    assert [c.unexpected for c in collector.captures] == [False, True, True]
    assert collector.kinds() == [ViolationKind.UNEXPECTED_CAPTURE] * 2
    assert all("mark_ready()" in v.message for v in collector.violations)


def test_mark_ready_without_install_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="not installed"):
        watch.mark_ready()


def test_start_up_captures_of_many_shapes_are_not_a_storm(collector: Collector) -> None:
    watch.install(collector, storm_threshold=3)
    graphs = [capture(torch.zeros(n, 4)) for n in (64, 32, 16, 8, 4, 2, 1)]
    for graph in graphs:
        graph.replay()
    assert not collector.violations


def test_a_site_that_keeps_capturing_once_in_use_is_a_rerecord_storm(collector: Collector) -> None:
    watch.install(collector, storm_threshold=3)
    capture(torch.zeros(8, 4)).replay()
    for n in (9, 10):
        capture(torch.zeros(n, 4))
    assert not collector.violations
    capture(torch.zeros(11, 4))
    capture(torch.zeros(11, 4))
    assert collector.kinds() == [ViolationKind.RERECORD_STORM] * 2
    storm = collector.violations[-1]
    assert storm.descriptor.key.startswith("test_watch_hooks.py:") and " site #" in storm.descriptor.key
    assert "captured 4 graphs within 60 s" in storm.message
    assert "a shape it had captured before: [11x4]" in storm.message
    assert collector.violations[0].descriptor == storm.descriptor  # one finding, counted twice


def test_pool_memory_is_what_the_capture_added_to_its_pool(collector: Collector) -> None:
    """The allocator's reserved bytes per pool: 1000 before a second graph joins the pool, 1300 after."""
    reserved: dict[tuple[int, int], int] = {}
    growth = iter([1000, 300])
    capturing: list[torch.cuda.CUDAGraph] = []

    def allocate_during_capture(module: torch.nn.Module, args: object) -> None:
        pool = capturing[-1].pool()
        reserved[pool] = reserved.get(pool, 0) + next(growth)

    watcher = Watcher(collector, pool_meter=lambda pool: reserved.get(pool, 0))
    hooks = Hooks(watcher)
    hooks.install()
    handle = MODEL.register_forward_pre_hook(allocate_during_capture)
    try:
        first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        for graph, pool, rows in ((first, None, 8), (second, "shared", 4)):
            capturing.append(graph)
            graph.capture_begin(pool=first.pool() if pool else None)
            MODEL(torch.zeros(rows, 4))
            graph.capture_end()
    finally:
        handle.remove()
        hooks.uninstall()
    assert [c.pool_bytes for c in collector.captures] == [1000, 300]
    assert watcher.graphs[0].pool == watcher.graphs[1].pool == first.pool()


def test_what_a_pool_grew_by_between_captures_belongs_to_the_next_graph(collector: Collector) -> None:
    """torch.compile's trees warm up inside their pool: those segments are the next graph's."""
    reserved: dict[tuple[int, int], int] = {}
    watcher = Watcher(collector, pool_meter=lambda pool: reserved.get(pool, 0))
    hooks = Hooks(watcher)
    hooks.install()
    try:
        keeper = torch.cuda.CUDAGraph()  # the trees' empty pool keep-alive graph
        keeper.capture_begin()
        keeper.capture_end()
        pool = keeper.pool()
        reserved[pool] = 4096  # a warm-up allocated inside the pool, outside any capture
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        reserved[pool] += 512
        graph.capture_end()
    finally:
        hooks.uninstall()
    assert [c.pool_bytes for c in collector.captures] == [0, 4096 + 512]
    assert sum(c.pool_bytes for c in collector.captures) == reserved[pool]


def test_a_failure_inside_the_watch_never_reaches_the_program(
    collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("a bug in the watch")

    watcher = Watcher(collector, pool_meter=broken)
    hooks = Hooks(watcher)
    hooks.install()
    try:
        capture(torch.zeros(2, 4)).replay()  # the meter fails: the graph is recorded with 0 bytes
        assert [c.pool_bytes for c in collector.captures] == [0] and watcher.watch_errors == 1
        monkeypatch.setattr(watcher, "capture_started", broken)
        graph = capture(torch.zeros(3, 4))  # noting the capture fails: the engine's capture goes on
        graph.replay()
        assert graph.eager_replays == 1 and len(collector.captures) == 1
        monkeypatch.undo()
        monkeypatch.setattr(watcher, "capture_finished", broken)
        last = capture(torch.zeros(5, 4))
        last.replay()
        assert watcher.watch_errors == 3 and "_graph_inspector_pending" not in vars(last)
        assert last.eager_replays == 1 and len(collector.captures) == 1
    finally:
        hooks.uninstall()


class TorchWithHooks:
    """``torch.cuda.graphs`` as PyTorch's main branch has it: global capture-start, capture-end and
    replay-end hooks, each called with the graph, registered for a ``RemovableHandle``."""

    def __init__(self) -> None:
        self.start: dict[int, Callable[[object], None]] = collections.OrderedDict()
        self.end: dict[int, Callable[[object], None]] = collections.OrderedDict()
        self.replayed: dict[int, Callable[[object], None]] = collections.OrderedDict()

    @staticmethod
    def _register(hooks: dict, fn: Callable[[object], None]) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = fn
        return handle

    def register_graph_capture_start_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        return self._register(self.start, fn)

    def register_graph_capture_end_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        return self._register(self.end, fn)

    def register_graph_replay_end_hook(self, fn: Callable[[object], None]) -> RemovableHandle:
        return self._register(self.replayed, fn)

    @contextlib.contextmanager
    def firing(self) -> Iterator[None]:
        """Make the stand-in graph call the hooks where torch's graph does."""
        base = torch.cuda.CUDAGraph.__bases__[0]
        hooks = self

        class Hooked(base):  # type: ignore[misc, valid-type]
            def capture_begin(self, *args: object, **kwargs: object) -> None:
                super().capture_begin(*args, **kwargs)
                for fn in list(hooks.start.values()):
                    fn(self)

            def capture_end(self) -> None:
                for fn in list(hooks.end.values()):
                    fn(self)
                super().capture_end()

            def replay(self) -> None:
                try:
                    super().replay()
                finally:
                    for fn in list(hooks.replayed.values()):
                        fn(self)

        torch.cuda.CUDAGraph.__bases__ = (Hooked,)
        try:
            yield
        finally:
            torch.cuda.CUDAGraph.__bases__ = (base,)


def test_a_torch_with_its_own_graph_hooks_is_watched_through_them(collector: Collector) -> None:
    module = TorchWithHooks()
    cls = torch.cuda.CUDAGraph
    methods = {name: cls.__dict__[name] for name in ("capture_begin", "capture_end", "replay")}
    watcher = Watcher(collector)
    hooks = Hooks(watcher, graphs_module=module)
    assert hooks.path == "torch hooks" and Hooks(watcher).path == "patched"
    with module.firing():
        hooks.install()
        try:
            assert {name: cls.__dict__[name] for name in methods} == methods  # nothing of torch replaced
            graph = capture(torch.zeros(8, 4))
            graph.replay()
            graph.replay()
        finally:
            hooks.uninstall()
        graph.replay()  # after uninstall: not counted
    (event,) = collector.captures
    assert "in capture" in event.wrapper and event.descriptor.num_tokens == 8
    assert event.input_names == ("x",)
    assert [g.replays for g in watcher.graphs] == [2]
    assert not (module.start or module.end or module.replayed)


def test_a_failing_recorder_never_breaks_the_engine(collector: Collector) -> None:
    class Broken(Collector):
        def on_capture(self, event: CaptureEvent) -> None:
            raise OSError("disk full")

        def on_replay(self, *args: object) -> None:
            raise OSError("disk full")

    watcher = watch.install(Broken())
    graph = capture(torch.zeros(2, 4))
    graph.replay()
    assert graph.eager_replays == 1 and watcher.graphs[0].replays == 1
    assert watcher.sink_errors == 2


def test_a_failed_capture_leaves_no_state_behind(collector: Collector) -> None:
    watch.install(collector)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError):
        graph.capture_begin(pool=("not", "a pool"))  # torch refuses it: nothing is recorded
    assert "_graph_inspector_pending" not in vars(graph)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    with pytest.raises(RuntimeError, match="without capture_begin"):
        graph.capture_end()
    assert not collector.captures


def test_a_second_capture_begin_keeps_the_capture_in_progress(collector: Collector) -> None:
    watch.install(collector)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="already capturing"):
        graph.capture_begin()
    MODEL(torch.zeros(3, 4))
    graph.capture_end()
    (event,) = collector.captures
    assert event.descriptor.num_tokens == 3
    assert "_graph_inspector_pending" not in vars(graph)
    assert not torch.nn.modules.module._global_forward_pre_hooks


class Keep(logging.Handler):
    """A handler beside torch's own console handlers: what users see."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def console() -> Iterator[Keep]:
    """Where torch's console handlers sit for the two loggers (both stop propagating there)."""
    handler = Keep()
    owners = [logging.getLogger("torch._inductor"), logging.getLogger("torch._inductor.cudagraph_trees")]
    for owner in owners:
        owner.addHandler(handler)
    yield handler
    for owner in owners:
        owner.removeHandler(handler)


def test_a_skip_log_line_becomes_a_compile_event_and_still_reaches_the_user(
    collector: Collector, console: Keep
) -> None:
    watch.install(collector)
    logging.getLogger(SKIP_LOGGER).warning(
        "skipping cudagraphs due to mutated inputs (1 instances). Found from : model.py:12"
    )
    (event,) = collector.compile_events
    assert event.kind is CompileEventKind.SKIP
    assert event.reason == "mutated inputs (1 instances). Found from : model.py:12"
    (violation,) = collector.violations  # the compiler gave up on graphs: the user is told
    assert violation.kind is ViolationKind.COMPILE_SKIP
    assert violation.message.startswith("skipping cudagraphs due to mutated inputs")
    assert violation.descriptor.key.startswith("torch.compile skip: mutated inputs")
    assert [r.getMessage()[:19] for r in console.records] == ["skipping cudagraphs"]


def test_skips_are_heard_where_older_torch_wrote_them(collector: Collector) -> None:
    watch.install(collector)
    logging.getLogger(OLDER_SKIP_LOGGER).warning("skipping cudagraphs due to multiple devices: cuda:0, cpu")
    watch.uninstall()
    (event,) = collector.compile_events
    assert event.reason == "multiple devices: cuda:0, cpu"
    assert not logging.getLogger(OLDER_SKIP_LOGGER).filters


def test_the_watch_changes_no_logger_level_of_torch(collector: Collector) -> None:
    """Lowering the cudagraph trees' logger to DEBUG made torch 2.11 build a debug message that
    fails an assertion at batch 32; the watch now changes no level at all."""
    loggers = [name for name in logging.root.manager.loggerDict if name.startswith("torch")]
    before = {name: logging.getLogger(name).level for name in loggers}
    watch.install(collector)
    try:
        assert {name: logging.getLogger(name).level for name in loggers} == before
        trees = logging.getLogger("torch._inductor.cudagraph_trees.__cudagraphs")
        assert not trees.isEnabledFor(logging.DEBUG)
    finally:
        watch.uninstall()


def test_pool_bytes_sum_the_pools_segments_on_a_torch_without_per_pool_snapshots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from inspector.watch import pools

    segments = [
        {"segment_pool_id": (0, 7), "total_size": 2 << 20},
        {"segment_pool_id": (0, 7), "total_size": 20 << 20},
        {"segment_pool_id": (0, 8), "total_size": 2 << 20},
        {"segment_pool_id": (0, 0), "total_size": 64 << 20},
    ]
    calls: list[tuple] = []

    def old_memory_snapshot() -> list[dict]:  # no mempool_id, no include_traces
        calls.append(())
        return segments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", old_memory_snapshot)
    monkeypatch.setattr(pools, "_SNAPSHOT_FORMS", list(pools._SNAPSHOT_FORMS))
    assert pools.allocator_pool_bytes((0, 7)) == 22 << 20
    assert pools.allocator_pool_bytes((0, 9)) == 0
    assert len(calls) == 2 and len(pools._SNAPSHOT_FORMS) == 1  # the working form is remembered


def test_the_watch_times_its_own_capture_hooks_not_the_capture(collector: Collector) -> None:
    """``hook_seconds`` is what the watch added to the program's captures: a slow pool meter (the
    watch's own work) shows in it, the captured code's time does not."""
    import time

    def slow_meter(pool: object) -> int:
        time.sleep(0.05)
        return 0

    watcher = Watcher(collector, pool_meter=slow_meter)
    hooks = Hooks(watcher)
    hooks.install()
    try:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        time.sleep(0.3)  # the engine's captured work
        graph.capture_end()
    finally:
        hooks.uninstall()
    assert 0.05 <= watcher.hook_seconds < 0.3  # the meter ran once, after the capture, into its new pool
