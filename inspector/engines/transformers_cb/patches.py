"""Where the integration meets transformers: three methods of its ``ModelRunner`` wrapped, and the
reads of its own objects that tell what each step did.

``ModelRunner.compute_batch`` runs every step: with CUDA graphs on for the step's path it looks the
step's key up in the inputs-and-outputs object's graphs and replays the graph, or calls
``_capture_graph`` (one eager forward in the graph pool, then the capture) when there is none; with
graphs off for the path it runs the step eagerly. ``ModelRunner.warmup`` captures graphs before
serving (the largest varlen batch, and the decode fast path's sizes when it has one). The wrappers
call the originals unchanged, with the same arguments, and only read: the step's key
(``_get_graph_key``), its real tokens (``total_seqlen_q``: the query tokens before padding), which
path and whether that path uses graphs, transformers' graph buffer, the graph pool's id. Nothing
they do can change a token; what fails in them is contained (counted, logged once) and the step goes
on.

Read against transformers 5.17, 5.24 and 5.25 (``version.py``); the names used exist in each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from inspector.watch.identity import CapturedInputs

PATCHED = ("warmup", "compute_batch", "_capture_graph")
"""The ``ModelRunner`` methods wrapped."""
CONFIG_FIELDS = (
    "use_cuda_graph",
    "q_padding_interval_size",
    "kv_padding_interval_size",
    "max_batch_tokens",
    "num_blocks",
    "block_size",
    "page_size",
    "max_requests_per_batch",
    "max_blocks_per_request",
    "use_async_batching",
    "allow_block_sharing",
    "scheduler_type",
)
"""The resolved continuous-batching configuration kept on the run (those the release has)."""
STEP_TENSORS = ("carry_over_ids", "prev_output_ids", "output_ids")
"""What ``_capture_graph`` passes after the model and its inputs, in order."""


class Hooks(Protocol):
    """What the wrappers call: the attachment (``attachment.py``)."""

    def warmup(self, runner: Any, model: Any, original: Callable[..., Any]) -> Any: ...

    def compute_batch(
        self, runner: Any, model: Any, batch_data: dict, original: Callable[..., Any]
    ) -> Any: ...

    def capture_graph(self, runner: Any, args: tuple[Any, ...], original: Callable[..., Any]) -> Any: ...


@dataclass(frozen=True)
class Transformers:
    """The installed transformers' continuous-batching classes the integration reads."""

    version: str
    model_runner: type
    async_ios: type

    @classmethod
    def load(cls) -> Transformers:
        import transformers
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs
        from transformers.generation.continuous_batching.model_runner import ModelRunner

        return cls(transformers.__version__, ModelRunner, ContinuousBatchingAsyncIOs)

    def missing(self) -> list[str]:
        """The names this release lacks of those the integration reads (empty when all are there)."""
        runner = self.model_runner
        return [f"ModelRunner.{name}" for name in PATCHED if not callable(getattr(runner, name, None))]

    def device_io(self, runner: Any) -> tuple[Any, int | None]:
        """The inputs-and-outputs object that holds this step's graphs, and its async pair."""
        ios = runner.inputs_and_outputs
        if isinstance(ios, self.async_ios):
            return ios.io_pairs[ios.current_pair].device_io, ios.current_pair
        return ios, None


class Patch:
    """The three wrappers, installed on ``ModelRunner`` itself (every runner, made before or after)."""

    def __init__(self, target: type, hooks: Hooks) -> None:
        self.target = target
        self.originals = {name: target.__dict__[name] for name in PATCHED}
        self.wrappers = {name: self._wrap(name, hooks) for name in PATCHED}

    def _wrap(self, name: str, hooks: Hooks) -> Callable[..., Any]:
        original = self.originals[name]
        if name == "warmup":

            def wrapper(runner: Any, model: Any) -> Any:
                return hooks.warmup(runner, model, original)

        elif name == "compute_batch":

            def wrapper(runner: Any, model: Any, batch_data: dict) -> Any:
                return hooks.compute_batch(runner, model, batch_data, original)

        else:

            def wrapper(runner: Any, *args: Any) -> Any:
                return hooks.capture_graph(runner, args, original)

        return functools.wraps(original)(wrapper)

    def install(self) -> None:
        for name, wrapper in self.wrappers.items():
            setattr(self.target, name, wrapper)

    def uninstall(self) -> None:
        """Put the originals back (where the wrapper is still the one installed)."""
        for name, wrapper in self.wrappers.items():
            if self.target.__dict__.get(name) is wrapper:
                setattr(self.target, name, self.originals[name])


def graphs_on(runner: Any, io: Any) -> bool:
    """Whether this step's path (decode fast path or varlen) runs through CUDA graphs."""
    return bool(runner.use_cuda_graph_decode if io.use_block_table else runner.use_cuda_graph_varlen)


def graph_inputs(args: tuple[Any, ...]) -> CapturedInputs:
    """The tensors a captured step reads, by name, with the addresses baked in: the model's keyword
    inputs (``batch_data``: ids, positions, lengths, cache indices, mask, block table) and the
    step's own (``carry_over_ids``, ``prev_output_ids``, ``output_ids``)."""
    _model, batch_data, *extra = args
    named = list(_named(batch_data))
    named += [(name, tensor) for name, tensor in zip(STEP_TENSORS, extra, strict=False) if _is_tensor(tensor)]
    return CapturedInputs.from_named(named)


def _named(batch_data: dict) -> Iterator[tuple[str, Any]]:
    for name, value in batch_data.items():
        if _is_tensor(value):
            yield name, value
        elif isinstance(value, (list, tuple)):
            yield from ((f"{name}[{i}]", item) for i, item in enumerate(value) if _is_tensor(item))
        elif isinstance(value, dict):
            yield from ((f"{name}[{key}]", item) for key, item in value.items() if _is_tensor(item))


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def run_config(runner: Any, model: Any, version: str) -> dict[str, Any]:
    """What the run's row keeps: transformers' release, the attention, the resolved configuration."""
    config: dict[str, Any] = {
        "source": "transformers continuous batching",
        "transformers": version,
        "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
    }
    cb_config = runner.cb_config
    for name in CONFIG_FIELDS:
        if hasattr(cb_config, name):
            value = getattr(cb_config, name)
            config[name] = list(value) if isinstance(value, tuple) else value
    config["compiled"] = {
        "varlen": cb_config.varlen_compile_config is not None,
        "decode": cb_config.decode_compile_config is not None,
    }
    return config
