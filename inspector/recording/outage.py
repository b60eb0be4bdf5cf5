"""A recorder's trouble with its database: when to try again, what went wrong, and when to give up.

A database that cannot take a write now (locked, unwritable, gone with its folder) is retried with
backoff, from ``FIRST_BACKOFF_S`` doubling to ``MAX_BACKOFF_S``; a corrupt one is refused: it is
left untouched and never written again. The first failure of an outage is logged, and so is the
write that ends it; ``last_error`` says in a line what the latest failure was.
"""

from __future__ import annotations

import logging
import sqlite3

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError

from inspector.errors import DatabaseError
from inspector.storage.store import StoreCorrupt, StoreUnavailable, translate_error

log = logging.getLogger("graph_inspector.recorder")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class Outage:
    """The state of one recorder's database, as its flush thread found it (``url`` names it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.failures = 0
        """Failed attempts since the last write that committed (0: the database is fine)."""
        self.retry_at = 0.0
        """When (``time.monotonic()``) to try again, while ``failures``."""
        self.refused: str | None = None
        """Why this database is never written again (it is corrupt), once it is."""
        self.last_error: str | None = None

    def failed(self, error: BaseException, now: float) -> None:
        """An attempt failed with ``error``: back off, log the first failure, refuse a corrupt file."""
        if isinstance(error, (DBAPIError, sqlite3.Error)):
            error = translate_error(error, self.url)
        self.failures += 1
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self.failures - 1))
        self.retry_at = now + backoff
        self.last_error = first_line(error)
        if isinstance(error, StoreCorrupt):
            self._refuse(error)
        elif self.failures == 1:
            log.warning(
                "graph-inspector recorder: cannot write %s (%s); retrying with backoff",
                self.url,
                self.last_error,
            )
        if isinstance(error, DatabaseError) and not isinstance(error, (StoreUnavailable, StoreCorrupt)):
            log.error("graph-inspector recorder: %s", error)

    def committed(self, display_url: str) -> None:
        """A write committed: whatever the trouble was, it is over."""
        if self.failures:
            log.warning("graph-inspector recorder: %s is writable again", display_url)
        self.failures = 0
        self.last_error = None

    @property
    def trouble(self) -> str:
        """Why nothing is written, in a few words for the lines that count losses."""
        return "the database is corrupt" if self.refused else f"database unavailable: {self.last_error}"

    def _refuse(self, error: StoreCorrupt) -> None:
        if self.refused is None:
            self.refused = str(error)
            log.error("graph-inspector recorder: %s; nothing more is written to it, and every event is "
                      "counted as dropped", error)


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def refused_as_it_is(error: BaseException) -> bool:
    """The database refused a value in the batch (it would refuse it again), rather than being
    unable to take any write now."""
    if isinstance(error, (DataError, IntegrityError)):
        return True
    return not isinstance(error, (SQLAlchemyError, DatabaseError, OSError, sqlite3.Error))
