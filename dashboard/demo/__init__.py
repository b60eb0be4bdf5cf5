"""`graph-inspector demo`: the main job. Real traffic through the graph cache, recorded, then served.

It runs the reference decoder on real LLM-serving traffic (the Azure conversation trace replayed
through continuous batching with chunked prefill, from an engine that is already busy, so the token
count moves on nearly every step as in production) through the mixed-batch runner under a chosen
CUDA-graph mode: by default FULL graphs for pure-decode steps, PIECEWISE graphs for steps that
carry prompt chunks, eager (with the reason) above the largest capture size. It captures the graphs
with a progress bar, records everything into the inspector's database, plants one address drift
and one unexpected capture through the runner (labelled as injected, so nobody mistakes them for
real findings), prints what happened and serves the dashboard over it. ``--mode full_decode_only``
keeps the original decode-only demo (decode steps only, from a cold start, FULL graphs). On a host
without CUDA it says so and runs the eager backend, which keeps every capture, check and event
identical.

One module per job: ``options`` (defaults, limits, checks that combine options), ``workload`` (the
backend, the trace, the model's shape, the runner), ``traffic`` (the step loops and the planted
faults), ``console`` (what it prints), ``command`` (the order they run in). Only the product's
public API is used: the runner's steps and its ``inject_*`` faults, the recorder, the queries.
"""
