"""A tiny progress bar for capturing graphs at start-up (stdlib only, to stderr).

Capturing dozens of graphs takes seconds to minutes; a silent start-up looks like a hang. On a
terminal the bar redraws one line; in logs (stderr not a TTY) it writes one line per item, which
stays readable in CI output and ``kubectl logs``.
"""

from __future__ import annotations

import sys
from typing import TextIO

BAR_WIDTH = 20


class ProgressBar:
    """``Capturing graphs [#####.....] 12/35 FULL tokens=64``."""

    def __init__(
        self, total: int, label: str = "Capturing graphs", stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.done = 0
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty())

    def render(self, detail: str = "") -> str:
        filled = BAR_WIDTH * self.done // self.total if self.total else BAR_WIDTH
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        text = f"{self.label} [{bar}] {self.done}/{self.total}"
        return f"{text} {detail}" if detail else text

    def advance(self, detail: str = "") -> None:
        """Count one item done and show it."""
        self.done += 1
        if not self.enabled:
            return
        if self.interactive:
            # Pad with spaces so a shorter line fully covers the previous one.
            self.stream.write("\r" + self.render(detail).ljust(79))
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(self.render(detail) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the line if the bar stopped early (an error part-way through)."""
        if self.enabled and self.interactive and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
