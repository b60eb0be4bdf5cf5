"""The capturing code, read off the stack: its frames, its call site and the tensors it holds.

A capture is seen from inside torch (``CUDAGraph.capture_begin``, or torch.compile's recorder), so
the engine's own code is found by walking outwards past the watch's and contextlib's plumbing and,
for the call site, past torch itself. Files are classified once each: every capture walks the whole
stack, and its files repeat.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from collections.abc import Iterator

import torch

from inspector.watch.identity import MAX_INPUTS, CallSite, CapturedInputs

_WATCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CONTEXTLIB = os.path.abspath(sys.modules["contextlib"].__file__ or "contextlib.py")
_GRAPHS_PY = os.path.abspath(sys.modules["torch.cuda.graphs"].__file__ or "graphs.py")


def capture_frames(start: types.FrameType | None) -> list[types.FrameType]:
    """The frames of the capturing code, innermost first, without watch/contextlib/graph plumbing."""
    frames = []
    frame = start
    while frame is not None:
        if not _is_plumbing(frame):
            frames.append(frame)
        frame = frame.f_back
    return frames


def find_call_site(frames: list[types.FrameType]) -> CallSite:
    """The first frame outside torch; the torch frame that captured, when torch did it for the caller."""
    if not frames:
        return CallSite("<unknown>", 0, "<unknown>")
    capturer = frames[0]
    for frame in frames:
        if not in_torch(frame):
            via = "" if frame is capturer else _torch_function_name(capturer)
            return CallSite(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, via)
    return CallSite(capturer.f_code.co_filename, capturer.f_lineno, capturer.f_code.co_name)


def find_inputs(frames: list[types.FrameType]) -> list[tuple[str, torch.Tensor]]:
    """Tensor arguments of the nearest capturing frame that has any, up to the engine's own frame.

    torch.compile's recorder is called with the graph's inputs; vLLM-style wrappers with the
    model's. Code that captures without tensor arguments is covered, in order, by the module
    pre-hook in ``hooks`` (what the first module was called with) and ``find_local_inputs``.
    """
    for frame in frames:
        named = list(tensor_arguments(frame))
        if named:
            return named
        if not in_torch(frame):
            break
    return []


def find_local_inputs(frames: list[types.FrameType]) -> CapturedInputs:
    """The tensors the engine's own function holds when it starts the capture: SGLang-style
    runners slice their static buffers into locals and call ``forward`` directly (no module hook
    fires). A guess, so the last resort; module-level code has no locals of its own to look at."""
    for frame in frames:
        if not in_torch(frame):
            if frame.f_code.co_flags & 0x02:  # CO_NEWLOCALS: a function, not module-level code
                return CapturedInputs.from_named(_tensor_locals(frame))
            break
    return CapturedInputs()


def named_tensors(prefix: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in ``value``, one container level deep (lists, tuples, dicts of tensors)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value[:MAX_INPUTS]):
            if isinstance(item, torch.Tensor):
                yield f"{prefix}[{index}]", item
    elif isinstance(value, dict):
        for key, item in list(value.items())[:MAX_INPUTS]:
            if isinstance(item, torch.Tensor):
                yield f"{prefix}[{key!r}]", item


def format_stack(frames: list[types.FrameType], limit: int = 40) -> str:
    """A traceback-style stack of the capture, outermost call first."""
    lines = []
    for frame in reversed(frames[:limit]):
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
        source = linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals).strip()
        if source:
            lines.append(f"    {source}\n")
    return "".join(lines)


def tensor_arguments(frame: types.FrameType) -> Iterator[tuple[str, torch.Tensor]]:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    varargs = bool(code.co_flags & 0x04)  # CO_VARARGS
    varkw = bool(code.co_flags & 0x08)  # CO_VARKEYWORDS
    names = list(code.co_varnames[:count])
    star = code.co_varnames[count] if varargs else None
    starstar = code.co_varnames[count + varargs] if varkw else None
    values = frame.f_locals
    for name in names:
        if name in ("self", "cls"):
            continue
        yield from named_tensors(name, values.get(name))
    if star is not None:
        for index, item in enumerate(values.get(star, ())):
            yield from named_tensors(f"{star}[{index}]", item)
    if starstar is not None:
        for key, item in dict(values.get(starstar, {})).items():
            yield from named_tensors(str(key), item)


def _tensor_locals(frame: types.FrameType) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in list(frame.f_locals.items()):
        if name not in ("self", "cls"):
            yield from named_tensors(name, value)


_PLUMBING, _GRAPHS, _TORCH = 1, 2, 4
_file_kinds: dict[str, int] = {}
"""Filename -> what it is: every capture walks the whole stack, whose files repeat. Relative names
are not kept (after a chdir the same name is another file)."""


def _file_kind(filename: str) -> int:
    kind = _file_kinds.get(filename)
    if kind is None:
        kind = _classify(filename)
        if filename.startswith("<") or os.path.isabs(filename):
            _file_kinds[filename] = kind
    return kind


def _classify(filename: str) -> int:
    if filename.startswith("<"):  # not a file: "<eval_with_key>.3" (FX), "<string>", "<frozen ...>"
        return _TORCH if filename.startswith("<eval_with_key>") else 0
    path = os.path.abspath(filename)
    return (
        (_PLUMBING if path.startswith(_WATCH_DIR) or path == _CONTEXTLIB else 0)
        | (_GRAPHS if path == _GRAPHS_PY else 0)
        | (_TORCH if _in_inductor_cache(filename) or path.startswith(_TORCH_DIR) else 0)
    )


def _is_plumbing(frame: types.FrameType) -> bool:
    kind = _file_kind(frame.f_code.co_filename)
    if kind & _GRAPHS:
        return frame.f_code.co_name in ("__enter__", "__exit__")
    return bool(kind & _PLUMBING)


def in_torch(frame: types.FrameType) -> bool:
    """torch's own code, and the code torch generates: FX graph modules (``<eval_with_key>.N``) and
    Inductor's compiled modules, written as .py files under its cache directory."""
    return bool(_file_kind(frame.f_code.co_filename) & _TORCH)


def _in_inductor_cache(filename: str) -> bool:
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir and os.path.abspath(filename).startswith(os.path.abspath(cache_dir)):
        return True
    return f"{os.sep}torchinductor_" in filename


def _torch_function_name(frame: types.FrameType) -> str:
    module = frame.f_globals.get("__name__", "torch")
    return f"{module}.{frame.f_code.co_name}"
