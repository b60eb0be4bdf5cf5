"""What ``fork()`` does to recorders, and what they do about it (``os.register_at_fork``).

A forked child is a copy of the parent's memory with one thread, the one that forked. A recorder
in it has no flush thread; its locks are copies, possibly of locks held; its database connections
are the parent's. Used as they are, what the child reports is lost without a count. Worse for a
SQLite file: SQLite keeps one record per process of the locks its connections hold on a file, so a
child that inherits the parent's open connections believes their locks its own. A recorder the
child starts for itself then takes no file lock of its own (the parent, closing its last
connection, deletes the write-ahead log under it: its writes are lost), or waits for ever on a
write lock the parent's flush held at the fork. So:

- **Before a fork**, each recording recorder's flush thread is held between two transactions (its
  ``gate``, held around every database write; ``FORK_WAIT_S`` at most), so nothing of it is inside
  SQLite or SQLAlchemy, holding their locks, when the child is made.
- **In the parent**, the gates are let go at once.
- **In the child**, a recorder that was recording carries on as the child's own: a new run (this
  pid), counting from what its counters held at the fork, with new locks, a new flush thread and
  connections of its own; the parent's connections are let go without touching the parent's
  (``Store.let_go_after_fork``). A recorder on a SQLite file whose write could not be held at the
  fork (one taking longer than ``FORK_WAIT_S``: SQLite waits 5 s at most for a lock) is inert in the
  child, since the connection in use cannot be closed there: it says so once, and what the child
  reports to it is counted as lost (in the log, and the file's sidecar) when the child exits. (On
  PostgreSQL the parent's connection in use is simply left alone, and the child carries on.) A
  recorder closed before the fork stays closed, and counts what the child reports to it the same
  way.

A child started by ``multiprocessing`` ends with ``os._exit``, past the exit hooks, so a recorder
in one is also closed by ``multiprocessing``'s own finalizers. A ``spawn``ed child is a new
interpreter: it starts its own recorder, and a Recorder cannot be pickled into it.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar


class ForkAware(Protocol):
    """What a fork asks of a recorder (``Recorder`` is one; this module imports none, so that the
    recorder's module, which imports this one, is imported by nothing it imports)."""

    def hold_for_fork(self, timeout: float) -> bool: ...

    def release_after_fork(self) -> None: ...

    def carry_into_child(self, parent: int, *, quiesced: bool) -> None: ...


R = TypeVar("R", bound=ForkAware)

FORK_WAIT_S = 10.0
"""How long a fork waits for a write under way to end (a SQLite write waits 5 s at most for its
lock, ``store.BUSY_TIMEOUT_MS``); past it the fork goes on."""
EXIT_PRIORITY = 10
"""``multiprocessing``'s finalizers with a priority run first, highest first, before it joins its
own children."""

_recorders: weakref.WeakSet[ForkAware] = weakref.WeakSet()
"""Every recorder started in this process (closed ones too)."""
_held: list[ForkAware] = []
"""The recorders whose gates ``_before`` holds, until the fork is made."""


def track(recorder: ForkAware) -> None:
    _recorders.add(recorder)


def on_exit(close: Callable[[], None]) -> Callable[[], None]:
    """In a ``multiprocessing`` child, which ends with ``os._exit`` past the interpreter's exit
    hooks, have ``close`` run by its finalizers; returns what cancels that (elsewhere, a no-op: the
    recorder's own exit hooks run)."""
    process = sys.modules.get("multiprocessing.process")
    if process is None or process.parent_process() is None:
        return _nothing
    from multiprocessing.util import Finalize

    return Finalize(None, close, exitpriority=EXIT_PRIORITY).cancel


def once_started(recorder: R, set_up: Callable[[R], None]) -> None:
    """In a child just forked: ``set_up(recorder)`` once ``multiprocessing`` has started the child
    (it clears the finalizers it inherited after the fork, then runs its after-fork hooks)."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util.register_after_fork(recorder, set_up)


def _nothing() -> None:
    pass


def _before() -> None:
    deadline = time.monotonic() + FORK_WAIT_S
    for recorder in list(_recorders):
        if recorder.hold_for_fork(max(0.0, deadline - time.monotonic())):
            _held.append(recorder)


def _after_in_parent() -> None:
    for recorder in _held:
        recorder.release_after_fork()
    _held.clear()


def _after_in_child() -> None:
    held = {id(recorder) for recorder in _held}
    _held.clear()
    parent = os.getppid()
    for recorder in list(_recorders):
        recorder.carry_into_child(parent, quiesced=id(recorder) in held)


os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
