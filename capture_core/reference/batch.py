"""One step's flattened inputs: vLLM-style token rows and the attention metadata that describes them.

A mixed prefill/decode batch is flattened into one row per token of every request; the metadata
(query start offsets, sequence lengths, slot per request) tells the eager per-request attention
where each request lies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each request of a flattened mixed batch lies, for the eager per-request attention.

    Request ``r`` owns tokens ``query_start_loc[r]:query_start_loc[r + 1]``, lives in KV slot
    ``slot_ids[r]`` and, after this step, has ``seq_lens[r]`` tokens of context (its new tokens
    included), so its queries sit at positions ``seq_lens[r] - query_len .. seq_lens[r] - 1``.
    Tokens after ``query_start_loc[-1]`` are padding. Host integers, because eager attention loops
    over requests on the host anyway and must not sync with the device to find them.
    """

    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    slot_ids: tuple[int, ...]
    _device_cache: dict[torch.device, DecodeTensors | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        num_reqs = len(self.seq_lens)
        if len(self.query_start_loc) != num_reqs + 1 or len(self.slot_ids) != num_reqs:
            raise ValueError(
                f"AttentionMetadata needs num_reqs + 1 query offsets and num_reqs slots: got "
                f"{len(self.query_start_loc)} offsets, {num_reqs} sequence lengths, "
                f"{len(self.slot_ids)} slots"
            )
        if len(set(self.slot_ids)) != num_reqs:
            raise ValueError(f"each request needs its own KV slot, got slot_ids {list(self.slot_ids)}")
        if self.query_start_loc and self.query_start_loc[0] != 0:
            raise ValueError(f"query_start_loc must start at 0, got {self.query_start_loc[0]}")
        for r in range(num_reqs):
            query_len = self.query_start_loc[r + 1] - self.query_start_loc[r]
            if query_len <= 0:
                raise ValueError(f"request {r} has query length {query_len}; it must be positive")
            if self.seq_lens[r] < query_len:
                raise ValueError(
                    f"request {r} has sequence length {self.seq_lens[r]} shorter than its "
                    f"query length {query_len}"
                )

    @classmethod
    def build(
        cls, query_lens: Sequence[int], context_lens: Sequence[int], slot_ids: Sequence[int]
    ) -> AttentionMetadata:
        """From per-request query lengths, contexts already cached, and slots."""
        if not len(query_lens) == len(context_lens) == len(slot_ids):
            raise ValueError("query_lens, context_lens and slot_ids must have one entry per request")
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + int(query_len))
        seq_lens = tuple(int(c) + int(q) for c, q in zip(context_lens, query_lens, strict=True))
        return cls(tuple(starts), seq_lens, tuple(int(s) for s in slot_ids))

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_actual_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def query_lens(self) -> tuple[int, ...]:
        starts = self.query_start_loc
        return tuple(starts[r + 1] - starts[r] for r in range(self.num_reqs))

    @property
    def is_uniform_decode(self) -> bool:
        """Every request decodes exactly one token (the batches FULL decode graphs serve)."""
        return all(q == 1 for q in self.query_lens)

    @property
    def prefill_requests(self) -> tuple[int, ...]:
        """Requests with more than one query token (prompt chunks), attended one by one."""
        return tuple(r for r, q in enumerate(self.query_lens) if q > 1)

    def decode_tensors(self, device: torch.device) -> DecodeTensors | None:
        """The decode requests' token rows, slots and lengths on ``device`` (None when none).

        Built once per step and device, then shared by every layer's attention call.
        """
        if device not in self._device_cache:
            decodes = [r for r, q in enumerate(self.query_lens) if q == 1]
            self._device_cache[device] = (
                DecodeTensors(
                    rows=_long_tensor([self.query_start_loc[r] for r in decodes], device),
                    slots=_long_tensor([self.slot_ids[r] for r in decodes], device),
                    seq_lens=_long_tensor([self.seq_lens[r] for r in decodes], device),
                    max_seq_len=max(self.seq_lens[r] for r in decodes),
                )
                if decodes
                else None
            )
        return self._device_cache[device]


@dataclass(frozen=True)
class DecodeTensors:
    """The one-token requests of a step, as index tensors for one batched attention call."""

    rows: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int


def _long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


@dataclass(frozen=True)
class FlatBatch:
    """One step's flattened model inputs, with the metadata that describes them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    attn_metadata: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def flatten_requests(
    token_ids: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    slot_ids: Sequence[int],
    *,
    pad_to: int | None = None,
    padding_slot: int | None = None,
    device: str | torch.device = "cpu",
) -> FlatBatch:
    """Flatten several requests' new tokens into one vLLM-style batch.

    Request ``r`` brings ``token_ids[r]`` (its prompt chunk, or one decode token) on top of
    ``context_lens[r]`` tokens already in slot ``slot_ids[r]``. ``pad_to`` pads the batch with
    tokens that write into ``padding_slot`` at position 0 (their outputs are discarded).
    """
    meta = AttentionMetadata.build([len(t) for t in token_ids], context_lens, slot_ids)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for tokens, context, slot in zip(token_ids, context_lens, slot_ids, strict=True):
        ids.extend(int(t) for t in tokens)
        positions.extend(range(context, context + len(tokens)))
        slots.extend([int(slot)] * len(tokens))
    if pad_to is not None:
        if pad_to < len(ids):
            raise ValueError(f"pad_to={pad_to} is smaller than the batch's {len(ids)} tokens")
        if padding_slot is None:
            raise ValueError("padding a batch needs the model's padding_slot")
        extra = pad_to - len(ids)
        ids.extend([0] * extra)
        positions.extend([0] * extra)
        slots.extend([padding_slot] * extra)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return FlatBatch(as_tensor(ids), as_tensor(positions), as_tensor(slots), meta)


