"""One real vLLM 0.25.1 process serving the bundled Azure conversation trace, with graph-inspector's
vLLM integration on or off (the GPU machine; `bench/gpu_vllm.py` starts several and compares them).

The trace is replayed through vLLM's own scheduler (continuous batching, chunked prefill, prefix
caching) on a small random-weight Llama, as token-id requests:

- arrivals: the trace's arrival times on a virtual clock of engine steps (``--requests-per-step``
  at the trace's own rate, ramping up from a tenth of it over the first ``--ramp-steps`` steps and
  down to a twentieth over the last, so the batch grows from one request through every capture
  size and shrinks again; an idle engine skips to the next arrival). Requests are added between
  ``LLMEngine.step()`` calls by step number, never by wall time, so the batches (and the greedy
  tokens) are the same in every run of the same options;
- prompts: the trace's ``ContextTokens`` divided by ``--prompt-scale`` (a small model's context),
  a shared 32-token system prompt (the prefix vLLM's prefix cache keeps) then tokens of the request's
  own; outputs: ``GeneratedTokens`` divided by ``--output-scale``, greedy, ``ignore_eos``.

With ``--alternate N`` (in-process engine, integration on) the serve is cut into segments of N steps
served in turn at each of ``--levels`` (default ``on,off``: the integration as shipped, and paused by
``hooks.pause``, vLLM's own per-step methods back in place; ``hooks`` and ``recording`` in between say
where a cost is): each segment's tokens and seconds are kept, so the levels are compared within one
process on neighbouring steps, free of what differs between processes.

With ``--faults`` (in-process engine only) the run plants, between steps, the faults the issue names
(a weight reassigned as an RL weight sync might, by ``.data`` and by a new ``nn.Parameter``; a
per-step input buffer replaced instead of written; a descriptor vLLM never captured reaching its
wrappers) and records at which step each violation reached the recorder. ``--cudagraph-metrics``
turns on vLLM's own ``CUDAGraphStat`` and counts them (V1 runner; vLLM 0.25.1's V2 runner makes
none) to compare with what graph-inspector recorded.

usage (the GPU machine, vLLM's bundle on PYTHONPATH, see ../shared/vllm/README.md):
    python3 bench/vllm_serve.py --tag on --db sqlite:////tmp/on.db --out /tmp/on.json
    python3 bench/vllm_serve.py --tag off --out /tmp/off.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SYSTEM_PROMPT = [(17 * j) % 30000 + 200 for j in range(32)]
"""The shared system prompt every request starts with (what prefix caching keeps)."""

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16", "torch_dtype": "bfloat16",
}
MODELS = {
    "tiny": TINY_LLAMA,
    # Llama 3 8B's shape (what vLLM users serve on one GPU): 8.0B parameters, 16 GB of bf16 weights a
    # step reads, 32 layers (so 33 pieces a PIECEWISE step), grouped-query attention.
    "llama-8b": {**TINY_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                 "max_position_embeddings": 8192, "rope_theta": 500000.0},
}
"""The random-weight models ``--model`` serves (a config each; vLLM makes dummy weights of its shape)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", required=True, help="name of this process's result")
    p.add_argument("--db", default="", help="database URL: the integration is on (GRAPH_INSPECTOR_VLLM); "
                   "empty: off")
    p.add_argument("--runner", choices=("v1", "v2"), default="v2", help="vLLM's model runner (default V2)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny",
                   help="the random-weight Llama served: tiny (hidden 512, 4 layers: the host-bound worst "
                   "case, default) or llama-8b (Llama 3 8B's shape; give it --kv-cache-gib)")
    p.add_argument("--multiproc", action="store_true", help="the engine core in its own process (vllm serve)")
    p.add_argument("--steps", type=int, default=3000, help="engine steps of arrivals (then drain)")
    p.add_argument("--requests-per-step", type=float, default=0.8, help="arrivals per step at full speed")
    p.add_argument("--ramp-steps", type=int, default=300)
    p.add_argument("--prompt-scale", type=float, default=8.0)
    p.add_argument("--output-scale", type=float, default=4.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--sizes", default="", help="cudagraph_capture_sizes, comma separated (default vLLM's)")
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="kv_cache_memory_bytes (skips vLLM's memory profiling; 0: gpu_memory_utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.08)
    p.add_argument("--cudagraph-metrics", action="store_true")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="serve this many steps of the trace first, unmeasured (while the others build)")
    p.add_argument("--faults", action="store_true", help="plant the faults (in-process engine only)")
    p.add_argument("--alternate", type=int, default=0, metavar="STEPS",
                   help="with --db, in-process: serve in segments of this many steps at each of --levels in "
                   "turn (on-off-off-on-... for two), each timed")
    p.add_argument("--levels", default="on,off", type=levels_of,
                   help=f"what --alternate's segments serve with, comma separated, among: "
                   f"{'; '.join(f'{k}: {v}' for k, v in LEVELS.items())} (default on,off)")
    p.add_argument("--waves", type=int, default=0, metavar="CYCLES",
                   help="with --db, in-process: instead of the trace serve, this many cycles, each serving "
                   "one window of the trace once at each of --levels, the same requests every time "
                   "(bench/vllm_waves.py)")
    p.add_argument("--wave-steps", type=int, default=200,
                   help="arrival steps of the trace per wave (default 200, about 150 requests)")
    p.add_argument("--time-integration", action="store_true",
                   help="time the integration's own host work per step, per level (bench/vllm_clock.py); for "
                   "a process whose tokens/s are not compared")
    p.add_argument("--checks", choices=("always_on", "off", "debug"), default="",
                   help="GRAPH_INSPECTOR_CHECKS for this process (default: unset, always_on)")
    p.add_argument("--canary", action="store_true", help="the replay-vs-eager canary on sampled replays")
    p.add_argument("--profile", action="store_true",
                   help="profile the measured serve (cProfile, main thread): the functions that took longest")
    p.add_argument("--serve-cpus", default="",
                   help="pin every thread of this process to these cores while it serves (e.g. 0-3)")
    p.add_argument("--init-gate", default="", help="wait for this file before building the engine")
    p.add_argument("--ready-file", default="", help="touch this file once the engine is built")
    p.add_argument("--go-file", default="", help="wait for this file before serving")
    p.add_argument("--done-file", default="", help="touch this file when serving is done")
    p.add_argument("--out", required=True, help="result JSON")
    return p.parse_args(argv)


def levels_of(text: str) -> str:
    names = text.split(",")
    if "off" not in names or len(set(names)) != len(names) or not set(names) <= set(LEVELS):
        known = ", ".join(LEVELS)
        raise argparse.ArgumentTypeError(f"levels are distinct names among {known}, off one of them")
    return text


def wait_for(path: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def cpus(text: str) -> set[int]:
    """``0-3,8`` as a set of core numbers."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def pin(cores: set[int]) -> None:
    """Pin every thread of this process (those running now; later ones inherit) to ``cores``."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


def top_functions(profile: Any, count: int = 40) -> dict[str, list[list[Any]]]:
    """A cProfile run's functions as [where, calls, own seconds, cumulative seconds]: the ``count``
    with the most time of their own, and graph-inspector's own by cumulative time."""
    import pstats

    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [[f"{path}:{line}({name})", calls, round(own, 4), round(cumulative, 4)]
            for (path, line, name), (_, calls, own, cumulative, _) in stats.items()]
    ours = [row for row in rows if "/inspector/" in row[0] or "/capture_core/" in row[0]]
    return {"own": sorted(rows, key=lambda row: -row[2])[:count],
            "graph_inspector": sorted(ours, key=lambda row: -row[3])[:count]}


class GcClock:
    """Python's garbage collections during the measured serve: how many per generation, how long."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._began

    def result(self) -> dict[str, Any]:
        return {"collections": self.counts, "seconds": round(self.seconds, 3)}


def touch(path: str) -> None:
    if path:
        Path(path).write_text(str(time.time()))


def trace_requests(args: argparse.Namespace) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt token ids, output tokens) of every request arriving within the steps."""
    from capture_core.reference.trace import load_trace

    trace = load_trace()
    rate = len(trace) / trace.period_s  # requests per trace second
    per_step_s = args.requests_per_step / rate  # trace seconds per step at full speed
    requests, clock, step, index = [], 0.0, 0, 0
    while step < args.steps and index < len(trace):
        rising = 0.1 + 0.9 * step / max(args.ramp_steps, 1)
        falling = 0.05 + 0.95 * (args.steps - step) / max(args.ramp_steps, 1)
        speed = min(1.0, rising, falling)
        clock += per_step_s * speed
        while index < len(trace) and trace.requests[index].arrival_s <= clock:
            r = trace.requests[index]
            prompt_len = max(1, min(round(r.context_tokens / args.prompt_scale), args.max_model_len // 2))
            output = max(1, min(round(r.generated_tokens / args.output_scale), args.max_model_len // 4))
            own_len = max(prompt_len - len(SYSTEM_PROMPT), 0)
            own = [(7919 * index + 104729 * j) % 30000 + 1000 for j in range(own_len)]
            requests.append((step, SYSTEM_PROMPT[:prompt_len] + own, output))
            index += 1
        step += 1
    return requests


def trace_windows(args: argparse.Namespace) -> list[list[tuple[int, list[int], int]]]:
    """``--waves`` windows of ``--wave-steps`` arrival steps each, from the end of the ramp on (the trace
    at full speed)."""
    from bench.vllm_waves import windows

    ramp, width = args.ramp_steps, args.wave_steps
    full = trace_requests(argparse.Namespace(**{**vars(args), "steps": 2 * ramp + args.waves * width}))
    return windows(full, ramp, width, args.waves)


def engine_kwargs(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    compilation: dict[str, Any] = {}
    if args.sizes:
        compilation["cudagraph_capture_sizes"] = [int(s) for s in args.sizes.split(",")]
    kwargs: dict[str, Any] = dict(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        enforce_eager=False, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
        compilation_config=compilation, attention_config={"backend": "TRITON_ATTN"}, seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if args.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.cudagraph_metrics:
        kwargs["cudagraph_metrics"] = True
    return kwargs


class Faults:
    """Plants each fault between steps, in order, and notes the step each one was planted at."""

    def __init__(self, runner: Any, runner_kind: str) -> None:
        self.runner, self.kind = runner, runner_kind
        self.planted: list[dict[str, Any]] = []
        self._undo: Any = None

    def model(self) -> Any:
        model = self.runner.model
        return getattr(model, "runnable", model)

    def plant(self, name: str, step: int) -> None:
        import torch

        self.planted.append({"fault": name, "step": step})
        model = self.model()
        if name == "weight_data_swap":  # param.data = new storage (the values kept)
            param = model.model.layers[1].mlp.down_proj.weight
            old = param.data
            param.data = old.clone()
            self._undo = lambda: setattr(param, "data", old)
        elif name == "weight_parameter_reassigned":  # module.weight = nn.Parameter(new)
            layer = model.model.layers[2].mlp.down_proj
            old = layer.weight
            layer.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
            self._undo = lambda: setattr(layer, "weight", old)
        elif name == "input_buffer_replaced":  # a per-step buffer replaced instead of written
            if self.kind == "v2":
                buffers = self.runner.input_buffers
                old = buffers.positions
                buffers.positions = torch.zeros_like(old)
                self._undo = lambda: setattr(buffers, "positions", old)
            else:
                runner = self.runner
                old = runner.positions
                runner.positions = torch.zeros_like(old)
                self._undo = lambda: setattr(runner, "positions", old)
        elif name == "uncaptured_descriptor":
            self._undo = self._dispatch_uncaptured()
        else:
            raise ValueError(name)

    @property
    def active(self) -> bool:
        return self._undo is not None

    def undo(self, faulty_step: int) -> None:
        """Take the fault out again, once a step replayed a graph with it in place (``faulty_step``:
        where a silently wrong graph would have run, and where it must be caught)."""
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()
            self.planted[-1]["faulty_step"] = faulty_step

    def _dispatch_uncaptured(self) -> Any:
        """The next step of a token count that is no capture size is dispatched to PIECEWISE at its
        own, unpadded size: a descriptor vLLM never captured reaches its piece wrappers."""
        sizes = set(self.runner.vllm_config.compilation_config.cudagraph_capture_sizes)
        if self.kind == "v2":
            from vllm.config.compilation import CUDAGraphMode
            from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

            manager = self.runner.cudagraph_manager
            original = manager.dispatch

            def dispatch(num_reqs: int, num_tokens: int, *a: Any, **k: Any) -> Any:
                if num_tokens not in sizes:
                    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=num_tokens,
                                                    num_reqs=None)
                return original(num_reqs, num_tokens, *a, **k)

            manager.dispatch = dispatch
            return lambda: manager.__dict__.pop("dispatch", None)
        from vllm.config.compilation import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        dispatcher = self.runner.cudagraph_dispatcher
        original = dispatcher.dispatch

        def dispatch(num_tokens: int, *a: Any, **k: Any) -> Any:
            if num_tokens not in sizes:
                return CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=num_tokens)
            return original(num_tokens, *a, **k)

        dispatcher.dispatch = dispatch
        return lambda: dispatcher.__dict__.pop("dispatch", None)


LEVELS = {
    "off": "paused: vLLM's own per-step methods (hooks.pause)",
    "hooks": "the hooks in place, passing every call straight to vLLM (no runtime, no recorder)",
    "recording": "steps, graphs and replays recorded, the replay checks off",
    "on": "the integration as shipped: recording and the always-on checks",
}
"""What a segment of ``--alternate`` serves with (``--levels``)."""


class Levels:
    """Puts the in-process integration at one of ``LEVELS`` between steps."""

    def __init__(self, session: Any, clock: Any = None) -> None:
        from capture_core.checks import AddressCheckMode

        self.session, self.runtime, self.recorder = session, session.runtime, session.recorder
        self.checked, self.unchecked = self.runtime.address_check, AddressCheckMode.OFF
        self.clock = clock

    def apply(self, level: str) -> None:
        from inspector.engines.vllm import hooks

        if self.clock is not None:
            self.clock.level = level
        if level == "off":
            hooks.pause()
            return
        hooks.resume()
        passing = level == "hooks"
        self.session.runtime = None if passing else self.runtime
        self.session.recorder = None if passing else self.recorder
        self.runtime.address_check = self.checked if level == "on" else self.unchecked


class Segments:
    """``--alternate``: the serve cut into segments of ``every`` steps, served at each of ``levels`` in
    turn, the order rotated by one every cycle (``off, on`` gives on, off, off, on, on, off, ...), so
    within a cycle of neighbouring segments each level serves once, and over cycles each level serves
    at each position alike; each segment's level, steps, output tokens and seconds."""

    def __init__(self, every: int, levels: Any = None, order: tuple[str, ...] = ("on", "off")) -> None:
        self.every, self.levels, self.order = every, levels, order
        self.done: list[dict[str, Any]] = []
        self._seen: dict[str, int] = {}
        self._tokens, self._first, self._began = 0, 0, time.perf_counter()
        if every and levels is not None:
            levels.apply(self.level(0))

    def level(self, index: int) -> str:
        count = len(self.order)
        return self.order[(index % count + index // count) % count]

    def made(self, request_id: str, generated: int) -> None:
        if self.every:
            self._tokens += generated - self._seen.get(request_id, 0)
            self._seen[request_id] = generated

    def stepped(self, step: int) -> None:
        if not self.every or step - self._first < self.every:
            return
        now = time.perf_counter()
        index = len(self.done)
        self.done.append({"level": self.level(index), "steps": step - self._first, "tokens": self._tokens,
                          "seconds": round(now - self._began, 6)})
        if self.levels is not None:
            self.levels.apply(self.level(index + 1))
        self._tokens, self._first, self._began = 0, step, time.perf_counter()

    def result(self) -> dict[str, Any]:
        """Each level against ``off``: tokens/s over all its segments / off's, and within each cycle
        (one segment of each level, neighbours) its tokens/s / off's, the median over cycles."""
        import statistics

        if self.levels is not None:
            self.levels.apply("on")
        rate = [s["tokens"] / s["seconds"] if s["seconds"] else 0.0 for s in self.done]
        count = len(self.order)
        cycles = [range(i, i + count) for i in range(0, len(self.done) - count + 1, count)]

        def total(level: str) -> float:
            chosen = [s for s in self.done if s["level"] == level]
            seconds = sum(s["seconds"] for s in chosen)
            return sum(s["tokens"] for s in chosen) / seconds if seconds else 0.0

        levels: dict[str, Any] = {}
        for level in self.order:
            per_cycle = []
            for cycle in cycles:
                at = {self.done[i]["level"]: i for i in cycle}
                off = rate[at["off"]] if "off" in at else 0.0
                if off and level in at:
                    per_cycle.append(round(rate[at[level]] / off, 4))
            levels[level] = {"tok_per_s": round(total(level), 1), "cycle_ratios": per_cycle,
                             "median_cycle_ratio": statistics.median(per_cycle) if per_cycle else None}
            if total("off"):
                levels[level]["ratio_over_all"] = total(level) / total("off")
        return {"every": self.every, "order": list(self.order), "segments": self.done, "levels": levels}


def serve(engine: Any, requests: list[tuple[int, list[int], int]], prefix: str, sampling: Any
          ) -> dict[str, Any]:
    """Serve ``requests`` (arrival step, prompt, output tokens) to the end, plainly (the warm-up)."""
    from bench.vllm_waves import serve_requests

    started = time.perf_counter()
    made, _, clock = serve_requests(engine, requests, prefix, lambda n: sampling(
        max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False))
    return {"requests": len(made), "steps": clock, "seconds": round(time.perf_counter() - started, 2)}


FAULT_ORDER = ("weight_data_swap", "weight_parameter_reassigned", "input_buffer_replaced",
               "uncaptured_descriptor")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"tag": args.tag, "argv": sys.argv, "integration": bool(args.db),
                              "runner": args.runner, "model": args.model, "multiproc": args.multiproc}
    out = Path(args.out)

    def dump() -> None:
        out.write_text(json.dumps(result, indent=1, default=str))

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiproc else "0"
    for key, value in (("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"), ("HF_HUB_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_USE_FLASHINFER_SAMPLER", "0")):
        os.environ.setdefault(key, value)
    if args.canary:
        os.environ["GRAPH_INSPECTOR_CANARY"] = "1"
    if args.checks:
        os.environ["GRAPH_INSPECTOR_CHECKS"] = args.checks
    if args.db:
        os.environ["GRAPH_INSPECTOR_VLLM"] = args.db
    else:
        os.environ.pop("GRAPH_INSPECTOR_VLLM", None)
    try:
        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import SamplingParams

        result["vllm"] = vllm.__version__
        result["torch"] = torch.__version__
        result["import_s"] = round(time.perf_counter() - t0, 2)
        model_dir = tempfile.mkdtemp(prefix=f"{args.model}_")
        Path(model_dir, "config.json").write_text(json.dumps(MODELS[args.model]))
        requests = trace_requests(args)
        result["requests"] = len(requests)
        wait_for(args.init_gate)
        stats: collections.Counter = collections.Counter()
        if args.cudagraph_metrics:
            from vllm.v1.core.sched.scheduler import Scheduler

            update = Scheduler.update_from_output

            def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
                stat = getattr(model_runner_output, "cudagraph_stats", None)
                if stat is not None:
                    stats[(stat.num_unpadded_tokens, stat.num_padded_tokens, stat.runtime_mode)] += 1
                return update(self, scheduler_output, model_runner_output)

            Scheduler.update_from_output = update_from_output
        t1 = time.perf_counter()
        llm = vllm.LLM(**engine_kwargs(args, model_dir))
        result["init_s"] = round(time.perf_counter() - t1, 2)
        config = llm.llm_engine.vllm_config
        result["config"] = {
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "cudagraph_capture_sizes": config.compilation_config.cudagraph_capture_sizes,
            "max_cudagraph_capture_size": config.compilation_config.max_cudagraph_capture_size,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "v2_model_runner": bool(getattr(config, "use_v2_model_runner", False)),
        }
        runner = None
        if not args.multiproc:
            core = llm.llm_engine.engine_core.engine_core
            runner = core.model_executor.driver_worker.worker.model_runner
            result["model_runner"] = type(runner).__module__ + "." + type(runner).__name__
        if args.warmup_steps:  # kernels compiled, caches warm: the measured serve starts steady
            warm = trace_requests(argparse.Namespace(**{**vars(args), "steps": args.warmup_steps}))
            result["warmup"] = serve(llm.llm_engine, warm, "w", SamplingParams)
        touch(args.ready_file)
        wait_for(args.go_file)
        if args.serve_cpus:
            pin(cpus(args.serve_cpus))
            result["serve_cpus"] = sorted(os.sched_getaffinity(0))
        violations: list[dict[str, Any]] = []
        session = None
        if args.db and runner is not None:
            from inspector.engines.vllm import hooks

            session = hooks.session()
            if session is None or session.recorder is None:
                raise RuntimeError("the integration was asked for (--db) but vLLM did not load it: is "
                                   "graph-inspector installed (its vllm.general_plugins entry point)?")
            told = session.violation

            def violation(event: Any) -> None:
                violations.append({"step": state["step"], "kind": event.kind.value,
                                   "input": event.input_name, "wrapper": event.wrapper,
                                   "descriptor": event.descriptor.key})
                told(event)

            session.violation = violation
        faults = Faults(runner, args.runner) if args.faults and runner is not None else None
        modes: dict[int, str] = {}  # step -> the runtime mode vLLM dispatched it in (with the integration)
        if session is not None:
            dispatched = session.step

            def step_seen(vllm_mode: Any, *a: Any, **k: Any) -> None:
                if not session.dummy_depth:
                    modes[state["step"]] = vllm_mode.name
                dispatched(vllm_mode, *a, **k)

            session.step = step_seen
        to_plant, plant_at = (list(FAULT_ORDER) if faults else []), args.steps // 3
        engine = llm.llm_engine
        params = {n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                  for n in {o for _, _, o in requests}}
        tokens: dict[str, list[int]] = {}
        state = {"step": 0}
        pending = collections.deque(requests)
        profile = None
        if args.profile:
            import cProfile

            profile = cProfile.Profile()
        import gc

        collections_seen = GcClock()
        gc.callbacks.append(collections_seen)
        splits: list[float] = []  # seconds from the start at every 500th step
        clock = None
        if session is not None and args.time_integration:
            from bench.vllm_clock import IntegrationClock

            clock = IntegrationClock(session)
        alternating = session is not None and not faults and args.alternate
        levels = Levels(session, clock) if alternating else None
        segments = Segments(args.alternate if alternating else 0, levels, tuple(args.levels.split(",")))
        waves = None
        if session is not None and not faults and args.waves:
            from bench.vllm_waves import Waves

            waves = Waves(trace_windows(args), Levels(session, clock), tuple(args.levels.split(",")))
            pending.clear()
        torch.cuda.synchronize()
        started = time.perf_counter()
        step = added = 0
        error = None
        if profile is not None:
            profile.enable()
        try:
            if waves is not None:
                waves.run(engine, lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                           detokenize=False),
                          on_step=lambda n: state.__setitem__("step", n))
                tokens, step = waves.tokens, waves.steps
            while pending or engine.has_unfinished_requests():
                if pending and not engine.has_unfinished_requests():
                    step = max(step, pending[0][0])  # idle until the next arrival: no step to run
                while pending and pending[0][0] <= step:
                    _, prompt, output = pending.popleft()
                    engine.add_request(f"r{added}", {"prompt_token_ids": prompt}, params[output])
                    added += 1
                if faults is not None:
                    if faults.active and modes.get(step - 1, "NONE") != "NONE":
                        faults.undo(step - 1)  # a graph replayed with the fault in place: its faulty step
                    if to_plant and step >= plant_at and not faults.active:
                        faults.plant(to_plant.pop(0), step)
                        plant_at = step + 40
                state["step"] = step
                if faults is not None and session is not None:
                    session.last_v2_step = None  # set again by this step's V2 replay, if it has one
                for output in engine.step():
                    segments.made(output.request_id, len(output.outputs[0].token_ids))
                    if output.finished:
                        tokens[output.request_id] = list(output.outputs[0].token_ids)
                if faults is not None and session is not None and session.last_v2_step is not None:
                    # a V2 replay seen before is counted in the dispatch hook, without session.step
                    modes.setdefault(step, session.last_v2_step.execution.cg_mode.name)
                step += 1
                segments.stepped(step)
                if step % 500 == 0:
                    splits.append(round(time.perf_counter() - started, 3))
        except Exception as exc:  # the uncaptured descriptor makes vLLM refuse the capture: expected
            error = f"{type(exc).__name__}: {exc}"
            result["stopped_by"] = {"step": step, "error": error[:2000]}
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        gc.callbacks.remove(collections_seen)
        result["gc"] = collections_seen.result()
        result["splits_s"] = splits
        if segments.every:
            result["segments"] = segments.result()
        if waves is not None:
            result["waves"] = waves.result()
        if clock is not None:
            clock.close()
            result["integration_clock"] = clock.result()
        if session is not None:
            result["closer_looks"] = session.looks()
        if profile is not None:
            profile.disable()
            result["profile"] = top_functions(profile)
        generated = sum(len(t) for t in tokens.values())
        result.update({
            "steps": step, "serve_s": round(seconds, 3), "output_tokens": generated,
            "tok_per_s": round(generated / seconds, 1) if seconds else None,
            "finished_requests": len(tokens),
            "tokens_sha256": hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest(),
            "cudagraph_stats": sorted([[*k, v] for k, v in stats.items()]),
            "violations": violations,
            "faults": faults.planted if faults else [],
            "steps_by_mode": dict(collections.Counter(modes.values())),  # steps the integration saw
        })
        if session is not None:
            session.close()
            result["recorder"] = {"url": session.recorder.url, "dropped": session.recorder.dropped}
        dump()
        touch(args.done_file)
        if args.multiproc:  # the engine core's process closes its recorder when vLLM shuts its worker down
            import threading

            closing = threading.Thread(target=engine.engine_core.shutdown, daemon=True)
            closing.start()
            closing.join(60)
        print(f"[vllm_serve {args.tag}] OK steps={step} tok/s={result['tok_per_s']} init={result['init_s']}s "
              f"violations={len(violations)} stopped_by={error}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the in-process engine keeps threads alive at exit
    except BaseException:
        result["traceback"] = traceback.format_exc()
        touch(args.ready_file)
        touch(args.done_file)
        dump()
        print(f"[vllm_serve {args.tag}] FAILED\n{result['traceback']}", flush=True)
        os._exit(1)


if __name__ == "__main__":
    main()
