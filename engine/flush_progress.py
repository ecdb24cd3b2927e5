"""What closing an engine says on stderr while it writes its pending blocks to the disk tier."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvtier.manager import FlushReport

#: Seconds between two progress lines.
PROGRESS_EVERY_S = 1.0


class FlushProgressLine:
    """A `kvtier.manager.FlushProgress` callback that prints a line every
    `PROGRESS_EVERY_S` while blocks remain (a flush done sooner says nothing), and `done`
    the outcome: blocks left unwritten always, the blocks written once it spoke."""

    def __init__(self, timeout_s: float, out: TextIO | None = None,
                 every_s: float = PROGRESS_EVERY_S) -> None:
        self.timeout_s, self.every_s = timeout_s, every_s
        self.out = out if out is not None else sys.stderr
        self._began = time.monotonic()
        self._last = self._began
        self._spoke = False

    def __call__(self, num_written: int, num_left: int) -> None:
        now = time.monotonic()
        if num_left == 0 or now - self._last < self.every_s:
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
