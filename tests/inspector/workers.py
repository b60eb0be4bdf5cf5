"""Code the recorder tests run in other processes (spawned workers and killed children), and the
events and queries they share.

It lives in its own module so that ``multiprocessing``'s spawn start method can import it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from capture_core.sizes import EagerReason

FULL = CUDAGraphMode.FULL
PIECEWISE = CUDAGraphMode.PIECEWISE
SIZES = (1, 2, 4, 8, 16)


def capture(
    descriptor: BatchDescriptor, mode: CUDAGraphMode = FULL, address: int = 0x7F00_0000
) -> CaptureEvent:
    return CaptureEvent(
        descriptor=descriptor,
        mode=mode,
        backend="eager",
        wrapper="model.forward",
        input_names=("input_ids", "positions"),
        input_addresses=(address, address + 4096),
        capture_seconds=0.01,
        pool_bytes=descriptor.num_tokens * 1024,
        warmup_iters=2,
    )


def drift(
    descriptor: BatchDescriptor, actual: int, expected: int = 0x7F00_0000, name: str = "input_ids"
) -> ViolationEvent:
    return ViolationEvent(
        kind=ViolationKind.ADDRESS_DRIFT,
        descriptor=descriptor,
        mode=FULL,
        wrapper="model.forward",
        message=f"{name} moved from {expected:#x} to {actual:#x}",
        input_name=name,
        expected_address=expected,
        actual_address=actual,
    )


def record_traffic(url: str, rank: int, replays_per_size: int, violations: int) -> dict[str, int]:
    """One rank's run: a capture per size, replays, eager batches and distinct violations."""
    from inspector.recorder import Recorder

    with Recorder(url, rank=rank, world_size=4, flush_interval=0.05, label=f"rank{rank}") as recorder:
        descriptors = [BatchDescriptor(size, size, True) for size in SIZES]
        for descriptor in descriptors:
            recorder.on_capture(capture(descriptor))
        for i in range(replays_per_size):
            for descriptor in descriptors:
                recorder.on_replay(
                    FULL,
                    BatchDescriptor(descriptor.num_tokens, descriptor.num_reqs, True),
                    max(1, descriptor.num_tokens - i % 2),
                )
            recorder.on_eager(EagerReason.ABOVE_MAX_CAPTURE_SIZE, 100, FULL)
        for v in range(violations):
            recorder.on_violation(drift(descriptors[0], actual=0x1000 * (rank * 1000 + v + 1)))
    return {"dropped": recorder.dropped, "run_id": recorder.run_id or -1}


def record_until_killed(url: str, ledger_path: str) -> None:
    """Record forever; after every committed flush, append what is known to be committed.

    The parent reads the ledger, kills this process with SIGKILL, and checks the database holds at
    least everything the last ledger line claims.
    """
    from inspector.recorder import Recorder

    recorder = Recorder(url, flush_interval=0.05, label="killed").start()
    descriptor = BatchDescriptor(8, 8, True)
    recorder.on_capture(capture(descriptor))
    replays = 0
    violations = 0
    with open(ledger_path, "a") as ledger:
        while True:
            for _ in range(500):
                recorder.on_replay(FULL, BatchDescriptor(8, 8, True), 7)
            replays += 500
            violations += 1
            recorder.on_violation(drift(descriptor, actual=0x2000 + violations * 0x100))
            if recorder.flush(timeout=10):
                ledger.write(json.dumps({"replays": replays, "violations": violations}) + "\n")
                ledger.flush()
                os.fsync(ledger.fileno())
            time.sleep(0.005)


if __name__ == "__main__":
    record_until_killed(sys.argv[1], sys.argv[2])


def fetch_rows(url: str, statement: Any) -> list:
    """Run one SELECT against the database at ``url`` on a fresh engine; every row."""
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(statement).all())
    finally:
        engine.dispose()


REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python that imports this checkout and this module."""
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(REPO), str(here), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Another process's exclusive lock on the SQLite file at ``path``, held for the block."""
    locker = sqlite3.connect(path, timeout=0, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        locker.execute("ROLLBACK")
        locker.close()
