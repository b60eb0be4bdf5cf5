"""Turn a folder of benchmark JSON into the Markdown that BENCHMARKS.md holds.

After ``bench/run_gpu.sh bench/results/h200`` this prints, from the JSON alone, one table row per
benchmark (command, machine, date, headline figures, targets met or missed and by how much) and
the detail tables of the decode, overhead and capture benchmarks, so that no figure is copied by
hand. Benchmarks it does not know in detail still get their row from their ``targets``.

    python3 bench/summarize.py bench/results/h200 > /tmp/h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MIB = 2**20


def load(folder: Path) -> list[dict[str, Any]]:
    """Every benchmark JSON in ``folder`` (files that are not one are skipped with a warning)."""
    payloads = []
    for path in sorted(folder.glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"warning: skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(payload, dict) and "benchmark" in payload:
            payload["_file"] = path.name
            payloads.append(payload)
    return payloads


def machine_text(machine: dict[str, Any]) -> str:
    """``NVIDIA H200, CUDA 13.0, torch 2.11.0, Python 3.12.3`` (or the CPU host's fields)."""
    parts = []
    if machine.get("gpu"):
        parts.append(str(machine["gpu"]))
        if machine.get("cuda"):
            parts.append(f"CUDA {machine['cuda']}")
    cpus = machine.get("cpu_count")
    model = machine.get("cpu_model") or ("CPU" if not machine.get("gpu") else "")
    if model:  # host-time figures depend on the CPU, on a GPU machine too
        parts.append(f"{model} ({cpus} cores)" if cpus else model)
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    if machine.get("python"):
        parts.append(f"Python {machine['python']}")
    if machine.get("git_commit"):
        parts.append(f"commit {machine['git_commit']}")
    return ", ".join(parts) or "unknown"


def date_text(payload: dict[str, Any]) -> str:
    machine = payload.get("machine", {})
    stamp = machine.get("date_utc") or payload.get("date") or ""
    return str(stamp)[:10] or "unknown"


def target_text(targets: Iterable[dict[str, Any]]) -> str:
    """Each target as ``name: value (met < limit)`` / ``MISSED by x`` / ``n/a``."""
    parts = []
    for t in targets:
        value, limit, unit = t.get("value"), t.get("limit"), t.get("unit", "")
        shown = "-" if value is None else f"{_num(value)}{unit.strip()}"
        if t.get("met") is None:
            verdict = "n/a"
        elif t["met"]:
            verdict = f"met, < {_num(limit)}{unit.strip()}"
        else:
            verdict = f"**MISSED** (limit {_num(limit)}{unit.strip()}, over by {_num(value - limit)})"
        parts.append(f"{t['name']}: {shown} ({verdict})")
    return "; ".join(parts) or "-"


def _num(value: Any) -> str:
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.3g}"
        return f"{value:.3g}"
    return str(value)


def headline(payload: dict[str, Any]) -> str:
    """The few figures a reader wants first, per known benchmark."""
    name, results = payload["benchmark"], payload.get("results")
    if name == "gpu_decode" and results:
        parts = []
        for r in results:
            first, last = r["sizes"][0], r["sizes"][-1]
            base = first["baseline"]
            worst = max(s["ratio_to_baseline"]["runner"] for s in r["sizes"])
            text = (
                f"{r['model']}: {base} {_num(first['variants'][base]['median_ms'])} ms at batch "
                f"{first['batch']}, {_num(last['variants'][base]['median_ms'])} ms at {last['batch']}; "
                f"runner+recorder/{base} worst {_num(worst)}x"
            )
            for peer in ("eager", "compile"):
                if peer != base and peer in first["ratio_to_baseline"]:
                    ratio = _num(first["ratio_to_baseline"][peer])
                    text += f"; {peer}/{base} {ratio}x at batch {first['batch']}"
            if "compile" in r:
                c = r["compile"]
                text += (
                    f"; torch.compile captured {c['graphs_captured']} graphs, {c['cudagraph_skips']} skips"
                )
            parts.append(text)
        return "<br>".join(parts)
    if name == "gpu_ubatch" and results:
        return _ubatch_headline(payload)
    if name == "gpu_overhead" and results:
        return "; ".join(
            f"{r['variant']} {_num(r['median_us'])} us (+{_num(r['added_us'])})" for r in results
        )
    if name == "gpu_capture" and results:
        parts = []
        for r in results:
            text = f"{r['model']}: capture core {_num(r['core_capture_s_median'])} s"
            if "bare_capture_s_median" in r:
                text += f" vs bare {_num(r['bare_capture_s_median'])} s ({_num(r['time_ratio'])}x)"
            memory = r.get("memory", {}).get("core")
            if memory:
                text += (
                    f"; shared pool {_num(memory['shared_pool_bytes'] / MIB)} MiB, pool per graph "
                    f"{_num(memory['pool_per_graph_bytes'] / MIB)} MiB, largest alone "
                    f"{_num(memory['largest_graph_alone_bytes'] / MIB)} MiB"
                )
            parts.append(text)
        return "<br>".join(parts)
    if name == "padding":
        return _padding_headline(payload)
    if name == "check_cost" and isinstance(results, list):
        parts = []
        for r in results:
            if "wrapper_ns_per_call" in r:
                text = f"{r['what']}: {_num(r['wrapper_ns_per_call'] / 1e3)} us"
                if "check_ns_per_call" in r:
                    text += f" (check {_num(r['check_ns_per_call'] / 1e3)} us)"
            else:
                text = f"{r['what']}: check {_num(r['check_ns_per_call'] / 1e3)} us"
            parts.append(text)
        return "; ".join(parts)
    if name == "recorder_bench" and isinstance(results, dict):
        hot = results.get("hot_path", {})
        parts = [f"{k} {_num(v['median_ns'])} ns" for k, v in hot.items()]
        if "events_per_s" in results:
            parts.append(f"{_num(results['events_per_s'])} replay events/s")
        if "flush" in results:
            parts.append(f"flush {_num(results['flush']['rows_per_s_median'])} rows/s")
        if "scrape" in results:
            scrape = results["scrape"]
            parts.append(f"scrape {_num(scrape['seconds_median'] * 1e3)} ms at {scrape['windows']:,} windows")
        return "; ".join(parts)
    if name in ("dashboard", "dashboard_bench") and isinstance(results, dict) and "endpoints" in results:
        return "p95: " + "; ".join(
            f"{e['path']} {_num(e['p95_ms'])} ms" for e in results["endpoints"].values()
        )
    return "see the JSON" if not payload.get("targets") else "see targets"


def _padding_headline(payload: dict[str, Any]) -> str:
    def pct(value: float) -> str:
        return f"{100 * value:.1f}%"

    parts = []
    combined = payload.get("trace_combined")
    if combined:
        pow2, vllm = pct(combined["pow2"]["padding_waste"]), pct(combined["vllm"]["padding_waste"])
        parts.append(f"trace, all speedups: waste pow2 {pow2} vs vLLM list {vllm}")
    mixed = payload.get("mixed")
    if mixed:
        pow2, vllm = mixed["pow2"], mixed["vllm"]
        parts.append(
            f"chunked prefill: waste {pct(pow2['padding_waste'])} vs {pct(vllm['padding_waste'])}, "
            f"hit rate {pct(pow2['hit_ratio'])} vs {pct(vllm['hit_ratio'])}"
        )
    uniform = payload.get("uniform")
    if uniform:
        pow2, vllm = uniform["pow2"], uniform["vllm"]
        parts.append(
            f"uniform: pow2 {pct(pow2['padding_waste'])} (exact {pct(pow2['exact_padding_waste'])}), "
            f"vLLM {pct(vllm['padding_waste'])} (exact {pct(vllm['exact_padding_waste'])})"
        )
    return "; ".join(parts) or "see the JSON"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_num(c) if c is not None else "-" for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ubatch_headline(payload: dict[str, Any]) -> str:
    """The comm case where micro-batching gained most: overlapped against in line and not split."""
    cases = [c for c in payload["results"].get("cases", []) if c.get("overlap")]
    if not cases:
        return "see targets"
    best = min(cases, key=lambda c: c["overlap"]["overlapped_vs_in_line"])
    ms = {name: v["median_ms"] for name, v in best["step_ms"].items()}
    text = (
        f"{payload['config']['model']}, {best['case']} per exchange: ubatched overlapped "
        f"{_num(ms['ubatched, overlapped'])} ms vs in line {_num(ms['ubatched, in line'])} ms vs not "
        f"split {_num(ms['whole, in line'])} ms; comm hidden {_num(best['overlap']['comm_hidden_fraction'])}"
    )
    seen = best.get("profile", {}).get("ubatched, overlapped", {}).get("comm_hidden_fraction")
    return text + (f" (profiler: {_num(seen)})" if seen is not None else "")


def _ubatch_rows(payload: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows = []
    for c in payload["results"]["cases"]:
        ms = {name: v["median_ms"] for name, v in c["step_ms"].items()}
        overlap = c.get("overlap", {})
        seen = c.get("profile", {}).get("ubatched, overlapped", {})
        control = c.get("profile", {}).get("ubatched, in line", {})
        rows.append(
            (
                c["case"],
                ms.get("whole, compute only"),
                ms.get("whole, in line"),
                ms.get("ubatched, compute only"),
                ms.get("ubatched, in line"),
                ms.get("ubatched, overlapped"),
                overlap.get("comm_hidden_fraction"),
                seen.get("comm_hidden_fraction"),
                control.get("comm_under_compute_us"),
                c["equality"]["equal_to_eager"],
            )
        )
    return rows


def _runner_host_added(size: dict[str, Any]) -> float | None:
    host = size.get("host_us_per_step", {})
    return host["runner"] - host["bare"] if "runner" in host and "bare" in host else None


def details(payload: dict[str, Any]) -> str:
    """The full tables of the benchmarks written in this folder's style."""
    name, results = payload["benchmark"], payload.get("results") or []
    blocks = []
    if name == "gpu_decode":
        for r in results:
            names = list(dict.fromkeys(n for s in r["sizes"] for n in s["variants"]))
            base = r["sizes"][0]["baseline"]
            rows = [
                (
                    s["batch"],
                    *(s["variants"].get(n, {}).get("median_ms") for n in names),
                    *(s["ratio_to_baseline"].get(n) for n in names if n != base),
                    _runner_host_added(s),
                    s.get("check_host_pct_of_step"),
                )
                for s in r["sizes"]
            ]
            headers = [
                "batch",
                *(f"{n} ms" for n in names),
                *(f"{n}/{base}" for n in names if n != base),
                "runner host +us",
                "check %",
            ]
            blocks.append(
                f"Decode step, {r['model']} ({r['params'] / 1e6:.1f}M params)\n\n"
                + markdown_table(headers, rows)
            )
            if "compile" in r and r["compile"]["skip_reasons"]:
                reasons = "\n".join(f"- `{reason}`" for reason in r["compile"]["skip_reasons"])
                blocks.append(f"torch.compile skip reasons ({r['model']}):\n\n{reasons}")
    elif name == "gpu_ubatch" and "cases" in (payload.get("results") or {}):
        c = payload["config"]
        headers = [
            "comm per exchange",
            "whole, compute ms",
            "whole, in line ms",
            "ubatched, compute ms",
            "ubatched, in line ms",
            "ubatched, overlapped ms",
            "hidden (step times)",
            "hidden (profiler)",
            "in-line graph: comm under compute us",
            "equal to eager",
        ]
        blocks.append(
            f"Micro-batching, {c['model']} ({c['params'] / 1e6:.1f}M params), {c['tokens']} tokens in "
            f"{c['num_ubatches']} ubatches (medians)\n\n" + markdown_table(headers, _ubatch_rows(payload))
        )
    elif name == "gpu_overhead":
        rows = [(r["variant"], r["median_us"], r["p10_us"], r["p90_us"], r["added_us"]) for r in results]
        blocks.append(
            "Wrapper overhead (host us per call)\n\n"
            + markdown_table(["variant", "median us", "p10 us", "p90 us", "added us"], rows)
        )
    elif name == "gpu_capture":
        rows = []
        for r in results:
            for side, m in r.get("memory", {}).items():
                rows.append(
                    (
                        r["model"],
                        side,
                        m["shared_pool_bytes"] / MIB,
                        m["pool_per_graph_bytes"] / MIB,
                        m["largest_graph_alone_bytes"] / MIB,
                        m["shared_over_largest"],
                    )
                )
        if rows:
            blocks.append(
                "Graph pool memory (MiB)\n\n"
                + markdown_table(
                    ["model", "capture", "shared", "pool per graph", "largest alone", "shared/largest"], rows
                )
            )
    return "\n\n".join(blocks)


def summarize(payloads: Sequence[dict[str, Any]]) -> str:
    rows = [
        (
            p["benchmark"],
            f"`{p.get('command', '?')}`",
            machine_text(p.get("machine", {})),
            date_text(p),
            headline(p),
            target_text(p.get("targets", [])),
        )
        for p in payloads
    ]
    text = markdown_table(["benchmark", "command", "machine", "date (UTC)", "figures", "targets"], rows)
    extra = [d for d in (details(p) for p in payloads) if d]
    notes = [f"- {p['benchmark']}: {note}" for p in payloads for note in p.get("notes", [])]
    if notes:
        extra.append("Notes\n\n" + "\n".join(notes))
    return "\n\n".join([text, *extra]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder of benchmark JSON (e.g. bench/results/h200)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder of benchmark results", file=sys.stderr)
        return 2
    payloads = load(args.folder)
    if not payloads:
        print(f"error: no benchmark JSON in {args.folder}", file=sys.stderr)
        return 2
    print(summarize(payloads), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
