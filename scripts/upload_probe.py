"""Does a step's input upload wait behind a restore's host -> GPU copies on another stream?

The engine uploads each step's inputs (token ids, positions, block tables, slot mapping)
with `tensor.to(device, non_blocking=True)` on the compute stream: copy-engine transfers.
A host-tier restore queues its blocks' copies on a copy stream. If the copy engines take
them in order, a step launched after a restore was issued cannot start before the
restore's bytes have passed, even when it does not read them. This probe issues a bulk
host -> GPU copy on a side stream, then on the compute stream uploads a small input and
runs a matmul loop that reads it, and reports when that loop ends: uploaded with `.to`
(copy engines), and with `kernels.load_from_host` (the SMs, through unified addressing),
against the loop alone and the bulk copy alone.

    python3 scripts/upload_probe.py [--bulk-mib 4096] [--tries 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from kvtier.kernels import load_from_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk-mib", type=int, default=4096)
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    bulk_src = torch.empty(args.bulk_mib << 20, dtype=torch.uint8, pin_memory=True)
    bulk_dst = torch.empty(args.bulk_mib << 20, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    host_input = torch.arange(4096, dtype=torch.int64).pin_memory()  # a step's token ids
    device_input = torch.empty(4096, dtype=torch.int64, device="cuda")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def loop(tokens: torch.Tensor) -> None:  # ~a prefill step's matmuls, reading the input
        y = x + tokens[:1].to(x.dtype)
        for _ in range(20):
            y = y @ x

    def by_copy_engine() -> None:
        loop(host_input.to("cuda", non_blocking=True))

    def by_sms() -> None:
        load_from_host(host_input, device_input)
        loop(device_input)

    def timed(work, with_bulk: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        start, bulk_done, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        side.wait_event(start)
        if with_bulk:
            with torch.cuda.stream(side):
                bulk_dst.copy_(bulk_src, non_blocking=True)
        bulk_done.record(side)
        work()
        done.record()
        torch.cuda.synchronize()
        return start.elapsed_time(done), start.elapsed_time(bulk_done)

    by_copy_engine()
    by_sms()
    rows = {}
    for name, work, with_bulk in (("loop alone", by_copy_engine, False),
                                  ("bulk alone", lambda: None, True),
                                  ("loop, input by copy engine, beside the bulk copy",
                                   by_copy_engine, True),
                                  ("loop, input read by the SMs, beside the bulk copy",
                                   by_sms, True)):
        ends, bulks = zip(*(timed(work, with_bulk) for _ in range(args.tries)))
        rows[name] = (statistics.median(ends), statistics.median(bulks))
        print(f"{name}: loop ends at {rows[name][0]:.1f} ms, bulk copy ends at "
              f"{rows[name][1]:.1f} ms (medians of {args.tries})", flush=True)


if __name__ == "__main__":
    main()
