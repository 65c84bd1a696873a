"""Progress bars in a log file are lines, not carriage-return redraws."""

from __future__ import annotations

import time

from coarse2fine import progress as progress_module
from coarse2fine.progress import progress


def test_off_a_terminal_the_bar_is_a_few_whole_lines(capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_SECONDS", 0.05)
    for _ in progress(range(4), total=4, desc="write", unit="img"):
        time.sleep(0.06)
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert lines[0].startswith("write:   0%") and lines[-1].startswith("write: 100%")
    assert all(line.startswith("write:") for line in lines)
    assert 2 < len(lines) <= 6  # the start, a redraw per interval, the end: not one per step forever


def test_a_cleared_bar_leaves_no_blank_lines(capsys):
    for _ in progress(range(3), total=3, desc="epoch", leave=False):
        pass
    assert all(line.strip() for line in capsys.readouterr().err.splitlines())
