"""Where the host time of one write-through submit goes: `TransferEngine.submit` of a
few-block GPU -> host swap (random GPU blocks and host slots), timed and profiled with
cProfile, the GPU kept busy by a matmul loop as in `bench swap`'s write-through case.

    python3 scripts/writethrough_submit_profile.py [--blocks 4] [--block-kib 2048]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

from kvtier.stats import Direction
from kvtier.transfer import SwapJob, TransferEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    device = torch.device("cuda")
    elements = args.block_kib * 1024 // 2
    gpu = torch.randn((64 * args.blocks, elements), device=device).to(torch.bfloat16)
    host = torch.zeros((64 * args.blocks, elements), dtype=torch.bfloat16, pin_memory=True)
    rng = np.random.default_rng(0)
    mappings = [torch.from_numpy(np.stack([rng.choice(gpu.shape[0], args.blocks, False),
                                           rng.choice(host.shape[0], args.blocks, False)], 1))
                for _ in range(args.steps)]
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    engine = TransferEngine(device, swap_method="auto")
    try:
        def run(profiler: cProfile.Profile | None) -> list[float]:
            times = []
            for mapping in mappings:
                for _ in range(8):
                    a @ a  # the step's GPU work, queued ahead of the copy
                started = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
                engine.submit(SwapJob(Direction.GPU_TO_HOST, gpu, host, mapping))
                if profiler is not None:
                    profiler.disable()
                times.append((time.perf_counter() - started) * 1e6)
                engine.get_finished()
            torch.cuda.synchronize()
            engine.wait_all()
            return times

        run(None)
        times = run(None)
        print(f"submit of {args.blocks} x {args.block_kib} KiB: p50 "
              f"{statistics.median(times):.0f} us, p90 "
              f"{sorted(times)[int(0.9 * len(times))]:.0f} us", flush=True)
        profiler = cProfile.Profile()
        run(profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
