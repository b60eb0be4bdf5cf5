"""What a run row says about the process that records it: host, pid, command line, rank, job, device.

The rank comes from torch.distributed when it is initialised, else from the launcher's environment;
the job from the launcher's environment (torchrun, SLURM) unless given; the device from torch when
CUDA is up. torch is only looked at when the engine imported it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from inspector.storage.text import storable_json
from inspector.storage.writer import RunInfo


def describe_process(
    label: str,
    config: dict[str, Any] | None,
    rank: int | None = None,
    world_size: int | None = None,
    device: str | None = None,
    job: str | None = None,
) -> RunInfo:
    """This process, as of now, for its run row (arguments given win over what is detected).

    The text is taken as it comes (a command line may hold surrogates for file names that are not
    UTF-8); the writer makes it storable. ``config`` becomes JSON here, from storable parts."""
    rank, world_size = detect_rank(rank, world_size)
    return RunInfo(
        label=label,
        host=socket.gethostname(),
        pid=os.getpid(),
        process=" ".join(sys.argv) or sys.executable,
        rank=rank,
        world_size=world_size,
        device=device or detect_device(),
        config=storable_json(config or {}),
        started_at=time.time(),
        job=detect_job(job),
    )


JOB_ENV = "GRAPH_INSPECTOR_JOB"
"""Names the job of every recorder in the process (``graph-inspector watch --job`` sets it)."""
TORCHRUN_DEFAULT_RUN_ID = "none"
"""What torchrun puts in $TORCHELASTIC_RUN_ID without --rdzv-id (or --standalone): shared by every
such job, so it names none of them."""


def detect_job(job: str | None) -> str | None:
    """The job id: ``job`` when given ("" for none), else $GRAPH_INSPECTOR_JOB, torchrun's
    $TORCHELASTIC_RUN_ID (its rendezvous id), SLURM's $SLURM_JOB_ID (with the step, $SLURM_STEP_ID,
    since each ``srun`` of a job is a job of ranks of its own), else None."""
    if job is not None:
        return job or None
    named = os.environ.get(JOB_ENV, "").strip()
    if named:
        return named
    torchrun = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if torchrun and torchrun != TORCHRUN_DEFAULT_RUN_ID:
        return f"torchrun:{torchrun}"
    slurm = os.environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        step = os.environ.get("SLURM_STEP_ID", "").strip()
        return f"slurm:{slurm}.{step}" if step else f"slurm:{slurm}"
    return None


def detect_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The rank from torch.distributed when it is initialised, else $RANK/$WORLD_SIZE, else 0/1."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return (
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if world_size is None else world_size,
        )
    if rank is None:
        rank = _int_env("RANK", 0)
    if world_size is None:
        world_size = _int_env("WORLD_SIZE", 1)
    return rank, world_size


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def detect_device() -> str:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        index = torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return "cpu"
