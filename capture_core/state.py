"""The wrapped module's own state: its parameters and buffers, which a graph bakes in like inputs.

Reloading weights by assignment (``lin.weight = nn.Parameter(new)``) instead of ``copy_`` leaves a
CUDA graph reading the old weights; so does ``lin.weight.data = new``, moving the model with
``.to()``, or swapping a submodule. At capture every parameter and buffer is recorded by its
qualified name (``self.layers.0.lin.weight``) with its object and layout.

Re-reading hundreds of parameters on every replay would cost more than the replay saves, so the
check is split by cost:

* always on: PyTorch's global module registration hooks count every assignment of a parameter,
  buffer or submodule anywhere in the process (one integer bump each), and a graph's replay guard
  compares that count with the one it last checked at; what no module hook sees - ``param.data =
  new`` (an RL weight sync does this), ``set_``, ``.to()``, ``swap_tensors``, a buffer resized in
  place - is counted where it happens (``capture_core.swaps``, for every parameter and buffer a graph
  holds) and compared the same way; the guard reads the address of a tensor whose class could bypass
  that count, and of no other. Any of these is found at the very next replay of every graph.
* on sampled replays (and every debug replay), and whenever the guard said no, every parameter and
  buffer re-read from its module's dict and its address compared (a different object: its whole
  layout); after a counted registration the module tree is walked again by name, which finds a
  replaced submodule.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from capture_core.checks import Finding
from capture_core.inputs import LayoutKey, compare, layout_key
from capture_core.swaps import DATA_SWAPS, counted, watch

REGISTRATIONS = [0]
"""How many parameters, buffers and submodules have been assigned in this process since the
hooks were installed (a one-element list: the replay guard reads it in place)."""
_installed = False


def _count(module: nn.Module, name: str, value: object) -> None:
    REGISTRATIONS[0] += 1


def watch_registrations() -> None:
    """Install the counting hooks (once per process; they stay: each costs one integer bump)."""
    global _installed
    if not _installed:
        module_hooks.register_module_parameter_registration_hook(_count)
        module_hooks.register_module_buffer_registration_hook(_count)
        module_hooks.register_module_module_registration_hook(_count)
        _installed = True


@dataclass(frozen=True)
class StateTensor:
    """One parameter or buffer a graph baked in, and where its module keeps it."""

    name: str
    """``self.<qualified name>``: the module's own state, told apart from the call's inputs."""
    owner: nn.Module
    table: str
    """``_parameters`` or ``_buffers``: the owner's dict that holds it under ``attribute``."""
    attribute: str
    tensor: torch.Tensor
    key: LayoutKey

    @property
    def what(self) -> str:
        return "parameter" if self.table == "_parameters" else "buffer"

    def current(self) -> torch.Tensor | None:
        return getattr(self.owner, self.table).get(self.attribute)


def _state_of(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, str, torch.Tensor]]:
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in ("_parameters", "_buffers"):
            for attribute, tensor in getattr(owner, table).items():
                if tensor is not None:
                    name = f"self.{prefix}.{attribute}" if prefix else f"self.{attribute}"
                    yield name, owner, table, attribute, tensor


class ModuleState:
    """The parameters and buffers of one module as a graph captured them."""

    def __init__(self, module: nn.Module) -> None:
        watch_registrations()
        self.module = module
        self.tensors = tuple(
            StateTensor(name, owner, table, attribute, tensor, layout_key(tensor))
            for name, owner, table, attribute, tensor in _state_of(module)
        )
        watch(self, (spec.tensor for spec in self.tensors))  # their moves counted from here on
        self.checked_at = [REGISTRATIONS[0]]
        """The registration count at the last clean check (a one-element list, read in place)."""
        self.swaps_at = [DATA_SWAPS[0]]
        """The count of moves of captured tensors at the last clean check (the same way)."""

    def changed_since_checked(self) -> bool:
        """Whether a registration or a move of a captured tensor was counted since the last clean check."""
        return self.checked_at[0] != REGISTRATIONS[0] or self.swaps_at[0] != DATA_SWAPS[0]

    def guard_terms(self) -> list[tuple[torch.Tensor, int]]:
        """``(tensor, captured address)`` of every parameter or buffer whose moves are not counted (its
        class defines its own ``set_`` or ``__setattr__``), for the replay guard (the counts cover the
        rest); a tensor held under several names (a rotary cache every layer shares) once."""
        terms = {id(spec.tensor): (spec.tensor, spec.key[0])
                 for spec in self.tensors if not counted(spec.tensor)}
        return list(terms.values())

    def moved(self) -> bool:
        """Whether any captured parameter or buffer lives elsewhere now (``.data =``, ``set_``)."""
        return any(spec.tensor.data_ptr() != spec.key[0] for spec in self.tensors)

    def find_changes(self) -> list[Finding]:
        """Every parameter and buffer not as captured, each re-read from its owner's dict; when the
        registration count moved, the module tree is walked again by name (a replaced submodule
        holds other tensors). When nothing is wrong, the counts are noted as checked."""
        count, swaps = REGISTRATIONS[0], DATA_SWAPS[0]
        walked = None
        if count != self.checked_at[0]:
            walked = {name: tensor for name, _, _, _, tensor in _state_of(self.module)}
        findings = []
        for spec in self.tensors:
            value = walked.get(spec.name) if walked is not None else spec.current()
            if value is spec.tensor and value.data_ptr() == spec.key[0]:
                continue  # the captured object, still over its captured memory
            finding = compare(spec.name, spec.tensor, spec.key, value, deep=True, what=spec.what)
            if finding is not None:
                findings.append(finding)
        if not findings:
            self.checked_at[0], self.swaps_at[0] = count, swaps
        return findings
