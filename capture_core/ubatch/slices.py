"""The arithmetic of micro-batching: where a step is split, and whether it is worth splitting.

Everything here is a pure function of integers so it can be property-tested without a GPU. A step
of flattened tokens (vLLM style: request 0's tokens, then request 1's, ...) is cut into
``num_ubatches`` micro-batches at fixed token offsets. Cutting by tokens, not requests, keeps every
micro-batch the same shape (so one graph serves them all), at the price that a request may straddle
two micro-batches. Only the last micro-batch absorbs the padding up to the captured size.

Engines hold these counts in arrays (vLLM passes ``num_scheduled_tokens`` as a numpy array), so an
integer of any integral type is taken: Python's, numpy's, a 0-d integer tensor; a bool, a float or
a negative count is refused with the argument's name.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class UBatchSlice:
    """One micro-batch: the requests it touches and the tokens it owns (half-open ranges).

    ``request_slice`` covers every request with at least one token in ``token_slice``; a request
    that straddles a split point appears in both neighbours' request slices.
    """

    request_slice: slice
    token_slice: slice

    def __post_init__(self) -> None:
        for name in ("request_slice", "token_slice"):
            part = getattr(self, name)
            if not isinstance(part, slice) or part.step not in (None, 1):
                raise ValueError(f"{name} must be a slice with step 1, got {part!r}")
            if not (isinstance(part.start, int) and isinstance(part.stop, int)):
                raise ValueError(f"{name} needs integer start and stop, got {part!r}")
            if not 0 <= part.start <= part.stop:
                raise ValueError(f"{name} must satisfy 0 <= start <= stop, got {part!r}")

    def is_empty(self) -> bool:
        """True when the micro-batch has no requests or no tokens: running it would do nothing."""
        return (
            self.request_slice.start == self.request_slice.stop
            or self.token_slice.start == self.token_slice.stop
        )

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(request start, request stop, token start, token stop): the form events and records use."""
        requests, tokens = self.request_slice, self.token_slice
        return (requests.start, requests.stop, tokens.start, tokens.stop)

    def __hash__(self) -> int:
        # slice objects are unhashable before Python 3.12; hash the four integers instead.
        return hash(self.as_tuple())


UBatchSlices = list[UBatchSlice]


@dataclass(frozen=True)
class UBatchConfig:
    """When to micro-batch. Off by default: it only pays when there is communication to hide.

    The thresholds are vLLM's defaults: a uniform-decode step is split from 32 tokens on, a mixed
    (prefill) step from 512.
    """

    enabled: bool = False
    num_ubatches: int = 2
    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512

    def __post_init__(self) -> None:
        if self.num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {self.num_ubatches}")
        if self.decode_token_threshold < 0 or self.prefill_token_threshold < 0:
            raise ValueError(
                "ubatch token thresholds must be >= 0, got "
                f"decode={self.decode_token_threshold}, prefill={self.prefill_token_threshold}"
            )

    @property
    def effective_num_ubatches(self) -> int:
        """How many micro-batches a step is split into; 1 when micro-batching is off."""
        return self.num_ubatches if self.enabled else 1


def check_ubatch_thresholds(config: UBatchConfig, num_tokens: int, uniform_decode: bool) -> bool:
    """Whether a step of ``num_tokens`` is big enough to be worth splitting (False when off)."""
    if not config.enabled:
        return False
    num_tokens = _integer(num_tokens, "num_tokens", minimum=0)
    if uniform_decode:
        return num_tokens >= config.decode_token_threshold
    return num_tokens >= config.prefill_token_threshold


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """True when the real tokens end before the last split point, leaving the last ubatch only padding.

    Splits fall at multiples of ``padded_num_tokens // num_ubatches``; a last micro-batch with no
    real token would run a graph on pure padding, so callers abort micro-batching instead.
    """
    num_ubatches = _integer(num_ubatches, "num_ubatches", minimum=1)
    orig_num_tokens = _integer(orig_num_tokens, "orig_num_tokens", minimum=0)
    padded_num_tokens = _integer(padded_num_tokens, "padded_num_tokens", minimum=0)
    if padded_num_tokens < orig_num_tokens:
        raise ValueError(
            f"need 0 <= orig_num_tokens <= padded_num_tokens, got {orig_num_tokens} and {padded_num_tokens}"
        )
    return (padded_num_tokens // num_ubatches) * (num_ubatches - 1) >= orig_num_tokens


def maybe_create_ubatch_slices(
    should_ubatch: bool,
    num_scheduled_tokens: Sequence[int],
    num_tokens_padded: int,
    num_reqs_padded: int,
    num_ubatches: int,
    split_point: int | Sequence[int] | None = None,
) -> tuple[UBatchSlices | None, UBatchSlices | None]:
    """Split a step into micro-batches: ``(unpadded, padded)`` slices, or ``(None, None)`` when off.

    ``num_scheduled_tokens[i]`` is request ``i``'s token count. Split points default to multiples
    of ``num_tokens_padded // num_ubatches``; an int gives the stride, a sequence the explicit
    ``num_ubatches - 1`` points. The unpadded slices cover the real tokens and requests; the padded
    ones are the same except that the last is stretched to ``num_tokens_padded`` tokens and
    ``num_reqs_padded`` requests, which is the shape the graph is captured at.
    """
    if not should_ubatch:
        return None, None
    num_ubatches = _integer(num_ubatches, "num_ubatches", minimum=1)
    counts = [_integer(count, f"num_scheduled_tokens[{index}]", minimum=1)
              for index, count in enumerate(num_scheduled_tokens)]
    num_tokens_padded = _integer(num_tokens_padded, "num_tokens_padded", minimum=0)
    num_reqs_padded = _integer(num_reqs_padded, "num_reqs_padded", minimum=0)
    if not counts:
        raise ValueError("cannot micro-batch a step with no requests")
    num_tokens = sum(counts)
    if num_tokens_padded < num_tokens:
        raise ValueError(
            f"num_tokens_padded ({num_tokens_padded}) is below the real token count ({num_tokens})"
        )
    if num_reqs_padded < len(counts):
        raise ValueError(
            f"num_reqs_padded ({num_reqs_padded}) is below the real request count ({len(counts)})"
        )

    points = _split_points(split_point, num_tokens_padded, num_ubatches)
    if points and points[-1] >= num_tokens:
        raise ValueError(
            f"the last ubatch would hold no real token: split points {points} but only {num_tokens} "
            "real tokens (check is_last_ubatch_empty before micro-batching)"
        )

    # cu[i] is the first token of request i; cu[-1] the total.
    cu = [0, *itertools.accumulate(counts)]
    slices: UBatchSlices = []
    start = 0
    for stop in [*points, num_tokens]:
        # The request holding token `start`, through the last request with a token before `stop`.
        first_req = bisect.bisect_right(cu, start) - 1
        stop_req = bisect.bisect_left(cu, stop)
        slices.append(UBatchSlice(slice(first_req, stop_req), slice(start, stop)))
        start = stop

    last = slices[-1]
    padded_last = UBatchSlice(
        slice(last.request_slice.start, num_reqs_padded), slice(last.token_slice.start, num_tokens_padded)
    )
    return slices, [*slices[:-1], padded_last]


def _split_points(
    split_point: int | Sequence[int] | None, num_tokens_padded: int, num_ubatches: int
) -> list[int]:
    if split_point is None:
        split_point = num_tokens_padded // num_ubatches
    if _is_integer(split_point):
        split_point = operator.index(split_point)
        if split_point <= 0 and num_ubatches > 1:
            raise ValueError(
                f"split point stride must be positive, got {split_point} "
                f"({num_tokens_padded} padded tokens cannot make {num_ubatches} ubatches)"
            )
        points = [split_point * i for i in range(1, num_ubatches)]
    else:
        given = list(split_point)
        if len(given) != num_ubatches - 1:
            raise ValueError(f"{num_ubatches} ubatches need {num_ubatches - 1} split points, got {given}")
        if not all(_is_integer(point) for point in given):
            raise ValueError(f"split points must be strictly increasing positive integers, got {given}")
        points = [operator.index(point) for point in given]
    previous = 0
    for point in points:
        if point <= previous:
            raise ValueError(f"split points must be strictly increasing positive integers, got {points}")
        previous = point
    return points


def _is_integer(value: Any) -> bool:
    """An integral value that is not a bool: a Python or numpy integer, a 0-d integer tensor."""
    if isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not (value.dtype.is_floating_point or value.dtype.is_complex
                                        or value.dtype == torch.bool)
    try:
        operator.index(value)  # numpy's bool and floats have no __index__
    except TypeError:
        return False
    return True


def _integer(value: Any, name: str, minimum: int) -> int:
    """``value`` as an ``int`` at least ``minimum``; ValueError naming ``name`` otherwise."""
    if not _is_integer(value) or operator.index(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return operator.index(value)
