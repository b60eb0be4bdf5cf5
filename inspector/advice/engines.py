"""The lists each engine's configuration takes, in the unit it means, and the lines to paste.

Engines do not mean one thing by a capture size:

* vLLM's ``cudagraph_capture_sizes`` are token counts, one list for its FULL decode graphs and its
  piecewise graphs alike (``capture_core``'s ``sizes=`` likewise): the advice's own list, over every
  batch.
* SGLang keeps decode apart from prefill: ``--cuda-graph-bs`` (``--cuda-graph-bs-decode`` in newer
  releases) lists decode batch sizes as *requests* (a size of 8 serves 8 requests decoding, however
  many tokens each decodes), never a prefill chunk's tokens; ``--piecewise-cuda-graph-tokens``
  (``--cuda-graph-bs-prefill``) lists the token counts of its piecewise graphs for extend/prefill.
* TensorRT-LLM likewise: ``cuda_graph_config.batch_sizes`` are generation-only batches, in requests
  (``enable_padding`` so a batch replays the next size up); its piecewise graphs for context and
  mixed steps take ``torch_compile_config.capture_num_tokens`` (``prefill_capture_num_tokens`` in
  newer releases), token counts.

So the decode list is advised on the decode steps alone (the batches that replayed a uniform-decode
graph, in requests: tokens over the tokens each request decodes), the prefill list on the other
batches, each with as many sizes as the advice; where the decode steps are not told apart, the
decode lines are left out and the advice says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from inspector.advice.sizes import Histogram, StepCost, best_choices


@dataclass(frozen=True)
class DecodeTraffic:
    """The batches that were decode steps (replayed a uniform-decode graph), and the tokens each
    request decodes in one (1 without speculative decoding)."""

    histogram: Histogram
    query_len: int = 1


@dataclass(frozen=True)
class EngineLists:
    """What each engine's configuration takes for one advice."""

    tokens: tuple[int, ...]
    """Token counts over every batch (vLLM, capture_core): the advised sizes."""
    decode_requests: tuple[int, ...] | None
    """Decode batch sizes in requests (SGLang's decode graphs, TensorRT-LLM's generation graphs)."""
    prefill_tokens: tuple[int, ...] | None
    """Token counts of the batches that were not decode steps (their piecewise prefill graphs)."""
    notes: tuple[str, ...] = ()


def engine_lists(
    sizes: tuple[int, ...], histogram: Histogram, decode: DecodeTraffic | None, graphs: int, cost: StepCost,
    smallest_at_most: int | None = None,
) -> EngineLists:
    """The advised ``sizes`` as every engine takes them: the decode and prefill lists advised apart
    (up to ``graphs`` sizes each, padding weighed by ``cost``, up to the advice's largest size; the
    decode list's smallest size held at or below ``smallest_at_most``, as the advice's is for a lone
    request). Traffic that is all decode steps (or has none) takes the advised sizes as they are."""
    top = sizes[-1]
    if decode is None:
        note = ("the decode steps are not told apart in these runs (rows recorded before they were, or "
                "decode graphs of several query lengths): SGLang's and TensorRT-LLM's decode lists are "
                "left out rather than filled with prefill tokens")
        return EngineLists(sizes, None, None, (note,))
    decode_counts = dict(zip(decode.histogram.sizes, decode.histogram.batches, strict=True))
    rest = {size: n - decode_counts.get(size, 0) for size, n in zip(histogram.sizes, histogram.batches,
                                                                    strict=True)}
    notes = []
    mixed = Histogram.from_counts(rest)
    if not mixed.total:
        decode_list: tuple[int, ...] | None = sizes
    else:
        decode_list = _advised(decode.histogram, top, graphs, cost, smallest_at_most)
    requests = None
    if decode_list is not None:
        q = decode.query_len
        requests = tuple(sorted({max(1, size // q) for size in decode_list}))
        if q > 1:
            notes.append(f"a decode step decodes {q} tokens per request: decode sizes are tokens / {q}")
    else:
        notes.append("no decode step was recorded at or below the largest size: no decode list")
    prefill = sizes if not decode.histogram.total else _advised(mixed, top, graphs, cost)
    return EngineLists(sizes, requests, prefill, tuple(notes))


def _advised(histogram: Histogram, top: int, graphs: int, cost: StepCost,
             smallest_at_most: int | None = None) -> tuple[int, ...] | None:
    """The best sizes for ``histogram``'s batches up to ``top`` (None when it has none)."""
    below = [size for size in histogram.sizes if size <= top]
    if not below:
        return None
    limit = smallest_at_most if smallest_at_most is not None and below[0] <= smallest_at_most else None
    choices = best_choices(histogram, below[-1], max(graphs, 2), cost, smallest_at_most=limit)
    fitting = [choice for choice in choices if choice.graphs <= graphs] or choices[:1]
    return fitting[-1].sizes


ENGINES = {
    "vllm": "vLLM",
    "sglang": "SGLang decode",
    "sglang_prefill": "SGLang prefill",
    "tensorrt_llm": "TensorRT-LLM decode",
    "tensorrt_llm_prefill": "TensorRT-LLM prefill",
    "capture_core": "capture_core",
}


def config_lines(lists: EngineLists) -> dict[str, str | None]:
    """What to paste into each engine's configuration (None: that engine's list does not apply)."""
    tokens = lists.tokens
    decode, prefill = lists.decode_requests, lists.prefill_tokens
    return {
        "vllm": f"--compilation-config '{json.dumps({'cudagraph_capture_sizes': list(tokens)})}'",
        "sglang": None if decode is None else "--cuda-graph-bs " + " ".join(map(str, decode)),
        "sglang_prefill": None if prefill is None else "--piecewise-cuda-graph-tokens " + " ".join(
            map(str, prefill)),
        "tensorrt_llm": None if decode is None else (
            f"cuda_graph_config: {{enable_padding: true, batch_sizes: [{_listed(decode)}]}}"),
        "tensorrt_llm_prefill": None if prefill is None else (
            f"torch_compile_config: {{enable_piecewise_cuda_graph: true, capture_num_tokens: "
            f"[{_listed(prefill)}]}}"),
        "capture_core": f"sizes=[{_listed(tokens)}]",
    }


def _listed(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes))
