"""Where the host time of a swap call goes (cProfile), on a GPU machine.

    python scripts/swap_profile.py > profile.log

For a 4-block write-through submit through the transfer engine and 1,000-block swaps
(random host slots, and host slots in runs of 16) per method: the median host ms per call,
then the functions with the most own time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
from kvtier.kernels import swap_blocks

from kvtier.stats import Direction
from kvtier.transfer import SwapJob, TransferEngine

BLOCK = 256 << 10
NUM = 4096


def rows(count: int, run: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.permutation(NUM // run) * run
    host = (starts[:, None] + np.arange(run)).reshape(-1)[:count]
    return torch.from_numpy(np.stack([rng.permutation(NUM)[:count], host], 1))


def profile(name: str, call, calls: int = 20) -> None:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    prof, times = cProfile.Profile(), []
    for _ in range(calls):
        torch.cuda.synchronize()
        started = time.perf_counter()
        prof.enable()
        call()
        prof.disable()
        times.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    print(f"== {name}: median {statistics.median(times):.3f} ms per call "
          f"(min {min(times):.3f})", flush=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
    print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))


def main() -> None:
    gpu = torch.empty((NUM, BLOCK // 2), dtype=torch.bfloat16, device="cuda")
    host = torch.empty((NUM, BLOCK // 2), dtype=torch.bfloat16, pin_memory=True)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    engine = TransferEngine("cuda")
    few = rows(4, 1, rng)
    profile("engine.submit, 4 blocks GPU->host",
            lambda: engine.submit(SwapJob(Direction.GPU_TO_HOST, gpu, host, few)), 200)
    profile("swap_blocks auto, 4 blocks GPU->host",
            lambda: swap_blocks(gpu, host, few, "auto", stream), 200)
    for label, run in (("random host slots", 1), ("host runs of 16", 16)):
        mapping = rows(1000, run, rng)
        back = mapping.flip(1).contiguous()
        for method in ("auto", "dma", "staged"):
            profile(f"{method}, 1000 blocks GPU->host, {label}",
                    lambda m=method, r=mapping: swap_blocks(gpu, host, r, m, stream))
            profile(f"{method}, 1000 blocks host->GPU, {label}",
                    lambda m=method, r=back: swap_blocks(host, gpu, r, m, stream))
    engine.close()


if __name__ == "__main__":
    main()
