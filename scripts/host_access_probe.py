"""Do the SMs' loads and stores to pinned host memory wait behind copy-engine transfers?

`kernels.load_from_host` and `store_to_host` move a step's small values through unified
addressing so that they never queue behind a restore's or a write-through's bulk copies on
another stream. This probe measures that on the machine it runs on: a 1 GiB bulk copy in
each direction on a side stream, issued as one copy or as 2 MiB copies (as the tiers issue
blocks), and on the main stream, once the bulk copy is running, 16 values moved each way:
by the kernel and by a plain `copy_`. Printed: ms from the main stream's start to the small
move's end, against the bulk copy's own ms. Medians of 5.

    python3 scripts/host_access_probe.py
"""

from __future__ import annotations

import statistics

import torch
from kvtier.kernels import load_from_host, store_to_host

BULK = 1 << 30
CHUNK = 2 << 20


def main() -> None:
    host_big = torch.empty(BULK, dtype=torch.uint8, pin_memory=True)
    gpu_big = torch.empty(BULK, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    host_small = torch.arange(16).pin_memory()
    gpu_small = torch.arange(16, device="cuda")
    load_from_host(host_small, gpu_small)
    store_to_host(gpu_small, host_small)
    torch.cuda.synchronize()
    print(torch.cuda.get_device_name(), flush=True)

    def bulk(to_gpu: bool, chunked: bool) -> None:
        src, dst = (host_big, gpu_big) if to_gpu else (gpu_big, host_big)
        step = CHUNK if chunked else BULK
        for start in range(0, BULK, step):
            dst[start:start + step].copy_(src[start:start + step], non_blocking=True)

    small = {
        "load_from_host (SMs)": (True, lambda: load_from_host(host_small, gpu_small)),
        "copy_ host -> GPU": (True, lambda: gpu_small.copy_(host_small, non_blocking=True)),
        "store_to_host (SMs)": (False, lambda: store_to_host(gpu_small, host_small)),
        "copy_ GPU -> host": (False, lambda: host_small.copy_(gpu_small, non_blocking=True)),
    }
    for chunked in (False, True):
        for label, (to_gpu, move) in small.items():
            took, bulk_took = [], []
            for _ in range(5):
                torch.cuda.synchronize()
                start, moved, bulk_done = (torch.cuda.Event(enable_timing=True)
                                           for _ in range(3))
                start.record()
                side.wait_event(start)
                with torch.cuda.stream(side):
                    bulk(to_gpu, chunked)
                    bulk_done.record(side)
                torch.cuda._sleep(1_000_000)  # let the bulk copy get going first
                move()
                moved.record()
                torch.cuda.synchronize()
                took.append(start.elapsed_time(moved))
                bulk_took.append(start.elapsed_time(bulk_done))
            print(f"bulk {'host -> GPU' if to_gpu else 'GPU -> host'} as "
                  f"{'2 MiB copies' if chunked else 'one copy'}: {label} done at "
                  f"{statistics.median(took):.2f} ms, bulk at "
                  f"{statistics.median(bulk_took):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
