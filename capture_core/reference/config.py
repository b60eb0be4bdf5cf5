"""The reference decoder's shape: sizes from a tiny CPU model to a ~1.3B-parameter one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, the KV cache's size and where it lives.

    ``max_num_seqs`` request slots plus one spare padding slot (index ``max_num_seqs``) make up the
    KV cache; ``max_seq_len`` is the longest context a slot holds.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_seq_len: int
    max_num_seqs: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_seq_len",
            "max_num_seqs",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def padding_slot(self) -> int:
        """The spare KV slot that padded tokens write into (never a real request's)."""
        return self.max_num_seqs

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A few hundred thousand parameters: hundreds of 256-token steps a minute on 2 CPU cores."""
        base = cls(
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            max_seq_len=256,
            max_num_seqs=256,
        )
        return replace(base, **overrides)

    @classmethod
    def small(cls, **overrides: Any) -> ModelConfig:
        """About 60M parameters: the GPU benchmarks' model."""
        base = cls(
            vocab_size=32000,
            hidden_size=512,
            num_layers=10,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1408,
            max_seq_len=2048,
            max_num_seqs=256,
        )
        return replace(base, **overrides)

    @classmethod
    def large(cls, **overrides: Any) -> ModelConfig:
        """About 1.3B parameters (a TinyLlama-like shape): a realistic graph and pool on an H200."""
        base = cls(
            vocab_size=32000,
            hidden_size=2048,
            num_layers=24,
            num_heads=16,
            num_kv_heads=8,
            intermediate_size=5632,
            max_seq_len=1024,
            max_num_seqs=256,
        )
        return replace(base, **overrides)


