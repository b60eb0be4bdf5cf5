"""torch.compile's decision to skip CUDA graphs, heard through its log line, with the reason.

Inductor says when it gives up on CUDA graphs only in a WARNING ("skipping cudagraphs due to
mutated inputs (1 instances)..." - a KV cache written in place is the classic case). The watch puts
a filter on that logger: a filter sees every record that reaches the logger before any handler,
and lets it through unchanged. No level is changed, so torch runs exactly the code it runs
unwatched (re-records are read off the cudagraph trees' frames instead, see ``trees.py``: lowering
the trees' logger to DEBUG makes torch build a debug message that fails at batch 32 with torch 2.11).
``remove`` takes the filters off again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from inspector.watch.watcher import CompileEvent, CompileEventKind

SKIP_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"
"""Where ``log_cudagraph_skip_and_bump_counter`` writes "skipping cudagraphs due to ..." (WARNING)."""
OLDER_SKIP_LOGGER = "torch._inductor.cudagraph_utils.__perf_hints"
"""Where torch releases before the ``cudagraphs`` artifact wrote the same line."""

SKIP_MARKER = "skipping cudagraph"


class _Tap(logging.Filter):
    """Turns skip records into CompileEvents; lets every record through."""

    def __init__(self, emit: Callable[[CompileEvent], None]) -> None:
        super().__init__("graph-inspector-watch")
        self.emit = emit

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            event = compile_event_from_record(record)
            if event is not None:
                self.emit(event)
        except Exception:  # a malformed record must not break the compiler
            logging.getLogger(__name__).debug("could not read a cudagraph log record", exc_info=True)
        return True


def compile_event_from_record(record: logging.LogRecord) -> CompileEvent | None:
    """A CompileEvent for a skip record, None for any other record (checked on the template,
    before anything is formatted)."""
    if SKIP_MARKER not in str(record.msg):
        return None
    message = record.getMessage()
    _, _, reason = message.partition("due to ")
    return CompileEvent(
        kind=CompileEventKind.SKIP,
        reason=(reason or message).strip().rstrip("."),
        message=message,
        seen_at=record.created,
    )


class CompileLogTap:
    """The filters on torch's skip loggers, for one watch."""

    def __init__(self, emit: Callable[[CompileEvent], None]) -> None:
        self.emit = emit
        self._installed: list[tuple[logging.Logger, _Tap]] = []

    def install(self) -> None:
        for name in (SKIP_LOGGER, OLDER_SKIP_LOGGER):
            logger, tap = logging.getLogger(name), _Tap(self.emit)
            logger.addFilter(tap)
            self._installed.append((logger, tap))

    def remove(self) -> None:
        while self._installed:
            logger, tap = self._installed.pop()
            logger.removeFilter(tap)
