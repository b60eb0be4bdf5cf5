"""What the watch reads off torch.compile's frames: the compiled function, batch shapes, and why
the cudagraph trees re-recorded, with torch's own objects (the trees themselves need a GPU: see
test_watch_cuda.py and test_watch_transformers.py)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable

import pytest
import torch
from torch._inductor.cudagraph_utils import CheckInvariantStatus, PlaceholderInfo, log_data_ptr_mismatch

from capture_core.events import NullObserver
from inspector.watch.frames import capture_frames, tensor_arguments
from inspector.watch.identity import BatchShape, CallSite, GraphIdentity
from inspector.watch.trees import TreeCapture, compiled_function, moved_inputs, rerecord_of, tree_capture
from inspector.watch.watcher import WatchedGraph, Watcher


def placeholder(name: str) -> PlaceholderInfo:
    return PlaceholderInfo(name=name, stack_trace=None, users=[], mutating_use_stack_trace=None)


def deferred_message(
    placeholders: list[PlaceholderInfo], inputs: list[object], recorded: list[int | None], indices: list[int],
    status: CheckInvariantStatus,
) -> functools.partial:
    """The message builder CUDAGraphNode.check_invariants hands back, built the way it builds it."""
    logger = functools.partial(log_data_ptr_mismatch, placeholders, inputs, recorded)
    return functools.partial(logger, indices, status)


def test_a_rerecord_reason_is_read_where_torchs_own_debug_message_fails() -> None:
    """torch 2.11's debug-only message asserts one length for inputs, pointers and placeholders;
    reading the trees' state instead names the moved input and never raises."""
    cache, ids = torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.long)
    moved = torch.zeros(2, 8)
    inputs: list[object] = [moved, ids, 7]  # one input more than there are placeholders
    logger = deferred_message(
        [placeholder("L_cache_"), placeholder("L_input_ids_")], inputs,
        [cache.data_ptr(), ids.data_ptr(), None], [0, 1], CheckInvariantStatus.StaticInputIdxMismatch,
    )
    with pytest.raises(AssertionError, match="length mismatch between inputs, recorded_data_ptr"):
        logger()
    status = CheckInvariantStatus.StaticInputIdxMismatch
    rerecord = rerecord_of({"status": status, "status_logger": logger}, compile_id="0/1")
    assert rerecord is not None
    assert rerecord.reason == "static input data pointer changed"
    assert rerecord.detail == "inputs whose address changed: L_cache_ 2x8"
    assert rerecord.compile_id == "0/1"


def test_no_status_or_success_is_a_first_recording_not_a_rerecord() -> None:
    assert rerecord_of({}) is None
    assert rerecord_of({"status": CheckInvariantStatus.SUCCESS, "status_logger": lambda: "ok"}) is None
    dead = rerecord_of({"status": CheckInvariantStatus.ExpectedDeadIndicesBeforeGraphMismatch,
                        "status_logger": lambda: "never called"})
    assert dead is not None and not dead.detail
    assert dead.reason == "expected dead indices before graph are live"


def test_moved_inputs_survive_whatever_torch_bound() -> None:
    tensors = [torch.zeros(1) for _ in range(6)]
    logger = deferred_message([placeholder(f"arg{i}") for i in range(6)], list(tensors), [0] * 6,
                              list(range(6)), CheckInvariantStatus.CudagraphManagedIdxMismatch)
    assert moved_inputs(logger) == "inputs whose address changed: arg0 1, arg1 1, arg2 1, arg3 1 (+2 more)"
    unreadable = functools.partial(log_data_ptr_mismatch, None, None, None, None)
    assert moved_inputs(unreadable) == "" and moved_inputs(lambda: "x") == "" and moved_inputs(None) == ""


def test_batch_shape_reads_token_ids_and_a_kv_cache() -> None:
    mask, ids = torch.ones(8, 64, dtype=torch.long), torch.zeros(8, 1, dtype=torch.long)
    position = torch.zeros(1, dtype=torch.long)
    user = [("attention_mask", mask), ("cache_position", position), ("input_ids", ids)]
    keys = torch.zeros(8, 4, 64, 16)
    shape = BatchShape.of(user, [torch.zeros(1024, 256), keys, torch.zeros(1, 4, 99, 16)])
    assert shape == BatchShape(batch=8, seq=1, cache=64)
    assert (shape.num_tokens, shape.text) == (8, "batch 8 · seq 1 · cache 64")
    unnamed = BatchShape.of([("attention_mask", mask), ("args[1]", torch.zeros(8, 3, dtype=torch.int32))])
    assert unnamed == BatchShape(batch=8, seq=3)  # a mask is not token ids
    assert BatchShape.of([("x", torch.zeros(4, 16, 32))]) == BatchShape(batch=4)
    assert BatchShape.of([("x", torch.zeros(()))]) is None and BatchShape.of([]) is None


def test_a_compiled_functions_graph_is_keyed_by_function_and_batch() -> None:
    site = CallSite("/src/modeling_llama.py", 430, "LlamaForCausalLM.forward", via="torch.compile")
    decode = GraphIdentity(site, ((32000, 1024), (8, 4, 64, 16)), batch=BatchShape(8, 1, 64))
    key = decode.key
    assert key.startswith("LlamaForCausalLM.forward batch 8 · seq 1 · cache 64 #")
    descriptor = decode.descriptor()
    assert (descriptor.num_tokens, descriptor.num_reqs, descriptor.uniform) == (8, 8, True)
    prefill = GraphIdentity(site, ((32000, 1024),), batch=BatchShape(2, 16)).descriptor()
    assert (prefill.num_tokens, prefill.num_reqs, prefill.uniform) == (32, 2, False)
    assert site.text == "/src/modeling_llama.py:430 in LlamaForCausalLM.forward via torch.compile"


# -- the compiled function, from real dynamo frames (backend="eager": no GPU, no compiler) ------


def seen_from_inside(compiled: Callable[..., object], *args: object) -> tuple[str, CallSite | None, list]:
    """What ``compiled_function`` reads from inside ``compiled``, as a capture there would: the
    probe runs eagerly at a graph break, below the frame dynamo compiled."""
    seen: list[tuple[str, CallSite | None, list]] = []

    @torch._dynamo.disable
    def probe() -> None:
        frame, name, site = compiled_function(capture_frames(sys._getframe(1)))
        shapes = [tuple(t.shape) for _, t in tensor_arguments(frame)] if frame is not None else []
        seen.append((name, site, shapes))

    PROBE["probe"] = probe
    torch._dynamo.reset()
    try:
        fn = torch.compile(compiled, backend="eager")
        fn(*args)
        fn(*args)  # the second call runs dynamo's cached code, as every replay does
    finally:
        torch._dynamo.reset()
        PROBE.clear()
    return seen[-1]


PROBE: dict[str, Callable[[], None]] = {}


def probe() -> None:
    PROBE["probe"]()


class Decoder(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = input_ids * 2
        probe()
        return hidden + 1


def keep_kwargs(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A decorator as transformers writes them: a wrapper with no ``self`` of its own."""

    @functools.wraps(forward)
    def wrapped(*args: object, **kwargs: object) -> torch.Tensor:
        return forward(*args, **kwargs)

    return wrapped


class DecoratedDecoder(torch.nn.Module):
    @keep_kwargs
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = input_ids * 2
        probe()
        return hidden + 1


def decode_step(input_ids: torch.Tensor) -> torch.Tensor:
    hidden = input_ids * 2
    probe()
    return hidden + 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "name", "defined_by"),
    [
        (lambda: Decoder().__call__, "Decoder.forward", Decoder.forward),
        (lambda: DecoratedDecoder().__call__, "DecoratedDecoder.forward",
         inspect.unwrap(DecoratedDecoder.forward)),
        (lambda: decode_step, "decode_step", decode_step),
    ],
    ids=["module", "decorated module", "function"],
)
def test_the_compiled_function_is_named_as_the_user_wrote_it(
    target: Callable[[], Callable[..., object]], name: str, defined_by: Callable[..., object]
) -> None:
    found, site, shapes = seen_from_inside(target(), torch.ones(2, 1, dtype=torch.long))
    assert found == name and site is not None
    assert (site.filename, site.lineno) == (__file__, defined_by.__code__.co_firstlineno)
    assert (site.function, site.via) == (name, "torch.compile")
    assert (2, 1) in shapes


TREES_MANAGER = """
class CUDAGraphTreeManager:
    def __init__(self, device_index, report):
        report(sys._getframe())  # where the real one captures its pool's empty keep-alive graph
"""


def trees_manager_class() -> type:
    """A class named and filed as torch's cudagraph trees' manager (the real one needs a GPU)."""
    filename = os.path.join(os.path.dirname(torch.__file__), "_inductor", "cudagraph_trees.py")
    namespace: dict[str, object] = {"sys": sys}
    exec(compile(TREES_MANAGER, filename, "exec"), namespace)
    return namespace["CUDAGraphTreeManager"]  # type: ignore[return-value]


@pytest.mark.slow
def test_the_pool_keep_alive_is_told_under_the_compiled_function_whose_first_run_made_the_trees() -> None:
    """Not under the decorator's wrapper that happens to be the first frame outside torch
    (transformers' ``wrapped_func``), and with no inputs: the graph is empty."""
    manager_class = trees_manager_class()
    watcher = Watcher(NullObserver())
    seen: list[tuple[TreeCapture | None, WatchedGraph]] = []

    def report(frame: object) -> None:
        frames = capture_frames(frame)  # type: ignore[arg-type]
        pending = watcher.capture_started(frames, None)
        seen.append((tree_capture(frames), watcher.capture_finished(pending, None)))

    @torch._dynamo.disable
    def make_manager() -> None:
        manager_class(0, report)

    PROBE["probe"] = make_manager
    torch._dynamo.reset()
    try:
        torch.compile(DecoratedDecoder().__call__, backend="eager")(torch.ones(2, 1, dtype=torch.long))
    finally:
        torch._dynamo.reset()
        PROBE.clear()
    tree, graph = seen[-1]
    assert tree is not None and tree.keeps_pool_alive and tree.function == "DecoratedDecoder.forward"
    defined = inspect.unwrap(DecoratedDecoder.forward).__code__.co_firstlineno
    assert tree.site == CallSite(__file__, defined, "DecoratedDecoder.forward", via="torch.compile")
    assert graph.function == "DecoratedDecoder.forward" and not graph.inputs
    assert graph.identity.key.startswith("DecoratedDecoder.forward pool keep-alive #")
    assert graph.identity.site.text.endswith("in DecoratedDecoder.forward via torch.compile")


def test_frames_without_dynamo_name_no_function() -> None:
    assert compiled_function(capture_frames(sys._getframe())) == (None, "", None)
