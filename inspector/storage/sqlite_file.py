"""A SQLite database is files, and files go wrong under a running process: corrupted, deleted or
replaced, made read-only or immutable. What the store checks, and how, so that none of it costs
data or the engine's life (``inspector.storage.store`` raises the errors):

- **not a file**: a path that is a directory, a device, a FIFO, a socket or a symlink loop is
  refused before SQLite opens it (it would open ``/dev/null`` as an empty database and make a
  ``-journal`` beside it);
- **corruption**: ``PRAGMA quick_check`` (every page of every table and index read once, no index
  cross-check) before anything writes to or reports from a file;
- **deleted or replaced**: the file's (device, inode) when opened against now, before and after
  every commit: an open connection writes on into a deleted file without an error;
- **unwritable**: the database, its write-ahead log and its shared-memory index must be writable
  before a transaction maps and writes them. The index is written through a memory mapping, and a
  write into the mapping of a file made immutable (``chattr +i``, which even root cannot write) is
  answered by the kernel with SIGBUS, which kills the process whatever Python does. So the checks
  come first, and a connection to such files is never closed (closing the last one checkpoints,
  which writes the index): ``GuardedConnection`` keeps it open for the life of the process, and the
  kernel unmaps it at exit, writing nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("graph_inspector.store")

SUFFIXES = ("", "-wal", "-shm")
"""The database, its write-ahead log and its shared-memory index."""
QUICK_CHECK_ROWS = 20
"""Problems ``quick_check`` lists at most (it reads the whole file whatever the number)."""


@dataclass(frozen=True)
class FileIdentity:
    device: int
    inode: int


def identity(path: Path) -> FileIdentity | None:
    """The file's (device, inode), None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileIdentity(st.st_dev, st.st_ino)


_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
              (stat.S_ISSOCK, "a socket"))


def not_a_file(path: Path) -> str | None:
    """What ``path`` is when it cannot hold a database: ``a directory``, ``a character device``, ``a
    symlink loop``... None for a regular file, or nothing there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "a symlink loop"
        if error.errno == errno.ENOTDIR:
            return "under something that is not a directory"
        return None  # what SQLite makes of it (permission denied, say) is told as its error
    for kind, name in _NOT_FILES:
        if kind(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def unwritable_files(path: Path) -> list[Path]:
    """Those of the database's files that exist and this process may not write (read-only, or
    immutable: ``access(2)`` refuses an immutable file's write even to root)."""
    found = []
    for suffix in SUFFIXES:
        name = Path(f"{path}{suffix}")
        if not os.access(name, os.W_OK) and os.path.lexists(name):
            found.append(name)
    return found


def quick_check(connection: Any) -> list[str]:
    """What SQLite's ``quick_check`` finds wrong in the database of ``connection`` (a DB-API or
    SQLAlchemy connection): nothing when the file is sound."""
    if isinstance(connection, sqlite3.Connection):
        rows = connection.execute(f"PRAGMA quick_check({QUICK_CHECK_ROWS})").fetchall()
    else:
        rows = connection.exec_driver_sql(f"PRAGMA quick_check({QUICK_CHECK_ROWS})").fetchall()
    problems = [line for (text,) in rows for line in str(text).splitlines()]
    return [] if problems == ["ok"] else [p for p in problems if not p.startswith("*** in database")]


_abandoned: list[sqlite3.Connection] = []


class GuardedConnection(sqlite3.Connection):
    """A SQLite connection that stays open while its database's files cannot be written (see the
    module's doc); everything else is sqlite3's own."""

    def __init__(self, database: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(database, *args, **kwargs)
        text = os.fsdecode(database) if isinstance(database, (str, bytes, os.PathLike)) else ""
        self._guarded = None if text in ("", ":memory:") or text.startswith("file:") else Path(text)

    def close(self) -> None:
        if not self._stays_open():
            super().close()
            self._guarded = None

    def __del__(self) -> None:
        self._stays_open()

    def _stays_open(self) -> bool:
        guarded = getattr(self, "_guarded", None)
        if guarded is None or not unwritable_files(guarded):
            return False
        if not any(kept is self for kept in _abandoned):
            _abandoned.append(self)
            _immortal(self)
            log.warning(
                "graph-inspector: %s cannot be written (read-only or immutable); a connection to it "
                "stays open until the process exits, since closing it would write to it", guarded,
            )
        return True


def _immortal(obj: object) -> None:
    """One reference that is never given back: not even the interpreter's exit frees ``obj``."""
    try:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    except (ImportError, AttributeError, OSError):  # no ctypes: the list's reference holds until exit
        pass
