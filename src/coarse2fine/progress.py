"""Progress bars: tqdm's on a terminal; in a log (a cluster job's output file, `dvc repro > log`), plain lines.

tqdm redraws its bar with carriage returns, which a log file keeps: one line of tens of kB per epoch. Off a
terminal the bar is written as a line of its own, at most once a minute (and once at the start and the end).
"""

from __future__ import annotations

import io
import sys
from typing import Any, Iterable, TextIO

from tqdm import tqdm

LOG_INTERVAL_SECONDS = 60.0


def progress(iterable: Iterable | None = None, **options: Any) -> tqdm:
    """`tqdm(iterable, **options)` on a terminal; tidy log lines otherwise."""
    if sys.stderr.isatty():
        return tqdm(iterable, **options)
    return tqdm(iterable, file=_Lines(sys.stderr), mininterval=LOG_INTERVAL_SECONDS, ascii=True, **options)


class _Lines(io.TextIOBase):
    """Writes each of tqdm's "\\r<bar>" redraws as one line; drops the blank ones (a cleared bar)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
