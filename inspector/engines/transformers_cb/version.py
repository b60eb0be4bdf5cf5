"""Which transformers releases the continuous-batching integration reads, and the line that refuses
the others.

The integration reads transformers' own objects (``ModelRunner``, its inputs-and-outputs object and
their graph key), which transformers changes between releases without notice; so it attaches only to
release lines it was written against, and says so in one line for any other.
"""

from __future__ import annotations

SUPPORTED = ("5.17", "5.24", "5.25")
"""The release lines read line by line: 5.17 (the H200's), 5.24 and 5.25 (this project's test installs;
the registry's newest within the dev extra's bound, ``transformers>=5.24,<5.26``)."""

FALLBACK = (
    "`graph-inspector watch -- python your_script.py` still records its CUDA graphs, keyed by call "
    "site and shapes instead of transformers' own key, and without padding"
)


def release_line(version: str) -> str | None:
    """``5.17`` of ``5.17.0``, ``5.17.1`` or ``5.17.0.dev0``; None for what is not a version."""
    parts = version.strip().split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return f"{int(parts[0])}.{int(parts[1])}"


def refusal(version: str | None) -> str | None:
    """None when ``version`` (transformers' ``__version__``, None when it is not installed) is one
    the integration supports; else the one line that says why nothing was attached."""
    supported = ", ".join(SUPPORTED)
    if version is None:
        return (
            "graph-inspector: transformers is not installed here, so its continuous batching cannot "
            f"be attached to (supported releases: {supported})"
        )
    if release_line(version) in SUPPORTED:
        return None
    return (
        f"graph-inspector: transformers {version} is not a release its continuous-batching "
        f"integration supports ({supported}): not attached; {FALLBACK}"
    )
