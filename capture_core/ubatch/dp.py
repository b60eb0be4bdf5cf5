"""Data-parallel agreement: every rank must split, pad and replay the same way, or collectives hang.

Data-parallel ranks run their own batches but meet in collectives inside the model (expert
all-to-all, for instance). If one rank micro-batches and another does not, or they replay graphs of
different sizes, those collectives pair up wrongly and the step hangs. So once per step, before
running, the ranks exchange what each wants in one all-reduce and apply the same rules to the same
numbers: micro-batch only if every rank wants to and no rank's last ubatch would be empty; run the
lowest graph mode any rank can; pad everyone to the largest padded batch whenever graphs or
micro-batches are in play.

Every rank learns what every rank asked for (``DPCoordination.requests``), and an ``observer``
(the inspector's Recorder) hears each agreement: its step sequence then counts one step per
agreement, which is how the inspector compares the graphs the ranks replay, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from capture_core.modes import CUDAGraphMode
from capture_core.ubatch.slices import UBatchConfig, check_ubatch_thresholds, is_last_ubatch_empty

# Rows of the exchanged table, one column per rank.
_REAL, _PADDED, _WANTS_UBATCH, _MODE = range(4)


class DPCoordinationError(RuntimeError):
    """The per-step all-reduce failed or timed out: some rank did not take part."""


class DPObserver(Protocol):
    """Hears every agreement, on every rank (the inspector's Recorder is one). Must not raise."""

    def on_dp_coordination(self, coordination: DPCoordination) -> None: ...


@dataclass(frozen=True)
class DPRequest:
    """What one rank asked for in one step, before the agreement."""

    num_tokens_unpadded: int
    num_tokens_padded: int
    wants_ubatch: bool
    mode: CUDAGraphMode


@dataclass(frozen=True)
class DPCoordination:
    """What every rank agreed on for this step (identical on every rank)."""

    should_ubatch: bool
    mode: CUDAGraphMode
    """The lowest runtime mode any rank asked for."""
    num_tokens_across_dp: tuple[int, ...]
    """Token count each rank runs, padding included: all equal to the largest when padding applies."""
    rank: int
    requests: tuple[DPRequest, ...] = ()
    """What each rank asked for, by rank (the same on every rank)."""

    @property
    def num_tokens_after_padding(self) -> int:
        """The token count this rank runs."""
        return self.num_tokens_across_dp[self.rank]

    @property
    def world_size(self) -> int:
        return len(self.num_tokens_across_dp)


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    *,
    num_tokens_padded: int | None = None,
    ubatch_config: UBatchConfig | None = None,
    uniform_decode: bool = False,
    mode: CUDAGraphMode = CUDAGraphMode.NONE,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    observer: DPObserver | None = None,
) -> DPCoordination:
    """Agree with every data-parallel rank on micro-batching, graph mode and padding for one step.

    ``num_tokens_padded`` is this rank's count after its own padding (to a capture size); it
    defaults to the unpadded count. ``ubatch_config`` says whether this rank wants to micro-batch
    (its thresholds decide); ``mode`` is the runtime mode this rank's dispatcher chose. Without an
    initialised process group (or with one rank) the same rules apply to this rank alone.

    The exchange is one all-reduce of a small integer table on ``device``: by default the CPU for
    gloo and the current CUDA device for NCCL. Every rank must call this once per step.
    ``observer`` hears the agreement (pass the rank's Recorder, so the inspector can tell which
    batches belong to which step when it compares the ranks).
    """
    padded = num_tokens_unpadded if num_tokens_padded is None else num_tokens_padded
    if num_tokens_unpadded < 0:
        raise ValueError(f"num_tokens_unpadded must be >= 0, got {num_tokens_unpadded}")
    if padded < num_tokens_unpadded:
        raise ValueError(f"num_tokens_padded ({padded}) is below num_tokens_unpadded ({num_tokens_unpadded})")
    if not mode.is_runtime_mode():
        raise ValueError(f"coordinate a runtime mode (NONE, PIECEWISE, FULL), not {mode.name}")
    config = ubatch_config or UBatchConfig()
    wants_ubatch = check_ubatch_thresholds(config, num_tokens_unpadded, uniform_decode)

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    table = torch.zeros(4, world, dtype=torch.int64)
    table[_REAL, rank] = num_tokens_unpadded
    table[_PADDED, rank] = padded
    table[_WANTS_UBATCH, rank] = int(wants_ubatch)
    table[_MODE, rank] = mode.value
    if world > 1:
        table = _all_reduce(table, group, device, rank, world)
    agreed = _decide(table, config.num_ubatches, rank)
    if observer is not None:
        observer.on_dp_coordination(agreed)
    return agreed


def _all_reduce(
    table: torch.Tensor,
    group: dist.ProcessGroup | None,
    device: torch.device | str | None,
    rank: int,
    world: int,
) -> torch.Tensor:
    if device is None:
        device = _default_device(group)
    on_device = table.to(device)
    try:
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as exc:
        raise DPCoordinationError(
            f"rank {rank} of {world}: the data-parallel all-reduce that agrees on micro-batching and "
            f"padding failed ({exc}); every rank must call coordinate_batch_across_dp once per step"
        ) from exc
    return on_device.cpu()


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _decide(table: torch.Tensor, num_ubatches: int, rank: int) -> DPCoordination:
    rows = table.tolist()
    mode = CUDAGraphMode(min(rows[_MODE]))
    padded = max(rows[_PADDED])
    # Every ubatch needs a token of its own (a stride of 0 would leave the first ubatch empty) and
    # the smallest rank's real tokens must reach past the last split point.
    should_ubatch = (
        all(rows[_WANTS_UBATCH])
        and padded // num_ubatches > 0
        and not is_last_ubatch_empty(min(rows[_REAL]), padded, num_ubatches)
    )
    if mode is not CUDAGraphMode.NONE or should_ubatch:
        across = (padded,) * len(rows[_PADDED])
    else:
        across = tuple(rows[_PADDED])
    requests = tuple(
        DPRequest(real, own, bool(wants), CUDAGraphMode(wanted))
        for real, own, wants, wanted in zip(rows[_REAL], rows[_PADDED], rows[_WANTS_UBATCH], rows[_MODE],
                                            strict=True)
    )
    return DPCoordination(should_ubatch, mode, across, rank, requests)
