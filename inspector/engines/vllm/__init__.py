"""graph-inspector inside vLLM: vLLM's own CUDA graphs, steps and configuration recorded, and its
graphs' inputs checked at every replay, with no change to vLLM's code or behaviour.

Turn it on with one environment variable naming the database, in the environment vLLM starts in::

    GRAPH_INSPECTOR_VLLM=sqlite:///vllm-graphs.db vllm serve ...

vLLM runs the ``vllm.general_plugins`` entry points of installed packages in every process it starts
(the API server, the engine core, the workers); this package's entry point is ``register`` below. It
does nothing while ``GRAPH_INSPECTOR_VLLM`` is unset. With it set, it checks vLLM's version (it knows
vLLM 0.25.x; any other release is refused in one line that names ``graph-inspector watch`` instead),
installs the hooks (``hooks``) and the process that builds a model runner records (``session``).
``GRAPH_INSPECTOR_CHECKS=off`` records without checking vLLM's replays, ``=debug`` checks everything on
every replay and raises at the first finding (a test run); ``GRAPH_INSPECTOR_WINDOW=<seconds>`` sets how
often the recorder writes (default vLLM's stats interval, 10 s; at most 30 s); ``hooks.pause()`` and
``hooks.resume()`` take the integration out of an in-process engine and put it back between steps.
"""

from __future__ import annotations

import logging
import os

from inspector.engines.vllm.version import SUPPORTED, support_problem, vllm_version

ENV = "GRAPH_INSPECTOR_VLLM"
"""The environment variable that turns the integration on; its value is the database URL."""

log = logging.getLogger("graph_inspector.vllm")

__all__ = ["ENV", "SUPPORTED", "register"]


def register() -> None:
    """vLLM's general-plugin entry point: attach when ``GRAPH_INSPECTOR_VLLM`` names a database."""
    url = os.environ.get(ENV, "").strip()
    if not url:
        return
    _say_on_stderr()
    problem = support_problem(vllm_version())
    if problem is not None:
        log.warning("%s", problem)
        return
    from inspector.engines.vllm.hooks import install

    try:
        install(url)
    except Exception as exc:  # a plugin must never stop vLLM from starting
        log.warning("the vLLM integration could not attach (%s: %s); vLLM runs without it",
                    type(exc).__name__, exc)


def _say_on_stderr() -> None:
    """One line per message on stderr, as vLLM's own log lines are, whatever the root logger has."""
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s graph-inspector: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
