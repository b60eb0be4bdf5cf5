"""An eager stand-in for the CUDA part of ``torch.cuda.CUDAGraph``, for hosts without a GPU.

On CPU-only torch, ``torch.cuda.CUDAGraph``'s base ``torch._C._CUDAGraph`` is a placeholder that
cannot be built. ``eager_cuda_graphs()`` swaps that base for ``EagerGraphBase`` so the REAL
``torch.cuda.CUDAGraph`` Python class (its ``__new__``, ``capture_begin``, ``capture_end``,
``replay``, ``pool``) runs, with the watch's patches on it, and the work between capture_begin and
capture_end simply runs eagerly. The tests below pin that the stand-in keeps the rules a real graph
keeps, so tests built on it cannot pass on behaviour a GPU would refuse.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


class EagerGraphBase:
    """What ``torch._C._CUDAGraph`` does, minus the GPU: capture state, pools, replays."""

    _pool_ids = itertools.count(1)

    def __new__(cls, keep_graph: bool = False) -> EagerGraphBase:
        return object.__new__(cls)

    def __init__(self, keep_graph: bool = False) -> None:
        self.capturing = False
        self.captured = False
        self.eager_replays = 0
        self._pool: tuple[int, int] | None = None

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global") -> None:
        if self.capturing:
            raise RuntimeError("capture_begin called while this graph is already capturing")
        self._pool = (0, next(EagerGraphBase._pool_ids)) if pool is None else (int(pool[0]), int(pool[1]))
        self.capturing = True

    def capture_end(self) -> None:
        if not self.capturing:
            raise RuntimeError("capture_end called without capture_begin")
        self.capturing = False
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a graph that was never captured")
        self.eager_replays += 1

    def reset(self) -> None:
        self.captured = False

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("a graph has no pool before capture_begin")
        return self._pool


def standin_possible() -> bool:
    """True on CPU-only torch, whose CUDAGraph base is a plain Python placeholder class."""
    base = torch.cuda.CUDAGraph.__bases__[0]
    return base is EagerGraphBase or (not torch.cuda.is_available() and type(base) is type)


@contextmanager
def eager_cuda_graphs() -> Iterator[type]:
    """Make the real ``torch.cuda.CUDAGraph`` usable without a GPU, for the duration."""
    cls = torch.cuda.CUDAGraph
    if not standin_possible():
        pytest.skip("this torch has a real CUDA graph base; the cuda-marked tests cover it")
    bases = cls.__bases__
    cls.__bases__ = (EagerGraphBase,)
    try:
        yield cls
    finally:
        cls.__bases__ = bases


@pytest.fixture
def standin() -> Iterator[type]:
    with eager_cuda_graphs() as cls:
        yield cls


def test_standin_runs_the_real_cudagraph_class(standin: type) -> None:
    graph = torch.cuda.CUDAGraph()
    assert type(graph) is torch.cuda.CUDAGraph
    graph.capture_begin()
    graph.capture_end()
    graph.replay()
    assert graph.eager_replays == 1


def test_standin_refuses_what_a_gpu_refuses(standin: type) -> None:
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="never captured"):
        graph.replay()
    with pytest.raises(RuntimeError, match="without capture_begin"):
        graph.capture_end()
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="already capturing"):
        graph.capture_begin()


def test_standin_shares_a_pool_when_given_one(standin: type) -> None:
    first, second, third = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    first.capture_begin()
    second.capture_begin(pool=first.pool())
    third.capture_begin()
    assert second.pool() == first.pool() != third.pool()


def test_standin_is_removed_afterwards() -> None:
    if not standin_possible():
        pytest.skip("CUDA build")
    original = torch.cuda.CUDAGraph.__bases__
    with eager_cuda_graphs():
        assert torch.cuda.CUDAGraph.__bases__ == (EagerGraphBase,)
    assert torch.cuda.CUDAGraph.__bases__ == original
