"""What torch.compile's cudagraph trees know about a graph they capture, read off their own frames.

The trees record a graph from ``CUDAGraphTreeManager._run`` (through ``record_function``,
``CUDAGraphNode`` and ``torch.cuda.graph``), called from the code dynamo compiled. At
``capture_begin`` the watch walks the stack it walks anyway and reads, without calling anything:

- the *compiled function*: the innermost frame whose code dynamo produced (its code object is a key
  of ``torch._dynamo.utils.orig_code_map``), named as the user wrote it (``LlamaForCausalLM.forward``
  for a module called through ``torch.compile(model.__call__)``, ``step`` for a function), with its
  tensor arguments, which show the batch, sequence and cache sizes;
- the *re-record reason*: when the trees record a function that already has graphs at that place
  in the tree, ``_run`` holds the ``status`` of the invariant check that failed (and the deferred
  message builder torch keeps for it); the watch turns the status into the reason and checks for
  itself which inputs moved.

Nothing in torch is changed to learn this: no logger level (lowering the trees' logger to DEBUG
makes torch build its debug message eagerly, and that debug-only code fails an assertion at batch
32 with torch 2.11), no patched method. A torch whose trees are written otherwise yields no reason
and no function name; every read is guarded, so it can never fail the capture.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from inspector.watch.frames import in_torch, tensor_arguments
from inspector.watch.identity import COMPILED_VIA, BatchShape, CallSite, CapturedInputs

TREES_FILE = f"_inductor{os.sep}cudagraph_trees.py"
MANAGER_FRAMES = ("_run", "run")
"""``CUDAGraphTreeManager``'s dispatch: ``_run`` since torch 2.2, ``run`` before it."""
MODULE_CALL_FRAMES = ("_call_impl", "_wrapped_call_impl", "__call__")
MOVED_SHOWN = 4
"""Inputs named in a re-record's message; the rest are counted."""
_RESUME = re.compile(r"torch_dynamo_resume_in_(?P<function>.+)_at_(?P<line>\d+)$")


@dataclass(frozen=True)
class Rerecord:
    """Why the trees recorded a function again instead of replaying one of its graphs."""

    reason: str
    """The check that failed, as torch names it: "static input data pointer changed", ..."""
    detail: str = ""
    """Which inputs moved, where the watch could tell."""
    compile_id: str = ""


@dataclass(frozen=True)
class TreeCapture:
    """A capture by the cudagraph trees: for the function dynamo compiled, and why, if a re-record."""

    function: str
    """The compiled function as the user names it ("" when no compiled frame was found)."""
    site: CallSite | None
    """Where that function is defined, ``via torch.compile``: one site per compiled function."""
    inputs: CapturedInputs = field(default_factory=CapturedInputs)
    """The compiled function's tensor arguments (the user's inputs, not the graph's flattened ones)."""
    shape: BatchShape | None = None
    rerecord: Rerecord | None = None
    keeps_pool_alive: bool = False
    """The empty graph each tree manager captures at start to keep its memory pool alive, told
    under the compiled function whose first run made the manager."""


def tree_capture(
    frames: list[types.FrameType], graph_inputs: Iterable[torch.Tensor] = ()
) -> TreeCapture | None:
    """The trees' view of this capture, or None when the trees are not the capturer."""
    manager = _manager_frame(frames)
    if manager is None:
        return None
    compiled, name, site = compiled_function(frames[frames.index(manager) :])
    if manager.f_code.co_name == "__init__":
        # The manager is made when the first compiled function with CUDA graphs runs on a device:
        # its pool's keep-alive graph is told under that function (no inputs: it is empty).
        return TreeCapture(function=name, site=site, keeps_pool_alive=True)
    local = manager.f_locals
    user = list(tensor_arguments(compiled)) if compiled is not None else []
    inputs = CapturedInputs.from_named(user)
    shape = BatchShape.of(user, graph_inputs)
    return TreeCapture(
        function=name,
        site=site,
        inputs=inputs,
        shape=shape,
        rerecord=rerecord_of(local, compile_id=_compile_id(local.get("self"))),
    )


def _manager_frame(frames: list[types.FrameType]) -> types.FrameType | None:
    """The innermost frame of the trees' manager: the dispatch that records, or its constructor."""
    for frame in frames:
        code = frame.f_code
        if not code.co_filename.endswith(TREES_FILE):
            continue
        if code.co_name in MANAGER_FRAMES and "function_id" in code.co_varnames:
            return frame
        if code.co_name == "__init__" and _qualname(code) == "CUDAGraphTreeManager.__init__":
            return frame
    return None


def _qualname(code: types.CodeType) -> str:
    """A code object's qualified name, without touching its frame's locals: a snapshot of those
    would keep tensors alive that torch's trees expect to be freed (their liveness checks)."""
    qualname = getattr(code, "co_qualname", None)  # Python 3.11+
    if qualname is not None:
        return qualname
    return "CUDAGraphTreeManager.__init__" if code.co_varnames[:2] == ("self", "device_index") else ""


def compiled_function(
    frames: list[types.FrameType],
) -> tuple[types.FrameType | None, str, CallSite | None]:
    """The innermost frame dynamo compiled, the function's name and where it is defined."""
    originals = _orig_code_map()
    if originals is None:
        return None, "", None
    index = next((i for i, frame in enumerate(frames) if frame.f_code in originals), None)
    if index is None:
        return None, "", None
    frame, original = frames[index], originals[frames[index].f_code]
    resume = _RESUME.match(original.co_name)
    module = _called_module(frames[index:])
    if module is not None:
        method = original.co_name if hasattr(type(module), original.co_name) else "forward"
        name = f"{type(module).__qualname__}.{method}"
        defined = _code_of(getattr(type(module), method, None)) or original
    else:
        name = getattr(original, "co_qualname", original.co_name)
        defined = original
    if resume is not None:
        name = f"{name if module is not None else resume['function']} after line {resume['line']}"
    site = CallSite(defined.co_filename, defined.co_firstlineno, name, via=COMPILED_VIA)
    return frame, name, site


def _orig_code_map() -> Mapping[types.CodeType, types.CodeType] | None:
    """dynamo's map from the code it produced to the user's code; None while dynamo is not loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    return getattr(utils, "orig_code_map", None)


def _called_module(frames: list[types.FrameType]) -> torch.nn.Module | None:
    """The module whose call reached the compiled frame: its own ``self``, or the ``self`` of the
    module-call plumbing around it (a decorator's wrapper in between has no ``self`` of its own)."""
    for position, frame in enumerate(frames):
        if position and not in_torch(frame):
            return None  # the caller of the compiled code: no module was called on the way
        if position and frame.f_code.co_name not in MODULE_CALL_FRAMES:
            continue
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and not isinstance(owner, torch.fx.GraphModule):
            return getattr(owner, "_orig_mod", owner)  # torch.compile(model) wraps the module
    return None


def _code_of(function: object) -> types.CodeType | None:
    try:
        return inspect.unwrap(function).__code__  # type: ignore[arg-type, union-attr]
    except (AttributeError, TypeError, ValueError):
        return None


def _compile_id(manager: object) -> str:
    compile_id = getattr(manager, "compile_id", None)
    return "" if compile_id is None else str(compile_id)


def rerecord_of(local: Mapping[str, object], *, compile_id: str = "") -> Rerecord | None:
    """The re-record the trees' dispatch is making, from its locals; None for a first recording.

    ``status`` is the result of ``CUDAGraphNode.check_invariants`` for the last graph of the
    function at this place in the tree; it exists only when the function had graphs there and none
    could run. torch's own message builder (``status_logger``) is never called: at torch 2.11 it
    asserts that the inputs, recorded pointers and placeholders have one length, which they need not.
    """
    status = local.get("status")
    if status is None or getattr(status, "name", "SUCCESS") == "SUCCESS":
        return None
    detail = moved_inputs(local.get("status_logger"))
    return Rerecord(reason=str(status), detail=detail, compile_id=compile_id)


def moved_inputs(status_logger: object) -> str:
    """The inputs whose data pointer differs from the recording's, from the arguments torch bound
    for its message (placeholders, inputs, recorded pointers, indices to check); "" when unknown."""
    if not isinstance(status_logger, functools.partial) or len(status_logger.args) < 4:
        return ""
    placeholders, inputs, recorded, indices = status_logger.args[:4]
    try:
        moved = list(_moved(placeholders, inputs, recorded, indices))
    except Exception:  # torch's own structures, read defensively: no detail rather than a failure
        return ""
    if not moved:
        return ""
    shown = ", ".join(moved[:MOVED_SHOWN])
    more = len(moved) - MOVED_SHOWN
    return f"inputs whose address changed: {shown}{f' (+{more} more)' if more > 0 else ''}"


def _moved(placeholders: object, inputs: object, recorded: object, indices: object) -> Iterator[str]:
    for index in indices:  # type: ignore[attr-defined]
        if not (0 <= index < len(inputs) and index < len(recorded)):  # type: ignore[arg-type]
            continue
        tensor, was = inputs[index], recorded[index]  # type: ignore[index]
        if not isinstance(tensor, torch.Tensor) or was is None or tensor.data_ptr() == was:
            continue
        name = getattr(placeholders[index], "name", "") if index < len(placeholders) else ""  # type: ignore[arg-type, index]
        yield f"{name or f'input {index}'} {'x'.join(map(str, tensor.shape)) or 'scalar'}"

