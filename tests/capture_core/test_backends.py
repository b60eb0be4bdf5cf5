"""Backends: the eager stand-in on CPU, backend selection, and real CUDA graphs on a GPU."""

from __future__ import annotations

import gc

import pytest
import torch

from capture_core.backends import (
    CudaGraphBackend,
    EagerBackend,
    copy_outputs,
    gc_frozen,
    pool_reserved_bytes,
    select_backend,
)
from capture_core.descriptor import BatchDescriptor
from capture_core.errors import GraphCacheError
from capture_core.forward_context import set_forward_context
from capture_core.modes import CUDAGraphMode
from capture_core.runtime import GraphRuntime
from capture_core.wrapper import CUDAGraphWrapper


def affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tuple-and-dict outputs, to show replays refresh nested outputs in place."""
    y = x @ w
    return y, {"sum": y.sum(dim=-1)}


def test_the_eager_backend_names_itself_and_holds_no_pool():
    backend = EagerBackend()
    x, w = torch.ones(2, 3), torch.eye(3)
    graph = backend.capture(affine, (x, w), {}, warmup_iters=2)
    assert backend.name == "eager" and graph.pool_bytes == 0 and graph.capture_seconds > 0
    assert GraphRuntime("eager", progress=False).backend_name == "eager"


def test_an_eager_replay_reads_the_captured_inputs_into_the_kept_outputs():
    x, w = torch.ones(2, 3), torch.eye(3)
    graph = EagerBackend().capture(affine, (x, w), {}, warmup_iters=0)
    y, extra = graph.outputs
    x.copy_(torch.full((2, 3), 2.0))
    graph.replay()
    assert graph.outputs[0] is y and torch.equal(y, torch.full((2, 3), 2.0))
    assert torch.equal(extra["sum"], torch.full((2,), 6.0))


def test_auto_selects_the_eager_backend_without_cuda(caplog):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with caplog.at_level("INFO", logger="capture_core.backends"):
        backend = select_backend("auto")
    assert backend.name == "eager"
    assert "graph backend: eager" in caplog.text


def test_the_cuda_backend_refuses_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(GraphCacheError, match="needs a CUDA GPU"):
        select_backend("cuda")


def test_an_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="auto, cuda, eager"):
        select_backend("opencl")


def test_a_backend_object_is_used_as_given():
    backend = EagerBackend()
    assert select_backend(backend) is backend


def test_gc_is_frozen_and_collect_is_a_no_op_during_capture():
    assert gc.isenabled()
    with gc_frozen():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0
        assert gc.collect() == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.collect.__module__ == "gc"


def test_copy_outputs_walks_nested_outputs():
    destination = (torch.zeros(2), [torch.zeros(1)], {"k": torch.zeros(3)}, "label")
    copy_outputs(destination, (torch.ones(2), [torch.ones(1)], {"k": torch.ones(3)}, "label"))
    assert all(bool((t == 1).all()) for t in (destination[0], destination[1][0], destination[2]["k"]))


# --- real CUDA graphs --------------------------------------------------------------------------


def mlp_step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def mlp_inputs(tokens: int, hidden: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator)
    w1 = torch.randn(hidden, 4 * hidden, device="cuda", generator=generator) / hidden**0.5
    w2 = torch.randn(4 * hidden, hidden, device="cuda", generator=generator) / (4 * hidden) ** 0.5
    return x, w1, w2


@pytest.mark.cuda
def test_cuda_capture_and_replay_equal_eager_and_measure_pool_bytes():
    runtime = GraphRuntime("cuda", progress=False)
    assert runtime.backend_name == "cuda"
    wrapper = CUDAGraphWrapper(mlp_step, runtime)
    x, w1, w2 = mlp_inputs(64)
    descriptor = BatchDescriptor(64)
    with runtime.capture_phase(), set_forward_context(CUDAGraphMode.FULL, descriptor):
        first = wrapper(x, w1, w2).clone()
    torch.testing.assert_close(first, mlp_step(x, w1, w2))
    x.copy_(torch.randn_like(x))
    with set_forward_context(CUDAGraphMode.FULL, descriptor):
        replayed = wrapper(x, w1, w2)
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, mlp_step(x, w1, w2))
    entry = wrapper.graphs[descriptor]
    assert entry.pool_bytes > 0 and entry.capture_seconds > 0
    assert pool_reserved_bytes(runtime.backend.pool) >= entry.pool_bytes


def pool_total(shared_pool: bool, sizes: list[int]) -> int:
    backend = CudaGraphBackend(shared_pool=shared_pool)
    runtime = GraphRuntime(backend, progress=False)
    wrapper = CUDAGraphWrapper(mlp_step, runtime)
    _, w1, w2 = mlp_inputs(1)
    inputs = torch.randn(max(sizes), w1.shape[0], device="cuda")

    def run(mode, descriptor):
        wrapper(inputs[: descriptor.num_tokens], w1, w2)

    runtime.capture_all([(CUDAGraphMode.FULL, BatchDescriptor(n)) for n in sizes], run)
    return sum(entry.pool_bytes for entry in wrapper.graphs.values())


@pytest.mark.cuda
def test_a_shared_pool_captured_largest_first_is_smaller_than_a_pool_per_graph():
    sizes = [256, 512, 1024, 2048]
    shared = pool_total(True, sizes)
    separate = pool_total(False, sizes)
    assert 0 < shared < separate


def test_a_cuda_capture_of_cpu_work_is_refused_not_silently_empty():
    from capture_core.backends import _require_cuda_work

    with pytest.raises(GraphCacheError, match=r"none of its tensor inputs is on a CUDA device") as raised:
        _require_cuda_work(affine, (torch.ones(2, 3), [torch.eye(3)]), {"scale": 2})
    assert "'affine'" in str(raised.value) and "backend='eager'" in str(raised.value)
    _require_cuda_work(lambda: None, (), {})  # a closure over its own buffers cannot be judged
