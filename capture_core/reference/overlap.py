"""The reference decoder with a communication step after every layer: the workload DBO exists for.

In expert- or data-parallel serving each layer ends in an exchange (an all-to-all dispatch and
combine); micro-batching hides it under the other micro-batch's compute. This module stands in for
that exchange on one device: after every layer, the hidden states travel through a receive buffer
on the comm stream (the next layer reads the received copy, so a missing GPU wait would show as
wrong logits), optionally with two kinds of extra traffic:

* ``payload_bytes``: a device-to-device copy of that size, bandwidth-bound like a large transfer;
* ``wait_us``: a one-block kernel that spins for that long, latency-bound like a collective that
  waits on its peers (it holds one SM and no memory bandwidth, as a waiting NCCL kernel does).

``overlap=False`` keeps the ubatches' turns exactly as they are but issues every exchange in line
on the compute stream: the same split and the same work with nothing overlapped, the baseline that
says how much of the comm the second stream hides. Outside micro-batching the ``dbo_*`` calls are
no-ops and the exchanges run in line.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from capture_core.reference.decoder import ReferenceDecoder
from capture_core.ubatch.context import (
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)

SPIN_KERNEL_NAME = "spin_kernel"
"""The name the profiler gives the ``wait_us`` kernel (``torch.cuda._sleep``)."""


@functools.cache
def spin_cycles_per_us(device_index: int) -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` on one device, measured once."""
    with torch.cuda.device(device_index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(cycles)  # first launch loads the kernel; not timed
        rates = []
        for _ in range(3):
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / (start.elapsed_time(end) * 1e3))
        return sorted(rates)[1]


class CommOverlapDecoder(nn.Module):
    """``ReferenceDecoder`` plus an exchange per layer; same signature, same logits.

    ``payload_bytes`` > 0 adds a device-to-device copy of that many bytes to every exchange;
    ``wait_us`` > 0 adds a spin of that many microseconds (CUDA only). ``overlap=False`` runs the
    exchanges on the compute stream, in the same ubatch order (the no-overlap baseline).
    """

    def __init__(
        self,
        model: ReferenceDecoder,
        payload_bytes: int = 0,
        *,
        wait_us: float = 0.0,
        overlap: bool = True,
    ) -> None:
        super().__init__()
        if payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
        if wait_us < 0:
            raise ValueError(f"wait_us must be >= 0, got {wait_us}")
        device = torch.device(model.config.device)
        if wait_us > 0 and device.type != "cuda":
            raise ValueError(f"wait_us spins a CUDA kernel; the model is on {device}, so pass wait_us=0")
        self.model = model
        self.payload_bytes = payload_bytes
        self.wait_us = wait_us
        self.overlap = overlap
        self.wait_cycles = 0
        if wait_us > 0:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.wait_cycles = max(1, round(wait_us * spin_cycles_per_us(index)))
        self.payload_src = torch.ones(payload_bytes, dtype=torch.uint8, device=device)
        self.payload_dst = torch.empty(payload_bytes, dtype=torch.uint8, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        model = self.model
        hidden = model.embed(input_ids)
        for layer in model.layers:
            hidden = layer(hidden, positions, slot_ids, kv_cache, None)
            hidden = self.exchange(hidden)
        return model.lm_head(model.norm(hidden))

    def exchange(self, hidden: torch.Tensor) -> torch.Tensor:
        """Send ``hidden`` through a receive buffer; compute resumes on the received copy."""
        # Allocated on the compute stream, so its memory is never recycled while comm writes it.
        received = torch.empty_like(hidden)
        if self.overlap:
            dbo_yield_and_switch_from_compute_to_comm()
            self._send(hidden, received)
            dbo_yield_and_switch_from_comm_to_compute()
        else:
            # The same turns as above, with the exchange queued on the compute stream.
            dbo_yield()
            self._send(hidden, received)
            dbo_yield()
        return received

    def _send(self, hidden: torch.Tensor, received: torch.Tensor) -> None:
        received.copy_(hidden)
        if self.payload_bytes:
            self.payload_dst.copy_(self.payload_src)
        if self.wait_cycles:
            torch.cuda._sleep(self.wait_cycles)
