"""Hugging Face transformers' continuous batching, recorded: ``generate_batch`` (and the manager it
wraps) with CUDA graphs (``ContinuousBatchingConfig(use_cuda_graph=True)``, paged attention).

    from inspector.engines.transformers_cb import attach
    attach("sqlite:///cb.db")          # then generate_batch(...) as before: the same tokens
    ...                                # detach() at the end, or let the process exit

What is recorded (one run per process, transformers' resolved configuration on it):

- every graph transformers captures, keyed by transformers' own padded shape
  (``varlen q=256 kv=16384 k=16384`` for ``(num_q_tokens, max_kv_read, *max_seqlen_k)``,
  ``decode q=8`` for the decode fast path's ``(num_q_tokens,)``; see ``keys.py``), with the time its
  capture took (transformers' eager forward in the pool, then the capture), the bytes its pool grew
  by, and the addresses of the tensors it reads;
- the graphs captured in ``warmup`` as start-up graphs, and every graph transformers captures
  lazily after it (the first step that meets a new key) as captured after start-up, with its cost;
  that step is an eager batch for that reason (``unexpected_capture``);
- every step: its real tokens (the query tokens before padding) against the graph's padded size,
  so padding waste and hit ratio per size, and the batch-size histogram the advice reads; a step on
  a path without graphs (graphs off, or a CPU) is an eager batch (``mode_none``);
- not the warm-up's made-up batches.

``graph-inspector serve`` shows it like any run: graphs grouped by path, late ones marked, padding
per size. Supported: transformers 5.17, 5.24 and 5.25 (``version.py``); other releases are refused with
one line (``attach`` returns None), and ``graph-inspector watch`` is the fallback. Importing this
package imports neither transformers nor the database side (both are loaded when first needed).
"""

from __future__ import annotations

from inspector.engines.transformers_cb.attachment import Attachment, attach, current, detach
from inspector.engines.transformers_cb.version import SUPPORTED

__all__ = ["SUPPORTED", "Attachment", "attach", "current", "detach"]
