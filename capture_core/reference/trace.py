"""Real traffic: the Azure LLM conversation trace (or your own CSV in its format), read and checked.

A graph cache is judged by the batch sizes it meets; this module reads the arrivals and the prompt
and answer lengths of a real serving trace (see ``data/README.md``), refusing a malformed file with
the line that is wrong. Standard library only.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_TRACE_PATH = Path(__file__).resolve().parent / "data" / "azure_conv_2023.csv"
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MIN_PERIOD_S = 1.0


class TraceError(ValueError):
    """The trace file is missing or malformed; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: when it arrived and how long its prompt and its answer were."""

    arrival_s: float
    """Seconds since the trace's first arrival."""
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Trace:
    """A request trace sorted by arrival time."""

    requests: tuple[TraceRequest, ...]
    source: str

    def __post_init__(self) -> None:
        if not self.requests:
            raise TraceError(f"{self.source}: the trace has no requests")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def period_s(self) -> float:
        """The length of one pass, for replaying the trace in a loop.

        The last arrival plus one mean inter-arrival gap, so the wrap from the last request back to
        the first is spaced like the rest of the trace; at least ``MIN_PERIOD_S``, so that a trace
        squeezed into an instant is not replayed infinitely often within one step.
        """
        last = self.requests[-1].arrival_s
        gap = last / (len(self.requests) - 1) if len(self.requests) > 1 else 0.0
        return max(last + gap, MIN_PERIOD_S)


def _parse_timestamp(text: str) -> float:
    """Seconds (UTC epoch) of ``YYYY-MM-DD HH:MM:SS[.fffffff]``: the trace has 7 fractional digits,
    more than ``datetime`` parses before Python 3.11, so the fraction is read separately."""
    base, _, fraction = text.strip().partition(".")
    if len(base) != 19:  # fromisoformat would also take other ISO forms; the trace has only this one
        raise ValueError(f"bad timestamp {text!r}")
    moment = datetime.fromisoformat(base).replace(tzinfo=timezone.utc)  # no DST jumps in the arithmetic
    if fraction and not fraction.isdigit():
        raise ValueError(f"bad fractional seconds {fraction!r}")
    return moment.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def load_trace(path: str | os.PathLike[str] | None = None) -> Trace:
    """Read a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV (the packaged Azure trace by default).

    Raises ``TraceError`` with the file and line for a missing file, a wrong header, a bad
    timestamp or a token count that is not a positive integer. Rows are sorted by arrival.
    """
    source = Path(path) if path is not None else DEFAULT_TRACE_PATH
    try:
        handle = source.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{source}: trace file not found") from None
    except OSError as exc:
        raise TraceError(f"{source}: cannot read the trace: {exc.strerror or exc}") from None
    rows: list[tuple[float, int, int]] = []
    with handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{source}: the trace file is empty")
            if tuple(col.strip() for col in header) != TRACE_COLUMNS:
                expected = ",".join(TRACE_COLUMNS)
                raise TraceError(f"{source}: line 1: expected the header {expected}, got {header}")
            for row in reader:
                if not row or all(not cell.strip() for cell in row):
                    continue
                rows.append(_parse_row(source, reader.line_num, row))
        except UnicodeDecodeError:
            raise TraceError(f"{source}: not a text CSV file") from None
        except csv.Error as exc:
            raise TraceError(f"{source}: line {reader.line_num}: {exc}") from None
    if not rows:
        raise TraceError(f"{source}: the trace has a header but no requests")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    requests = tuple(TraceRequest(t - start, ctx, gen) for t, ctx, gen in rows)
    return Trace(requests, str(source))


def _parse_row(source: Path, line: int, row: list[str]) -> tuple[float, int, int]:
    if len(row) != len(TRACE_COLUMNS):
        raise TraceError(f"{source}: line {line}: expected {len(TRACE_COLUMNS)} fields, got {len(row)}")
    try:
        arrival = _parse_timestamp(row[0])
    except ValueError:
        raise TraceError(f"{source}: line {line}: bad TIMESTAMP {row[0]!r}") from None
    counts = []
    for name, cell in zip(TRACE_COLUMNS[1:], row[1:], strict=True):
        try:
            value = int(cell)
        except ValueError:
            raise TraceError(f"{source}: line {line}: {name} must be an integer, got {cell!r}") from None
        if value <= 0:
            raise TraceError(f"{source}: line {line}: {name} must be positive, got {value}")
        counts.append(value)
    return arrival, counts[0], counts[1]

