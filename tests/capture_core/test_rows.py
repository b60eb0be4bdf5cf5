"""Which rows of a buffer group held real tokens at the replay that last read them."""

from __future__ import annotations

from capture_core.rows import RowStatus


def test_each_replay_decides_the_rows_below_its_size_until_a_larger_one_replaces_it() -> None:
    rows = RowStatus()
    assert rows.real_rows(0, 8) == []  # nothing replayed yet: no row held a token
    rows.record(8, 8)
    rows.record(4, 2)
    assert rows.real_rows(0, 8) == [0, 1, 4, 5, 6, 7]  # rows 2, 3 were the 4-graph's padding
    assert [entry[0] for entry in rows.entries] == [8, 4]
    rows.record(8, 3)  # a replay of 8 decides every row below 8 again
    assert rows.entries == [[8, 3, None]] and rows.real_rows(0, 8) == [0, 1, 2]


def test_rows_still_holding_tokens_make_the_guard_look_closer_until_settled() -> None:
    rows = RowStatus()
    rows.record(8, 8)
    entry = rows.record(8, 5, still_real=[6])
    assert entry[1] == 9  # no real token count passes the guard's ``real >= high``
    assert rows.real_rows(5, 8) == [6]
    RowStatus.settle(entry, 5, still_real=[])  # the comparison came back: row 6 was rewritten
    assert entry == [8, 5, None] and rows.real_rows(5, 8) == []
    RowStatus.settle(entry, 5, still_real=[5, 7])
    assert rows.real_rows(0, 8) == [0, 1, 2, 3, 4, 5, 7]
