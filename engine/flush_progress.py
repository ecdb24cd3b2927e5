"""What closing an engine says on stderr while it writes its pending blocks to the disk tier."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvtier.manager import FlushReport

#: Seconds between two progress lines.
PROGRESS_EVERY_S = 1.0


class FlushProgressLine:
    """A `kvtier.manager.FlushProgress` callback that prints a line at most every
    `PROGRESS_EVERY_S` while blocks remain, and `done` the outcome (nothing when there was
    nothing to write)."""

    def __init__(self, timeout_s: float, out: TextIO | None = None) -> None:
        self.timeout_s = timeout_s
        self.out = out if out is not None else sys.stderr
        self._began = time.monotonic()
        self._last: float | None = None
        self._spoke = False

    def __call__(self, num_written: int, num_left: int) -> None:
        now = time.monotonic()
        if num_left == 0 or (self._last is not None and now - self._last < PROGRESS_EVERY_S):
            return
        self._last, self._spoke = now, True
        left_s = max(0.0, self.timeout_s - (now - self._began))
        print(f"kvtier: writing {num_left:,} KV blocks to the disk tier before closing "
              f"({num_written:,} written so far, at most {left_s:.0f} s left)",
              file=self.out, flush=True)

    def done(self, report: FlushReport) -> None:
        if report.num_unwritten:
            print(f"kvtier: closed with {report.num_unwritten:,} KV blocks not written to the "
                  f"disk tier ({report.num_written:,} written in {report.seconds:.1f} s; "
                  "raise flush_timeout_s to keep them)", file=self.out, flush=True)
        elif self._spoke:
            print(f"kvtier: {report.num_written:,} KV blocks written to the disk tier in "
                  f"{report.seconds:.1f} s", file=self.out, flush=True)
