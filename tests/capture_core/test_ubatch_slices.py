"""The micro-batch arithmetic: properties that hold for every step, and clear errors otherwise."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from capture_core.ubatch.slices import (
    UBatchConfig,
    UBatchSlice,
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
)


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """A step that can be micro-batched: request token counts, padded totals, ubatch count."""
    counts = draw(st.lists(st.integers(1, 40), min_size=1, max_size=24))
    num_ubatches = draw(st.integers(1, 4))
    total = sum(counts)
    padded = total + draw(st.integers(0, 64))
    reqs_padded = len(counts) + draw(st.integers(0, 8))
    assume(padded // num_ubatches > 0 and not is_last_ubatch_empty(total, padded, num_ubatches))
    return counts, padded, reqs_padded, num_ubatches


def _owner_requests(counts: list[int]) -> list[int]:
    """For every real token, the index of the request it belongs to."""
    return [req for req, count in enumerate(counts) for _ in range(count)]


@given(steps())
def test_slices_tile_the_tokens_and_only_the_last_is_padded(step: tuple[list[int], int, int, int]) -> None:
    counts, padded, reqs_padded, n = step
    unpadded, padded_slices = maybe_create_ubatch_slices(True, counts, padded, reqs_padded, n)
    assert unpadded is not None and padded_slices is not None
    assert len(unpadded) == len(padded_slices) == n
    # Contiguous, in order, from 0 to the real total (unpadded) and to the padded total (padded).
    for slices, end in ((unpadded, sum(counts)), (padded_slices, padded)):
        assert slices[0].token_slice.start == 0
        for left, right in itertools.pairwise(slices):
            assert left.token_slice.stop == right.token_slice.start
        assert slices[-1].token_slice.stop == end
        assert sum(s.num_tokens for s in slices) == end
    assert padded_slices[:-1] == unpadded[:-1]
    assert padded_slices[-1].request_slice.stop == reqs_padded
    assert padded_slices[-1].token_slice.start == unpadded[-1].token_slice.start
    assert not any(s.is_empty() for s in unpadded)


@given(steps())
def test_split_points_are_at_multiples_of_padded_over_n(step: tuple[list[int], int, int, int]) -> None:
    counts, padded, reqs_padded, n = step
    unpadded, _ = maybe_create_ubatch_slices(True, counts, padded, reqs_padded, n)
    assert unpadded is not None
    stride = padded // n
    assert [s.token_slice.start for s in unpadded] == [stride * i for i in range(n)]
    assert all(s.num_tokens == stride for s in unpadded[:-1])


@given(steps())
def test_request_slices_are_the_requests_owning_the_tokens(step: tuple[list[int], int, int, int]) -> None:
    counts, padded, reqs_padded, n = step
    unpadded, _ = maybe_create_ubatch_slices(True, counts, padded, reqs_padded, n)
    assert unpadded is not None
    owners = _owner_requests(counts)
    for s in unpadded:
        touched = sorted(set(owners[s.token_slice]))
        assert list(range(s.request_slice.start, s.request_slice.stop)) == touched
    # Neighbours share at most one request: the one straddling the split point.
    for left, right in itertools.pairwise(unpadded):
        assert right.request_slice.start in (left.request_slice.stop - 1, left.request_slice.stop)
        straddles = owners[left.token_slice.stop - 1] == owners[right.token_slice.start]
        assert (right.request_slice.start == left.request_slice.stop - 1) == straddles


def test_a_request_straddling_the_split_is_in_both_ubatches() -> None:
    # Requests of 3, 4 and 1 tokens, padded to 8: the split at 4 cuts request 1 after one token.
    unpadded, padded = maybe_create_ubatch_slices(True, [3, 4, 1], 8, 4, 2)
    assert unpadded == [UBatchSlice(slice(0, 2), slice(0, 4)), UBatchSlice(slice(1, 3), slice(4, 8))]
    assert padded == [UBatchSlice(slice(0, 2), slice(0, 4)), UBatchSlice(slice(1, 4), slice(4, 8))]


def test_decode_batch_with_padding_only_pads_the_last_slice() -> None:
    unpadded, padded = maybe_create_ubatch_slices(True, [1] * 6, 8, 8, 2)
    assert [s.as_tuple() for s in unpadded or []] == [(0, 4, 0, 4), (4, 6, 4, 6)]
    assert [s.as_tuple() for s in padded or []] == [(0, 4, 0, 4), (4, 8, 4, 8)]


def test_explicit_split_points() -> None:
    unpadded, _ = maybe_create_ubatch_slices(True, [2, 2, 2, 2], 8, 4, 3, split_point=[3, 5])
    assert [s.as_tuple() for s in unpadded or []] == [(0, 2, 0, 3), (1, 3, 3, 5), (2, 4, 5, 8)]
    stride, _ = maybe_create_ubatch_slices(True, [2, 2, 2, 2], 8, 4, 2, split_point=2)
    assert [s.as_tuple() for s in stride or []] == [(0, 1, 0, 2), (1, 4, 2, 8)]


def test_off_returns_none() -> None:
    assert maybe_create_ubatch_slices(False, [1, 2], 4, 2, 2) == (None, None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 1], 2, 2, 0), "num_ubatches must be an integer >= 1"),
        (([3, 3], 5, 2, 2), r"num_tokens_padded \(5\) is below the real token count \(6\)"),
        (([3, 3], 6, 1, 2), r"num_reqs_padded \(1\) is below the real request count \(2\)"),
        (([3, 0], 6, 2, 2), r"num_scheduled_tokens\[1\] must be an integer >= 1, got 0"),
        (([], 4, 0, 2), "no requests"),
        (([1, 1], 8, 2, 2), "the last ubatch would hold no real token"),
    ],
)
def test_inconsistent_inputs_get_clear_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        maybe_create_ubatch_slices(True, *args)


def test_engines_arrays_of_counts_are_taken_as_integers() -> None:
    # vLLM's model runner passes num_scheduled_tokens as a numpy array, and its padded sizes as numpy
    # or torch integers: the slices are the ones Python integers give, made of Python integers.
    expected = maybe_create_ubatch_slices(True, [3, 1, 4], 8, 3, 2)
    for counts in (np.array([3, 1, 4], dtype=np.int32), np.array([3, 1, 4], dtype=np.int64),
                   torch.tensor([3, 1, 4]), [np.uint8(3), torch.tensor(1), 4]):
        got = maybe_create_ubatch_slices(True, counts, np.int64(8), torch.tensor(3), np.int32(2),
                                         split_point=np.int64(4))
        assert got == expected
        assert all(type(bound) is int for part in got for s in part for bound in s.as_tuple())
    assert maybe_create_ubatch_slices(True, [3, 1, 4], 8, 3, 2, split_point=np.array([4])) == expected
    assert is_last_ubatch_empty(np.int32(3), torch.tensor(8), np.int64(2)) is True
    assert check_ubatch_thresholds(UBatchConfig(enabled=True), np.int32(32), True) is True


@pytest.mark.parametrize(
    "count",
    [True, np.bool_(True), torch.tensor(True), -1, np.int32(-2), torch.tensor(-3), 0, np.int64(0),
     1.0, np.float32(2.0), torch.tensor(2.0), "2", None, torch.tensor([1, 2])],
    ids=repr,
)
def test_a_count_that_is_not_a_positive_integer_is_refused(count: object) -> None:
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[1\] must be an integer >= 1, got "):
        maybe_create_ubatch_slices(True, [4, count], 8, 2, 2)


@pytest.mark.parametrize("bad", [True, np.bool_(False), -1, 2.0, np.float64(8.0), torch.tensor(8.5)],
                         ids=repr)
def test_padded_sizes_and_ubatch_counts_refuse_bools_negatives_and_floats(bad: object) -> None:
    for args, name in (((bad, 2, 2), "num_tokens_padded"), ((8, bad, 2), "num_reqs_padded"),
                       ((8, 2, bad), "num_ubatches")):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            maybe_create_ubatch_slices(True, [4, 4], *args)
    with pytest.raises(ValueError, match="strictly increasing positive integers"):
        maybe_create_ubatch_slices(True, [4, 4], 8, 2, 2, split_point=[bad])


@pytest.mark.parametrize(
    ("split_point", "message"),
    [([4, 2], "strictly increasing"), ([2], "need 2 split points"), (0, "stride must be positive")],
)
def test_bad_split_points_are_rejected(split_point: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        maybe_create_ubatch_slices(True, [2, 2, 2, 2], 8, 4, 3, split_point=split_point)  # type: ignore[arg-type]


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 8))
def test_last_ubatch_empty_matches_the_slicing(orig: int, extra: int, n: int) -> None:
    padded = orig + extra
    empty = is_last_ubatch_empty(orig, padded, n)
    assert empty == ((padded // n) * (n - 1) >= orig)
    if orig > 0:
        if padded // n == 0:  # fewer padded tokens than ubatches: the first ubatch would be empty
            with pytest.raises(ValueError, match="stride must be positive"):
                maybe_create_ubatch_slices(True, [1] * orig, padded, orig, n)
        elif empty:
            with pytest.raises(ValueError, match="last ubatch would hold no real token"):
                maybe_create_ubatch_slices(True, [1] * orig, padded, orig, n)
        else:
            unpadded, _ = maybe_create_ubatch_slices(True, [1] * orig, padded, orig, n)
            assert unpadded is not None and unpadded[-1].num_tokens > 0


def test_is_last_ubatch_empty_rejects_inconsistent_totals() -> None:
    with pytest.raises(ValueError, match="orig_num_tokens <= padded_num_tokens"):
        is_last_ubatch_empty(9, 8, 2)
    with pytest.raises(ValueError, match="num_ubatches"):
        is_last_ubatch_empty(4, 8, 0)


def test_ubatch_slice_basics_and_validation() -> None:
    s = UBatchSlice(slice(2, 5), slice(10, 16))
    assert (s.num_reqs, s.num_tokens, s.is_empty()) == (3, 6, False)
    assert UBatchSlice(slice(2, 2), slice(10, 16)).is_empty()
    assert UBatchSlice(slice(2, 3), slice(10, 10)).is_empty()
    assert len({s, UBatchSlice(slice(2, 5), slice(10, 16))}) == 1
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        UBatchSlice(slice(3, 2), slice(0, 1))
    with pytest.raises(ValueError, match="step 1"):
        UBatchSlice(slice(0, 4, 2), slice(0, 1))
    with pytest.raises(ValueError, match="integer start and stop"):
        UBatchSlice(slice(None, 4), slice(0, 1))


@given(st.booleans(), st.integers(0, 2000), st.booleans(), st.integers(0, 100), st.integers(0, 1000))
def test_thresholds(enabled: bool, num_tokens: int, uniform: bool, decode_t: int, prefill_t: int) -> None:
    config = UBatchConfig(enabled, 2, decode_t, prefill_t)
    expected = enabled and num_tokens >= (decode_t if uniform else prefill_t)
    assert check_ubatch_thresholds(config, num_tokens, uniform) == expected
    assert config.effective_num_ubatches == (2 if enabled else 1)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_ubatches must be >= 1"):
        UBatchConfig(True, 0)
    with pytest.raises(ValueError, match="thresholds must be >= 0"):
        UBatchConfig(True, 2, -1)
