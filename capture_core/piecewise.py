"""Piecewise (breakable) CUDA graphs: capture everything but attention.

A mixed prefill/decode batch has attention shapes that vary with every batch, so a single graph
cannot serve it. A model marks its attention modules with :func:`attention_boundary`; a piecewise
graph splits the model at those calls and captures the segments between them, running attention
eagerly between segment replays.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

_BREAK_ATTR = "_graph_inspector_break_point"

ModuleType = TypeVar("ModuleType", bound=type[nn.Module])


def attention_boundary(module_class: ModuleType) -> ModuleType:
    """Class decorator: calls to modules of this class are graph break points.

    The module runs eagerly between graph segments, so it may have data-dependent shapes and host
    logic. It must not return a tensor the next segment reads: it fills an output buffer that the
    code before it allocated (which then lives at a fixed address inside the previous segment).
    """
    setattr(module_class, _BREAK_ATTR, True)
    return module_class


def is_break_point(module: nn.Module) -> bool:
    """True for modules whose class was marked with :func:`attention_boundary`."""
    return bool(getattr(type(module), _BREAK_ATTR, False))
