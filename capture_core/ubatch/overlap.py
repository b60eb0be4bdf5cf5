"""The reference decoder with a communication step after every layer: the workload DBO exists for.

In expert- or data-parallel serving each layer ends in an exchange (an all-to-all dispatch and
combine); micro-batching hides it under the other micro-batch's compute. This module stands in for
that exchange on one device: after every layer, the hidden states travel through a receive buffer
on the comm stream (the next layer reads the received copy, so a missing GPU wait would show as
wrong logits), optionally with an extra bandwidth-bound payload copy sized like real traffic.
Outside micro-batching the ``dbo_*`` calls are no-ops and the same copies run in line.
"""

from __future__ import annotations

import torch
from torch import nn

from capture_core.model import ReferenceDecoder
from capture_core.ubatch.context import (
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)


class CommOverlapDecoder(nn.Module):
    """``ReferenceDecoder`` plus an exchange per layer; same signature, same logits.

    ``payload_bytes`` > 0 adds a device-to-device copy of that many bytes to every exchange, the
    stand-in for collective traffic whose time micro-batching should hide.
    """

    def __init__(self, model: ReferenceDecoder, payload_bytes: int = 0) -> None:
        super().__init__()
        if payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
        self.model = model
        self.payload_bytes = payload_bytes
        device = model.config.device
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
        """Send ``hidden`` through a receive buffer on the comm stream; compute resumes on the copy."""
        # Allocated on the compute stream, so its memory is never recycled while comm writes it.
        received = torch.empty_like(hidden)
        dbo_yield_and_switch_from_compute_to_comm()
        received.copy_(hidden)
        if self.payload_bytes:
            self.payload_dst.copy_(self.payload_src)
        dbo_yield_and_switch_from_comm_to_compute()
        return received
