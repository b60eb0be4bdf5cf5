"""Integrations with the engines users run: each one maps an engine's own graph decisions (its
descriptors, its runtime modes, its padded and unpadded token counts, its capture phase) onto the
recorder's events, through the engine's own extension points and without changing its behaviour.

- ``vllm``: vLLM 0.25's general plugin (``GRAPH_INSPECTOR_VLLM=<db>``), both model runners.
- ``transformers_cb``: Hugging Face transformers' continuous batching (``generate_batch`` and the
  manager it wraps) with its CUDA graphs: ``attach(db)`` in the program.
"""
