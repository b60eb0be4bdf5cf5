"""torch.compile's cudagraph trees, heard through their loggers: skips and re-records, with reasons.

Inductor says when it gives up on CUDA graphs only in a log line ("skipping cudagraphs due to
mutated inputs (1 instances)..." - a KV cache written in place is the classic case) and when it
re-records a graph only in a DEBUG line with the reason. The watch puts a filter on those two
loggers: a filter sees every record that reaches the logger before any handler, and it can let the
record through unchanged. To hear the DEBUG re-record lines the trees' logger is lowered to DEBUG;
the filter then drops the records the user did not ask for, so their console stays as it was.
``remove`` restores the levels and filters exactly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from inspector.watch.watcher import CompileEvent, CompileEventKind

SKIP_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"
"""Where ``log_cudagraph_skip_and_bump_counter`` writes "skipping cudagraphs due to ..." (WARNING)."""
OLDER_SKIP_LOGGER = "torch._inductor.cudagraph_utils.__perf_hints"
"""Where torch releases before the ``cudagraphs`` artifact wrote the same line."""
TREES_LOGGER = "torch._inductor.cudagraph_trees.__cudagraphs"
"""Where the cudagraph trees write "[id] Re-recording function=..., reason=..." (DEBUG)."""

SKIP_MARKER = "skipping cudagraph"
RERECORD_MARKER = "Re-recording function="
_RERECORD = re.compile(r"Re-recording function=(?P<function>.*?), mode=\w+, reason=(?P<reason>.*)", re.DOTALL)


class _Tap(logging.Filter):
    """Turns matching log records into CompileEvents; lets through what the user would have seen."""

    def __init__(self, emit: Callable[[CompileEvent], None], show_from_level: int) -> None:
        super().__init__("graph-inspector-watch")
        self.emit = emit
        self.show_from_level = show_from_level

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            event = compile_event_from_record(record)
            if event is not None:
                self.emit(event)
        except Exception:  # a malformed record must not break the compiler
            logging.getLogger(__name__).debug("could not read a cudagraph log record", exc_info=True)
        return record.levelno >= self.show_from_level


def compile_event_from_record(record: logging.LogRecord) -> CompileEvent | None:
    """A CompileEvent for a skip or re-record record, None for any other record.

    The template is checked before anything is formatted: the trees' logger also writes a DEBUG
    line per warm-up run once it is lowered to DEBUG, and those must stay cheap.
    """
    template = str(record.msg)
    if RERECORD_MARKER in template:
        message = record.getMessage()
        match = _RERECORD.search(message)
        return CompileEvent(
            kind=CompileEventKind.RERECORD,
            reason=(match["reason"].strip() if match else "") or "unknown",
            message=message,
            function=match["function"] if match else "",
            seen_at=record.created,
        )
    if SKIP_MARKER in template:
        message = record.getMessage()
        _, _, reason = message.partition("due to ")
        return CompileEvent(
            kind=CompileEventKind.SKIP,
            reason=(reason or message).strip().rstrip("."),
            message=message,
            seen_at=record.created,
        )
    return None


@dataclass
class _Installed:
    logger: logging.Logger
    tap: _Tap
    level: int


class CompileLogTap:
    """The filters on torch's cudagraph loggers, for one watch."""

    def __init__(self, emit: Callable[[CompileEvent], None]) -> None:
        self.emit = emit
        self._installed: list[_Installed] = []

    def install(self) -> None:
        self._add(SKIP_LOGGER, need_debug=False)
        self._add(OLDER_SKIP_LOGGER, need_debug=False)
        self._add(TREES_LOGGER, need_debug=True)

    def _add(self, name: str, *, need_debug: bool) -> None:
        logger = logging.getLogger(name)
        level = logger.level
        show_from = 0
        if need_debug and not logger.isEnabledFor(logging.DEBUG):
            show_from = logger.getEffectiveLevel()
            logger.setLevel(logging.DEBUG)
        tap = _Tap(self.emit, show_from)
        logger.addFilter(tap)
        self._installed.append(_Installed(logger, tap, level))

    def remove(self) -> None:
        while self._installed:
            item = self._installed.pop()
            item.logger.removeFilter(item.tap)
            item.logger.setLevel(item.level)
