"""Which vLLM releases the integration knows: it patches vLLM's internals by name, so it attaches
only to a release series it was written and tested against, and says so in one line otherwise."""

from __future__ import annotations

SUPPORTED_SERIES = (0, 25)
SUPPORTED = "vLLM 0.25.x (tested on 0.25.1, with both model runners, V2 and V1)"


def vllm_version() -> str | None:
    """The installed vLLM's version, or None where vLLM is not installed."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def support_problem(version: str | None) -> str | None:
    """Why the integration will not attach to ``version`` (one line), or None when it will."""
    if version is None:
        return f"vLLM is not installed; the vLLM integration supports {SUPPORTED}"
    parts = version.split(".")
    try:
        series = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        series = None
    if series == SUPPORTED_SERIES:
        return None
    return (
        f"vLLM {version} is not supported by the vLLM integration, which supports "
        f"{SUPPORTED}; nothing is recorded in this process. Record any engine's CUDA graphs with "
        "`graph-inspector watch -- <your command>` instead."
    )
