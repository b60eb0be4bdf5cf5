"""The capture progress bar: redraws on a terminal, one line per item in logs."""

from __future__ import annotations

import io

from capture_core.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_logs_it_writes_one_line_per_item():
    stream = io.StringIO()
    bar = ProgressBar(4, stream=stream)
    for n in (8, 4, 2, 1):
        bar.advance(f"FULL tokens={n}")
    assert stream.getvalue().splitlines() == [
        "Capturing graphs [#####...............] 1/4 FULL tokens=8",
        "Capturing graphs [##########..........] 2/4 FULL tokens=4",
        "Capturing graphs [###############.....] 3/4 FULL tokens=2",
        "Capturing graphs [####################] 4/4 FULL tokens=1",
    ]


def test_on_a_terminal_it_redraws_one_line_and_ends_it():
    stream = Terminal()
    bar = ProgressBar(2, label="Capturing decode graphs", stream=stream)
    bar.advance("FULL tokens=2")
    bar.advance("FULL tokens=1")
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "Capturing decode graphs [####################] 2/2 FULL tokens=1" in text


def test_a_bar_stopped_early_still_ends_its_line():
    stream = Terminal()
    bar = ProgressBar(3, stream=stream)
    bar.advance()
    bar.close()
    assert stream.getvalue().endswith("\n")


def test_disabled_it_writes_nothing():
    stream = io.StringIO()
    bar = ProgressBar(2, stream=stream, enabled=False)
    bar.advance("x")
    bar.close()
    assert stream.getvalue() == "" and bar.done == 1
