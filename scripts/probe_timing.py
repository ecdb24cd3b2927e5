"""What the GPU probe scripts share: host time of a launch while the GPU is busy, and the
lines of the table they print at the end."""

from __future__ import annotations

import time

import torch


class Notes(list):
    """Lines printed as they come and kept for the closing table."""

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.append(line)


def host_us(fn, calls: int = 50, busy_cycles: int = 50_000_000) -> float:
    """Python time (us) of one call of `fn` while the GPU is busy (`busy_cycles` of sleep
    queued ahead, so the launch queue never blocks)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(busy_cycles)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6
