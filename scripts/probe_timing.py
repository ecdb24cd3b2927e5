"""What the GPU probe scripts share: host time of a launch while the GPU is busy, GPU time of
a call on an idle GPU, the buffers of the swap probes, and the lines of the table they
print at the end."""

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


def gpu_ms(run) -> float:
    """GPU ms of `run()` on the current stream, from an idle GPU to its last queued work."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def swap_buffers(num_bytes: int) -> tuple[torch.Tensor, ...]:
    """(GPU source, pinned host source, GPU destination, pinned host destination), uint8
    [num_bytes] each, the sources random: what the swap probes copy between."""
    return (torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda"),
            torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).pin_memory(),
            torch.empty(num_bytes, dtype=torch.uint8, device="cuda"),
            torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True))
