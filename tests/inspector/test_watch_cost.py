"""What the watch costs the program, counted rather than timed: the Python functions of the watch
that run on the program's thread. A generate() with no graphs runs none (nothing is installed on
the eager path: no module hook, no profiler, no filter on a logger it writes to), and a replay runs
two (the patched ``replay`` and its counter). Timings of the same are in bench/gpu_transformers.py.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_watch_standin import eager_cuda_graphs

from inspector import watch
from inspector.watch import api
from inspector.watch.compile_log import OLDER_SKIP_LOGGER, SKIP_LOGGER

PACKAGE = str(Path(watch.__file__).resolve().parents[1]) + "/"
"""The inspector package: any of its functions running counts."""


@contextmanager
def watch_calls() -> Iterator[list[str]]:
    """The names of the inspector's Python functions called on this thread, in order."""
    calls: list[str] = []

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            calls.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def global_module_hooks() -> dict[str, int]:
    module = torch.nn.modules.module
    names = [name for name in vars(module) if name.startswith("_global_") and name.endswith("hooks")]
    return {name: len(getattr(module, name)) for name in names if getattr(module, name)}


def test_the_counter_sees_the_watchs_own_functions() -> None:
    """The control for the tests below: a call into the watch is counted."""
    with watch_calls() as calls:
        api.current()
    assert calls == ["current"]


@pytest.mark.slow
def test_a_generate_without_graphs_runs_no_code_of_the_watch(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 64, (2, 5))

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                  min_new_tokens=6, do_sample=False, cache_implementation="static",
                                  disable_compile=True, pad_token_id=0)

    bare = generate()
    before = global_module_hooks()
    watch.install(f"sqlite:///{tmp_path / 'watch.db'}")
    try:
        assert global_module_hooks() == before
        taps = {name: logging.getLogger(name).filters for name in (SKIP_LOGGER, OLDER_SKIP_LOGGER)}
        assert all(len(filters) == 1 for filters in taps.values())  # only torch's skip loggers
        with watch_calls() as calls:
            watched = generate()
        assert sys.getprofile() is None and sys.gettrace() is None
    finally:
        watch.uninstall()
    assert calls == []
    assert torch.equal(watched, bare)
    assert not (tmp_path / "watch.db").exists()  # nothing captured, nothing recorded


def test_a_replay_runs_the_patched_replay_and_its_counter_and_nothing_else(tmp_path: Path) -> None:
    with eager_cuda_graphs():
        watch.install(f"sqlite:///{tmp_path / 'watch.db'}")
        try:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin()
            graph.capture_end()
            replay: Callable[[], None] = graph.replay
            with watch_calls() as calls:
                for _ in range(10):
                    replay()
            (watched,) = watch.current().graphs  # type: ignore[union-attr]
        finally:
            watch.uninstall()
    assert calls == ["replay", "count"] * 10  # hooks.py's patched replay and its counter
    assert watched.replays == 10
