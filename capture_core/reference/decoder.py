"""The reference workload: a small Llama-style decoder with random weights.

It exists so that the graph cache, the demo, the tests and the benchmarks have a real decoder to
capture: RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP over vLLM-style
*flattened* tokens (one row per token of every request in the batch, with its position and the KV
cache slot of its request). Weights are random but deterministic for a seed, so eager and replayed
runs can be compared exactly.

Two attention paths compute the same thing:

* without metadata, every token gathers its slot's whole KV row and masks keys after its own
  position. Every shape depends only on the token count, there is no ``.item()`` and no host sync,
  so the whole step is capturable as one FULL CUDA graph;
* with :class:`AttentionMetadata` (query start offsets, sequence lengths, slot per request), each
  request attends over just its own context. Shapes vary per batch, so this path runs eagerly -
  between the graph segments of a piecewise graph (see ``capture_core.piecewise``).

Every attention call goes through an :class:`Attention` module, marked as a graph break point; its
output buffer is allocated by the code before it (inside the preceding graph segment) and filled
in place, so the segment after it always reads the same address.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from capture_core.forward_context import ForwardContext
from capture_core.piecewise import attention_boundary
from capture_core.reference.batch import AttentionMetadata, DecodeTensors
from capture_core.reference.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Llama does: bf16 squares lose too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embeddings from a cos/sin table indexed by each token's position."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0, **factory: Any) -> None:
        super().__init__()
        device = factory.get("device")
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
        self.register_buffer("cos", angles.cos().to(factory["dtype"]), persistent=False)
        self.register_buffer("sin", angles.sin().to(factory["dtype"]), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x``: [tokens, heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@attention_boundary
class Attention(nn.Module):
    """Writes this step's K/V into the cache, then attends; fills ``out`` in place.

    Marked as a graph break point: a piecewise graph runs it eagerly between its segments. It
    holds no parameters, only its layer index (which KV cache plane is its own).
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> None:
        """``q``: [T, heads, d]; ``k``, ``v``: [T, kv_heads, d]; ``out``: [T, heads * d]."""
        k_cache = kv_cache[self.layer_idx, 0]  # [slots, kv_heads, S, d]
        v_cache = kv_cache[self.layer_idx, 1]
        k_cache[slot_ids, :, positions] = k
        v_cache[slot_ids, :, positions] = v
        if attn_metadata is None:
            self._gathered(q, positions, slot_ids, k_cache, v_cache, out)
        else:
            self._per_request(q, k_cache, v_cache, out, attn_metadata)

    def _gathered(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Each token over its slot's whole row, masked after its position: fixed shapes."""
        num_tokens, max_seq_len = q.shape[0], k_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        keys = k_cache[slot_ids]  # [T, kv_heads, S, d]: batched matmuls read it without a copy
        values = v_cache[slot_ids]
        q = q.view(num_tokens, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [T, kv_heads, g, S]
        key_pos = torch.arange(max_seq_len, device=q.device)
        hidden = key_pos.unsqueeze(0) > positions.unsqueeze(1)  # [T, S]
        scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        result = torch.matmul(probs, values)  # [T, kv_heads, g, d]
        out.copy_(result.reshape(num_tokens, self.num_heads * self.head_dim))

    def _per_request(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Each request over its own context only: shapes vary per batch, so eager only.

        Decode requests (one query each) are attended together, over keys up to the longest of
        their contexts; prefill chunks one request at a time. (vLLM's attention backends split a
        mixed batch the same way.)
        """
        decodes = meta.decode_tensors(q.device)
        if decodes is not None:
            self._decodes(q, k_cache, v_cache, out, decodes)
        starts = meta.query_start_loc
        for r in meta.prefill_requests:
            start, stop = starts[r], starts[r + 1]
            self._prefill(q, k_cache, v_cache, out, start, stop, meta.seq_lens[r], meta.slot_ids[r])
        # Padding tokens belong to no request: give them zeros rather than stale memory.
        out[meta.num_actual_tokens :].zero_()

    def _decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        decodes: DecodeTensors,
    ) -> None:
        num = decodes.rows.shape[0]
        group = self.num_heads // self.num_kv_heads
        keys = k_cache[decodes.slots, :, : decodes.max_seq_len]  # [D, kv_heads, S, d]
        values = v_cache[decodes.slots, :, : decodes.max_seq_len]
        query = q[decodes.rows].view(num, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * self.scale  # [D, kv_heads, g, S]
        key_pos = torch.arange(decodes.max_seq_len, device=q.device)
        beyond = key_pos.unsqueeze(0) >= decodes.seq_lens.unsqueeze(1)  # [D, S]
        scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        result = torch.matmul(probs, values)  # [D, kv_heads, g, d]
        out[decodes.rows] = result.reshape(num, self.num_heads * self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        start: int,
        stop: int,
        seq_len: int,
        slot: int,
    ) -> None:
        query_len = stop - start
        group = self.num_heads // self.num_kv_heads
        keys = k_cache[slot, :, :seq_len]  # [kv_heads, S, d]
        values = v_cache[slot, :, :seq_len]
        # [kv_heads, g * query_len, d]: each KV head's query group as one matrix.
        query = q[start:stop].view(query_len, self.num_kv_heads, group, self.head_dim)
        query = query.permute(1, 2, 0, 3).reshape(self.num_kv_heads, group * query_len, self.head_dim)
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * self.scale
        # Query i sits at position seq_len - query_len + i and sees keys up to it.
        visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - query_len)
        scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        result = torch.matmul(probs, values).view(self.num_kv_heads, group, query_len, self.head_dim)
        out[start:stop].copy_(result.permute(2, 0, 1, 3).reshape(query_len, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        factory = {"dtype": config.dtype, "device": config.device}
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, head_dim
        self.intermediate_size = config.intermediate_size
        self.input_norm = RMSNorm(hidden, **factory)
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * head_dim
        self.qkv_proj = nn.Linear(hidden, qkv_size, bias=False, **factory)
        self.rotary = RotaryEmbedding(head_dim, config.max_seq_len, **factory)
        self.attn = Attention(layer_idx, config.num_heads, config.num_kv_heads, head_dim)
        self.o_proj = nn.Linear(config.num_heads * head_dim, hidden, bias=False, **factory)
        self.post_attn_norm = RMSNorm(hidden, **factory)
        self.gate_up_proj = nn.Linear(hidden, 2 * config.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False, **factory)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(self.input_norm(hidden))
        # Slices, not tuple unpacking: torch.fx traces this method (see capture_core.piecewise).
        q = qkv[:, :q_size]
        k = qkv[:, q_size : q_size + kv_size]
        v = qkv[:, q_size + kv_size :]
        q = self.rotary(positions, q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.rotary(positions, k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        # Allocated here, before the break point, so a piecewise graph keeps it at a fixed address.
        out = hidden.new_empty(num_tokens, q_size)
        self.attn(q, k, v, positions, slot_ids, kv_cache, out, attn_metadata)
        hidden = hidden + self.o_proj(out)
        gate_up = self.gate_up_proj(self.post_attn_norm(hidden))
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        return hidden + self.down_proj(nn.functional.silu(gate) * up)


class ReferenceDecoder(nn.Module):
    """A Llama-style decoder over flattened tokens with deterministic random weights.

    ``model(input_ids, positions, slot_ids, kv_cache) -> logits[num_tokens, vocab]``: token ``t``
    writes its K/V at ``(slot_ids[t], positions[t])`` of every layer's cache plane and attends
    causally over its slot's row. Pass ``attn_metadata`` for mixed batches run eagerly or
    piecewise (the same logits, computed per request).
    """

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        factory = {"dtype": config.dtype, "device": config.device}
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self._init_weights(seed)
        self.requires_grad_(False)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Seeded normal weights scaled by fan-in, so activations stay O(1) at any size.

        On the meta device there is nothing to fill: that is how sizes are counted for free.
        """
        if torch.device(self.config.device).type == "meta":
            return
        generator = torch.Generator(device=torch.device(self.config.device)).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 2:
                std = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(param.shape[1])
                param.normal_(0.0, std, generator=generator)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, slot_ids, kv_cache, attn_metadata)
        return self.lm_head(self.norm(hidden))

    def kv_written(
        self, context: ForwardContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ...]:
        """Where a call of this model writes its KV cache: every layer's K and V at each real token's
        (slot, position), as an index of the cache (``kv_cache[index]`` is ``[tokens, layers, 2,
        kv_heads, head_dim]``). The canary's region for the cache (``mutated_inputs={"kv_cache":
        model.kv_written}``); padding rows, after the context's real tokens, are left out (they
        write the spare padding slot)."""
        positions = args[1] if len(args) > 1 else kwargs["positions"]
        slot_ids = args[2] if len(args) > 2 else kwargs["slot_ids"]
        real, every = context.num_real_tokens, slice(None)
        return (every, every, slot_ids[:real], every, positions[:real])

    def new_kv_cache(self) -> torch.Tensor:
        """A zeroed static cache: [layers, 2 (K, V), max_num_seqs + 1 slots, kv_heads, max_seq_len, d].

        The last slot is the padding slot that padded tokens write into.
        """
        c = self.config
        shape = (c.num_layers, 2, c.max_num_seqs + 1, c.num_kv_heads, c.max_seq_len, c.head_dim)
        return torch.zeros(shape, dtype=c.dtype, device=c.device)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

