"""A run whose every text field is a megabyte, written the way an engine writes it: through the
Recorder (run label and config, a capture's input names and wrapper, a violation's message, stack
and input name) and the watch's flusher (a torch.compile re-record's reason and message).

For the long-text page tests and bench/long_text_pages.py: the pages must cut such text for
display, stay fast, and still let a reader fetch all of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from capture_core.descriptor import BatchDescriptor
from capture_core.events import CaptureEvent, ViolationEvent, ViolationKind
from capture_core.modes import CUDAGraphMode
from inspector.reading.queries import Queries
from inspector.recording.recorder import Recorder
from inspector.storage.store import open_store
from inspector.watch.flush import WatchFlusher
from inspector.watch.watcher import CompileEvent, CompileEventKind

MB = 1_000_000
UNBROKEN_MARK = "<b>long</b>"
"""Opens each unbroken field: markup that must come out as text, wherever the field is cut."""
HARD_LETTERS = [chr(c) for c in range(0x0627, 0x064B)] + ["\U0001f680", "\u0301"]
"""Arabic letters, with now and then an emoji and a combining accent: text the browser must shape
(joining forms, fallback fonts). Without a space it cannot be broken into lines either. A million
such characters kept a tab blank for minutes; as many ASCII letters take Chromium about a second."""


@dataclass(frozen=True)
class LongTextRun:
    """The ids of what was planted, and the planted texts themselves."""

    run_id: int
    graph_id: int
    violation_id: int
    compile_id: int
    message: str
    stack: str
    input_name: str


def unbroken(size: int, tag: str) -> str:
    """``size`` characters without a space or line break: the hardest text to lay out (the same
    text for the same ``tag``)."""
    head = f"{UNBROKEN_MARK}{tag}:"
    letters = random.Random(tag).choices(HARD_LETTERS, k=max(0, size - len(head)))
    return head + "".join(letters)


def traceback_lines(size: int) -> str:
    """``size`` characters of a deep traceback (a recursion gone wrong), line by line."""
    frame = '  File "serve_llm/model.py", line {n}, in forward\n    return self.layers[{n}](hidden)\n'
    lines, length, n = ["Traceback (most recent call last):\n"], 0, 0
    while length < size:
        lines.append(frame.format(n=n))
        length += len(lines[-1])
        n += 1
    return "".join(lines)[:size]


def plant_long_text(url: str, size: int = MB) -> LongTextRun:
    """Record one run with ``size``-character fields into the database at ``url``."""
    message, stack = unbroken(size, "message"), traceback_lines(size)
    input_name = unbroken(size, "input")
    descriptor = BatchDescriptor(8, uniform=True)
    recorder = Recorder(url, label=unbroken(size, "label"), config={"note": unbroken(size, "config")},
                        flush_interval=0.2).start()
    try:
        recorder.on_capture(CaptureEvent(
            descriptor=descriptor, mode=CUDAGraphMode.FULL, backend="eager",
            wrapper=unbroken(size, "wrapper"), input_names=(input_name, "positions"),
            input_addresses=(0x7F3A2C000400, 0x7F3A2C000800), capture_seconds=0.01, pool_bytes=0,
            warmup_iters=1,
        ))
        recorder.on_replay(CUDAGraphMode.FULL, descriptor, 5)
        recorder.on_violation(ViolationEvent(
            kind=ViolationKind.ADDRESS_DRIFT, descriptor=descriptor, mode=CUDAGraphMode.FULL,
            wrapper=unbroken(size, "violation wrapper"), message=message, input_name=input_name,
            expected_address=0x7F3A2C000400, actual_address=0x7F3A2C9F0400, stack=stack,
        ))
        assert recorder.flush(timeout=60), "the recorder did not flush the long-text run"
        watch = WatchFlusher(recorder, [])
        reason = unbroken(size, "reason")  # as the watch's capture hook reports a re-record
        watch.add_compile_event(CompileEvent(CompileEventKind.RERECORD, reason,
                                             f"[0/0] torch.compile re-recorded forward: {reason}", "forward"))
        watch.close()
        run_id = recorder.run_id
        assert run_id is not None
    finally:
        recorder.close()
    store = open_store(url, upgrade=False)
    try:
        queries = Queries(store.engine)
        (graph,) = queries.graphs(run_id=run_id).items
        (violation,) = queries.violations(run_id=run_id).items
        (compiled,) = queries.compile_events(run_id=run_id).items
    finally:
        store.dispose()
    return LongTextRun(run_id, graph["id"], violation["id"], compiled["id"], message, stack, input_name)
