"""vLLM's own counts against graph-inspector's, for the same steps: what a vLLM run recorded (its
database) read back through `graph-inspector report --format json` and the daemon's `/metrics`,
against the ``CUDAGraphStat`` vLLM itself built for every step of that run (its
``--cudagraph-metrics``, collected by `bench/vllm_serve.py --cudagraph-metrics`).

Compared: steps and unpadded tokens per runtime mode (FULL, PIECEWISE, NONE = eager), and steps
per padded size. Runs on a CPU, on what the GPU run brought back.

usage: python3 bench/vllm_agreement.py --db sqlite:///v1-on.db --serve-json v1-on.json --out agreement.json
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dashboard.cli", *args], capture_output=True, text=True,
                          timeout=300)
    if done.returncode not in (0, 1):
        raise SystemExit(f"graph-inspector {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def vllm_counts(stats: list[list[Any]]) -> dict[str, Any]:
    """vLLM's CUDAGraphStat, as [unpadded, padded, mode, steps] rows: per mode and per padded size."""
    by_mode: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    by_size: dict[tuple[str, int], int] = collections.Counter()
    for unpadded, padded, mode, steps in stats:
        mode = str(mode).rsplit(".", 1)[-1].upper()
        by_mode[mode][0] += steps
        by_mode[mode][1] += unpadded * steps
        by_mode[mode][2] += (padded - unpadded) * steps
        if mode != "NONE":
            by_size[(mode, padded)] += steps
    return {"by_mode": dict(by_mode), "by_size": dict(by_size)}


def metric_counts(text: str) -> dict[str, Any]:
    """/metrics: replays per mode and size, real and padding tokens per mode, eager batches."""
    by_mode: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    by_size: dict[tuple[str, int], int] = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "graph_inspector_replays_total":
                mode = sample.labels["mode"].upper()
                by_mode[mode][0] += int(sample.value)
                by_size[(mode, int(sample.labels["captured_size"]))] += int(sample.value)
            elif sample.name == "graph_inspector_real_tokens_total":
                by_mode[sample.labels["mode"].upper()][1] += int(sample.value)
            elif sample.name == "graph_inspector_padding_tokens_total":
                by_mode[sample.labels["mode"].upper()][2] += int(sample.value)
            elif sample.name == "graph_inspector_eager_fallbacks_total":
                by_mode["NONE"][0] += int(sample.value)
    return {"by_mode": dict(by_mode), "by_size": dict(by_size)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="the vLLM run's database URL")
    parser.add_argument("--serve-json", required=True, help="bench/vllm_serve.py's result for that run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    served = json.loads(Path(args.serve_json).read_text())
    if not served.get("cudagraph_stats"):
        raise SystemExit(f"{args.serve_json} has no CUDAGraphStat (from vllm_serve.py --cudagraph-metrics)")
    cli("db", "upgrade", "--db", args.db)
    vllm = vllm_counts(served["cudagraph_stats"])
    metrics = metric_counts(cli("serve", "--db", args.db, "--get", "/metrics"))
    (run,) = json.loads(cli("report", "--db", args.db, "--format", "json"))["runs"]
    traffic = run["traffic"]
    report = {"replays": traffic["replays"], "eager_batches": traffic["eager_batches"],
              "num_real_tokens": traffic["num_real_tokens"], "padding_tokens": traffic["padding_tokens"]}
    graphed = {m: v for m, v in vllm["by_mode"].items() if m != "NONE"}
    rows = []
    for mode in sorted(set(vllm["by_mode"]) | set(metrics["by_mode"])):
        ours = metrics["by_mode"].get(mode, [0, 0, 0])
        theirs = vllm["by_mode"].get(mode, [0, 0, 0])
        graph = mode != "NONE"  # /metrics counts the real and padding tokens of replays
        rows.append({"mode": mode, "vllm_steps": theirs[0], "metrics_steps": ours[0],
                     "vllm_unpadded_tokens": theirs[1], "metrics_real_tokens": ours[1] if graph else None,
                     "vllm_paddings": theirs[2], "metrics_padding_tokens": ours[2] if graph else None})
    sizes_agree = {f"{m}:{s}": n for (m, s), n in vllm["by_size"].items()} == {
        f"{m}:{s}": n for (m, s), n in metrics["by_size"].items()}
    result = {
        "by_mode": rows,
        "sizes": len(vllm["by_size"]),
        "every_size_agrees": sizes_agree,
        "report": report,
        "report_agrees": report == {  # the report's tokens are the replays' (the glossary's)
            "replays": sum(v[0] for v in graphed.values()),
            "eager_batches": vllm["by_mode"].get("NONE", [0])[0],
            "num_real_tokens": sum(v[1] for v in graphed.values()),
            "padding_tokens": sum(v[2] for v in graphed.values())},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| mode | vLLM steps | /metrics steps | vLLM unpadded tokens | /metrics real tokens | "
          "vLLM paddings | /metrics padding tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['vllm_steps']} | {r['metrics_steps']} | {r['vllm_unpadded_tokens']} | "
              f"{r['metrics_real_tokens']} | {r['vllm_paddings']} | {r['metrics_padding_tokens']} |")
    print(f"per padded size ({result['sizes']} sizes): {'identical' if sizes_agree else 'DIFFERENT'}; "
          f"report {report}: {'agrees' if result['report_agrees'] else 'DIFFERS'}")
    return 0 if sizes_agree and result["report_agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
