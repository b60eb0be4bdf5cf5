"""Recording workloads that run in processes of their own: a rank's run for the many-writer tests
and benchmarks, one that records until it is killed, and the events they record.

Importable by ``multiprocessing``'s spawn start method (a module, not a test file); as a script,
``python3 -m tests.support.recording URL LEDGER`` records until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

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


def record_traffic(url: str, rank: int, replays_per_size: int, violations: int, world_size: int = 4
                   ) -> dict[str, int]:
    """One rank's run: a capture per size, replays, eager batches and distinct violations."""
    from inspector.recording.recorder import Recorder

    recorder = Recorder(url, rank=rank, world_size=world_size, flush_interval=0.05, label=f"rank{rank}")
    with recorder:
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
    from inspector.recording.recorder import Recorder

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


def fill_filesystem(filler: str) -> None:
    """Write ``filler`` until its filesystem is full."""
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError:
            pass


if __name__ == "__main__":
    record_until_killed(sys.argv[1], sys.argv[2])
