"""The threads of one micro-batched step: one per ubatch, each inside its ``UBatchContext``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from capture_core.ubatch.context import UBatchAbortedError, UBatchContext, UBatchHandoverError


class UBatchThreads:
    """Run one callable per ubatch, each on its own thread inside its ``UBatchContext``.

    Split in two so graph capture can sit between the halves: ``start`` launches the threads and
    returns once all are parked at the barrier (each has run ``thread_setup`` first: CUDA context,
    device, grad mode); ``finish`` releases ubatch 0 and joins, returning the results in ubatch
    order, or raising the first real failure (not the aborts it caused in the other ubatches).
    """

    def __init__(
        self,
        contexts: Sequence[UBatchContext],
        work: Sequence[Callable[[], Any]],
        *,
        thread_setup: Callable[[UBatchContext], None] | None = None,
        name: str = "ubatch",
    ) -> None:
        if len(contexts) != len(work):
            raise ValueError(f"need one callable per ubatch: {len(contexts)} contexts, {len(work)} callables")
        if not contexts:
            raise ValueError("need at least one ubatch")
        self.ring = contexts[0].ring
        self.contexts = list(contexts)
        self.work = list(work)
        self.thread_setup = thread_setup
        self.results: list[Any] = [None] * len(contexts)
        self.errors: list[BaseException | None] = [None] * len(contexts)
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(len(contexts))
        ]
        self._started = False

    def _run(self, index: int) -> None:
        context = self.contexts[index]
        try:
            if self.thread_setup is not None:
                self.thread_setup(context)
            with context:
                self.results[index] = self.work[index]()
        except BaseException as exc:
            self.errors[index] = exc
            self.ring.abort(f"ubatch {index} failed: {exc!r}")

    def start(self) -> None:
        for thread in self.threads:
            thread.start()
        self._started = True
        try:
            self.ring.wait_at_barrier("main thread")
        except UBatchHandoverError:
            # A thread failed before the barrier (in its setup): its error is the one to report.
            for thread in self.threads:
                thread.join(self.ring.start_timeout)
            self._raise_first_failure()
            raise

    def finish(self, compute_stream: torch.cuda.Stream | None = None) -> list[Any]:
        if not self._started:
            raise RuntimeError("UBatchThreads.finish() before start()")
        self.ring.release(compute_stream)
        for index, thread in enumerate(self.threads):
            thread.join(self.ring.timeout)
            while thread.is_alive() and not self.ring.aborted:
                thread.join(self.ring.timeout)
            if thread.is_alive():
                # The ring was aborted and this thread is stuck in its own work, not at a hand-over.
                thread.join(self.ring.timeout)
                if thread.is_alive():
                    raise UBatchHandoverError(
                        f"{self.ring.abort_reason}; then ubatch {index} did not finish within "
                        f"{self.ring.timeout:g}s (stuck in its own work): its thread is left behind"
                    )
        self._raise_first_failure()
        return list(self.results)

    def run(self, compute_stream: torch.cuda.Stream | None = None) -> list[Any]:
        """``start`` then ``finish``: the non-graph path."""
        self.start()
        return self.finish(compute_stream)

    def _raise_first_failure(self) -> None:
        errors = [e for e in self.errors if e is not None]
        if not errors:
            return
        real = [e for e in errors if not isinstance(e, UBatchAbortedError)]
        raise (real or errors)[0]
