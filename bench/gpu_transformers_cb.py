"""Hugging Face transformers' continuous batching with CUDA graphs, bare against graph-inspector's
integration (``inspector.engines.transformers_cb``), on the bundled Azure conversation trace.

What a transformers user runs: a Llama built from a config with random weights (no hub access),
paged attention (``paged|sdpa``: flash attention is not installed there), and transformers'
continuous batching with ``ContinuousBatchingConfig(use_cuda_graph=True)``. The requests are the
trace's first ``--requests`` conversations, their lengths scaled down for a small model: a prompt of
``ContextTokens / --prompt-scale`` tokens (within 4..``--max-prompt``), an answer of
``GeneratedTokens / --output-scale`` tokens (within 2..``--max-output``), random token ids seeded by
the request's index, greedy, no end-of-sequence token, so every answer has its length.

Arrivals come in waves: the requests that arrive within one ``--wave-s`` seconds of the trace are
queued together and served by transformers' scheduler (continuous batching, chunked prefill) until
all of them are answered; then the next wave. ``generate_batch`` gives every request one
``max_new_tokens`` and starts stepping while the requests are still being queued, so two runs of it
can batch differently and differ in a token; the script drives the manager ``generate_batch``
wraps, its own way (a persistent manager: ``init_continuous_batching``, then per wave
``add_request`` with the request's own length, ``start``, results, ``stop`` keeping it), with every
request of a wave queued before its steps begin, so every run batches the same steps and the tokens
of two runs can be compared. One process serves the whole trace twice with one manager: the *cold*
pass meets transformers' lazy captures (a new padded shape is captured on the serving path), the
*warm* pass replays what the cold one captured. Prefix sharing is off: the prompts share nothing,
and with it off the warm pass repeats the cold one step for step.

Each round runs two processes, ``--variant bare`` and ``--variant attached``, alternating which goes
first; ``--rounds`` of them. Processes differ from one another by more than the integration costs (the
same was seen with vLLM), so ``--alternating`` processes then compare within one process: attached,
they serve the cold pass, then the warm pass twice, pausing the integration (``Attachment.pause``:
transformers' own methods back) for every other wave, the other waves the second time, so each wave
is served once on and once off; tokens/s on over off per wave, the median over waves.

An attached process calls ``attach(db)`` before serving and
``detach()`` after, writing into one SQLite file (``--db``, default beside the JSON) through the
product's Recorder, then reads its run back through the daemon's queries. Figures: output tokens
identical in every process (per pass), tokens per second per pass (generated tokens over the time
from queuing a wave's requests to its last answer, summed over waves) as the median over processes
of each variant and attached/bare of the medians, start-up (model built, warm-up) likewise; and what
the attached processes recorded: graphs by transformers' key, start-up and late captures with their
cost, replays, real and padding tokens per graph, eager batches by reason, pool bytes recorded
against what the allocator holds in transformers' graph pool.

    python3 bench/gpu_transformers_cb.py --out $OUT/gpu_transformers_cb.json   # 6 processes, ~2 min

``--quick`` runs a tiny model in one round on any device (a CPU runs no CUDA graphs: every step is
an eager batch); its figures are not results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    base_parser,
    command_line,
    print_table,
    print_targets,
    resolve_device,
    target,
    write_results,
)
from bench.gpu_transformers import MODELS  # the same Llama shapes: "small" (~160M) and "tiny"

VARIANTS = ("bare", "attached")
PASSES = ("cold", "warm")
CB_CONFIGS = {
    # 64 pages of 256 tokens (16,384 tokens of cache), up to 512 tokens and 64 requests a step; the
    # query padded to multiples of 64 tokens, the cache read to multiples of 4,096 (transformers'
    # default 16,384 would be the whole cache: every step one size)
    "small": {
        "block_size": 256,
        "num_blocks": 64,
        "max_batch_tokens": 512,
        "max_requests_per_batch": 64,
        "q_padding_interval_size": 64,
        "kv_padding_interval_size": 4096,
    },
    "tiny": {
        "block_size": 32,
        "num_blocks": 32,
        "max_batch_tokens": 64,
        "max_requests_per_batch": 16,
        "q_padding_interval_size": 16,
        "kv_padding_interval_size": 256,
    },
}
ATTENTION = "paged|sdpa"
RATIO_FLOOR = 0.99
"""The issue's throughput target for an engine integration: attached/bare tokens per second."""


# ------------------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Request:
    id: str
    arrival_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int


def trace_requests(
    count: int, *, prompt_scale: float, output_scale: float, max_prompt: int, max_output: int, vocab: int
) -> list[Request]:
    """The trace's first ``count`` requests, lengths scaled down and clamped, prompts seeded."""
    from capture_core.reference.trace import load_trace

    trace = load_trace()
    if count > len(trace):
        raise SystemExit(f"error: --requests {count}: the trace has {len(trace)} requests")
    requests = []
    for index, row in enumerate(trace.requests[:count]):
        prompt_len = min(max(round(row.context_tokens / prompt_scale), 4), max_prompt)
        output_len = min(max(round(row.generated_tokens / output_scale), 2), max_output)
        generator = torch.Generator().manual_seed(index)
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        requests.append(Request(f"r{index}", row.arrival_s, tuple(prompt), output_len))
    return requests


def arrival_waves(requests: list[Request], wave_s: float) -> list[list[Request]]:
    """Requests grouped by arrival: one wave per ``wave_s`` seconds of the trace that has any."""
    if wave_s <= 0:
        raise SystemExit(f"error: --wave-s must be positive, got {wave_s:g}")
    waves: dict[int, list[Request]] = defaultdict(list)
    for request in requests:
        waves[int(request.arrival_s // wave_s)].append(request)
    return [waves[key] for key in sorted(waves)]


def expected_real_tokens(requests: list[Request]) -> int:
    """What the steps' real tokens add up to, however they are batched: every prompt token once and
    every generated token but the last once (the last is sampled, never fed back)."""
    return sum(len(r.prompt) + r.max_new_tokens - 1 for r in requests)


def build_model(size: str, device: torch.device) -> Any:
    """The same random weights in every process (seeded, built on the device), paged attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[size], max_position_embeddings=32768)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config).eval()
    model = model.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.set_attn_implementation(ATTENTION)
    return model


def cb_config(size: str) -> Any:
    """CUDA graphs on, the sizes above, prefix sharing off, and no switch to flash attention."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    options: dict[str, Any] = {**CB_CONFIGS[size], "use_cuda_graph": True, "allow_block_sharing": False}
    if "auto_switch_to_flash" in {f.name for f in fields(ContinuousBatchingConfig)}:
        options["auto_switch_to_flash"] = False  # 5.24 would try flash attention, which is not there
    return ContinuousBatchingConfig(**options)


def generation_config() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)


@dataclass
class Pass:
    tokens: dict[str, list[int]]
    seconds: float
    generated: int
    waves: list[tuple[float, int]] = field(default_factory=list)
    """Each wave's (seconds, generated tokens), in order."""


@dataclass
class Served:
    warmup_s: float
    passes: list[Pass]
    pool_reserved_bytes: int | None
    """What the allocator held in transformers' graph pool after the last pass (None off CUDA)."""
    graph_keys: list[list[Any]]
    """[IO pair or None, transformers' key] of every graph transformers held after the last pass."""


def serve(
    model: Any,
    waves: list[list[Request]],
    size: str,
    passes: int = len(PASSES),
    timeout_s: float = 120.0,
    before_wave: Callable[[int, int], None] | None = None,
) -> Served:
    """Warm up one persistent manager, then serve every wave ``passes`` times. Within a wave every
    request is queued before its steps start; ``before_wave(pass, wave)`` is called before each wave
    is queued (the manager stopped)."""
    config, gen = cb_config(size), generation_config()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    began = time.perf_counter()
    manager.warmup()
    warmup_s = time.perf_counter() - began
    served = []
    try:
        for index in range(passes):
            result = Pass({}, 0.0, 0)
            for wave_index, wave in enumerate(waves):
                if before_wave is not None:
                    before_wave(index, wave_index)
                manager.background_thread_status.clear()  # "before starting the thread": ours to queue
                began = time.perf_counter()
                ids = {
                    manager.add_request(
                        list(r.prompt), request_id=f"p{index}-{r.id}", max_new_tokens=r.max_new_tokens
                    ): r
                    for r in wave
                }
                manager.start()
                answered = collect(manager, set(ids), timeout_s)
                seconds = time.perf_counter() - began
                result.seconds += seconds
                result.waves.append((seconds, sum(len(tokens) for tokens in answered.values())))
                manager.stop(block=True, keep_for_next_session=True)
                # the cached manager back, its attention made paged again (as generate_batch gets it)
                again = model.init_continuous_batching(
                    generation_config=gen, continuous_batching_config=config
                )
                if again is not manager:
                    raise RuntimeError("transformers did not keep the manager between waves")
                for request_id, tokens in answered.items():
                    result.tokens[ids[request_id].id] = tokens
                    result.generated += len(tokens)
            served.append(result)
        pool = pool_bytes(manager.batch_processor.model_runner.graph_pool_id)
        keys = graph_keys(manager.batch_processor.inputs_and_outputs)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return Served(warmup_s, served, pool, keys)


def graph_keys(ios: Any) -> list[list[Any]]:
    """The keys of the graphs transformers holds, read from its own graph buffers."""
    pairs = getattr(ios, "io_pairs", None)
    holders = [(p.device_io, i) for i, p in enumerate(pairs)] if pairs is not None else [(ios, None)]
    return sorted(([pair, list(key)] for io, pair in holders for key in io.graphs._storage), key=repr)


def pool_bytes(pool: Any) -> int | None:
    """The allocator's segments of one graph pool, summed (torch's own snapshot, not the meter the
    integration uses)."""
    if pool is None or not torch.cuda.is_available():
        return None
    wanted = tuple(int(part) for part in pool)
    return sum(
        int(segment["total_size"])
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) == wanted
    )


def collect(manager: Any, ids: set[str], timeout_s: float) -> dict[str, list[int]]:
    answered: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(answered) < len(ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(ids) - len(answered)} requests unanswered after {timeout_s:g} s")
        result = manager.get_result(timeout=1)
        if result is None or not result.is_finished():
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped before every answer came")
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        answered[result.request_id] = list(result.generated_tokens)
    return answered


def digest(tokens: dict[str, list[int]]) -> str:
    return hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ one process


def run_child(args: Any) -> dict[str, Any]:
    started = time.perf_counter()
    device = resolve_device(args.device)
    model = build_model(args.model, device)
    requests = trace_requests(
        args.requests,
        prompt_scale=args.prompt_scale,
        output_scale=args.output_scale,
        max_prompt=args.max_prompt,
        max_output=args.max_output,
        vocab=model.config.vocab_size,
    )
    waves = arrival_waves(requests, args.wave_s)
    built_s = time.perf_counter() - started
    attachment = None
    if args.variant in ("attached", "alternating"):
        from inspector.engines.transformers_cb import attach

        attachment = attach(args.db, label=args.label)
        if attachment is None:
            raise SystemExit("error: graph-inspector refused to attach (see the line above)")
    alternating = args.variant == "alternating"

    def before_wave(pass_index: int, wave_index: int) -> None:
        """Passes 2 and 3 of an alternating process: the integration on for every other wave, the
        other waves in pass 3 (so each wave is served once on and once paused)."""
        assert attachment is not None
        if pass_index == 0 or on_in(pass_index, wave_index):
            attachment.resume()
        else:
            attachment.pause()

    try:
        served = serve(model, waves, args.model, passes=len(PASSES) + alternating,
                       before_wave=before_wave if alternating else None)
    finally:
        if attachment is not None:
            from inspector.engines.transformers_cb import detach

            detach()
    result: dict[str, Any] = {
        "variant": args.variant,
        "pid": os.getpid(),
        "transformers": __import__("transformers").__version__,
        "built_s": built_s,
        "warmup_s": served.warmup_s,
        "waves": len(waves),
        "requests": len(requests),
        "expected_real_tokens_per_pass": expected_real_tokens(requests),
        "passes": {
            name: {
                "tokens": digest(p.tokens),
                "seconds": p.seconds,
                "generated": p.generated,
                "tokens_per_s": p.generated / p.seconds if p.seconds else None,
            }
            for name, p in zip(PASSES, served.passes, strict=False)
        },
        "pool_reserved_bytes": served.pool_reserved_bytes,
        "graph_keys": served.graph_keys,
    }
    if alternating:
        result["alternation"] = alternation(served.passes[1:])
    if attachment is not None:
        result["integration"] = attachment.summary()
        result["recorded"] = read_back(args.db, attachment.run_id)
    return result


def on_in(pass_index: int, wave_index: int) -> bool:
    """Whether an alternating process serves this wave with the integration on (passes 1 and 2 after
    the cold pass 0: even waves on in pass 1, odd waves in pass 2)."""
    return wave_index % 2 == (pass_index - 1) % 2


def alternation(warm: list[Pass]) -> dict[str, Any]:
    """An alternating process's two warm passes compared wave by wave: each wave served once with the
    integration on and once paused, the same requests and tokens; tokens/s on over off per wave (the
    median over waves), and over all waves (on seconds and off seconds summed)."""
    first, second = warm
    ratios, seconds = [], {True: 0.0, False: 0.0}
    same = True
    for wave, ((s1, g1), (s2, g2)) in enumerate(zip(first.waves, second.waves, strict=True)):
        on_s, off_s = (s1, s2) if on_in(1, wave) else (s2, s1)
        seconds[True] += on_s
        seconds[False] += off_s
        same = same and g1 == g2
        if on_s and off_s:
            ratios.append(off_s / on_s)  # the same tokens: the ratio of tokens/s on to off
    return {
        "wave_ratios": [round(r, 4) for r in ratios],
        "median_wave_ratio": statistics.median(ratios) if ratios else None,
        "ratio_over_all_waves": seconds[False] / seconds[True] if seconds[True] else None,
        "tokens_identical": same and digest(first.tokens) == digest(second.tokens),
        "on_seconds": seconds[True],
        "off_seconds": seconds[False],
    }


def read_back(db: str, run_id: int | None) -> dict[str, Any]:
    """The run as the database holds it: its configuration, every graph with its running totals,
    the traffic figures by the inspector's one formula (``inspector.reading.traffic``), the eager
    batches and the violations. Read through the storage models, not the daemon's queries, so the
    GPU machine needs SQLAlchemy and Alembic only (the daemon's side also wants prometheus-client)."""
    from sqlalchemy import func, select

    from inspector.reading.traffic import TrafficTotals, eager_totals, replay_totals, run_traffic
    from inspector.storage.models import EagerTotal, Graph, ReplayTotal, Run, Violation
    from inspector.storage.store import open_store

    if run_id is None:
        return {"run": None}
    store = open_store(db, upgrade=False)
    try:
        with store.session() as session:
            run = session.get(Run, run_id)
            config = json.loads(run.config or "{}") if run is not None else {}
            traffic = run_traffic(session, [run_id])
            per_graph = replay_totals(session, ReplayTotal.graph_id, run_ids=[run_id])
            eager = eager_totals(session, EagerTotal.reason, run_ids=[run_id])
            violations = session.scalar(
                select(func.coalesce(func.sum(Violation.count), 0)).where(Violation.run_id == run_id)
            )
            graphs = list(session.scalars(select(Graph).where(Graph.run_id == run_id).order_by(Graph.id)))
            by_graph = []
            for g in graphs:
                totals = per_graph.get((g.id,), TrafficTotals())
                by_graph.append(
                    {
                        "key": g.descriptor_key,
                        "engine_key": g.engine_key,
                        "captured_size": g.captured_size,
                        "unexpected": bool(g.unexpected),
                        "capture_seconds": g.capture_seconds,
                        "pool_bytes": g.pool_bytes,
                        "replays": totals.replays,
                        "num_real_tokens": totals.num_real_tokens,
                        "padding_tokens": totals.padding_tokens,
                    }
                )
    finally:
        store.dispose()
    return {
        "run": run_id,
        "config": config,
        "graphs": {"count": len(by_graph), "pool_bytes": sum(g["pool_bytes"] for g in by_graph)},
        "traffic": traffic.as_dict(),
        "eager": [
            {"reason": reason, "batches": batches, "num_real_tokens": tokens}
            for (reason,), (batches, tokens) in sorted(eager.items())
        ],
        "violations": int(violations or 0),
        "by_graph": by_graph,
    }


# ------------------------------------------------------------------------------ the parent


def child_command(args: Any, variant: str, out: Path, label: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--variant",
        variant,
        "--child-out",
        str(out),
        "--device",
        args.device,
        "--model",
        args.model,
        "--db",
        args.db,
        "--label",
        label,
        "--requests",
        str(args.requests),
        "--wave-s",
        repr(args.wave_s),
        "--prompt-scale",
        repr(args.prompt_scale),
        "--output-scale",
        repr(args.output_scale),
        "--max-prompt",
        str(args.max_prompt),
        "--max-output",
        str(args.max_output),
    ]


def run_process(args: Any, variant: str, round_index: int, logs: Path) -> dict[str, Any]:
    name = f"{variant}-r{round_index}"
    out, log = logs / f"{name}.json", logs / f"{name}.log"
    label = f"gpu_transformers_cb r{round_index}"
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    began = time.perf_counter()
    with log.open("w") as sink:
        try:
            code: int | str = subprocess.run(
                child_command(args, variant, out, label),
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=args.child_timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"over its {args.child_timeout_s:g} s limit"
    wall_s = time.perf_counter() - began
    if code != 0 or not out.exists():
        return {
            "variant": variant,
            "round": round_index,
            "failed": code,
            "wall_s": wall_s,
            "log_tail": log.read_text()[-3000:],
        }
    return json.loads(out.read_text()) | {"round": round_index, "wall_s": wall_s}


def summarise(processes: list[dict[str, Any]]) -> dict[str, Any]:
    attached = [p for p in processes if "failed" not in p and p["variant"] == "attached"]
    alternating = [p["alternation"] for p in processes if "failed" not in p and p["variant"] == "alternating"]
    every_wave = [r for a in alternating for r in a["wave_ratios"]]
    return figures(processes) | {
        "within_process": {
            "processes": alternating,
            "median_wave_ratio": statistics.median(every_wave) if every_wave else None,
            "waves": len(every_wave),
            "tokens_identical": all(a["tokens_identical"] for a in alternating),
        },
        "recorded": recorded_summary(attached[0]) if attached else None,
        "recorded_alike": len({json.dumps(keys(p)) for p in attached}) <= 1,
        "processes": processes,
    }


def figures(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens identical (per pass, in every process, none failed), tokens/s and start-up: the median
    over each variant's processes, attached/bare of the medians, and each round's own ratio."""
    ok = [p for p in processes if "failed" not in p]
    by_variant = {v: [p for p in ok if p["variant"] == v] for v in VARIANTS}
    identical = {
        name: len({p["passes"][name]["tokens"] for p in ok}) == 1 and len(ok) == len(processes)
        for name in PASSES
    }
    throughput = {}
    for name in PASSES:
        medians = {v: _median([p["passes"][name]["tokens_per_s"] for p in by_variant[v]]) for v in VARIANTS}
        throughput[name] = medians | {
            "ratio": _ratio(medians["attached"], medians["bare"]),
            "round_ratios": round_ratios(ok, name),
        }
    startup = {
        key: {v: _median([p[key] for p in by_variant[v]]) for v in VARIANTS}
        for key in ("built_s", "warmup_s")
    }
    for phase in startup.values():
        phase["ratio"] = _ratio(phase["attached"], phase["bare"])
    return {
        "failed": len(processes) - len(ok),
        "tokens_identical": identical,
        "tokens_per_s": throughput,
        "startup_s": startup,
    }


def keys(process: dict[str, Any]) -> list[tuple[str, bool]]:
    return sorted((g["key"], g["unexpected"]) for g in process["recorded"]["by_graph"])


def recorded_summary(process: dict[str, Any]) -> dict[str, Any]:
    """What one attached process recorded, read back from the database, with its own checks."""
    recorded, seen = process["recorded"], process["integration"]
    graphs = recorded["by_graph"]
    late = [g for g in graphs if g["unexpected"]]
    real = sum(g["num_real_tokens"] for g in graphs) + sum(e["num_real_tokens"] for e in recorded["eager"])
    pool = recorded["graphs"]["pool_bytes"]
    return {
        "run": recorded["run"],
        "graphs": len(graphs),
        "start_up_graphs": len(graphs) - len(late),
        "late_captures": len(late),
        "late_capture_seconds": sum(g["capture_seconds"] for g in late),
        "start_up_capture_seconds": sum(g["capture_seconds"] for g in graphs if not g["unexpected"]),
        "keys": [g["key"] for g in graphs],
        "replays": recorded["traffic"]["replays"],
        "eager_batches": {e["reason"]: e["batches"] for e in recorded["eager"]},
        "num_real_tokens": real,
        "expected_real_tokens": process["expected_real_tokens_per_pass"] * len(PASSES),
        "padding_tokens": recorded["traffic"]["padding_tokens"],
        "padding_waste": recorded["traffic"]["padding_waste"],
        "hit_ratio": recorded["traffic"]["hit_ratio"],
        "pool_bytes": pool,
        "pool_reserved_bytes": process["pool_reserved_bytes"],
        "keys_match": sorted(([g["pair"], g["transformers_key"]] for g in seen["by_graph"]), key=repr)
        == process["graph_keys"],
        "violations": recorded["violations"],
        "integration_errors": seen["errors"],
        "by_graph": graphs,
        "config": recorded["config"],
    }


def round_ratios(processes: list[dict[str, Any]], name: str) -> list[float]:
    by_round: dict[int, dict[str, float]] = defaultdict(dict)
    for p in processes:
        if p["variant"] in VARIANTS:
            by_round[p["round"]][p["variant"]] = p["passes"][name]["tokens_per_s"]
    return [pair["attached"] / pair["bare"] for _, pair in sorted(by_round.items()) if len(pair) == 2]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(results: dict[str, Any]) -> None:
    rows = [
        (
            name,
            results["tokens_identical"][name],
            t["bare"],
            t["attached"],
            t["ratio"],
            " ".join(f"{r:.3f}" for r in t["round_ratios"]),
        )
        for name, t in results["tokens_per_s"].items()
    ]
    print_table(
        "tokens/s, median over processes",
        ("pass", "tokens identical", "bare", "attached", "attached/bare", "per round"),
        rows,
    )
    within = results["within_process"]
    if within["processes"]:
        print_table(
            "warm pass within one process: each wave served attached and paused, tokens/s on / off",
            ("process", "median over waves", "over all waves", "tokens identical"),
            [(i, a["median_wave_ratio"], a["ratio_over_all_waves"], a["tokens_identical"])
             for i, a in enumerate(within["processes"])]
            + [("every wave", within["median_wave_ratio"], "-", within["tokens_identical"])],
        )
    start = results["startup_s"]
    print_table(
        "start-up, median seconds",
        ("phase", "bare", "attached", "attached/bare"),
        [(k, v["bare"], v["attached"], v["ratio"]) for k, v in start.items()],
    )
    recorded = results["recorded"]
    if recorded is None:
        return
    print_table(
        f"recorded (run {recorded['run']}, read back from the database)",
        ("figure", "value"),
        [
            ("graphs", recorded["graphs"]),
            ("at warm-up", recorded["start_up_graphs"]),
            ("captured lazily after warm-up", recorded["late_captures"]),
            ("their capture seconds", recorded["late_capture_seconds"]),
            ("replays", recorded["replays"]),
            ("eager batches", json.dumps(recorded["eager_batches"])),
            ("real tokens (expected)", f"{recorded['num_real_tokens']} ({recorded['expected_real_tokens']})"),
            ("padding tokens", recorded["padding_tokens"]),
            ("padding waste", recorded["padding_waste"]),
            ("hit ratio", recorded["hit_ratio"]),
            (
                "pool bytes recorded (allocator)",
                f"{recorded['pool_bytes']} ({recorded['pool_reserved_bytes']})",
            ),
            ("violations", recorded["violations"]),
            ("recorded keys = transformers' graph buffers", recorded["keys_match"]),
            ("same graphs in every attached process", results["recorded_alike"]),
        ],
    )
    print_table(
        "graphs",
        ("key", "late", "capture s", "pool bytes", "replays", "real tokens", "padding"),
        [
            (
                g["key"],
                g["unexpected"],
                g["capture_seconds"],
                g["pool_bytes"],
                g["replays"],
                g["num_real_tokens"],
                g["padding_tokens"],
            )
            for g in recorded["by_graph"]
        ],
    )


def run_parent(args: Any) -> dict[str, Any]:
    device = resolve_device(args.device)
    out = Path(args.out)
    db_path = out.with_suffix(".db")
    if args.db is None:
        for stale in (db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm")):
            stale.unlink(missing_ok=True)  # our own output from an earlier run
        db_path.parent.mkdir(parents=True, exist_ok=True)
        args.db = f"sqlite:///{db_path.resolve()}"
    logs = out.parent / f"{out.stem}-processes"
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    began = time.perf_counter()
    for round_index in range(args.rounds):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            processes.append(run_process(args, variant, round_index, logs))
            state = "  FAILED" if "failed" in processes[-1] else ""
            print(f"round {round_index} {variant:8} {processes[-1]['wall_s']:6.1f} s{state}", flush=True)
    for index in range(args.alternating):
        processes.append(run_process(args, "alternating", index, logs))
        state = "  FAILED" if "failed" in processes[-1] else ""
        print(f"alternating {index}  {processes[-1]['wall_s']:6.1f} s{state}", flush=True)
    results = summarise(processes) | {"db": args.db, "seconds": time.perf_counter() - began}
    warm = results["tokens_per_s"]["warm"]["ratio"]
    targets = [
        target(
            "warm pass: share of tokens/s lost attached",
            None if warm is None else 1.0 - warm,
            1.0 - RATIO_FLOOR,
            applies=device.type == "cuda" and not args.quick,
        )
    ]
    notes = [] if device.type == "cuda" else ["a CPU runs no CUDA graphs: every step is an eager batch"]
    config = {
        k: v for k, v in vars(args).items() if k not in ("child", "child_out", "variant", "label", "out")
    }
    payload = write_results(
        out,
        benchmark="gpu_transformers_cb",
        command=command_line(),
        device=device,
        config=config,
        results=results,
        targets=targets,
        notes=notes,
    )
    report(results)
    print_targets(targets)
    print(
        json.dumps(
            {
                "out": str(out),
                "db": args.db,
                "failed": results["failed"],
                "tokens_identical": results["tokens_identical"],
                "warm_ratio": warm,
                "warm_ratio_within_process": results["within_process"]["median_wave_ratio"],
                "cold_ratio": results["tokens_per_s"]["cold"]["ratio"],
            }
        )
    )
    return payload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = base_parser(
        __doc__.split("\n\n")[0], default_out="bench/results/gpu_transformers_cb.json", default_budget_s=240
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of one bare and one attached process (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default=None, help="default small (tiny with --quick)"
    )
    parser.add_argument(
        "--alternating",
        type=int,
        default=None,
        help="processes that serve the warm pass twice, each wave once attached and once paused "
        "(default 2; 1 with --quick)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="the trace's first N requests (default 240; 24 with --quick)",
    )
    parser.add_argument(
        "--wave-s", type=float, default=10.0, help="seconds of the trace per wave (default 10)"
    )
    parser.add_argument("--prompt-scale", type=float, default=8.0, help="ContextTokens / this (default 8)")
    parser.add_argument("--output-scale", type=float, default=4.0, help="GeneratedTokens / this (default 4)")
    parser.add_argument("--max-prompt", type=int, default=None, help="prompt tokens at most (default 512)")
    parser.add_argument("--max-output", type=int, default=None, help="answer tokens at most (default 96)")
    parser.add_argument(
        "--db",
        default=None,
        help="database URL for the attached processes (default: a fresh SQLite file beside --out)",
    )
    parser.add_argument(
        "--child-timeout-s", type=float, default=240.0, help="one process's limit (default 240)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=(*VARIANTS, "alternating"), help=argparse.SUPPRESS)
    parser.add_argument("--label", default="gpu_transformers_cb", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, small in (
        ("rounds", 3, 1),
        ("alternating", 2, 1),
        ("model", "small", "tiny"),
        ("requests", 240, 24),
        ("max_prompt", 512, 48),
        ("max_output", 96, 8),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if quick:
        args.prompt_scale, args.output_scale = max(args.prompt_scale, 32.0), max(args.output_scale, 16.0)
    if args.rounds < 1 or args.requests < 1 or args.alternating < 0:
        parser.error("--rounds and --requests must be at least 1, --alternating at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_child(args)
        args.child_out.write_text(json.dumps(result, indent=1))
        return 0
    payload = run_parent(args)
    return 0 if payload["results"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
