"""transformers' graph key, as its continuous batching makes it, mapped onto the inspector's.

transformers keeps one CUDA graph per key of the inputs-and-outputs object that holds the step's
static tensors (``ContinuousBatchingIOs._get_graph_key``, padded sizes only):

- the decode fast path (every request decodes one token, flash attention's block table):
  ``(num_q_tokens,)``, the request count padded up to a power of two;
- the varlen path (prefill chunks, mixed batches, every batch of an attention that needs a mask):
  ``(num_q_tokens, max_kv_read, *max_seqlen_k)``: the query tokens padded up to a multiple of
  ``q_padding_interval_size``, the cache tokens read padded up to a multiple of
  ``kv_padding_interval_size`` (both capped at the cache's size), and each attention type's longest
  key length padded up to a power of two, at least 1024 (5.24 calls it ``max_length_k``).

Async batching keeps two such objects (two IO pairs), each with its own graphs; a process may run
several managers (one ``generate_batch`` after another), each with its own runner, pool and graphs.
``CBKey`` is all of that; its ``descriptor`` is the inspector's key: the padded query tokens are the
captured size, the padded request count the graph's requests, the decode path a uniform batch, and
the text names transformers' tuple.
"""

from __future__ import annotations

from dataclasses import dataclass

from inspector.watch.identity import WatchedDescriptor

DECODE = "decode"
VARLEN = "varlen"


@dataclass(frozen=True, slots=True)
class CBKey:
    """One graph of transformers' continuous batching: transformers' key and where the graph lives."""

    key: tuple[int, ...]
    """transformers' own: ``(num_q_tokens,)`` or ``(num_q_tokens, max_kv_read, *max_seqlen_k)``."""
    decode: bool
    """The decode fast path's graph (else the varlen path's)."""
    num_sequences: int
    """The padded request count the graph was captured for (its ``cu_seq_lens`` hold that many)."""
    pair: int | None = None
    """Async batching's IO pair (0 or 1), which holds the graph; None without async batching."""
    runner: int = 1
    """Which of the process's continuous-batching runners (1 for the first) captured it."""

    def __post_init__(self) -> None:
        if not self.key or any(not isinstance(size, int) or size < 0 for size in self.key):
            raise ValueError(f"a graph key is a tuple of sizes, got {self.key!r}")
        if self.key[0] < 1:
            raise ValueError(f"a graph key's query tokens must be positive, got {self.key!r}")
        if self.decode != (len(self.key) == 1):
            raise ValueError(f"the decode path's key has one size, the varlen path's more: got {self.key!r}")

    @property
    def path(self) -> str:
        return DECODE if self.decode else VARLEN

    @property
    def num_q_tokens(self) -> int:
        return self.key[0]

    @property
    def text(self) -> str:
        """``varlen q=256 kv=16384 k=16384``, ``decode q=8``; then ``io 1`` for an async pair's
        graph and ``runner 2`` for a later runner's."""
        if self.decode:
            text = f"{DECODE} q={self.num_q_tokens}"
        else:
            kv, *seqlens_k = self.key[1:]
            text = f"{VARLEN} q={self.num_q_tokens} kv={kv} k={'/'.join(map(str, seqlens_k))}"
        if self.pair is not None:
            text += f" io {self.pair}"
        if self.runner != 1:
            text += f" runner {self.runner}"
        return text

    @property
    def engine_text(self) -> str:
        """The key as transformers writes it in its log (``Creating graph for key = (256, 8192,
        1024)``), after ``(IO 1)`` for an async pair's graph, as transformers prefixes it."""
        prefix = "" if self.pair is None else f"(IO {self.pair}) "
        return f"{prefix}{self.key!r}"

    def descriptor(self) -> WatchedDescriptor:
        return WatchedDescriptor(
            num_tokens=self.num_q_tokens,
            num_reqs=max(1, self.num_sequences),
            uniform=self.decode,
            identity=self.text,
        )
