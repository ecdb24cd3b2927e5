"""How long reading a few values back from the GPU takes while a bulk device-to-host copy
runs on another stream: `copy_` into pinned memory and `.tolist()` (copy engines) against
`kernels.store_to_host` (the SMs' stores through unified addressing).

    python3 scripts/readback_probe.py [--bulk-mib 1024] [--tries 5]

Prints each way's wall times (ms) from issuing the read-back to having the values.
"""

from __future__ import annotations

import argparse
import time

import torch
from kvtier.kernels import store_to_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk-mib", type=int, default=1024)
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    bulk_src = torch.empty(args.bulk_mib << 20, dtype=torch.uint8, device="cuda")
    bulk_dst = torch.empty(args.bulk_mib << 20, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    ids = torch.arange(16, device="cuda")  # [16] int64, a step's sampled ids
    host = torch.empty(16, dtype=torch.int64, pin_memory=True)
    store_to_host(ids, host)  # compiled before timing
    ways = {
        "copy_ into pinned": lambda: (host.copy_(ids, non_blocking=True),
                                      torch.cuda.current_stream().synchronize()),
        "tolist": ids.tolist,
        "store_to_host": lambda: (store_to_host(ids, host),
                                  torch.cuda.current_stream().synchronize()),
    }
    for name, read_back in ways.items():
        times = []
        for _ in range(args.tries):
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                bulk_dst.copy_(bulk_src, non_blocking=True)
            started = time.perf_counter()
            read_back()
            times.append((time.perf_counter() - started) * 1e3)
            torch.cuda.synchronize()
        print(f"read-back beside a {args.bulk_mib} MiB device-to-host copy, {name}: ms "
              + " ".join(f"{t:.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
