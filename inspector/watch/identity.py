"""Who captured a graph, and with what: the identity of a graph seen from outside the engine.

An engine that calls ``torch.cuda.CUDAGraph`` directly tells us nothing about its graphs, so the
identity is read off the capture itself: the *call site* (the first frame of the capturing code,
past ``torch.cuda.graph``'s own ``__enter__`` and context-manager plumbing) plus the *shapes* of the
tensors that code was called with. The same code capturing the same shapes always gets the same
identity, run after run, which is what makes "captured again" and "never replayed" meaningful.
Reading the capturing code off the stack (its frames, its call site, its tensors) is ``frames``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from capture_core.descriptor import BatchDescriptor

KEY_LIMIT = 128
"""``graphs.descriptor_key`` is a String(128)."""
WRAPPER_LIMIT = 200
"""``graphs.wrapper`` is a String(200)."""
MAX_INPUTS = 256
"""Inputs remembered per graph (names and addresses); torch.compile passes every parameter."""
COMPILED_VIA = "torch.compile"
"""``CallSite.via`` of a compiled function's graphs (their site is where the function is defined)."""
SHAPES_SHOWN = 6
"""Shapes spelled out in a key; the digest covers all of them."""


@dataclass(frozen=True, slots=True)
class WatchedDescriptor(BatchDescriptor):
    """A graph key for a graph the engine captured itself: a BatchDescriptor plus its identity.

    Two watched graphs of the same leading size are different graphs when their call sites or
    shapes differ; carrying the identity in the key keeps them apart in every counter and table
    that is keyed by descriptor, and ``key`` (the stored ``descriptor_key``) is the identity.
    """

    identity: str = ""
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super(WatchedDescriptor, self).__post_init__()
        fields = (self.num_tokens, self.num_reqs, self.uniform, self.has_lora, self.num_active_loras)
        object.__setattr__(self, "_hash", hash((*fields, self.identity)))

    def __hash__(self) -> int:
        # Hashed on every replay by the recorder's counter: computed once, not per call.
        return self._hash

    @property
    def key(self) -> str:
        return self.identity


@dataclass(frozen=True, slots=True)
class CallSite:
    """Where a capture was started from, in the engine's code."""

    filename: str
    lineno: int
    function: str
    via: str = ""
    """The torch machinery in between, when torch itself captured (torch.compile, graphed callables)."""

    @property
    def short(self) -> str:
        return _site_names(self).short

    @property
    def text(self) -> str:
        """The site as the ``wrapper`` column shows it: the path (relative where it can be), line,
        function and what torch machinery was in between."""
        return _site_names(self).text

    @property
    def stable(self) -> str:
        """The parts of the site that survive a reinstall or another checkout path."""
        return _site_names(self).stable

    @property
    def key(self) -> str:
        """A short key for the call site alone (re-recording storms are counted per site)."""
        return _site_names(self).key


class _SiteNames(NamedTuple):
    short: str
    text: str
    stable: str
    key: str


@functools.lru_cache(maxsize=4096)
def _site_names(site: CallSite) -> _SiteNames:
    """A site's names, spelled out once per site: a function torch.compile re-records on every call
    captures from one site again and again (and each capture and storm reads several of them)."""
    base = os.path.basename(site.filename)
    text = f"{_display_path(site.filename)}:{site.lineno} in {site.function}"
    if site.via:
        text += f" via {site.via}"
    stable = f"{base}:{site.lineno}:{site.function}:{site.via}"
    short = f"{base}:{site.lineno}"
    return _SiteNames(short, _clip(text, WRAPPER_LIMIT), stable, f"{short} site #{digest(stable)}")


@dataclass(frozen=True, slots=True)
class BatchShape:
    """Batch size, tokens per sequence and cache length, where a graph's inputs show them.

    Read from the tensors the compiled function was called with: token ids are the argument named
    ``input_ids`` (transformers' name), else the first 2-D integer tensor that is not a mask:
    batch x sequence; without any, the first tensor's leading size is the batch. The cache length
    is the third size of the 4-D floating tensors of that batch among all inputs (a KV cache laid
    out batch x heads x length x head size, as transformers' static cache is).
    """

    batch: int
    seq: int | None = None
    cache: int | None = None

    @classmethod
    def of(
        cls, user: Iterable[tuple[str, torch.Tensor]], graph: Iterable[torch.Tensor] = ()
    ) -> BatchShape | None:
        user = list(user)
        integer = [(n, t) for n, t in user if t.dim() == 2 and _is_integer(t)]
        ids = next((t for n, t in integer if n.endswith("input_ids")), None)
        ids = ids if ids is not None else next((t for n, t in integer if "mask" not in n), None)
        if ids is not None:
            batch, seq = int(ids.shape[0]), int(ids.shape[1])
        else:
            first = next((t for _, t in user if t.dim() >= 1), None)
            if first is None:
                return None
            batch, seq = int(first.shape[0]), None
        if batch < 1:
            return None
        lengths = [
            int(t.shape[2])
            for t in (*(t for _, t in user), *graph)
            if t.dim() == 4 and t.is_floating_point() and int(t.shape[0]) == batch
        ]
        return cls(batch, seq, max(lengths) if lengths else None)

    @property
    def num_tokens(self) -> int:
        return self.batch * (self.seq or 1)

    @property
    def text(self) -> str:
        parts = [f"batch {self.batch}"]
        if self.seq is not None:
            parts.append(f"seq {self.seq}")
        if self.cache is not None:
            parts.append(f"cache {self.cache}")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class GraphIdentity:
    """A call site, the shapes it was called with, and a label for torch's own multi-graph captures.

    ``batch`` is set for graphs of a compiled function (torch.compile's trees): the key then reads
    as the function and its batch ("LlamaForCausalLM.forward batch 8 · seq 1 · cache 64 #..."), and
    the descriptor carries the batch as ``num_reqs`` and batch x sequence as ``num_tokens``.
    """

    site: CallSite
    shapes: tuple[tuple[int, ...], ...]
    label: str = ""
    batch: BatchShape | None = None

    @property
    def shapes_text(self) -> str:
        if not self.shapes:
            return "[inputs unseen]"
        shown = ", ".join(_shape_text(s) for s in self.shapes[:SHAPES_SHOWN])
        more = len(self.shapes) - SHAPES_SHOWN
        return f"[{shown}{f', +{more} more' if more > 0 else ''}]"

    @property
    def key(self) -> str:
        """Stable, unique and at most 128 characters: readable head, digest of everything."""
        tail = f" #{_identity_digest(self.site.stable, self.shapes, self.label)}"
        if self.batch is not None:
            head = f"{self.site.function} {self.batch.text}"
        elif self.site.via == COMPILED_VIA:
            head = self.site.function  # a compiled function's graph that shows no batch
        else:
            head = f"{self.site.short} {self.shapes_text}"
        if self.label:
            head += f" {self.label}"
        return _clip(head, KEY_LIMIT - len(tail)) + tail

    @property
    def num_tokens(self) -> int:
        """batch x sequence where known, else the leading dimension of the first input (else 1)."""
        if self.batch is not None:
            return self.batch.num_tokens
        for shape in self.shapes:
            if shape:
                return max(int(shape[0]), 1)
        return 1

    def descriptor(self) -> WatchedDescriptor:
        batch = self.batch
        if batch is None:
            return WatchedDescriptor(num_tokens=self.num_tokens, identity=self.key)
        return WatchedDescriptor(
            num_tokens=self.num_tokens, num_reqs=batch.batch, uniform=batch.seq == 1, identity=self.key
        )


@dataclass(frozen=True, slots=True)
class CapturedInputs:
    """The tensors the capturing code was called with: names, shapes and baked-in addresses."""

    names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    addresses: tuple[int, ...] = ()

    @classmethod
    def from_named(cls, named: Iterable[tuple[str, torch.Tensor]]) -> CapturedInputs:
        names, shapes, addresses = [], [], []
        for name, tensor in named:
            if len(names) >= MAX_INPUTS:
                break
            names.append(name)
            shapes.append(tuple(tensor.shape))  # torch.Size: a tuple of ints already
            addresses.append(_address(tensor))
        return cls(tuple(names), tuple(shapes), tuple(addresses))

    def __bool__(self) -> bool:
        return bool(self.names)


def _display_path(filename: str) -> str:
    cwd = os.getcwd() + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd):]
    marker = f"site-packages{os.sep}"
    if marker in filename:
        return filename.split(marker, 1)[1]
    return filename


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype is not torch.bool


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _address(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0  # tensors without storage (meta, fake) have no address to bake in


def digest(text: str) -> str:
    """A short stable digest: keys stay unique when their readable part is clipped."""
    return hashlib.sha1(text.encode()).hexdigest()[:8]


@functools.lru_cache(maxsize=1024)
def _identity_digest(site: str, shapes: tuple[tuple[int, ...], ...], label: str) -> str:
    """Remembered: torch.compile re-records a function with the same inputs on every call of some
    programs (transformers' static cache), and spelling out a hundred shapes each time adds up."""
    return digest(f"{site}|{shapes}|{label}")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
