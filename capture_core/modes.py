"""CUDA-graph modes: which kind of graph serves which kind of batch.

A mode is either a *runtime* mode (NONE, PIECEWISE, FULL: what actually runs for one batch) or a
*configuration* mode that pairs a decode mode with a mixed-batch mode (FULL_DECODE_ONLY,
FULL_AND_PIECEWISE). Callers ask the mode for its halves instead of unpacking tuples.
"""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    """The graph mode of a configuration, or of one batch at runtime.

    The value is ``(decode_mode, mixed_mode)`` expressed as runtime-mode integers, so that the
    separate-routine modes carry their own halves.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """True when uniform-decode batches and mixed batches use different modes."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        """The runtime mode for uniform-decode batches."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The runtime mode for mixed prefill/decode batches."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """True when either half of this mode is ``mode`` (a runtime mode)."""
        assert not mode.separate_routine(), "has_mode takes a runtime mode"
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def requires_piecewise_compilation(self) -> bool:
        return self.has_piecewise_cudagraphs()

    def is_runtime_mode(self) -> bool:
        """Runtime modes are the ones a single batch can run in."""
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

    def valid_runtime_modes(self) -> frozenset[CUDAGraphMode]:
        """Every runtime mode a batch may be dispatched to under this configuration.

        NONE is always valid: batches above the largest capture size run eagerly.
        """
        return frozenset({CUDAGraphMode.NONE, self.decode_mode(), self.mixed_mode()})

    @property
    def label(self) -> str:
        """Lower-case name used in records, metrics labels and pages."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> CUDAGraphMode:
        """Parse a mode name case-insensitively, with a clear error listing the choices."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            choices = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown CUDA graph mode {text!r}; choose one of {choices}") from None
