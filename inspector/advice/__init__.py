"""Advice: the capture sizes recorded traffic wants, under a graph, time or memory budget.

``sizes`` holds the optimiser (exact, over the batch-size histogram), ``costs`` the capture-time
and pool-memory models fitted to recorded graphs, ``recommend`` the advice (how many sizes, which,
and what they change against the current ones), ``render`` its text, JSON and engine config lines.
Standard library only: the command, the daemon and the benchmarks all call it.
"""
