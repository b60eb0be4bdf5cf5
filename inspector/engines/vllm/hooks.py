"""Where the vLLM integration attaches: a few of vLLM 0.25's own methods, wrapped in place.

Each hook calls vLLM's method unchanged and tells the session what it decided; none changes an
argument or a result. ``install`` is idempotent (vLLM may load its plugins more than once), and
``uninstall`` puts every method back (for tests). Hooks on the two model runners are installed for
whichever of them this vLLM has.

| vLLM (0.25.1)                                                | what is recorded                          |
| ------------------------------------------------------------ | ----------------------------------------- |
| ``CUDAGraphWrapper.__call__`` (V1 FULL, every PIECEWISE piece) | captures, unexpected captures, the checks |
| ``CUDAGraphWrapper.clear_graphs``                            | the twin forgets what vLLM threw away     |
| ``GPUModelRunner.__init__`` / V2 ``ModelRunner.__init__``    | recording starts in this process          |
| ``_determine_batch_execution_and_padding`` (V1)              | one step: padded descriptor, mode, tokens |
| ``dispatch_cg_and_sync_dp`` (V2)                             | one step, the same                        |
| ``_dummy_run`` (both)                                        | what runs inside is not a step            |
| ``profile_cudagraph_memory`` (V1)                            | graphs captured there are discarded ones  |
| ``capture_model`` (both)                                     | the end of the capture phase              |
| ``CudaGraphManager.capture`` / ``run_fullgraph`` (V2)        | the model's FULL graphs: captures, checks |
| ``Worker.shutdown``                                          | the last window is written                |

``pause`` puts vLLM's own per-step methods back (the wrapper's ``__call__``, the dispatch of either
runner, V2's ``run_fullgraph``) until ``resume``: while paused vLLM runs exactly its own code, and
nothing is recorded or checked. What was recorded and the twins' graphs are kept, so the checks go on
where they stopped. Call both between steps, in the process that serves (an in-process engine).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from capture_core.checks import AddressCheckMode
from inspector.engines.vllm.session import VllmSession
from inspector.engines.vllm.twins import PoolMeter

log = logging.getLogger("graph_inspector.vllm")

_installed: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original) of every method replaced, to put back."""
_per_step: list[tuple[Any, str, Any, Any]] = []
"""(owner, attribute, original, replacement) of the methods vLLM calls at every step (``pause``)."""
_session: VllmSession | None = None
_ALWAYS_ON, _OFF = AddressCheckMode.ALWAYS_ON, AddressCheckMode.OFF


def session() -> VllmSession | None:
    """This process's session, once installed."""
    return _session


def install(url: str) -> VllmSession:
    """Install the hooks (once per process) and return the session that records through them."""
    global _session
    if _session is not None:
        return _session
    from vllm.compilation import cuda_graph

    wrapper_cls = cuda_graph.CUDAGraphWrapper
    vllm_call = wrapper_cls.__call__
    v2 = _optional("vllm.v1.worker.gpu.model_runner")
    v2_graphs = _optional("vllm.v1.worker.gpu.cudagraph_utils")
    run_fullgraph = v2_graphs.CudaGraphManager.run_fullgraph if v2_graphs is not None else None
    _session = current = VllmSession(url, vllm_call, run_fullgraph)
    _hook_wrapper(current, wrapper_cls, cuda_graph)
    v1 = _optional("vllm.v1.worker.gpu_model_runner")
    if v1 is not None:
        _hook_v1(current, v1.GPUModelRunner)
    if v2 is not None and v2_graphs is not None:
        _hook_v2(current, v2, v2_graphs)
    worker = _optional("vllm.v1.worker.gpu_worker")
    if worker is not None:
        _wrap(worker.Worker, "shutdown", lambda original: _after(original, current.close))
    return current


def pause() -> None:
    """vLLM's own per-step methods back in place: nothing is recorded or checked until ``resume``."""
    for owner, name, original, _ in _per_step:
        setattr(owner, name, original)


def resume() -> None:
    """The per-step hooks in place again after ``pause`` (a no-op when not paused)."""
    for owner, name, _, replacement in _per_step:
        setattr(owner, name, replacement)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """vLLM runs without the integration inside the block (between steps of an in-process engine)."""
    pause()
    try:
        yield
    finally:
        resume()


def uninstall() -> None:
    """Put every hooked method back and forget the session (its recorder is closed)."""
    global _session
    _per_step.clear()
    while _installed:
        owner, name, original = _installed.pop()
        setattr(owner, name, original)
    if _session is not None:
        _session.close()
    _session = None


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        log.info("vLLM has no %s here (%s): its hooks are skipped", module, exc)
        return None


def _wrap(owner: Any, name: str, make: Callable[[Any], Any], per_step: bool = False) -> None:
    """Replace ``owner.name`` by ``make(original)``; ``per_step``: one vLLM calls at every step."""
    original = owner.__dict__[name]
    function = original.__func__ if isinstance(original, staticmethod) else original
    replacement = functools.wraps(function)(make(function))
    if isinstance(original, staticmethod):
        replacement = staticmethod(replacement)
    _installed.append((owner, name, original))
    if per_step:
        _per_step.append((owner, name, original, replacement))
    setattr(owner, name, replacement)


def _after(original: Callable[..., Any], then: Callable[[], None]) -> Callable[..., Any]:
    def hooked(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            then()
    return hooked


def _in_dummy_run(current: VllmSession) -> Callable[[Any], Any]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            current.dummy_depth += 1
            current.plain = False  # its graph calls go the whole way (its captures are recorded)
            try:
                return original(*args, **kwargs)
            finally:
                current.dummy_depth -= 1
        return hooked
    return make


def _hook_wrapper(current: VllmSession, wrapper_cls: Any, cuda_graph: Any) -> None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    NONE = cuda_graph.CUDAGraphMode.NONE

    def make_call(vllm_call: Callable[..., Any]) -> Callable[..., Any]:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if current.plain:  # an eager step, or recording only a graph vLLM holds: vLLM's call alone
                return current.vllm_call(self, *args, **kwargs)
            if current.runtime is None or not is_forward_context_available():
                return vllm_call(self, *args, **kwargs)
            forward = get_forward_context()
            mode = forward.cudagraph_runtime_mode
            if mode == NONE or mode != self.runtime_mode or forward.batch_descriptor is None:
                return vllm_call(self, *args, **kwargs)
            twin = self.__dict__.get("_graph_inspector_twin") or current.twin(self)
            context = current.context(forward)
            entry = twin.lookup(context.descriptor)
            if (entry is not None and current.runtime.address_check is _ALWAYS_ON
                    and entry.guard(args, kwargs, context.num_real_tokens)):
                return current.vllm_call(self, *args, **kwargs)  # the common replay: guard, then vLLM's
            return twin.serve(context, args, kwargs)
        return __call__

    def make_clear(original: Callable[..., Any]) -> Callable[..., Any]:
        def clear_graphs(self: Any) -> None:
            self.__dict__.pop("_graph_inspector_twin", None)
            current.forget_captures()
            return original(self)
        return clear_graphs

    _wrap(wrapper_cls, "__call__", make_call, per_step=True)
    _wrap(wrapper_cls, "clear_graphs", make_clear)


def _hook_v1(current: VllmSession, runner_cls: Any) -> None:
    def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            current.attach(self, "V1")
        return __init__

    def make_decide(original: Callable[..., Any]) -> Callable[..., Any]:
        def decide(self: Any, num_tokens: int, num_reqs: int, num_scheduled_tokens_np: Any,
                   max_num_scheduled_tokens: int, use_cascade_attn: bool, *args: Any, **kwargs: Any) -> Any:
            result = original(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                              use_cascade_attn, *args, **kwargs)
            if not current.dummy_depth:
                mode, descriptor = result[0], result[1]
                uniform = bool(getattr(descriptor, "uniform", False)) or (
                    max_num_scheduled_tokens == self.uniform_decode_query_len
                    and num_tokens == max_num_scheduled_tokens * num_reqs)
                current.step(mode, descriptor, int(num_tokens), uniform,
                             forced=bool(use_cascade_attn or kwargs.get("force_eager")))
            return result
        return decide

    def make_profile(original: Callable[..., Any]) -> Callable[..., Any]:
        def profile_cudagraph_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
            current.profiling = True
            try:
                return original(self, *args, **kwargs)
            finally:
                current.profiling = False
        return profile_cudagraph_memory

    _wrap(runner_cls, "__init__", make_init)
    _wrap(runner_cls, "_determine_batch_execution_and_padding", make_decide, per_step=True)
    _wrap(runner_cls, "_dummy_run", _in_dummy_run(current))
    _wrap(runner_cls, "capture_model", lambda original: _after(original, current.capture_finished))
    if "profile_cudagraph_memory" in runner_cls.__dict__:
        _wrap(runner_cls, "profile_cudagraph_memory", make_profile)


def _hook_v2(current: VllmSession, v2: Any, v2_graphs: Any) -> None:
    from vllm.config import CUDAGraphMode as VllmMode

    runner_cls = v2.GPUModelRunner
    manager_cls = v2_graphs.ModelCudaGraphManager
    dispatch = v2.dispatch_cg_and_sync_dp
    eager = VllmMode.NONE
    seen = current.v2_steps

    def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            current.attach(self, "V2")
        return __init__

    def dispatch_cg_and_sync_dp(cudagraph_manager: Any, num_reqs: int, num_tokens: int,
                                uniform_token_count: int | None, *args: Any, **kwargs: Any) -> Any:
        result = dispatch(cudagraph_manager, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
        if not current.dummy_depth:
            execution = result[0]
            known = seen.get((id(execution), num_tokens))
            if known is not None and known.execution is execution:  # a replay seen before: count it
                known.cell[0] += 1
                current.step_tokens = num_tokens
                current.last_v2_step = known
                runtime = current.runtime  # as current.unchecked(), without the call
                current.plain = known.captured and runtime is not None and runtime.address_check is _OFF
                return result
            if execution.cg_mode is eager:  # a new descriptor every eager step: counted by its figures
                forced = bool(kwargs.get("need_eager", args[2] if len(args) > 2 else False))
                decode = uniform_token_count is not None and uniform_token_count == getattr(
                    cudagraph_manager, "decode_query_len", 1)
                current.eager_step(int(num_tokens), decode, forced)
                return result
            current.step(execution.cg_mode, execution, int(num_tokens), False, execution=True)
        return result

    def make_capture(original: Callable[..., Any]) -> Callable[..., Any]:
        def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
            runner = current.runner
            if runner is None or getattr(runner, "cudagraph_manager", None) is not self:
                return original(self, *args, **kwargs)  # a speculator's manager: not the model's graphs
            recording = _CaptureLog(current, self, lambda: _full_inputs(runner))
            graphs, self.graphs = self.graphs, recording
            self.__dict__["_graph_inspector_log"] = recording
            try:
                return original(self, *args, **kwargs)
            finally:
                del self.__dict__["_graph_inspector_log"]
                self.graphs = dict(graphs)
                self.graphs.update(recording)
        return capture

    def make_base_capture(original: Callable[..., Any]) -> Callable[..., Any]:
        def capture(self: Any, create_forward_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            recording = self.__dict__.get("_graph_inspector_log")
            if recording is None:
                return original(self, create_forward_fn, *args, **kwargs)

            def create(desc: Any, warmup: bool) -> Any:
                made = create_forward_fn(desc, warmup=warmup)
                if not warmup:
                    recording.restart()  # the capture itself follows at once
                return made
            return original(self, create, *args, **kwargs)
        return capture

    def make_run(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_fullgraph(self: Any, desc: Any) -> Any:
            if current.plain:  # recording only, a graph the twin holds: recorded at its dispatch
                return original(self, desc)
            twin = current.full_twin
            if twin is None or current.runtime is None or self is not current.full_manager:
                return original(self, desc)  # nothing to check, or a speculator's own graphs
            known = current.last_v2_step
            inputs = _full_inputs(current.runner)
            if known is not None and known.execution is desc:
                entry = known.entry  # the common replay: its guard, then vLLM's replay
                if (entry is not None and current.runtime.address_check is _ALWAYS_ON
                        and entry.guard((), inputs, known.context.num_real_tokens)):
                    return original(self, desc)
                context = known.context
            else:
                context = current.full_context(desc)
            return twin.serve(context, (), inputs)
        return run_fullgraph

    _wrap(runner_cls, "__init__", make_init)
    _wrap(runner_cls, "_dummy_run", _in_dummy_run(current))
    _wrap(runner_cls, "capture_model", lambda original: _after(original, current.capture_finished))
    _wrap(v2, "dispatch_cg_and_sync_dp", lambda original: dispatch_cg_and_sync_dp, per_step=True)
    _wrap(manager_cls, "capture", make_capture)
    _wrap(v2_graphs.CudaGraphManager, "capture", make_base_capture)
    _wrap(v2_graphs.CudaGraphManager, "run_fullgraph", make_run, per_step=True)


def _full_inputs(runner: Any) -> dict[str, Any]:
    """What the V2 runner's FULL graphs read that a step rewrites: its persistent input buffers, block
    tables, slot mappings and KV cache, read from the runner at each call (so a buffer the runner
    replaced instead of writing is seen)."""
    buffers = runner.input_buffers
    tables = runner.block_tables
    return {
        "input_ids": buffers.input_ids, "positions": buffers.positions,
        "query_start_loc": buffers.query_start_loc, "seq_lens": buffers.seq_lens,
        "slot_mappings": tables.slot_mappings, "block_tables": tables.input_block_tables,
        "kv_caches": getattr(runner, "kv_caches", ()),
    }


class _CaptureLog(dict):
    """The V2 manager's ``graphs`` while it captures: every FULL graph it stores is handed to the
    session's FULL twin, timed from the end of its warm-up to the store (the capture itself)."""

    def __init__(self, current: VllmSession, manager: Any, inputs: Callable[[], dict[str, Any]]) -> None:
        super().__init__()
        self.current, self.manager, self.inputs = current, manager, inputs
        self.restart()

    def restart(self) -> None:
        """A FULL graph's capture begins (its warm-up is done and its inputs are prepared)."""
        self.started = time.perf_counter()
        self.meter = PoolMeter(getattr(self.manager, "pool", None))

    def __setitem__(self, execution: Any, graph: Any) -> None:
        super().__setitem__(execution, graph)
        seconds = time.perf_counter() - self.started
        self.current.adopt_full(self.manager, execution, self.inputs(), seconds, self.meter.grown())
