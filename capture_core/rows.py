"""Which rows of a group of per-step token buffers held real tokens at the replay that last read them.

A graph of ``n`` tokens reads the first ``n`` rows of its token buffers; a step with ``r`` real tokens
fills rows ``[0, r)`` and pads rows ``[r, n)``. A padding row that held a real token at the replay
that last read it must be rewritten before the next replay reads it as padding, or it writes that
earlier request's KV slot again. To tell such a row from one that was padding already (which may
keep its pad values), ``RowStatus`` keeps, for the graphs of one group of buffers, a short list of
``[size, high, rows]`` entries, newest last: each decides the rows below its ``size`` that no newer
entry covers. A newer replay of a size at least as large replaces an entry, so sizes fall from the
oldest entry to the newest and the list is at most as long as the list of capture sizes.

An entry reads ``rows [0, high) held real tokens`` while ``rows`` is None. When some padding rows
were found not rewritten (they still hold real tokens: a fault reported every step it lasts), or
while a comparison of them is still on its way back from the device, ``rows`` is the exact set and
``high`` is ``size + 1``: the replay guard's test ``real >= high`` then fails for every step of that
size, so the closer look, which reads ``rows``, decides.
"""

from __future__ import annotations

from collections.abc import Iterable

Entry = list  # [size, high, rows]: a list, so the guard updates ``high`` in place


class RowStatus:
    """The rows that held real tokens at their last replay, for the graphs of one buffer group."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        """Oldest first; the replay guard reads and updates the last one in place."""

    def real_rows(self, start: int, stop: int) -> list[int]:
        """The rows in ``[start, stop)`` that held a real token at the replay that last read them."""
        found: list[int] = []
        covered = 0
        for size, high, rows in reversed(self.entries):
            low, top = max(start, covered), min(stop, size)
            if low < top:
                found += [row for row in range(low, top) if (row < high if rows is None else row in rows)]
            covered = max(covered, size)
            if covered >= stop:
                break
        return found

    def record(self, size: int, real: int, still_real: Iterable[int] = ()) -> Entry:
        """After a replay of ``size`` rows with ``real`` real tokens: its rows are decided by it.
        ``still_real`` are padding rows that still hold real tokens (or may: a comparison on its way)."""
        while self.entries and self.entries[-1][0] <= size:
            self.entries.pop()
        extra = frozenset(still_real)
        entry: Entry = [size, real, None] if not extra else [size, size + 1, frozenset(range(real)) | extra]
        self.entries.append(entry)
        return entry

    @staticmethod
    def settle(entry: Entry, real: int, still_real: Iterable[int]) -> None:
        """A comparison came back: of the rows it was unsure of, ``still_real`` still hold real tokens."""
        extra = frozenset(still_real)
        if extra:
            entry[1], entry[2] = entry[0] + 1, frozenset(range(real)) | extra
        else:
            entry[1], entry[2] = real, None
