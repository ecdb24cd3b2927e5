"""swap_blocks' dma path with and without a short first call, side by side. On the lent GPU:

    python scripts/swap_first_call_ab.py [--total-mib 256] [--block-kib 32,64,128,256,512]
        [--first 0,32]

For each block size, 256 MiB of blocks in random order on both sides: GPU -> host, host ->
GPU and both at once (two calls on two streams from one thread), each as a ratio to the
same bytes moved by one contiguous pinned copy (two on two streams for both ways), with
`kernels.swap_blocks.FIRST_CALL_COPIES` set to each value of --first in turn within every
repeat (so drift in the bus hits all alike). Medians of 9; bytes checked.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import numpy as np
import torch
from probe_timing import gpu_ms, swap_buffers

swap_module = importlib.import_module("kvtier.kernels.swap_blocks")
REPEATS = 9


def swapper(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor):
    return lambda: swap_module.swap_blocks(src, dst, mapping, method="dma")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--block-kib", default="32,64,128,256,512")
    parser.add_argument("--first", default="0,32")
    args = parser.parse_args()
    total = args.total_mib << 20
    gpu_a, host_a, gpu_b, host_b = swap_buffers(total)
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def both(d2h, h2d):
        def run() -> None:
            side.wait_stream(main_stream)
            d2h()
            with torch.cuda.stream(side):
                h2d()
            main_stream.wait_stream(side)
        return run
    ceilings = {
        "d2h": lambda: host_b.copy_(gpu_a, non_blocking=True),
        "h2d": lambda: gpu_b.copy_(host_a, non_blocking=True),
    }
    ceilings["both"] = both(ceilings["d2h"], ceilings["h2d"])
    ceiling_ms = {k: statistics.median(gpu_ms(f) for _ in range(REPEATS))
                  for k, f in ceilings.items()}
    print(f"{torch.cuda.get_device_name()}; ceiling GB/s: " + ", ".join(
        f"{k} {(2 if k == 'both' else 1) * total / 1e6 / ms:.1f}"
        for k, ms in ceiling_ms.items()), flush=True)
    firsts = [int(f) for f in args.first.split(",")]
    rng = np.random.default_rng(0)
    for kib in (int(k) for k in args.block_kib.split(",")):
        bb = kib << 10
        n = total // bb
        mapping = torch.from_numpy(np.stack([rng.permutation(n), rng.permutation(n)], 1))
        ga, ha, gb, hb = (t.view(n, bb) for t in (gpu_a, host_a, gpu_b, host_b))
        d2h = swapper(ga, hb, mapping)
        h2d = swapper(ha, gb, mapping)
        ways = {"d2h": d2h, "h2d": h2d, "both": both(d2h, h2d)}
        times = {(f, w): [] for f in firsts for w in ways}
        for _ in range(REPEATS):
            for first in firsts:
                swap_module.FIRST_CALL_COPIES = first
                for way, run in ways.items():
                    times[(first, way)].append(gpu_ms(run))
        torch.cuda.synchronize()
        ok = torch.equal(hb[mapping[:64, 1]], ga[mapping[:64, 0]].cpu()) and torch.equal(
            gb[mapping[:64, 1]].cpu(), ha[mapping[:64, 0]])
        cells = []
        for first in firsts:
            cells.append(f"first call {first}: " + " / ".join(
                f"{ceiling_ms[w] / statistics.median(times[(first, w)]):.2f}" for w in ways))
        print(f"{kib:5d} KiB ({n} blocks), d2h / h2d / both x ceiling: " + "; ".join(cells)
              + ("" if ok else " BAD BYTES"), flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # batched copies need a non-default stream
        main()
